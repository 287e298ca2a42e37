"""GMRES and BiCGStab across ranks against numpy/scipy on the gathered global system.

Nonsymmetric systems in both layouts, pytrees, complex, preconditioned,
gradients in both modes (including a replicated operator whose matvec
communicates and is not symmetric: the transposed solve needs the matrix
transpose, not each rank's share of the program's adjoint), vmap, the
reasons, errors on every rank, and the jax.scipy calling conventions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse.linalg

import distlinalg
from distlinalg.comm import allreduce
from distlinalg.operators import dense_rows
from distlinalg.solvers import Reason
from conftest import gather_global

N = 12

SOLVERS = {
    "gmres": lambda *a, **k: distlinalg.gmres(*a, **k),
    "gmres_incremental": lambda *a, **k: distlinalg.gmres(*a, solve_method="incremental", **k),
    "bicgstab": lambda *a, **k: distlinalg.bicgstab(*a, **k),
}


def nonsymmetric(seed=0, n=N, complex_=False):
    """Well-conditioned, clearly nonsymmetric: diagonal dominance plus a random part."""
    rng = np.random.default_rng(seed)
    A = rng.standard_normal((n, n)) / np.sqrt(n)
    if complex_:
        A = A + 1j * rng.standard_normal((n, n)) / np.sqrt(n)
    return A + np.diag(np.linspace(2.0, 4.0, n))


def rows_of(rank, size, n=N):
    return np.array_split(np.arange(n), size)[rank]


def assert_same_on_every_rank(info, comm):
    everyone = gather_global(np.array([info.iterations, info.residual_norm, info.reason], float), comm)
    assert (everyone == everyone[0]).all(), everyone


@pytest.mark.parametrize("solver", list(SOLVERS))
@pytest.mark.parametrize("complex_", [pytest.param(False, marks=pytest.mark.max_ranks(2)), True])
@pytest.mark.parametrize("layout", [pytest.param("replicated", marks=pytest.mark.max_ranks(2)), "sharded"])
def test_against_numpy(comm, rank, size, solver, complex_, layout):
    A = nonsymmetric(1, complex_=complex_)
    rng = np.random.default_rng(2)
    b = rng.standard_normal(N) + (1j * rng.standard_normal(N) if complex_ else 0)
    exact = np.linalg.solve(A, b)
    if layout == "replicated":
        x, info = jax.jit(lambda b: SOLVERS[solver](A, b, rtol=1e-11, restart=N, comm=comm)
                          if "gmres" in solver else SOLVERS[solver](A, b, rtol=1e-11, comm=comm))(b)
        np.testing.assert_allclose(x, exact, rtol=1e-8, atol=1e-10)
    else:
        rows = rows_of(rank, size)
        op = dense_rows(A[rows], comm=comm)
        kwargs = dict(rtol=1e-11, comm=comm)
        x, info = jax.jit(lambda b: SOLVERS[solver](op, b, **kwargs))(b[rows])
        np.testing.assert_allclose(x, exact[rows], rtol=1e-8, atol=1e-10)
    assert bool(info.converged) and int(info.reason) == Reason.CONVERGED_RTOL, info
    assert info.residual_norm <= 1e-11 * np.linalg.norm(b) * 1.01
    assert_same_on_every_rank(info, comm)


@pytest.mark.max_ranks(1)  # replicated and rank-independent: the iterates, not the distribution
@pytest.mark.parametrize("maxiter,restart", [(1, 1), (2, 1), (1, 3), (2, 4)])
@pytest.mark.parametrize("preconditioned", [False, True])
def test_gmres_iterates_match_scipy(comm, maxiter, restart, preconditioned):
    """Same restarts, same left preconditioning, same inner tolerance control: same x."""
    A = nonsymmetric(3)
    b = np.random.default_rng(4).standard_normal(N)
    M = np.linalg.inv(nonsymmetric(5)) if preconditioned else None
    expected, _ = scipy.sparse.linalg.gmres(A, b, M=M, restart=restart, maxiter=maxiter, atol=0.0)
    for method in ("batched", "incremental"):
        x, info = distlinalg.gmres(A, b, M=M, restart=restart, maxiter=maxiter, solve_method=method, comm=comm)
        np.testing.assert_allclose(x, expected, rtol=1e-10, atol=1e-12)
        assert int(info.reason) == Reason.DIVERGED_MAX_IT


@pytest.mark.parametrize("maxiter", [1, 3])
@pytest.mark.parametrize("preconditioned", [False, True])
@pytest.mark.parametrize("layout", [pytest.param("replicated", marks=pytest.mark.max_ranks(2)), "sharded"])
def test_bicgstab_iterates_match_scipy(comm, rank, size, maxiter, preconditioned, layout):
    A = nonsymmetric(6, complex_=True)
    rng = np.random.default_rng(7)
    b = rng.standard_normal(N) + 1j * rng.standard_normal(N)
    D = np.diag(1 / np.diag(A))
    expected, _ = scipy.sparse.linalg.bicgstab(A, b, M=D if preconditioned else None, maxiter=maxiter, atol=0.0)
    if layout == "replicated":
        x, info = distlinalg.bicgstab(A, b, M=D if preconditioned else None, maxiter=maxiter, comm=comm)
    else:
        rows = rows_of(rank, size)
        d = np.diag(D)[rows]
        x, info = distlinalg.bicgstab(dense_rows(A[rows], comm=comm), b[rows], maxiter=maxiter,
                                      M=(lambda v: d * v) if preconditioned else None, comm=comm)
        expected = expected[rows]
    np.testing.assert_allclose(x, expected, rtol=1e-10, atol=1e-12)
    assert int(info.iterations) == maxiter and int(info.reason) == Reason.DIVERGED_MAX_IT
    np.testing.assert_allclose(info.residual_norm, np.linalg.norm(b - A @ gather_full(x, layout, comm)), rtol=1e-8)


def gather_full(x, layout, comm):
    return np.asarray(x) if layout == "replicated" else np.concatenate(comm.allgather(np.asarray(x)))


@pytest.mark.max_ranks(2)  # replicated, rank-count independent beyond 2 (CI time)
@pytest.mark.parametrize("solver", list(SOLVERS))
def test_pytree_and_preconditioner(comm, solver):
    """A dict of two blocks coupled nonsymmetrically, with a Jacobi preconditioner."""
    A = nonsymmetric(8)
    n1 = 5

    def mv(v):
        flat = A @ jnp.concatenate([v["a"], v["b"]])
        return {"a": flat[:n1], "b": flat[n1:]}

    d = 1 / np.diag(A)
    M = lambda v: {"a": d[:n1] * v["a"], "b": d[n1:] * v["b"]}  # noqa: E731
    rhs = np.random.default_rng(9).standard_normal(N)
    x, info = SOLVERS[solver](mv, {"a": rhs[:n1], "b": rhs[n1:]}, M=M, rtol=1e-11, comm=comm)
    exact = np.linalg.solve(A, rhs)
    np.testing.assert_allclose(np.concatenate([x["a"], x["b"]]), exact, rtol=1e-8)
    assert bool(info.converged)


@pytest.mark.parametrize("solver", ["gmres", pytest.param("gmres_incremental", marks=pytest.mark.max_ranks(2)),
                                    "bicgstab"])
def test_gradients_through_nonsymmetric_allreduce_operator(comm, rank, size, solver):
    """Replicated layout, A(θ) = Σ_r θ_r G_r + 2I with nonsymmetric G_r (the matvec
    allreduces), rank-dependent losses c_r·x. Reverse mode needs Aᵀ; JAX's
    transpose of the matvec is each rank's share of the program's adjoint.
    Reference: the stacked global program in jax, both modes."""
    rng = np.random.default_rng(30 + rank)
    G = jnp.asarray(rng.standard_normal((N, N)) / (2 * np.sqrt(N) * size))
    G_all = jnp.asarray(gather_global(G, comm))
    c_all = np.random.default_rng(31).standard_normal((size, N))
    b = jnp.asarray(np.random.default_rng(32).standard_normal(N))
    theta = 1.0 + 0.2 * rank
    thetas = jnp.asarray(gather_global(np.array(theta), comm))

    def local(theta, b):
        mv = lambda v: allreduce(theta * (G @ v), comm=comm) + 2.0 * v  # noqa: E731
        x, _ = SOLVERS[solver](mv, b, rtol=1e-13, comm=comm)
        return jnp.dot(c_all[rank], x)

    def stacked(thetas, b):
        A = jnp.einsum("r,rij->ij", thetas, G_all) + 2.0 * jnp.eye(N)
        return jnp.sum(jnp.asarray(c_all) @ jnp.linalg.solve(A, b))

    g_theta, g_b = jax.jit(jax.grad(local, argnums=(0, 1)))(theta, b)
    r_theta, r_b = jax.grad(stacked, argnums=(0, 1))(thetas, b)
    np.testing.assert_allclose(g_theta, r_theta[rank], rtol=1e-7)
    np.testing.assert_allclose(allreduce(g_b, comm=comm), r_b, rtol=1e-7)
    # Forward mode: every rank moves its own θ_r by 1.
    _, tangent = jax.jvp(lambda t: local(t, b), (theta,), (1.0,))
    A = np.einsum("r,rij->ij", np.asarray(thetas), np.asarray(G_all)) + 2.0 * np.eye(N)
    x = np.linalg.solve(A, np.asarray(b))
    x_dot = -np.linalg.solve(A, sum(g @ x for g in np.asarray(G_all)))
    np.testing.assert_allclose(tangent, c_all[rank] @ x_dot, rtol=1e-7)


@pytest.mark.parametrize("solver", ["gmres", "bicgstab"])
def test_gradient_sharded_layout_complex(comm, rank, size, solver):
    """Sharded rows of a complex nonsymmetric A scaled by s; loss Re Σ c·x over all ranks."""
    A = nonsymmetric(11, complex_=True)
    rng = np.random.default_rng(12)
    b = rng.standard_normal(N) + 1j * rng.standard_normal(N)
    c = rng.standard_normal(N) + 1j * rng.standard_normal(N)
    rows = rows_of(rank, size)
    op = dense_rows(A[rows], comm=comm)

    def local(scale, b_block):
        x, _ = SOLVERS[solver](lambda v: scale * op.matvec(v), b_block, rtol=1e-13, layout="sharded", comm=comm)
        return jnp.real(allreduce(jnp.sum(c[rows] * x), comm=comm))

    def reference(scale, b):
        return jnp.real(jnp.sum(c * jnp.linalg.solve(scale * A, b)))

    g_scale, g_b = jax.grad(local, argnums=(0, 1))(2.0, jnp.asarray(b[rows]))
    r_scale, r_b = jax.grad(reference, argnums=(0, 1))(2.0, jnp.asarray(b))
    np.testing.assert_allclose(allreduce(g_scale, comm=comm), size * r_scale, rtol=1e-7)
    np.testing.assert_allclose(g_b, size * r_b[rows], rtol=1e-7)
    _, t = jax.jvp(lambda s: local(s, jnp.asarray(b[rows])), (2.0,), (1.0,))
    _, r_t = jax.jvp(lambda s: reference(s, jnp.asarray(b)), (2.0,), (1.0,))
    np.testing.assert_allclose(t, r_t, rtol=1e-7)


@pytest.mark.parametrize("solver", list(SOLVERS))
@pytest.mark.parametrize("layout", [pytest.param("replicated", marks=pytest.mark.max_ranks(2)), "sharded"])
def test_vmap_over_right_hand_sides(comm, rank, size, solver, layout):
    A = nonsymmetric(13)
    B = np.random.default_rng(14).standard_normal((3, N))
    B[1] *= 1e-3
    exact = np.linalg.solve(A, B.T).T
    if layout == "replicated":
        x, info = jax.vmap(lambda b: SOLVERS[solver](A, b, rtol=1e-11, comm=comm))(B)
    else:
        rows = rows_of(rank, size)
        op = dense_rows(A[rows], comm=comm)
        x, info = jax.vmap(lambda b: SOLVERS[solver](op, b, rtol=1e-11, comm=comm))(B[:, rows])
        exact = exact[:, rows]
    np.testing.assert_allclose(x, exact, rtol=1e-7, atol=1e-12)
    assert np.asarray(info.converged).all() and info.iterations.shape == (3,)


@pytest.mark.max_ranks(2)
def test_reasons(comm):
    # Singular A: GMRES exhausts the space with the residual above the tolerance.
    A = np.diag(np.r_[np.ones(N - 1), 0.0])
    b = np.ones(N)
    _, info = distlinalg.gmres(A, b, restart=N, comm=comm)
    assert int(info.reason) == Reason.DIVERGED_BREAKDOWN and not bool(info.converged)
    # Iteration limit.
    _, info = distlinalg.bicgstab(nonsymmetric(15), b, rtol=1e-14, maxiter=2, comm=comm)
    assert int(info.reason) == Reason.DIVERGED_MAX_IT and int(info.iterations) == 2
    # NaN in the operator.
    _, info = distlinalg.gmres(lambda v: v * jnp.nan, b, comm=comm)
    assert int(info.reason) == Reason.DIVERGED_NANORINF
    _, info = distlinalg.bicgstab(lambda v: v * jnp.nan, b, comm=comm)
    assert int(info.reason) == Reason.DIVERGED_NANORINF
    # atol decides.
    _, info = distlinalg.bicgstab(nonsymmetric(15), b, rtol=0.0, atol=1e-6, comm=comm)
    assert int(info.reason) == Reason.CONVERGED_ATOL
    # Zero right-hand side: x = 0 at once.
    x, info = distlinalg.gmres(nonsymmetric(15), np.zeros(N), comm=comm)
    assert bool(info.converged) and int(info.iterations) == 0 and not np.asarray(x).any()


@pytest.mark.parametrize("solver", list(SOLVERS))
def test_rank_local_operator_is_inconsistent(comm, rank, size, solver):
    """A "replicated" operator that differs per rank stops every rank alike."""
    A = nonsymmetric(16) * (1.0 + 0.5 * rank)
    _, info = SOLVERS[solver](A, np.ones(N), rtol=1e-10, comm=comm)
    assert_same_on_every_rank(info, comm)
    if size > 1:
        assert int(info.reason) == Reason.DIVERGED_INCONSISTENT_RANKS
    else:
        assert bool(info.converged)


@pytest.mark.max_ranks(2)
def test_history_and_monitor(comm, rank, capfd):
    A = nonsymmetric(17)
    _, info = distlinalg.gmres(A, np.ones(N), restart=4, history=30, monitor=True, comm=comm)
    k = int(info.iterations)
    assert np.isfinite(info.history[: k + 1]).all() and np.isnan(info.history[k + 1:]).all()
    jax.effects_barrier()
    out = capfd.readouterr().out
    assert ("gmres    1 KSP Residual norm" in out) == (rank == 0)
    _, info = distlinalg.bicgstab(A, np.ones(N), history=30, comm=comm)
    k = int(info.iterations)
    assert np.isfinite(info.history[: k + 1]).all()
    np.testing.assert_allclose(info.history[k], info.residual_norm)


def test_errors_on_every_rank(comm, rank, size):
    """Bad arguments raise on every rank, with jax.scipy's wording (also when one rank's are bad)."""
    b = np.ones(N)
    last = rank == size - 1
    with pytest.raises(ValueError, match="invalid solve_method"):
        distlinalg.gmres(np.eye(N), b, solve_method="qr", comm=comm)
    with pytest.raises(ValueError, match="restart must be an int >= 1"):
        distlinalg.gmres(np.eye(N), b, restart=0, comm=comm)
    for solver in ("gmres", "bicgstab"):
        with pytest.raises(ValueError, match="x0 and b must have matching tree structure"):
            SOLVERS[solver](lambda v: v, {"x": b}, {"y": b}, comm=comm)
        with pytest.raises(ValueError, match="must have matching shape"):
            SOLVERS[solver](lambda v: v, b, b[:, None], comm=comm)
        with pytest.raises(ValueError, match="must be a square matrix"):
            SOLVERS[solver](np.zeros((3, 2)), np.zeros(2), comm=comm)
        with pytest.raises(TypeError, match="linear operator must be either a function or ndarray"):
            SOLVERS[solver]([[1.0]], np.zeros(1), comm=comm)
        # Only the last rank's matrix is bad: every rank raises.
        bad = np.zeros((N, N + 1)) if last else np.eye(N)
        with pytest.raises(ValueError, match="square matrix" if last or size == 1 else "rank\\(s\\)"):
            SOLVERS[solver](bad, b, comm=comm)
        with pytest.raises(ValueError, match="rtol or atol must be positive"):
            SOLVERS[solver](np.eye(N), b, rtol=0.0, comm=comm)


class MatmulOnly:
    """An operator known only by ``@`` and ``shape`` (accepted by jax.scipy)."""

    def __init__(self, A):
        self.A = jnp.asarray(A)
        self.shape = self.A.shape

    def __matmul__(self, x):
        return self.A @ x


@pytest.mark.max_ranks(1)  # replicated, rank-independent
@pytest.mark.parametrize("solver", ["cg", "minres", "gmres", "bicgstab"])
def test_jax_scipy_conventions(comm, solver):
    """Matmul objects, matrix-shaped b, weak types and strict dtype promotion, for every solver."""
    fn = getattr(distlinalg, solver)
    B = jnp.arange(9.0).reshape(3, 3)
    x, _ = fn(MatmulOnly(2 * jnp.eye(3)), B, comm=comm)
    np.testing.assert_allclose(x, B / 2, rtol=1e-6)
    x, _ = fn(lambda v: 2 * v, 1.0, comm=comm)
    assert x.weak_type and float(x) == pytest.approx(0.5)
    A = nonsymmetric(18, n=4, complex_=True)
    A = A @ A.conj().T if solver in ("cg", "minres") else A
    rng = np.random.default_rng(19)
    b = (rng.standard_normal(4) + 1j * rng.standard_normal(4)).astype(np.complex64)
    with jax.numpy_dtype_promotion("strict"):
        x, info = jax.jit(lambda b: fn(jnp.asarray(A, jnp.complex64), b, rtol=1e-5, comm=comm))(b)
    assert x.dtype == jnp.complex64 and bool(info.converged)
    np.testing.assert_allclose(x, np.linalg.solve(A, b), rtol=1e-3)
