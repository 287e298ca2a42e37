"""Row partitions of a global index range across ranks, and variable-size
gathers/scatters built on the fixed-size collectives (padding to the
largest block)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._runtime.mpi import Communicator, ReduceOp, resolve_comm
from ..comm.allgather import allgather
from ..comm.reduce_scatter import reduce_scatter


def exchange_sizes(value: int, comm: Communicator) -> np.ndarray:
    """Every rank's `value` (a Python int), on every rank, at trace time.

    Runs an eager allgather even inside a jit trace (the sizes are static
    shapes, known before the program runs); it is ordered after everything
    this rank dispatched before. Every rank must call it together.
    """
    return exchange_rows(np.asarray([value], np.int64), comm)[:, 0]


def exchange_rows(row: np.ndarray, comm: Communicator) -> np.ndarray:
    """Every rank's int vector `row` (the same length everywhere), stacked (size, len), at trace time.

    The same eager allgather as `exchange_sizes`. The int64 entries travel as
    pairs of int32 words, so they are exact whether or not JAX has x64
    enabled (without it a JAX int64 array would be truncated to int32).
    """
    row = np.ascontiguousarray(row, np.int64)
    if comm.size == 1:
        return row[None]
    with jax.ensure_compile_time_eval():
        words = np.asarray(allgather(jnp.asarray(row.view(np.int32)), comm=comm), np.int32)
    return np.ascontiguousarray(words).view(np.int64).reshape(comm.size, row.size)


class Partition(NamedTuple):
    """Contiguous blocks: rank r owns global indices [starts[r], starts[r+1]).

    The operators' ``row_partition`` / ``column_partition`` arguments accept
    one (or the list of its block sizes).

    Example:
      >>> import numpy as np
      >>> from distlinalg import comm
      >>> from distlinalg.operators import Partition, laplacian_2d
      >>> p = Partition.even(10, 3)                # 10 indices over 3 ranks
      >>> p
      Partition(starts=(0, 4, 7, 10))
      >>> p.sizes, p.total, p.size_of(1)
      ((4, 3, 3), 10, 3)
      >>> p.owner(np.array([0, 4, 9]))
      array([0, 1, 2])
      >>> q = Partition.even(4, comm.size())       # 4 grid rows over this job's ranks
      >>> A = laplacian_2d(4, row_partition=q)
      >>> A.input_structure.shape == (4 * q.size_of(comm.rank()),)
      True
    """

    starts: tuple[int, ...]  # size + 1 entries, starts[-1] = total

    @property
    def total(self) -> int:
        return self.starts[-1]

    def size_of(self, r: int) -> int:
        return self.starts[r + 1] - self.starts[r]

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(self.starts[r + 1] - self.starts[r] for r in range(len(self.starts) - 1))

    @property
    def widest(self) -> int:
        return max(self.sizes)

    def owner(self, index: np.ndarray) -> np.ndarray:
        return np.searchsorted(np.asarray(self.starts), index, side="right") - 1

    @staticmethod
    def from_sizes(sizes: Any) -> "Partition":
        return Partition(tuple(int(s) for s in np.concatenate([[0], np.cumsum(sizes)])))

    @staticmethod
    def even(total: int, size: int) -> "Partition":
        """The first total % size ranks get one more index."""
        base, extra = divmod(int(total), size)
        return Partition.from_sizes([base + (r < extra) for r in range(size)])

    @staticmethod
    def of_local_sizes(local: int, comm: Any = None) -> "Partition":
        """The partition whose block r has rank r's `local` size (exchanged at
        trace time: every rank calls it together)."""
        return partition_of_local_sizes(int(local), resolve_comm(comm))

    def allgather(self, block: Any, comm: Any = None) -> Any:
        """Every rank's block (leading axis, this partition's sizes) concatenated, on every rank."""
        return allgather_blocks(block, self, resolve_comm(comm))

    def reduce_scatter(self, y: Any, comm: Any = None) -> Any:
        """The sum over ranks of the global-length `y`; rank r keeps its block of it."""
        return reduce_scatter_blocks(y, self, resolve_comm(comm))


def resolve_partition(partition: Any, total: int, comm: Communicator, what: str) -> Partition:
    """A Partition from None (even split), a sequence of block sizes, or a Partition.

    Collective: every rank must call it together (at construction, also
    inside a jit trace). The ranks exchange what they resolved (one small
    eager allgather) before anything is judged, so a partition that is
    invalid, or different from the other ranks', raises the same ValueError
    on every rank (naming each rank's partition when they differ) instead of
    an error on one rank while the others wait in the operator's first
    message.
    """
    sizes, code, problem = _block_sizes(partition, total, comm.size, what)
    if comm.size > 1:
        table = exchange_rows(_encode(sizes, total, code, comm.size), comm)
        if np.any(table != table[0]):
            raise ValueError(_disagreement(table, what, comm.size))
    if code:
        raise ValueError(problem)  # the same on every rank: their inputs agree
    return Partition.from_sizes(sizes)


# What can be wrong with a rank's partition (code 0: nothing).
_PROBLEMS = ("", "not one block size per rank", "a negative block size", "a block size that is not an integer",
             "blocks that do not add up to the total")


def _block_sizes(partition: Any, total: int, size: int, what: str) -> tuple[list[int], int, str]:
    """(block sizes, problem code, error message for this rank alone)."""
    if partition is None:
        return list(Partition.even(total, size).sizes), 0, ""
    raw = partition.sizes if isinstance(partition, Partition) else partition
    try:
        sizes = [_as_int(s) for s in raw]
    except (TypeError, ValueError):
        return [], 3, f"distlinalg.operators: {what} must give integer block sizes, got {raw!r}"
    if len(sizes) != size or any(s < 0 for s in sizes):
        code = 1 if len(sizes) != size else 2
        return sizes, code, (f"distlinalg.operators: {what} must give one non-negative block size per rank "
                             f"({size}), got {sizes}")
    if sum(sizes) != total:
        return sizes, 4, (f"distlinalg.operators: {what} covers {sum(sizes)} indices but the matrix has {total}; "
                          f"the blocks {sizes} must add up to {total}")
    return sizes, 0, ""


def _as_int(value: Any) -> int:
    if isinstance(value, (bool, np.bool_)) or int(value) != value:
        raise ValueError(f"not an integer: {value!r}")
    return int(value)


def _encode(sizes: list[int], total: int, code: int, size: int) -> np.ndarray:
    """A rank's partition on the wire: [code, total, number of blocks, blocks…],
    the blocks padded with -1 (or cut) to one per rank, so every rank sends
    the same length."""
    row = np.full(3 + size, -1, np.int64)
    row[:3] = (code, total, len(sizes))
    shown = sizes[:size]
    row[3 : 3 + len(shown)] = shown
    return row


HALO_MODES = ("blocking", "overlapped")


def resolve_halo_mode(halo: Any, comm: Communicator, what: str) -> str:
    """`halo` ("blocking" or "overlapped"), agreed across ranks.

    The mode decides which messages every matvec sends (sendrecv/alltoall or
    isend/irecv), so ranks that differ would hang or mismatch. Every rank
    contributes its choice to one allgather (at construction, eager even
    inside a jit trace) before anything is judged: a bad or differing value
    raises the same ValueError on every rank.
    """
    codes = exchange_sizes(HALO_MODES.index(halo) if halo in HALO_MODES else -1, comm)
    if np.all(codes == codes[0]) and codes[0] >= 0:
        return halo
    given = ", ".join(f"rank {r}: {HALO_MODES[c] if c >= 0 else 'not one of them'}" for r, c in enumerate(codes))
    raise ValueError(f"{what}: halo must be one of {HALO_MODES} and the same on every rank ({given}); "
                     f"this rank passed {halo!r}")


def _disagreement(table: np.ndarray, what: str, size: int) -> str:
    """The error every rank raises when the ranks' partitions differ."""
    lines = []
    for r, row in enumerate(table):
        code, total, count = (int(v) for v in row[:3])
        blocks = [int(v) for v in row[3 : 3 + min(count, size)]]
        shown = "(not integers)" if code == 3 else str(blocks)[:-1] + (", …]" if count > size else "]")
        note = f" ({_PROBLEMS[code]})" if code else ""
        lines.append(f"rank {r}: {shown} of {total} indices{note}")
    return (f"distlinalg.operators: the ranks passed different {what}s; every rank must pass the same "
            f"one (one non-negative block size per rank, adding up to the total):\n  " + "\n  ".join(lines))


def partition_of_local_sizes(local: int, comm: Communicator) -> Partition:
    """The partition whose block r has rank r's `local` size (exchanged at trace time)."""
    return Partition.from_sizes(exchange_sizes(local, comm))


def allgather_blocks(x: Any, partition: Partition, comm: Communicator) -> Any:
    """Concatenate every rank's block (leading axis) into the global vector."""
    if comm.size == 1:
        return x
    widest = partition.widest
    padded = jnp.pad(x, [(0, widest - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
    stacked = allgather(padded, comm=comm)
    return jnp.concatenate([stacked[r, : partition.size_of(r)] for r in range(comm.size)], axis=0)


def reduce_scatter_blocks(y: Any, partition: Partition, comm: Communicator) -> Any:
    """Sum the global-length `y` over ranks; rank r keeps its block of the sum."""
    if comm.size == 1:
        return y
    widest = partition.widest
    blocks = [
        jnp.pad(y[partition.starts[r] : partition.starts[r + 1]], [(0, widest - partition.size_of(r))]
                + [(0, 0)] * (y.ndim - 1))
        for r in range(comm.size)
    ]
    mine = reduce_scatter(jnp.stack(blocks), ReduceOp.SUM, comm=comm)
    return mine[: partition.size_of(comm.rank)]


def gather_rows(rows: jax.Array, comm: Communicator) -> jax.Array:
    """Concatenate every rank's rows (counts may differ) on every rank."""
    return allgather_blocks(rows, partition_of_local_sizes(rows.shape[0], comm), comm)
