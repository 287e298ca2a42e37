"""distlinalg's own engine: LU with partial pivoting of a matrix held by rows, and its solves.

P A = L U, right-looking over blocks of w columns. Rows never move between
ranks: a row chosen as a pivot stays where it is and is marked; it then holds
its row of U, and every other row keeps its multipliers (its row of L) in the
columns of the blocks eliminated before its own pivot step.

    step k (columns [c, c + w)):
        every rank: the panel of the rows not yet pivots, N × w (an allgather),
                    factored with partial pivoting (LAPACK, replicated)
        the pivots' rows of the trailing columns (an allreduce of w rows,
                    each from its owner), U_k = L_kk⁻¹ · those rows
        every rank: its rows not yet pivots −= multipliers · U_k

About N³ / P multiply-adds per rank (the rows not yet pivots are spread over
every rank; their update runs over all of them, masked). Solves (and solves
with Aᵀ, for reverse mode) take one allreduce of w × m (or of N × m for Aᵀ's
forward sweep) per step; the pivots and the diagonal blocks are replicated
(N × w in all), the rest is this rank's rows.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..comm.allreduce import allreduce
from ._layout import RowSplit

__all__ = ["LUFactors", "factor", "solve"]

_NOT_YET = np.iinfo(np.int32).max  # step_of_row of a row that is not a pivot yet


class LUFactors(NamedTuple):
    rows: jax.Array  # this rank's rows: multipliers left of the row's pivot block, U from it on
    step_of_row: jax.Array  # (n_r,) int32: the step at which the row became a pivot
    position_of_row: jax.Array  # (n_r,) int32: its position in the pivot order
    pivots: tuple[jax.Array, ...]  # per step: the global rows chosen, (w,) int32, replicated
    blocks: tuple[jax.Array, ...]  # per step: L_kk (unit lower) and U_kk (upper) in one w × w array
    columns: tuple[tuple[int, int], ...]  # per step: (first column, width), static
    singular: jax.Array  # bool scalar, identical on every rank


def _sum(x: jax.Array, split: RowSplit) -> jax.Array:
    return allreduce(x, comm=split.comm) if split.size > 1 else x


def _pivot_rows(values: jax.Array, pivots: jax.Array, split: RowSplit) -> jax.Array:
    """values[pivot rows] (w × …) on every rank: each owner contributes its rows, one allreduce."""
    local = pivots - split.partition.starts[split.rank]
    owned = (local >= 0) & (local < values.shape[0])
    picked = values[jnp.clip(local, 0, max(values.shape[0] - 1, 0))] if values.shape[0] else \
        jnp.zeros((pivots.shape[0], *values.shape[1:]), values.dtype)
    return _sum(jnp.where(owned.reshape(-1, *([1] * (values.ndim - 1))), picked, 0), split)


def factor(A_rows: jax.Array, split: RowSplit, block: int) -> LUFactors:
    n, n_local = split.n, split.n_local
    mine = split.partition.starts[split.rank] + jnp.arange(n_local, dtype=jnp.int32)
    rows = A_rows
    step_of_row = jnp.full((n_local,), _NOT_YET, jnp.int32)
    position_of_row = jnp.full((n_local,), _NOT_YET, jnp.int32)
    pivots, blocks, columns = [], [], []
    singular = jnp.zeros((), bool)
    for k, c in enumerate(range(0, n, block)):
        w = min(block, n - c)
        active = step_of_row == _NOT_YET
        panel = split.gather(jnp.where(active[:, None], rows[:, c : c + w], 0))  # N × w
        lu, _, permutation = jax.lax.linalg.lu(panel)
        chosen = permutation[:w].astype(jnp.int32)
        where = jnp.zeros((n,), jnp.int32).at[permutation].set(jnp.arange(n, dtype=jnp.int32))[mine]
        diagonal = lu[:w, :w]
        singular = singular | jnp.any(jnp.diagonal(diagonal) == 0) | jnp.any(~jnp.isfinite(diagonal))
        multipliers = lu[where]  # n_r × w: this rank's rows of L (or of L_kk / U_kk for pivots)
        pivot_now = active & (where < w)
        updating = active & ~pivot_now
        if c + w < n:
            top = _pivot_rows(rows[:, c + w :], chosen, split)
            U_rest = jax.lax.linalg.triangular_solve(diagonal, top, left_side=True, lower=True, unit_diagonal=True)
            trailing = rows[:, c + w :] - jnp.where(updating[:, None], multipliers, 0) @ U_rest
            trailing = jnp.where(pivot_now[:, None], U_rest[jnp.clip(where, 0, w - 1)], trailing)
            rows = rows.at[:, c + w :].set(trailing)
        rows = rows.at[:, c : c + w].set(jnp.where(active[:, None], multipliers, rows[:, c : c + w]))
        step_of_row = jnp.where(pivot_now, k, step_of_row)
        position_of_row = jnp.where(pivot_now, c + where, position_of_row)
        pivots.append(chosen)
        blocks.append(diagonal)
        columns.append((c, w))
    return LUFactors(rows, step_of_row, position_of_row, tuple(pivots), tuple(blocks), tuple(columns), singular)


def solve(f: LUFactors, b_rows: jax.Array, split: RowSplit, transpose: bool = False) -> jax.Array:
    """This rank's rows of x with A x = b (or Aᵀ x = b), from `factor`'s factors."""
    b = b_rows[:, None] if b_rows.ndim == 1 else b_rows
    x = _transpose_solve(f, b, split) if transpose else _solve(f, b, split)
    return x.reshape(b_rows.shape)


def _solve(f: LUFactors, b: jax.Array, split: RowSplit) -> jax.Array:
    # Forward, L y = P b: y_k from the pivots' entries of b, then the other rows' entries updated.
    ys = []
    for k, ((c, w), pivots, diagonal) in enumerate(zip(f.columns, f.pivots, f.blocks)):
        y_k = jax.lax.linalg.triangular_solve(diagonal, _pivot_rows(b, pivots, split), left_side=True, lower=True,
                                              unit_diagonal=True)
        later = (f.step_of_row > k)[:, None]
        b = b - jnp.where(later, f.rows[:, c : c + w], 0) @ y_k
        ys.append(y_k)
    # Backward, U x = y: x in column order, replicated, filled from the last block.
    n, m = split.n, b.shape[1]
    x = jnp.zeros((n, m), b.dtype)
    for k in reversed(range(len(f.columns))):
        (c, w), pivots, diagonal = f.columns[k], f.pivots[k], f.blocks[k]
        partial = _pivot_rows(f.rows[:, c + w :] @ x[c + w :], pivots, split)
        x = x.at[c : c + w].set(jax.lax.linalg.triangular_solve(diagonal, ys[k] - partial, left_side=True,
                                                                lower=False))
    return x[split.mine]


def _transpose_solve(f: LUFactors, c_rows: jax.Array, split: RowSplit) -> jax.Array:
    # Aᵀ = Uᵀ Lᵀ P: Uᵀ u = c (forward over the blocks), Lᵀ v = u (backward), z = Pᵀ v.
    n = split.n
    c = split.gather(c_rows)  # N × m, column order, replicated
    us = []
    for k, ((c0, w), pivots, diagonal) in enumerate(zip(f.columns, f.pivots, f.blocks)):
        u_k = jax.lax.linalg.triangular_solve(diagonal, c[c0 : c0 + w], left_side=True, lower=False,
                                              transpose_a=True)
        us.append(u_k)
        if c0 + w < n:  # c_rest −= U_k,restᵀ u_k, each pivot row from its owner
            local = pivots - split.partition.starts[split.rank]
            owned = (local >= 0) & (local < f.rows.shape[0])
            weights = jnp.zeros((f.rows.shape[0], u_k.shape[1]), u_k.dtype).at[
                jnp.where(owned, local, f.rows.shape[0])].set(u_k, mode="drop")
            c = c.at[c0 + w :].add(-_sum(f.rows[:, c0 + w :].T @ weights, split))
    v = jnp.zeros((n, c.shape[1]), c.dtype)  # in pivot order
    for k in reversed(range(len(f.columns))):
        (c0, w), diagonal = f.columns[k], f.blocks[k]
        later = f.step_of_row > k
        v_rows = v[jnp.clip(f.position_of_row, 0, n - 1)]  # each row's entry of v, if pivoted later
        partial = _sum(jnp.where(later[:, None], f.rows[:, c0 : c0 + w], 0).T @ jnp.where(later[:, None], v_rows, 0),
                       split)
        v = v.at[c0 : c0 + w].set(jax.lax.linalg.triangular_solve(diagonal, us[k] - partial, left_side=True,
                                                                  lower=True, transpose_a=True, unit_diagonal=True))
    order = jnp.concatenate(f.pivots)  # order[q] = the global row pivoted at position q
    z = jnp.zeros_like(v).at[order].set(v)
    return z[split.mine]
