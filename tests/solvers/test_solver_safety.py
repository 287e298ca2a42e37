"""The solvers never hang and never return a silently inconsistent answer.

Whatever steers the loop (iteration limit, stopping threshold, stopping
quantity) is identical on every rank by construction; inputs that differ
between ranks stop every rank with Reason.DIVERGED_INCONSISTENT_RANKS; bad
input raises the same error on every rank. Solves go through a few jitted
functions reused across tests (traced rtol/maxiter/A/b), so the file compiles
little. Tests that need a disagreement between ranks check, on one rank, that
the agreeing case still converges.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import distlinalg as dl
from distlinalg import operators as ops
from distlinalg.comm import allreduce
from distlinalg.solvers import Reason, cg, minres
from conftest import assert_no_failures, failure_of, gather_global

N = 12
INCONSISTENT = Reason.DIVERGED_INCONSISTENT_RANKS
SOLVERS = {
    "cg": functools.partial(cg, method="standard"),
    "cg1": functools.partial(cg, method="single_reduction"),
    "cgp": functools.partial(cg, method="pipelined"),
    "minres": minres,
}


def spd(seed=0, n=N):
    rng = np.random.default_rng(seed)
    Q = rng.standard_normal((n, n))
    return Q @ Q.T / n + np.diag(np.linspace(0.5, 3.0, n))


def symmetric(seed, n=N):
    E = np.random.default_rng(seed).standard_normal((n, n))
    return (E + E.T) / 2


def identical_everywhere(info, comm):
    """The info of every rank, checked identical (the rule), returned as (iterations, reason)."""
    record = np.array([int(info.iterations), int(info.reason), bool(info.converged), float(info.residual_norm)])
    everyone = gather_global(record, comm)
    np.testing.assert_array_equal(everyone, np.broadcast_to(record, everyone.shape))
    return int(info.iterations), Reason(int(info.reason))


# One compiled program per solver and layout, reused by every test: A, b,
# rtol and maxiter are arguments (traced), the communicator distlinalg's own.
@functools.cache
def replicated(solver):
    return jax.jit(lambda A, b, rtol, maxiter: SOLVERS[solver](A, b, rtol=rtol, maxiter=maxiter))


@functools.cache
def sharded_solve(solver, maxiter_given):
    """Sharded solve with a diagonal operator given by this rank's entries `d`."""
    if maxiter_given:
        return jax.jit(lambda d, b, rtol, maxiter: SOLVERS[solver](
            lambda v: d * v, b, rtol=rtol, maxiter=maxiter, layout="sharded"))
    return jax.jit(lambda d, b, rtol: SOLVERS[solver](lambda v: d * v, b, rtol=rtol, layout="sharded"))


def blocks(total, size):
    return np.array_split(np.arange(total), size)


# ---------------------------------------------------------------------------
# 1. The default maxiter is the same on every rank (uneven row split).
@pytest.mark.timeout(90)
@pytest.mark.parametrize("solver", list(SOLVERS))
def test_uneven_split_without_convergence_stops_together(comm, rank, size, solver):
    """Before: the default came from the local size, ranks left the loop at
    different iterations and the next allreduce hung. 61 rows split unevenly
    over 2 or 3 ranks; a spectrum of condition 1e10 that CG cannot resolve in
    10 n steps; MINRES gets a singular, inconsistent system (never converges)."""
    total = 61
    d = np.geomspace(1.0, 1e10, total)
    if solver == "minres":
        d[0] = 0.0
    b = np.random.default_rng(1).standard_normal(total)
    mine = blocks(total, size)[rank]
    x, info = sharded_solve(solver, False)(jnp.asarray(d[mine]), jnp.asarray(b[mine]), 1e-12)
    iterations, reason = identical_everywhere(info, comm)
    widest = max(len(block) for block in blocks(total, size))
    assert reason == Reason.DIVERGED_MAX_IT
    assert iterations == 10 * size * widest  # the documented default, agreed in-graph
    assert np.all(np.isfinite(x))


# ---------------------------------------------------------------------------
# 2. Replicated layout: b, operator and options compared across ranks.
@pytest.mark.parametrize("solver", list(SOLVERS))
def test_replicated_inputs_compared(comm, rank, size, solver):
    A = spd(2)
    b = np.random.default_rng(3).standard_normal(N)
    exact = np.linalg.solve(A, b)
    solve = replicated(solver)

    def outcome(A_r, b_r, rtol=1e-10, maxiter=200):
        x, info = solve(jnp.asarray(A_r), jnp.asarray(b_r), rtol, maxiter)
        return x, identical_everywhere(info, comm)

    # Agreeing ranks, also with last-bit differences (rank-dependent rounding).
    for A_r, b_r in [(A, b), (A * (1 + rank * 2.0**-52), b * (1 + 1e-15 * rank))]:
        x, (iterations, reason) = outcome(A_r, b_r)
        assert reason == Reason.CONVERGED_RTOL and 0 < iterations <= 3 * N
        np.testing.assert_allclose(x, exact, rtol=1e-8)
    if size == 1:
        return
    last = rank == size - 1
    flipped = -b if last else b  # same norm: only the projection sees it
    disagreeing = {
        "b differs": (A, b + 0.1 * rank),
        "b negated on one rank": (A, flipped),
        "operator differs (rank-local)": (A + 1e-3 * rank * symmetric(4), b),
        "operator scaled per rank": ((1 + 0.1 * rank) * A, b),
    }
    for what, (A_r, b_r) in disagreeing.items():
        x, (iterations, reason) = outcome(A_r, b_r)
        assert reason == INCONSISTENT, what
        assert iterations <= 1, what
    # Caught before the first step: x is x0 (zeros), on every rank.
    x, _ = outcome(A, b + 0.1 * rank)
    np.testing.assert_array_equal(x, np.zeros(N))


@pytest.mark.parametrize("layout", ["replicated", "sharded"])
def test_options_differ_between_ranks(comm, rank, size, layout):
    """rtol, atol-free maxiter, and traced values that are invalid on one rank only."""
    last = rank == size - 1
    cases = {
        "rtol differs": dict(rtol=1e-10 * (1 + rank)),
        "maxiter differs": dict(maxiter=50 + rank),
        "rtol NaN on one rank": dict(rtol=np.nan if last else 1e-10),
        "rtol negative on one rank": dict(rtol=-1.0 if last else 1e-10),
        "maxiter negative on one rank": dict(maxiter=-1 if last else 50),
    }
    A = spd(5)
    b = np.random.default_rng(6).standard_normal(N)
    if layout == "replicated":
        def run(rtol=1e-10, maxiter=50):
            return replicated("cg")(jnp.asarray(A), jnp.asarray(b), rtol, maxiter)
    else:
        d = np.linspace(1.0, 4.0, N)
        mine = blocks(N, size)[rank]

        def run(rtol=1e-10, maxiter=50):
            return sharded_solve("cg", True)(jnp.asarray(d[mine]), jnp.asarray(b[mine]), rtol, maxiter)

    _, info = run()
    assert identical_everywhere(info, comm)[1] == Reason.CONVERGED_RTOL
    for what, options in cases.items():
        if size == 1 and "differs" in what:
            continue
        x, info = run(**options)
        iterations, reason = identical_everywhere(info, comm)
        assert (reason, iterations) == (INCONSISTENT, 0), what
    # Invalid on every rank (traced, so not caught at trace time): the same.
    _, info = run(rtol=-1.0)
    assert identical_everywhere(info, comm) == (0, INCONSISTENT)


def test_rank_local_gram_operator(comm, rank, size):
    """A QGT/Fisher matrix built from each rank's own samples must be summed
    over ranks; without the allreduce every rank solves with its own matrix."""
    rng = np.random.default_rng(10 + rank)
    J = rng.standard_normal((20, N))  # this rank's samples
    lam = 0.1
    S_global = gather_global(J.T @ J, comm).sum(0) / (20 * size) + lam * np.eye(N)
    S_local = J.T @ J / 20 + lam * np.eye(N)
    force = np.random.default_rng(11).standard_normal(N)
    for solver in ("cg", "minres"):
        x, info = replicated(solver)(jnp.asarray(S_global), jnp.asarray(force), 1e-10, 200)
        assert identical_everywhere(info, comm)[1] == Reason.CONVERGED_RTOL
        np.testing.assert_allclose(x, np.linalg.solve(S_global, force), rtol=1e-8)
        _, info = replicated(solver)(jnp.asarray(S_local), jnp.asarray(force), 1e-10, 200)
        expected = INCONSISTENT if size > 1 else Reason.CONVERGED_RTOL
        assert identical_everywhere(info, comm)[1] == expected


def test_grad_and_vmap_still_work(comm, rank, size):
    """Regression through the agreement, the cond and the first-step check:
    gradients (the transposed solve reuses the verdict and its cotangents may
    differ by rank), and vmap with one lane whose b differs between ranks."""
    rng = np.random.default_rng(20 + rank)
    J = rng.standard_normal((6, N)) / 3
    G = jnp.asarray(J.T @ J)
    G_all = gather_global(J.T @ J, comm)
    b = jnp.asarray(np.random.default_rng(21).standard_normal(N))
    c = jnp.asarray(np.random.default_rng(22 + rank).standard_normal(N))  # rank-dependent loss

    def loss(theta, b):
        x, _ = cg(lambda v: allreduce(theta**2 * (G @ v)) + 0.5 * v, b, rtol=1e-13)
        return jnp.dot(c, x)

    g_theta, g_b = jax.jit(jax.grad(loss, argnums=(0, 1)))(1.0 + 0.1 * rank, b)
    # Reference for Σ_r c_r · S⁻¹ b, S = Σ_r θ_r² G_r + ½ I (symmetric):
    # ∂/∂θ_r = −2 θ_r yᵀ G_r x and ∂/∂b = y, with x = S⁻¹ b, y = S⁻¹ Σ_r c_r.
    thetas = 1.0 + 0.1 * np.arange(size)
    c_sum = gather_global(np.asarray(c), comm).sum(0)
    S = np.einsum("r,rij->ij", thetas**2, G_all) + 0.5 * np.eye(N)
    x, y = np.linalg.solve(S, np.asarray(b)), np.linalg.solve(S, c_sum)
    np.testing.assert_allclose(g_theta, -2 * thetas[rank] * y @ G_all[rank] @ x, rtol=1e-7)
    np.testing.assert_allclose(gather_global(np.asarray(g_b), comm).sum(0), y, rtol=1e-7)

    A = spd(23)
    B = np.stack([np.asarray(b), np.asarray(b) + 0.5 * rank])  # lane 1 differs by rank (size > 1)
    x, info = jax.jit(jax.vmap(lambda v: minres(A, v, rtol=1e-10)))(B)
    reasons = gather_global(np.asarray(info.reason), comm)
    assert (reasons == reasons[0]).all()
    assert Reason(int(info.reason[0])) == Reason.CONVERGED_RTOL
    np.testing.assert_allclose(x[0], np.linalg.solve(A, B[0]), rtol=1e-8)
    assert Reason(int(info.reason[1])) == (INCONSISTENT if size > 1 else Reason.CONVERGED_RTOL)


# ---------------------------------------------------------------------------
# 3. Bad input: an error on every rank, or the reason on every rank.
def test_bad_static_input_raises_everywhere(comm):
    A, b = spd(), np.ones(N)
    bad = [
        (dict(rtol=-1.0), "rtol must be a finite number >= 0"),
        (dict(rtol=np.nan), "rtol must be a finite number >= 0"),
        (dict(tol=np.inf), "rtol must be a finite number >= 0"),
        (dict(atol=-1e-3), "atol must be a finite number >= 0"),
        (dict(atol=np.nan), "atol must be a finite number >= 0"),
        (dict(rtol=0.0, atol=0.0), "rtol or atol must be positive"),
        (dict(rtol=[1e-5]), "rtol must be a scalar"),
        (dict(rtol="1e-5"), "rtol must be a real number"),
        (dict(maxiter=-1), "maxiter must be >= 0"),
        (dict(maxiter=2.5), "maxiter must be an integer"),
        (dict(maxiter=True), "maxiter must be an integer"),
        (dict(layout="diagonal"), "layout must be one of"),
        (dict(x0={"a": b}), "x0 and b must have matching tree structure"),
        (dict(x0=np.ones(N + 1)), "x0 and b must have matching shapes"),
    ]
    for solve in (cg, minres):
        for options, message in bad:
            with pytest.raises(ValueError, match=message):
                solve(A, b, **options)
    with pytest.raises(ValueError, match="maxiter must be an integer"):
        jax.jit(lambda m: cg(A, b, maxiter=m))(3.0)  # a traced float: its dtype is known at trace time
    assert comm.allreduce(1) == comm.Get_size()  # every rank got here (none raised alone)


def test_bad_input_on_one_rank_raises_everywhere(comm, rank, size):
    """Arguments checked at trace time, invalid on one rank only: that rank
    raises its error, every other rank an error naming it (never one rank
    alone, which would leave the others blocked in the solve's first message)."""
    A, last = spd(7), rank == size - 1
    cases = [
        (dict(rtol=-1.0 if last else 1e-8), "rtol must be a finite number >= 0"),
        (dict(maxiter=2.5 if last else 10), "maxiter must be an integer"),
        (dict(b=np.ones(N + 1) if last else np.ones(N)), "dense A of shape .* does not fit b"),
    ]
    for options, message in cases:
        b = options.pop("b", np.ones(N))
        expected = message if last or size == 1 else rf"invalid solver arguments on rank\(s\) \[{size - 1}\].*{message}"
        assert_no_failures(failure_of(lambda: cg(A, b, **options), expected), comm)


def test_rhs_length_differs_between_ranks(comm, rank, size):
    """A replicated b whose length differs between ranks, with an operator
    that accepts any length: the sizes are compared in-graph and every rank
    stops with the reason; the b-sized messages of the solve (averaging b
    over ranks) are skipped. (A callable A that raises on the longer b at
    trace time cannot be helped: that is the user's code.)"""
    b = np.ones(N + 1) if rank == size - 1 else np.ones(N)
    x, info = jax.jit(lambda b: minres(lambda v: 2.0 * v, b))(jnp.asarray(b))
    expected = (0, INCONSISTENT) if size > 1 else (1, Reason.CONVERGED_RTOL)
    assert identical_everywhere(info, comm) == expected


# ---------------------------------------------------------------------------
# 4. Row partitions are checked across ranks at construction.
def test_row_partition_checked_across_ranks(comm, rank, size):
    n = 6
    same = [n - (size - 1)] + [1] * (size - 1)
    op = ops.laplacian_2d(n, row_partition=same, comm=comm)  # agreeing ranks: fine
    assert op.grid_rows[1] - op.grid_rows[0] == same[rank]
    if size == 1:
        return
    # Ranks pass different (each valid) partitions: every rank raises, naming each rank's.
    mine = [int(v) for v in np.roll(same, rank)]
    named = "rank 0: " + str(same)
    assert_no_failures(failure_of(lambda: ops.laplacian_2d(n, row_partition=mine, comm=comm),
                                  r"different row_partitions(.|\n)*" + named.replace("[", r"\[").replace("]", r"\]")),
                       comm)
    # Invalid on one rank only: still the same error everywhere, not one rank's.
    wrong = [n + 1] + [0] * (size - 1) if rank == size - 1 else same
    assert_no_failures(failure_of(lambda: ops.sparse_rows(_poisson_1d(n), row_partition=wrong, comm=comm),
                                  r"rank \d+: \[7, 0(, 0)*\] of 6 indices \(blocks that do not add up"), comm)


def _poisson_1d(n):
    import scipy.sparse as sp

    return sp.diags([-np.ones(n - 1), 2 * np.ones(n), -np.ones(n - 1)], [-1, 0, 1]).tocsr()


# ---------------------------------------------------------------------------
# 5. The checks ride in the existing messages: none added per iteration.
def test_messages_per_iteration_unchanged(size):
    def allreduces_in_loop(fn, *args):
        def count(jaxpr):
            """Allreduces of one loop's own body (not of the loops nested in it:
            the check of a converged claim runs the iteration loop inside one)."""
            total = 0
            for eqn in jaxpr.eqns:
                total += eqn.primitive.name in ("distlinalg_allreduce", "distlinalg_iallreduce")
                if eqn.primitive.name == "while":
                    continue
                for value in eqn.params.values():
                    for sub in value if isinstance(value, (tuple, list)) else (value,):
                        inner = getattr(sub, "jaxpr", sub)
                        if hasattr(inner, "eqns"):
                            total += count(inner)
            return total

        def loops(jaxpr):
            for eqn in jaxpr.eqns:
                if eqn.primitive.name == "while":
                    yield eqn
                for value in eqn.params.values():
                    for sub in value if isinstance(value, (tuple, list)) else (value,):
                        inner = getattr(sub, "jaxpr", sub)
                        if hasattr(inner, "eqns"):
                            yield from loops(inner)

        # The iteration's loop: innermost (the check of a converged claim runs
        # it inside a loop of its own); others, e.g. history, have none.
        innermost = [eqn.params["body_jaxpr"].jaxpr for eqn in loops(jax.make_jaxpr(fn)(*args).jaxpr)
                     if not any(True for _ in loops(eqn.params["body_jaxpr"].jaxpr))]
        return max(count(body) for body in innermost)

    A, b = jnp.asarray(spd()), jnp.ones(N)
    replicated_expected = 1 if size > 1 else 0
    # MINRES's loop body holds two steps (its vector slots alternate, minres.py).
    steps_per_body = {"cg": 1, "cg1": 1, "cgp": 1, "minres": 2}
    for name, expected in {"cg": 2, "cg1": 1, "cgp": 1, "minres": 2}.items():
        got = allreduces_in_loop(lambda b: SOLVERS[name](lambda v: 2.0 * v, b, layout="sharded"), b)
        assert got == expected * steps_per_body[name], (name, got)
        got = allreduces_in_loop(lambda b: SOLVERS[name](A, b), b)
        assert got == replicated_expected * steps_per_body[name], (name, got)
    assert dl.solvers.Reason.DIVERGED_INCONSISTENT_RANKS == -20


# ---------------------------------------------------------------------------
# Converged claims backed by the true residual (issue 43, item 4)
def _ill_conditioned_diagonal(comm, rank, size, n=210):
    """A diagonal system of condition 1e12 with 7 distinct eigenvalues (so the
    Krylov methods converge fast, and their recurrences drift), sharded."""
    d_all = np.logspace(0, 12, 7)[np.arange(n) % 7]
    b_all = np.random.default_rng(3).standard_normal(n)
    part = ops.Partition.even(n, size)
    mine = slice(part.starts[rank], part.starts[rank + 1])
    d = jnp.asarray(d_all[mine])
    A = ops.LinearOperator(lambda d, v: d * v, data=d, input_structure=jnp.zeros(d.shape), layout="sharded",
                           symmetric=True, hermitian=True, comm=comm)
    return A, jnp.asarray(b_all[mine]), d_all, b_all


@pytest.mark.parametrize("name", ["cg", "cg1", "cgp", "minres", "gmres", "bicgstab"])
def test_converged_claims_are_backed_by_the_true_residual(comm, rank, size, name):
    """Every CONVERGED reason comes with ‖b − A x‖ ≤ rtol ‖b‖ on the gathered x
    (numpy); an unreachable tolerance ends as DIVERGED_ACCURACY_LOST, the same
    on every rank; verify_residual=False takes the recurrence's word (CG then
    claims convergence the true residual does not back, the issue's case)."""
    solver = {"gmres": dl.gmres, "bicgstab": dl.bicgstab, **SOLVERS}[name]
    A, b, d_all, b_all = _ill_conditioned_diagonal(comm, rank, size)
    limit = {"maxiter": 100} if name == "gmres" else {"maxiter": 3000}

    def true_relative_residual(x):
        x_all = np.concatenate(comm.allgather(np.asarray(x)))
        return np.linalg.norm(b_all - d_all * x_all) / np.linalg.norm(b_all)

    x, info = jax.jit(lambda b: solver(A, b, rtol=1e-14, **limit))(b)
    reasons = comm.allgather(int(info.reason))
    assert reasons == [reasons[0]] * size
    if int(info.reason) > 0:
        assert true_relative_residual(x) <= 1e-14, (name, Reason(int(info.reason)).name, true_relative_residual(x))
        # The reported norm is the checked one (equal to numpy's up to the rounding of b − A x itself).
        assert float(info.residual_norm) <= 1e-14 * np.linalg.norm(b_all)
        reported, recomputed = float(info.residual_norm) / np.linalg.norm(b_all), true_relative_residual(x)
        assert abs(reported - recomputed) <= 0.05 * recomputed + 1e-15, (reported, recomputed)  # (rounding floor)
    else:  # a failure said as one (pipelined CG's recurrences may see a negative curvature here)
        assert int(info.reason) < 0 and not bool(info.converged), (name, Reason(int(info.reason)).name)
    if name == "cg":
        _, unverified = solver(A, b, rtol=1e-14, verify_residual=False, **limit)
        assert int(unverified.reason) == Reason.CONVERGED_RTOL  # the recurrence's word ...
        x_loose, _ = solver(A, b, rtol=1e-14, verify_residual=False, maxiter=int(unverified.iterations))
        assert true_relative_residual(x_loose) > 1e-14        # ... which the true residual does not back
    if name in ("cg", "minres"):
        _, lost = solver(A, b, rtol=1e-17, **limit)  # below what float64 can reach here
        assert int(lost.reason) == Reason.DIVERGED_ACCURACY_LOST and not bool(lost.converged)
        assert comm.allgather(int(lost.iterations)) == [int(lost.iterations)] * size


def test_true_residual_check_in_the_replicated_layout_and_history(comm, rank, size):
    """Replicated layout (a matvec that allreduces): the check agrees on every
    rank; the history's last entry is the checked norm."""
    d_all = np.logspace(0, 12, 7)[np.arange(28) % 7]
    share = jnp.asarray(d_all / size)
    A = ops.LinearOperator(lambda s, v: allreduce(s * v, comm=comm), data=share, input_structure=jnp.zeros(28),
                           symmetric=True, hermitian=True, comm=comm)
    b = jnp.asarray(np.random.default_rng(4).standard_normal(28))
    x, info = cg(A, b, rtol=1e-13, maxiter=500, history=600)
    k = int(info.iterations)
    assert bool(info.converged), Reason(int(info.reason)).name
    assert np.linalg.norm(np.asarray(b) - d_all * np.asarray(x)) <= 1e-13 * np.linalg.norm(np.asarray(b))
    assert float(info.history[k]) == float(info.residual_norm)
    assert comm.allgather(k) == [k] * size


# ---------------------------------------------------------------------------
# Issue 57: shape checks agreed before the first message, and trace-time
# exchanges ordered after the programs a rank dispatched.
def test_non_square_sharded_operator_raises_on_every_rank(comm, rank, size):
    """Rows of an 8-column matrix that add up to 7: on some rank the operator maps
    a block of x to a block of another length. eigsh and cg raise on every rank
    (the rank whose block differs names it; the others name that rank) before any
    message; eigsh used to leave the other ranks in its first allgather."""
    from conftest import uneven_partition

    A = spd(3, 8)
    rows = uneven_partition(7, size)
    mine = jnp.asarray(A[rows.starts[rank]:rows.starts[rank + 1]])
    op = ops.dense_rows(mine, comm=comm)
    differs = op.input_structure.shape != op.output_structure.shape
    pattern = "is not square on this rank" if differs else "invalid solver arguments"
    b = jnp.ones(op.input_structure.shape)
    for name, call in {"eigsh": lambda: dl.eigsh(op, k=1),
                       "cg": lambda: cg(op, b),
                       "jitted cg": lambda: jax.jit(lambda b: cg(op, b)[0])(b)}.items():
        failure = failure_of(call, pattern)
        assert_no_failures(f"{name}: {failure}" if failure else "", comm)
    # The same rows, square, solve on every rank.
    square = ops.dense_rows(jnp.asarray(A[:7, :7][rows.starts[rank]:rows.starts[rank + 1]]), comm=comm)
    w, _, info = dl.eigsh(square, k=1, which="LA")
    assert bool(info.converged)
    np.testing.assert_allclose(float(w[0]), np.linalg.eigvalsh(A[:7, :7])[-1], rtol=1e-8)


@pytest.mark.timeout(120)
def test_trace_time_exchange_waits_for_the_programs_this_rank_dispatched(comm, rank, size):
    """Rank 0 is late to a solve (it sleeps before dispatching it) while the other
    ranks, whose solve is dispatched and waiting inside its first collective for
    rank 0, go on at once to trace a second solve: its trace-time exchanges (the
    operator's block sizes, the argument checks) are eager collectives on the same
    communicator. Each rank's exchange waits for the programs it dispatched, so it
    never runs beside, or pairs with, a collective of the first solve (issue 57:
    'Message truncated'; without the wait the second thread on the communicator
    is refused)."""
    import time

    from conftest import uneven_partition

    n = 6
    first = ops.laplacian_2d(n, row_partition=uneven_partition(n, size), comm=comm)
    b1 = jnp.ones(first.input_structure.shape)
    solve1 = jax.jit(lambda b: cg(first, b, rtol=1e-10)[0])
    solve1(b1).block_until_ready()  # compiled; every rank's next call runs the program alone
    if rank == 0:
        time.sleep(1.0)
    x1 = solve1(2.0 * b1)  # dispatched: asynchronous, still running when the next line starts
    second = ops.laplacian_2d(n + 1, row_partition=uneven_partition(n + 1, size), comm=comm)
    x2, info = jax.jit(lambda b: cg(second, b, rtol=1e-10))(jnp.ones(second.input_structure.shape))
    assert bool(info.converged)
    for x, op in ((x1, first), (x2, second)):
        residual = np.asarray(op.matvec(jnp.asarray(x))) - np.asarray(
            (2.0 if op is first else 1.0) * jnp.ones(op.input_structure.shape))
        total = float(allreduce(jnp.sum(jnp.asarray(residual) ** 2), comm=comm))
        assert total < 1e-12
