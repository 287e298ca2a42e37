"""distlinalg: differentiable distributed linear algebra for JAX over MPI.

Import under ``mpiexec -n P python script.py``; every rank runs the same
program. ``distlinalg.comm`` holds the MPI primitives, ``distlinalg.ad`` the
helpers for exact gradients of replicated losses.
"""

from ._version import __version__
from . import _mpi  # initialises MPI and registers the FFI handlers
from . import ad, comm, solvers
from .comm import rank, size
from .solvers import cg, minres

__all__ = ["__version__", "ad", "comm", "solvers", "cg", "minres", "rank", "size"]
