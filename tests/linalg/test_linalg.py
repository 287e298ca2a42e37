"""distlinalg.linalg on a matrix held by rows, against numpy/jax on the gathered matrix.

Every test runs on an uneven split of the rows (1:2 at 2 ranks, 0:1:2 from 3
ranks: rank 0 then holds no rows), with distlinalg's own engine and with the
default ("auto": ScaLAPACK where it loads), eagerly and inside jit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import distlinalg.linalg as dll
from distlinalg.comm import allreduce
from conftest import assert_no_failures, failure_of, gather_global, uneven_partition

N = 23
ENGINES = ["distlinalg", "auto"]
# Complex cases add no new messages beyond 2 ranks (the same schedule, twice the bytes):
# they run at 1 and 2 ranks, the real ones at 3 too (where rank 0 holds no rows).
REAL_AND_COMPLEX = [False, pytest.param(True, marks=pytest.mark.max_ranks(2))]


def rows(comm):
    p = uneven_partition(N, comm.Get_size())
    r = comm.Get_rank()
    return p, slice(p.starts[r], p.starts[r + 1])


def matrices(kind, complex_, seed=0, n=N):
    rng = np.random.default_rng(seed)
    M = rng.standard_normal((n, n)) + (1j * rng.standard_normal((n, n)) if complex_ else 0)
    if kind == "pos":
        return M @ M.conj().T / n + np.diag(np.linspace(0.5, 2.0, n))
    if kind == "her":
        return (M + M.conj().T) / 2
    return M + 2 * np.eye(n)


def right_hand_side(complex_, m, seed=1, n=N):
    rng = np.random.default_rng(seed)
    shape = (n,) if m is None else (n, m)
    return rng.standard_normal(shape) + (1j * rng.standard_normal(shape) if complex_ else 0)


def gathered(local, p, comm):
    """The rows of every rank, concatenated (a rank may hold none)."""
    return np.concatenate(list(comm.allgather(np.asarray(local))), axis=0)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("complex_", REAL_AND_COMPLEX, ids=["real", "complex"])
def test_solves_match_numpy(comm, engine, complex_):
    p, mine = rows(comm)
    for kind, call in [("pos", lambda A, b: dll.cholesky_solve(A, b, comm=comm, engine=engine, block_size=6)),
                       ("her", lambda A, b: dll.solve(A, b, assume_a="her", comm=comm, engine=engine, block_size=8)),
                       ("gen", lambda A, b: dll.solve(A, b, comm=comm, engine=engine, block_size=6))]:
        A = matrices(kind, complex_)
        for m, run in ((None, jax.jit(call)), (3, call)):  # inside jit, and eagerly
            b = right_hand_side(complex_, m)
            expected = np.linalg.solve(A, b)
            for _ in range(2):  # the second call runs the cached program
                x = run(jnp.asarray(A[mine]), jnp.asarray(b[mine]))
                assert x.shape == b[mine].shape
                np.testing.assert_allclose(gathered(x, p, comm), expected, rtol=1e-10, atol=1e-12,
                                           err_msg=f"{kind}, m={m}")


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("complex_", REAL_AND_COMPLEX, ids=["real", "complex"])
def test_eigh_matches_numpy(comm, engine, complex_):
    p, mine = rows(comm)
    A = matrices("her", complex_)
    w_ref, V_ref = np.linalg.eigh(A)
    for run in (lambda a: dll.eigh(a, comm=comm, engine=engine), jax.jit(lambda a: dll.eigh(a, comm=comm, engine=engine))):
        w, V = run(jnp.asarray(A[mine]))
        assert w.shape == (N,) and V.shape == (p.size_of(comm.Get_rank()), N)
        np.testing.assert_allclose(w, w_ref, rtol=1e-10, atol=1e-12)
        assert_no_failures("" if np.array_equal(gather_global(w, comm)[0], np.asarray(w)) else "w differs", comm)
        V_all = gathered(V, p, comm)
        np.testing.assert_allclose(V_all.conj().T @ V_all, np.eye(N), atol=1e-12)
        np.testing.assert_allclose(np.abs(V_all.conj().T @ V_ref), np.eye(N), atol=1e-10)  # distinct eigenvalues
        np.testing.assert_allclose(V_all @ np.diag(w) @ V_all.conj().T, A, atol=1e-11)


def test_pinv_smooth_is_netkets_formula(comm):
    p, mine = rows(comm)
    rng = np.random.default_rng(3)
    Q, _ = np.linalg.qr(rng.standard_normal((N, N)))
    evals = np.logspace(-16, 0, N)  # some below rtol, some in the smooth cut-off
    A = (Q * evals) @ Q.T
    b = rng.standard_normal(N)
    rtol, rtol_smooth = 1e-12, 1e-6
    w, V = np.linalg.eigh(A)
    inverse = np.where(np.abs(w / w[-1]) > rtol, 1 / w, 0) / (1 + (rtol_smooth / np.abs(w / w[-1])) ** 6)
    expected = V @ (inverse * (V.T @ b))
    x, info = jax.jit(lambda a, v: dll.pinv_smooth(a, v, rtol=rtol, rtol_smooth=rtol_smooth, comm=comm,
                                                   engine="distlinalg"))(jnp.asarray(A[mine]), jnp.asarray(b[mine]))
    # x weighs eigenvectors by up to 1/λ ≈ 1e6 (the smooth cut-off): errors of ε‖A‖ in the
    # eigenpairs show 1e6 times larger here, for numpy's reference as for the engines.
    np.testing.assert_allclose(gathered(x, p, comm), expected, rtol=1e-6, atol=1e-6 * np.abs(expected).max())
    assert int(info["rank"]) == int(np.sum(w > rtol * w[-1]))
    np.testing.assert_allclose(float(info["eval_max"]), w[-1], rtol=1e-12)


@pytest.mark.parametrize("kind", ["pos", "gen", "eigh"])
@pytest.mark.parametrize("complex_", REAL_AND_COMPLEX, ids=["real", "complex"])
def test_derivatives_match_jax_on_the_gathered_matrix(comm, kind, complex_):
    """jax.grad (reverse) and jax.jvp (forward) in A and b against jax's own solve/eigh of the
    gathered matrix; the loss is the sum over ranks of each rank's share (docs/ad.md)."""
    p, mine = rows(comm)
    size = comm.Get_size()
    rng = np.random.default_rng(5)
    A = matrices("her" if kind == "eigh" else kind, complex_)
    b = right_hand_side(complex_, None)
    c = rng.standard_normal(N)
    D = rng.standard_normal((N, N))

    def reference(A, b):
        if kind == "eigh":
            w, V = jnp.linalg.eigh(A)
            return jnp.sum(w * c) + jnp.sum(jnp.abs(V) ** 2 * D)  # invariant under the eigenvectors' phases
        x = jnp.linalg.solve(A, b)  # (jax.scipy.linalg.solve(assume_a="pos") transposes complex A wrongly)
        return jnp.real(jnp.sum(x * c)) + jnp.imag(jnp.sum(x * c))

    def share(A_rows, b_rows):
        if kind == "eigh":
            w, V = dll.eigh(A_rows, comm=comm, engine="distlinalg")
            return jnp.sum(w * c) / size + jnp.sum(jnp.abs(V) ** 2 * D[mine])
        if kind == "pos":
            x = dll.cholesky_solve(A_rows, b_rows, comm=comm, engine="distlinalg", block_size=6)
        else:
            x = dll.solve(A_rows, b_rows, comm=comm, engine="distlinalg", block_size=8)
        return jnp.real(jnp.sum(x * c[mine])) + jnp.imag(jnp.sum(x * c[mine]))

    A_j, b_j = jnp.asarray(A), jnp.asarray(b)
    gA, gb = jax.grad(reference, argnums=(0, 1))(A_j, b_j)
    hA, hb = jax.jit(jax.grad(share, argnums=(0, 1)))(A_j[mine], b_j[mine])
    np.testing.assert_allclose(hA, np.asarray(gA)[mine], rtol=1e-9, atol=1e-10)
    if kind != "eigh":
        np.testing.assert_allclose(hb, np.asarray(gb)[mine], rtol=1e-9, atol=1e-10)
    dA = jnp.asarray(matrices("her" if kind == "eigh" else "gen", complex_, seed=9))
    db = jnp.asarray(right_hand_side(complex_, None, seed=10))
    expected = jax.jvp(reference, (A_j, b_j), (dA, db))[1]
    tangent = jax.jvp(share, (A_j[mine], b_j[mine]), (dA[mine], db[mine]))[1]
    np.testing.assert_allclose(float(allreduce(tangent, comm=comm)), float(expected), rtol=1e-9, atol=1e-10)


def test_ordered_with_other_collectives_in_one_program(comm):
    """A solve and an unrelated allreduce in one jit, on ranks with different shapes, run
    in program order on every rank (twice, the second from the cache)."""
    p, mine = rows(comm)
    A, b = matrices("pos", False), right_hand_side(False, None)

    @jax.jit
    def program(A_rows, b_rows, v):
        total = allreduce(v, comm=comm)
        x = dll.cholesky_solve(A_rows, b_rows, comm=comm, engine="distlinalg", block_size=6)
        w, _ = dll.eigh(A_rows, comm=comm, engine="distlinalg")
        return x, total, w

    for _ in range(2):
        v = jnp.arange(4.0) + comm.Get_rank()
        x, total, w = program(jnp.asarray(A[mine]), jnp.asarray(b[mine]), v)
        np.testing.assert_allclose(gathered(x, p, comm), np.linalg.solve(A, b), rtol=1e-10)
        np.testing.assert_allclose(total, sum(np.arange(4.0) + r for r in range(comm.Get_size())))
        np.testing.assert_allclose(w, np.linalg.eigvalsh(A), rtol=1e-10)


def test_memory_per_rank_falls_with_the_ranks(comm):
    """No N × N buffer on any rank: the compiled factorisation's temporaries are O(N² / P)."""
    size, r = comm.Get_size(), comm.Get_rank()
    if size == 1:
        pytest.skip("one rank: LAPACK")
    n = 256
    p = uneven_partition(n, size)
    A = jnp.eye(n)[p.starts[r] : p.starts[r + 1]] * 2.0
    b = jnp.ones(p.size_of(r))
    compiled = jax.jit(lambda a, v: dll.cholesky_solve(a, v, comm=comm, engine="distlinalg")).lower(A, b).compile()
    temporaries = compiled.memory_analysis().temp_size_in_bytes
    assert temporaries < 3.0 * max(p.sizes) * n * A.dtype.itemsize, temporaries


def test_bad_shapes_raise_on_every_rank(comm):
    size, r = comm.Get_size(), comm.Get_rank()
    p, mine = rows(comm)
    A = matrices("pos", False)
    # the rows do not add up to a square (every rank holds one row too many... or the last one too few)
    extra = A[mine] if r != size - 1 else np.concatenate([A[mine], A[:1]])
    failure = failure_of(lambda: dll.cholesky_solve(jnp.asarray(extra), jnp.ones(extra.shape[0]), comm=comm),
                         "do not add up to a square")
    assert_no_failures(failure, comm)
    if size > 1:  # different N on different ranks
        wide = A[mine] if r != 1 else np.pad(A[mine], ((0, 0), (0, 1)))
        failure = failure_of(lambda: dll.eigh(jnp.asarray(wide), comm=comm), "different lengths N")
        assert_no_failures(failure, comm)
    # b with the wrong number of rows on one rank only
    b = np.ones(p.size_of(r) + (1 if r == size - 1 else 0))
    failure = failure_of(lambda: dll.solve(jnp.asarray(A[mine]), jnp.asarray(b), comm=comm), "right-hand side")
    assert_no_failures(failure, comm)
    failure = failure_of(lambda: dll.solve(jnp.asarray(A[mine]), jnp.ones(p.size_of(r)), assume_a="sy", comm=comm),
                         "assume_a")
    assert_no_failures(failure, comm)
    if size > 1:  # options that set the schedule of messages, differing by rank
        for call in (lambda: dll.cholesky_solve(jnp.asarray(A[mine]), jnp.ones(p.size_of(r)), comm=comm,
                                                engine="distlinalg", block_size=4 + r),
                     lambda: dll.solve(jnp.asarray(A[mine]), jnp.ones(p.size_of(r)), comm=comm,
                                       assume_a="gen" if r else "pos"),
                     lambda: dll.eigh(jnp.asarray(A[mine]), comm=comm, engine="distlinalg" if r else "auto")):
            assert_no_failures(failure_of(call, "the ranks passed different engine, block_size"), comm)


@pytest.mark.parametrize("engine", ENGINES)
def test_not_positive_definite_and_singular(comm, engine):
    """Eagerly: LinAlgError on every rank. Inside jit: NaN and a reason code, identical on every rank."""
    p, mine = rows(comm)
    A = matrices("her", False)  # indefinite
    b = jnp.ones(p.size_of(comm.Get_rank()))
    failure = failure_of(lambda: dll.cholesky_solve(jnp.asarray(A[mine]), b, comm=comm, engine=engine),
                         "not positive definite")
    assert_no_failures(failure, comm)
    x, info = jax.jit(lambda a, v: dll.cholesky_solve(a, v, comm=comm, engine=engine, return_info=True))(
        jnp.asarray(A[mine]), b)
    assert int(info.reason) == dll.Reason.NOT_POSITIVE_DEFINITE
    assert bool(jnp.all(jnp.isnan(x)))
    singular = A.copy()
    singular[-1] = 0  # a zero row: the last pivot is exactly zero in any engine
    x, info = jax.jit(lambda a, v: dll.solve(a, v, comm=comm, engine=engine, return_info=True))(
        jnp.asarray(singular[mine]), b)
    assert int(info.reason) == dll.Reason.SINGULAR, (int(info.reason), info.engine)
    codes = gather_global(int(info.reason), comm)
    assert (codes == codes[0]).all()


@pytest.mark.parametrize("engine", ENGINES)
def test_eigh_of_a_repeated_eigenvalue(comm, engine):
    """A low-rank matrix plus a shift (a 20-fold eigenvalue, as an NTK's spectrum has):
    the eigenvectors of the repeated eigenvalue are any basis, but A V = V diag(w) and V
    unitary. (Jacobi rotating already orthogonal pairs by eigh's arbitrary basis once
    stopped with a wrong V here.)"""
    p, mine = rows(comm)
    G = np.random.default_rng(7).standard_normal((N, 3))
    A = G @ G.T / 3 + 0.5 * np.eye(N)
    w, V = jax.jit(lambda a: dll.eigh(a, comm=comm, engine=engine))(jnp.asarray(A[mine]))
    np.testing.assert_allclose(w, np.linalg.eigvalsh(A), rtol=1e-10, atol=1e-12)
    V_all = gathered(V, p, comm)
    np.testing.assert_allclose(V_all.T @ V_all, np.eye(N), atol=1e-12)
    np.testing.assert_allclose(A @ V_all, V_all * np.asarray(w), atol=1e-11)
