"""MPI operations as JAX primitives, differentiable and batchable.

Every operation takes an optional ``comm`` (an mpi4py intracommunicator;
default: distlinalg's private duplicate of ``MPI.COMM_WORLD``), runs inside
``jax.jit`` and eagerly, and carries an ordered effect so XLA keeps the
program order of all communication. Each family lives in its own module with
its abstract evaluation, lowering, JVP, transpose and batching rules.
"""

from .._runtime.mpi import PROC_NULL, Communicator, ReduceOp, configure
from .allgather import allgather, allgather_p
from .allreduce import allreduce, allreduce_p
from .alltoall import alltoall, alltoall_p
from .barrier import barrier, barrier_p
from .fused import tree_allreduce
from .bcast import bcast, bcast_p
from .gather import gather, gather_p
from .info import communicator, rank, size
from .nonblocking import Request, iallgather, iallgather_p, iallreduce, iallreduce_p, wait, wait_p
from .nonblocking_p2p import irecv, irecv_p, isend, isend_p
from .overlap import fence_p, overlap
from .reduce import reduce, reduce_p
from .reduce_scatter import reduce_scatter, reduce_scatter_p
from .scan import exscan, scan, scan_p
from .scatter import scatter, scatter_p
from .send_recv import recv, recv_p, send, send_p
from .sendrecv import sendrecv, sendrecv_p
from .sendrecv_status import ANY_SOURCE, ANY_TAG, Status, sendrecv_status_p

__all__ = [
    "PROC_NULL", "ANY_SOURCE", "ANY_TAG", "Status", "Communicator", "ReduceOp", "configure", "communicator",
    "rank", "size",
    "allreduce", "tree_allreduce", "reduce", "bcast", "gather", "scatter", "allgather", "reduce_scatter",
    "alltoall", "scan", "exscan", "send", "recv", "sendrecv", "barrier",
    "iallreduce", "iallgather", "isend", "irecv", "wait", "overlap", "Request",
    "allreduce_p", "reduce_p", "bcast_p", "gather_p", "scatter_p", "allgather_p",
    "reduce_scatter_p", "alltoall_p", "scan_p", "send_p", "recv_p", "sendrecv_p",
    "sendrecv_status_p", "barrier_p", "iallreduce_p", "iallgather_p", "isend_p", "irecv_p", "wait_p", "fence_p",
]
