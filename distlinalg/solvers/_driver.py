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

from .. import _compat
from ..comm.fused import tree_allreduce
from . import _arguments
from . import _common as C
from ._vectors import real_dtype, scale as scaled
from ._agreement import agree_inputs


def krylov_solve(
    iterate: Callable[..., tuple[Any, C.SolverInfo]],
    matvec: Callable[[Any], Any],
    b: Any,
    problem: _arguments.Problem,
    *,
    history: int,
    hermitian: bool = True,
) -> tuple[Any, C.SolverInfo]:
    """Solve A x = b with `iterate(matvec, b, x0, rtol, atol, maxiter, start) -> (x, info)`.

    `start` is the reason code to start from (ITERATING, or
    DIVERGED_INCONSISTENT_RANKS, which ends the loop before its first step);
    `history` is the length of ``info.history`` the iteration returns.
    x0 and everything the iteration closes over other than `matvec` (the
    preconditioner, tolerances) are not differentiated.

    `hermitian`: A = Aᴴ (cg, minres), so the transposed solve of reverse mode
    reuses `matvec`. Otherwise (gmres, bicgstab) the transposed solve runs the
    same iteration on Aᵀ, the transpose JAX derives from `matvec`; in the
    replicated layout that is each rank's share of the whole-program adjoint
    (see docs/ad.md), and the matrix transpose every rank holds is its mean
    over ranks (`replicated_transpose`).
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
        x, info = iterate(mv, scaled(1 / scale, rhs), scaled(1 / scale, x0), agreed.rtol,
                          agreed.atol / scale, agreed.maxiter, start)
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
    ranks = comm.size

    def transposed(w: Any) -> Any:
        total = tree_allreduce(vecmat(w), comm=comm)
        return jax.tree_util.tree_map(lambda v: v / jnp.asarray(ranks, v.dtype), total)

    return transposed


def _cast_like(x: Any, like: Any) -> Any:
    """x in `like`'s dtypes, weak where `like` is weak (jax.scipy keeps a Python-float b weak)."""
    return jax.tree_util.tree_map(
        lambda v, ref: _compat.convert_element_type(v, ref.dtype, _compat.is_weakly_typed(ref)), x, like)


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
