"""Curvature operators of a replicated loss on sharded data: the Hessian and
the generalized Gauss-Newton matrix, matrix-free.

The loss is *replicated*: every rank returns the same global value (it
reduces its data's contribution with a distlinalg collective). Its
gradient is taken under the project's AD convention by
:func:`distlinalg.ad.grad` (exact for replicated and sharded parameters), and
the operators are linearizations of that gradient, made once at
construction.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .. import ad
from .._mpi import resolve_comm
from ._base import LinearOperator, sum_over_ranks

_NAME = "distlinalg.operators"


def _check_params(params: Any, what: str) -> None:
    leaves = jax.tree_util.tree_leaves(params)
    if not leaves or any(not jnp.issubdtype(jnp.result_type(x), jnp.floating) for x in leaves):
        raise TypeError(f"{_NAME}.{what}: params must be a non-empty pytree of real floating arrays")


def _check_scalar_loss(loss: Callable[..., Any], args: tuple, what: str) -> None:
    out = jax.eval_shape(loss, *args)
    if not (isinstance(out, jax.ShapeDtypeStruct) and out.shape == () and jnp.issubdtype(out.dtype, jnp.floating)):
        raise ValueError(f"{_NAME}.{what}: the loss must return a real scalar, got {out}")


def hessian(
    loss: Callable[..., Any],
    params: Any,
    *args: Any,
    sharded_params: bool = False,
    comm: Any = None,
) -> LinearOperator:
    """The Hessian ∇²L(params) of a replicated loss as a matrix-free operator.

    Args:
      loss: ``loss(params, *args) -> scalar``, the same global value on
        every rank (each rank's data in `args`, combined with distlinalg
        collectives inside the loss).
      params: real pytree; replicated, or this rank's block with
        ``sharded_params=True``.
      *args: the rest of loss's arguments (this rank's data); not
        differentiated.
      sharded_params: params are a block of the global parameter vector;
        the layout is then "sharded".
      comm: communicator (default distlinalg's).

    Returns:
      A symmetric LinearOperator v ↦ ∇²L v (forward-over-reverse, linearized
      once here; each matvec is one JVP of the gradient, whose replicated
      parameters' allreduce is one parameter-sized allreduce).
    """
    comm = resolve_comm(comm)
    _check_params(params, "hessian")
    _check_scalar_loss(loss, (params, *args), "hessian")
    gradient = ad.grad(loss, sharded=(0,) if sharded_params else (), comm=comm)
    _, hvp = jax.linearize(lambda p: gradient(p, *args), params)
    return LinearOperator(
        hvp,
        input_structure=params,
        layout="sharded" if sharded_params else "replicated",
        symmetric=True,
        hermitian=True,
        comm=comm,
        name="HessianOperator",
    )


def gauss_newton(
    f: Callable[..., Any],
    loss_of_outputs: Callable[[Any], Any],
    params: Any,
    *args: Any,
    sharded_params: bool = False,
    comm: Any = None,
) -> LinearOperator:
    """The generalized Gauss-Newton matrix G = Jᵀ H J of L = ℓ(f(params)).

    Args:
      f: ``f(params, *args) -> outputs``: this rank's model outputs on its
        data (any pytree of real arrays).
      loss_of_outputs: ``ℓ(outputs) -> scalar``, replicated: the global loss
        of every rank's outputs (it combines them with a collective), so its
        Hessian H couples the ranks' outputs as the loss does.
      params, *args, sharded_params, comm: as for :func:`hessian`.

    Returns:
      A symmetric LinearOperator v ↦ Jᵀ (H (J v)), J = ∂f/∂params on every
      rank's data: J v and Jᵀ w by the model linearized once, H u by
      forward-over-reverse on ℓ. Positive semidefinite when ℓ is convex in
      the outputs. One parameter-sized allreduce per matvec (replicated).
    """
    comm = resolve_comm(comm)
    _check_params(params, "gauss_newton")
    outputs, jvp = jax.linearize(lambda p: f(p, *args), params)
    _check_scalar_loss(loss_of_outputs, (outputs,), "gauss_newton")
    transpose_of = jax.linear_transpose(jvp, params)
    # ∂ℓ/∂(this rank's outputs): the outputs are sharded inputs of ℓ.
    output_gradient = ad.grad(loss_of_outputs, sharded=(0,), comm=comm)
    _, output_hvp = jax.linearize(output_gradient, outputs)

    def matvec(v: Any) -> Any:
        (local,) = transpose_of(output_hvp(jvp(v)))
        if sharded_params or comm.size == 1:
            return local
        # Rank r's transpose covers its own copy of the parameters.
        return sum_over_ranks(local, comm)

    return LinearOperator(
        matvec,
        input_structure=params,
        layout="sharded" if sharded_params else "replicated",
        symmetric=True,
        hermitian=True,
        comm=comm,
        name="GaussNewtonOperator",
    )
