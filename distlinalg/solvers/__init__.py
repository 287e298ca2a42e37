"""Krylov solvers across MPI ranks, differentiable end to end.

``cg`` (conjugate gradients, standard or single-reduction), ``minres``
(symmetric indefinite, with shift), ``gmres`` and ``bicgstab`` (general
nonsymmetric systems; with cg a superset of jax.scipy.sparse.linalg) run inside ``jax.jit`` on replicated or
sharded vectors, return a :class:`SolverInfo` identical on every rank, and
differentiate through ``lax.custom_linear_solve`` (one extra solve). Their
loops are steered only by values identical on every rank; inputs that differ
between ranks stop every rank with ``Reason.DIVERGED_INCONSISTENT_RANKS``,
invalid arguments raise a ValueError on every rank. ``natural_gradient``
solves the SR / MinSR system of a sharded model in parameter or sample space.
``eigsh`` finds a few eigenpairs of a Hermitian operator (thick-restart
Lanczos, or LOBPCG with a preconditioner), differentiable in both modes.
"""

from ._common import Reason, SolverInfo
from .bicgstab import bicgstab
from .cg import cg
from .eigsh import EigshInfo, eigsh
from .gmres import gmres
from .minres import minres
from .natural_gradient import natural_gradient
from .block_jacobi import BlockJacobi, block_jacobi
from .chebyshev import ChebyshevPreconditioner, chebyshev
from .multigrid import Multigrid, multigrid
from .nystrom import NystromPreconditioner, nystrom
from .preconditioners import jacobi

__all__ = ["cg", "minres", "gmres", "bicgstab", "eigsh", "natural_gradient", "jacobi", "chebyshev", "multigrid", "nystrom", "block_jacobi",
           "BlockJacobi", "ChebyshevPreconditioner", "Multigrid", "NystromPreconditioner", "Reason", "SolverInfo",
           "EigshInfo"]
