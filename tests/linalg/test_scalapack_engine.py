"""distlinalg.linalg's ScaLAPACK engine (distlinalg/linalg/_scalapack.py, csrc/scalapack.cc).

Every value is checked against numpy on the gathered matrix, on every rank. The
matrices are held by rows with the uneven split of tests/conftest.py (at 3 ranks
rank 0 holds no rows). Small blocks (4) spread even these small matrices over the
whole grid, so the block-cyclic redistribution is exercised at every rank count.
Tests that need MKL skip when it is not installed (`make scalapack`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

from distlinalg._runtime import mpi as _mpi
from distlinalg.comm import allreduce
from distlinalg.linalg import _scalapack as engine

from conftest import assert_no_failures, failure_of, gather_global, uneven_partition

MKL, WHY = engine.available()
needs_mkl = pytest.mark.skipif(not MKL, reason=WHY)

N = 37  # not a multiple of the blocks, nor of the rank counts
TOL = {np.float64: 1e-10, np.complex128: 1e-10, np.float32: 1e-4, np.complex64: 1e-4}


def hpd(n, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, n))
    if np.iscomplexobj(np.zeros((), dtype)):
        x = x + 1j * rng.standard_normal((n, n))
    return (x @ x.conj().T / n + np.eye(n)).astype(dtype)


def general(n, dtype, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, n)) + n ** 0.5 * np.eye(n)
    if np.iscomplexobj(np.zeros((), dtype)):
        x = x + 1j * rng.standard_normal((n, n))
    return x.astype(dtype)


def rhs(n, m, dtype, seed=2):
    rng = np.random.default_rng(seed)
    shape = (n,) if m is None else (n, m)
    b = rng.standard_normal(shape)
    if np.iscomplexobj(np.zeros((), dtype)):
        b = b + 1j * rng.standard_normal(shape)
    return b.astype(dtype)


def split(comm, n=N):
    p = uneven_partition(n, comm.Get_size())
    r = comm.Get_rank()
    return p.sizes, slice(p.starts[r], p.starts[r + 1])


def gathered_rows(local, comm):
    return np.concatenate(comm.allgather(np.asarray(local)), axis=0)


def assert_same_everywhere(value, comm):
    everyone = gather_global(value, comm)
    np.testing.assert_array_equal(everyone, np.broadcast_to(everyone[0], everyone.shape))


def relative_error(x, ref):
    return np.linalg.norm(x - ref) / np.linalg.norm(ref)


def run(mode, fn, *args):
    return jax.jit(fn)(*args) if mode == "jit" else fn(*args)


# ---------------------------------------------------------------------------
@needs_mkl
def test_available_says_what_it_loaded():
    assert MKL
    assert "ScaLAPACK" in WHY and "blacs" in WHY
    family = _mpi.BUILD_INFO["implementation"]
    assert ("intelmpi" if family == "MPICH" else "openmpi") in WHY


@needs_mkl
@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("dtype", [np.float64, np.complex128, np.float32])
@pytest.mark.parametrize("block", [None, 4])
def test_potrf_solve(comm, mode, dtype, block):
    sizes, mine = split(comm)
    A, B = hpd(N, dtype), rhs(N, 3, dtype)
    x, info = run(mode, lambda a, b: engine.potrf_solve(a, b, sizes, comm, block=block), A[mine], B[mine])
    assert x.shape == B[mine].shape and x.dtype == dtype and info.dtype == np.int32
    assert int(info) == 0
    assert relative_error(gathered_rows(x, comm), np.linalg.solve(A, B)) < TOL[dtype]


@needs_mkl
@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("dtype", [np.float64, np.complex128])
def test_gesv(comm, mode, dtype):
    sizes, mine = split(comm)
    A, b = general(N, dtype), rhs(N, None, dtype)  # a vector right-hand side
    x, info = run(mode, lambda a, b: engine.gesv(a, b, sizes, comm, block=4), A[mine], b[mine])
    assert x.shape == b[mine].shape and int(info) == 0
    assert relative_error(gathered_rows(x, comm), np.linalg.solve(A, b)) < TOL[dtype]


def spectrum_matrix(n, dtype):
    """A Hermitian matrix with known, well separated eigenvalues (-3 ... 5), so that
    every eigenvector is defined up to a phase and projectors compare directly."""
    q, _ = np.linalg.qr(general(n, dtype, seed=3))
    w = np.linspace(-3.0, 5.0, n)
    a = (q * w) @ q.conj().T
    return ((a + a.conj().T) / 2).astype(dtype), w


@needs_mkl
@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("dtype", [np.float64, np.complex128, np.complex64])
def test_heevd(comm, mode, dtype):
    sizes, mine = split(comm)
    A, w_exact = spectrum_matrix(N, dtype)
    w, v, info = run(mode, lambda a: engine.heevd(a, sizes, comm, block=4), A[mine])
    assert int(info) == 0 and w.shape == (N,) and v.shape == (len(A[mine]), N)
    assert w.dtype == np.finfo(dtype).dtype and v.dtype == dtype
    assert_same_everywhere(w, comm)
    tol = TOL[dtype]
    np.testing.assert_allclose(np.asarray(w), np.linalg.eigvalsh(A), atol=tol * 5, rtol=0)
    np.testing.assert_allclose(np.asarray(w), w_exact, atol=tol * 50, rtol=0)
    V = gathered_rows(v, comm)
    _, U = np.linalg.eigh(A.astype(np.complex128))
    # Eigenvector k against numpy's, through the projectors v v^H (phase-free).
    for k in range(N):
        p, q = np.outer(V[:, k], V[:, k].conj()), np.outer(U[:, k], U[:, k].conj())
        assert np.linalg.norm(p - q) < 100 * tol, k
    np.testing.assert_allclose(V.conj().T @ V, np.eye(N), atol=100 * tol)


@needs_mkl
@pytest.mark.parametrize("op", ["potrf_solve", "heevd"])
def test_handler_memory_is_about_one_share_beside_xla(comm, op):
    # The redistribution moves one column panel at a time: beside XLA's buffers the handler
    # holds its block-cyclic piece (plus Z and the workspace for eigh) and one panel's send
    # and receive buffers, not three shares as when the whole matrix went through one
    # exchange. Uneven rows; the solve checked against numpy too (the panels cover every
    # column once).
    n, block = 256, 8
    sizes, mine = split(comm, n)
    A, b = hpd(n, np.float64), rhs(n, 2, np.float64)
    share = max(sizes) * n * 8  # bytes of this rank's rows of A, the largest over the ranks
    engine.handler_memory(reset_peak=True)
    if op == "potrf_solve":
        x, info = jax.jit(lambda a, v: engine.potrf_solve(a, v, sizes, comm, block=block))(A[mine], b[mine])
        assert int(info) == 0
        assert relative_error(gathered_rows(x, comm), np.linalg.solve(A, b)) < 1e-10
        pieces = 1.0  # the block-cyclic A (B's piece is small)
    else:
        w, v, info = jax.jit(lambda a: engine.heevd(a, sizes, comm, block=block))(A[mine])
        assert int(info) == 0
        np.testing.assert_allclose(np.asarray(w), np.linalg.eigvalsh(A), rtol=1e-10, atol=1e-10)
        pieces = 2.0 + 2.2  # A, Z and p?syevd's workspace (about 2 shares)
    live, peak = engine.handler_memory()
    assert live == 0  # everything freed when the call returns
    cyclic = max(comm.allgather(peak))  # the largest over the ranks, as a share bound
    # block-cyclic shares are not row shares: allow one block row/column of slack per piece
    slack = 2 * block * n * 8
    assert cyclic <= pieces * share + 0.4 * share + pieces * slack + 2 * n * 8 * 4, (cyclic, share)
    # and the accounting sees the pieces: at least this rank's block-cyclic part of A
    assert min(comm.allgather(peak)) >= 0.5 * n * n * 8 / comm.Get_size(), peak


@needs_mkl
@pytest.mark.parametrize("orientation", ["rows", "columns"])
def test_every_grid_shape_gives_the_same_answer(comm, orientation):
    """P x 1 and 1 x P grids (the default is the squarest): the redistribution is right
    whichever way the grid lies."""
    P = comm.Get_size()
    grid = (P, 1) if orientation == "rows" else (1, P)
    sizes, mine = split(comm)
    A, B = hpd(N, np.float64), rhs(N, 2, np.float64)
    x, info = engine.potrf_solve(A[mine], B[mine], sizes, comm, block=3, grid=grid)
    assert int(info) == 0
    assert relative_error(gathered_rows(x, comm), np.linalg.solve(A, B)) < 1e-10
    w, v, info = engine.heevd(A[mine], sizes, comm, block=5, grid=grid)
    assert int(info) == 0
    np.testing.assert_allclose(np.asarray(w), np.linalg.eigvalsh(A), atol=1e-10)


@needs_mkl
def test_ordered_with_other_collectives_and_repeatable(comm):
    """One program: allreduce, a solve, allreduce of the solution, eigh, allreduce; run
    twice in a row, each run the same values. The token orders the ScaLAPACK calls with
    the program's other collectives (a wrong order would pair the allreduce with
    ScaLAPACK's messages: wrong values or a hang)."""
    sizes, mine = split(comm)
    A, B = hpd(N, np.float64), rhs(N, 2, np.float64)

    @jax.jit
    def program(a, b):
        scale = allreduce(jnp.ones(()), comm=comm)  # P
        x, info1 = engine.potrf_solve(a * scale, b, sizes, comm, block=4)
        total = allreduce(jnp.sum(x), comm=comm)
        w, v, info2 = engine.heevd(a, sizes, comm, block=4)
        norm = allreduce(jnp.sum(jnp.abs(v) ** 2), comm=comm)
        return x, total, w, norm, info1 + info2

    P = comm.Get_size()
    x_ref = np.linalg.solve(P * A, B)
    for _ in range(2):
        x, total, w, norm, info = program(A[mine], B[mine])
        assert int(info) == 0
        assert relative_error(gathered_rows(x, comm), x_ref) < 1e-10
        np.testing.assert_allclose(float(total), x_ref.sum(), rtol=1e-10)
        np.testing.assert_allclose(np.asarray(w), np.linalg.eigvalsh(A), atol=1e-10)
        np.testing.assert_allclose(float(norm), N, rtol=1e-10)  # orthonormal columns
    for _ in range(2):  # and eagerly, twice
        x, info = engine.potrf_solve(A[mine], B[mine], sizes, comm, block=4)
        assert int(info) == 0
        assert relative_error(gathered_rows(x, comm), np.linalg.solve(A, B)) < 1e-10


@needs_mkl
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_failures_report_info_on_every_rank_and_nan(comm, mode):
    sizes, mine = split(comm)
    A = hpd(N, np.float64)
    A[20, 20] = -50.0  # not positive definite: the leading minor of order 21 is the first that fails
    b = rhs(N, 2, np.float64)
    x, info = run(mode, lambda a, b: engine.potrf_solve(a, b, sizes, comm, block=4), A[mine], b[mine])
    assert int(info) == 21
    assert_same_everywhere(np.asarray(info), comm)
    assert np.isnan(np.asarray(x)).all()

    S = general(N, np.float64)
    S[:, 7] = 0.0  # singular: a zero column gives an exactly zero pivot, U(8, 8) = 0
    x, info = run(mode, lambda a, b: engine.gesv(a, b, sizes, comm, block=4), S[mine], b[mine])
    assert int(info) == 8  # (MKL's own INFO was 0 here: csrc/scalapack.cc FirstBadPivot)
    assert_same_everywhere(np.asarray(info), comm)
    assert np.isnan(np.asarray(x)).all()


@needs_mkl
def test_one_rank_communicator_beside_the_world():
    """Each rank solves its own whole system on MPI.COMM_SELF (a 1 x 1 grid), independently."""
    r = MPI.COMM_WORLD.Get_rank()
    A, B = hpd(16, np.complex128, seed=10 + r), rhs(16, 1, np.complex128, seed=20 + r)
    x, info = jax.jit(lambda a, b: engine.potrf_solve(a, b, (16,), MPI.COMM_SELF))(A, B)
    assert int(info) == 0 and relative_error(np.asarray(x), np.linalg.solve(A, B)) < 1e-10


@needs_mkl
def test_default_grid_and_block():
    assert engine.default_grid(1) == (1, 1)
    assert engine.default_grid(2) == (1, 2)
    assert engine.default_grid(6) == (2, 3)
    assert engine.default_grid(7) == (1, 7)
    assert engine.default_block(4096, (1, 2)) == 64
    assert engine.default_block(10, (1, 2)) == 5


@needs_mkl
def test_bad_static_arguments_raise_on_every_rank(comm):
    sizes, mine = split(comm)
    A = hpd(N, np.float64)
    with pytest.raises(ValueError, match="sizes"):
        engine.potrf_solve(A[mine], A[mine, :1], sizes + (1,), comm)
    with pytest.raises(ValueError, match="grid"):
        engine.heevd(A[mine], sizes, comm, grid=(comm.Get_size() + 1, 1))
    with pytest.raises(ValueError, match="N = sum"):
        engine.gesv(A[mine, :-1], A[mine, :1], sizes, comm)


@needs_mkl
def test_ranks_that_disagree_fail_together(comm):
    """Ranks passing different blocks would hand ScaLAPACK different layouts (wrong results or
    a hang inside MKL); the handler's signature check refuses the call on every rank first."""
    if comm.Get_size() == 1:
        pytest.skip("needs two ranks to disagree")
    sizes, mine = split(comm)
    A, b = hpd(N, np.float64), rhs(N, 1, np.float64)
    block = 4 + comm.Get_rank()
    failure = failure_of(lambda: engine.potrf_solve(A[mine], b[mine], sizes, comm, block=block)[0].block_until_ready(),
                         "mismatched communication")
    assert_no_failures(failure, comm)
    x, info = engine.potrf_solve(A[mine], b[mine], sizes, comm, block=4)  # and the communicator still works
    assert int(info) == 0 and relative_error(gathered_rows(x, comm), np.linalg.solve(A, b)) < 1e-10


def test_without_mkl_the_entry_points_raise_importerror(monkeypatch, tmp_path):
    """A directory without MKL: available() says so and how to install it; every entry
    point raises an ImportError naming the package (on every rank alike)."""
    monkeypatch.setenv("DISTLINALG_MKL_LIB_DIR", str(tmp_path))
    ok, message = engine._load()
    assert not ok and "make scalapack" in message and engine.MKL_REQUIREMENT in message
    monkeypatch.setattr(engine, "_status", (False, message))
    a = np.eye(2)
    for call in (lambda: engine.potrf_solve(a, a, (2,), MPI.COMM_SELF),
                 lambda: engine.gesv(a, a, (2,), MPI.COMM_SELF),
                 lambda: engine.heevd(a, (2,), MPI.COMM_SELF)):
        with pytest.raises(ImportError, match="mkl") as raised:
            call()
        assert raised.value.name == "mkl"
