"""scan / exscan: inclusive and exclusive prefix reductions over ranks.

Values: rank r gets op(x_0, ..., x_r) (scan) or op(x_0, ..., x_{r-1})
(exscan; rank 0 gets the op's identity, which MPI leaves undefined).

AD (design note):
  sum: linear. ẏ = SCAN(ẋ); the transpose is the suffix sum
       x̄_s = Σ_{r ≥ s} ȳ_r (exscan: r > s). It is computed exactly from an
       allgather of the cotangents (size × the data), never as AR − EXSCAN,
       which cancels catastrophically.
  prod/min/max: ẏ_r = J_r(x_0..x_r) ẋ computed from allgathers of x and ẋ:
       the JVP of the local prefix reduction of the gathered rows (zero-safe
       for prod, ties shared equally for min/max, as jnp's reductions). Linear
       in ẋ through the allgather, so reverse mode follows.
vmap keeps the batch dimension (one message carries the batch).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._mpi import Communicator, ReduceOp, check_dtype, resolve_comm, resolve_op
from . import _core
from ._core import ad, batching

scan_p = _core.new_primitive("scan")
_core.def_abstract_eval(scan_p, lambda x, *, comm, op, exclusive: _core.shaped(x.shape, x.dtype))
_core.register_lowering(
    scan_p,
    "distlinalg_scan",
    lambda *, comm, op, exclusive: {
        "comm": _core.comm_attr(comm),
        "op": np.int32(op),
        "exclusive": bool(exclusive),
    },
)

_REDUCERS = {ReduceOp.SUM: jnp.sum, ReduceOp.PROD: jnp.prod, ReduceOp.MIN: jnp.min, ReduceOp.MAX: jnp.max}


def identity_of(op: ReduceOp, dtype: Any) -> Any:
    """The neutral element of op for dtype (rank 0's exscan result)."""
    dtype = np.dtype(dtype)
    if op == ReduceOp.SUM:
        return np.zeros((), dtype)
    if op == ReduceOp.PROD:
        return np.ones((), dtype)
    if dtype == np.bool_:
        return np.array(op == ReduceOp.MIN)
    if jnp.issubdtype(dtype, jnp.floating):
        return np.array(np.inf if op == ReduceOp.MIN else -np.inf, dtype)
    info = jnp.iinfo(dtype)
    return np.array(info.max if op == ReduceOp.MIN else info.min, dtype)


def _bind_scan(x: Any, comm: Communicator, op: ReduceOp, exclusive: bool) -> Any:
    y = scan_p.bind(x, comm=comm, op=op, exclusive=exclusive)
    if exclusive and comm.rank == 0:
        # MPI leaves rank 0's exscan output undefined; the handler zeroes it.
        # Add the identity rather than replace the value: a result that no
        # longer depends on the collective would let JAX drop the collective
        # (and its transpose) on this rank alone, while the others wait.
        y = y + identity_of(op, y.dtype)
    return y


def _prefix_of_gathered(gathered: Any, rank: int, op: ReduceOp, exclusive: bool) -> Any:
    """op over rows 0..rank (or 0..rank-1) of a (size, ...) stack.

    Written as a masked reduction over all rows so that every rank's
    derivative has the same data dependence (only the mask differs): under
    vmap, a cotangent that is batched on some ranks and not on others would
    post differently shaped messages.
    """
    rows = np.arange(gathered.shape[0]).reshape((-1,) + (1,) * (gathered.ndim - 1))
    mask = rows < rank if exclusive else rows <= rank
    filled = jnp.where(mask, gathered, identity_of(op, gathered.dtype))
    return _REDUCERS[op](filled, axis=0)


def _scan_jvp(primals, tangents, *, comm: Communicator, op: ReduceOp, exclusive: bool):
    (x,), (t,) = primals, tangents
    y = _bind_scan(x, comm, op, exclusive)
    t = _core.instantiate(t)
    if op == ReduceOp.SUM:
        return y, _bind_scan(t, comm, op, exclusive)
    from .allgather import allgather_p

    rows = allgather_p.bind(x, comm=comm)
    row_tangents = allgather_p.bind(t, comm=comm)
    _, dy = jax.jvp(lambda g: _prefix_of_gathered(g, comm.rank, op, exclusive), (rows,), (row_tangents,))
    return y, dy


def _scan_transpose(ct, x, *, comm: Communicator, op: ReduceOp, exclusive: bool):
    if op != ReduceOp.SUM:
        raise NotImplementedError(f"scan with op {op.name.lower()} is not linear")
    from .allgather import allgather_p

    everyone = allgather_p.bind(_core.instantiate(ct), comm=comm)
    start = comm.rank + 1 if exclusive else comm.rank
    return (jnp.sum(everyone[start:], axis=0),)


def _scan_batch(args, dims, *, comm: Communicator, op: ReduceOp, exclusive: bool):
    (x,), (d,) = args, dims
    return scan_p.bind(x, comm=comm, op=op, exclusive=exclusive), d


ad.primitive_jvps[scan_p] = _scan_jvp
ad.primitive_transposes[scan_p] = _scan_transpose
batching.primitive_batchers[scan_p] = _scan_batch


def _api(x: Any, op: Any, comm: Any, exclusive: bool) -> Any:
    name = "exscan" if exclusive else "scan"
    comm = resolve_comm(comm)
    op = resolve_op(op)

    def one(a):
        a = _core.as_array(a)
        check_dtype(a.dtype, name, op)
        y = _core.bind(scan_p, a, comm=comm, op=op, exclusive=exclusive)
        return y + identity_of(op, y.dtype) if exclusive and comm.rank == 0 else y

    return _core.tree_apply(one, x)


def scan(x: Any, op: Any = "sum", *, comm: Any = None) -> Any:
    """Inclusive prefix reduction over ranks: rank r gets op(x_0, ..., x_r).

    Args:
      x: array or pytree, same shapes and dtypes on every rank.
      op: ``"sum"``, ``"prod"``, ``"min"``, ``"max"`` or ``MPI.SUM`` ... .
      comm: mpi4py intracommunicator (default distlinalg's).

    Returns:
      The prefix reduction, shaped like x.

    AD: sum is linear (transpose: suffix sums of the cotangents, exact);
    prod/min/max differentiate the prefix reduction of allgathered values
    (zero-safe products, ties shared equally).
    """
    return _api(x, op, comm, exclusive=False)


def exscan(x: Any, op: Any = "sum", *, comm: Any = None) -> Any:
    """Exclusive prefix reduction: rank r gets op(x_0, ..., x_{r-1}).

    Rank 0 gets the op's identity (0, 1, the dtype's max for min, its lowest
    for max; True/False for bool min/max). Arguments, returns and AD as
    :func:`scan`; rank 0's output carries no derivative.
    """
    return _api(x, op, comm, exclusive=True)
