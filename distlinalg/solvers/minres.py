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

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from . import _arguments
from ._common import Reason, Run, SolverInfo, finish_reason, first_reason, inconsistent
from ._common import mark_inconsistent, monitor_print, new_history, record, stopping_threshold
from ._driver import krylov_solve
from ._eager import compiled_when_eager
from ._vectors import Dot, Update, axpy, local_vdot, scale, sub, update_and_dots, zeros_like


@compiled_when_eager
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
    verify_residual: bool = True,
) -> tuple[Any, SolverInfo]:
    """Solve (A − shift·I) x = b by MINRES for Hermitian, possibly indefinite A.

    Args:
      A, b, x0, layout, comm, maxiter, history, monitor, verify_residual: as for
        :func:`distlinalg.solvers.cg`.
      shift: σ in (A − σI) x = b (a static or traced scalar, replicated;
        differentiated as part of the operator).
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
    gradients cost one more MINRES solve. The shift is part of the operator:
    forward and reverse mode differentiate it too (dx/dσ = (A − σI)⁻¹ x).

    Example:
      A symmetric indefinite system, where cg would stop:

      >>> import jax.numpy as jnp
      >>> import distlinalg as dl
      >>> A = jnp.array([[2.0, 1.0, 0.0], [1.0, -3.0, 1.0], [0.0, 1.0, 1.0]])
      >>> b = jnp.array([1.0, 0.0, -1.0])
      >>> x, info = dl.minres(A, b, rtol=1e-6)
      >>> bool(info.converged), bool(jnp.allclose(A @ x, b, atol=1e-4))
      (True, True)
      >>> x, info = dl.minres(A, b, shift=0.5, rtol=1e-6)    # (A − 0.5 I) x = b
      >>> bool(jnp.allclose(A @ x - 0.5 * x, b, atol=1e-4))
      True
    """
    if _arguments.is_real_linear(A):
        return _arguments.solve_real_linear(
            minres, A, b, x0, M, shift=shift, tol=tol, rtol=rtol, atol=atol, maxiter=maxiter, layout=layout,
            comm=comm, history=history, monitor=monitor, verify_residual=verify_residual,
        )
    p = _arguments.setup(A, b, x0, M, tol, rtol, atol, maxiter, layout, comm)
    # A shift known to be 0 adds no pass over v to every matvec.
    unshifted = isinstance(shift, (int, float)) and shift == 0
    # Not stopped: σ is a diagonal term of the operator, so custom_linear_solve
    # differentiates it with the matvec (dx/dσ = (A − σI)⁻¹ x).
    shift = jnp.asarray(shift)

    def shifted(v):
        if unshifted:
            return p.matvec(v)
        return axpy(-shift, v, p.matvec(v))                         # (A − σ) v

    def preconditioned_norm_sq(v):
        # MINRES stops on ‖r‖_M; the check of its claim uses the same norm.
        return local_vdot(v, p.precond(v))

    preconditioned = p.precond is not _arguments.identity
    # custom_linear_solve hands back `shifted` (or its transpose) as run.matvec.
    return krylov_solve(_minres, shifted, p.b, p, history=history, monitor=monitor, verify_residual=verify_residual,
                        local_norm_sq=preconditioned_norm_sq if preconditioned else None)


class MinresState(NamedTuple):
    """MINRES at the top of an iteration.

    The two-term histories (r₁, r₂) and (w₁, w₂) live in fixed slots ``a``
    and ``b``: each step writes its new vector over the older one, and the
    next step reads the slots the other way round. Shifting the values down
    (r₁ ← r₂) instead made XLA copy two whole vectors per iteration.
    """

    x: Any
    r_a: Any
    r_b: Any
    y: Any       # M r₂ (None without a preconditioner: it is r₂ itself)
    w_a: Any
    w_b: Any
    beta: Any    # β_k
    oldb: Any    # β_{k−1}
    dbar: Any    # rotation state: d̄, ε, c, s
    epsln: Any
    cs: Any
    sn: Any
    phibar: Any  # φ̄ = ‖r‖ in the preconditioner's metric, agreed across ranks
    k: Any
    reason: Any
    happy: Any   # β = 0: the Krylov space is exhausted
    history: Any


# The vectors of the state (the rest are scalars and the history).
_VECTORS = frozenset({"x", "y", "r_a", "r_b", "w_a", "w_b"})


def _minres(run: Run):
    real = jnp.real
    op, precond, red, b, maxiter, monitor = run.matvec, run.precond, run.red, run.b, run.maxiter, run.monitor
    preconditioned = precond is not _arguments.identity
    r1 = sub(b, op(run.x0))                                         # r₁ = b − (A − σ) x₀
    y = precond(r1)                                                 # y = M r₁
    mb = precond(b) if preconditioned else b
    beta1_sq, bnorm_sq = map(real, red.dots([(r1, y), (b, mb)]))    # β₁² = ⟨r₁, y⟩, ‖b‖²_M
    dtype = beta1_sq.dtype
    failure = first_reason((run.start != Reason.ITERATING, run.start),
                           (~jnp.isfinite(beta1_sq) | ~jnp.isfinite(bnorm_sq), Reason.DIVERGED_NANORINF),
                           (beta1_sq < 0, Reason.DIVERGED_INDEFINITE_PC))
    beta1 = jnp.sqrt(jnp.abs(beta1_sq))
    # One message: φ̄₀ = β₁ (max and min), the code, and ‖b‖²_M, so that the
    # threshold is identical on every rank (replicated layout).
    agreed = red.agree(beta1, failure, also=[jnp.abs(bnorm_sq)])
    b_norm = jnp.sqrt(agreed.also[0])
    failure = mark_inconsistent(agreed.failure, inconsistent(agreed, True, b_norm, squared=False))
    threshold, from_atol = stopping_threshold(b_norm, run.rtol, run.atol)
    hist = record(new_history(run.history, dtype), 0, agreed.value)
    monitor_print("minres", red.comm, monitor, 0, agreed.value)

    def keep_going(s: MinresState):
        return (s.reason == Reason.ITERATING) & ~s.happy & (s.k < maxiter) & ~(s.phibar <= threshold)

    def step(s: MinresState, older: str, newer: str, active: Any = True) -> MinresState:
        """One Lanczos step and rotation; r₁, w₁ in slots `older`, r₂, w₂ in `newer`."""
        r_old, r_new = getattr(s, "r_" + older), getattr(s, "r_" + newer)
        w1, w2 = getattr(s, "w_" + older), getattr(s, "w_" + newer)
        u = s.y if preconditioned else r_new
        v = scale(1 / s.beta, u)                                    # v = y / β (fused into the matvec)
        y = op(v)                                                   # y = (A − σ) v
        # The three-term recurrence has no previous vector in the first step.
        previous = jnp.where(s.k >= 1, s.beta / jnp.where(s.oldb == 0, 1, s.oldb), 0)
        # y ← y − (β/β_old) r₁, written over r₁'s slot, and ⟨u, y⟩ on the way
        # (⟨u, y⟩/β = ⟨v, y⟩: v is never written to memory). The previous
        # step's w (w₂ here) was the last to read that slot: after it, XLA
        # writes it in place (no copy).
        (y,), (uy,) = update_and_dots(Update("y", [(-previous, r_old), (1, y)]),  # y ← y − (β/β_old) r₁
                                      dots=[Dot(u, "y")], wait_for=w2)              # ⟨u, y⟩
        alfa = jnp.real(red.totals([uy])[0]) / s.beta               # α = ⟨v, y⟩ = ⟨u, y⟩/β
        # r₂' = y − (α/β) r₂, in the same slot (r₁' = r₂); ⟨r₂', r₂'⟩ on the way when M is I.
        (r2,), rr = update_and_dots(Update("r2", [(1, y), (-(alfa / s.beta), r_new)]),  # r₂' = y − (α/β) r₂
                                    dots=[] if preconditioned else [Dot("r2", "r2")])    # ⟨r₂', r₂'⟩
        if preconditioned:
            y = precond(r2)                                         # y = M r₂'
            (beta_new_sq,) = map(real, red.dots([(r2, y)]))         # β' = √⟨r₂', y⟩
        else:
            (beta_new_sq,) = map(real, red.totals(rr))
        beta_new = jnp.sqrt(jnp.abs(beta_new_sq))
        # Givens rotation of the new column of T_k.
        delta = s.cs * s.dbar + s.sn * alfa                         # δ = c d̄ + s α
        gbar = s.sn * s.dbar - s.cs * alfa                          # ḡ = s d̄ − c α
        epsln = s.sn * beta_new                                     # ε' = s β'
        dbar = -s.cs * beta_new                                     # d̄ = −c β'
        gamma = jnp.maximum(jnp.hypot(gbar, beta_new), jnp.finfo(dtype).tiny)  # γ = ‖(ḡ, β')‖
        cs, sn = gbar / gamma, beta_new / gamma                     # c = ḡ/γ, s = β'/γ
        phi, phibar = cs * s.phibar, sn * s.phibar                  # φ = c φ̄, φ̄ ← s φ̄
        # w = (v − ε w₁ − δ w₂)/γ over w₁, and x ← x + φ w: one pass. A masked
        # step (the second of a body, after the first ended the solve) leaves
        # x as it is: all its coefficients are 0, and its vectors are finite
        # unless the first step diverged, which already made x non-finite.
        keep = lambda c: jnp.where(active, c, jnp.zeros_like(c))  # noqa: E731
        (w, x), _ = update_and_dots(
            Update("w", [(keep(-s.epsln / gamma), w1),                  # w = (v − ε w₁ − δ w₂)/γ,
                         (keep(1 / (s.beta * gamma)), u),               #     v = u/β
                         (keep(-delta / gamma), w2)]),
            Update("x", [(1, s.x), (keep(phi), "w")]))                  # x ← x + φ w
        failure = first_reason(
            (~jnp.isfinite(alfa) | ~jnp.isfinite(beta_new_sq) | ~jnp.isfinite(phibar), Reason.DIVERGED_NANORINF),
            (beta_new_sq < 0, Reason.DIVERGED_INDEFINITE_PC))
        # First step: also compare φ̄₁ and the curvature α₁ = ⟨v₁, A v₁⟩ (relative
        # to ‖A v₁‖ ≈ (α₁, β₂)) across ranks.
        phibar, failure = red.agree_step(phibar, failure, check=s.k == 0, scale=b_norm, squared=False,
                                         probe=(alfa, jnp.hypot(alfa, beta_new)))
        k = s.k + 1
        # A masked step records nowhere (an index past the history).
        hist = record(s.history, jnp.where(active, k, jnp.iinfo(jnp.int32).max), phibar)
        if active is True:
            monitor_print("minres", red.comm, monitor, k, phibar)
        new = s._replace(x=x, y=y if preconditioned else None, beta=beta_new, oldb=s.beta, dbar=dbar, epsln=epsln,
                         cs=cs, sn=sn, phibar=phibar, k=k, reason=failure, happy=beta_new == 0, history=hist,
                         **{"r_" + older: r2, "r_" + newer: r_new, "w_" + older: w, "w_" + newer: w2})
        if active is True:
            return new
        # Scalars of a masked step keep their values, so that the loop test
        # sees the state the first step left. Its vectors are garbage, but the
        # loop ends right after it.
        return MinresState(*(
            value if name in _VECTORS else jax.tree_util.tree_map(lambda n, o: jnp.where(active, n, o), value, old)
            for name, value, old in zip(MinresState._fields, new, s)))

    if monitor:
        # The monitor prints every step as it happens: one step per loop body.
        def body(s: MinresState) -> MinresState:
            t = step(s, "a", "b")
            # Shift the slots back (the copies the pair avoids).
            return t._replace(r_a=t.r_b, r_b=t.r_a, w_a=t.w_b, w_b=t.w_a)
    else:
        def body(s: MinresState) -> MinresState:
            # Step k (r₁, w₁ in slots a) then step k+1 (slots b), the
            # latter masked when step k ended the solve. Every rank takes the
            # same branch values: keep_going reads agreed quantities only.
            t = step(s, "a", "b")
            return step(t, "b", "a", active=keep_going(t))

    zeros, one, zero = zeros_like(b), jnp.ones((), dtype), jnp.zeros((), dtype)
    # Without a preconditioner y = M r₂ is r₂ itself: carrying both would make
    # XLA copy the vector every iteration.
    state = MinresState(x=run.x0, r_a=r1, r_b=r1, y=y if preconditioned else None, w_a=zeros, w_b=zeros, beta=beta1,
                        oldb=zero, dbar=zero, epsln=zero, cs=-one, sn=zero, phibar=agreed.value, k=jnp.int32(0),
                        reason=failure, happy=jnp.bool_(False), history=hist)
    s = jax.lax.while_loop(keep_going, body, state)
    converged = (s.reason == Reason.ITERATING) & (s.phibar <= threshold)
    reason = finish_reason(from_atol, converged, s.k, maxiter, s.reason)
    happy = (reason == Reason.DIVERGED_MAX_IT) | (reason == Reason.ITERATING)
    reason = jnp.where(s.happy & happy, Reason.CONVERGED_HAPPY_BREAKDOWN, reason).astype(jnp.int32)
    converged = converged | (reason == Reason.CONVERGED_HAPPY_BREAKDOWN)
    return s.x, SolverInfo(s.k, s.phibar, converged, reason, s.history)
