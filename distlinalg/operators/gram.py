"""The parameter-space Gram operator (quantum geometric tensor, Fisher
matrix) of a model evaluated on samples sharded across ranks:

    S v = Ōᴴ Ō v / N + λ v + ε diag(ŌᴴŌ/N) v

(λ = diag_shift, ε = diag_scale), with Ō the centred Jacobian of the
per-sample outputs over all N samples of all ranks in the mode's parameter
space (:mod:`._jacobian`: modes "real", "complex", "holomorphic" as in
NetKet). Matrix-free: Ō u is a JVP of the model linearised once, Ōᴴ w a VJP.
Centring costs nothing per matvec: the centred vector Ō u sums to zero over
all samples, so Ōᴴ Ō u = Oᴴ Ō u. With replicated parameters a matvec is one
allreduce of a parameter-sized vector; with sharded parameters the model's
own collectives sum over ranks and the centring adds one k-vector allreduce.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .._trees import tree_map
from ._base import LinearOperator, eager_product, function_operator, linearise, operator_class
from ._jacobian import MODES, Jacobian, ModelOperator, ModelPoint, ParameterSpace

__all__ = ["gram", "gram_operator", "GramOperator", "MODES"]

_NAME = "distlinalg.operators.gram"


# -- the math, one small function per term -------------------------------------------
def gram_product(model: Jacobian, u: Any) -> Any:
    """ŌᴴŌ u / N (u in the mode's parameter space)."""
    return tree_map(lambda x: x / model.n_total, model.adjoint(model.jvp(u), centred_input=model.center))


def gram_diagonal(model: Jacobian) -> Any:
    """diag(ŌᴴŌ)/N: Σ over samples and channels of |Ō_ij|², divided by N."""
    return tree_map(lambda d: d / model.n_total, model.squared_row_sums())


def shifted(product: Any, u: Any, diag_shift: Any, diag_scale: Any, diagonal: Any) -> Any:
    """product + λ u + ε d ∘ u."""
    out = tree_map(lambda o, x: o + diag_shift * x, product, u)
    if diagonal is not None:
        out = tree_map(lambda o, d, x: o + diag_scale * d * x, out, diagonal, u)
    return out


def gram(
    f: Callable[[Any, Any], Any],
    params: Any,
    samples: Any,
    *,
    center: bool = True,
    diag_shift: Any = 0.0,
    diag_scale: Any = None,
    mode: str | None = None,
    chunk_size: int | None = None,
    comm: Any = None,
    sharded_params: bool = False,
    equal_samples: bool = False,
) -> GramOperator:
    """The Jacobian Gram operator (QGT / Fisher / SR matrix) of a sharded model.

    S = Ōᴴ Ō / N + λ I (+ ε diag), n_params × n_params, over every rank's
    samples; the Jacobian is never formed nor gathered.

    Args:
      f: ``f(params, samples) -> (n_r,)``: one output per local sample (e.g.
        log ψ(σ_i)), real or complex. With replicated params it must not
        communicate in a way that mixes samples; with sharded params it
        computes with its parameter block and distlinalg collectives.
      params: pytree of floating/complex arrays: replicated (identical on
        every rank) or, with ``sharded_params=True``, this rank's block.
      samples: pytree of arrays with a leading axis of this rank's n_r
        samples; counts may differ between ranks (N = Σ n_r).
      center: subtract the mean Jacobian row over all N samples.
      diag_shift: λ (may be traced; the operator is differentiable in it).
      diag_scale: ε, adds ε·diag(S) (Becca–Sorella regularisation); the
        diagonal costs a per-sample Jacobian pass and one allreduce, once per
        linearisation (once per solve).
      mode: "real", "complex" or "holomorphic", NetKet's modes (see
        :mod:`distlinalg.operators._jacobian`): "real" keeps Re f only,
        "complex" both Re f and Im f (for real params S = Re(OᴴO)/N),
        "holomorphic" the complex S of a holomorphic model. Complex params
        in "real"/"complex" mode are (Re θ, Im θ) pairs. Default (None):
        NetKet's choice, "complex" for a complex output, else "real".
      chunk_size: evaluate the model on at most this many local samples at
        a time. Bounds memory; the model is then re-linearised per chunk in
        every matvec (without chunks it is linearised once per solve, by
        :func:`~distlinalg.operators.linearise`).
      comm: communicator (default distlinalg's).
      sharded_params: params are this rank's block; the operator's layout is
        "sharded" (vectors are parameter blocks).
      equal_samples: declare every rank's sample count equal: a mismatch is
        a ValueError on every rank.

    Returns:
      A :class:`GramOperator` on pytrees shaped like params ("replicated" or
      "sharded" layout), Hermitian (real symmetric except in "holomorphic"
      mode; real-linear when complex params are split into pairs), with
      ``diagonal()`` (of S + shifts; for split complex params the real and
      imaginary parts' diagonals packed as d_r + i·d_i) and ``to_dense()``.
      One allreduce of a parameter-sized vector per matvec (replicated).

    AD: the matvec is differentiable with respect to params, samples and the
    shifts, so ``jax.grad`` through ``distlinalg.cg(gram(...), F)`` gives
    exact meta-gradients, whether the operator is built inside the
    differentiated function or passed to it (it is a pytree whose leaves are
    params, samples, diag_shift and diag_scale: the gradient with respect to
    it is a :class:`GramOperator` of cotangents).

    Pytree and jit: see :class:`GramOperator`. The counts of every rank's
    samples are exchanged here, once, and kept static: an operator passed to
    a jitted function is rebuilt without communicating.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from distlinalg import comm
      >>> from distlinalg.operators import gram
      >>> f = lambda w, x: jnp.tanh(x @ w)          # one output per sample
      >>> w = jnp.array([0.5, -0.3, 0.2])
      >>> x = jax.random.normal(jax.random.PRNGKey(comm.rank()), (4, 3))  # this rank's samples
      >>> S = gram(f, w, x, diag_shift=1e-2)
      >>> X = comm.allgather(x).reshape(-1, 3)      # every rank's samples: the reference
      >>> O = jax.jacfwd(f)(w, X); O = O - O.mean(axis=0)
      >>> bool(jnp.allclose(S @ w, O.T @ O @ w / len(X) + 1e-2 * w, atol=1e-5))
      True
    """
    point = ModelPoint.build(f, params, samples, mode=mode, center=center, chunk_size=chunk_size, comm=comm,
                             sharded_params=sharded_params, where=_NAME)
    if equal_samples and np.any(np.asarray(point.counts) != point.counts[0]):
        raise ValueError(f"{_NAME}: equal_samples=True but the ranks hold {list(point.counts)} samples")
    return GramOperator(point=point, diag_shift=diag_shift, diag_scale=diag_scale)


def gram_operator(point: ModelPoint, diag_shift: Any, diag_scale: Any = None) -> GramOperator:
    """S + λ I (+ ε diag S) at a :class:`~distlinalg.operators.ModelPoint` (see :func:`gram`)."""
    return GramOperator(point=point, diag_shift=diag_shift, diag_scale=diag_scale)


@operator_class
class GramOperator(ParameterSpace, ModelOperator):
    """S = ŌᴴŌ/N + diag_shift·I + diag_scale·diag(ŌᴴŌ/N); see :func:`gram`.

    Args:
      point: the :class:`~distlinalg.operators.ModelPoint` (f, params, this
        rank's samples, mode, counts).
      diag_shift: λ, a scalar (Python number or 0-d array, may be traced).
      diag_scale: ε or None (no diagonal term).

    Pytree: the children are ``(point, diag_shift, diag_scale)``, i.e. the
    leaves are params, samples, λ (and ε); the mode, f, every rank's sample
    count, the chunking and the structures are static and compare by value.
    So an operator built outside ``jax.jit`` can be an argument of a jitted
    function (the matvec, ``distlinalg.cg``, ``to_dense`` inside it), one
    with new params, samples or shifts of the same shapes and the same f
    reuses the compilation, and ``jax.grad`` with respect to the operator
    gives an operator of cotangents (``.params``, ``.samples``,
    ``.diag_shift``). Unflattening computes and communicates nothing. A
    product ``S @ v`` evaluates the model; the solvers first call
    :func:`~distlinalg.operators.linearise`, which linearises it once (one
    linearisation per solve, not per iteration).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import distlinalg as dl
      >>> from distlinalg import comm
      >>> from distlinalg.operators import gram
      >>> f = lambda w, x: jnp.tanh(x @ w)
      >>> x = jax.random.normal(jax.random.PRNGKey(comm.rank()), (4, 3))
      >>> solve = jax.jit(lambda S, F: dl.cg(S, F)[0])  # the operator is an argument
      >>> S = gram(f, jnp.array([0.5, -0.3, 0.2]), x, diag_shift=1e-2)
      >>> S
      GramOperator(layout='replicated', symmetric, hermitian)
      >>> delta = solve(S, jnp.ones(3))
      >>> S2 = gram(f, jnp.array([0.1, 0.2, 0.3]), x, diag_shift=1e-2)  # new params: no recompilation
      >>> bool(jnp.allclose(S2 @ solve(S2, jnp.ones(3)), 1.0, atol=1e-4))
      True
    """

    diag_shift: Any = 0.0
    diag_scale: Any = None

    @property
    def real_linear(self) -> bool:
        return self.point.split

    def _matvec(self, v: Any) -> Any:
        eager = eager_product(self, v)
        if eager is not None:
            return eager
        return gram_apply(self.point.jacobian(), v, self.diag_shift, self.diag_scale)

    def _diagonal(self) -> Any:
        return gram_diagonal_with_shifts(self.point.jacobian(), self.diag_shift, self.diag_scale)


def gram_apply(model: Jacobian, v: Any, diag_shift: Any, diag_scale: Any, scale_diagonal: Any = None) -> Any:
    """(S + λ + ε diag S) v, v shaped like params; `scale_diagonal` is diag S when
    already computed (else computed here when ε is given)."""
    u = model.to_space(v)
    if diag_scale is not None and scale_diagonal is None:
        scale_diagonal = gram_diagonal(model)
    return model.from_space(shifted(gram_product(model, u), u, diag_shift, diag_scale, scale_diagonal))


def gram_diagonal_with_shifts(model: Jacobian, diag_shift: Any, diag_scale: Any, squares: Any = None) -> Any:
    """diag(S)(1 + ε) + λ, shaped like params (split complex parameters: d_r + i·d_i)."""
    squares = gram_diagonal(model) if squares is None else squares
    factor = 1 + (0 if diag_scale is None else diag_scale)
    return model.from_space(tree_map(lambda x: factor * x + diag_shift, squares))


@linearise.register
def _linearise_gram(S: GramOperator) -> LinearOperator:
    """The model linearised once; with ε, diag S computed once too."""
    model = S.point.linearise()
    squares = gram_diagonal(model) if S.diag_scale is not None else None
    return function_operator(
        lambda v: gram_apply(model, v, S.diag_shift, S.diag_scale, squares),
        diagonal=lambda: gram_diagonal_with_shifts(model, S.diag_shift, S.diag_scale, squares),
        input_structure=S.point.params_structure, layout=S.layout, symmetric=S.symmetric, hermitian=True,
        real_linear=S.real_linear, comm=S.comm, name=S.name, linearisation=model,
    )
