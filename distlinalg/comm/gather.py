"""gather: every rank's array stacked on root; zeros on the other ranks.

Shapes: x: s on every rank -> y: (size, *s) on every rank (root: row r is
rank r's x; other ranks: zeros). AD: ẏ = gather(ẋ); transpose x̄_s =
ȳ_root[s], a scatter from root (non-root outputs carry no cotangent).
vmap: the rank axis stays in front, so a batch dimension moves behind it.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from .._runtime.mpi import Communicator, check_rank, resolve_comm
from . import _core
from ._core import ad, batching

gather_p = _core.new_primitive("gather")
_core.def_abstract_eval(gather_p, lambda x, *, comm, root: _core.shaped((comm.size, *x.shape), x.dtype))
_core.register_lowering(
    gather_p,
    "distlinalg_gather",
    lambda *, comm, root: {"comm": _core.comm_attr(comm), "root": np.int32(root)},
    local=lambda x, **_: [x[None]],
)


def _gather_jvp(primals, tangents, *, comm: Communicator, root: int):
    (x,), (t,) = primals, tangents
    return gather_p.bind(x, comm=comm, root=root), gather_p.bind(_core.instantiate(t), comm=comm, root=root)


def _gather_transpose(ct, x, *, comm: Communicator, root: int):
    from .scatter import scatter_p

    return (scatter_p.bind(_core.instantiate(ct), comm=comm, root=root),)


def _gather_batch(args, dims, *, comm: Communicator, root: int):
    (x,), (d,) = args, dims
    # One message: gather (B, *s) blocks -> (size, B, *s).
    return gather_p.bind(jnp.moveaxis(x, d, 0), comm=comm, root=root), 1


ad.primitive_jvps[gather_p] = _gather_jvp
ad.primitive_transposes[gather_p] = _gather_transpose
batching.primitive_batchers[gather_p] = _gather_batch


def gather(x: Any, *, root: int = 0, comm: Any = None) -> Any:
    """Stack every rank's `x` on root.

    Args:
      x: array or pytree, same shapes and dtypes on every rank (shape s).
      root: the receiving rank (a static int).
      comm: mpi4py intracommunicator (default distlinalg's).

    Returns:
      Shape ``(size, *s)``: on root, row r is rank r's x; zeros on other ranks.

    AD: forward mode gathers the tangents; the transpose scatters root's
    cotangent rows back to their ranks.

    Example:
      >>> import jax.numpy as jnp
      >>> from distlinalg import comm
      >>> g = comm.gather(jnp.array([comm.rank(), 10 * comm.rank()]), root=0)
      >>> g.shape == (comm.size(), 2)
      True
      >>> rows = [[r, 10 * r] for r in range(comm.size())]
      >>> g.tolist() == (rows if comm.rank() == 0 else [[0, 0]] * comm.size())
      True
    """
    comm = resolve_comm(comm)
    root = check_rank(root, comm, "root", "gather")

    return _core.apply_collective(gather_p, x, opname="gather", comm=comm, root=root)
