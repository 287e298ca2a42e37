"""Wrapping an iteration into a differentiable, normalised solve.

`krylov_solve` puts an iteration behind `lax.custom_linear_solve`, so JVPs
and gradients take one more solve with the same operator instead of
differentiating through the iterations, and runs every solve on a
right-hand side scaled to a largest entry of 1 (tiny cotangents would
otherwise underflow in the squared norms; the stopping test is scaled with it, so the
criterion ||r|| <= max(rtol ||b||, atol) is unchanged).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ..ad.grad import sum_tree_over_ranks
from . import _common as C


def krylov_solve(
    iterate: Callable[..., tuple[Any, C.SolverInfo]],
    matvec: Callable[[Any], Any],
    b: Any,
    x0: Any,
    *,
    atol: Any,
    reductions: C.Reductions,
) -> tuple[Any, C.SolverInfo]:
    """Solve A x = b with `iterate(matvec, b, x0, atol) -> (x, info)`.

    x0 and everything the iteration closes over other than `matvec` (the
    preconditioner, tolerances) are not differentiated.
    """
    x0 = jax.lax.stop_gradient(x0)
    complex_system = any(jnp.iscomplexobj(leaf) for leaf in jax.tree_util.tree_leaves(b))

    replicated_ranks = reductions.comm.size if reductions.layout == "replicated" else 1

    def solve(mv: Callable[[Any], Any], rhs: Any) -> tuple[Any, C.SolverInfo]:
        if replicated_ranks > 1:
            # The replicated solve is x_r = A⁻¹ mean_s(b_s) on every rank: the
            # same as A⁻¹ b for the replicated b of a primal solve, and the
            # right extension for tangents and cotangents, which may differ
            # between ranks (a loss that uses x differently on each rank).
            # Without it the transposed solve mixes rank-dependent vectors in
            # a matvec that assumes identical copies.
            rhs = jax.tree_util.tree_map(lambda v: v / replicated_ranks, sum_tree_over_ranks(rhs, reductions.comm))
        # Scale by the largest entry, not the 2-norm: the squared norm of a
        # 1e-300 cotangent is already 0. A zero or non-finite rhs keeps
        # scale 1 (the iteration then reports it).
        largest = reductions.max_abs(rhs)
        scale = jnp.where((largest > 0) & jnp.isfinite(largest), largest, jnp.ones_like(largest))
        x, info = iterate(mv, C.tree_scale(1 / scale, rhs), C.tree_scale(1 / scale, x0), atol / scale)
        info = info._replace(
            residual_norm=info.residual_norm * scale,
            history=None if info.history is None else info.history * scale,
        )
        return C.tree_scale(scale, x), info

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
