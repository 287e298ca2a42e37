"""The layout of distlinalg.linalg: an N × N matrix held by rows, and the moves between layouts.

Rank r holds rows [s_r, s_{r+1}) of the matrix, an (n_r, N) array; the split
is any partition (uneven, a rank may hold no rows). Vectors and blocks of
right-hand sides are this rank's rows, (n_r,) or (n_r, m). Every move here has
static message sizes derived from the partition, which every rank knows, so
every rank posts the same messages in the same order whatever its own n_r.
All moves are built from distlinalg's collectives and are differentiable
(their transposes are the reversed moves).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from .._runtime.mpi import Communicator
from ..comm.alltoall import alltoall
from ..comm.sendrecv import sendrecv
from ..operators._partition import Partition, allgather_blocks

__all__ = ["RowSplit", "ring_matmul", "rows_to_columns", "columns_to_rows", "hermitian_part"]


@dataclass(frozen=True)
class RowSplit:
    """Which rows of the N × N matrix every rank holds (static, identical on every rank)."""

    partition: Partition
    comm: Communicator

    @property
    def n(self) -> int:
        return self.partition.total

    @property
    def size(self) -> int:
        return self.comm.size

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def mine(self) -> slice:
        """This rank's rows, as a slice of the global index range."""
        return slice(self.partition.starts[self.rank], self.partition.starts[self.rank + 1])

    @property
    def n_local(self) -> int:
        return self.partition.size_of(self.rank)

    def gather(self, rows: Any) -> Any:
        """Every rank's rows of a vector (or of an N × m block), concatenated, on every rank."""
        return allgather_blocks(rows, self.partition, self.comm)


def ring_matmul(X_rows: jax.Array, Y_rows: jax.Array, split: RowSplit) -> jax.Array:
    """This rank's rows of X Y, for X (N × N) and Y (N × k) both held by rows.

    (X Y)[rows_r] = Σ_q X[rows_r, rows_q] Y_q: rank r's own block first, then
    every rank's block of Y travels once around the ring (P − 1 sendrecv
    steps of the widest block), so no rank ever holds more than two blocks of
    Y. Memory: O(N k / P). Linear in both arguments; differentiable.
    """
    p, rank, size = split.partition, split.rank, split.size
    own = slice(p.starts[rank], p.starts[rank + 1])
    out = X_rows[:, own] @ Y_rows
    if size == 1:
        return out
    widest = p.widest
    travelling = jnp.pad(Y_rows, ((0, widest - Y_rows.shape[0]), (0, 0)))
    for step in range(1, size):
        travelling = sendrecv(travelling, travelling, source=(rank - 1) % size, dest=(rank + 1) % size,
                              comm=split.comm)
        owner = (rank - step) % size  # whose block of Y has reached this rank
        cols = slice(p.starts[owner], p.starts[owner + 1])
        out = out + X_rows[:, cols] @ travelling[: p.size_of(owner)]
    return out


def _exchange_pieces(pieces: list[jax.Array], height: int, width: int, comm: Communicator) -> list[jax.Array]:
    """Send pieces[q] to rank q; returns what every rank sent here.

    One alltoall of pieces padded to (height, width), the largest piece of any
    rank (static, the same on every rank); the caller cuts each received piece
    to its own static shape.
    """
    height, width = max(height, 1), max(width, 1)
    stacked = jnp.stack([jnp.pad(x, ((0, height - x.shape[0]), (0, width - x.shape[1]))) for x in pieces])
    received = alltoall(stacked, comm=comm)
    return [received[q] for q in range(comm.size)]


def rows_to_columns(X_rows: jax.Array, split: RowSplit, columns: Partition) -> jax.Array:
    """This rank's block of columns X[:, columns_r] (N × k_r) of X (N × N) held by rows.

    One alltoall; memory O(N² / P).
    """
    p, c, rank = split.partition, columns, split.rank
    if split.size == 1:
        return X_rows
    pieces = [X_rows[:, c.starts[q] : c.starts[q + 1]] for q in range(split.size)]
    got = _exchange_pieces(pieces, p.widest, c.widest, split.comm)
    return jnp.concatenate([got[q][: p.size_of(q), : c.size_of(rank)] for q in range(split.size)], axis=0)


def columns_to_rows(Y_cols: jax.Array, split: RowSplit, columns: Partition) -> jax.Array:
    """This rank's rows Y[rows_r, :] (n_r × K) of Y (N × K) held by blocks of columns (N × k_r).

    The inverse of `rows_to_columns`; one alltoall.
    """
    p, c, rank = split.partition, columns, split.rank
    if split.size == 1:
        return Y_cols
    pieces = [Y_cols[p.starts[q] : p.starts[q + 1], :] for q in range(split.size)]
    got = _exchange_pieces(pieces, p.widest, c.widest, split.comm)
    return jnp.concatenate([got[q][: p.size_of(rank), : c.size_of(q)] for q in range(split.size)], axis=1)


def hermitian_part(A_rows: jax.Array, split: RowSplit) -> jax.Array:
    """This rank's rows of (A + Aᴴ) / 2 (one alltoall: Aᴴ's rows are A's columns, conjugated)."""
    columns = rows_to_columns(A_rows, split, split.partition)  # A[:, rows_r], N × n_r
    return (A_rows + jnp.conj(columns).T) / 2

