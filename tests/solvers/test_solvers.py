"""CG and MINRES across ranks against numpy/scipy on the gathered global system."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distlinalg.comm import allreduce
from distlinalg import comm as C  # noqa: F401
from distlinalg.operators import LinearOperator
from distlinalg.solvers import Reason, cg, jacobi, minres
from conftest import gather_global

N = 14


def spd(seed=0, n=N, complex_=False):
    rng = np.random.default_rng(seed)
    Q = rng.standard_normal((n, n))
    if complex_:
        Q = Q + 1j * rng.standard_normal((n, n))
    return Q @ Q.conj().T / n + np.diag(np.linspace(0.5, 3.0, n))


def indefinite(seed=1, n=N):
    rng = np.random.default_rng(seed)
    Q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    eig = np.linspace(-2.0, 3.0, n)
    eig[np.abs(eig) < 0.2] = 0.7
    return (Q * eig) @ Q.T


def rows_of(rank, size, n=N):
    return np.array_split(np.arange(n), size)[rank]


def sharded_operator(A, comm):
    """This rank's rows of A; x's blocks assembled with one allreduce."""
    rank, size = comm.Get_rank(), comm.Get_size()
    rows = rows_of(rank, size, A.shape[0])
    block = jnp.asarray(A[rows])

    def matvec(v):
        full = allreduce(jnp.zeros(A.shape[0], v.dtype).at[rows].set(v), comm=comm)
        return block @ full

    return matvec, rows


SOLVERS = {
    "cg": lambda *a, **k: cg(*a, **k),
    "cg1": lambda *a, **k: cg(*a, method="single_reduction", **k),
    "cgp": lambda *a, **k: cg(*a, method="pipelined", **k),
    "minres": lambda *a, **k: minres(*a, **k),
}


@pytest.mark.parametrize("solver", list(SOLVERS))
@pytest.mark.parametrize("layout", ["replicated", "sharded"])
def test_spd_against_numpy(comm, rank, size, solver, layout):
    A = spd()
    b = np.random.default_rng(5).standard_normal(N)
    exact = np.linalg.solve(A, b)
    if layout == "replicated":
        x, info = jax.jit(lambda b: SOLVERS[solver](A, b, rtol=1e-11, comm=comm))(b)
        np.testing.assert_allclose(x, exact, rtol=1e-8)
    else:
        mv, rows = sharded_operator(A, comm)
        x, info = jax.jit(lambda b: SOLVERS[solver](mv, b, rtol=1e-11, layout="sharded", comm=comm))(b[rows])
        np.testing.assert_allclose(x, exact[rows], rtol=1e-8)
    assert bool(info.converged) and int(info.reason) == Reason.CONVERGED_RTOL
    assert 0 < int(info.iterations) <= 2 * N
    # Identical info on every rank.
    everyone = gather_global(np.array([info.iterations, info.residual_norm, info.reason], float), comm)
    assert (everyone == everyone[0]).all()


@pytest.mark.parametrize("layout", ["replicated", "sharded"])
def test_minres_indefinite_with_shift_and_preconditioner(comm, rank, size, layout):
    A = indefinite()
    b = np.random.default_rng(6).standard_normal(N)
    shift = 0.3
    exact = np.linalg.solve(A - shift * np.eye(N), b)
    d = np.abs(np.diag(A)) + 1.0
    if layout == "replicated":
        x, info = minres(A, b, shift=shift, M=jacobi(jnp.asarray(d)), rtol=1e-11, comm=comm)
        np.testing.assert_allclose(x, exact, rtol=1e-7, atol=1e-9)
    else:
        mv, rows = sharded_operator(A, comm)
        x, info = minres(mv, b[rows], shift=shift, M=jacobi(jnp.asarray(d[rows])), rtol=1e-11,
                         layout="sharded", comm=comm)
        np.testing.assert_allclose(x, exact[rows], rtol=1e-7, atol=1e-9)
    assert bool(info.converged)


def test_cg_on_indefinite_matrix_reports_it(comm):
    A = indefinite()
    b = np.random.default_rng(7).standard_normal(N)
    for method in ["standard", "single_reduction", "pipelined"]:
        _, info = cg(A, b, rtol=1e-12, comm=comm, method=method)
        assert int(info.reason) == Reason.DIVERGED_INDEFINITE_MAT, (method, info)
        assert not bool(info.converged)


def test_against_scipy_with_preconditioner(comm):
    import scipy.sparse.linalg as sla

    A = spd(3)
    b = np.random.default_rng(8).standard_normal(N)
    d = np.diag(A)
    ref, _ = sla.cg(A, b, rtol=1e-12, M=np.diag(1 / d))
    x, info = cg(A, b, rtol=1e-12, M=jacobi(jnp.asarray(A)), comm=comm)
    np.testing.assert_allclose(x, ref, rtol=1e-8)
    ref, _ = sla.minres(A, b, rtol=1e-12)
    x, info = minres(A, b, rtol=1e-12, comm=comm)
    np.testing.assert_allclose(x, ref, rtol=1e-7)


@pytest.mark.parametrize("solver", ["cg", "minres"])
def test_complex_hermitian(comm, solver):
    A = spd(4, complex_=True)
    rng = np.random.default_rng(9)
    b = rng.standard_normal(N) + 1j * rng.standard_normal(N)
    x, info = SOLVERS[solver](A, b, rtol=1e-11, comm=comm)
    np.testing.assert_allclose(x, np.linalg.solve(A, b), rtol=1e-8)
    assert bool(info.converged)
    # Gradient of a real loss w.r.t. a complex b: conj(A⁻ᵀ) applied to the
    # loss's cotangent, as jax defines it for the dense solve.
    c = rng.standard_normal(N)
    loss = lambda solve: lambda b: jnp.real(jnp.vdot(c, solve(b)))  # noqa: E731
    g = jax.grad(loss(lambda b: SOLVERS[solver](A, b, rtol=1e-12, comm=comm)[0]))(jnp.asarray(b))
    g_ref = jax.grad(loss(lambda b: jnp.linalg.solve(A, b)))(jnp.asarray(b))
    np.testing.assert_allclose(g, g_ref, rtol=1e-7)


def test_pytree_rhs(comm):
    A = spd(5)
    b = np.random.default_rng(10).standard_normal(N)
    split = 5

    def mv(tree):
        v = jnp.concatenate([tree["head"], tree["tail"]])
        out = A @ v
        return {"head": out[:split], "tail": out[split:]}

    tree_b = {"head": b[:split], "tail": b[split:]}
    for solve in (cg, minres):
        x, info = solve(mv, tree_b, rtol=1e-11, comm=comm)
        np.testing.assert_allclose(np.concatenate([x["head"], x["tail"]]), np.linalg.solve(A, b), rtol=1e-8)


@pytest.mark.parametrize("solver", ["cg", "cg1", "cgp", "minres"])
def test_gradients_through_allreduce_operator(comm, rank, size, solver):
    """Natural-gradient shape: S(θ) = Σ_r θ_r² G_r + λI, replicated vectors.

    The matvec allreduces, so every rank's θ_r influences every rank's x.
    Reference: the stacked global function of (θ_0..θ_{P-1}, λ) in jax.
    """
    rng = np.random.default_rng(20 + rank)
    J = rng.standard_normal((6, N)) / 3
    G = jnp.asarray(J.T @ J)
    G_all = jnp.asarray(gather_global(G, comm))
    b = np.random.default_rng(3).standard_normal(N)
    c = np.random.default_rng(4).standard_normal(N)
    theta, lam = 1.0 + 0.1 * rank, 0.5
    thetas = jnp.asarray(gather_global(np.array(theta), comm))

    def local(theta, lam, b):
        mv = lambda v: allreduce(theta**2 * (G @ v), comm=comm) + lam * v  # noqa: E731
        x, _ = SOLVERS[solver](mv, b, rtol=1e-13, comm=comm)
        return jnp.dot(c, x)

    def stacked(thetas, lam, b):
        S = jnp.einsum("r,rij->ij", thetas**2, G_all) + lam * jnp.eye(N)
        return size * jnp.dot(c, jnp.linalg.solve(S, b))  # Σ over ranks of identical losses

    grads = jax.grad(local, argnums=(0, 1, 2))(theta, lam, jnp.asarray(b))
    ref_theta, ref_lam, ref_b = jax.grad(stacked, argnums=(0, 1, 2))(thetas, lam, jnp.asarray(b))
    np.testing.assert_allclose(grads[0], ref_theta[rank], rtol=1e-7)
    # λ and b are replicated: each rank's copy gets its own path's share.
    np.testing.assert_allclose(allreduce(grads[1], comm=comm), ref_lam, rtol=1e-7)
    np.testing.assert_allclose(allreduce(grads[2], comm=comm), ref_b, rtol=1e-7)
    # Forward mode: every rank moves its own θ_r by 1.
    _, tangent = jax.jvp(lambda t: local(t, lam, jnp.asarray(b)), (theta,), (1.0,))
    _, ref_tangent = jax.jvp(lambda t: stacked(t, lam, jnp.asarray(b)) / size, (thetas,), (jnp.ones(size),))
    np.testing.assert_allclose(tangent, ref_tangent, rtol=1e-7)


def test_gradient_sharded_layout(comm, rank, size):
    A = spd(11)
    b = np.random.default_rng(12).standard_normal(N)
    c = np.random.default_rng(13).standard_normal(N)
    mv, rows = sharded_operator(A, comm)

    def local(scale, b_block):
        x, _ = cg(lambda v: scale * mv(v), b_block, rtol=1e-13, layout="sharded", comm=comm)
        return allreduce(jnp.dot(c[rows], x), comm=comm)  # replicated scalar loss

    def reference(scale, b):
        return jnp.dot(c, jnp.linalg.solve(scale * A, b))

    g_scale, g_b = jax.grad(local, argnums=(0, 1))(2.0, jnp.asarray(b[rows]))
    r_scale, r_b = jax.grad(reference, argnums=(0, 1))(2.0, jnp.asarray(b))
    # Seeded 1 on each of the P ranks: P times the reference. Rank r's copy
    # of the replicated scale multiplies only its own rows, so the copies'
    # gradients sum to the gradient of the scale.
    np.testing.assert_allclose(allreduce(g_scale, comm=comm), size * r_scale, rtol=1e-7)
    np.testing.assert_allclose(g_b, size * r_b[rows], rtol=1e-7)


def test_stopping_reasons(comm):
    A = spd(14)
    b = np.random.default_rng(15).standard_normal(N)
    for solve in (cg, minres):
        x, info = solve(A, b, rtol=1e-14, maxiter=3, comm=comm)
        assert int(info.reason) == Reason.DIVERGED_MAX_IT and int(info.iterations) == 3
        assert not bool(info.converged)
        x, info = solve(A, np.zeros(N), comm=comm)
        assert bool(info.converged) and int(info.iterations) == 0
        np.testing.assert_array_equal(x, np.zeros(N))
        exact = np.linalg.solve(A, b)
        x, info = solve(A, b, x0=exact, rtol=1e-6, comm=comm)
        assert bool(info.converged) and int(info.iterations) == 0
        bad = b.copy()
        bad[2] = np.nan
        x, info = solve(A, bad, comm=comm)
        assert int(info.reason) == Reason.DIVERGED_NANORINF and not bool(info.converged)
        x, info = solve(A, b, atol=1e3, rtol=0.0, comm=comm)
        assert int(info.reason) == Reason.CONVERGED_ATOL


@pytest.mark.parametrize("layout", [pytest.param("replicated", marks=pytest.mark.max_ranks(2)), "sharded"])
def test_minres_iterates_at_every_budget(comm, rank, size, layout, capfd):
    """MINRES runs two steps per loop body (minres.py); a budget that ends
    after the first of them, or a solve that converges there, must give
    scipy's k-th iterate, k iterations and a history of k + 1 entries."""
    import scipy.sparse.linalg as sla

    A = spd(21)
    A[0, 0] = -A[0, 0]  # indefinite: MINRES's own ground
    b = np.random.default_rng(22).standard_normal(N)
    mv, rows = sharded_operator(A, comm)
    for k in (1, 2, 3):  # ends after the first step of a pair, the second, the first again
        reference, _ = sla.minres(A, b, rtol=1e-30, maxiter=k)
        for monitor in ((False, True) if k == 3 else (False,)):
            if layout == "replicated":
                x, info = minres(A, b, rtol=1e-30, maxiter=k, history=8, monitor=monitor, comm=comm)
                want = reference
            else:
                x, info = minres(mv, b[rows], rtol=1e-30, maxiter=k, history=8, monitor=monitor,
                                 layout="sharded", comm=comm)
                want = reference[rows]
            jax.effects_barrier()
            np.testing.assert_allclose(x, want, rtol=1e-9, atol=1e-12)
            assert int(info.iterations) == k and int(info.reason) == Reason.DIVERGED_MAX_IT
            hist = np.asarray(info.history)
            assert np.isfinite(hist[: k + 1]).all() and np.isnan(hist[k + 1:]).all()
            np.testing.assert_allclose(hist[k], info.residual_norm)
            lines = capfd.readouterr().out.count("KSP Residual norm")
            assert lines == (k + 1 if monitor and rank == 0 else 0)
    # Converging in the first step of a pair: the masked second one changes nothing.
    x, info = minres(A, b, rtol=1e-10, history=40, comm=comm)
    exact = np.linalg.solve(A, b)
    np.testing.assert_allclose(x, exact, rtol=1e-8)
    k = int(info.iterations)
    reference, _ = sla.minres(A, b, rtol=1e-30, maxiter=k)
    np.testing.assert_allclose(x, reference, rtol=1e-9, atol=1e-12)
    assert np.isnan(np.asarray(info.history)[k + 1:]).all()


def test_history_and_monitor(comm, rank, capfd):
    A = spd(16)
    b = np.random.default_rng(17).standard_normal(N)
    x, info = cg(A, b, rtol=1e-10, history=50, monitor=True, comm=comm)
    jax.effects_barrier()
    k = int(info.iterations)
    hist = np.asarray(info.history)
    assert np.isfinite(hist[: k + 1]).all() and np.isnan(hist[k + 1 :]).all()
    np.testing.assert_allclose(hist[k], info.residual_norm)
    out = capfd.readouterr().out
    if rank == 0:
        assert "KSP Residual norm" in out and out.count("KSP Residual norm") == k + 1
    else:
        assert "KSP Residual norm" not in out


def test_bad_input(comm):
    A = spd()
    b = np.ones(N)
    with pytest.raises(ValueError, match="x0 and b must have matching tree structure"):
        cg(A, {"a": b}, x0=b, comm=comm)
    with pytest.raises(ValueError, match="square"):
        cg(np.ones((N, N + 1)), b, comm=comm)
    with pytest.raises(ValueError, match="layout"):
        cg(A, b, layout="diagonal", comm=comm)
    with pytest.raises(ValueError, match="replicated operator"):
        minres(A, b, layout="sharded", comm=comm)

    sharded_identity = LinearOperator(lambda v: v, layout="sharded", comm=comm)
    with pytest.raises(ValueError, match="operator's layout is 'sharded'"):
        cg(sharded_identity, b, layout="replicated", comm=comm)

    class MatvecOnly:  # duck typing is gone: the solvers dispatch on LinearOperator
        layout = "replicated"

        def matvec(self, v):
            return v

    with pytest.raises(TypeError, match="linear operator must be either a function or ndarray"):
        cg(MatvecOnly(), b, comm=comm)
    np.testing.assert_allclose(allreduce(jnp.ones(1), comm=comm), [comm.Get_size()])


@pytest.mark.parametrize("layout", ["replicated", "sharded"])
def test_vmap_over_right_hand_sides(comm, rank, size, layout):
    A = spd(18)
    B = np.random.default_rng(19).standard_normal((3, N))
    B[1] *= 1e-3  # lanes converge at different iterations
    exact = np.linalg.solve(A, B.T).T
    if layout == "replicated":
        x, info = jax.vmap(lambda b: cg(A, b, rtol=1e-11, comm=comm))(B)
        np.testing.assert_allclose(x, exact, rtol=1e-8)
    else:
        mv, rows = sharded_operator(A, comm)
        x, info = jax.vmap(lambda b: minres(mv, b, rtol=1e-11, layout="sharded", comm=comm))(B[:, rows])
        np.testing.assert_allclose(x, exact[:, rows], rtol=1e-7)
    assert np.asarray(info.converged).all() and info.iterations.shape == (3,)


def test_check_grads_through_allgather_operator(comm, rank, size):
    """A sharded operator whose matvec allgathers x; derivatives of the solve
    with respect to b and to the operator's scale pass the distributed checks."""
    import distlinalg.ad as dad

    A = spd(21)
    rows = rows_of(rank, size)
    pieces = [len(rows_of(r, size)) for r in range(size)]
    width = max(pieces)
    block = jnp.asarray(A[rows])

    def matvec(v):
        padded = jnp.zeros(width, v.dtype).at[: v.shape[0]].set(v)
        everyone = C_allgather(padded)
        full = jnp.concatenate([everyone[r, : pieces[r]] for r in range(size)])
        return block @ full

    def C_allgather(v):
        from distlinalg.comm import allgather

        return allgather(v, comm=comm)

    def solve(scale, b_block):
        x, _ = cg(lambda v: scale * matvec(v), b_block, rtol=1e-13, layout="sharded", comm=comm)
        return x

    b = jnp.asarray(np.random.default_rng(22).standard_normal(N)[rows])
    dad.check_grads(solve, (jnp.asarray(1.5), b), modes=("fwd", "rev"), atol=1e-6, rtol=1e-6, comm=comm)
    x = solve(1.5, b)
    np.testing.assert_allclose(x, np.linalg.solve(1.5 * A, np.random.default_rng(22).standard_normal(N))[rows],
                               rtol=1e-9)


@pytest.mark.parametrize("solver", ["cg", "cg1", "cgp", "minres"])
def test_stopping_decision_identical_on_every_rank(comm, rank, size, solver):
    """Ranks that see different data still stop together with the same info."""
    A = spd(30)
    mv, rows = sharded_operator(A, comm)
    b = np.random.default_rng(31).standard_normal(N)
    block = b[rows].copy()
    if rank == size - 1:
        block[0] = np.inf  # one rank's entry is not finite
    _, info = SOLVERS[solver](mv, jnp.asarray(block), rtol=1e-10, layout="sharded", comm=comm)
    record = np.array([int(info.iterations), int(info.reason), bool(info.converged)])
    assert (gather_global(record, comm) == record).all()
    assert int(info.reason) == Reason.DIVERGED_NANORINF
    # Replicated layout with copies that differ in the last bits (as after
    # rank-dependent summation orders): still one decision for all.
    noisy = b * (1 + 1e-15 * rank)
    x, info = SOLVERS[solver](A, noisy, rtol=1e-10, comm=comm)
    record = np.array([int(info.iterations), int(info.reason), bool(info.converged)])
    assert (gather_global(record, comm) == record).all() and bool(info.converged)


@pytest.mark.parametrize("solver", ["cg", "minres"])
def test_traced_x0_and_preconditioner_are_not_differentiated(comm, solver):
    """x0 and M may depend on the differentiated inputs: no error, and the
    gradient is that of the exact solution (x0 and M only change the path)."""
    A = spd(32)
    c = np.random.default_rng(33).standard_normal(N)

    def loss(scale, b):
        S = scale * jnp.asarray(A)
        x0 = 0.5 * b  # depends on b
        M = jacobi(jnp.diagonal(S))  # depends on scale
        x, _ = SOLVERS[solver](S, b, x0=x0, M=M, rtol=1e-13, comm=comm)
        return jnp.dot(c, x)

    def reference(scale, b):
        return jnp.dot(c, jnp.linalg.solve(scale * jnp.asarray(A), b))

    b = jnp.asarray(np.random.default_rng(34).standard_normal(N))
    for mode in ("reverse", "forward"):
        if mode == "reverse":
            got = jax.grad(loss, argnums=(0, 1))(1.5, b)
            ref = jax.grad(reference, argnums=(0, 1))(1.5, b)
        else:
            got = jax.jvp(loss, (1.5, b), (1.0, jnp.ones(N)))[1:]
            ref = jax.jvp(reference, (1.5, b), (1.0, jnp.ones(N)))[1:]
        for g, r in zip(got, ref):
            np.testing.assert_allclose(g, r, rtol=1e-7)


@pytest.mark.parametrize("solver", ["cg", "minres"])
def test_tiny_cotangent_does_not_underflow(comm, solver):
    """A cotangent of 1e-300: its squared norm underflows to 0 unless the
    backward right-hand side is normalised before the solve."""
    A = spd(35)
    c = jnp.asarray(np.random.default_rng(36).standard_normal(N))
    b = jnp.asarray(np.random.default_rng(37).standard_normal(N))
    g = jax.grad(lambda b: 1e-300 * jnp.dot(c, SOLVERS[solver](A, b, rtol=1e-12, comm=comm)[0]))(b)
    expected = 1e-300 * np.linalg.solve(A.T, np.asarray(c))
    assert np.all(np.isfinite(g)) and np.any(g != 0)
    np.testing.assert_allclose(g, expected, rtol=1e-7)


@pytest.mark.parametrize("solver", ["cg", "minres"])
def test_rank_dependent_cotangents_replicated_layout(comm, rank, size, solver):
    """Each rank uses the replicated solution differently (loss_r = c_r·x):
    gradients with respect to every rank's operator parameter and to the
    replicated b against the stacked global program."""
    rng = np.random.default_rng(40 + rank)
    J = rng.standard_normal((5, N)) / 3
    G = jnp.asarray(J.T @ J)
    G_all = jnp.asarray(gather_global(G, comm))
    c_all = np.random.default_rng(41).standard_normal((size, N))
    b = jnp.asarray(np.random.default_rng(42).standard_normal(N))
    theta = 1.0 + 0.1 * rank
    thetas = jnp.asarray(gather_global(np.array(theta), comm))

    def local(theta, b):
        mv = lambda v: allreduce(theta**2 * (G @ v), comm=comm) + 0.3 * v  # noqa: E731
        x, _ = SOLVERS[solver](mv, b, rtol=1e-13, comm=comm)
        return jnp.dot(c_all[rank], x)

    def stacked(thetas, b):
        S = jnp.einsum("r,rij->ij", thetas**2, G_all) + 0.3 * jnp.eye(N)
        return jnp.sum(jnp.asarray(c_all) @ jnp.linalg.solve(S, b))

    g_theta, g_b = jax.grad(local, argnums=(0, 1))(theta, b)
    r_theta, r_b = jax.grad(stacked, argnums=(0, 1))(thetas, b)
    np.testing.assert_allclose(g_theta, r_theta[rank], rtol=1e-7)
    np.testing.assert_allclose(allreduce(g_b, comm=comm), r_b, rtol=1e-7)
    # Forward mode: rank r moves θ_r by 1; the solution's tangent is the
    # same on every rank, and each rank's output tangent is c_r · ẋ.
    _, tangent = jax.jvp(lambda t: local(t, b), (theta,), (1.0,))
    S = np.einsum("r,rij->ij", np.asarray(thetas) ** 2, np.asarray(G_all)) + 0.3 * np.eye(N)
    x = np.linalg.solve(S, np.asarray(b))
    x_dot = -np.linalg.solve(S, sum(2 * t * (g @ x) for t, g in zip(np.asarray(thetas), np.asarray(G_all))))
    np.testing.assert_allclose(tangent, c_all[rank] @ x_dot, rtol=1e-7)


def test_pipelined_cg_on_halo_laplacian_values_grad_jvp_vmap(comm, rank, size):
    """cg(method="pipelined"): the sharded 2-D Laplacian (halo sendrecvs in the matvec,
    the reduction in flight across the preconditioner and matvec), against the
    dense single-process solve of the gathered problem: values, reverse and
    forward derivatives with respect to b and to the operator's scale, vmap."""
    from distlinalg.operators import laplacian_2d

    n = 6
    op = laplacian_2d(n, comm=comm)
    start, stop = op.grid_rows
    mine = slice(start * n, stop * n)
    T = 2 * np.eye(n) - np.eye(n, k=1) - np.eye(n, k=-1)
    dense = np.kron(np.eye(n), T) + np.kron(T, np.eye(n))
    rng = np.random.default_rng(44)
    b_all, c_all = rng.standard_normal(n * n), rng.standard_normal(n * n)
    b, c = jnp.asarray(b_all[mine]), jnp.asarray(c_all[mine])
    M = jacobi(jnp.full(b.shape, 4.0))

    def loss(scale, b):
        x, _ = cg(lambda v: scale * (op @ v), b, rtol=1e-12, M=M, layout="sharded", method="pipelined", comm=comm)
        return allreduce(jnp.vdot(c, x), comm=comm)

    def reference(scale, b_all):
        return jnp.vdot(jnp.asarray(c_all), jnp.linalg.solve(scale * jnp.asarray(dense), b_all))

    scale = 1.3
    x, info = jax.jit(lambda b: cg(op, b, rtol=1e-12, M=M, method="pipelined", comm=comm))(b)
    np.testing.assert_allclose(x, np.linalg.solve(dense, b_all)[mine], rtol=1e-9, atol=1e-11)
    assert bool(info.converged) and int(info.reason) == Reason.CONVERGED_RTOL
    record = np.array([int(info.iterations), float(info.residual_norm)])
    assert (gather_global(record, comm) == record).all()

    import distlinalg.ad as dad

    # The scale is replicated, b sharded (docs/ad.md): the exact gradient of the replicated loss.
    value, (g_scale, g_b) = jax.jit(dad.value_and_grad(loss, argnums=(0, 1), sharded=1))(scale, b)
    ref_value, (ref_scale, ref_b) = jax.value_and_grad(reference, argnums=(0, 1))(scale, jnp.asarray(b_all))
    np.testing.assert_allclose(value, ref_value, rtol=1e-9)
    np.testing.assert_allclose(g_scale, ref_scale, rtol=1e-8)
    np.testing.assert_allclose(g_b, np.asarray(ref_b)[mine], rtol=1e-8, atol=1e-12)
    db_all = rng.standard_normal(n * n)
    _, tangent = jax.jvp(lambda b: loss(scale, b), (b,), (jnp.asarray(db_all[mine]),))
    _, ref_tangent = jax.jvp(lambda b: reference(scale, b), (jnp.asarray(b_all),), (jnp.asarray(db_all),))
    np.testing.assert_allclose(tangent, ref_tangent, rtol=1e-8)

    B_all = rng.standard_normal((3, n * n))
    B_all[1] *= 1e-3  # lanes that stop at different iterations
    xs, infos = jax.vmap(lambda b: cg(op, b, rtol=1e-11, method="pipelined", comm=comm))(jnp.asarray(B_all[:, mine]))
    np.testing.assert_allclose(xs, np.linalg.solve(dense, B_all.T).T[:, mine], rtol=1e-8, atol=1e-11)
    assert np.asarray(infos.converged).all()


def test_cg_updates_large_carried_vectors_in_place(comm, rank, size):
    """Vectors of 64 KiB and more per rank are updated in their loop slots
    (one-pass fused updates, and `after` where XLA's own updates remain):
    every cg method, with and without a preconditioner, on the sharded 2-D
    Laplacian, against scipy's sparse direct solve of the gathered problem;
    the loop body copies no whole vector; gradients in both modes."""
    import scipy.sparse as sp
    import scipy.sparse.linalg as spl
    import distlinalg.ad as dad
    from distlinalg.operators import laplacian_2d

    n = 160  # ≥ 8192 float64 entries per rank on up to 3 ranks
    op = laplacian_2d(n, comm=comm, dtype=jnp.float64)
    start, stop = op.grid_rows
    mine = slice(start * n, stop * n)
    assert (stop - start) * n * 8 >= 64 * 1024
    T = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(n, n))
    dense = (sp.kron(sp.identity(n), T) + sp.kron(T, sp.identity(n))).tocsc()
    rng = np.random.default_rng(7)
    b_all, c_all, db_all = rng.standard_normal((3, n * n))
    b, c = jnp.asarray(b_all[mine]), jnp.asarray(c_all[mine])
    M = jacobi(jnp.full(b.shape, 4.0))
    want = spl.spsolve(dense, b_all)

    variants = [(method, pre) for method in ("standard", "single_reduction", "pipelined") for pre in (None, M)]
    for method, pre in variants:
        # Compiled once: the values come from the program whose HLO is read.
        solve = jax.jit(lambda b, method=method, pre=pre: cg(op, b, rtol=1e-10, M=pre, method=method,
                                                             comm=comm)).lower(b).compile()
        x, info = solve(b)
        assert bool(info.converged), (method, pre, info)
        np.testing.assert_allclose(x, want[mine], rtol=0, atol=1e-7 * np.abs(want).max(), err_msg=method)
        text = solve.as_text()
        bodies = [c for c in text.split("\n\n") if c.split(" ", 1)[0] in re.findall(r"body=(%[^,\s]+)", text)]
        bodies = [c for c in bodies if " while(" not in c]  # the iteration's loop (not the one around it)
        assert bodies
        vector = rf"f64\[({(stop - start) * n}|{stop - start},{n})\]"
        copies = [line for c in bodies for line in c.splitlines() if re.search(rf"= {vector}\S* copy\(", line)]
        assert not copies, (method, pre is not None, copies)
        if jax.default_backend() != "cpu":
            continue  # the handlers below are the CPU's; XLA's GPU fusions do this work themselves
        # The vector updates and the inner products of a step read each vector
        # once (_kernels/fused_update.py, local_dots.py): no product vector
        # reduced by XLA fusions (named after their reduce).
        assert all("distlinalg_fused_update" in c for c in bodies), (method, pre is not None)
        reductions = [line for c in bodies for line in c.splitlines()
                      if "fusion(" in line and "reduce" in line.split(" = ")[0]]
        assert not reductions, (method, pre is not None, reductions)

    def loss(b):
        x, _ = cg(op, b, rtol=1e-10, M=M, method="pipelined", comm=comm)
        return allreduce(jnp.vdot(c, x), comm=comm)

    # d⟨c, A⁻¹ b⟩/db = A⁻¹ c (A symmetric); the tangent along db is ⟨c, A⁻¹ db⟩.
    grad = jax.jit(dad.grad(loss, sharded=0))(b)
    np.testing.assert_allclose(grad, spl.spsolve(dense, c_all)[mine], rtol=0, atol=1e-6)
    _, tangent = jax.jvp(loss, (b,), (jnp.asarray(db_all[mine]),))
    np.testing.assert_allclose(tangent, c_all @ spl.spsolve(dense, db_all), rtol=1e-6)


def test_minres_loop_copies_no_vector(comm):
    """MINRES on the sharded 2-D Laplacian (≥ 64 KiB per rank) against scipy's
    direct solve, with the default (static zero) and a traced shift: its
    r and w slots are updated in place (no whole-vector copy in the loop
    body), and its vector updates and inner products are one-pass handler
    calls (_kernels/fused_update.py), with no product vector reduced by XLA."""
    import scipy.sparse as sp
    import scipy.sparse.linalg as spl
    from distlinalg.operators import laplacian_2d

    n = 160
    op = laplacian_2d(n, comm=comm, dtype=jnp.float64)
    start, stop = op.grid_rows
    mine = slice(start * n, stop * n)
    T = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(n, n))
    dense = (sp.kron(sp.identity(n), T) + sp.kron(T, sp.identity(n))).tocsc()
    b_all = np.random.default_rng(8).standard_normal(n * n)
    b = jnp.asarray(b_all[mine])
    for shift in (0.0, jnp.float64(0.25)):
        solve = jax.jit(lambda b, shift=shift: minres(op, b, rtol=1e-10, shift=shift, comm=comm)).lower(b).compile()
        x, info = solve(b)
        assert bool(info.converged), (shift, info)
        want = spl.spsolve(dense - float(shift) * sp.identity(n * n), b_all)
        np.testing.assert_allclose(x, want[mine], rtol=0, atol=1e-7 * np.abs(want).max())
        text = solve.as_text()
        bodies = [c for c in text.split("\n\n") if c.split(" ", 1)[0] in re.findall(r"body=(%[^,\s]+)", text)]
        bodies = [c for c in bodies if " while(" not in c]  # the iteration's loop (not the one around it)
        assert bodies
        vector = rf"f64\[({(stop - start) * n}|{stop - start},{n})\]"
        copies = [line for c in bodies for line in c.splitlines() if re.search(rf"= {vector}\S* copy\(", line)]
        assert not copies, (shift, copies)
        if jax.default_backend() != "cpu":
            continue  # the handlers below are the CPU's; XLA's GPU fusions do this work themselves
        # Per step: y − c r₁ with ⟨u, y⟩, r₂' with ⟨r₂', r₂'⟩, and w with x.
        assert all(c.count("custom_call_target=\"distlinalg_fused_update\"") >= 3 for c in bodies), shift
        reductions = [line for c in bodies for line in c.splitlines()
                      if "fusion(" in line and "reduce" in line.split(" = ")[0]]
        assert not reductions, (shift, reductions)
