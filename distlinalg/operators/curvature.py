"""Curvature operators of a replicated loss on sharded data: the Hessian and
the generalized Gauss-Newton matrix, matrix-free.

The loss is *replicated*: every rank returns the same global value (it
reduces its data's contribution with a distlinalg collective). Its
gradient is taken under the project's AD convention by
:func:`distlinalg.ad.grad` (exact for replicated and sharded parameters), and
the operators are linearizations of that gradient, made once at
construction (and, for an operator rebuilt from its pytree children, once
per trace it is used in).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .. import ad
from .._mpi import Communicator, resolve_comm
from ..comm.fused import tree_allreduce
from ._jacobian import LinearisedOperator, TraceLocal, _shape_structs, _structure_of, hash_of

_NAME = "distlinalg.operators"


def _check_params(params: Any, what: str) -> None:
    leaves = jax.tree_util.tree_leaves(params)
    if not leaves or any(not jnp.issubdtype(jnp.result_type(x), jnp.floating) for x in leaves):
        raise TypeError(f"{_NAME}.{what}: params must be a non-empty pytree of real floating arrays")


def _check_scalar_loss(loss: Callable[..., Any], args: tuple, what: str) -> None:
    out = jax.eval_shape(loss, *args)
    if not (isinstance(out, jax.ShapeDtypeStruct) and out.shape == () and jnp.issubdtype(out.dtype, jnp.floating)):
        raise ValueError(f"{_NAME}.{what}: the loss must return a real scalar, got {out}")


@dataclasses.dataclass(frozen=True)
class CurvatureSpec:
    """The static part of a curvature operator (pytree aux data), compared by value.

    `functions` are the user's (the loss, or the model and the loss of its
    outputs): the same objects give equal specs. `params` is the
    parameters' structure (treedef, shapes and dtypes).
    """

    functions: tuple[Callable[..., Any], ...]
    sharded_params: bool
    comm: Communicator
    params: tuple[Any, tuple]

    def __hash__(self) -> int:
        return hash((tuple(hash_of(f) for f in self.functions), self.sharded_params, self.comm, self.params))


class Expansion:
    """The point a curvature operator expands the loss at.

    A pytree: the children are ``(params, args)`` (the parameters and this
    rank's data), the aux data the :class:`CurvatureSpec`. What is derived
    from the children (the linearisation) is computed at first use in a
    trace and kept for it and the traces nested in it (:class:`TraceLocal`).
    """

    def __init__(self, spec: CurvatureSpec, params: Any, args: tuple):
        self.spec, self.params, self.args = spec, params, tuple(args)
        self._derived = TraceLocal()

    def cached(self, name: str, compute: Callable[[], Any]) -> Any:
        return self._derived.get(name, compute)

    def _tree_flatten(self) -> tuple[tuple[Any, tuple], CurvatureSpec]:
        return (self.params, self.args), self.spec

    @classmethod
    def _tree_unflatten(cls, spec: CurvatureSpec, children: tuple[Any, tuple]) -> "Expansion":
        return cls(spec, *children)  # nothing computed: jax unflattens placeholders too


jax.tree_util.register_pytree_node(Expansion, Expansion._tree_flatten, Expansion._tree_unflatten)


class _CurvatureOperator(LinearisedOperator):
    """Shared by the Hessian and the Gauss-Newton operator: one child, the
    :class:`Expansion` (params and args), and a linearisation per trace."""

    _kind = ""

    def __init__(self, point: Expansion):
        # From the spec only: this is also the unflatten (no computation on
        # the children, no communication).
        spec = point.spec
        super().__init__(
            type(self)._product,
            data=(point,),
            input_structure=_shape_structs(spec.params),
            layout="sharded" if spec.sharded_params else "replicated",
            symmetric=True,
            hermitian=True,
            comm=spec.comm,
            name=self._kind,
        )

    @property
    def params(self) -> Any:
        """The parameters the loss is expanded at (or their cotangent)."""
        return self._data[0].params

    @property
    def args(self) -> tuple:
        """The loss's other arguments (this rank's data), or their cotangents."""
        return self._data[0].args

    def prepare(self) -> None:
        """Linearise in the current trace, unless done there or in an enclosing one."""
        (point,) = self._data
        point.cached("linear", lambda: type(self)._linearise(point))


class HessianOperator(_CurvatureOperator):
    """∇²L(params) of a replicated loss, matrix-free; see :func:`hessian`.

    Pytree: the leaves are params and args (this rank's data); the loss, the
    layout, the communicator and the parameters' structure are static and
    compare by value (the same loss object, shapes and dtypes give equal
    tree definitions, so jit reuses a compilation). Unflattening computes
    and communicates nothing; the gradient is linearised from the children
    at first use in a trace, once for the traces nested in it. ``jax.grad``
    with respect to the operator gives a HessianOperator of cotangents
    (``.params``, ``.args``).

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

    _kind = "HessianOperator"

    @staticmethod
    def _linearise(point: Expansion) -> Callable[[Any], Any]:
        (loss,) = point.spec.functions
        gradient = ad.grad(loss, sharded=(0,) if point.spec.sharded_params else (), comm=point.spec.comm)
        _, hvp = jax.linearize(lambda p: gradient(p, *point.args), point.params)
        return hvp

    @staticmethod
    def _product(data: tuple, v: Any) -> Any:
        (point,) = data
        hvp = point.cached("linear", lambda: HessianOperator._linearise(point))
        return hvp(v)


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

    _kind = "GaussNewtonOperator"

    @staticmethod
    def _linearise(point: Expansion) -> tuple[Callable[[Any], Any], Callable[[Any], Any], Callable[[Any], Any]]:
        f, loss_of_outputs = point.spec.functions
        outputs, jvp = jax.linearize(lambda p: f(p, *point.args), point.params)
        transpose_of = jax.linear_transpose(jvp, point.params)
        # ∂ℓ/∂(this rank's outputs): the outputs are sharded inputs of ℓ.
        output_gradient = ad.grad(loss_of_outputs, sharded=(0,), comm=point.spec.comm)
        _, output_hvp = jax.linearize(output_gradient, outputs)
        return jvp, transpose_of, output_hvp

    @staticmethod
    def _product(data: tuple, v: Any) -> Any:
        (point,) = data
        jvp, transpose_of, output_hvp = point.cached("linear", lambda: GaussNewtonOperator._linearise(point))
        (local,) = transpose_of(output_hvp(jvp(v)))
        comm = point.spec.comm
        if point.spec.sharded_params or comm.size == 1:
            return local
        # Rank r's transpose covers its own copy of the parameters.
        return tree_allreduce(local, comm=comm)


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
      A symmetric :class:`HessianOperator` v ↦ ∇²L v (forward-over-reverse,
      linearized once here; each matvec is one JVP of the gradient, whose
      replicated parameters' allreduce is one parameter-sized allreduce).
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
    spec = CurvatureSpec((loss,), bool(sharded_params), comm, _structure_of(params))
    op = HessianOperator(Expansion(spec, params, args))
    op.prepare()  # linearized here, once, in the trace it is built in
    return op


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
      ∂f/∂params on every rank's data: J v and Jᵀ w by the model linearized
      once, H u by forward-over-reverse on ℓ. Positive semidefinite when ℓ
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
    spec = CurvatureSpec((f, loss_of_outputs), bool(sharded_params), comm, _structure_of(params))
    op = GaussNewtonOperator(Expansion(spec, params, args))
    op.prepare()
    return op
