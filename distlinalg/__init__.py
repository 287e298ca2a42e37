"""distlinalg: differentiable distributed linear algebra for JAX over MPI.

Import under ``mpiexec -n P python script.py``; every rank runs the same
program. ``distlinalg.comm`` holds the MPI primitives, ``distlinalg.ad`` the
helpers for exact gradients of replicated losses, ``distlinalg.solvers`` the
Krylov solvers (CG, MINRES, GMRES, BiCGStab) and the natural gradient,
``distlinalg.operators`` the distributed linear operators, ``distlinalg.linalg`` dense
factorisations (Cholesky, LU, eigh) of a matrix held by rows.
"""

from ._version import __version__
from . import _runtime

# The one start-up (XLA flags, JAX patches, MPI, the safety net), in its order: _runtime.start.
YNN_FUSION = _runtime.start()
from . import ad, comm, grid, linalg, operators, solvers  # noqa: E402  (after the start-up)
from .comm import rank, size  # noqa: E402
from .solvers import bicgstab, cg, eigsh, gmres, minres, natural_gradient  # noqa: E402

__all__ = ["__version__", "ad", "comm", "grid", "linalg", "operators", "solvers", "cg", "minres", "gmres", "bicgstab", "eigsh",
           "natural_gradient", "rank", "size"]
