"""Conjugate gradients across ranks (Hestenes–Stiefel, and Chronopoulos–Gear).

For Hermitian positive definite A and preconditioner M (M ≈ A⁻¹, HPD):

    r₀ = b − A x₀,  z₀ = M r₀,  p₀ = z₀,  γ₀ = ⟨r₀, z₀⟩
    for k = 0, 1, ...
        q  = A p
        α  = γ / ⟨p, q⟩                         (reduction 1)
        x ← x + α p;   r ← r − α q;   z = M r
        γ' = ⟨r, z⟩, ρ = ⟨r, r⟩                 (reduction 2, fused)
        stop when √ρ ≤ max(rtol ‖b‖, atol)
        p ← z + (γ'/γ) p;   γ ← γ'

The single-reduction variant (Chronopoulos & Gear 1989) carries s = A p and
w = A u to compute ⟨r, u⟩, ⟨w, u⟩ and ⟨r, r⟩ in one fused reduction per
iteration, at the price of one more vector update (and, in finite precision,
a slightly different rounding behaviour).

The pipelined variant (Ghysels & Vanroose 2014, PETSc's KSPPIPECG) also
carries m = M w, n = A m and their recurrences z, q, s, p, so that the one
reduction of an iteration is *started* before the preconditioner and the
matvec and waited for after them: in the sharded layout the message travels
while A and M compute (a non-blocking ``iallreduce``). It costs four more
vector updates per iteration and, in finite precision, a residual that drifts
further from b − A x than the other variants' (the recurrences are longer).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from . import _arguments
from ._common import Reason, Reductions, Run, SolverInfo, finish_reason, first_reason, mark_inconsistent
from ._common import inconsistent, monitor_print, new_history, record, stopping_threshold
from ._driver import krylov_solve
from ._eager import compiled_when_eager
from ._vectors import Dot, Update, after, local_vdot, local_vdots, sub, update_and_dots, xpby, zeros_like

METHODS = ("standard", "single_reduction", "pipelined")


@compiled_when_eager
def cg(
    A: Any,
    b: Any,
    x0: Any = None,
    *,
    tol: float | None = None,
    rtol: float = 1e-5,
    atol: float = 0.0,
    maxiter: int | None = None,
    M: Any = None,
    layout: str | None = None,
    comm: Any = None,
    method: str = "standard",
    history: int = 0,
    monitor: bool = False,
    verify_residual: bool = True,
) -> tuple[Any, SolverInfo]:
    """Solve A x = b for Hermitian positive definite A by conjugate gradients.

    A drop-in for ``jax.scipy.sparse.linalg.cg`` (positional ``A, b, x0``;
    ``tol`` is an alias of ``rtol``) that runs across MPI ranks and reports
    convergence.

    Args:
      A: a callable ``v -> A v`` on pytrees shaped like `b`, a dense square
        array (replicated layout), or a distlinalg operator (its ``layout``
        must match). In the sharded layout the callable maps this rank's block
        of v to this rank's block of A v (it communicates as it needs).
      b: right-hand side, a pytree of arrays. Replicated layout: the whole
        vector, identical on every rank. Sharded: this rank's block of rows.
      x0: initial guess shaped like `b` (default zeros); not differentiated.
      rtol, atol: stop when ‖b − A x‖₂ ≤ max(rtol ‖b‖₂, atol) (global norms);
        finite, ≥ 0, not both 0.
      maxiter: iteration limit, an int ≥ 0 (default 10 × the global size;
        sharded layout: 10 × ranks × the largest block, agreed in-graph, so
        it is the same on every rank even when the blocks differ).
      M: preconditioner, a callable approximating A⁻¹ (HPD) in the same layout
        (e.g. :func:`distlinalg.solvers.jacobi`); not differentiated.
      layout: ``"replicated"`` or ``"sharded"`` (see distlinalg.solvers);
        default: the operator's ``layout`` for a distlinalg operator, else
        replicated. A real-linear operator (``A.real_linear``, e.g. a
        "complex"-mode Gram matrix) is solved on (Re, Im) pairs.
      comm: mpi4py communicator (default distlinalg's).
      method: ``"standard"`` (2 allreduces per iteration in the sharded
        layout), ``"single_reduction"`` (Chronopoulos–Gear, 1 allreduce) or
        ``"pipelined"`` (Ghysels–Vanroose: 1 non-blocking allreduce, in flight
        while the preconditioner and the matvec run; pays where a reduction
        costs as much as a matvec, i.e. many ranks or small blocks). The
        replicated layout has no reductions to hide (its one agreement message
        per iteration is blocking in every method).
      history: keep the residual norms of the first `history` iterations.
      monitor: print ``k KSP Residual norm r`` on rank 0 every iteration.
      verify_residual: when the iteration claims convergence, compute the
        true residual ‖b − A x‖ (one matvec) and restart from x if it misses
        the tolerance; a claim that restarts cannot back ends as
        ``DIVERGED_ACCURACY_LOST``, and ``info.residual_norm`` is the true
        norm (docs/solvers.md). False: the recurrence's word, no matvec.

    Returns:
      ``(x, info)``: x shaped like `b` (same layout), and a
      :class:`SolverInfo` identical on every rank. ``info.residual_norm`` is
      the recurrence residual (not recomputed from b − A x).

    Ranks that disagree never hang: the loop's bounds and stopping tests are
    identical on every rank by construction. Once per solve one small
    allreduce compares rtol, atol and maxiter (and, replicated layout, the
    size, norm and a projection of b); in the first iteration the replicated
    layout also compares the residual norm and the curvature ⟨p, A p⟩ (in
    the message each iteration sends anyway). A disagreement, or a traced
    tolerance that is invalid on some rank, stops every rank with
    ``Reason.DIVERGED_INCONSISTENT_RANKS`` (x = x0 when caught before the
    first step). Arguments that can be checked at trace time (Python-number
    tolerances, layout, shapes) raise a ValueError on every rank, also when
    they are invalid on one rank only.

    AD: wrapped in ``lax.custom_linear_solve``: JVPs and gradients with
    respect to b and to whatever A's matvec closes over (including values
    that flow through collectives) cost one more CG solve with the same
    operator; nothing is differentiated through the iterations. vmap over b
    solves all right-hand sides in one loop (one message per reduction for
    the whole batch) until every lane has stopped; each lane keeps its own
    info.

    Example:
      A replicated solve (every rank holds A and b), and its gradient:

      >>> import jax, jax.numpy as jnp
      >>> import distlinalg as dl
      >>> A = jnp.array([[4.0, 1.0], [1.0, 3.0]])
      >>> b = jnp.array([1.0, 2.0])
      >>> x, info = dl.cg(A, b, rtol=1e-6)
      >>> bool(info.converged), dl.solvers.Reason(int(info.reason)).name
      (True, 'CONVERGED_RTOL')
      >>> bool(jnp.allclose(x, jnp.linalg.solve(A, b), atol=1e-5))
      True
      >>> g = jax.grad(lambda b: dl.cg(A, b, rtol=1e-6)[0].sum())(b)   # = A⁻ᵀ 1
      >>> bool(jnp.allclose(g, jnp.linalg.solve(A.T, jnp.ones(2)), atol=1e-5))
      True

      A sharded solve: the 2-D Laplacian's grid rows split over the ranks,
      each rank passing its block of b:

      >>> from distlinalg.operators import laplacian_2d
      >>> L = laplacian_2d(8)
      >>> b = jnp.ones(L.input_structure.shape)
      >>> x, info = jax.jit(lambda b: dl.cg(L, b, rtol=1e-6))(b)
      >>> bool(info.converged), L.layout
      (True, 'sharded')
    """
    if method not in METHODS:
        raise ValueError(f"distlinalg.cg: method must be one of {METHODS}, got {method!r}")
    if _arguments.is_real_linear(A):
        return _arguments.solve_real_linear(
            cg, A, b, x0, M, tol=tol, rtol=rtol, atol=atol, maxiter=maxiter, layout=layout, comm=comm,
            method=method, history=history, monitor=monitor, verify_residual=verify_residual,
        )
    p = _arguments.setup(A, b, x0, M, tol, rtol, atol, maxiter, layout, comm)
    body = {"standard": _standard, "single_reduction": _single_reduction, "pipelined": _pipelined}[method]
    return krylov_solve(body, p.matvec, p.b, p, history=history, monitor=monitor, verify_residual=verify_residual)


def _unless(plain: bool, v: Any) -> Any:
    """A loop slot that an unpreconditioned solve does not carry (None: it equals another slot)."""
    return None if plain else v


def _or(v: Any, same: Any) -> Any:
    """The slot's value, or the slot it equals in an unpreconditioned solve."""
    return same if v is None else v


def _converged(rr: Any, threshold: Any) -> Any:
    """‖r‖ ≤ max(rtol ‖b‖, atol), from the agreed ‖r‖²."""
    return jnp.sqrt(rr) <= threshold


def _agree_start(red: Reductions, rr: Any, bb: Any, failure: Any, start: Any, probe: Any = None):
    """The agreed initial state: (‖r₀‖², ‖b‖ (both identical on every rank), failure code).

    Replicated layout: one message carries ‖r₀‖² (max and min), the failure
    code, ‖b‖² (so the stopping threshold is the same everywhere, not just
    up to each rank's rounding of a local inner product) and the probe; a
    disagreement beyond rounding is DIVERGED_INCONSISTENT_RANKS.
    """
    failure = jnp.where(start != Reason.ITERATING, start, failure)
    agreed = red.agree(rr, failure, also=[bb], probe=probe)
    b_norm = jnp.sqrt(agreed.also[0])
    failure = mark_inconsistent(agreed.failure, inconsistent(agreed, True, b_norm, squared=True))
    return agreed.value, b_norm, failure


def _result(final: Any, threshold: Any, from_atol: Any, maxiter: Any):
    """(x, SolverInfo) from the final loop state (any of the states below: x, rr, k, reason, history)."""
    x, rr, k, reason, hist = final.x, final.rr, final.k, final.reason, final.history
    converged = (reason == Reason.ITERATING) & _converged(rr, threshold)
    return x, SolverInfo(k, jnp.sqrt(rr), converged, finish_reason(from_atol, converged, k, maxiter, reason), hist)


# ---------------------------------------------------------------------------
class StandardState(NamedTuple):
    """Hestenes–Stiefel CG at the top of an iteration."""

    x: Any
    r: Any      # b − A x
    z: Any      # M r
    p: Any      # search direction
    gamma: Any  # ⟨r, z⟩
    rr: Any     # ⟨r, r⟩, agreed across ranks
    k: Any
    reason: Any
    history: Any


def _standard(run: Run):
    real = jnp.real  # ⟨·,·⟩ of HPD systems is real
    matvec, precond, red, b, x0, maxiter = run.matvec, run.precond, run.red, run.b, run.x0, run.maxiter
    r = sub(b, matvec(x0))                                          # r₀ = b − A x₀
    z = precond(r)                                                  # z₀ = M r₀
    gamma, rr, bb = map(real, red.dots([(r, z), (r, r), (b, b)]))   # γ₀ = ⟨r₀, z₀⟩, ρ₀ = ⟨r₀, r₀⟩
    failure = first_reason((~jnp.isfinite(rr) | ~jnp.isfinite(gamma), Reason.DIVERGED_NANORINF))
    rr, b_norm, failure = _agree_start(red, rr, bb, failure, run.start)
    threshold, from_atol = stopping_threshold(b_norm, run.rtol, run.atol)
    hist = record(new_history(run.history, rr.dtype), 0, jnp.sqrt(rr))
    monitor_print("cg", red.comm, run.monitor, 0, jnp.sqrt(rr))

    def keep_going(s: StandardState):
        return (s.reason == Reason.ITERATING) & (s.k < maxiter) & ~_converged(s.rr, threshold)

    def step(s: StandardState) -> StandardState:
        q = matvec(s.p)                                             # q = A p
        (pq,) = map(real, red.dots([(s.p, q)]))                     # ⟨p, A p⟩
        curvature_failure = first_reason((~jnp.isfinite(pq), Reason.DIVERGED_NANORINF),
                                         (pq < 0, Reason.DIVERGED_INDEFINITE_MAT),
                                         (pq == 0, Reason.DIVERGED_BREAKDOWN))
        # A failed step must not move x: a zero step length keeps every
        # vector as it was without a select over whole vectors.
        alpha = jnp.where(curvature_failure == Reason.ITERATING, s.gamma / pq, jnp.zeros_like(pq))  # α = γ / ⟨p, q⟩
        # One pass over memory:
        (x, r), (rr_local,) = update_and_dots(
            Update("x", [(1, s.x), (alpha, s.p)]),                  # x ← x + α p
            Update("r", [(1, s.r), (-alpha, q)]),                   # r ← r − α q
            dots=[Dot("r", "r")])                                   # ρ = ⟨r, r⟩ of the new r
        z = precond(r)                                              # z = M r
        if precond is _arguments.identity:                          # γ' = ρ (z = r)
            (rr_new,) = map(real, red.totals([rr_local]))
            gamma_new = rr_new
        else:                                                       # γ' = ⟨r, z⟩ in the same reduction
            gamma_new, rr_new = map(real, red.totals([local_vdot(r, z), rr_local]))
        failure = first_reason((curvature_failure != Reason.ITERATING, curvature_failure),
                               (~jnp.isfinite(rr_new) | ~jnp.isfinite(gamma_new), Reason.DIVERGED_NANORINF),
                               (gamma_new < 0, Reason.DIVERGED_INDEFINITE_PC))
        # First step: also compare ‖r₁‖ and the curvature ⟨p, A p⟩ across ranks.
        rr_new, failure = red.agree_step(rr_new, failure, check=s.k == 0, scale=b_norm, squared=True,
                                         probe=(pq, jnp.abs(pq)))
        ok = failure == Reason.ITERATING
        p = xpby(z, gamma_new / s.gamma, after(x, s.p))            # p ← z + (γ'/γ) p (after x: in place)
        rr = jnp.where(ok, rr_new, s.rr)
        k = s.k + ok.astype(jnp.int32)
        monitor_print("cg", red.comm, run.monitor, k, jnp.sqrt(rr))
        return StandardState(x, r, z, p, jnp.where(ok, gamma_new, s.gamma), rr, k, failure,
                             record(s.history, k, jnp.sqrt(rr)))

    s = jax.lax.while_loop(keep_going, step, StandardState(x0, r, z, z, gamma, rr, jnp.int32(0), failure, hist))
    return _result(s, threshold, from_atol, maxiter)


# ---------------------------------------------------------------------------
class SingleReductionState(NamedTuple):
    """Chronopoulos–Gear CG at the top of an iteration (p, s of the previous one)."""

    x: Any
    r: Any      # b − A x
    u: Any      # M r
    w: Any      # A u
    p: Any      # previous search direction
    s: Any      # A p
    alpha: Any  # step length of this iteration
    beta: Any   # β of this iteration (0 in the first)
    gamma: Any  # ⟨r, u⟩
    delta: Any  # ⟨w, u⟩
    rr: Any     # ⟨r, r⟩, agreed across ranks
    k: Any
    reason: Any
    history: Any


class StartWithAu(NamedTuple):
    """The start of the single-reduction and pipelined variants: r₀, u₀ = M r₀,
    w₀ = A u₀, their inner products, and what the ranks agreed on."""

    r: Any
    u: Any
    w: Any
    gamma: Any      # ⟨r₀, u₀⟩
    delta: Any      # ⟨u₀, A u₀⟩
    rr: Any         # ‖r₀‖², agreed
    b_norm: Any     # ‖b‖, agreed
    threshold: Any  # max(rtol ‖b‖, atol)
    from_atol: Any
    failure: Any
    history: Any


def _start_with_Au(run: Run, check_curvature: bool) -> StartWithAu:
    real = jnp.real
    matvec, precond, red, b = run.matvec, run.precond, run.red, run.b
    r = sub(b, matvec(run.x0))                                      # r₀ = b − A x₀
    u = precond(r)                                                  # u₀ = M r₀
    w = matvec(u)                                                   # w₀ = A u₀
    if precond is _arguments.identity:                                         # γ₀ = ρ₀ (u₀ = r₀)
        delta, rr, bb = map(real, red.dots([(u, w), (r, r), (b, b)]))
        gamma = rr
    else:
        gamma, delta, rr, bb = map(real, red.dots([(r, u), (u, w), (r, r), (b, b)]))
    curvature = [(delta < 0, Reason.DIVERGED_INDEFINITE_MAT), (delta == 0, Reason.DIVERGED_BREAKDOWN)]
    failure = first_reason((~jnp.isfinite(rr) | ~jnp.isfinite(gamma) | ~jnp.isfinite(delta), Reason.DIVERGED_NANORINF),
                           *(curvature if check_curvature else []))
    # The first matvec of A u₀ is here: ⟨u₀, A u₀⟩ is the curvature probe.
    rr, b_norm, failure = _agree_start(red, rr, bb, failure, run.start, probe=(delta, jnp.abs(delta)))
    threshold, from_atol = stopping_threshold(b_norm, run.rtol, run.atol)
    hist = record(new_history(run.history, rr.dtype), 0, jnp.sqrt(rr))
    monitor_print("cg", red.comm, run.monitor, 0, jnp.sqrt(rr))
    return StartWithAu(r, u, w, gamma, delta, rr, b_norm, threshold, from_atol, failure, hist)


def _single_reduction(run: Run):
    real = jnp.real
    matvec, precond, red, maxiter = run.matvec, run.precond, run.red, run.maxiter
    r, u, w, gamma, delta, rr, b_norm, threshold, from_atol, failure, hist = _start_with_Au(run, check_curvature=True)
    # Already converged at x₀: a vanishing curvature is harmless then.
    curvature_only = (failure == Reason.DIVERGED_INDEFINITE_MAT) | (failure == Reason.DIVERGED_BREAKDOWN)
    plain = precond is _arguments.identity  # u = r: not carried twice (XLA would copy one slot per iteration)
    failure = jnp.where(curvature_only & _converged(rr, threshold), Reason.ITERATING, failure).astype(jnp.int32)

    def keep_going(st: SingleReductionState):
        return (st.reason == Reason.ITERATING) & (st.k < maxiter) & ~_converged(st.rr, threshold)

    def step(st: SingleReductionState) -> SingleReductionState:
        # One pass over memory, each vector in place:
        (p, s, x, r), (rr_local,) = update_and_dots(
            Update("p", [(st.beta, st.p), (1, _or(st.u, st.r))]),  # p ← u + β p
            Update("s", [(st.beta, st.s), (1, st.w)]),              # s ← w + β s (= A p)
            Update("x", [(1, st.x), (st.alpha, "p")]),              # x ← x + α p
            Update("r", [(1, st.r), (-st.alpha, "s")]),             # r ← r − α s
            dots=[Dot("r", "r")])                                   # ρ = ⟨r, r⟩ of the new r
        u = precond(r)                                              # u = M r
        w = matvec(u)                                               # w = A u
        if plain:                                                   # γ' = ρ (u = r)
            delta, rr = map(real, red.totals([local_vdot(u, w), rr_local]))  # δ', ρ: one reduction
            gamma = rr
        else:                                                       # γ', δ', ρ: one reduction
            gamma, delta, rr = map(real, red.totals([*local_vdots([(r, u), (u, w)]), rr_local]))
        beta = gamma / st.gamma                                     # β' = γ'/γ
        curvature = delta - beta * gamma / st.alpha                 # ⟨p', A p'⟩ = δ' − β' γ'/α
        done = _converged(rr, threshold)  # once converged the next curvature may vanish harmlessly
        failure = first_reason(
            (~jnp.isfinite(rr) | ~jnp.isfinite(gamma) | ~jnp.isfinite(delta), Reason.DIVERGED_NANORINF),
            (~done & (curvature < 0), Reason.DIVERGED_INDEFINITE_MAT),
            (~done & (curvature == 0), Reason.DIVERGED_BREAKDOWN),
            (~done & (gamma < 0), Reason.DIVERGED_INDEFINITE_PC))
        rr, failure = red.agree_step(rr, failure, check=st.k == 0, scale=b_norm, squared=True)
        ok = failure == Reason.ITERATING
        # The update of this step used the previous, validated α; a failure
        # detected now only stops the loop (no select over whole vectors).
        k = st.k + ok.astype(jnp.int32)
        rr = jnp.where(ok, rr, st.rr)
        monitor_print("cg", red.comm, run.monitor, k, jnp.sqrt(rr))
        return SingleReductionState(x, r, _unless(plain, u), w, p, s, gamma / curvature, beta, gamma, delta, rr, k,
                                    failure, record(st.history, k, jnp.sqrt(rr)))

    zeros = zeros_like(run.b)
    state = SingleReductionState(run.x0, r, _unless(plain, u), w, zeros, zeros, gamma / delta, jnp.zeros_like(gamma),
                                 gamma, delta, rr, jnp.int32(0), failure, hist)
    st = jax.lax.while_loop(keep_going, step, state)
    return _result(st, threshold, from_atol, maxiter)


# ---------------------------------------------------------------------------
class PipelinedState(NamedTuple):
    """Ghysels–Vanroose pipelined CG at the top of an iteration.

    Invariants (exact arithmetic): u = M r, w = A u, m = M w, n = A m, and
    γ = ⟨r, u⟩, δ = ⟨w, u⟩, ρ = ⟨r, r⟩ of the current r (reduced in the
    previous iteration, while m and n were computed).
    """

    x: Any
    r: Any
    u: Any
    w: Any
    m: Any
    n: Any
    z: Any          # A q
    q: Any          # M s
    s: Any          # A p
    p: Any          # search direction
    gamma: Any
    delta: Any
    gamma_old: Any  # γ of the previous iteration (unused at k = 0: β₀ = 0)
    alpha_old: Any  # α of the previous iteration (likewise)
    rr: Any         # agreed across ranks
    k: Any
    reason: Any
    history: Any


def _pipelined(run: Run):
    real = jnp.real
    matvec, precond, red, maxiter = run.matvec, run.precond, run.red, run.maxiter
    r, u, w, gamma, delta, rr, b_norm, threshold, from_atol, failure, hist = _start_with_Au(run, check_curvature=False)
    m = precond(w)                                                  # m₀ = M w₀
    n = matvec(m)                                                   # n₀ = A m₀
    # Without a preconditioner u = r, m = w and q = s: those recurrences are
    # not run or carried (three vectors' updates and copies per iteration).
    plain = precond is _arguments.identity

    def keep_going(st: PipelinedState):
        return (st.reason == Reason.ITERATING) & (st.k < maxiter) & ~_converged(st.rr, threshold)

    def precondition_and_apply(w):                                  # ... while these run:
        m = precond(w)                                              # m = M w
        return m, matvec(m)                                         # n = A m

    def step(st: PipelinedState) -> PipelinedState:
        first = st.k == 0
        beta = jnp.where(first, jnp.zeros_like(st.gamma), st.gamma / st.gamma_old)              # β = γ / γ₋₁
        curvature = jnp.where(first, st.delta, st.delta - beta * st.gamma / st.alpha_old)     # ⟨p, A p⟩, new p
        failure = first_reason((curvature < 0, Reason.DIVERGED_INDEFINITE_MAT),
                               (curvature == 0, Reason.DIVERGED_BREAKDOWN),
                               (st.gamma < 0, Reason.DIVERGED_INDEFINITE_PC))
        # A failed step must not move x or r: a zero step length.
        alpha = jnp.where(failure == Reason.ITERATING, st.gamma / curvature, jnp.zeros_like(st.gamma))
        # The vector updates and the new r's (and u's) inner products: one
        # pass over memory, each vector in place.
        updates = [Update("z", [(beta, st.z), (1, st.n)]),                  # z ← n + β z (= A q)
                   Update("s", [(beta, st.s), (1, st.w)]),                  # s ← w + β s (= A p)
                   Update("p", [(beta, st.p), (1, _or(st.u, st.r))]),       # p ← u + β p
                   Update("x", [(1, st.x), (alpha, "p")]),                  # x ← x + α p
                   Update("r", [(1, st.r), (-alpha, "s")]),                 # r ← r − α s
                   Update("w", [(1, st.w), (-alpha, "z")])]                 # w ← w − α z (= A u)
        if plain:                                                   # u = r, q = s, m = w
            dots = [Dot("w", "r"), Dot("r", "r")]                   # δ' = ⟨w, r⟩, ρ' = ⟨r, r⟩ (= γ')
            (z, s, p, x, r, w), local = update_and_dots(*updates, dots=dots)
            u = q = None
            pending = red.start_totals(local)                       # δ' = ⟨w, r⟩, ρ' = γ' under way ...
            (delta, rr), n = red.finish_while(pending, matvec, w)   # ... while n = A w runs
            gamma, m = rr, None
        else:
            updates += [Update("q", [(beta, st.q), (1, st.m)]),             # q ← m + β q (= M s)
                        Update("u", [(1, st.u), (-alpha, "q")])]            # u ← u − α q (= M r)
            dots = [Dot("r", "u"), Dot("w", "u"), Dot("r", "r")]  # γ' = ⟨r, u⟩, δ' = ⟨w, u⟩, ρ' = ⟨r, r⟩
            (z, s, p, x, r, w, q, u), local = update_and_dots(*updates, dots=dots)
            pending = red.start_totals(local)                       # γ', δ', ρ' under way ...
            (gamma, delta, rr), (m, n) = red.finish_while(pending, precondition_and_apply, w)
        gamma, delta, rr = map(real, (gamma, delta, rr))
        failure = first_reason((failure != Reason.ITERATING, failure),
                               (~jnp.isfinite(rr) | ~jnp.isfinite(gamma) | ~jnp.isfinite(delta),
                                Reason.DIVERGED_NANORINF))
        # First step: also compare ‖r₁‖ and the curvature across ranks (replicated layout).
        rr, failure = red.agree_step(rr, failure, check=first, scale=b_norm, squared=True,
                                     probe=(curvature, jnp.abs(curvature)))
        ok = failure == Reason.ITERATING
        keep = lambda new, old: jnp.where(ok, new, old)  # noqa: E731  (scalars of a failed step stay)
        k = st.k + ok.astype(jnp.int32)
        rr = keep(rr, st.rr)
        monitor_print("cg", red.comm, run.monitor, k, jnp.sqrt(rr))
        return PipelinedState(x, r, u, w, m, n, z, q, s, p, keep(gamma, st.gamma), keep(delta, st.delta),
                              keep(st.gamma, st.gamma_old), keep(alpha, st.alpha_old), rr, k, failure,
                              record(st.history, k, jnp.sqrt(rr)))

    zeros = zeros_like(run.b)
    one = jnp.ones_like(gamma)
    state = PipelinedState(run.x0, r, _unless(plain, u), w, _unless(plain, m), n, zeros, _unless(plain, zeros), zeros,
                           zeros, gamma, delta, one, one, rr, jnp.int32(0), failure, hist)
    st = jax.lax.while_loop(keep_going, step, state)
    return _result(st, threshold, from_atol, maxiter)
