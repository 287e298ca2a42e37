"""reduce_scatter: block r of every rank's (size, *s) array, reduced, on rank r.

AD: sum is linear: ẏ = RS(ẋ), x̄ = AG(ȳ). prod/min/max: ẏ = RS(c ⊙ ẋ), where
rank s's weight for its block r depends on rank r's result: the zero counts
and nonzero products (prod) or the extrema and tie counts (min/max) of every
block are allgathered as residuals. vmap: batch behind the rank axis.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from .._mpi import Communicator, ReduceOp, check_dtype, resolve_comm, resolve_op
from . import _core
from ._core import ad, batching
from .scatter import check_leading_dim

reduce_scatter_p = _core.new_primitive("reduce_scatter")
_core.def_abstract_eval(reduce_scatter_p, lambda x, *, comm, op: _core.shaped(x.shape[1:], x.dtype))
_core.register_lowering(
    reduce_scatter_p,
    "distlinalg_reduce_scatter",
    lambda *, comm, op: {"comm": _core.comm_attr(comm), "op": np.int32(op)},
)


def _weights(x: Any, comm: Communicator, op: ReduceOp, dtype: Any) -> Any:
    """Per-block tangent weights of rank s's contribution, shape (size, *s)."""
    from .allgather import allgather_p

    def rs(v, o):
        return reduce_scatter_p.bind(v, comm=comm, op=o)

    if op == ReduceOp.PROD:
        is_zero = x == 0
        safe_x = jnp.where(is_zero, jnp.ones_like(x), x)
        zeros = allgather_p.bind(rs(is_zero.astype(jnp.int32), ReduceOp.SUM), comm=comm)
        nonzero_product = allgather_p.bind(rs(safe_x, ReduceOp.PROD), comm=comm)
        return jnp.where(
            zeros == 0,
            nonzero_product / safe_x,
            jnp.where((zeros == 1) & is_zero, nonzero_product, jnp.zeros_like(x)),
        )
    extremum = allgather_p.bind(rs(x, op), comm=comm)
    hit = (x == extremum).astype(dtype)
    return hit / allgather_p.bind(rs(hit, ReduceOp.SUM), comm=comm)


def _reduce_scatter_jvp(primals, tangents, *, comm: Communicator, op: ReduceOp):
    (x,), (t,) = primals, tangents
    y = reduce_scatter_p.bind(x, comm=comm, op=op)
    t = _core.instantiate(t)
    if op != ReduceOp.SUM:
        t = _weights(x, comm, op, t.dtype) * t
    return y, reduce_scatter_p.bind(t, comm=comm, op=ReduceOp.SUM)


def _reduce_scatter_transpose(ct, x, *, comm: Communicator, op: ReduceOp):
    if op != ReduceOp.SUM:
        raise NotImplementedError(f"reduce_scatter with op {op.name.lower()} is not linear")
    from .allgather import allgather_p

    return (allgather_p.bind(_core.instantiate(ct), comm=comm),)


def _reduce_scatter_batch(args, dims, *, comm: Communicator, op: ReduceOp):
    (x,), (d,) = args, dims
    return reduce_scatter_p.bind(jnp.moveaxis(x, d, 1), comm=comm, op=op), 0


ad.primitive_jvps[reduce_scatter_p] = _reduce_scatter_jvp
ad.primitive_transposes[reduce_scatter_p] = _reduce_scatter_transpose
batching.primitive_batchers[reduce_scatter_p] = _reduce_scatter_batch


def reduce_scatter(x: Any, op: Any = "sum", *, comm: Any = None) -> Any:
    """Reduce block r of every rank's `x` onto rank r.

    Args:
      x: array or pytree of shape (size, *s) on every rank.
      op: ``"sum"``, ``"prod"``, ``"min"``, ``"max"`` or ``MPI.SUM`` ... .
      comm: mpi4py intracommunicator (default distlinalg's).

    Returns:
      Shape s: on rank r, op over ranks q of x_q[r].

    AD: sum is linear (transpose: allgather of the cotangents); prod is
    zero-safe, min/max share ties equally.
    """
    comm = resolve_comm(comm)
    op = resolve_op(op)

    def one(a):
        a = _core.as_array(a)
        check_dtype(a.dtype, "reduce_scatter", op)
        check_leading_dim(a, comm, "reduce_scatter")
        return _core.bind(reduce_scatter_p, a, comm=comm, op=op)

    return _core.tree_apply(one, x)
