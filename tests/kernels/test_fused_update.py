"""One-pass vector updates with inner products (_kernels/fused_update.py,
csrc/fused_update.cc) against numpy: values in every dtype and size class,
outputs built from earlier outputs, many terms, an output written over an
operand that later terms and dots still read, derivatives against the jnp
reference, vmap, the fallback lowering, pytrees through update_and_dots (and
its names), and what a Krylov step compiles to."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from distlinalg.comm import allgather
from distlinalg._kernels.fused_update import fused_update
from distlinalg.solvers._vectors import Dot, Update, update_and_dots
from vector_reference import DTYPES, SIZES, vector


def coefficient(dtype, value):
    return value if np.issubdtype(dtype, np.complexfloating) else value.real


def tolerance(dtype):
    return 2e-5 if np.dtype(dtype) in (np.dtype(np.float32), np.dtype(np.complex64)) else 1e-13


def assert_dot_close(value, a, b, dtype):
    wide = np.clongdouble if np.iscomplexobj(a) else np.longdouble
    exact = complex(np.vdot(a.astype(wide), b.astype(wide)))
    scale = float(np.sum(np.abs(a.astype(np.complex128)) * np.abs(b.astype(np.complex128))))
    assert abs(complex(np.asarray(value)) - exact) <= tolerance(dtype) * (abs(exact) + scale) + 1e-300


def step(x, p, r, q, alpha):
    """CG's step with a third output that uses the first: x + αp, r − αq, 2x' + ½p."""
    return fused_update([[(1.0, x), (alpha, p)], [(1.0, r), (-alpha, q)], [(2.0, 0), (0.5, p)]],
                        dots=[(1, 1), (p, 0), (2, q)])


@pytest.mark.max_ranks(2)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", SIZES)
def test_values_in_every_dtype_and_size(dtype, n):
    rng = np.random.default_rng(n + 1)
    x, p, r, q = (vector(rng, n, dtype) for _ in range(4))
    alpha = coefficient(dtype, 0.3 - 0.2j)
    x_new = x + np.asarray(alpha, dtype) * p
    r_new = r - np.asarray(alpha, dtype) * q
    w_new = 2 * x_new + 0.5 * p
    for (x_out, r_out, w_out), dots in (jax.jit(step)(x, p, r, q, alpha), step(x, p, r, q, alpha)):
        for out, want in ((x_out, x_new), (r_out, r_new), (w_out, w_new)):
            assert out.dtype == np.dtype(dtype) and out.shape == (n,)
            np.testing.assert_allclose(out, want, rtol=tolerance(dtype), atol=tolerance(dtype))
        assert [d.dtype for d in dots] == [np.dtype(dtype)] * 3
        assert_dot_close(dots[0], r_new, r_new, dtype)
        assert_dot_close(dots[1], p, x_new, dtype)
        assert_dot_close(dots[2], w_new, q, dtype)


@pytest.mark.max_ranks(2)
@pytest.mark.parametrize("dtype", [np.float64, np.complex128], ids=["real", "complex"])
@pytest.mark.parametrize("terms", [1, 4, 6, 9])
def test_any_number_of_terms(dtype, terms):
    rng = np.random.default_rng(terms)
    vs = [vector(rng, 40000, dtype) for _ in range(terms)]
    cs = [coefficient(dtype, complex(rng.standard_normal(), rng.standard_normal())) for _ in range(terms)]
    (out,), (norm,) = jax.jit(lambda *vs: fused_update([list(zip(cs, vs))], dots=[(0, 0)]))(*vs)
    want = sum(np.asarray(c, dtype) * v for c, v in zip(cs, vs))
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
    assert_dot_close(norm, want, want, dtype)


@pytest.mark.max_ranks(2)
def test_an_output_written_over_an_operand_that_later_terms_and_dots_read():
    """Inside jit, v is dead after the call, so XLA writes the first new vector
    over v's buffer; the second new vector and the dot still read the old v."""
    rng = np.random.default_rng(2)
    a, p, q = (vector(rng, 70001, np.float64) for _ in range(3))

    def f(a, p, q):
        v = a * 3.0  # an intermediate buffer, dead after the call
        (first, second), (vv, pq) = fused_update([[(1.0, v), (2.0, p)], [(1.0, q), (-1.0, v)]],
                                                 dots=[(v, v), (p, 1)])
        return first, second, vv, pq

    text = jax.jit(f).lower(a, p, q).as_text()
    assert "output_operand_alias" in text
    first, second, vv, pq = jax.jit(f)(a, p, q)
    v = 3.0 * a
    np.testing.assert_allclose(first, v + 2 * p, rtol=1e-14)
    np.testing.assert_allclose(second, q - v, rtol=1e-14)
    assert_dot_close(vv, v, v, np.float64)
    assert_dot_close(pq, p, q - v, np.float64)

    # The vector written over is also a term past the first four of its own combination.
    def g(a, p, q):
        v = a * 3.0
        (out,), _ = fused_update([[(1.0, v), (1.0, p), (2.0, q), (3.0, p), (0.5, v), (-1.0, q)]])
        return out

    np.testing.assert_allclose(jax.jit(g)(a, p, q), 1.5 * v + 4 * p + q, rtol=1e-13, atol=1e-12)


@pytest.mark.max_ranks(2)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, np.int32], ids=["bfloat16", "int32"])
def test_other_dtypes_lower_to_jnp(dtype):
    x = jnp.arange(1, 2001).astype(dtype)
    y = (jnp.arange(2000) % 3).astype(dtype)
    f = jax.jit(lambda x, y: fused_update([[(2, x), (1, y)]], dots=[(0, y)]))
    (out,), (dot,) = f(x, y)
    assert out.dtype == x.dtype and dot.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(out, np.float64), np.asarray(2 * x + y, np.float64))
    assert dot == jnp.sum((2 * x + y) * y, dtype=dtype)
    assert "distlinalg_fused_update" not in f.lower(x, y).as_text()


def test_bad_programs_are_refused_at_trace_time():
    with pytest.raises(ValueError, match="one shape and dtype"):
        fused_update([[(1.0, jnp.ones(3)), (1.0, jnp.ones(4))]])
    with pytest.raises(ValueError, match="one shape and dtype"):
        fused_update([[(1.0, jnp.ones(3)), (1.0, jnp.ones(3, jnp.float32))]])
    with pytest.raises(ValueError, match="new vectors 0..0 only"):
        fused_update([[(1.0, jnp.ones(3))], [(1.0, 1)]])
    with pytest.raises(ValueError, match="needs a term"):
        fused_update([[]])
    with pytest.raises(ValueError, match="1 to 8 new vectors"):
        fused_update([[(1.0, jnp.ones(3))]] * 9)
    with pytest.raises(ValueError, match="dot refers to new vector 2"):
        fused_update([[(1.0, jnp.ones(3))]], dots=[(0, 2)])


def reference_step(x, p, r, q, alpha):
    """`step` in plain jnp."""
    x = x + alpha * p
    r = r - alpha * q
    w = 2 * x + 0.5 * p
    return (x, r, w), [jnp.vdot(r, r), jnp.vdot(p, x), jnp.vdot(w, q)]


@pytest.mark.max_ranks(2)
@pytest.mark.parametrize("dtype", [np.float64, np.complex128], ids=["real", "complex"])
def test_derivatives_equal_those_of_the_jnp_step(dtype):
    rng = np.random.default_rng(5)
    n = 20000
    primals = [vector(rng, n, dtype) for _ in range(4)] + [jnp.asarray(coefficient(dtype, 0.7 + 0.1j), dtype)]
    tangents = [vector(rng, n, dtype) for _ in range(4)] + [jnp.asarray(coefficient(dtype, 0.2 - 0.3j), dtype)]

    def scalar(f):
        def g(*args):
            (x, r, w), dots = f(*args)
            return jnp.vdot(x, w) + dots[0] * dots[1] + dots[2] + jnp.sum(r)
        return g

    def jvp(f):
        return jax.jit(lambda primals, tangents: jax.jvp(scalar(f), primals, tangents))(primals, tangents)

    def vjp(f, ct):
        return jax.jit(lambda primals, ct: jax.vjp(scalar(f), *primals)[1](ct))(primals, ct)

    (out, tangent), (ref_out, ref_tangent) = jvp(step), jvp(reference_step)
    np.testing.assert_allclose(out, ref_out, rtol=1e-11)
    np.testing.assert_allclose(tangent, ref_tangent, rtol=1e-11)
    ct = jnp.asarray((1.5 - 0.5j) if np.iscomplexobj(out) else 1.5, out.dtype)
    for c, r in zip(vjp(step, ct), vjp(reference_step, ct)):
        np.testing.assert_allclose(c, r, rtol=1e-10, atol=1e-10)
    small = [v[:300] for v in primals[:4]] + [primals[4]]
    check_grads(jax.jit(scalar(step)), small, order=1, modes=["fwd", "rev"], rtol=1e-4)
    if np.iscomplexobj(out):
        # Coefficients held fixed (symbolic zero tangents), one vector only, and second order.
        check_grads(jax.jit(lambda p: scalar(step)(small[0], p, *small[2:])), small[1:2], order=2,
                    modes=["fwd", "rev"], rtol=1e-4)


@pytest.mark.max_ranks(2)
def test_vmap_over_vectors_coefficients_or_both():
    rng = np.random.default_rng(7)
    X, P, R, Q = (vector(rng, 3 * 40000, np.complex128).reshape(3, 40000) for _ in range(4))
    alphas = jnp.asarray([0.5 + 0.1j, -0.2j, 1.0], np.complex128)
    cases = {
        "vectors and coefficients": (jax.vmap(step), (X, P, R, Q, alphas)),
        "vectors only": (jax.vmap(step, in_axes=(0, 0, 0, 0, None)), (X, P, R, Q, alphas[0])),
        "coefficients only": (jax.vmap(step, in_axes=(None, None, None, None, 0)), (X[0], P[0], R[0], Q[0], alphas)),
        "one vector": (jax.vmap(step, in_axes=(0, None, None, None, None)), (X, P[0], R[0], Q[0], alphas[0])),
    }
    for name, (f, args) in cases.items():
        outs, dots = jax.jit(f)(*args)
        axes = [0 if a.ndim == (2 if i < 4 else 1) else None for i, a in enumerate(args)]
        for i in range(3):
            one = [a[i] if axis == 0 else a for a, axis in zip(args, axes)]
            (x, r, w), d = reference_step(*one)
            for got, want in zip(outs, (x, r, w)):
                np.testing.assert_allclose(got[i], want, rtol=1e-12, err_msg=name)
            for got, want in zip(dots, d):
                np.testing.assert_allclose(got[i], want, rtol=1e-11, err_msg=name)
    # Nested batches.
    nested = jax.vmap(jax.vmap(step))(*(a.reshape((3, 1) + a.shape[1:]) for a in (X, P, R, Q, alphas)))
    np.testing.assert_allclose(nested[0][0][:, 0], X + alphas[:, None] * P, rtol=1e-12)


def test_update_and_dots_on_pytrees_mix_both_paths(comm):
    """Large leaves through the handler (one call each), small and
    non-handler ones through jnp, summed into each dot; every rank gets the
    same bits from the same data."""
    rng = np.random.default_rng(11)

    def tree():
        return {"big": vector(rng, 60000, np.complex128), "small": vector(rng, 10, np.complex128),
                "real": vector(rng, 5000, np.float64), "half": vector(rng, 8192, np.float32).astype(jnp.bfloat16)}

    x, p, r, q = tree(), tree(), tree(), tree()
    alpha = 0.25 - 0.5j

    def f(x, p, r, q):
        return update_and_dots(Update("x", [(1, x), (alpha, p)]), Update("r", [(1, r), (-alpha, q)]),
                               dots=[Dot("r", "r"), Dot(p, "x")])

    text = jax.jit(f).lower(x, p, r, q).as_text()
    # "big" and "real" (≥ 8 KiB, handler dtypes); "small" and the bfloat16 "half" in jnp.
    assert text.count("@distlinalg_fused_update(") == 2
    (x_new, r_new), (rr, px) = jax.jit(f)(x, p, r, q)
    want_rr, want_px = 0j, 0j
    for k in x:
        a = np.asarray(alpha if np.iscomplexobj(x[k]) else alpha.real).astype(np.asarray(x[k]).dtype)
        xe = np.asarray(x[k]) + a * np.asarray(p[k])
        re_ = np.asarray(r[k]) - a * np.asarray(q[k])
        assert x_new[k].dtype == x[k].dtype and r_new[k].dtype == r[k].dtype
        tol = 1e-2 if x[k].dtype == jnp.bfloat16 else 1e-12
        np.testing.assert_allclose(np.asarray(x_new[k], np.complex128), xe.astype(np.complex128), rtol=tol, atol=tol)
        np.testing.assert_allclose(np.asarray(r_new[k], np.complex128), re_.astype(np.complex128), rtol=tol, atol=tol)
        if x[k].dtype == jnp.bfloat16:  # a bfloat16 dot, as jnp.vdot computes it
            want_rr += complex(jnp.vdot(r_new[k], r_new[k]))
            want_px += complex(jnp.vdot(p[k], x_new[k]))
        else:
            want_rr += np.vdot(np.asarray(r_new[k], np.complex128), np.asarray(r_new[k], np.complex128))
            want_px += np.vdot(np.asarray(p[k], np.complex128), np.asarray(x_new[k], np.complex128))
    np.testing.assert_allclose(rr, want_rr, rtol=1e-12)
    np.testing.assert_allclose(px, want_px, rtol=1e-12)
    gathered = np.asarray(allgather(jnp.stack([rr, px]), comm=comm))
    assert (gathered == gathered[0]).all()



def test_update_and_dots_names():
    """A term or dot names a new vector of the same call, defined before the
    term (any new vector for a dot); an unknown, later or repeated name is a
    ValueError, a bare list in place of an Update a TypeError."""
    x, p = jnp.arange(4.0), jnp.ones(4)
    (y, z), (yz, pz) = update_and_dots(Update("y", [(2, x), (1, p)]), Update("z", [(1, p), (-1, "y")]),
                                       dots=[Dot("y", "z"), Dot(p, "z")])
    np.testing.assert_array_equal(y, 2 * x + p)
    np.testing.assert_array_equal(z, -2 * x)
    assert float(yz) == float(jnp.vdot(y, z)) and float(pz) == float(jnp.vdot(p, z))
    with pytest.raises(ValueError, match="'w', which is not a new vector"):
        update_and_dots(Update("y", [(1, x), (1, "w")]))
    with pytest.raises(ValueError, match="'z', which is not a new vector"):
        update_and_dots(Update("y", [(1, x), (1, "z")]), Update("z", [(1, p)]))
    with pytest.raises(ValueError, match="'q', which is not a new vector"):
        update_and_dots(Update("y", [(1, x)]), dots=[Dot("y", "q")])
    with pytest.raises(ValueError, match="two new vectors named 'y'"):
        update_and_dots(Update("y", [(1, x)]), Update("y", [(1, p)]))
    with pytest.raises(TypeError, match="Update"):
        update_and_dots([(1, x), (1, p)])

def test_krylov_steps_compile_to_one_pass(comm):
    """Standard CG's x, r update and ⟨r, r⟩ are one handler call with x and r
    updated in place (aliased, no copy in the loop body)."""
    from distlinalg.operators import laplacian_2d
    from distlinalg.solvers import cg

    n = 160
    op = laplacian_2d(n, comm=comm, dtype=jnp.float64)
    start, stop = op.grid_rows
    b = jnp.ones((stop - start) * n)
    text = jax.jit(lambda b: cg(op, b, rtol=1e-10)[0]).lower(b).compile().as_text()
    bodies = [c for c in text.split("\n\n") if c.split(" ", 1)[0] in re.findall(r"body=(%[^,\s]+)", text)]
    calls = [line for c in bodies for line in c.splitlines() if 'custom_call_target="distlinalg_fused_update"' in line]
    assert len(calls) == 1
    assert "output_to_operand_aliasing" in calls[0]
