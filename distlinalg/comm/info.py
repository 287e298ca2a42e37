"""rank and size of a communicator (static Python ints, usable at trace time)."""

from __future__ import annotations

from typing import Any

from .._mpi import resolve_comm


def rank(comm: Any = None) -> int:
    """This process's rank in `comm` (default: distlinalg's communicator)."""
    return resolve_comm(comm).rank


def size(comm: Any = None) -> int:
    """Number of ranks of `comm` (default: distlinalg's communicator)."""
    return resolve_comm(comm).size
