"""allgather: every rank's array stacked on every rank.

Shapes: x: s -> y: (size, *s), row r = rank r's x, identical on every rank.
AD (docs/ad.md, "The convention"): ẏ = AG(ẋ); transpose x̄_s = Σ_r ȳ_r[s],
a sum reduce_scatter. vmap: the batch dimension lands behind the rank axis.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from .._runtime.mpi import Communicator, ReduceOp, resolve_comm
from . import _core
from ._core import ad, batching

allgather_p = _core.new_primitive("allgather")
_core.def_abstract_eval(allgather_p, lambda x, *, comm: _core.shaped((comm.size, *x.shape), x.dtype))
_core.register_lowering(
    allgather_p, "distlinalg_allgather", lambda *, comm: {"comm": _core.comm_attr(comm)}, local=lambda x, **_: [x[None]]
)


def _allgather_jvp(primals, tangents, *, comm: Communicator):
    (x,), (t,) = primals, tangents
    return allgather_p.bind(x, comm=comm), allgather_p.bind(_core.instantiate(t), comm=comm)


def _allgather_transpose(ct, x, *, comm: Communicator):
    from .reduce_scatter import reduce_scatter_p

    return (reduce_scatter_p.bind(_core.instantiate(ct), comm=comm, op=ReduceOp.SUM),)


def _allgather_batch(args, dims, *, comm: Communicator):
    (x,), (d,) = args, dims
    # Every rank's (B, *s) batch becomes one row: the result is (size, B, *s).
    return allgather_p.bind(jnp.moveaxis(x, d, 0), comm=comm), 1


ad.primitive_jvps[allgather_p] = _allgather_jvp
ad.primitive_transposes[allgather_p] = _allgather_transpose
batching.primitive_batchers[allgather_p] = _allgather_batch


def allgather(x: Any, *, comm: Any = None) -> Any:
    """Stack every rank's `x` on every rank (MPI_Allgather).

    Args:
      x: array or pytree of arrays, the same shapes and dtypes on every rank
        (shape s, 0-d allowed).
      comm: an mpi4py intracommunicator; default: distlinalg's private
        duplicate of ``MPI.COMM_WORLD``.

    Returns:
      Shape ``(size, *s)``, dtype of `x`: row r is rank r's x, identical on every
      rank.

    Raises (at trace time, on every rank): TypeError for an unsupported
    dtype or a bad communicator.

    AD: forward mode gathers the tangents; the transpose sums every rank's
    cotangent row s onto rank s (a sum reduce_scatter). vmap sends the whole
    batch in one message; the gathered rank axis stays first.

    Example:
      >>> import jax.numpy as jnp
      >>> from distlinalg import comm
      >>> stacked = comm.allgather(jnp.asarray(comm.rank()))
      >>> stacked.tolist() == list(range(comm.size()))
      True
      >>> comm.allgather(jnp.ones((2, 3))).shape == (comm.size(), 2, 3)
      True
    """
    comm = resolve_comm(comm)

    return _core.apply_collective(allgather_p, x, opname="allgather", comm=comm)
