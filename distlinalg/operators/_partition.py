"""Row partitions of a global index range across ranks, and variable-size
gathers/scatters built on the fixed-size collectives (padding to the
largest block)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._mpi import Communicator, ReduceOp
from ..comm.allgather import allgather
from ..comm.reduce_scatter import reduce_scatter


def exchange_sizes(value: int, comm: Communicator) -> np.ndarray:
    """Every rank's `value` (a Python int), on every rank, at trace time.

    Runs an eager allgather even inside a jit trace (the sizes are static
    shapes, known before the program runs); it is ordered after everything
    this rank dispatched before. Every rank must call it together.
    """
    if comm.size == 1:
        return np.asarray([value], np.int64)
    with jax.ensure_compile_time_eval():
        return np.asarray(allgather(jnp.asarray(value, jnp.int64), comm=comm), np.int64)


class Partition(NamedTuple):
    """Contiguous blocks: rank r owns global indices [starts[r], starts[r+1])."""

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


def resolve_partition(partition: Any, total: int, comm: Communicator, what: str) -> Partition:
    """A Partition from None (even split), a sequence of block sizes, or a Partition."""
    if partition is None:
        return Partition.even(total, comm.size)
    if isinstance(partition, Partition):
        result = partition
    else:
        sizes = [int(s) for s in partition]
        if len(sizes) != comm.size or any(s < 0 for s in sizes):
            raise ValueError(
                f"distlinalg.operators: {what} must give one non-negative block size per rank "
                f"({comm.size}), got {list(partition)}"
            )
        result = Partition.from_sizes(sizes)
    if result.total != total:
        raise ValueError(
            f"distlinalg.operators: {what} covers {result.total} indices but the matrix has {total}; "
            f"the blocks {list(result.sizes)} must add up to {total}"
        )
    return result


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
