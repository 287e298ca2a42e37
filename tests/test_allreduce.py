"""allreduce: values, compile cache, control flow, bad input, AD."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

from distlinalg.comm import allreduce
from conftest import assert_matches_reference, gather_global

REDUCERS = {"sum": np.sum, "prod": np.prod, "min": np.min, "max": np.max}


def local_data(rank, shape=(3, 4), dtype=np.float64):
    rng = np.random.default_rng(100 + rank)
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("op", ["sum", "prod", "min", "max"])
@pytest.mark.parametrize("jit", [False, True])
def test_values(comm, rank, size, op, jit):
    x = local_data(rank)
    fn = (lambda a: allreduce(a, op, comm=comm))
    out = (jax.jit(fn) if jit else fn)(x)
    glob = gather_global(x, comm)
    expected = REDUCERS[op](glob, axis=0)
    np.testing.assert_allclose(out, expected, rtol=1e-13)
    assert out.dtype == x.dtype and out.shape == x.shape


def test_mpi4py_op_objects_and_default_comm(rank):
    x = local_data(rank)
    world = MPI.COMM_WORLD
    for name, mpi_op in [("sum", MPI.SUM), ("max", MPI.MAX)]:
        a = allreduce(x, mpi_op)
        b = allreduce(x, name)
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(allreduce(x), world.allreduce(x, op=MPI.SUM), rtol=1e-13)


def test_pytree(comm, rank, size):
    tree = {"a": jnp.full((2,), rank, jnp.float32), "b": (jnp.arange(3) * (rank + 1),)}
    out = allreduce(tree, comm=comm)
    total = size * (size - 1) / 2
    np.testing.assert_allclose(out["a"], np.full(2, total))
    np.testing.assert_array_equal(out["b"][0], np.arange(3) * size * (size + 1) // 2)


def test_control_flow(comm, rank, size):
    x = jnp.asarray(local_data(rank, (5,)))
    total = gather_global(x, comm).sum(0)

    @jax.jit
    def loops(x):
        a = jax.lax.fori_loop(0, 3, lambda i, v: allreduce(v, comm=comm) / size, x)
        b, _ = jax.lax.scan(lambda c, _: (allreduce(c, comm=comm) / size, None), x, None, length=3)
        c = jax.lax.cond(x.shape[0] > 0, lambda v: allreduce(v, comm=comm), lambda v: v, x)
        d = jax.lax.while_loop(lambda s: s[0] < 2, lambda s: (s[0] + 1, allreduce(s[1], comm=comm) / size), (0, x))[1]
        return a, b, c, d

    a, b, c, d = loops(x)
    mean = total / size
    np.testing.assert_allclose(a, mean, rtol=1e-12)
    np.testing.assert_allclose(b, mean, rtol=1e-12)
    np.testing.assert_allclose(c, total, rtol=1e-12)
    np.testing.assert_allclose(d, mean, rtol=1e-12)


def test_eager_second_call_hits_cache(comm, rank):
    from distlinalg.comm import allreduce_p  # noqa: F401

    x = jnp.asarray(local_data(rank))
    allreduce(x, comm=comm)  # first call compiles
    x2 = (x + 1).block_until_ready()
    with jax.log_compiles(True):
        import logging

        records = []
        handler = logging.Handler()
        handler.emit = records.append
        logger = logging.getLogger("jax")
        logger.addHandler(handler)
        try:
            allreduce(x, comm=comm)
            allreduce(x2, comm=comm)
        finally:
            logger.removeHandler(handler)
    compiles = [r for r in records if "Compiling" in r.getMessage() or "compil" in r.getMessage().lower()]
    assert not compiles, [r.getMessage() for r in compiles]


def test_dtypes(comm, rank, size):
    for dtype in ["float16", jnp.bfloat16, "float32", "float64", "complex64", "complex128",
                  "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]:
        x = (np.arange(6) % 3 + rank).astype(dtype)
        out = allreduce(x, comm=comm)
        expected = gather_global(np.asarray(x, np.float64), comm).sum(0)
        np.testing.assert_allclose(np.asarray(out, np.float64), expected, err_msg=str(dtype))
        assert out.dtype == x.dtype
    b = np.array([True, False, rank == 0])
    np.testing.assert_array_equal(allreduce(b, "max", comm=comm), [True, False, True])
    np.testing.assert_array_equal(allreduce(b, "min", comm=comm), [True, False, size == 1])


def test_half_precision_reductions(comm, rank, size):
    for dtype in [jnp.float16, jnp.bfloat16]:
        x = jnp.asarray([0.5 + rank, -1.25 * rank, 3.0], dtype)
        glob = gather_global(np.asarray(x, np.float32), comm)
        for op, ref in REDUCERS.items():
            out = allreduce(x, op, comm=comm)
            np.testing.assert_allclose(np.asarray(out, np.float32), ref(glob, axis=0), rtol=1e-2, err_msg=op)


def test_bad_input(comm):
    with pytest.raises(ValueError, match="unknown reduction op"):
        allreduce(jnp.ones(2), "avg", comm=comm)
    with pytest.raises(TypeError, match="mpi4py communicator"):
        allreduce(jnp.ones(2), comm="world")
    with pytest.raises(TypeError, match="not defined for bool"):
        allreduce(jnp.ones(2, bool), "sum", comm=comm)
    with pytest.raises(TypeError, match="complex"):
        allreduce(jnp.ones(2, jnp.complex64), "max", comm=comm)
    with pytest.raises(TypeError, match="unsupported dtype"):
        allreduce(jnp.ones(2, jnp.float8_e4m3fn), comm=comm)
    # Still in step: every rank raised without communicating.
    np.testing.assert_allclose(allreduce(jnp.ones(1), comm=comm), [comm.Get_size()])


@pytest.mark.parametrize("op", ["sum", "prod", "min", "max"])
def test_gradients_against_stacked_reference(comm, rank, size, op):
    """JVP and VJP against jax on the stacked-ranks global function."""
    x = jnp.asarray(local_data(rank, (4,)))
    if op in ("prod",):
        x = x.at[0].set(0.0 if rank == 0 else x[0])  # a zero on one rank
    if op in ("min", "max"):
        x = x.at[1].set(7.0 if op == "max" else -7.0)  # a tie across all ranks
    glob = jnp.asarray(gather_global(x, comm))
    xdot = jnp.asarray(local_data(rank + 50, (4,)))
    glob_dot = jnp.asarray(gather_global(xdot, comm))
    weights = jnp.asarray(gather_global(local_data(rank + 90, (4,)), comm))

    reduce = {"sum": jnp.sum, "prod": jnp.prod, "min": jnp.min, "max": jnp.max}[op]

    def stacked(g):  # the global program: every rank gets the reduction
        y = reduce(g, axis=0)
        return jnp.broadcast_to(y, g.shape)

    _, ref_tangent = jax.jvp(stacked, (glob,), (glob_dot,))
    _, tangent = jax.jvp(lambda a: allreduce(a, op, comm=comm), (x,), (xdot,))
    np.testing.assert_allclose(tangent, ref_tangent[rank], rtol=1e-10, atol=1e-12)

    # Reverse mode with a rank-dependent cotangent w_r.
    ref_grad = jax.grad(lambda g: jnp.sum(weights * stacked(g)))(glob)
    grad = jax.grad(lambda a: jnp.sum(weights[rank] * allreduce(a, op, comm=comm)))(x)
    np.testing.assert_allclose(grad, ref_grad[rank], rtol=1e-10, atol=1e-12)


def test_chained_allreduce_gradient(comm, rank, size):
    # mpi4jax's identity transpose gives 1.0 here; the true value is size**2
    # summed over ranks' seeds -> d/dx_r sum_s sum(AR(AR(x)))_s = size * size.
    x = jnp.ones(3)
    g = jax.grad(lambda a: allreduce(allreduce(a, comm=comm), comm=comm).sum())(x)
    np.testing.assert_allclose(g, np.full(3, size * size))


def test_hessian_through_allreduce(comm, rank, size):
    x = jnp.asarray(local_data(rank, (3,)))
    glob = jnp.asarray(gather_global(x, comm))

    def local_loss(a):
        return jnp.sum(allreduce(a, comm=comm) ** 3)

    def stacked_loss(g):
        return size * jnp.sum(jnp.sum(g, 0) ** 3)

    h = jax.hessian(local_loss)(x)
    # jacfwd perturbs every rank's input at once (the same basis direction on
    # each rank), so rank r sees the sum over s of the blocks H[r, :, s, :].
    ref = jax.hessian(stacked_loss)(glob)[rank].sum(axis=1)
    np.testing.assert_allclose(h, ref, rtol=1e-10)


def test_vmap(comm, rank, size):
    xs = jnp.asarray(local_data(rank, (5, 3)))
    out = jax.vmap(lambda a: allreduce(a, comm=comm), in_axes=1, out_axes=1)(xs)
    np.testing.assert_allclose(out, gather_global(xs, comm).sum(0), rtol=1e-13)
    grads = jax.vmap(jax.grad(lambda a: allreduce(a ** 2, comm=comm).sum()))(xs)
    np.testing.assert_allclose(grads, 2 * size * xs, rtol=1e-13)


def test_checkpoint_and_custom_vjp(comm, rank, size):
    x = jnp.asarray(local_data(rank, (3,)))

    @jax.checkpoint
    def f(a):
        return jnp.sin(allreduce(a, comm=comm))

    g = jax.grad(lambda a: f(a).sum())(x)
    total = gather_global(x, comm).sum(0)
    np.testing.assert_allclose(g, size * np.cos(total), rtol=1e-12)
