"""reduce_scatter beyond test_collectives.py's table (values, JVP/VJP, second order and
vmap of every op, with zeros and ties): every op in every dtype, edge block
shapes, op spellings, pytrees, hand-computed tie and zero weights, complex and
third-order derivatives, unused outputs, the batched layout, batched tangents,
loops, bad input.

The global program maps the stacked inputs G (size, size, *s), G[q, r] =
rank q's block r, to the stacked outputs op(G, axis=0) (size, *s): row r is
rank r's result.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

from distlinalg.comm.allreduce import allreduce
from distlinalg.comm.reduce_scatter import reduce_scatter, reduce_scatter_p
from conftest import gather_global

OPS = ["sum", "prod", "min", "max"]
JNP = {"sum": jnp.sum, "prod": jnp.prod, "min": jnp.min, "max": jnp.max}
NP = {"sum": np.sum, "prod": np.prod, "min": np.min, "max": np.max}


def stacked(G, op):
    return JNP[op](G, axis=0)


def local_blocks(op, rank, size, seed=0, shape=(5,)):
    """(size, *shape) blocks; prod gets zeros, min/max exact ties, differing per block.

    prod, entry 0 of every block: a zero on rank 0 only; entry 1: zeros on
    ranks 0 and 1; entry 2: zeros on every rank; entry 3: a zero on rank
    (block + 1) % size only. min/max, entry 0: a tie of the extremum across
    all ranks; entry 1: a tie of the extremum on ranks 0 and 1; entry 2: the
    extremum on rank 0, a tie of the other ranks behind it.
    """
    rng = np.random.default_rng(1000 * seed + rank)
    x = rng.uniform(0.5, 1.5, size=(size, *shape))
    if op == "sum" or x.size == 0:
        return x
    flat = x.reshape(size, -1)
    if op == "prod":
        if rank == 0:
            flat[:, 0] = 0.0
        if rank in (0, 1):
            flat[:, 1] = 0.0
        flat[:, 2] = 0.0
        for r in range(size):
            if rank == (r + 1) % size:
                flat[r, 3] = 0.0
    else:
        extreme = 0.25 if op == "min" else 1.75
        flat[:, 0] = extreme
        if rank in (0, 1):
            flat[:, 1] = extreme
        flat[:, 2] = (0.5 if op == "min" else 1.5) if rank == 0 else 1.0
    return x


DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "float16", "bfloat16", "float32", "float64", "complex64", "complex128"]


@pytest.mark.parametrize("dtype", DTYPES + ["bool"])
def test_values_every_dtype_and_op(comm, rank, size, dtype):
    raw = (np.arange(3 * size).reshape(size, 3) + rank) % 3 + 1
    x = jnp.asarray(raw % 2 == 0 if dtype == "bool" else raw, dtype)
    complex_ = dtype.startswith("complex")
    if complex_:
        x = x * (1 - 0.5j * rank)
    wide = np.complex128 if complex_ else np.float64
    ops = {"bool": ["min", "max"], "complex64": ["sum", "prod"], "complex128": ["sum", "prod"]}.get(dtype, OPS)
    tol = dict(rtol=1e-2) if dtype in ("float16", "bfloat16") else dict(rtol=1e-6)
    for op in ops:
        # Products grow with the world: past the third rank every factor is 1, so that
        # int8 products stay in range at any rank count.
        xo = jnp.where(rank >= 3, jnp.ones_like(x), x) if op == "prod" else x
        Bo = gather_global(np.asarray(xo).astype(wide), comm)
        out = reduce_scatter(xo, op, comm=comm)
        assert out.shape == (3,) and out.dtype == x.dtype, op
        np.testing.assert_allclose(np.asarray(out).astype(wide), NP[op](Bo[:, rank], axis=0), **tol, err_msg=op)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape", [(), (2, 3), (0,)])
@pytest.mark.parametrize("jit", [False, True])
def test_values_shapes(comm, rank, size, op, shape, jit):
    x = jnp.asarray(local_blocks("sum", rank, size, shape=shape))
    fn = lambda a: reduce_scatter(a, op, comm=comm)  # noqa: E731
    out = (jax.jit(fn) if jit else fn)(x)
    assert out.shape == shape
    np.testing.assert_allclose(out, NP[op](gather_global(x, comm)[:, rank], axis=0), rtol=1e-14)


def test_mpi4py_ops_default_comm_and_pytree(comm, rank, size):
    x = jnp.asarray(local_blocks("sum", rank, size))
    for name, mpi_op in [("sum", MPI.SUM), ("prod", MPI.PROD), ("min", MPI.MIN), ("max", MPI.MAX)]:
        np.testing.assert_array_equal(reduce_scatter(x, mpi_op, comm=comm), reduce_scatter(x, name, comm=comm))
    np.testing.assert_allclose(reduce_scatter(x), gather_global(x, comm)[:, rank].sum(0), rtol=1e-14)
    tree = {"a": jnp.full((size, 2), float(rank)), "b": [jnp.arange(size, dtype=jnp.int32)[:, None] + rank]}
    out = reduce_scatter(tree, "max", comm=comm)
    np.testing.assert_array_equal(out["a"], np.full(2, size - 1.0))
    np.testing.assert_array_equal(out["b"][0], [rank + size - 1])


def test_tie_and_zero_weights_explicitly(comm, rank, size):
    """Hand-computed: ties split the cotangent equally; prod weights are products of the others."""
    x = jnp.full((size, 1), 2.0)  # every rank ties every block
    g = jax.grad(lambda a: jnp.sum(reduce_scatter(a, "max", comm=comm)))(x)
    # Every rank's block r receives 1/size of rank r's seed 1.
    np.testing.assert_allclose(g, np.full((size, 1), 1.0 / size), rtol=1e-15)
    g = jax.grad(lambda a: jnp.sum(reduce_scatter(a, "prod", comm=comm)))(x)
    np.testing.assert_allclose(g, np.full((size, 1), 2.0 ** (size - 1)), rtol=1e-15)
    z = jnp.where(rank == 0, 0.0, 3.0) * jnp.ones((size, 1))  # one zero per block, on rank 0
    g = jax.grad(lambda a: jnp.sum(reduce_scatter(a, "prod", comm=comm)))(z)
    expected = np.full((size, 1), 3.0 ** (size - 1)) if rank == 0 else np.zeros((size, 1))
    np.testing.assert_allclose(g, expected, rtol=1e-15)
    assert np.all(np.isfinite(g))


@pytest.mark.parametrize("op", ["prod"])
def test_complex_prod_derivatives(comm, rank, size, op):
    rng = np.random.default_rng(rank)
    x = jnp.asarray(rng.standard_normal((size, 3)) + 1j * rng.standard_normal((size, 3)))
    x = x.at[0, 0].set(0.0 if rank == 0 else x[0, 0])
    xdot = jnp.asarray(rng.standard_normal((size, 3)) + 1j * rng.standard_normal((size, 3)))
    ct = jnp.asarray(rng.standard_normal(3) - 2j * rng.standard_normal(3))
    G, Gdot, CT = (jnp.asarray(gather_global(a, comm)) for a in (x, xdot, ct))
    fn = lambda a: reduce_scatter(a, op, comm=comm)  # noqa: E731
    _, tangent = jax.jvp(fn, (x,), (xdot,))
    _, ref_tangent = jax.jvp(lambda g: stacked(g, op), (G,), (Gdot,))
    np.testing.assert_allclose(tangent, ref_tangent[rank], rtol=1e-12, atol=1e-14)
    (xbar,) = jax.vjp(fn, x)[1](ct)
    (ref_xbar,) = jax.vjp(lambda g: stacked(g, op), G)[1](CT)
    np.testing.assert_allclose(xbar, ref_xbar[rank], rtol=1e-12, atol=1e-14)


def test_prod_third_order_at_zeros(comm, rank, size):
    """Directional third derivatives: the product of the others keeps its derivatives at zeros."""
    x = jnp.asarray(local_blocks("prod", rank, size))
    w = jnp.asarray(np.random.default_rng(70 + rank).standard_normal(x.shape[1:]))
    u, v = (jnp.asarray(np.random.default_rng(s + rank).standard_normal(x.shape)) for s in (110, 130))
    G, W, U, V = (jnp.asarray(gather_global(a, comm)) for a in (x, w, u, v))

    def third(loss, a, u, v):
        return jax.jvp(lambda b: jax.jvp(jax.grad(loss), (b,), (v,))[1], (a,), (u,))[1]

    got = third(lambda a: jnp.sum(w * jnp.sin(reduce_scatter(a, "prod", comm=comm))), x, u, v)
    ref = third(lambda g: jnp.sum(W * jnp.sin(stacked(g, "prod"))), G, U, V)
    np.testing.assert_allclose(got, ref[rank], rtol=1e-10, atol=1e-12)


def test_output_unused_on_some_ranks(comm, rank, size):
    """Rank 0's zero cotangent must still join the allgather of the transpose."""
    x = jnp.asarray(local_blocks("max", rank, size))
    G = jnp.asarray(gather_global(x, comm))
    mask = jnp.asarray([0.0] + [1.0] * (size - 1))
    for op in OPS:

        def loss(a, op=op):
            y = reduce_scatter(a, op, comm=comm)
            return jnp.zeros(()) if rank == 0 else jnp.sum(y**2)

        ref = jax.grad(lambda g: jnp.sum(mask[:, None] * stacked(g, op) ** 2))(G)[rank]
        np.testing.assert_allclose(jax.jit(jax.grad(loss))(x), ref, rtol=1e-12, err_msg=op)


@pytest.mark.parametrize("axis", [0, -1])
def test_vmap_batch_sits_behind_the_rank_axis(comm, rank, size, axis):
    """The values under vmap are the table's; here the layout: one message whose
    batch dimension sits right behind the rank axis, and out_axes under jit."""
    batch = [jnp.asarray(local_blocks("sum", rank, size, seed=s, shape=(2, 3))) for s in range(3)]
    xs = jnp.stack(batch, axis=axis)
    fn = lambda a: reduce_scatter(a, comm=comm)  # noqa: E731
    eqns = jax.make_jaxpr(jax.vmap(fn, in_axes=axis))(xs).jaxpr.eqns
    (eqn,) = [e for e in eqns if e.primitive is reduce_scatter_p]
    assert eqn.invars[0].aval.shape == (size, 3, 2, 3)
    loop = jnp.stack([fn(b) for b in batch], axis=-1)
    np.testing.assert_allclose(jax.jit(jax.vmap(fn, in_axes=axis, out_axes=-1))(xs), loop, rtol=1e-14)


def test_vmap_of_jvp_batched_tangents_only(comm, rank, size):
    x = jnp.asarray(local_blocks("max", rank, size))
    ts = jnp.asarray(np.random.default_rng(rank).standard_normal((4, *x.shape)))
    for op in OPS:
        fn = lambda a: reduce_scatter(a, op, comm=comm)  # noqa: E731
        got = jax.vmap(lambda t: jax.jvp(fn, (x,), (t,))[1], in_axes=0)(ts)
        np.testing.assert_allclose(got, jnp.stack([jax.jvp(fn, (x,), (t,))[1] for t in ts]), rtol=1e-14, err_msg=op)


def test_column_sharded_matvec_in_fori_loop_and_scan(comm, rank, size):
    """x_{k+1} = tanh(A x_k) with A's columns sharded: A x is a sum reduce_scatter."""
    n = 2
    A = np.random.default_rng(0).standard_normal((size * n, size * n)) / np.sqrt(size * n)
    A_cols = jnp.asarray(A[:, rank * n : (rank + 1) * n])
    x0 = jnp.asarray(np.cos(np.arange(size * n) + 1.0))

    def step(v):
        return jnp.tanh(reduce_scatter((A_cols @ v).reshape(size, n), comm=comm))

    def ref_run(x, k):
        for _ in range(k):
            x = jnp.tanh(jnp.asarray(A) @ x)
        return x

    mine = x0[rank * n : (rank + 1) * n]

    @jax.jit
    def loops(v):
        a = jax.lax.fori_loop(0, 4, lambda i, u: step(u), v)
        b, hist = jax.lax.scan(lambda u, _: (step(u), u), v, None, length=4)
        return a, b, hist

    a, b, hist = loops(mine)
    expected = ref_run(x0, 4)[rank * n : (rank + 1) * n]
    np.testing.assert_allclose(a, expected, rtol=1e-13)
    np.testing.assert_allclose(b, expected, rtol=1e-13)
    np.testing.assert_allclose(hist[2], ref_run(x0, 2)[rank * n : (rank + 1) * n], rtol=1e-13)

    w = jnp.asarray(np.sin(np.arange(size * n)))

    def loss(v):
        return jnp.sum(w[rank * n : (rank + 1) * n] * jax.lax.fori_loop(0, 4, lambda i, u: step(u), v))

    g = jax.jit(jax.grad(loss))(mine)
    ref = jax.grad(lambda x: jnp.sum(w * ref_run(x, 4)))(x0)
    np.testing.assert_allclose(g, ref[rank * n : (rank + 1) * n], rtol=1e-12, atol=1e-14)


def test_bad_input_raises_on_every_rank(comm, rank, size):
    expected = rf"distlinalg\.reduce_scatter: .*\({size}, \.\.\.\).*got shape \({size + 1}, 2\)"
    with pytest.raises(ValueError, match=expected):
        reduce_scatter(jnp.ones((size + 1, 2)), comm=comm)
    with pytest.raises(ValueError, match=r"reduce_scatter: .*got shape \(\)"):
        reduce_scatter(jnp.ones(()), comm=comm)
    with pytest.raises(ValueError, match=rf"got shape \({size + 2}, {size}\)"):
        jax.jit(lambda a: reduce_scatter(a, "max", comm=comm))(jnp.ones((size + 2, size)))
    with pytest.raises(ValueError, match="reduce_scatter"):
        reduce_scatter({"good": jnp.ones((size, 1)), "bad": jnp.ones((size + 2,))}, comm=comm)
    for op in ("sum", "prod"):
        with pytest.raises(TypeError, match="not defined for bool"):
            reduce_scatter(jnp.ones((size, 2), bool), op, comm=comm)
    for op in ("min", "max"):
        with pytest.raises(TypeError, match="complex"):
            reduce_scatter(jnp.ones((size, 2), jnp.complex64), op, comm=comm)
    with pytest.raises(ValueError, match="unknown reduction op"):
        reduce_scatter(jnp.ones((size, 2)), "mean", comm=comm)
    with pytest.raises(TypeError, match="unsupported dtype"):
        reduce_scatter(jnp.ones((size, 2), jnp.float8_e4m3fn), comm=comm)
    with pytest.raises(TypeError, match="mpi4py communicator"):
        reduce_scatter(jnp.ones((size, 2)), comm=0)
    # Still in step: every rank raised without communicating.
    np.testing.assert_allclose(allreduce(jnp.ones(1), comm=comm), [size])
    np.testing.assert_allclose(reduce_scatter(jnp.ones((size, 1)), comm=comm), [size])
