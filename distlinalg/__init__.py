"""distlinalg: differentiable distributed linear algebra for JAX over MPI.

Import under ``mpiexec -n P python script.py``; every rank runs the same
program. ``distlinalg.comm`` holds the MPI primitives, ``distlinalg.ad`` the
helpers for exact gradients of replicated losses, ``distlinalg.solvers`` the
Krylov solvers (CG, MINRES, GMRES, BiCGStab) and the natural gradient,
``distlinalg.operators`` the distributed linear operators, ``distlinalg.linalg`` dense
factorisations (Cholesky, LU, eigh) of a matrix held by rows.
"""

from ._version import __version__
from . import _compat

# Before anything starts XLA's CPU backend (see _compat.disable_ynn_fusion).
YNN_FUSION = _compat.disable_ynn_fusion()
if YNN_FUSION.startswith("left on"):
    import warnings

    warnings.warn(
        "distlinalg was imported after JAX's CPU backend started and could not switch XLA's YNN "
        "reduce fusions off; with jaxlib 0.10.2 they can give wrong results (e.g. jnp.sum((X @ W) ** 2, 1), "
        "jitted solves with x0=None). Import distlinalg before running JAX computations, or set "
        "XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT yourself.",
        RuntimeWarning,
        stacklevel=2,
    )
# Programs with MPI calls compile for GPUs without XLA's dynamic slice fusion (see _compat).
GPU_COMPILE_OPTIONS = _compat.route_gpu_compilations()
from . import _mpi  # initialises MPI and registers the FFI handlers
from . import _safety  # a failing, stuck or interrupted rank ends the whole job
_safety.install()
from . import ad, comm, linalg, operators, solvers
from .comm import rank, size
from .solvers import bicgstab, cg, eigsh, gmres, minres, natural_gradient

__all__ = ["__version__", "ad", "comm", "linalg", "operators", "solvers", "cg", "minres", "gmres", "bicgstab", "eigsh",
           "natural_gradient", "rank", "size"]
