"""The solvers' local inner products (_kernels/local_dots.py, csrc/local_dots.cc)
against numpy in extended precision: values in every dtype and size class
(one block, several blocks, several threads' chunks), several pairs in one
pass, JVP/VJP/second derivatives against jnp.vdot, vmap, the fallback
lowering, and what the solvers' loops compile to."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from distlinalg.comm import allgather
from distlinalg._kernels.local_dots import local_dots
from distlinalg.solvers._vectors import local_vdot, local_vdots
from vector_reference import DTYPES, SIZES, vector


def exact_vdot(x, y):
    """Σ conj(x)·y in extended precision (the inputs are exact in it)."""
    wide = np.clongdouble if np.iscomplexobj(x) else np.longdouble
    return np.vdot(x.astype(wide), y.astype(wide))


def assert_close_to_exact(value, x, y):
    # float64 accumulation: the error is that of rounding the result to the
    # output dtype plus O(n ε₆₄) of the sum of |x||y|.
    eps = np.finfo(np.result_type(x)).eps
    scale = float(np.sum(np.abs(x.astype(np.complex128)) * np.abs(y.astype(np.complex128))))
    exact = exact_vdot(x, y)
    assert abs(complex(np.asarray(value)) - complex(exact)) <= 2 * eps * abs(complex(exact)) + 1e-14 * scale


@pytest.mark.max_ranks(2)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", SIZES)
def test_values_in_every_dtype_and_size(dtype, n):
    rng = np.random.default_rng(n)
    x, y = vector(rng, n, dtype), vector(rng, n, dtype)
    jitted = jax.jit(lambda x, y: local_dots([(x, y), (x, x), (y, x)]))(x, y)
    eager = local_dots([(x, y), (x, x), (y, x)])
    for values in (jitted, eager):
        assert [v.dtype for v in values] == [np.dtype(dtype)] * 3
        assert all(v.shape == () for v in values)
        assert_close_to_exact(values[0], x, y)
        assert_close_to_exact(values[1], x, x)
        assert_close_to_exact(values[2], y, x)
        # ⟨x, x⟩ is real; ⟨y, x⟩ = conj⟨x, y⟩ to the last bit (same products, same order).
        assert np.imag(values[1]) == 0
        assert values[2] == np.conj(values[0])


@pytest.mark.max_ranks(2)
def test_pairs_of_different_sizes_and_dtypes_in_one_call():
    rng = np.random.default_rng(3)
    pairs = [(vector(rng, 100000, np.float64), vector(rng, 100000, np.float64)),
             (vector(rng, 3, np.complex64), vector(rng, 3, np.complex64)),
             (vector(rng, 70000, np.complex128).reshape(700, 100), vector(rng, 70000, np.complex128).reshape(700, 100)),
             (vector(rng, 0, np.float32), vector(rng, 0, np.float32))]
    values = jax.jit(local_dots)(pairs)
    for value, (x, y) in zip(values, pairs):
        assert value.dtype == x.dtype
        assert_close_to_exact(value, x.ravel(), y.ravel())


@pytest.mark.max_ranks(2)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, np.float16, np.int32], ids=["bfloat16", "float16", "int32"])
def test_other_dtypes_lower_to_jnp(dtype):
    x = jnp.arange(1, 2001).astype(dtype)
    y = (jnp.arange(2000) % 3).astype(dtype)
    (value,) = jax.jit(lambda x, y: local_dots([(x, y)]))(x, y)
    assert value.dtype == x.dtype
    expected = jnp.sum(x * y, dtype=dtype)
    assert value == expected
    hlo = jax.jit(lambda x, y: local_dots([(x, y)])).lower(x, y).as_text()
    assert "distlinalg_local_dots" not in hlo


def test_a_pair_must_match():
    with pytest.raises(ValueError, match="one shape and dtype"):
        local_dots([(jnp.ones(3), jnp.ones(4))])
    with pytest.raises(ValueError, match="one shape and dtype"):
        local_dots([(jnp.ones(3), jnp.ones(3, jnp.float32))])


@pytest.mark.max_ranks(2)
@pytest.mark.parametrize("dtype", [np.float64, np.complex128], ids=["real", "complex"])
def test_derivatives_equal_those_of_vdot(dtype):
    rng = np.random.default_rng(5)
    n = 40000
    x, y, dx, dy = (vector(rng, n, dtype) for _ in range(4))

    def ours(x, y):
        a, b = local_dots([(x, y), (y, y)])
        return a * b

    def reference(x, y):
        return jnp.vdot(x, y) * jnp.vdot(y, y)

    out, tangent = jax.jvp(ours, (x, y), (dx, dy))
    ref_out, ref_tangent = jax.jvp(reference, (x, y), (dx, dy))
    np.testing.assert_allclose(out, ref_out, rtol=1e-11)
    np.testing.assert_allclose(tangent, ref_tangent, rtol=1e-11)
    ct = (1.5 - 0.5j) if np.iscomplexobj(x) else 1.5
    cts = jax.vjp(ours, x, y)[1](jnp.asarray(ct, out.dtype))
    ref_cts = jax.vjp(reference, x, y)[1](jnp.asarray(ct, out.dtype))
    for c, r in zip(cts, ref_cts):
        np.testing.assert_allclose(c, r, rtol=1e-11)
    # One input held fixed (the other symbolic zero) and second order.
    small = [v[:600] for v in (x, y)]
    check_grads(lambda x, y: local_dots([(x, y)])[0], small, order=2, modes=["fwd", "rev"], rtol=1e-4)
    check_grads(lambda x: local_dots([(x, small[1])])[0], small[:1], order=2, modes=["fwd", "rev"], rtol=1e-4)
    check_grads(lambda y: local_dots([(small[0], y)])[0], small[1:], order=2, modes=["fwd", "rev"], rtol=1e-4)


@pytest.mark.max_ranks(2)
def test_vmap_over_either_or_both_vectors():
    rng = np.random.default_rng(7)
    X = vector(rng, 3 * 50000, np.complex128).reshape(3, 50000)
    Y = vector(rng, 50000 * 3, np.complex128).reshape(50000, 3)
    y = Y[:, 0]
    both = jax.vmap(lambda a, b: local_dots([(a, b), (b, b)]), in_axes=(0, 1))(X, Y)
    np.testing.assert_allclose(both[0], [np.vdot(X[i], Y[:, i]) for i in range(3)], rtol=1e-12)
    np.testing.assert_allclose(both[1], [np.vdot(Y[:, i], Y[:, i]) for i in range(3)], rtol=1e-12)
    one = jax.jit(jax.vmap(lambda a: local_dots([(a, y)])[0]))(X)
    np.testing.assert_allclose(one, [np.vdot(X[i], y) for i in range(3)], rtol=1e-12)
    # Nested: a batch of batches.
    nested = jax.vmap(jax.vmap(lambda a: local_dots([(a, a)])[0]))(X.reshape(3, 1, 50000))
    np.testing.assert_allclose(nested[:, 0], np.einsum("ij,ij->i", X.conj(), X), rtol=1e-12)
    # And the gradient of a vmapped dot.
    grads = jax.grad(lambda X: jnp.sum(jax.vmap(lambda a: local_dots([(a, a)])[0])(X).real))(X.real)
    np.testing.assert_allclose(grads, 2 * X.real, rtol=1e-12)


def test_solvers_inner_products_of_pytrees_mix_both_paths(comm):
    """local_vdot sums a pytree's leaves: large ones through the handler, small and
    mixed-dtype ones through jnp.vdot; every rank gets the same bits from the same data."""
    rng = np.random.default_rng(11)
    x = {"big": vector(rng, 60000, np.complex128), "small": vector(rng, 10, np.complex128),
         "real": vector(rng, 5000, np.float64)}
    y = {"big": vector(rng, 60000, np.complex128), "small": vector(rng, 10, np.complex128),
         "real": vector(rng, 5000, np.complex128)}  # real against complex: jnp.vdot
    hlo = jax.jit(local_vdot).lower(x, y).as_text()
    assert hlo.count("distlinalg_local_dots") == 1
    value = jax.jit(local_vdot)(x, y)
    exact = sum(exact_vdot(x[k].astype(np.complex128), y[k]) for k in x)
    assert abs(complex(value) - complex(exact)) <= 1e-13 * abs(complex(exact))
    values = jax.jit(local_vdots)([(x, y), (y, y)])
    assert values[0] == value
    # The replicated layout relies on every rank computing the same bits.
    gathered = np.asarray(allgather(jnp.stack(values), comm=comm))
    assert (gathered == gathered[0]).all()
