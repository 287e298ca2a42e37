"""Curvature operators of a replicated loss on sharded data: the Hessian and
the generalized Gauss-Newton matrix, matrix-free.

The loss is *replicated*: every rank returns the same global value (it
reduces its data's contribution with a distlinalg collective). Its
gradient is taken under the project's AD convention by
:func:`distlinalg.ad.grad` (exact for replicated and sharded parameters).
Both operators expand the loss at a :class:`LossPoint` (the parameters and
this rank's data, declared data); a product differentiates the gradient
(forward over reverse), and :func:`~distlinalg.operators.linearise` (which
the solvers call) linearises it once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .. import ad
from .._runtime.mpi import Communicator, resolve_comm
from .._trees import Structure
from ..comm.fused import tree_allreduce
from ._base import LinearOperator, eager_product, function_operator, linearise, operator_class
from ._jacobian import ParameterSpace, UserFunction, _static, point_class

_NAME = "distlinalg.operators"


def _check_params(params: Any, what: str) -> None:
    leaves = jax.tree_util.tree_leaves(params)
    if not leaves or any(not jnp.issubdtype(jnp.result_type(x), jnp.floating) for x in leaves):
        raise TypeError(f"{_NAME}.{what}: params must be a non-empty pytree of real floating arrays")


def _check_scalar_loss(loss: Callable[..., Any], args: tuple, what: str) -> None:
    out = jax.eval_shape(loss, *args)
    if not (isinstance(out, jax.ShapeDtypeStruct) and out.shape == () and jnp.issubdtype(out.dtype, jnp.floating)):
        raise ValueError(f"{_NAME}.{what}: the loss must return a real scalar, got {out}")


@point_class
class LossPoint:
    """The point a curvature operator expands the loss at.

    A pytree: the children are ``params`` and ``args`` (this rank's data);
    the user's functions (the loss, or the model and the loss of its
    outputs), the layout, the communicator and the parameters' structure
    are static and compared by value (the same function objects, shapes and
    dtypes give equal tree definitions).

    Example:
      >>> import jax.numpy as jnp
      >>> from distlinalg import comm
      >>> from distlinalg.operators import LossPoint, hessian
      >>> H = hessian(lambda w, x: comm.allreduce(jnp.sum((x * w) ** 2)), jnp.ones(2), jnp.ones(2))
      >>> isinstance(H.point, LossPoint), H.params.shape, len(H.args)
      (True, (2,), 1)
    """

    params: Any
    args: tuple
    functions: tuple[UserFunction, ...] = _static()
    sharded_params: bool = _static(default=False)
    comm: Communicator = _static()
    params_structure: Structure = _static()

    def gradient(self, loss: Callable[..., Any], sharded: tuple[int, ...]) -> Callable[..., Any]:
        """∇ of a replicated loss under the AD convention (docs/ad.md)."""
        return ad.grad(loss, sharded=sharded, comm=self.comm)


@operator_class
class _CurvatureOperator(ParameterSpace, LinearOperator):
    """Shared by the Hessian and the Gauss–Newton operator: one child, the
    :class:`LossPoint`; symmetric, in the layout of the parameters."""

    point: LossPoint

    symmetric = True
    hermitian = True

    @property
    def params(self) -> Any:
        """The parameters the loss is expanded at (or their cotangent)."""
        return self.point.params

    @property
    def args(self) -> tuple:
        """The loss's other arguments (this rank's data), or their cotangents."""
        return self.point.args

    @property
    def comm(self) -> Communicator:
        return self.point.comm

    def _linearised(self) -> Callable[[Any], Any]:
        """v ↦ A v with what does not depend on v computed once, here."""
        raise NotImplementedError

    def _linearised_operator(self) -> LinearOperator:
        return function_operator(self._linearised(), input_structure=self.in_structure, layout=self.layout,
                                 symmetric=True, hermitian=True, comm=self.comm, name=self.name)


@operator_class
class HessianOperator(_CurvatureOperator):
    """∇²L(params) of a replicated loss, matrix-free; see :func:`hessian`.

    Pytree: the leaves are params and args (this rank's data); the loss, the
    layout, the communicator and the parameters' structure are static and
    compare by value (the same loss object, shapes and dtypes give equal
    tree definitions, so jit reuses a compilation). Unflattening computes
    and communicates nothing. A product is one forward-over-reverse pass;
    :func:`~distlinalg.operators.linearise` (which the solvers call)
    linearises the gradient once. ``jax.grad`` with respect to the operator
    gives a HessianOperator of cotangents (``.params``, ``.args``).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import distlinalg as dl
      >>> from distlinalg import comm
      >>> from distlinalg.operators import hessian
      >>> loss = lambda w, x: comm.allreduce(jnp.sum(jnp.log(jnp.cosh(x @ w))))
      >>> x = jax.random.normal(jax.random.PRNGKey(comm.rank()), (4, 3))
      >>> H = hessian(loss, jnp.array([0.5, -0.3, 0.2]), x)
      >>> H
      HessianOperator(layout='replicated', symmetric, hermitian)
      >>> step = jax.jit(lambda H, g: dl.cg(H, g)[0])(H, jnp.ones(3))  # the operator is an argument
      >>> bool(jnp.allclose(H @ step, 1.0, atol=1e-4))
      True
    """

    def _gradient(self) -> Callable[[Any], Any]:
        (loss,) = self.point.functions
        gradient = self.point.gradient(loss.fn, (0,) if self.point.sharded_params else ())
        return lambda p: gradient(p, *self.point.args)

    def _matvec(self, v: Any) -> Any:
        eager = eager_product(self, v)
        if eager is not None:
            return eager
        return jax.jvp(self._gradient(), (self.point.params,), (v,))[1]

    def _linearised(self) -> Callable[[Any], Any]:
        _, hvp = jax.linearize(self._gradient(), self.point.params)
        return hvp


@operator_class
class GaussNewtonOperator(_CurvatureOperator):
    """Jᵀ H J of L = ℓ(f(params)), matrix-free; see :func:`gauss_newton`.

    Pytree: as :class:`HessianOperator` (leaves: params and args; f, ℓ, the
    layout, the communicator and the parameters' structure static).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import distlinalg as dl
      >>> from distlinalg import comm
      >>> from distlinalg.operators import gauss_newton
      >>> f = lambda w, x: jnp.tanh(x @ w)
      >>> loss_of_outputs = lambda out: comm.allreduce(0.5 * jnp.sum((out - 1.0) ** 2))
      >>> x = jax.random.normal(jax.random.PRNGKey(comm.rank()), (4, 3))
      >>> G = gauss_newton(f, loss_of_outputs, jnp.array([0.5, -0.3, 0.2]), x)
      >>> step = jax.jit(lambda G, g: dl.cg(G, g)[0])(G, jnp.ones(3))  # the operator is an argument
      >>> bool(jnp.allclose(G @ step, 1.0, atol=1e-4)), G.params.shape
      (True, (3,))
    """

    def _pieces(self) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
        """(the model on this rank's data, ∂ℓ/∂(this rank's outputs)): the outputs are sharded inputs of ℓ."""
        f, loss_of_outputs = self.point.functions
        return (lambda p: f.fn(p, *self.point.args)), self.point.gradient(loss_of_outputs.fn, (0,))

    def _sum_copies(self, local: Any) -> Any:
        """Rank r's transpose covers its own copy of replicated parameters: sum them."""
        if self.point.sharded_params or self.comm.size == 1:
            return local
        return tree_allreduce(local, comm=self.comm)

    def _matvec(self, v: Any) -> Any:
        eager = eager_product(self, v)
        if eager is not None:
            return eager
        model, output_gradient = self._pieces()
        outputs, transpose = jax.vjp(model, self.point.params)
        tangent = jax.jvp(model, (self.point.params,), (v,))[1]
        (local,) = transpose(jax.jvp(output_gradient, (outputs,), (tangent,))[1])
        return self._sum_copies(local)

    def _linearised(self) -> Callable[[Any], Any]:
        model, output_gradient = self._pieces()
        outputs, jvp = jax.linearize(model, self.point.params)
        transpose_of = jax.linear_transpose(jvp, self.point.params)
        _, output_hvp = jax.linearize(output_gradient, outputs)
        return lambda v: self._sum_copies(transpose_of(output_hvp(jvp(v)))[0])


@linearise.register
def _linearise_curvature(operator: _CurvatureOperator) -> LinearOperator:
    return operator._linearised_operator()


def hessian(
    loss: Callable[..., Any],
    params: Any,
    *args: Any,
    sharded_params: bool = False,
    comm: Any = None,
) -> HessianOperator:
    """The Hessian ∇²L(params) of a replicated loss as a matrix-free operator.

    Args:
      loss: ``loss(params, *args) -> scalar``, the same global value on
        every rank (each rank's data in `args`, combined with distlinalg
        collectives inside the loss).
      params: real pytree; replicated, or this rank's block with
        ``sharded_params=True``.
      *args: the rest of loss's arguments (this rank's data): pytrees of
        arrays, children of the operator (traced when it is passed to a
        jitted function; pass static options through the loss, e.g. with
        functools.partial). The Hessian does not differentiate them.
      sharded_params: params are a block of the global parameter vector;
        the layout is then "sharded".
      comm: communicator (default distlinalg's).

    Returns:
      A symmetric :class:`HessianOperator` v ↦ ∇²L v (forward-over-reverse;
      linearised once by the solvers, each matvec is then one JVP of the
      gradient, whose replicated parameters' allreduce is one
      parameter-sized allreduce).
      Vectors are shaped like params.

    AD and pytree: a pytree whose leaves are params and args (see
    :class:`HessianOperator`): pass it to a jitted function, or
    differentiate through its matvec with respect to params and args,
    whether it is built inside the differentiated function or passed to it.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from distlinalg import comm
      >>> from distlinalg.operators import hessian
      >>> loss = lambda w, x: comm.allreduce(jnp.sum(jnp.log(jnp.cosh(x @ w))))  # every rank's samples
      >>> w = jnp.array([0.5, -0.3, 0.2])
      >>> x = jax.random.normal(jax.random.PRNGKey(comm.rank()), (4, 3))  # this rank's samples
      >>> H = hessian(loss, w, x)
      >>> X = comm.allgather(x).reshape(-1, 3)      # every rank's samples: the reference
      >>> H_ref = X.T @ (X / jnp.cosh(X @ w)[:, None] ** 2)  # Σ_i sech²(x_i·w) x_i x_iᵀ
      >>> bool(jnp.allclose(H.to_dense(), H_ref, atol=1e-5)), bool(jnp.allclose(H @ w, H_ref @ w, atol=1e-5))
      (True, True)
    """
    comm = resolve_comm(comm)
    _check_params(params, "hessian")
    _check_scalar_loss(loss, (params, *args), "hessian")
    point = LossPoint(params=params, args=tuple(args), functions=(UserFunction(loss),),
                      sharded_params=bool(sharded_params), comm=comm, params_structure=Structure.of(params))
    return HessianOperator(point=point)


def gauss_newton(
    f: Callable[..., Any],
    loss_of_outputs: Callable[[Any], Any],
    params: Any,
    *args: Any,
    sharded_params: bool = False,
    comm: Any = None,
) -> GaussNewtonOperator:
    """The generalized Gauss-Newton matrix G = Jᵀ H J of L = ℓ(f(params)).

    Args:
      f: ``f(params, *args) -> outputs``: this rank's model outputs on its
        data (any pytree of real arrays).
      loss_of_outputs: ``ℓ(outputs) -> scalar``, replicated: the global loss
        of every rank's outputs (it combines them with a collective), so its
        Hessian H couples the ranks' outputs as the loss does.
      params, \\*args, sharded_params, comm: as for :func:`hessian`.

    Returns:
      A symmetric :class:`GaussNewtonOperator` v ↦ Jᵀ (H (J v)), J =
      ∂f/∂params on every rank's data: J v and Jᵀ w by the model (linearised
      once by the solvers), H u by forward-over-reverse on ℓ. Positive semidefinite when ℓ
      is convex in the outputs. One parameter-sized allreduce per matvec
      (replicated). Vectors are shaped like params.

    AD and pytree: as for :func:`hessian` (leaves: params and args; f and ℓ
    static).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from distlinalg import comm
      >>> from distlinalg.operators import gauss_newton
      >>> f = lambda w, x: jnp.tanh(x @ w)          # this rank's outputs
      >>> loss_of_outputs = lambda out: comm.allreduce(0.5 * jnp.sum((out - 1.0) ** 2))
      >>> w = jnp.array([0.5, -0.3, 0.2])
      >>> x = jax.random.normal(jax.random.PRNGKey(comm.rank()), (4, 3))  # this rank's samples
      >>> G = gauss_newton(f, loss_of_outputs, w, x)
      >>> J = jax.jacfwd(f)(w, comm.allgather(x).reshape(-1, 3))  # on every rank's samples
      >>> bool(jnp.allclose(G.to_dense(), J.T @ J, atol=1e-5))  # squared loss: Jᵀ I J
      True
    """
    comm = resolve_comm(comm)
    _check_params(params, "gauss_newton")
    outputs = jax.eval_shape(lambda p: f(p, *args), params)
    _check_scalar_loss(loss_of_outputs, (outputs,), "gauss_newton")
    point = LossPoint(params=params, args=tuple(args), functions=(UserFunction(f), UserFunction(loss_of_outputs)),
                      sharded_params=bool(sharded_params), comm=comm, params_structure=Structure.of(params))
    return GaussNewtonOperator(point=point)
