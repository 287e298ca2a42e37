"""BiCGStab across ranks (van der Vorst 1992), right-preconditioned.

For a general nonsingular A and preconditioner M ≈ A⁻¹, with the shadow
residual r̂ = r₀:

    r₀ = b − A x₀,  ρ₀ = ⟨r̂, r₀⟩,  p = r₀
    for k = 0, 1, ...
        p ← r + β (p − ω q)         β = (ρ/ρ_old)(α/ω)   (p = r₀ when k = 0)
        p̂ = M p,  q = A p̂
        ⟨r̂, q⟩, ‖r‖²                                      (reduction 1)
        stop when ‖r‖ ≤ max(rtol ‖b‖, atol)   (x, r are those of step k − 1)
        α = ρ/⟨r̂, q⟩,  s = r − α q
        ŝ = M s,  t = A ŝ
        ⟨t, s⟩, ⟨t, t⟩, ‖s‖², ⟨r̂, s⟩, ⟨r̂, t⟩               (reduction 2)
        ‖s‖ small enough: x ← x + α p̂, r = s, stop
        ω = ⟨t, s⟩/⟨t, t⟩,  x ← x + α p̂ + ω ŝ,  r = s − ω t
        ρ_new = ⟨r̂, r⟩ = ⟨r̂, s⟩ − ω ⟨r̂, t⟩

The residual norm of a step comes with the first inner product of the next
one, so that each step needs two allreduces (sharded layout) instead of
three; the price is one matvec and preconditioner application after the
last step, whose result is discarded. The iterates are those of
scipy.sparse.linalg.bicgstab, including its breakdown tests (|ρ| or |ω|
below eps², ⟨r̂, q⟩ = 0). Replicated layout: the inner products are local;
one small allreduce after each of the two points above makes the decisions
identical on every rank.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from . import _arguments
from . import _common as C
from ._vectors import as_coefficient, axpy, scalar_dtype, sub
from ._common import Reason, SolverInfo
from ._driver import krylov_solve
from ._eager import compiled_when_eager


@compiled_when_eager
def bicgstab(
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
    history: int = 0,
    monitor: bool = False,
    verify_residual: bool = True,
) -> tuple[Any, SolverInfo]:
    """Solve A x = b for a general (nonsymmetric) A by BiCGStab.

    A superset of ``jax.scipy.sparse.linalg.bicgstab`` (same positional
    arguments and keywords; ``tol`` is an alias of ``rtol``) that runs across
    MPI ranks and reports convergence.

    Args:
      A: a callable ``v -> A v``, a square array (replicated layout), an
        object with ``__matmul__``, or a distlinalg operator (see
        :func:`distlinalg.cg` for the layouts).
      b: right-hand side, a pytree of arrays (replicated: the whole vector,
        identical on every rank; sharded: this rank's block).
      x0: initial guess shaped like `b` (default zeros); not differentiated.
      rtol, atol: stop when ‖b − A x‖₂ ≤ max(rtol ‖b‖₂, atol) (the
        recurrence residual, in global norms).
      maxiter: iteration limit (default 10 × the global size, agreed across
        ranks as for cg).
      M: right preconditioner ≈ A⁻¹ (any of A's forms); the reverse-mode
        (transposed) solve uses the same M.
      layout, comm, history, monitor, verify_residual: as for :func:`distlinalg.cg`.

    Returns:
      ``(x, info)``: x shaped like b and a :class:`SolverInfo` identical on
      every rank. Reasons: CONVERGED_RTOL/ATOL, DIVERGED_MAX_IT,
      DIVERGED_BREAKDOWN (ρ, ω or ⟨r̂, A M p⟩ vanished: the method cannot go
      on; try gmres), DIVERGED_NANORINF, DIVERGED_INCONSISTENT_RANKS (as for
      cg).

    AD: ``lax.custom_linear_solve`` with a transposed BiCGStab solve on Aᵀ
    (in the replicated layout the transpose of the matvec averaged over
    ranks, the matrix transpose even when the matvec communicates). vmap
    over b runs the lanes in one loop.

    Example:
      >>> import jax.numpy as jnp
      >>> import distlinalg as dl
      >>> A = jnp.array([[3.0, 1.0, 0.0], [-1.0, 3.0, 1.0], [0.0, -1.0, 3.0]])  # nonsymmetric
      >>> b = jnp.array([1.0, 2.0, 3.0])
      >>> x, info = dl.bicgstab(A, b, rtol=1e-6)
      >>> bool(info.converged), bool(jnp.allclose(A @ x, b, atol=1e-5))
      (True, True)
    """
    if _arguments.is_real_linear(A):
        return _arguments.solve_real_linear(
            bicgstab, A, b, x0, M, tol=tol, rtol=rtol, atol=atol, maxiter=maxiter, layout=layout, comm=comm,
            history=history, monitor=monitor, verify_residual=verify_residual,
        )
    p = _arguments.setup(A, b, x0, M, tol, rtol, atol, maxiter, layout, comm)
    return krylov_solve(_bicgstab, p.matvec, p.b, p, history=history, monitor=monitor, hermitian=False,
                        verify_residual=verify_residual)


class BicgstabState(NamedTuple):
    """BiCGSTAB at the top of an iteration."""

    x: Any
    r: Any        # b − A x
    p: Any        # search direction
    q: Any        # A M p of the previous step
    rho: Any      # ⟨r̂, r⟩
    rho_old: Any
    alpha: Any
    omega: Any
    done: Any     # converged (agreed across ranks)
    k: Any
    reason: Any
    history: Any


def _bicgstab(run: C.Run):
    matvec, precond, red, b, maxiter, monitor = run.matvec, run.precond, run.red, run.b, run.maxiter, run.monitor
    dtype = scalar_dtype(b)
    real = jnp.real(jnp.zeros((), dtype)).dtype
    tiny = jnp.finfo(real).eps ** 2  # scipy's breakdown thresholds for ρ and ω
    r = sub(b, matvec(run.x0))
    r_shadow = r
    rr, bb = (jnp.real(v) for v in red.dots([(r, r), (b, b)]))
    failure = C.first_reason((run.start != Reason.ITERATING, run.start), (~jnp.isfinite(rr), Reason.DIVERGED_NANORINF))
    agreed = red.agree(rr, failure, also=[bb])
    rr = agreed.value
    b_norm = jnp.sqrt(agreed.also[0])
    failure = C.mark_inconsistent(agreed.failure, C.inconsistent(agreed, True, b_norm, squared=True))
    threshold, from_atol = C.stopping_threshold(b_norm, run.rtol, run.atol)
    hist = C.record(C.new_history(run.history, real), 0, jnp.sqrt(rr))
    C.monitor_print("bicgstab", red.comm, monitor, 0, jnp.sqrt(rr))
    one = jnp.ones((), dtype)
    zeros = jax.tree_util.tree_map(jnp.zeros_like, b)
    state = BicgstabState(x=run.x0, r=r, p=zeros, q=zeros, rho=rr.astype(dtype), rho_old=one, alpha=one, omega=one,
                          done=jnp.sqrt(rr) <= threshold, k=jnp.int32(0), reason=failure, history=hist)

    def keep_going(s: BicgstabState):
        return (s.reason == Reason.ITERATING) & ~s.done & (s.k < maxiter)

    def step(s: BicgstabState) -> BicgstabState:
        x, r, k = s.x, s.r, s.k
        rho, omega = s.rho, s.omega
        first = k == 0
        # Values of a step that turns out to be stopped are discarded, so its
        # divisions only need to avoid NaNs (safe denominators).
        safe_omega = jnp.where(jnp.abs(omega) > 0, omega, one)
        beta = (rho / _safe(s.rho_old)) * (s.alpha / safe_omega)
        p = jax.tree_util.tree_map(
            lambda r_, p_, q_: jnp.where(first, r_, r_ + as_coefficient(beta, r_) * (p_ - as_coefficient(omega, q_) * q_)),
            r, s.p, s.q)
        p_hat = precond(p)
        q = matvec(p_hat)
        shadow_q, rr_now = red.dots([(r_shadow, q), (r, r)])
        rr_now = jnp.real(rr_now)
        # The residual of the previous step is now known: stop before moving x.
        converged = jnp.sqrt(rr_now) <= threshold
        breakdown = ~converged & ((jnp.abs(rho) < tiny) | (~first & (jnp.abs(omega) < tiny)) | (shadow_q == 0))
        failure = C.first_reason((~jnp.isfinite(rr_now) | ~jnp.isfinite(shadow_q), Reason.DIVERGED_NANORINF),
                                 (breakdown, Reason.DIVERGED_BREAKDOWN))
        failure = jnp.where(converged & (failure == Reason.DIVERGED_NANORINF) & jnp.isfinite(rr_now),
                            Reason.ITERATING, failure).astype(jnp.int32)
        agreed = red.agree(rr_now, failure, also=[converged.astype(real)],
                           probe=(jnp.abs(shadow_q), jnp.abs(shadow_q)))
        rr_now = agreed.value
        failure = C.mark_inconsistent(agreed.failure, C.inconsistent(agreed, first, b_norm, squared=True))
        stopped = (agreed.also[0] > 0) | (failure != Reason.ITERATING)

        alpha = rho / _safe(shadow_q)
        s_vec = axpy(-alpha, q, r)
        s_hat = precond(s_vec)
        t = matvec(s_hat)
        ts, tt, ss, shadow_s, shadow_t = red.dots([(t, s_vec), (t, t), (s_vec, s_vec), (r_shadow, s_vec),
                                                    (r_shadow, t)])
        ss = jnp.real(ss)
        half_done = jnp.sqrt(ss) <= threshold  # scipy's early exit after the half step
        failure2 = jnp.where(jnp.isfinite(ss) & jnp.isfinite(ts) & jnp.isfinite(tt), Reason.ITERATING,
                             Reason.DIVERGED_NANORINF).astype(jnp.int32)
        failure2 = jnp.where(stopped, failure, failure2).astype(jnp.int32)
        agreed2 = red.agree(ss, failure2, also=[half_done.astype(real)])
        failure = agreed2.failure
        half_done = agreed2.also[0] > 0

        omega_new = jnp.where(half_done | (jnp.real(tt) == 0), jnp.zeros((), dtype), ts / _safe(tt))
        # A stopped step keeps x and r (its vectors may hold garbage: select, not a zero step).
        move = ~stopped & (failure == Reason.ITERATING)
        keep = lambda new, old: jax.tree_util.tree_map(lambda n, o: jnp.where(move, n, o), new, old)  # noqa: E731
        x = keep(axpy(omega_new, s_hat, axpy(alpha, p_hat, x)), x)
        r = keep(axpy(-omega_new, t, s_vec), r)
        rho_new = shadow_s - omega_new * shadow_t
        k_new = k + move.astype(jnp.int32)
        done = stopped | (move & half_done)
        hist = C.record(s.history, k, jnp.sqrt(rr_now))
        C.monitor_print("bicgstab", red.comm, monitor, k, jnp.sqrt(rr_now))
        return BicgstabState(x=x, r=r, p=p, q=q, rho=jnp.where(move, rho_new, rho),
                             rho_old=jnp.where(move, rho, s.rho_old), alpha=jnp.where(move, alpha, s.alpha),
                             omega=jnp.where(move, omega_new, omega), done=done, k=k_new, reason=failure, history=hist)

    s = jax.lax.while_loop(keep_going, step, state)
    # The residual of the last step (not yet known when the loop ran out of
    # steps, or after the half-step exit): one more reduction, once per solve.
    (rr,) = (jnp.real(v) for v in red.dots([(s.r, s.r)]))
    rr = red.agree(rr, s.reason).value
    r_norm = jnp.sqrt(rr)
    hist = C.record(s.history, s.k, r_norm)
    converged = (s.reason == Reason.ITERATING) & (r_norm <= threshold)
    reason = C.finish_reason(from_atol, converged, s.k, maxiter, s.reason)
    return s.x, SolverInfo(s.k, r_norm, converged, reason, hist)


def _safe(value: Any) -> Any:
    """`value`, or 1 where it is 0 (the result is discarded there)."""
    return jnp.where(value != 0, value, jnp.ones_like(value))
