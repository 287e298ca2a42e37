"""reduce_scatter: block r of every rank's (size, *s) array, reduced, on rank r.

Shapes: x: (size, *s) on every rank -> y: s; y on rank r = op over ranks q
of x_q[r].

AD (docs/ad.md, "The convention: the adjoint of the whole SPMD program"):
  sum:      ẏ = RS(ẋ);  x̄ = AG(ȳ), i.e. x̄_s[r] = ȳ_r
  prod:     ẏ = RS(c ⊙ ẋ), c[r] on rank s = Π_{t≠s} x_t[r] (zero-safe)
  min/max:  ẏ_r = RS([x == AG(y)] ⊙ ẋ)_r / count_r, count = RS([x == AG(y)])
            (ties share the tangent equally, as jnp.max)
Only the sum is linear; the other JVPs are sum reduce_scatters of scaled
tangents, so JAX derives their transposes from the sum's.
vmap: the batch dimension moves right behind the rank axis.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from .._runtime.mpi import Communicator, ReduceOp, resolve_comm, resolve_op
from . import _core
from ._core import ad, batching
from .allgather import allgather_p

reduce_scatter_p = _core.new_primitive("reduce_scatter")
_core.def_abstract_eval(reduce_scatter_p, lambda x, *, comm, op: _core.shaped(x.shape[1:], x.dtype))
_core.register_lowering(
    reduce_scatter_p,
    "distlinalg_reduce_scatter",
    lambda *, comm, op: {"comm": _core.comm_attr(comm), "op": np.int32(op)},
    local=lambda x, **_: [x[0]],  # (1, *s): the one block is this rank's
)


def _rs(x: Any, comm: Communicator, op: ReduceOp) -> Any:
    return reduce_scatter_p.bind(x, comm=comm, op=op)


def _product_of_others(x: Any, comm: Communicator) -> Any:
    """c[r] = Π_{t≠s} x_t[r] on rank s, shape (size, *s), zero-safe.

    Rank s's weight for block r depends on every rank's block r, so per-block
    sums are reduced onto the block's rank and allgathered back: the number
    of zeros k, the product N of the nonzero entries, and the power sums
    p1, p2 of the zero entries. Nothing divides by zero, and the result has
    the derivatives of the true product (not those of a constant 0), so
    higher-order derivatives stay exact: Π_{t≠s} x_t = N / x_s · e_k(zeros)
    for a nonzero x_s and N · e_{k-1}(the other zeros) for a zero x_s, with
    the elementary symmetric polynomials e_1 = p1 and e_2 = (p1² - p2) / 2
    (both 0 in value); e_3 and beyond are taken as 0, exact to third order.
    """
    is_zero = x == 0
    zero_part = jnp.where(is_zero, x, jnp.zeros_like(x))
    safe_x = jnp.where(is_zero, jnp.ones_like(x), x)
    # One message for the three sums; float counts stay exact up to the 3
    # that matter below, whatever the rounding of larger counts.
    sums = _rs(jnp.stack([is_zero.astype(x.dtype), zero_part, zero_part * zero_part], axis=1), comm, ReduceOp.SUM)
    nonzero_product = _rs(safe_x, comm, ReduceOp.PROD)
    gathered = allgather_p.bind(jnp.concatenate([sums, nonzero_product[None]]), comm=comm)
    count, p1, p2, product = (gathered[:, i] for i in range(4))
    count = jnp.real(count)
    one, zero = jnp.ones_like(x), jnp.zeros_like(x)
    e1_others = p1 - zero_part
    e2_others = (e1_others * e1_others - (p2 - zero_part * zero_part)) / 2
    at_zero = jnp.select([count == 1, count == 2, count == 3], [one, e1_others, e2_others], zero)
    at_nonzero = jnp.select([count == 0, count == 1, count == 2], [one, p1, (p1 * p1 - p2) / 2], zero) / safe_x
    return product * jnp.where(is_zero, at_zero, at_nonzero)


def _reduce_scatter_jvp(primals, tangents, *, comm: Communicator, op: ReduceOp):
    (x,), (t,) = primals, tangents
    y = _rs(x, comm, op)
    if op.is_bitwise_or_logical:  # integer and bool results: nothing to differentiate
        return y, ad.Zero.from_primal_value(y)
    t = _core.instantiate(t)
    if op == ReduceOp.SUM:
        return y, _rs(t, comm, ReduceOp.SUM)
    if op == ReduceOp.PROD:
        return y, _rs(_product_of_others(x, comm) * t, comm, ReduceOp.SUM)
    # min/max: rank s's entry of block r attains rank r's result y_r where
    # x_s[r] == y_r; every rank needs every y_r, hence the allgather. The
    # number of ranks attaining y_r is known on rank r, so the tie share is
    # applied after the reduction: ẏ_r = Σ_s [x_s[r] == y_r] ẋ_s[r] / count_r,
    # which is how jnp.max splits ties.
    hit = (x == allgather_p.bind(y, comm=comm)).astype(t.dtype)
    count = _rs(hit, comm, ReduceOp.SUM)
    return y, _rs(hit * t, comm, ReduceOp.SUM) / count


def _reduce_scatter_transpose(ct, x, *, comm: Communicator, op: ReduceOp):
    if op != ReduceOp.SUM:
        raise NotImplementedError(f"reduce_scatter with op {op.name.lower()} is not linear")
    return (allgather_p.bind(_core.instantiate(ct), comm=comm),)


def _reduce_scatter_batch(args, dims, *, comm: Communicator, op: ReduceOp):
    (x,), (d,) = args, dims
    return reduce_scatter_p.bind(jnp.moveaxis(x, d, 1), comm=comm, op=op), 0


ad.primitive_jvps[reduce_scatter_p] = _reduce_scatter_jvp
ad.primitive_transposes[reduce_scatter_p] = _reduce_scatter_transpose
batching.primitive_batchers[reduce_scatter_p] = _reduce_scatter_batch


def reduce_scatter(x: Any, op: Any = "sum", *, comm: Any = None) -> Any:
    """Reduce block r of every rank's `x` onto rank r (MPI_Reduce_scatter_block).

    Args:
      x: array or pytree of arrays of shape ``(size, *s)``, the same shapes and
        dtypes on every rank; block ``x[r]`` is this rank's contribution to
        rank r's result.
      op: ``"sum"``, ``"prod"``, ``"min"``, ``"max"``, the bitwise and logical
        ops (``"band"`` ... ``"lxor"``) or the mpi4py objects ``MPI.SUM`` ...
        ``MPI.LXOR``, with allreduce's dtype rules.
      comm: an mpi4py intracommunicator; default: distlinalg's private
        duplicate of ``MPI.COMM_WORLD``.

    Returns:
      Shape s, dtype of `x`: on rank r, the op-reduction over ranks q of
      ``x_q[r]``.

    Raises (at trace time, on every rank): ValueError when the leading
    dimension is not ``size`` (0-d input included) or the op is unknown;
    TypeError for an unsupported dtype/op pair or a bad communicator.

    AD: forward and reverse mode for every op under the convention of the
    whole SPMD program. The sum is linear (its transpose allgathers the
    cotangents: rank s gets ``x̄[r] = ȳ_r``); prod is zero-safe; min/max
    share the tangent equally among tied entries, like ``jnp.max``. vmap
    sends the whole batch in one message.

    Example:
      >>> import jax.numpy as jnp
      >>> from distlinalg import comm
      >>> n = comm.size()
      >>> x = jnp.ones((n, 3)) * jnp.arange(n)[:, None]    # block r goes to rank r
      >>> y = comm.reduce_scatter(x)                         # n copies of r on rank r
      >>> y.shape, bool((y == n * comm.rank()).all())
      ((3,), True)
    """
    comm = resolve_comm(comm)
    op = resolve_op(op)

    return _core.apply_collective(reduce_scatter_p, x, opname="reduce_scatter", comm=comm, op=op, one_block_per_rank=True)
