"""allreduce: every rank receives the op-reduction of all ranks' arrays.

AD (docs/ad.md, "The convention: the adjoint of the whole SPMD program"):
  sum:      ẏ = AR(ẋ);                x̄ = AR(ȳ)  (self-adjoint)
  prod:     ẏ = AR(c ⊙ ẋ), c_s = Π_{t≠s} x_t, computed without dividing by
            zero and with exact second derivatives (product_of_others)
  min/max:  ẏ = AR(w ⊙ ẋ), w = [x == y] / AR([x == y]) (ties share equally)
Only the sum is linear; the other JVPs are sums of scaled tangents, so their
transposes follow from the sum's.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from .._runtime.mpi import Communicator, ReduceOp, resolve_comm, resolve_op
from . import _core
from ._core import ad, batching

allreduce_p = _core.new_primitive("allreduce")
_core.def_abstract_eval(allreduce_p, lambda x, *, comm, op: _core.shaped(x.shape, x.dtype))
_core.register_lowering(
    allreduce_p,
    "distlinalg_allreduce",
    lambda *, comm, op: {"comm": _core.comm_attr(comm), "op": np.int32(op)},
    aliases={0: 0},
    local=lambda x, **_: [x],  # one rank: every reduction of one contribution is that contribution
)


def _allreduce_jvp(primals, tangents, *, comm: Communicator, op: ReduceOp):
    (x,), (t,) = primals, tangents
    y = allreduce_p.bind(x, comm=comm, op=op)
    if op.is_bitwise_or_logical:  # integer and bool results: nothing to differentiate
        return y, ad.Zero.from_primal_value(y)
    t = _core.instantiate(t)
    if op == ReduceOp.PROD:
        t = product_of_others(x, comm) * t
    elif op in (ReduceOp.MIN, ReduceOp.MAX):
        t = tie_weights(x, y, comm, t.dtype) * t
    return y, allreduce_p.bind(t, comm=comm, op=ReduceOp.SUM)


def product_of_others(x: Any, comm: Communicator) -> Any:
    """c_s = Π_{t≠s} x_t elementwise, exact (with derivatives) when some x_t are 0.

    Nothing divides by zero and the result keeps the derivatives of the true
    product, not those of a constant 0, so Hessians through a prod reduction
    are exact too. With N the product of the nonzero entries and z_t the zero
    entries, Π_{t≠s} x_t = (N / x_s if x_s ≠ 0 else N) · e_k(the other zeros),
    e_k the elementary symmetric polynomial of the k other zeros: e_0 = 1,
    e_1 = p1, e_2 = (p1² − p2) / 2 from the power sums p1, p2; e_3 and beyond
    are 0 with vanishing first and second derivatives at 0. Two allreduces:
    one sum of (zero count, p1, p2) and one product.
    """
    is_zero = x == 0
    zero_part = jnp.where(is_zero, x, jnp.zeros_like(x))
    safe_x = jnp.where(is_zero, jnp.ones_like(x), x)
    sums = allreduce_p.bind(
        jnp.stack([is_zero.astype(x.dtype), zero_part, zero_part * zero_part]), comm=comm, op=ReduceOp.SUM
    )
    nonzero_product = allreduce_p.bind(safe_x, comm=comm, op=ReduceOp.PROD)
    other_zeros = jnp.real(sums[0]) - is_zero.astype(jnp.real(sums[0]).dtype)
    e1 = sums[1] - zero_part
    e2 = (e1 * e1 - (sums[2] - zero_part * zero_part)) / 2
    zeros_factor = jnp.where(
        other_zeros == 0,
        jnp.ones_like(x),
        jnp.where(other_zeros == 1, e1, jnp.where(other_zeros == 2, e2, jnp.zeros_like(x))),
    )
    return nonzero_product / safe_x * zeros_factor


def tie_weights(x: Any, extremum: Any, comm: Communicator, dtype: Any) -> Any:
    """w = [x == y] / (number of ranks attaining y): ties share equally, as jnp.max."""
    hit = (x == extremum).astype(dtype)
    return hit / allreduce_p.bind(hit, comm=comm, op=ReduceOp.SUM)


def _allreduce_transpose(ct, x, *, comm: Communicator, op: ReduceOp):
    if op != ReduceOp.SUM:
        raise NotImplementedError(f"allreduce with op {op.name.lower()} is not linear")
    ct = _core.instantiate(ct)
    return (allreduce_p.bind(ct, comm=comm, op=ReduceOp.SUM),)


def _allreduce_batch(args, dims, *, comm: Communicator, op: ReduceOp):
    (x,), (d,) = args, dims
    return allreduce_p.bind(x, comm=comm, op=op), d


ad.primitive_jvps[allreduce_p] = _allreduce_jvp
ad.primitive_transposes[allreduce_p] = _allreduce_transpose
batching.primitive_batchers[allreduce_p] = _allreduce_batch


def allreduce(x: Any, op: Any = "sum", *, comm: Any = None) -> Any:
    """Reduce `x` elementwise over all ranks; every rank gets the result.

    Args:
      x: an array or a pytree of arrays, the same shapes and dtypes on every rank.
      op: ``"sum"``, ``"prod"``, ``"min"``, ``"max"``, ``"band"``, ``"bor"``,
        ``"bxor"``, ``"land"``, ``"lor"``, ``"lxor"``, or the mpi4py objects
        ``MPI.SUM`` ... ``MPI.LXOR``. bool accepts min (and), max (or) and
        the logical ops; complex accepts sum and prod; the bitwise and
        logical ops take integers and bool (no derivative: integer results).
      comm: an mpi4py intracommunicator; default: distlinalg's private
        duplicate of ``MPI.COMM_WORLD``.

    Returns:
      The reduction, with the shape and dtype of `x`, identical on every rank.

    AD: forward and reverse mode for every op under the convention of the
    whole SPMD program (the transpose of the sum is the sum of the
    cotangents); products are zero-safe, min/max ties share the tangent
    equally. vmap batches in one message.

    Example:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> from distlinalg import comm
      >>> n = comm.size()
      >>> x = jnp.arange(3.0) + comm.rank()
      >>> total = comm.allreduce(x)                # Σ_r (arange(3) + r), the same on every rank
      >>> bool((total == n * jnp.arange(3.0) + n * (n - 1) / 2).all())
      True
      >>> int(jax.jit(comm.allreduce, static_argnums=1)(comm.rank(), "max")) == n - 1
      True
      >>> g = jax.grad(lambda x: comm.allreduce(x).sum())(x)   # transpose of the sum: a sum
      >>> bool((g == n).all())
      True
    """
    comm = resolve_comm(comm)
    op = resolve_op(op)

    return _core.apply_collective(allreduce_p, x, opname="allreduce", comm=comm, op=op)
