"""reduce: the op-reduction of all ranks' arrays on root, zeros elsewhere.

AD (design note): sum: ẏ = RED(ẋ), x̄ = BC(ȳ) from root (non-root outputs are
constant zeros and carry no cotangent). prod/min/max: ẏ = RED(c ⊙ ẋ) with
c = Π_{t≠s} x_t (zero-safe) or the tie weights w, which need the full
reduction on every rank: an allreduce is kept as the residual.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._runtime.mpi import Communicator, ReduceOp, check_rank, resolve_comm, resolve_op
from . import _core
from ._core import ad, batching
from .allreduce import allreduce_p, product_of_others, tie_weights

reduce_p = _core.new_primitive("reduce")
_core.def_abstract_eval(reduce_p, lambda x, *, comm, op, root: _core.shaped(x.shape, x.dtype))
_core.register_lowering(
    reduce_p,
    "distlinalg_reduce",
    lambda *, comm, op, root: {"comm": _core.comm_attr(comm), "op": np.int32(op), "root": np.int32(root)},
    local=lambda x, **_: [x],
)


def _reduce_jvp(primals, tangents, *, comm: Communicator, op: ReduceOp, root: int):
    (x,), (t,) = primals, tangents
    y = reduce_p.bind(x, comm=comm, op=op, root=root)
    if op.is_bitwise_or_logical:  # integer and bool results: nothing to differentiate
        return y, ad.Zero.from_primal_value(y)
    t = _core.instantiate(t)
    if op == ReduceOp.PROD:
        t = product_of_others(x, comm) * t
    elif op in (ReduceOp.MIN, ReduceOp.MAX):
        full = allreduce_p.bind(x, comm=comm, op=op)
        t = tie_weights(x, full, comm, t.dtype) * t
    return y, reduce_p.bind(t, comm=comm, op=ReduceOp.SUM, root=root)


def _reduce_transpose(ct, x, *, comm: Communicator, op: ReduceOp, root: int):
    if op != ReduceOp.SUM:
        raise NotImplementedError(f"reduce with op {op.name.lower()} is not linear")
    from .bcast import bcast_p

    return (bcast_p.bind(_core.instantiate(ct), comm=comm, root=root),)


def _reduce_batch(args, dims, *, comm: Communicator, op: ReduceOp, root: int):
    (x,), (d,) = args, dims
    return reduce_p.bind(x, comm=comm, op=op, root=root), d


ad.primitive_jvps[reduce_p] = _reduce_jvp
ad.primitive_transposes[reduce_p] = _reduce_transpose
batching.primitive_batchers[reduce_p] = _reduce_batch


def reduce(x: Any, op: Any, *, root: int = 0, comm: Any = None) -> Any:
    """Reduce `x` elementwise over ranks onto `root`.

    Args:
      x: array or pytree, same shapes and dtypes on every rank.
      op: ``"sum"``, ``"prod"``, ``"min"``, ``"max"``, the bitwise and logical ops
        (``"band"`` ... ``"lxor"``) or ``MPI.SUM`` ... ``MPI.LXOR``, with allreduce's dtype rules.
      root: the receiving rank (a static int).
      comm: mpi4py intracommunicator (default distlinalg's).

    Returns:
      On root the reduction; on every other rank zeros of the same shape and
      dtype (MPI leaves them undefined; distlinalg defines them).

    AD: as allreduce, restricted to root's output: the sum's transpose
    broadcasts root's cotangent; non-root outputs carry no cotangent.

    Example:
      >>> import jax.numpy as jnp
      >>> from distlinalg import comm
      >>> n = comm.size()
      >>> y = comm.reduce(jnp.ones(2) * (comm.rank() + 1), "sum", root=0)
      >>> expected = n * (n + 1) / 2 if comm.rank() == 0 else 0.0   # 1 + 2 + ... + n on root
      >>> bool((y == expected).all())
      True
    """
    comm = resolve_comm(comm)
    op = resolve_op(op)
    root = check_rank(root, comm, "root", "reduce")

    return _core.apply_collective(reduce_p, x, opname="reduce", comm=comm, op=op, root=root)
