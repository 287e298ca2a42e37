"""The bitwise and logical reductions (band, bor, bxor, land, lor, lxor; MPI.BAND ... MPI.LXOR)
in every collective that reduces: values against numpy on the gathered data, every integer
and bool dtype, eager and jitted, vmap, derivatives of programs that use them (zero: the
results are integers), the mpi4py and mpi4jax spellings, and the errors for floating input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import distlinalg.mpi4jax as mpi4jax
from distlinalg import comm as dlc
from conftest import gather_global

OPS = ["band", "bor", "bxor", "land", "lor", "lxor"]
NP_OPS = {
    "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor,
    "land": np.logical_and, "lor": np.logical_or, "lxor": np.logical_xor,
}
DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]


def local_data(rank, dtype, shape=(6,), seed=0):
    """Rank-dependent entries with zeros among them (the logical ops' interesting case)."""
    rng = np.random.default_rng(100 * seed + rank)
    if np.dtype(dtype) == np.bool_:
        return rng.random(shape) < 0.6
    info = np.iinfo(dtype)
    low, high = max(int(info.min), -100), min(int(info.max), 200)
    values = rng.integers(low, high, shape, endpoint=True).astype(dtype)
    values[..., 0] = 0  # a zero on every rank
    return values


def reduced(G, op, dtype):
    """numpy's reduction over the rank axis, in the dtype MPI returns (logical ops: 0/1 of dtype)."""
    return NP_OPS[op].reduce(G, axis=0).astype(dtype)


def cumulative(G, op, dtype, exclusive):
    rows = [NP_OPS[op].reduce(G[: r + 1], axis=0) for r in range(G.shape[0])]
    if exclusive:
        identity = {"band": ~np.zeros((), dtype) if np.dtype(dtype) != np.bool_ else np.True_,
                    "land": np.ones((), dtype)}.get(op, np.zeros((), dtype))
        rows = [np.broadcast_to(identity, G.shape[1:])] + rows[:-1]
    return np.stack(rows).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_allreduce_every_dtype(comm, rank, dtype, op):
    x = local_data(rank, dtype)
    G = gather_global(x, comm)
    want = reduced(G, op, dtype)
    for run in (lambda x: dlc.allreduce(x, op, comm=comm), jax.jit(lambda x: dlc.allreduce(x, op, comm=comm))):
        got = run(jnp.asarray(x))
        assert got.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(got, want)
    mpi_op = getattr(MPI, op.upper())
    np.testing.assert_array_equal(dlc.allreduce(jnp.asarray(x), mpi_op, comm=comm), want)
    np.testing.assert_array_equal(dlc.allreduce(jnp.asarray(x), dlc.ReduceOp[op.upper()], comm=comm), want)


@pytest.mark.parametrize("op", OPS)
def test_reduce_reduce_scatter_scan_exscan(comm, rank, size, op):
    dtype = "int32"
    x = local_data(rank, dtype, shape=(size, 3), seed=1)
    G = gather_global(x, comm)
    root = size - 1
    y = jax.jit(lambda x: dlc.reduce(x, op, root=root, comm=comm))(jnp.asarray(x))
    if rank == root:
        np.testing.assert_array_equal(y, reduced(G, op, dtype))
    rs = jax.jit(lambda x: dlc.reduce_scatter(x, op, comm=comm))(jnp.asarray(x))
    np.testing.assert_array_equal(rs, reduced(G, op, dtype)[rank])
    for exclusive, fn in ((False, dlc.scan), (True, dlc.exscan)):
        got = jax.jit(lambda x, fn=fn: fn(x, op, comm=comm))(jnp.asarray(x))
        np.testing.assert_array_equal(got, cumulative(G, op, dtype, exclusive)[rank], err_msg=f"{fn.__name__}")


def test_bool_and_unsigned_scans_and_exscan_identities(comm, rank, size):
    for dtype in ("bool", "uint16"):
        x = local_data(rank, dtype, seed=2)
        G = gather_global(x, comm)
        for op in OPS:
            got = dlc.exscan(jnp.asarray(x), op, comm=comm)
            np.testing.assert_array_equal(got, cumulative(G, op, dtype, True)[rank], err_msg=f"{dtype} {op}")


@pytest.mark.parametrize("op", ["bor", "lxor"])
def test_nonblocking_and_fused(comm, rank, op):
    x = local_data(rank, "int64", seed=3)
    G = gather_global(x, comm)
    request = dlc.iallreduce(jnp.asarray(x), op, comm=comm)
    np.testing.assert_array_equal(dlc.wait(request), reduced(G, op, "int64"))
    tree = {"a": jnp.asarray(x), "b": jnp.asarray(x[:3].astype(np.uint8))}
    out = jax.jit(lambda t: dlc.tree_allreduce(t, op, comm=comm))(tree)
    np.testing.assert_array_equal(out["a"], reduced(G, op, "int64"))
    np.testing.assert_array_equal(out["b"], reduced(G[:, :3].astype(np.uint8), op, "uint8"))


def test_vmap_matches_a_loop(comm, rank):
    x = np.stack([local_data(rank, "int32", seed=s) for s in range(3)], axis=1)  # (6, 3): batch on axis 1
    G = gather_global(x, comm)
    for op in OPS:
        got = jax.vmap(lambda v: dlc.allreduce(v, op, comm=comm), in_axes=1, out_axes=1)(jnp.asarray(x))
        np.testing.assert_array_equal(got, reduced(G, op, "int32"), err_msg=op)


def test_derivatives_of_a_program_that_uses_them(comm, rank, size):
    """A mask agreed with lor selects the entries of a float loss: the gradient is the mask
    (the integer reduction has no derivative), in both modes; jvp of the reduction itself
    gives a float0 zero tangent."""
    flags = local_data(rank, "bool", seed=4)
    mask = reduced(gather_global(flags, comm), "lor", "bool")
    w = jnp.linspace(0.5, 1.5, flags.size)

    def loss(w):
        agreed = dlc.allreduce(jnp.asarray(flags), "lor", comm=comm)
        return jnp.sum(jnp.where(agreed, w * w, 0.0))

    np.testing.assert_allclose(jax.grad(loss)(w), np.where(mask, 2 * w, 0.0), rtol=1e-6)
    np.testing.assert_allclose(jax.jit(jax.grad(loss))(w), np.where(mask, 2 * w, 0.0), rtol=1e-6)
    _, tangent = jax.jvp(loss, (w,), (jnp.ones_like(w),))
    np.testing.assert_allclose(tangent, np.sum(np.where(mask, 2 * w, 0.0)), rtol=1e-6)
    x = jnp.asarray(local_data(rank, "int32", seed=5))
    y, t = jax.jvp(lambda x: dlc.allreduce(x, "band", comm=comm), (x,),
                   (np.zeros(x.shape, jax.dtypes.float0),))
    np.testing.assert_array_equal(y, reduced(gather_global(np.asarray(x), comm), "band", "int32"))
    assert t.dtype == jax.dtypes.float0


def test_mpi4jax_spelling(comm, rank):
    """mpi4jax hands any predefined MPI.Op to MPI; so does distlinalg.mpi4jax."""
    flags = jnp.array([1, 2, 4], jnp.int32) << rank
    G = gather_global(np.asarray(flags), comm)
    for op in ("BOR", "BAND", "BXOR", "LAND", "LOR", "LXOR"):
        got = mpi4jax.allreduce(flags, op=getattr(MPI, op), comm=comm)
        np.testing.assert_array_equal(got, reduced(G, op.lower(), "int32"), err_msg=op)


@pytest.mark.parametrize("dtype", ["float32", "float64", "complex64", "bfloat16"])
def test_floating_input_is_refused_on_every_rank(comm, dtype):
    x = jnp.ones(3, dtype)
    for op in OPS:
        with pytest.raises(TypeError, match=f"op {op} takes integer and bool arrays"):
            jax.jit(lambda x: dlc.allreduce(x, op, comm=comm))(x)
        with pytest.raises(TypeError, match=f"op {op} takes integer and bool arrays"):
            dlc.reduce_scatter(jnp.ones((comm.Get_size(), 2), dtype), op, comm=comm)
    with pytest.raises(ValueError, match="unsupported mpi4py op"):
        dlc.allreduce(jnp.ones(2, jnp.int32), MPI.MAXLOC, comm=comm)
