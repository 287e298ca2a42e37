"""Exact gradients of replicated losses (shared/design/ad-convention.md).

Under distlinalg's convention a primitive's transpose is the adjoint of the
whole SPMD program: seeding every rank's copy of a replicated loss L with 1
differentiates Σ_r L_r = P·L. And a replicated parameter w is really P
copies w_r (one per rank): the gradient of the one parameter is the sum of
the copies' gradients, the adjoint of the implicit broadcast w ↦ (w, ..., w).
These helpers do both: seed 1/P, then allreduce the gradients of the
replicated arguments; sharded (rank-local) arguments keep their local
blocks, which are then exactly the blocks of the global gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .._mpi import resolve_comm
from ..comm.allreduce import allreduce


def _as_tuple(argnums: int | Sequence[int]) -> tuple[int, ...]:
    return (argnums,) if isinstance(argnums, int) else tuple(argnums)


def value_and_grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    *,
    sharded: int | Sequence[int] = (),
    has_aux: bool = False,
    comm: Any = None,
) -> Callable[..., Any]:
    """Value and exact gradient of a replicated scalar loss, on every rank.

    Args:
      fun: the loss; every rank returns the same scalar (typically computed
        with allreduces from rank-local data), optionally ``(loss, aux)``.
        Terms computed redundantly on every rank (a regulariser R(w)) are fine.
      argnums: which positional arguments to differentiate (int or tuple).
      sharded: which of `argnums` are sharded, i.e. rank-local pieces of a
        distributed argument (each rank holds its own block, e.g. this rank's
        rows of data). All other differentiated arguments are replicated (the
        same value on every rank, e.g. model parameters).
      has_aux: `fun` returns ``(loss, aux)``; aux is returned untouched.
      comm: communicator over which the loss is replicated (default
        distlinalg's).

    Returns:
      A function returning ``(loss, grads)`` (``((loss, aux), grads)`` with
      has_aux): grads of replicated arguments are the full gradient,
      identical on every rank; grads of sharded arguments are this rank's
      block of the global gradient. Like ``jax.value_and_grad``, a single
      int argnums gives a single gradient. Jittable and differentiable.
    """
    nums = _as_tuple(argnums)
    sharded_nums = set(_as_tuple(sharded))
    unknown = sharded_nums - set(nums)
    if unknown:
        raise ValueError(f"distlinalg.ad: sharded={sorted(unknown)} are not among argnums={nums}")

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        communicator = resolve_comm(comm)
        for i in nums:
            if not -len(args) <= i < len(args):
                raise ValueError(f"distlinalg.ad: argnums {i} out of range for {len(args)} arguments")

        def of_differentiated(*diff):
            full = list(args)
            for i, value in zip(nums, diff):
                full[i] = value
            out = fun(*full, **kwargs)
            loss, aux = out if has_aux else (out, None)
            if jnp.ndim(loss) != 0:
                raise TypeError(f"distlinalg.ad: the loss must be a scalar, got shape {jnp.shape(loss)}")
            return loss, aux

        loss, pullback, aux = jax.vjp(of_differentiated, *(args[i] for i in nums), has_aux=True)
        seed = jnp.ones_like(loss) / communicator.size
        grads = list(pullback(seed))
        for k, i in enumerate(nums):
            if i not in sharded_nums:
                grads[k] = allreduce(grads[k], "sum", comm=communicator)
        grads_out = grads[0] if isinstance(argnums, int) else tuple(grads)
        value = (loss, aux) if has_aux else loss
        return value, grads_out

    return wrapped


def grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    *,
    sharded: int | Sequence[int] = (),
    has_aux: bool = False,
    comm: Any = None,
) -> Callable[..., Any]:
    """Exact gradient of a replicated scalar loss; see :func:`value_and_grad`.

    Returns ``grads`` (``(grads, aux)`` with has_aux).
    """
    vg = value_and_grad(fun, argnums, sharded=sharded, has_aux=has_aux, comm=comm)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        value, grads = vg(*args, **kwargs)
        return (grads, value[1]) if has_aux else grads

    return wrapped
