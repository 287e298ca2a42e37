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

from typing import Any

import jax
import jax.numpy as jnp

from . import _common as C
from ._common import Reason, SolverInfo
from ._driver import krylov_solve

METHODS = ("standard", "single_reduction", "pipelined")


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
    """
    if method not in METHODS:
        raise ValueError(f"distlinalg.cg: method must be one of {METHODS}, got {method!r}")
    if C.is_real_linear(A):
        return C.solve_real_linear(
            cg, A, b, x0, M, tol=tol, rtol=rtol, atol=atol, maxiter=maxiter, layout=layout, comm=comm,
            method=method, history=history, monitor=monitor,
        )
    p = C.setup(A, b, x0, M, tol, rtol, atol, maxiter, layout, comm)
    body = {"standard": _standard, "single_reduction": _single_reduction, "pipelined": _pipelined}[method]

    def iterate(mv, rhs, x_init, rtol_agreed, atol_scaled, maxiter_agreed, start):
        return body(mv, rhs, x_init, p.precond, rtol_agreed, atol_scaled, maxiter_agreed, start, p.reductions,
                    history, monitor)

    return krylov_solve(iterate, p.matvec, p.b, p, history=history)


def _status(rr_agreed: Any, threshold: Any, k: Any) -> Any:
    return jnp.sqrt(rr_agreed) <= threshold


def _start(red: C.Reductions, rr: Any, bb: Any, failure: Any, start: Any, probe: Any = None):
    """The agreed initial state: (‖r₀‖², ‖b‖ (both identical on every rank), failure code).

    Replicated layout: one message carries ‖r₀‖² (max and min), the failure
    code, ‖b‖² (so the stopping threshold is the same everywhere, not just
    up to each rank's rounding of a local inner product) and the probe; a
    disagreement beyond rounding is DIVERGED_INCONSISTENT_RANKS.
    """
    failure = jnp.where(start != Reason.ITERATING, start, failure)
    agreed = red.agree(rr, failure, also=[bb], probe=probe)
    b_norm = jnp.sqrt(agreed.also[0])
    failure = C.mark_inconsistent(agreed.failure, C.inconsistent(agreed, True, b_norm, squared=True))
    return agreed.value, b_norm, failure


def _standard(matvec, b, x0, precond, rtol, atol, maxiter, start, red: C.Reductions, history, monitor):
    real = lambda v: jnp.real(v)  # noqa: E731  (⟨·,·⟩ of HPD systems is real)
    r = C.tree_sub(b, matvec(x0))
    z = precond(r)
    gamma, rr, bb = map(real, red.dots([(r, z), (r, r), (b, b)]))
    nonfinite0 = ~jnp.isfinite(rr) | ~jnp.isfinite(gamma)
    failure0 = jnp.where(nonfinite0, Reason.DIVERGED_NANORINF, Reason.ITERATING).astype(jnp.int32)
    rr, b_norm, reason0 = _start(red, rr, bb, failure0, start)
    threshold, from_atol = C.stopping_threshold(b_norm, rtol, atol)
    dtype = rr.dtype
    hist = C.record(C.new_history(history, dtype), 0, jnp.sqrt(rr))
    C.monitor_print("cg", red.comm, monitor, 0, jnp.sqrt(rr))
    state = (x0, r, z, z, gamma, rr, jnp.int32(0), reason0, hist)

    def keep_going(s):
        *_, rr, k, reason, _ = s
        return (reason == Reason.ITERATING) & (k < maxiter) & ~_status(rr, threshold, k)

    def step(s):
        x, r, z, p, gamma, rr, k, reason, hist = s
        q = matvec(p)
        (pq,) = map(real, red.dots([(p, q)]))
        curvature_failure = jnp.where(
            ~jnp.isfinite(pq), Reason.DIVERGED_NANORINF,
            jnp.where(pq < 0, Reason.DIVERGED_INDEFINITE_MAT,
                      jnp.where(pq == 0, Reason.DIVERGED_BREAKDOWN, Reason.ITERATING)),
        )
        # A failed step must not move x: a zero step length keeps every
        # vector as it was without a select over whole vectors.
        alpha = jnp.where(curvature_failure == Reason.ITERATING, gamma / pq, jnp.zeros_like(pq))
        x = C.tree_axpy(alpha, p, x)
        r = C.tree_axpy(-alpha, q, r)
        z = precond(r)
        gamma_new, rr_new = map(real, red.dots([(r, z), (r, r)]))
        failure = jnp.where(
            curvature_failure != Reason.ITERATING,
            curvature_failure,
            jnp.where(~jnp.isfinite(rr_new) | ~jnp.isfinite(gamma_new), Reason.DIVERGED_NANORINF,
                      jnp.where(gamma_new < 0, Reason.DIVERGED_INDEFINITE_PC, Reason.ITERATING)),
        )
        # First step: also compare ‖r₁‖ and the curvature ⟨p, A p⟩ across ranks.
        rr_new, failure = _agree(red, rr_new, failure, k == 0, b_norm, (pq, jnp.abs(pq)))
        ok = failure == Reason.ITERATING
        p = C.tree_scale_add(z, gamma_new / gamma, p)
        gamma = jnp.where(ok, gamma_new, gamma)
        rr = jnp.where(ok, rr_new, rr)
        k = k + ok.astype(jnp.int32)
        hist = C.record(hist, k, jnp.sqrt(rr)) if hist is not None else None
        C.monitor_print("cg", red.comm, monitor, k, jnp.sqrt(rr))
        return (x, r, z, p, gamma, rr, k, failure.astype(jnp.int32), hist)

    x, _, _, _, _, rr, k, reason, hist = jax.lax.while_loop(keep_going, step, state)
    converged = (reason == Reason.ITERATING) & _status(rr, threshold, k)
    reason = C.finish_reason(from_atol, converged, k, maxiter, reason)
    return x, SolverInfo(k, jnp.sqrt(rr), converged, reason, hist)


def _single_reduction(matvec, b, x0, precond, rtol, atol, maxiter, start, red: C.Reductions, history, monitor):
    real = lambda v: jnp.real(v)  # noqa: E731
    r = C.tree_sub(b, matvec(x0))
    u = precond(r)
    w = matvec(u)
    gamma, delta, rr, bb = map(real, red.dots([(r, u), (u, w), (r, r), (b, b)]))
    nonfinite0 = ~jnp.isfinite(rr) | ~jnp.isfinite(gamma) | ~jnp.isfinite(delta)
    curvature0 = jnp.where(delta > 0, Reason.ITERATING,
                           jnp.where(delta < 0, Reason.DIVERGED_INDEFINITE_MAT, Reason.DIVERGED_BREAKDOWN))
    failure0 = jnp.where(nonfinite0, Reason.DIVERGED_NANORINF, curvature0).astype(jnp.int32)
    # The first matvec of A u₀ is here: ⟨u₀, A u₀⟩ is the curvature probe.
    rr, b_norm, failure0 = _start(red, rr, bb, failure0, start, probe=(delta, jnp.abs(delta)))
    threshold, from_atol = C.stopping_threshold(b_norm, rtol, atol)
    hist = C.record(C.new_history(history, rr.dtype), 0, jnp.sqrt(rr))
    C.monitor_print("cg", red.comm, monitor, 0, jnp.sqrt(rr))
    alpha = gamma / delta
    zeros = jax.tree_util.tree_map(jnp.zeros_like, b)
    # Already converged at x0: a vanishing curvature is harmless then.
    curvature_only = (failure0 == Reason.DIVERGED_INDEFINITE_MAT) | (failure0 == Reason.DIVERGED_BREAKDOWN)
    reason0 = jnp.where(curvature_only & _status(rr, threshold, 0), Reason.ITERATING, failure0)
    state = (x0, r, u, w, zeros, zeros, alpha, jnp.zeros_like(gamma), gamma, delta, rr, jnp.int32(0),
             reason0.astype(jnp.int32), hist)

    def keep_going(s):
        rr, k, reason = s[10], s[11], s[12]
        return (reason == Reason.ITERATING) & (k < maxiter) & ~_status(rr, threshold, k)

    def step(s):
        x, r, u, w, p, sv, alpha, beta, gamma, delta, rr, k, reason, hist = s
        p_new = C.tree_scale_add(u, beta, p)
        s_new = C.tree_scale_add(w, beta, sv)
        x_new = C.tree_axpy(alpha, p_new, x)
        r_new = C.tree_axpy(-alpha, s_new, r)
        u_new = precond(r_new)
        w_new = matvec(u_new)
        gamma_new, delta_new, rr_new = map(real, red.dots([(r_new, u_new), (u_new, w_new), (r_new, r_new)]))
        beta_new = gamma_new / gamma
        # ⟨p', A p'⟩ of the next direction; must stay positive for HPD A
        # (once converged it may vanish harmlessly).
        curvature = delta_new - beta_new * gamma_new / alpha
        alpha_new = gamma_new / curvature
        done = _status(rr_new, threshold, k)
        failure = jnp.where(
            ~jnp.isfinite(rr_new) | ~jnp.isfinite(gamma_new) | ~jnp.isfinite(delta_new),
            Reason.DIVERGED_NANORINF,
            jnp.where(
                done,
                Reason.ITERATING,
                jnp.where(curvature < 0, Reason.DIVERGED_INDEFINITE_MAT,
                          jnp.where(curvature == 0, Reason.DIVERGED_BREAKDOWN,
                                    jnp.where(gamma_new < 0, Reason.DIVERGED_INDEFINITE_PC, Reason.ITERATING))),
            ),
        )
        rr_new, failure = _agree(red, rr_new, failure, k == 0, b_norm)
        ok = failure == Reason.ITERATING
        # The update of this step used the previous, validated α; a failure
        # detected now only stops the loop (no select over whole vectors).
        x, r, u, w, p, sv = x_new, r_new, u_new, w_new, p_new, s_new
        alpha, beta, gamma, delta = alpha_new, beta_new, gamma_new, delta_new
        rr = jnp.where(ok, rr_new, rr)
        k = k + ok.astype(jnp.int32)
        hist = C.record(hist, k, jnp.sqrt(rr)) if hist is not None else None
        C.monitor_print("cg", red.comm, monitor, k, jnp.sqrt(rr))
        return (x, r, u, w, p, sv, alpha, beta, gamma, delta, rr, k, failure.astype(jnp.int32), hist)

    out = jax.lax.while_loop(keep_going, step, state)
    x, rr, k, reason, hist = out[0], out[10], out[11], out[12], out[13]
    converged = (reason == Reason.ITERATING) & _status(rr, threshold, k)
    reason = C.finish_reason(from_atol, converged, k, maxiter, reason)
    return x, SolverInfo(k, jnp.sqrt(rr), converged, reason, hist)


def _pipelined(matvec, b, x0, precond, rtol, atol, maxiter, start, red: C.Reductions, history, monitor):
    """Ghysels–Vanroose pipelined CG: one reduction per iteration, overlapped.

    Invariants at the top of iteration k (exact arithmetic): u = M r, w = A u,
    m = M w, n = A m, and γ = ⟨r, u⟩, δ = ⟨w, u⟩, ρ = ⟨r, r⟩ of the current r
    (reduced in the previous iteration, while m and n were computed).
    """
    real = lambda v: jnp.real(v)  # noqa: E731
    r = C.tree_sub(b, matvec(x0))                                   # r₀ = b − A x₀
    u = precond(r)                                                  # u₀ = M r₀
    w = matvec(u)                                                   # w₀ = A u₀
    gamma, delta, rr, bb = map(real, red.dots([(r, u), (w, u), (r, r), (b, b)]))
    nonfinite0 = ~jnp.isfinite(rr) | ~jnp.isfinite(gamma) | ~jnp.isfinite(delta)
    failure0 = jnp.where(nonfinite0, Reason.DIVERGED_NANORINF, Reason.ITERATING).astype(jnp.int32)
    rr, b_norm, reason0 = _start(red, rr, bb, failure0, start, probe=(delta, jnp.abs(delta)))
    threshold, from_atol = C.stopping_threshold(b_norm, rtol, atol)
    hist = C.record(C.new_history(history, rr.dtype), 0, jnp.sqrt(rr))
    C.monitor_print("cg", red.comm, monitor, 0, jnp.sqrt(rr))
    m = precond(w)                                                  # m₀ = M w₀
    n = matvec(m)                                                   # n₀ = A m₀
    zeros = jax.tree_util.tree_map(jnp.zeros_like, b)
    one = jnp.ones_like(gamma)
    # (z, q, s, p) = (A q, M s, A p, the direction); γ₋₁ and α₋₁ are unused at k = 0 (β₀ = 0).
    state = (x0, r, u, w, m, n, zeros, zeros, zeros, zeros, gamma, delta, one, one, rr, jnp.int32(0),
             reason0, hist)

    def keep_going(st):
        rr, k, reason = st[14], st[15], st[16]
        return (reason == Reason.ITERATING) & (k < maxiter) & ~_status(rr, threshold, k)

    def precondition_and_apply(w):                                  # ... while these run:
        m = precond(w)                                              # m = M w
        return m, matvec(m)                                         # n = A m

    def step(st):
        x, r, u, w, m, n, z, q, s, p, gamma, delta, gamma_old, alpha_old, rr, k, reason, hist = st
        first = k == 0
        beta = jnp.where(first, jnp.zeros_like(gamma), gamma / gamma_old)           # β = γ / γ₋₁
        curvature = jnp.where(first, delta, delta - beta * gamma / alpha_old)       # ⟨p, A p⟩ of the new p
        failure = jnp.where(
            curvature < 0, Reason.DIVERGED_INDEFINITE_MAT,
            jnp.where(curvature == 0, Reason.DIVERGED_BREAKDOWN,
                      jnp.where(gamma < 0, Reason.DIVERGED_INDEFINITE_PC, Reason.ITERATING)),
        )
        # A failed step must not move x or r: a zero step length.
        alpha = jnp.where(failure == Reason.ITERATING, gamma / curvature, jnp.zeros_like(gamma))
        z = C.tree_scale_add(n, beta, z)                            # z = n + β z    (= A q)
        q = C.tree_scale_add(m, beta, q)                            # q = m + β q    (= M s)
        s = C.tree_scale_add(w, beta, s)                            # s = w + β s    (= A p)
        p = C.tree_scale_add(u, beta, p)                            # p = u + β p
        x = C.tree_axpy(alpha, p, x)                                # x ← x + α p
        r = C.tree_axpy(-alpha, s, r)                               # r ← r − α s
        u = C.tree_axpy(-alpha, q, u)                               # u ← u − α q    (= M r)
        w = C.tree_axpy(-alpha, z, w)                               # w ← w − α z    (= A u)
        pending = red.start_dots([(r, u), (w, u), (r, r)])          # γ', δ', ρ' under way ...
        (gamma_new, delta_new, rr_new), (m, n) = red.finish_while(pending, precondition_and_apply, w)
        gamma_new, delta_new, rr_new = map(real, (gamma_new, delta_new, rr_new))
        failure = jnp.where(
            failure != Reason.ITERATING, failure,
            jnp.where(~jnp.isfinite(rr_new) | ~jnp.isfinite(gamma_new) | ~jnp.isfinite(delta_new),
                      Reason.DIVERGED_NANORINF, Reason.ITERATING),
        )
        # First step: also compare ‖r₁‖ and the curvature across ranks (replicated layout).
        rr_new, failure = _agree(red, rr_new, failure, first, b_norm, (curvature, jnp.abs(curvature)))
        ok = failure == Reason.ITERATING
        gamma_old = jnp.where(ok, gamma, gamma_old)
        alpha_old = jnp.where(ok, alpha, alpha_old)
        gamma = jnp.where(ok, gamma_new, gamma)
        delta = jnp.where(ok, delta_new, delta)
        rr = jnp.where(ok, rr_new, rr)
        k = k + ok.astype(jnp.int32)
        hist = C.record(hist, k, jnp.sqrt(rr)) if hist is not None else None
        C.monitor_print("cg", red.comm, monitor, k, jnp.sqrt(rr))
        return (x, r, u, w, m, n, z, q, s, p, gamma, delta, gamma_old, alpha_old, rr, k,
                failure.astype(jnp.int32), hist)

    out = jax.lax.while_loop(keep_going, step, state)
    x, rr, k, reason, hist = out[0], out[14], out[15], out[16], out[17]
    converged = (reason == Reason.ITERATING) & _status(rr, threshold, k)
    reason = C.finish_reason(from_atol, converged, k, maxiter, reason)
    return x, SolverInfo(k, jnp.sqrt(rr), converged, reason, hist)


def _agree(red: C.Reductions, rr: Any, failure: Any, check: Any, b_norm: Any, probe: Any = None) -> tuple[Any, Any]:
    """Replicated layout: the stopping quantities made identical on every rank.

    One fused allreduce (max) of (‖r‖², −‖r‖², −code[, probe]); failure codes
    are ≤ 0, so the most negative wins everywhere. Where `check` (the first
    iteration), ranks whose ‖r‖ (or probe) differ beyond rounding give
    DIVERGED_INCONSISTENT_RANKS. Sharded values already agree.
    """
    agreed = red.agree(rr, failure, probe=probe)
    return agreed.value, C.mark_inconsistent(agreed.failure, C.inconsistent(agreed, check, b_norm, squared=True))
