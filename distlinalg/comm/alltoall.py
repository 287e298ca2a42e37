"""alltoall: block q of rank r's (size, *s) array becomes block r on rank q.

Shapes: x: (size, *s) -> y: (size, *s); y on rank q, block r = x on rank r,
block q. As a map of the stacked global state, a transpose of the first two
axes, hence self-adjoint: ẏ = A2A(ẋ), x̄ = A2A(ȳ) (docs/ad.md, "The convention").
vmap: the batch dimension moves right behind the rank axis.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from .._runtime.mpi import Communicator, resolve_comm
from . import _core
from ._core import ad, batching

alltoall_p = _core.new_primitive("alltoall")
_core.def_abstract_eval(alltoall_p, lambda x, *, comm: _core.shaped(x.shape, x.dtype))
_core.register_lowering(
    alltoall_p, "distlinalg_alltoall", lambda *, comm: {"comm": _core.comm_attr(comm)}, local=lambda x, **_: [x]
)


def _alltoall_jvp(primals, tangents, *, comm: Communicator):
    (x,), (t,) = primals, tangents
    return alltoall_p.bind(x, comm=comm), alltoall_p.bind(_core.instantiate(t), comm=comm)


def _alltoall_transpose(ct, x, *, comm: Communicator):
    return (alltoall_p.bind(_core.instantiate(ct), comm=comm),)


def _alltoall_batch(args, dims, *, comm: Communicator):
    (x,), (d,) = args, dims
    # (size, B, *s): each block sent to a rank carries the whole batch.
    return alltoall_p.bind(jnp.moveaxis(x, d, 1), comm=comm), 1


ad.primitive_jvps[alltoall_p] = _alltoall_jvp
ad.primitive_transposes[alltoall_p] = _alltoall_transpose
batching.primitive_batchers[alltoall_p] = _alltoall_batch


def alltoall(x: Any, *, comm: Any = None) -> Any:
    """Exchange one block with every rank (MPI_Alltoall).

    Args:
      x: array or pytree of arrays of shape ``(size, *s)``, the same shapes and
        dtypes on every rank; block ``x[q]`` goes to rank q.
      comm: an mpi4py intracommunicator; default: distlinalg's private
        duplicate of ``MPI.COMM_WORLD``.

    Returns:
      Shape ``(size, *s)``, dtype of `x`: block r is what rank r sent to this
      rank (rank r's ``x[rank]``).

    Raises (at trace time, on every rank): ValueError when the leading
    dimension is not ``size`` (0-d input included); TypeError for an
    unsupported dtype or a bad communicator.

    AD: self-adjoint; forward mode exchanges the tangents, the transpose
    exchanges the cotangents back. vmap sends the whole batch in one message.

    Example:
      >>> import jax.numpy as jnp
      >>> from distlinalg import comm
      >>> n, r = comm.size(), comm.rank()
      >>> x = jnp.array([[r, q] for q in range(n)])     # block q goes to rank q
      >>> comm.alltoall(x).tolist() == [[s, r] for s in range(n)]   # block s came from rank s
      True
    """
    comm = resolve_comm(comm)

    return _core.apply_collective(alltoall_p, x, opname="alltoall", comm=comm, one_block_per_rank=True)
