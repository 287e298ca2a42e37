"""distlinalg's own engine: a blocked Cholesky factorisation of a matrix held by rows, and its solves.

A = Uᴴ U with U upper triangular, right-looking, one block row of U per step:

    step k (block row k of w rows, at position o_k):
        the owner broadcasts its rows of the trailing matrix, A_k = [A_kk  A_k,rest]
        every rank:   L = chol(A_kk),  U_k = L⁻¹ A_k          (U_kk = Lᴴ)
        the owner:    keeps U_k as its rows of U
        every rank:   A_ij −= conj(U_ki) U_kj  for its trailing rows i (columns j ≥ i's block)

No row moves between ranks. For balance, the order of elimination deals out
the ranks' rows in blocks round-robin (rank 0's first block, rank 1's first
block, …, rank 0's second block, …): Cholesky of Πᵀ A Π for that symmetric
permutation Π, so every rank keeps trailing rows until near the end, and each
does about N³ / (3P) multiply-adds. Columns are stored in that order (one
local gather), so every slice is static.

Triangular solves, one message per step: forward (Uᴴ y = Πᵀ b) the owner of
block k computes y_k and the update of every later entry of the right-hand
side, broadcast as one (N − o_k) × m message; backward (U x = y) the owner
computes x_k from the entries after it and broadcasts it (w × m).

Memory per rank: this rank's rows twice (the input, and the factor in the
permuted column order), a panel of w × N, and replicated N × m vectors.
Every message's size is derived from the partition, identical on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from ..comm.bcast import bcast
from ._layout import RowSplit

__all__ = ["Schedule", "schedule", "factor", "solve"]

_GROUPS = 4  # trailing rows are updated in at most this many blocks (each from its own first column)


@dataclass(frozen=True)
class Step:
    owner: int  # rank holding the block row
    local: int  # its first row among the owner's rows
    width: int  # rows in the block
    position: int  # its first index in the elimination order


@dataclass(frozen=True)
class Schedule:
    """The elimination order: static, computed from the partition identically on every rank."""

    steps: tuple[Step, ...]
    order: np.ndarray  # order[p] = the global index eliminated at position p
    positions: np.ndarray  # positions[i] = the position of this rank's local row i
    block_starts: np.ndarray  # block_starts[i] = the position of the first row of local row i's block


def schedule(split: RowSplit, block: int) -> Schedule:
    """Blocks of `block` rows dealt round-robin over the ranks (a rank without rows is skipped)."""
    sizes = split.partition.sizes
    rounds = max(-(-s // block) for s in sizes)
    steps, order, position = [], [], 0
    mine = np.zeros(split.n_local, np.int64)
    firsts = np.zeros(split.n_local, np.int64)
    for c in range(rounds):
        for q, s in enumerate(sizes):
            if c * block >= s:
                continue
            width = min(block, s - c * block)
            steps.append(Step(q, c * block, width, position))
            start = split.partition.starts[q] + c * block
            order.extend(range(start, start + width))
            if q == split.rank:
                mine[c * block : c * block + width] = np.arange(position, position + width)
                firsts[c * block : c * block + width] = position
            position += width
    return Schedule(tuple(steps), np.asarray(order, np.int64), mine, firsts)


def _trailing_groups(sched: Schedule, after: int) -> list[tuple[int, int, int]]:
    """This rank's local rows eliminated after position `after`, in at most _GROUPS blocks
    (first local row, end, first column): a block is updated from the first position of the
    block row it starts in, so the diagonal blocks (whose lower triangles the Cholesky of the
    panel reads) are updated whole."""
    first = int(np.searchsorted(sched.positions, after))
    n = sched.positions.size
    if first >= n:
        return []
    bounds = np.linspace(first, n, min(_GROUPS, n - first) + 1).round().astype(int)
    return [(int(a), int(b), int(sched.block_starts[a])) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def factor(A_rows: jax.Array, split: RowSplit, sched: Schedule) -> tuple[jax.Array, jax.Array]:
    """(this rank's rows of U, columns in elimination order; a bool: A not positive definite).

    The flag is computed from the broadcast panels, so it is identical on every rank.
    """
    n, rank = split.n, split.rank
    U = A_rows[:, sched.order]  # columns in elimination order (local gather)
    failed = jnp.zeros((), bool)
    for step in sched.steps:
        o, w = step.position, step.width
        if rank == step.owner:
            panel = U[step.local : step.local + w, o:]
        else:
            panel = jnp.zeros((w, n - o), U.dtype)
        if split.size > 1:
            panel = bcast(panel, root=step.owner, comm=split.comm)
        L = jax.lax.linalg.cholesky(panel[:, :w], symmetrize_input=False)
        failed = failed | jnp.any(jnp.isnan(jnp.real(jnp.diagonal(L))))
        U_k = jax.lax.linalg.triangular_solve(L, panel, left_side=True, lower=True)
        if rank == step.owner:
            U = U.at[step.local : step.local + w, o:].set(U_k)
        for a, b, first in _trailing_groups(sched, o + w):
            rows = jnp.conj(U_k[:, sched.positions[a:b] - o]).T  # (b − a) × w
            U = U.at[a:b, first:].add(-(rows @ U_k[:, first - o :]))
    return U, failed


def _as_matrix(b: jax.Array) -> jax.Array:
    return b[:, None] if b.ndim == 1 else b


def solve(U: jax.Array, b_rows: jax.Array, split: RowSplit, sched: Schedule) -> jax.Array:
    """This rank's rows of x with A x = b, from `factor`'s U (Uᴴ y = Πᵀ b, U z = y, x = Π z)."""
    n, rank = split.n, split.rank
    c = split.gather(_as_matrix(b_rows))[sched.order]  # N × m, elimination order, replicated
    m = c.shape[1]
    for step in sched.steps:  # forward: Uᴴ y = c, column by column of Uᴴ
        o, w = step.position, step.width
        if rank == step.owner:
            rows = U[step.local : step.local + w, o:]
            y_k = jax.lax.linalg.triangular_solve(rows[:, :w], c[o : o + w], left_side=True, lower=False,
                                                  transpose_a=True, conjugate_a=True)
            message = jnp.concatenate([y_k, -(jnp.conj(rows[:, w:]).T @ y_k)])
        else:
            message = jnp.zeros((n - o, m), c.dtype)
        if split.size > 1:
            message = bcast(message, root=step.owner, comm=split.comm)
        c = c.at[o : o + w].set(message[:w]).at[o + w :].add(message[w:])
    for step in reversed(sched.steps):  # backward: U z = y
        o, w = step.position, step.width
        if rank == step.owner:
            rows = U[step.local : step.local + w, o:]
            x_k = jax.lax.linalg.triangular_solve(rows[:, :w], c[o : o + w] - rows[:, w:] @ c[o + w :],
                                                  left_side=True, lower=False)
        else:
            x_k = jnp.zeros((w, m), c.dtype)
        if split.size > 1:
            x_k = bcast(x_k, root=step.owner, comm=split.comm)
        c = c.at[o : o + w].set(x_k)
    x = jnp.zeros_like(c).at[sched.order].set(c)[split.mine]
    return x.reshape(b_rows.shape)
