"""bcast: root's array on every rank; other ranks' input is a template.

AD: ẏ = BC(ẋ) (only root's tangent matters); transpose x̄_root = Σ_r ȳ_r,
zeros on the other ranks (their input was only a shape/dtype template):
a sum-reduce to root. vmap keeps the batch dimension (one message).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._runtime.mpi import Communicator, check_rank, resolve_comm
from . import _core
from ._core import ad, batching

bcast_p = _core.new_primitive("bcast")
_core.def_abstract_eval(bcast_p, lambda x, *, comm, root: _core.shaped(x.shape, x.dtype))
_core.register_lowering(
    bcast_p,
    "distlinalg_bcast",
    lambda *, comm, root: {"comm": _core.comm_attr(comm), "root": np.int32(root)},
    aliases={0: 0},
    local=lambda x, **_: [x],
)


def _bcast_jvp(primals, tangents, *, comm: Communicator, root: int):
    (x,), (t,) = primals, tangents
    return bcast_p.bind(x, comm=comm, root=root), bcast_p.bind(_core.instantiate(t), comm=comm, root=root)


def _bcast_transpose(ct, x, *, comm: Communicator, root: int):
    from .reduce import reduce_p  # the two transpose into each other
    from .._runtime.mpi import ReduceOp

    return (reduce_p.bind(_core.instantiate(ct), comm=comm, op=ReduceOp.SUM, root=root),)


def _bcast_batch(args, dims, *, comm: Communicator, root: int):
    (x,), (d,) = args, dims
    return bcast_p.bind(x, comm=comm, root=root), d


ad.primitive_jvps[bcast_p] = _bcast_jvp
ad.primitive_transposes[bcast_p] = _bcast_transpose
batching.primitive_batchers[bcast_p] = _bcast_batch


def bcast(x: Any, *, root: int = 0, comm: Any = None) -> Any:
    """Broadcast root's `x` to every rank.

    Args:
      x: array or pytree. On root, the data; on other ranks only its shape
        and dtype matter (pass the same traced value everywhere when
        differentiating: see docs/ad.md, "templates").
      root: the sending rank (a static int).
      comm: mpi4py intracommunicator (default distlinalg's).

    Returns:
      Root's `x` on every rank (same shape and dtype).

    AD: forward mode broadcasts root's tangent; the transpose sums every
    rank's cotangent onto root (zeros on the other ranks).

    Example:
      >>> import jax.numpy as jnp
      >>> from distlinalg import comm
      >>> x = jnp.full(3, 10.0 + comm.rank())      # only root's values travel
      >>> bool((comm.bcast(x, root=0) == 10.0).all())
      True
    """
    comm = resolve_comm(comm)
    root = check_rank(root, comm, "root", "bcast")

    return _core.apply_collective(bcast_p, x, opname="bcast", comm=comm, root=root)
