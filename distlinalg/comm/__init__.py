"""MPI operations as JAX primitives, differentiable and batchable.

Every operation takes an optional ``comm`` (an mpi4py intracommunicator;
default: distlinalg's private duplicate of ``MPI.COMM_WORLD``), runs inside
``jax.jit`` and eagerly, and carries an ordered effect so XLA keeps the
program order of all communication.
"""

from .._mpi import PROC_NULL, Communicator, ReduceOp, configure
from .allreduce import allreduce, allreduce_p
from .info import rank, size

__all__ = [
    "PROC_NULL",
    "Communicator",
    "ReduceOp",
    "configure",
    "allreduce",
    "allreduce_p",
    "rank",
    "size",
]
