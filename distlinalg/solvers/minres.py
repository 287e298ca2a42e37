"""MINRES across ranks (Paige & Saunders 1975), with shift and SPD preconditioner.

Solves (A − σI) x = b for Hermitian A, possibly indefinite, or singular but
consistent. The preconditioned Lanczos process builds v_k with
⟨v_j, M⁻¹ v_k⟩ = δ_jk; Givens rotations turn the tridiagonal T_k into upper
triangular form, and x is updated by a three-term recurrence of search
directions, so each step costs one matvec, one preconditioner application and
two inner products (⟨v, A v⟩, then the norm of the new Lanczos vector: two
dependent reductions). The residual norm comes from the rotations (φ̄), not
from an extra inner product; with a preconditioner it is the M-norm
‖r‖_M = √⟨r, M r⟩, otherwise the 2-norm.

    r₁ = b − (A − σ)x₀,  y = M r₁,  β₁ = √⟨r₁, y⟩,  φ̄ = β₁
    for k = 1, 2, ...
        v = y/β;  y = (A − σ)v − (β/β_old) r_old;  α = ⟨v, y⟩
        y ← y − (α/β) r₂;  r_old, r₂ = r₂, y;  y = M r₂;  β_new = √⟨r₂, y⟩
        rotate: δ = c d̄ + s α,  ḡ = s d̄ − c α,  ε' = s β_new,  d̄ = −c β_new
                γ = ‖(ḡ, β_new)‖,  c = ḡ/γ,  s = β_new/γ,  φ = c φ̄,  φ̄ ← s φ̄
        w = (v − ε w₁ − δ w₂)/γ;  x ← x + φ w
        stop when φ̄ ≤ max(rtol ‖b‖_M, atol)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from . import _common as C
from ._common import Reason, SolverInfo
from ._driver import krylov_solve


def minres(
    A: Any,
    b: Any,
    x0: Any = None,
    *,
    shift: float = 0.0,
    tol: float | None = None,
    rtol: float = 1e-5,
    atol: float = 0.0,
    maxiter: int | None = None,
    M: Any = None,
    layout: str | None = None,
    comm: Any = None,
    history: int = 0,
    monitor: bool = False,
) -> tuple[Any, SolverInfo]:
    """Solve (A − shift·I) x = b by MINRES for Hermitian, possibly indefinite A.

    Args:
      A, b, x0, layout, comm, maxiter, history, monitor: as for
        :func:`distlinalg.solvers.cg`.
      shift: σ in (A − σI) x = b (a static or traced scalar; not differentiated).
      rtol, atol: stop when the recurrence residual φ̄ ≤ max(rtol ‖b‖, atol),
        norms in the preconditioner's metric (‖r‖_M = √⟨r, M r⟩; the 2-norm
        without M). ``tol`` is an alias of ``rtol``.
      M: symmetric positive definite preconditioner (callable, ≈ A⁻¹); an
        indefinite M stops the solve with ``Reason.DIVERGED_INDEFINITE_PC``.

    Returns:
      ``(x, info)`` as for cg; ``info.residual_norm`` is φ̄ (recurrence).
      The default maxiter and the cross-rank checks are those of cg (ranks
      that disagree on rtol, atol, maxiter or, replicated layout, on b or on
      φ̄ and ⟨v₁, A v₁⟩ in the first iteration all stop with
      ``Reason.DIVERGED_INCONSISTENT_RANKS``; never a hang).
      A singular but consistent system converges to a solution; when the
      Krylov space is exhausted (β = 0) the reason is
      ``CONVERGED_HAPPY_BREAKDOWN`` if the residual is not already below the
      tolerance.

    AD: ``lax.custom_linear_solve`` with the same operator (symmetric), so
    gradients cost one more MINRES solve; derivatives with respect to the
    shift are not propagated (it is treated as a constant).
    """
    if C.is_real_linear(A):
        return C.solve_real_linear(
            minres, A, b, x0, M, shift=shift, tol=tol, rtol=rtol, atol=atol, maxiter=maxiter, layout=layout,
            comm=comm, history=history, monitor=monitor,
        )
    p = C.setup(A, b, x0, M, tol, rtol, atol, maxiter, layout, comm)
    shift = jax.lax.stop_gradient(jnp.asarray(shift))

    def shifted(v):
        return C.tree_axpy(-shift, v, p.matvec(v))

    def iterate(mv, rhs, x_init, rtol_agreed, atol_scaled, maxiter_agreed, start):
        # custom_linear_solve hands back `shifted` (or its transpose) as mv.
        return _minres(mv, rhs, x_init, p.precond, rtol_agreed, atol_scaled, maxiter_agreed, start, p.reductions,
                       history, monitor)

    return krylov_solve(iterate, shifted, p.b, p, history=history)


def _minres(op, b, x0, precond, rtol, atol, maxiter, start, red: C.Reductions, history, monitor):
    real = jnp.real
    r1 = C.tree_sub(b, op(x0))
    y = precond(r1)
    mb = precond(b) if precond is not C.identity else b
    beta1_sq, bnorm_sq = map(real, red.dots([(r1, y), (b, mb)]))
    dtype = beta1_sq.dtype
    failure0 = jnp.where(
        ~jnp.isfinite(beta1_sq) | ~jnp.isfinite(bnorm_sq), Reason.DIVERGED_NANORINF,
        jnp.where(beta1_sq < 0, Reason.DIVERGED_INDEFINITE_PC, Reason.ITERATING),
    ).astype(jnp.int32)
    failure0 = jnp.where(start != Reason.ITERATING, start, failure0)
    beta1 = jnp.sqrt(jnp.abs(beta1_sq))
    # One message: φ̄₀ = β₁ (max and min), the code, and ‖b‖²_M, so that the
    # threshold is identical on every rank (replicated layout).
    agreed = red.agree(beta1, failure0, also=[jnp.abs(bnorm_sq)])
    b_norm = jnp.sqrt(agreed.also[0])
    phibar = agreed.value
    failure0 = C.mark_inconsistent(agreed.failure, C.inconsistent(agreed, True, b_norm, squared=False))
    threshold, from_atol = C.stopping_threshold(b_norm, rtol, atol)
    hist = C.record(C.new_history(history, dtype), 0, phibar)
    C.monitor_print("minres", red.comm, monitor, 0, phibar)

    zeros = jax.tree_util.tree_map(jnp.zeros_like, b)
    one, zero = jnp.ones((), dtype), jnp.zeros((), dtype)
    # Without a preconditioner y = M r₂ is r₂ itself: carrying both would make
    # XLA copy the vector every iteration.
    preconditioned = precond is not C.identity
    # The two-term histories (r₁, r₂) and (w₁, w₂) live in fixed slots "a" and
    # "b": each step writes its new vector over the older one, and the next
    # step reads the slots the other way round. Shifting the values down
    # (r₁ ← r₂) instead made XLA copy two whole vectors per iteration. The loop
    # body is therefore two steps, the second masked off when the first ends
    # the solve (see `body`).
    state = dict(
        x=x0, r_a=r1, r_b=r1, y=y if preconditioned else None, w_a=zeros, w_b=zeros,
        beta=beta1, oldb=zero, dbar=zero, epsln=zero, phibar=phibar,
        cs=-one, sn=zero, k=jnp.int32(0), reason=failure0, happy=jnp.bool_(False), hist=hist,
    )

    def keep_going(s):
        return (s["reason"] == Reason.ITERATING) & ~s["happy"] & (s["k"] < maxiter) & ~(s["phibar"] <= threshold)

    def step(s, older, newer, active=True):
        # r₁ = s["r_" + older], r₂ = s["r_" + newer]; likewise w₁, w₂.
        beta, oldb = s["beta"], s["oldb"]
        r_old, r_new = s["r_" + older], s["r_" + newer]
        v = C.tree_scale(1 / beta, s["y"] if preconditioned else r_new)
        y = op(v)
        # The three-term recurrence has no previous vector in the first step.
        previous = jnp.where(s["k"] >= 1, beta / jnp.where(oldb == 0, 1, oldb), 0)
        y = C.tree_axpy(-previous, r_old, y)
        (alfa,) = map(real, red.dots([(v, y)]))
        y = C.tree_axpy(-(alfa / beta), r_new, y)
        r2 = y  # the new r₂; the old r₂ becomes r₁
        y = precond(r2)
        (beta_new_sq,) = map(real, red.dots([(r2, y)]))
        beta_new = jnp.sqrt(jnp.abs(beta_new_sq))
        # Givens rotation of the new column of T_k.
        cs, sn, dbar = s["cs"], s["sn"], s["dbar"]
        oldeps = s["epsln"]
        delta = cs * dbar + sn * alfa
        gbar = sn * dbar - cs * alfa
        epsln = sn * beta_new
        dbar = -cs * beta_new
        gamma = jnp.hypot(gbar, beta_new)
        gamma = jnp.maximum(gamma, jnp.finfo(dtype).tiny)
        cs = gbar / gamma
        sn = beta_new / gamma
        phi = cs * s["phibar"]
        phibar = sn * s["phibar"]
        w1, w2 = s["w_" + older], s["w_" + newer]
        w = jax.tree_util.tree_map(
            lambda a, b_, c: (a - C.as_coefficient(oldeps, a) * b_ - C.as_coefficient(delta, a) * c)
            / C.as_coefficient(gamma, a), v, w1, w2)
        # x ← x + φ w, only in an active step (a masked one may hold NaNs).
        x = jax.tree_util.tree_map(
            lambda xi, wi: jnp.where(active, xi + C.as_coefficient(phi, xi) * wi, xi), s["x"], w)
        failure = jnp.where(
            ~jnp.isfinite(alfa) | ~jnp.isfinite(beta_new_sq) | ~jnp.isfinite(phibar),
            Reason.DIVERGED_NANORINF,
            jnp.where(beta_new_sq < 0, Reason.DIVERGED_INDEFINITE_PC, Reason.ITERATING),
        ).astype(jnp.int32)
        # First step: also compare φ̄₁ and the curvature α₁ = ⟨v₁, A v₁⟩ (relative
        # to ‖A v₁‖ ≈ (α₁, β₂)) across ranks.
        phibar, failure = _agree(red, phibar, failure, s["k"] == 0, b_norm, (alfa, jnp.hypot(alfa, beta_new)))
        k = s["k"] + 1
        # A masked step records nowhere (an index past the history).
        hist = C.record(s["hist"], jnp.where(active, k, jnp.iinfo(jnp.int32).max), phibar)
        if active is True:
            C.monitor_print("minres", red.comm, monitor, k, phibar)
        new = dict(
            x=x, y=y if preconditioned else None, beta=beta_new, oldb=beta, dbar=dbar, epsln=epsln,
            phibar=phibar, cs=cs, sn=sn, k=k, reason=failure, happy=beta_new == 0, hist=hist,
        )
        new["r_" + older], new["r_" + newer] = r2, r_new
        new["w_" + older], new["w_" + newer] = w, w2
        if active is True:
            return new
        # Scalars of a masked step keep their values, so that the loop test
        # sees the state the first step left. Its vectors are garbage, but the
        # loop ends right after it.
        return {key: (value if key in _VECTORS else
                      jax.tree_util.tree_map(lambda n, o: jnp.where(active, n, o), value, s[key]))
                for key, value in new.items()}

    if monitor:
        # The monitor prints every step as it happens: one step per loop body.
        def body(s):
            t = step(s, "a", "b")
            # Shift the slots back (the copies the pair avoids).
            t["r_a"], t["r_b"], t["w_a"], t["w_b"] = t["r_b"], t["r_a"], t["w_b"], t["w_a"]
            return t
    else:
        def body(s):
            # Step k (r₁, w₁ in slots a) then step k+1 (slots b), the
            # latter masked when step k ended the solve. Every rank takes the
            # same branch values: keep_going reads agreed quantities only.
            t = step(s, "a", "b")
            return step(t, "b", "a", active=keep_going(t))

    s = jax.lax.while_loop(keep_going, body, state)
    converged = (s["reason"] == Reason.ITERATING) & (s["phibar"] <= threshold)
    reason = C.finish_reason(from_atol, converged, s["k"], maxiter, s["reason"])
    happy = (reason == Reason.DIVERGED_MAX_IT) | (reason == Reason.ITERATING)
    reason = jnp.where(s["happy"] & happy, Reason.CONVERGED_HAPPY_BREAKDOWN, reason).astype(jnp.int32)
    converged = converged | (reason == Reason.CONVERGED_HAPPY_BREAKDOWN)
    return s["x"], SolverInfo(s["k"], s["phibar"], converged, reason, s["hist"])


# Vectors of the MINRES loop state (the rest are scalars and the history).
_VECTORS = frozenset({"x", "y", "r_a", "r_b", "w_a", "w_b"})


def _agree(red: C.Reductions, value: Any, failure: Any, check: Any, b_norm: Any, probe: Any) -> tuple[Any, Any]:
    """Replicated layout: one fused max-allreduce of (φ̄, −φ̄, −code, probe);
    in the first iteration (`check`) a disagreement beyond rounding is
    DIVERGED_INCONSISTENT_RANKS."""
    agreed = red.agree(value, failure, probe=probe)
    return agreed.value, C.mark_inconsistent(agreed.failure, C.inconsistent(agreed, check, b_norm, squared=False))
