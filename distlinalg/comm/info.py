"""A communicator, its rank and its size (static Python values, usable at trace time)."""

from __future__ import annotations

from typing import Any

from .._runtime.mpi import Communicator, resolve_comm


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


def communicator(comm: Any = None) -> Communicator:
    """distlinalg's :class:`Communicator` for `comm`: what every ``comm=`` argument resolves to.

    Args:
      comm: None (distlinalg's default communicator: a duplicate of
        ``MPI.COMM_WORLD`` made at import, so its messages never match the
        user's own mpi4py traffic), an mpi4py intracommunicator, or a
        :class:`Communicator`.

    Returns:
      A :class:`Communicator`: ``.comm`` the mpi4py communicator (for
      host-side mpi4py calls beside distlinalg's), ``.rank``, ``.size``.
      The same object for the same MPI communicator, so programs traced with
      either spelling share JAX's compile cache.

    Example:
      >>> from mpi4py import MPI
      >>> from distlinalg import comm
      >>> c = comm.communicator()                 # distlinalg's default
      >>> (c.rank, c.size) == (MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size())
      True
      >>> c.comm.allreduce(1) == c.size           # its mpi4py communicator
      True
      >>> comm.communicator(c) is c, comm.communicator(MPI.COMM_WORLD).size == c.size
      (True, True)
    """
    return resolve_comm(comm)
