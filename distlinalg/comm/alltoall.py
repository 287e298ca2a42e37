"""alltoall: block q of rank r's (size, *s) array becomes block r on rank q.

Self-adjoint: ẏ = A2A(ẋ), x̄ = A2A(ȳ). vmap: batch behind the rank axis.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from .._mpi import Communicator, check_dtype, resolve_comm
from . import _core
from ._core import ad, batching
from .scatter import check_leading_dim

alltoall_p = _core.new_primitive("alltoall")
_core.def_abstract_eval(alltoall_p, lambda x, *, comm: _core.shaped(x.shape, x.dtype))
_core.register_lowering(alltoall_p, "distlinalg_alltoall", lambda *, comm: {"comm": _core.comm_attr(comm)})


def _alltoall_jvp(primals, tangents, *, comm: Communicator):
    (x,), (t,) = primals, tangents
    return alltoall_p.bind(x, comm=comm), alltoall_p.bind(_core.instantiate(t), comm=comm)


def _alltoall_transpose(ct, x, *, comm: Communicator):
    return (alltoall_p.bind(_core.instantiate(ct), comm=comm),)


def _alltoall_batch(args, dims, *, comm: Communicator):
    (x,), (d,) = args, dims
    return alltoall_p.bind(jnp.moveaxis(x, d, 1), comm=comm), 1


ad.primitive_jvps[alltoall_p] = _alltoall_jvp
ad.primitive_transposes[alltoall_p] = _alltoall_transpose
batching.primitive_batchers[alltoall_p] = _alltoall_batch


def alltoall(x: Any, *, comm: Any = None) -> Any:
    """Exchange one block with every rank.

    Args:
      x: array or pytree of shape (size, *s); block q goes to rank q.
      comm: mpi4py intracommunicator (default distlinalg's).

    Returns:
      Shape (size, *s): block r is what rank r sent to this rank.

    AD: self-adjoint (the transpose is another alltoall).
    """
    comm = resolve_comm(comm)

    def one(a):
        a = _core.as_array(a)
        check_dtype(a.dtype, "alltoall")
        check_leading_dim(a, comm, "alltoall")
        return _core.bind(alltoall_p, a, comm=comm)

    return _core.tree_apply(one, x)
