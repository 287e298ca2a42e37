"""Geometric multigrid, Chebyshev preconditioning and 3 × 3 stencil operators.

Every value is checked against numpy on the gathered grid: the transfers
against the bilinear interpolation matrix, the coarse operators against the
dense Galerkin product Pᵀ A P, the solves against numpy's solve. The grids
are split unevenly (from 3 ranks on, rank 0 holds no grid row), with odd
and even sizes.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import distlinalg as dl
from distlinalg.operators import Laplacian2D, Partition, laplacian_2d, operator_class, static, stencil_2d

from conftest import assert_no_failures, failure_of, uneven_partition

mg = sys.modules["distlinalg.solvers.multigrid"]


def whole(local, comm):
    """Every rank's block of a flat vector, concatenated (on every rank)."""
    return np.concatenate([np.asarray(x).reshape(-1) for x in comm.allgather(np.asarray(local))])


def mine(global_vector, partition: Partition, nx: int, rank: int):
    return jnp.asarray(global_vector[partition.starts[rank] * nx : partition.starts[rank + 1] * nx])


def interpolation(n: int) -> np.ndarray:
    """Bilinear interpolation from the (n//2)² grid of odd-numbered points to the n² grid (dense)."""
    P = np.zeros((n, n // 2))
    for J in range(n // 2):
        P[2 * J + 1, J] = 1
        P[2 * J, J] = 0.5
        if 2 * J + 2 < n:
            P[2 * J + 2, J] = 0.5
    return np.kron(P, P)


def dense_laplacian(n: int) -> np.ndarray:
    T = 2 * np.eye(n) - np.eye(n, k=1) - np.eye(n, k=-1)
    return np.kron(np.eye(n), T) + np.kron(T, np.eye(n))


@pytest.mark.parametrize("n", [9, 10])
def test_transfers_and_galerkin_operator_match_dense_reference(comm, rank, size, n):
    A = laplacian_2d(n, row_partition=uneven_partition(n, size))
    M = dl.solvers.multigrid(A, levels=2)
    fine, coarse = M.grids
    assert coarse.shape == (n // 2, n // 2)
    assert coarse.row_partition.starts == tuple(s // 2 for s in fine.row_partition.starts)
    P = interpolation(n)
    rng = np.random.default_rng(n)
    e, r = rng.standard_normal(P.shape[1]), rng.standard_normal(P.shape[0])
    prolonged = jax.jit(lambda v: mg.prolong(v, fine, coarse, A.comm))(mine(e, coarse.row_partition, n // 2, rank))
    restricted = jax.jit(lambda v: mg.restrict(v, fine, coarse, A.comm))(mine(r, fine.row_partition, n, rank))
    np.testing.assert_allclose(whole(prolonged, comm), P @ e, rtol=1e-14, atol=1e-14)
    np.testing.assert_allclose(whole(restricted, comm), P.T @ r, rtol=1e-14, atol=1e-14)
    # The coarse operator is the Galerkin product (stencil algebra).
    galerkin = P.T @ dense_laplacian(n) @ P
    v = rng.standard_normal(galerkin.shape[0])
    product = jax.jit(lambda S, v: S @ v)(M.coarse[0], mine(v, coarse.row_partition, n // 2, rank))
    np.testing.assert_allclose(whole(product, comm), galerkin @ v, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.asarray(M.upper), [2.0, np.abs(galerkin).sum(1).max() / galerkin[0, 0]],
                               rtol=1e-12)


def interpolation_1d(n: int) -> np.ndarray:
    P = np.zeros((n, n // 2))
    for J in range(n // 2):
        P[2 * J : 2 * J + 3, J] = [0.5, 1, 0.5][: min(3, n - 2 * J)]
    return P


@pytest.mark.parametrize("shape", [(9, 8), (10, 7)])
def test_galerkin_algebra_of_a_variable_nonsymmetric_stencil(comm, rank, size, shape):
    """R A P by stencil algebra (no product) against the dense Pᵀ A P, and the fine coefficients read
    from the operator against those found by 9 products (the path of operators without them)."""
    ny, nx = shape
    partition = uneven_partition(ny, size)
    rng = np.random.default_rng(ny * nx)
    c_global = rng.standard_normal((3, 3, ny, nx))
    c = jnp.asarray(c_global[:, :, partition.starts[rank] : partition.starts[rank + 1]])
    S = stencil_2d(c)
    grid = S.stencil_grid
    read = mg.stencil_coefficients(S, grid, S.comm, jnp.float64)
    probed = jax.jit(lambda S: mg.probe_coefficients(S.matvec, grid, S.comm, jnp.float64))(S)
    np.testing.assert_allclose(np.asarray(read), np.asarray(probed), rtol=1e-14, atol=1e-14)
    M = dl.solvers.multigrid(S, levels=2)
    coarse = M.grids[1]
    P = np.kron(interpolation_1d(ny), interpolation_1d(nx))
    galerkin = P.T @ np.asarray(mg.assemble_dense(jnp.asarray(c_global), (ny, nx))) @ P
    v = rng.standard_normal(galerkin.shape[0])
    local = mine(v, coarse.row_partition, nx // 2, rank)
    product = jax.jit(lambda C, v: C @ v)(M.coarse[0], local)
    np.testing.assert_allclose(whole(product, comm), galerkin @ v, rtol=1e-12, atol=1e-12)
    assert not M.coarse[0].symmetric  # the flags are A's


def test_preconditioner_is_symmetric_positive_definite(comm, rank, size):
    """M as a dense matrix (applied to every unit vector of the gathered grid): Mᵀ = M, M > 0;
    for the V- and W-cycles with both smoothers, 3 levels on a 12 × 12 grid."""
    n = 12
    A = laplacian_2d(n, row_partition=uneven_partition(n, size))
    partition = A.row_partition
    identity = np.eye(n * n)
    rows = slice(partition.starts[rank] * n, partition.starts[rank + 1] * n)
    for smoother, cycle in [("chebyshev", "V"), ("jacobi", "W")]:
        M = dl.solvers.multigrid(A, levels=3, smoother=smoother, cycle=cycle, degree=3)
        columns = jax.jit(jax.vmap(lambda M, v: M @ v, in_axes=(None, 1), out_axes=1))(M, jnp.asarray(identity[rows]))
        dense = np.concatenate(comm.allgather(np.asarray(columns)))
        np.testing.assert_allclose(dense, dense.T, atol=1e-12)
        assert np.linalg.eigvalsh(dense).min() > 0
        # The whole cycle is a good approximate inverse: the spectrum of M A clusters near 1.
        eig = np.linalg.eigvals(dense @ dense_laplacian(n)).real
        assert 0.5 < eig.min() and eig.max() < 1.05, (smoother, cycle, eig.min(), eig.max())


@pytest.mark.parametrize("n", [63, pytest.param(256, marks=pytest.mark.max_ranks(2))])
def test_cg_iterations_do_not_grow_with_the_grid(comm, rank, size, n):
    A = laplacian_2d(n, row_partition=uneven_partition(n, size))
    b = jnp.ones(A.input_structure.shape)
    solve = jax.jit(lambda A, b: dl.cg(A, b, M=dl.solvers.multigrid(A), rtol=1e-8))
    x, info = solve(A, b)
    assert bool(info.converged) and int(info.iterations) <= 10, int(info.iterations)
    residual = np.sqrt(comm.allreduce(float(jnp.sum((b - A @ x) ** 2))))
    assert residual <= 1e-8 * n  # the true residual, ‖b‖ = n


@pytest.mark.max_ranks(2)
def test_every_solver_takes_it_eagerly_and_in_jit(comm, rank, size):
    n = 20
    A = laplacian_2d(n, row_partition=uneven_partition(n, size))
    b_global = np.random.default_rng(0).standard_normal(n * n)
    b = mine(b_global, A.row_partition, n, rank)
    expected = np.linalg.solve(dense_laplacian(n), b_global)
    M = dl.solvers.multigrid(A, levels=2)  # eager build; one coarse level keeps the programs small
    x, info = dl.cg(A, b, M=M, rtol=1e-10)  # eager solve
    assert bool(info.converged)
    np.testing.assert_allclose(whole(x, comm), expected, rtol=1e-8, atol=1e-8)
    for solver in (dl.minres, dl.gmres, dl.bicgstab):
        x, info = jax.jit(lambda A, M, b, solver=solver: solver(A, b, M=M, rtol=1e-10))(A, M, b)
        assert bool(info.converged), solver
        np.testing.assert_allclose(whole(x, comm), expected, rtol=1e-8, atol=1e-8)


@pytest.mark.max_ranks(2)  # the eigensolvers' own suite covers 3 ranks; here the preconditioner is the point
def test_eigsh_with_multigrid_finds_the_smallest_eigenvalues(comm, rank, size):
    """LOBPCG preconditioned by multigrid, and shift-invert at σ = 0 with multigrid in the inner solves."""
    n, k = 24, 4
    A = laplacian_2d(n, row_partition=uneven_partition(n, size))
    M = dl.solvers.multigrid(A, levels=2)
    expected = np.linalg.eigvalsh(dense_laplacian(n))[:k]
    for options in (dict(which="SA", method="lobpcg"), dict(sigma=0.0)):
        w, _, info = jax.jit(lambda A, M: dl.eigsh(A, k, M=M, tol=1e-8, **options))(A, M)
        np.testing.assert_allclose(np.asarray(w), expected, rtol=1e-7)
        assert bool(info.converged), options


@pytest.mark.max_ranks(2)  # CI time (issue 55): M is a stop_gradient constant whatever the rank count; the cycles run at 3 ranks in this file's other tests
def test_derivatives_of_a_solve_do_not_see_the_preconditioner(comm, rank, size):
    n = 16
    A = laplacian_2d(n, row_partition=uneven_partition(n, size))
    b = mine(np.random.default_rng(1).standard_normal(n * n), A.row_partition, n, rank)
    weights = jnp.linspace(0.5, 1.5, b.shape[0])

    def loss(b, with_mg):
        M = dl.solvers.multigrid(A) if with_mg else None
        x, _ = dl.cg(A, b, M=M, rtol=1e-12)
        return jnp.sum(weights * x ** 2)

    grads = [jax.jit(jax.grad(loss), static_argnums=1)(b, flag) for flag in (True, False)]
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-8, atol=1e-10)
    tangent = jnp.cos(jnp.arange(b.shape[0]) + rank)
    jvps = [jax.jit(lambda b, t, flag=flag: jax.jvp(lambda b: loss(b, flag), (b,), (t,))[1])(b, tangent)
            for flag in (True, False)]
    np.testing.assert_allclose(jvps[0], jvps[1], rtol=1e-8)


@pytest.mark.max_ranks(2)
def test_stencil_2d_matches_its_dense_matrix_and_transposes(comm, rank, size):
    ny, nx = 7, 5
    partition = uneven_partition(ny, size)
    rows = partition.size_of(rank)
    rng = np.random.default_rng(3)
    c_global = rng.standard_normal((3, 3, ny, nx))
    c = jnp.asarray(c_global[:, :, partition.starts[rank] : partition.starts[rank + 1]])
    S = stencil_2d(c)
    assert S.stencil_grid.shape == (ny, nx) and S.row_partition == partition
    dense = np.asarray(mg.assemble_dense(jnp.asarray(c_global), (ny, nx)))
    # The dense reference, entry by entry.
    for (J, K, a, b) in [(0, 0, 1, 1), (3, 2, 0, 2), (6, 4, 2, 0)]:
        Jn, Kn = J + a - 1, K + b - 1
        expected = c_global[a, b, J, K] if 0 <= Jn < ny and 0 <= Kn < nx else 0.0
        assert dense[J * nx + K, (Jn % ny) * nx + Kn % nx] == expected
    v = rng.standard_normal(ny * nx)
    local = mine(v, partition, nx, rank)
    np.testing.assert_allclose(whole(jax.jit(lambda S, v: S @ v)(S, local), comm), dense @ v, rtol=1e-12)
    np.testing.assert_allclose(whole(S.T @ local, comm), dense.T @ v, rtol=1e-12)
    assert local.shape == (rows * nx,)


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.complex128])
def test_symmetric_stencil_matches_its_dense_matrix(comm, rank, size, dtype):
    """The half-stored stencil (multigrid's coarse levels) against the dense symmetric / Hermitian matrix."""
    ny, nx = 8, 5
    partition = uneven_partition(ny, size)
    rng = np.random.default_rng(5)
    c_global = rng.standard_normal((3, 3, ny, nx))
    if dtype == jnp.complex128:
        c_global = c_global + 1j * rng.standard_normal((3, 3, ny, nx))
    dense = np.asarray(mg.assemble_dense(jnp.asarray(c_global), (ny, nx)))
    dense = np.triu(dense, 1) + np.triu(dense, 1).conj().T + np.diag(np.real(np.diag(dense)))  # Hermitian
    # Its coefficients, back from the dense matrix (the couplings beyond the grid zero).
    full = np.zeros((3, 3, ny, nx), dense.dtype)
    for J in range(ny):
        for K in range(nx):
            for a in range(3):
                for b in range(3):
                    Jn, Kn = J + a - 1, K + b - 1
                    if 0 <= Jn < ny and 0 <= Kn < nx:
                        full[a, b, J, K] = dense[J * nx + K, Jn * nx + Kn]
    local = jnp.asarray(full[:, :, partition.starts[rank] : partition.starts[rank + 1]])
    grid = stencil_2d(local).stencil_grid
    S = dl.operators.symmetric_stencil(local, grid, hermitian=True)
    assert S.hermitian and S.symmetric == (dtype == jnp.float64)
    v = rng.standard_normal(ny * nx) + (1j * rng.standard_normal(ny * nx) if dtype == jnp.complex128 else 0)
    mine_v = mine(v, partition, nx, rank)
    np.testing.assert_allclose(whole(jax.jit(lambda S, v: S @ v)(S, mine_v), comm), dense @ v, rtol=1e-12)
    np.testing.assert_allclose(whole(S.T @ mine_v, comm), dense.T @ v, rtol=1e-12)
    np.testing.assert_allclose(np.asarray(S.stencil_coefficients()), np.asarray(local), rtol=1e-14, atol=1e-14)


@pytest.mark.max_ranks(2)  # no message of its own: nothing depends on the rank count beyond 2
def test_chebyshev_preconditioner(comm, rank, size):
    n = 24
    A = laplacian_2d(n, row_partition=uneven_partition(n, size))
    b = jnp.ones(A.input_structure.shape)
    M = dl.solvers.chebyshev(A, degree=4)  # bounds from Lanczos
    lo, hi = float(M.lo), float(M.hi)
    exact = np.linalg.eigvalsh(dense_laplacian(n))
    assert exact[-1] <= hi <= 1.2 * exact[-1] and np.isclose(lo, hi / 100)
    assert comm.allgather((lo, hi)) == [(lo, hi)] * size  # replicated
    solve = jax.jit(lambda A, M, b: dl.cg(A, b, M=M, rtol=1e-10))
    x, info = solve(A, M, b)
    _, plain = solve(A, None, b)
    assert bool(info.converged) and int(info.iterations) <= 0.6 * int(plain.iterations)
    np.testing.assert_allclose(whole(x, comm), np.linalg.solve(dense_laplacian(n), np.ones(n * n)), rtol=1e-8)
    # A replicated dense operator, bounds given: q(A) is symmetric positive definite.
    Q = np.random.default_rng(2).standard_normal((6, 6))
    D = Q @ Q.T + np.eye(6)
    top = np.linalg.eigvalsh(D)[-1]
    R = dl.solvers.chebyshev(jnp.asarray(D), degree=3, bounds=(0.5, top))
    q = np.asarray(jax.vmap(R.matvec, in_axes=1, out_axes=1)(jnp.eye(6)))
    np.testing.assert_allclose(q, q.T, atol=1e-12)
    assert np.linalg.eigvalsh(q).min() > 0


@pytest.mark.max_ranks(2)
@operator_class
class _WrongCoefficients(Laplacian2D):
    """A Laplacian whose stencil_coefficients() has one row too many where `wrong`."""

    wrong: bool = static(default=False)

    def stencil_coefficients(self):
        c = Laplacian2D.stencil_coefficients(self)
        return jnp.concatenate([c, c[:, :, :1]], axis=2) if self.wrong else c


def test_bad_input_raises_on_every_rank(comm, rank, size):
    A = laplacian_2d(16, row_partition=uneven_partition(16, size))
    cases = [
        (lambda: dl.solvers.multigrid(dl.operators.dense_rows(jnp.eye(4)[:2] if size == 2 else jnp.eye(4))),
         "must be a sharded operator on a grid"),
        (lambda: dl.solvers.multigrid(A, levels=0), "levels must be None or an int >= 1"),
        (lambda: dl.solvers.multigrid(A, levels=9), "has at most 5 levels"),
        (lambda: dl.solvers.multigrid(laplacian_2d(80), levels=1), "solved directly on every rank"),
        (lambda: dl.solvers.multigrid(A, smoother="sor"), "smoother must be one of"),
        (lambda: dl.solvers.multigrid(A, cycle="F"), "cycle must be one of"),
        (lambda: dl.solvers.multigrid(A, degree=2 + (rank == size - 1) * (size > 1)),
         "passed different options" if size > 1 else None),
        # One rank's coefficients of the wrong shape: the same error on every rank, before any halo.
        (lambda: dl.operators.symmetric_stencil(
            jnp.zeros((3, 3, A.row_partition.size_of(rank) + (rank == size - 1), 16)), A.stencil_grid),
         "passed another shape"),
        (lambda: dl.solvers.multigrid(_WrongCoefficients(n=16, row_partition=A.row_partition, dtype=A.dtype, comm=A.comm, wrong=rank == size - 1)), "stencil_coefficients"),
        (lambda: dl.solvers.chebyshev(A, degree=0), "degree must be an int >= 1"),
        (lambda: dl.solvers.chebyshev(A, bounds=(2.0, 1.0)), "0 < lo < hi"),
        (lambda: dl.cg(laplacian_2d(12), jnp.ones(laplacian_2d(12).input_structure.shape),
                       M=dl.solvers.multigrid(A)), "does not fit"),
    ]
    for fn, pattern in cases:
        if pattern is None:
            continue
        assert_no_failures(failure_of(fn, pattern), comm)
