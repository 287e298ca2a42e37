"""rank and size of a communicator (static Python ints, usable at trace time)."""

from __future__ import annotations

from typing import Any

from .._mpi import resolve_comm


def rank(comm: Any = None) -> int:
    """This process's rank in `comm` (default: distlinalg's communicator).

    A static Python int, usable at trace time (shapes, control flow, roots).

    Example:
      >>> from distlinalg import comm
      >>> 0 <= comm.rank() < comm.size()
      True
      >>> from mpi4py import MPI
      >>> comm.rank(MPI.COMM_WORLD) == MPI.COMM_WORLD.Get_rank()
      True
    """
    return resolve_comm(comm).rank


def size(comm: Any = None) -> int:
    """Number of ranks of `comm` (default: distlinalg's communicator).

    A static Python int, usable at trace time.

    Example:
      >>> from mpi4py import MPI
      >>> from distlinalg import comm
      >>> comm.size() == MPI.COMM_WORLD.Get_size()    # mpiexec -n P: P
      True
    """
    return resolve_comm(comm).size
