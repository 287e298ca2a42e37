"""scan / exscan beyond test_collectives.py's table (values, JVP/VJP, second order and vmap
of every op, with zeros and ties): every op in every dtype against numpy on the
gathered data, bool and half precision, exscan's identities, pytrees, complex
AD, exact suffix sums, mixed batching in the derivative messages, control
flow, bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

from distlinalg.comm.allreduce import allreduce
from distlinalg.comm.scan import exscan, identity_of, scan
from distlinalg._runtime.mpi import ReduceOp
from conftest import gather_global

OPS = ["sum", "prod", "min", "max"]
NP_CUMULATIVE = {"sum": np.cumsum, "prod": np.cumprod, "min": np.minimum.accumulate, "max": np.maximum.accumulate}
JNP_REDUCE = {"sum": jnp.sum, "prod": jnp.prod, "min": jnp.min, "max": jnp.max}
NUMERIC = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
           "float32", "float64", "complex64", "complex128"]


def local_data(rank, shape=(4,), seed=0, low=0.5, high=1.5):
    return np.random.default_rng(1000 * seed + rank).uniform(low, high, shape)


def numpy_expected(G, op, exclusive):
    """Rows of the inclusive (or exclusive) cumulative op over the rank axis."""
    inclusive = NP_CUMULATIVE[op](G, axis=0)
    if not exclusive:
        return inclusive
    first = np.full_like(inclusive[:1], identity_of(ReduceOp[op.upper()], G.dtype))
    return np.concatenate([first, inclusive[:-1]], axis=0)


def stacked_reference(G, op, exclusive):
    """The global program in jnp on the stacked inputs (the AD reference)."""
    P = G.shape[0]
    rows = []
    for r in range(P):
        if exclusive and r == 0:
            rows.append(jnp.full(G.shape[1:], identity_of(ReduceOp[op.upper()], G.dtype)))
        else:
            rows.append(JNP_REDUCE[op](G[: r if exclusive else r + 1], axis=0))
    return jnp.stack(rows)


def assert_in_step(comm):
    np.testing.assert_allclose(allreduce(jnp.ones(1), comm=comm), [comm.Get_size()])


# ---------------------------------------------------------------------------
# Values
@pytest.mark.parametrize("dtype", NUMERIC)
def test_values_every_dtype(comm, rank, size, dtype):
    dt = np.dtype(dtype)
    raw = (np.arange(5) + 2 * rank) % 4 + 1  # small positive values: no overflow in any dtype
    x = raw.astype(dt)
    if np.issubdtype(dt, np.complexfloating):
        x = x + 1j * (rank - 1) * x.astype(dt)
    G = gather_global(x, comm)
    for op in OPS:
        if np.issubdtype(dt, np.complexfloating) and op in ("min", "max"):
            continue
        for exclusive in (False, True):
            got = (exscan if exclusive else scan)(jnp.asarray(x), op, comm=comm)
            assert got.dtype == dt
            expected = numpy_expected(G, op, exclusive)[rank]
            if np.issubdtype(dt, np.inexact):
                np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-6, err_msg=f"{op} {exclusive}")
            else:
                np.testing.assert_array_equal(np.asarray(got), expected, err_msg=f"{op} {exclusive}")


def test_values_bool_and_half_precision(comm, rank, size):
    b = np.array([True, False, rank % 2 == 0, rank == size - 1, True])
    Gb = gather_global(b, comm)
    np.testing.assert_array_equal(scan(b, "min", comm=comm), np.logical_and.accumulate(Gb, 0)[rank])
    np.testing.assert_array_equal(scan(b, "max", comm=comm), np.logical_or.accumulate(Gb, 0)[rank])
    np.testing.assert_array_equal(exscan(b, MPI.MIN, comm=comm),
                                  np.logical_and.reduce(Gb[:rank], 0) if rank else np.ones(5, bool))
    np.testing.assert_array_equal(exscan(b, MPI.MAX, comm=comm),
                                  np.logical_or.reduce(Gb[:rank], 0) if rank else np.zeros(5, bool))
    for dtype in (jnp.float16, jnp.bfloat16):
        x = jnp.asarray([0.5 + rank, -1.25 * rank, 3.0, 1.0], dtype)
        G = gather_global(np.asarray(x, np.float32), comm)
        for op in OPS:
            for exclusive in (False, True):
                got = (exscan if exclusive else scan)(x, op, comm=comm)
                assert got.dtype == dtype
                np.testing.assert_allclose(np.asarray(got, np.float32), numpy_expected(G, op, exclusive)[rank],
                                           rtol=2e-2, err_msg=f"{dtype} {op} {exclusive}")


def test_exscan_identity_on_rank_zero(comm, rank, size):
    """Rank 0 gets the op's identity for every dtype (MPI leaves it undefined)."""
    cases = {
        ("sum", "float32"): 0, ("prod", "int16"): 1, ("min", "float64"): np.inf, ("max", "float64"): -np.inf,
        ("min", "int8"): 127, ("max", "int8"): -128, ("min", "uint32"): 2**32 - 1, ("max", "uint16"): 0,
        ("min", "int64"): 2**63 - 1, ("max", "int32"): -(2**31), ("prod", "complex64"): 1,
        ("min", "bfloat16"): np.inf, ("max", "float16"): -np.inf,
    }
    for (op, dtype), ident in cases.items():
        got = np.asarray(exscan(jnp.full((3,), 5, dtype), op, comm=comm))
        expected = ident if rank == 0 else {"sum": 5 * rank, "prod": 5**rank, "min": 5, "max": 5}[op]
        if np.issubdtype(got.dtype, np.integer):
            np.testing.assert_array_equal(got, np.full(3, expected, got.dtype), err_msg=f"{op} {dtype}")
        else:
            np.testing.assert_array_equal(got.astype(np.complex128), np.full(3, expected, np.complex128),
                                          err_msg=f"{op} {dtype}")


def test_pytree_and_mpi_ops(comm, rank, size):
    tree = {"a": jnp.full((2,), rank + 1.0), "b": [jnp.arange(3) + rank]}
    out = scan(tree, MPI.SUM, comm=comm)
    np.testing.assert_allclose(out["a"], np.full(2, (rank + 1) * (rank + 2) / 2))
    np.testing.assert_array_equal(out["b"][0], np.arange(3) * (rank + 1) + rank * (rank + 1) // 2)
    ex = exscan(tree, "max", comm=comm)
    np.testing.assert_allclose(ex["a"], np.full(2, rank if rank else -np.inf))
    # Default communicator.
    np.testing.assert_allclose(scan(jnp.ones(2)), np.full(2, MPI.COMM_WORLD.Get_rank() + 1))


# ---------------------------------------------------------------------------
# AD against the stacked global program
def ad_input(rank, size, op, seed=0):
    x = local_data(rank, (5,), seed=seed)
    if op == "prod":
        if rank == 0:
            x[0] = 0.0  # a zero on rank 0: every later prefix has one zero
        if rank == size - 1:
            x[1] = 0.0  # a zero on the last rank only
        if rank in (0, 1):
            x[2] = 0.0  # two zeros
    if op in ("min", "max"):
        tie = 0.25 if op == "min" else 1.75
        x[0] = tie  # a tie across every rank
        if rank >= 1:
            x[1] = tie  # a tie from rank 1 on (rank 0 is not part of it)
        if rank in (0, size - 1):
            x[2] = tie  # rank 0 and the last rank tie; ranks between are not extreme
        x[3] = 1.0 if rank < 2 else 1.0 + 0.01 * rank  # ranks 0 and 1 tie, later ranks do not
    return jnp.asarray(x)


@pytest.mark.parametrize("exclusive", [False, True])
@pytest.mark.parametrize("op", ["sum", "prod"])
def test_complex_derivatives(comm, rank, size, op, exclusive):
    fn = lambda a: (exscan if exclusive else scan)(a, op, comm=comm)  # noqa: E731
    ref = lambda g: stacked_reference(g, op, exclusive)  # noqa: E731
    x = jnp.asarray(local_data(rank, (3,)) + 1j * local_data(rank, (3,), seed=5))
    G = jnp.asarray(gather_global(x, comm))
    xdot = jnp.asarray(local_data(rank, (3,), seed=1) - 1j * local_data(rank, (3,), seed=6))
    _, tangent = jax.jvp(fn, (x,), (xdot,))
    _, ref_tangent = jax.jvp(ref, (G,), (jnp.asarray(gather_global(xdot, comm)),))
    np.testing.assert_allclose(tangent, ref_tangent[rank], rtol=1e-13)
    ct = jnp.asarray(local_data(rank, (3,), seed=2) + 2j)
    expected = jax.vjp(ref, G)[1](jnp.asarray(gather_global(ct, comm)))[0][rank]
    np.testing.assert_allclose(jax.vjp(fn, x)[1](ct)[0], expected, rtol=1e-13)


@pytest.mark.parametrize("exclusive", [False, True])
def test_suffix_sum_transpose_is_exact(comm, rank, size, exclusive):
    """x̄_s = Σ_{r≥s} ȳ_r with a huge cotangent on rank 0: AR − EXSCAN would lose the small terms."""
    ct = jnp.full(3, 1e17 if rank == 0 else 1.0)
    fn = lambda a: (exscan if exclusive else scan)(a, comm=comm)  # noqa: E731
    _, vjp = jax.vjp(fn, jnp.zeros(3))
    (got,) = vjp(ct)
    CT = gather_global(np.asarray(ct), comm)
    first = rank + 1 if exclusive else rank
    expected = CT[first:].sum(axis=0) if first < size else np.zeros(3)
    np.testing.assert_array_equal(got, expected)  # bitwise: the small terms are never cancelled
    if rank >= 1:
        np.testing.assert_array_equal(got, np.full(3, float(size - first)))


# ---------------------------------------------------------------------------
# vmap and control flow
@pytest.mark.parametrize("axis", [0, -1])
def test_vmap_of_jvp_with_unbatched_tangent(comm, rank, size, axis):
    """Batched primal, unbatched tangent: the derivative rules' recursive-doubling
    messages must stay equally batched on every rank (vmap of values and of
    gradients is the table's)."""
    t = jnp.asarray(local_data(rank, (5,), seed=8))
    for op in OPS:
        batch = [ad_input(rank, size, op, seed=s) for s in range(3)]
        xs = jnp.stack(batch, axis=axis)
        for exclusive in (False, True):
            fn = lambda a: (exscan if exclusive else scan)(a, op, comm=comm)  # noqa: E731
            jvp = lambda a: jax.jvp(fn, (a,), (t,))[1]  # noqa: E731
            np.testing.assert_allclose(jax.vmap(jvp, in_axes=axis)(xs), jnp.stack([jvp(b) for b in batch]),
                                       rtol=1e-13, atol=1e-15, err_msg=f"{op} exclusive={exclusive}")


def test_in_fori_loop_and_lax_scan(comm, rank, size):
    x = jnp.asarray(local_data(rank, (3,)))
    G = gather_global(x, comm)

    @jax.jit
    def loops(x):
        a = jax.lax.fori_loop(0, 3, lambda i, v: scan(v, comm=comm) / (rank + 1), x)
        b, _ = jax.lax.scan(lambda c, _: (exscan(c, "max", comm=comm), None), x, None, length=2)
        return a, b

    a, b = loops(x)
    expected = G.copy()
    for _ in range(3):
        expected = np.cumsum(expected, axis=0) / np.arange(1, size + 1)[:, None]
    np.testing.assert_allclose(a, expected[rank], rtol=1e-13)
    once = numpy_expected(G, "max", True)
    np.testing.assert_allclose(b, numpy_expected(once, "max", True)[rank])
    # Differentiated through the loop against the stacked program.
    w = jnp.asarray(local_data(rank, (3,), seed=9))
    W = gather_global(w, comm)

    def global_loss(g):
        for _ in range(3):
            g = jnp.cumsum(g, axis=0) / jnp.arange(1, size + 1)[:, None]
        return jnp.sum(W * g)

    grad = jax.jit(jax.grad(lambda v: jnp.sum(w * loops(v)[0])))(x)
    np.testing.assert_allclose(grad, jax.grad(global_loss)(jnp.asarray(G))[rank], rtol=1e-12)


# ---------------------------------------------------------------------------
def test_bad_input_raises_on_every_rank(comm, rank, size):
    with pytest.raises(TypeError, match="not defined for bool"):
        scan(jnp.ones(2, bool), "sum", comm=comm)
    with pytest.raises(TypeError, match="not defined for bool"):
        exscan(jnp.ones(2, bool), "prod", comm=comm)
    with pytest.raises(TypeError, match="distlinalg.exscan: op min is not defined for complex"):
        exscan(jnp.ones(2, jnp.complex64), "min", comm=comm)
    with pytest.raises(TypeError, match="distlinalg.scan: op max is not defined for complex"):
        scan(jnp.ones(2, jnp.complex128), MPI.MAX, comm=comm)
    with pytest.raises(ValueError, match="unknown reduction op"):
        scan(jnp.ones(2), "mean", comm=comm)
    with pytest.raises(ValueError, match="unsupported mpi4py op"):
        exscan(jnp.ones(2), MPI.MINLOC, comm=comm)
    with pytest.raises(TypeError, match="op must be a string"):
        scan(jnp.ones(2), 3, comm=comm)
    with pytest.raises(TypeError, match="unsupported dtype"):
        scan(jnp.ones(2, jnp.float8_e4m3fn), comm=comm)
    with pytest.raises(TypeError, match="unsupported dtype"):
        # The bad leaf comes second: nothing is communicated for the first.
        scan([jnp.ones(2), jnp.ones(2, jnp.float8_e4m3fn)], comm=comm)
    with pytest.raises(TypeError, match="mpi4py communicator"):
        exscan(jnp.ones(2), comm=42)
    assert_in_step(comm)
