"""scatter: row r of root's (size, *s) array goes to rank r.

AD: ẏ = scatter(ẋ) (root's tangent); transpose: the cotangents gathered
onto root (zeros on the other ranks, whose input was only a template).
vmap: the batch dimension moves behind the rank axis before communicating.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from .._runtime.mpi import Communicator, check_rank, resolve_comm
from . import _core
from ._core import ad, batching

scatter_p = _core.new_primitive("scatter")
_core.def_abstract_eval(scatter_p, lambda x, *, comm, root: _core.shaped(x.shape[1:], x.dtype))
_core.register_lowering(
    scatter_p,
    "distlinalg_scatter",
    lambda *, comm, root: {"comm": _core.comm_attr(comm), "root": np.int32(root)},
    local=lambda x, **_: [x[0]],
)


def _scatter_jvp(primals, tangents, *, comm: Communicator, root: int):
    (x,), (t,) = primals, tangents
    return scatter_p.bind(x, comm=comm, root=root), scatter_p.bind(_core.instantiate(t), comm=comm, root=root)


def _scatter_transpose(ct, x, *, comm: Communicator, root: int):
    from .gather import gather_p

    return (gather_p.bind(_core.instantiate(ct), comm=comm, root=root),)


def _scatter_batch(args, dims, *, comm: Communicator, root: int):
    (x,), (d,) = args, dims
    # (size, B, *s): each rank's block carries the whole batch.
    return scatter_p.bind(jnp.moveaxis(x, d, 1), comm=comm, root=root), 0


ad.primitive_jvps[scatter_p] = _scatter_jvp
ad.primitive_transposes[scatter_p] = _scatter_transpose
batching.primitive_batchers[scatter_p] = _scatter_batch


def scatter(x: Any, *, root: int = 0, comm: Any = None) -> Any:
    """Send row r of root's `x` to rank r.

    Args:
      x: array or pytree of shape ``(size, *s)``. On root, the data; elsewhere a
        shape/dtype template (pass the same traced value when differentiating).
      root: the sending rank (a static int).
      comm: mpi4py intracommunicator (default distlinalg's).

    Returns:
      Shape s: root's row `rank`.

    AD: forward mode scatters root's tangent; the transpose gathers the
    cotangents onto root (zeros on other ranks).

    Example:
      >>> import jax.numpy as jnp
      >>> from distlinalg import comm
      >>> n = comm.size()
      >>> rows = jnp.arange(2.0 * n).reshape(n, 2)          # root's data
      >>> x = rows if comm.rank() == 0 else jnp.zeros((n, 2))   # elsewhere a template
      >>> comm.scatter(x, root=0).tolist() == rows[comm.rank()].tolist()
      True
    """
    comm = resolve_comm(comm)
    root = check_rank(root, comm, "root", "scatter")

    return _core.apply_collective(scatter_p, x, opname="scatter", comm=comm, root=root, one_block_per_rank=True)
