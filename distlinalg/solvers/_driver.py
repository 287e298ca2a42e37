"""Wrapping an iteration into a differentiable, normalised solve.

`krylov_solve` puts an iteration behind `lax.custom_linear_solve`, so JVPs
and gradients take one more solve with the same operator instead of
differentiating through the iterations, and runs every solve on a
right-hand side scaled to a largest entry of 1 (tiny cotangents would
otherwise underflow in the squared norms; the stopping test is scaled with it, so the
criterion ||r|| <= max(rtol ||b||, atol) is unchanged).

Before any of that, the ranks agree on the inputs (`_agreement`: one small
allreduce per solve, on the user's b): the iteration gets the agreed
tolerances and iteration limit, and inputs that disagree skip the iteration
on every rank (``Reason.DIVERGED_INCONSISTENT_RANKS``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .._runtime import jax_names
from ..comm.allreduce import allreduce
from ..comm.fused import mean_over_ranks, tree_allreduce
from . import _arguments
from . import _common as C
from ._vectors import real_dtype, scale as scaled
from ._agreement import agree_inputs


def krylov_solve(
    iterate: Callable[[C.Run], tuple[Any, C.SolverInfo]],
    matvec: Callable[[Any], Any],
    b: Any,
    problem: _arguments.Problem,
    *,
    history: int,
    monitor: bool = False,
    hermitian: bool = True,
    verify_residual: bool = True,
    cycles_of: Callable[[Any], Any] | None = None,
    local_norm_sq: Callable[[Any], Any] | None = None,
) -> tuple[Any, C.SolverInfo]:
    """Solve A x = b with `iterate(run) -> (x, info)`, a method's iteration.

    `run` (a `_common.Run`) holds the operator custom_linear_solve hands
    over, the scaled b and x0, the agreed tolerances and iteration limit, the
    reason code to start from (ITERATING, or DIVERGED_INCONSISTENT_RANKS,
    which ends the loop before its first step), and the problem's
    preconditioner and reductions; `history` is the length of
    ``info.history`` the iteration returns, `monitor` whether it prints.
    x0 and everything in `run` other than `matvec` (the preconditioner,
    tolerances) are not differentiated.

    `hermitian`: A = Aᴴ (cg, minres), so the transposed solve of reverse mode
    reuses `matvec`. Otherwise (gmres, bicgstab) the transposed solve runs the
    same iteration on Aᵀ, the transpose JAX derives from `matvec`; in the
    replicated layout that is each rank's share of the whole-program adjoint
    (see docs/ad.md), and the matrix transpose every rank holds is its mean
    over ranks (`replicated_transpose`).

    `verify_residual`: when the iteration claims convergence, check the true
    residual ‖b − A x‖ against the tolerance (`iterate_until_backed`).
    `cycles_of(iterations)`: what `maxiter` counts, from the iterations done
    (default: iterations; GMRES: restart cycles). `local_norm_sq(v)`: this
    rank's part of the squared norm the method's stopping test uses (default
    ⟨v, v⟩; preconditioned MINRES: ⟨v, M v⟩).
    """
    reductions = problem.reductions
    x0 = jax.lax.stop_gradient(problem.x0)
    complex_system = any(jnp.iscomplexobj(leaf) for leaf in jax.tree_util.tree_leaves(b))
    # Agreed once, on the primal b; the tangent and transposed solves reuse
    # the verdict (their right-hand sides may differ between ranks).
    agreed = agree_inputs(b, problem)
    start = jnp.where(agreed.consistent, C.Reason.ITERATING, C.Reason.DIVERGED_INCONSISTENT_RANKS).astype(jnp.int32)

    replicated_ranks = reductions.comm.size if reductions.layout == "replicated" else 1

    def run(mv: Callable[[Any], Any], rhs: Any) -> tuple[Any, C.SolverInfo]:
        if replicated_ranks > 1:
            # The replicated solve is x_r = A⁻¹ mean_s(b_s) on every rank: the
            # same as A⁻¹ b for the replicated b of a primal solve, and the
            # right extension for tangents and cotangents, which may differ
            # between ranks (a loss that uses x differently on each rank).
            # Without it the transposed solve mixes rank-dependent vectors in
            # a matvec that assumes identical copies.
            rhs = jax.tree_util.tree_map(lambda v: v / jnp.asarray(replicated_ranks, v.dtype),
                                         tree_allreduce(rhs, comm=reductions.comm))
        # Scale by the largest entry, not the 2-norm: the squared norm of a
        # 1e-300 cotangent is already 0. A zero or non-finite rhs keeps
        # scale 1 (the iteration then reports it).
        largest = reductions.max_abs(rhs)
        scale = jnp.where((largest > 0) & jnp.isfinite(largest), largest, jnp.ones_like(largest))
        first_run = C.Run(matvec=mv, b=scaled(1 / scale, rhs), x0=scaled(1 / scale, x0), rtol=agreed.rtol,
                          atol=agreed.atol / scale, maxiter=agreed.maxiter, start=start, precond=problem.precond,
                          red=reductions, history=history, monitor=monitor)
        if verify_residual:
            x, info = iterate_until_backed(iterate, first_run, cycles_of or (lambda k: k), local_norm_sq)
        else:
            x, info = iterate(first_run)
        info = info._replace(
            residual_norm=info.residual_norm * scale,
            history=None if info.history is None else info.history * scale,
        )
        return _cast_like(scaled(scale, x), x0), _canonical(info, rhs)

    def skip(mv: Callable[[Any], Any], rhs: Any) -> tuple[Any, C.SolverInfo]:
        """Inputs that disagree: no matvec, no message, x0 back (every rank takes it)."""
        dtype = real_dtype(rhs)
        nan = jnp.full((), jnp.nan, dtype)
        info = C.SolverInfo(jnp.int32(0), nan, jnp.bool_(False), jnp.int32(C.Reason.DIVERGED_INCONSISTENT_RANKS),
                            C.new_history(history, dtype))
        return x0, info

    def solve(mv: Callable[[Any], Any], rhs: Any) -> tuple[Any, C.SolverInfo]:
        if agreed.consistent is True:
            return run(mv, rhs)
        # The predicate is identical on every rank, so all take the same
        # branch: a b whose size differs between ranks never reaches the
        # b-sized collectives (averaging, the operator's own). Under vmap the
        # cond becomes a select of both branches; `start` still stops the loop.
        return jax.lax.cond(agreed.consistent, lambda r: run(mv, r), lambda r: skip(mv, r), rhs)

    if not hermitian:
        def general_transpose_solve(vecmat, ct):
            transposed = vecmat if replicated_ranks == 1 else replicated_transpose(vecmat, reductions.comm)
            return solve(transposed, ct)

        return jax.lax.custom_linear_solve(
            matvec, b, solve, transpose_solve=general_transpose_solve, symmetric=False, has_aux=True
        )
    if complex_system:
        # Hermitian A: Aᵀ v = conj(A conj(v)), so the transposed solve is the
        # conjugated solve with the same operator (and Mᵀ = conj(M conj(.))).
        def transpose_solve(_vecmat, ct):
            conj = lambda t: jax.tree_util.tree_map(jnp.conj, t)  # noqa: E731
            x, info = solve(matvec, conj(ct))
            return conj(x), info

        return jax.lax.custom_linear_solve(
            matvec, b, solve, transpose_solve=transpose_solve, symmetric=False, has_aux=True
        )
    return jax.lax.custom_linear_solve(matvec, b, solve, symmetric=True, has_aux=True)


def replicated_transpose(vecmat: Callable[[Any], Any], comm: Any) -> Callable[[Any], Any]:
    """Aᵀ of a replicated operator from the transpose of its matvec.

    For a matvec that communicates, e.g. A x = Σ_r A_r x (an allreduce of
    each rank's part), the transposed program on rank r gives
    A_rᵀ Σ_s w_s: its share of the adjoint of the whole SPMD program, which
    for identical w is P A_rᵀ w, not Aᵀ w. The mean over ranks is Aᵀ w
    whatever the matvec does inside (a matvec that does not communicate
    gives Aᵀ w on every rank, and the mean leaves it unchanged). One
    vector-sized allreduce per transposed product.
    """
    return lambda w: mean_over_ranks(vecmat(w), comm=comm)


def _cast_like(x: Any, like: Any) -> Any:
    """x in `like`'s dtypes, weak where `like` is weak (jax.scipy keeps a Python-float b weak)."""
    return jax.tree_util.tree_map(
        lambda v, ref: jax_names.convert_element_type(v, ref.dtype, jax_names.is_weakly_typed(ref)), x, like)


# Restarts from the true residual after a convergence claim it did not back.
MAX_VERIFICATION_RESTARTS = 2


def iterate_until_backed(iterate: Callable[[C.Run], Any], first_run: C.Run, cycles_of: Callable[[Any], Any],
                         local_norm_sq: Callable[[Any], Any] | None = None) -> tuple[Any, C.SolverInfo]:
    """`iterate(first_run)`, with Belos's explicit residual test of a converged claim.

    A recurrence's residual drifts from the true one in finite precision
    (by about ε‖A‖‖x‖ per step), so on an ill-conditioned system a solver can
    report CONVERGED while ‖b − A x‖ is orders of magnitude above the
    tolerance. When the iteration claims convergence, one matvec gives the
    true residual; above max(rtol‖b‖, atol) the iteration runs again from x
    (its recurrence then starts from the true residual), within what is left
    of `maxiter`, at most MAX_VERIFICATION_RESTARTS times. A claim still not
    backed ends as DIVERGED_ACCURACY_LOST. `info.residual_norm` (and the
    history's last entry) is the true norm whenever one was computed, in
    the norm of the method's stopping test (`local_norm_sq`).

    One loop around the iteration (which appears once in the program: its
    compile time is not doubled). Every decision is made on norms identical
    on every rank: sums over ranks (sharded), or the maximum over ranks of
    the local values (replicated: a matvec need not be bitwise identical
    everywhere).
    """
    mv, b, reductions, history_size = first_run.matvec, first_run.b, first_run.red, first_run.history
    rtol, atol, maxiter, start = first_run.rtol, first_run.atol, first_run.maxiter, first_run.start

    def agreed_norm(v: Any) -> Any:
        if local_norm_sq is None:
            (vv,) = reductions.dots([(v, v)])
        else:
            (vv,) = reductions.totals([jnp.asarray(local_norm_sq(v))])
        norm = jnp.sqrt(jnp.abs(jnp.real(vv)))
        if reductions.layout == "replicated" and reductions.comm.size > 1:
            norm = allreduce(norm, "max", comm=reductions.comm)
        return norm

    dtype = real_dtype(b)
    tolerance = jnp.maximum(rtol * agreed_norm(b), atol).astype(dtype)

    def true_norm(x: Any) -> Any:
        return agreed_norm(jax.tree_util.tree_map(jnp.subtract, b, mv(x))).astype(dtype)

    def run(state: tuple) -> tuple:
        x, info, _, runs = state
        first = runs == 0
        x, more = iterate(first_run._replace(x0=x, maxiter=maxiter - cycles_of(info.iterations),
                                             start=jnp.where(first, start, C.Reason.ITERATING).astype(jnp.int32)))
        history = more.history
        if history is not None:  # a rerun's residuals follow the earlier runs'
            k = jnp.arange(history_size)
            rerun = jnp.take(more.history, jnp.clip(k - info.iterations, 0, history_size - 1))
            history = jnp.where(k < info.iterations, info.history, rerun.astype(dtype))
        merged = C.SolverInfo(info.iterations + more.iterations, more.residual_norm, more.converged,
                              more.reason, history)
        merged = _canonical(merged, b)
        # The check's matvec only where the iteration claims convergence (the
        # reason is agreed: every rank takes the same branch).
        norm = jax.lax.cond(merged.reason > 0, true_norm, lambda x: merged.residual_norm, x)
        return x, merged, norm, runs + 1

    def unbacked(state: tuple) -> Any:
        _, info, norm, runs = state
        rerun = (info.reason > 0) & (norm > tolerance) & (runs <= MAX_VERIFICATION_RESTARTS) \
            & (cycles_of(info.iterations) < maxiter)
        return (runs == 0) | rerun

    empty = C.SolverInfo(jnp.int32(0), jnp.zeros((), dtype), jnp.bool_(False), jnp.int32(start),
                         C.new_history(history_size, dtype))
    x, info, norm, _ = jax.lax.while_loop(unbacked, run, (first_run.x0, empty, jnp.zeros((), dtype), jnp.int32(0)))
    claimed = info.reason > 0
    lost = claimed & (norm > tolerance)
    reason = jnp.where(lost, jnp.int32(C.Reason.DIVERGED_ACCURACY_LOST), info.reason).astype(jnp.int32)
    history = info.history
    if history is not None:  # the last entry: the checked norm
        at_last = (jnp.arange(history_size) == info.iterations) & claimed
        history = jnp.where(at_last, norm, history)
    return x, info._replace(residual_norm=norm, converged=info.converged & ~lost, reason=reason, history=history)


def _canonical(info: C.SolverInfo, rhs: Any) -> C.SolverInfo:
    """Info fields with fixed dtypes, so that `run` and `skip` match under lax.cond."""
    dtype = real_dtype(rhs)
    return C.SolverInfo(
        jnp.asarray(info.iterations, jnp.int32),
        jnp.asarray(info.residual_norm, dtype),
        jnp.asarray(info.converged, jnp.bool_),
        jnp.asarray(info.reason, jnp.int32),
        None if info.history is None else jnp.asarray(info.history, dtype),
    )
