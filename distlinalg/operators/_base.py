"""The operator contract: a linear map with its layout, symmetry, diagonal and transpose.

A distributed operator maps this rank's piece of a vector to this rank's
piece of the result. In the *replicated* layout every rank holds whole,
identical vectors; in the *sharded* layout rank r holds block r of a
global vector (the blocks' sizes may differ), and the matvec communicates
as it needs. Vectors are pytrees of arrays.

Every operator is a frozen dataclass declared with :func:`operator_class`
and registered as a pytree once: its array fields are the children (traced
when it is passed to a jitted function, differentiated by ``jax.grad``
with respect to it), the fields made with :func:`static` are the tree
definition, compared by value (so a new operator of the same kind, shapes
and options reuses a compilation). An operator declares (as fields or
properties) ``in_structure``/``out_structure`` (:class:`~distlinalg._trees.Structure`
or None), ``layout``, ``comm`` and the flags ``symmetric``, ``hermitian``,
``real_linear``, and implements ``_matvec(v)``; ``_transpose_matvec(w)``
and ``_diagonal()`` when it knows them in closed form. The rest
(``matvec`` with its output check, ``@``, sums, products, scaling, ``.T``,
``.H``, ``conj()``, ``real_pairs()``, ``to_dense()``) is written here, once.
docs/operators.md has the contract and an example.

An operator whose matvec needs a linearisation (the model operators: Gram,
sample Gram, Hessian, Gauss–Newton) applies the model directly in
``_matvec``; :func:`linearise` turns it into a plain operator over the
linearisation, made once. The solvers call it once, in their own trace.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from .. import _trees
from .._runtime import jax_names
from .._runtime.mpi import Communicator, resolve_comm
from .._trees import Structure
from ..comm._core import MPIEffect
from ..comm.fused import mean_over_ranks
from ._partition import exchange_sizes, gather_rows

LAYOUTS = ("replicated", "sharded")


# -- declaring operators -------------------------------------------------------------
def static(**kwargs: Any) -> Any:
    """A dataclass field that is static data of the pytree (not a child), compared by value.

    Takes :func:`dataclasses.field`'s arguments (``default``,
    ``default_factory``, ...); :func:`operator_class` has a whole operator.

    Example:
      >>> import dataclasses
      >>> from distlinalg.operators import static
      >>> static(default="sharded").metadata["static"]
      True
    """
    metadata = dict(kwargs.pop("metadata", None) or {}, static=True)
    return dataclasses.field(metadata=metadata, **kwargs)


def operator_class(cls: type) -> type:
    """Declare an operator: a frozen, keyword-only dataclass registered as a pytree.

    Fields made with :func:`static` are the tree definition; the others are
    children. Unflattening calls the constructor with the fields, so
    ``__post_init__`` must not compute on children (JAX unflattens with
    tracers, cotangents and placeholder objects alike). docs/operators.md
    has the whole contract.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from distlinalg import operators as ops
      >>> @ops.operator_class
      ... class Scaling(ops.LinearOperator):              # v ↦ d ∘ v, replicated
      ...     d: jax.Array                             # a child
      ...     layout: str = ops.static(default="replicated")
      ...     comm: object = ops.static(default=None)
      ...     symmetric = hermitian = True
      ...     @property
      ...     def in_structure(self):
      ...         return ops.Structure.of(self.d)
      ...     out_structure = in_structure
      ...     def _matvec(self, v):
      ...         return self.d * v
      >>> A = Scaling(d=jnp.array([1.0, 2.0]))
      >>> jax.jit(lambda A, v: A @ v)(A, jnp.ones(2)), jax.tree_util.tree_leaves(A)[0].shape
      (Array([1., 2.], dtype=float32), (2,))
    """
    cls = dataclasses.dataclass(frozen=True, eq=False, kw_only=True, repr=False)(cls)
    return jax.tree_util.register_dataclass(cls)


class _OperatorType(type):
    """``LinearOperator(matvec, ...)``, the constructor of earlier versions, builds
    a :class:`FunctionOperator`; a user's subclass that is not declared with
    :func:`operator_class` keeps that constructor (deprecated)."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is LinearOperator:
            return function_operator(*args, **kwargs)
        if "__dataclass_fields__" not in cls.__dict__:
            return _legacy_subclass(cls, args, kwargs)
        return super().__call__(*args, **kwargs)


class LinearOperator(metaclass=_OperatorType):
    """A linear map between pytrees of arrays, possibly across MPI ranks.

    ``LinearOperator(matvec, ...)`` makes one from a function (a
    :class:`FunctionOperator`).

    Args:
      matvec: ``v -> A v`` on this rank's piece of the vector (whole vectors
        in the replicated layout, this rank's block in the sharded layout).
        Must be linear and traceable; may call distlinalg collectives. With
        `data`, it is called as ``matvec(data, v)``.
      input_structure: the input vector's structure on this rank: a pytree of
        ``jax.ShapeDtypeStruct`` (or of example arrays). Needed by ``.T``
        (when no `transpose` is given) and ``to_dense``.
      output_structure: the output's structure (default: the input's).
      layout: ``"replicated"`` or ``"sharded"``.
      symmetric: Aᵀ = A (real symmetric, or complex symmetric).
      hermitian: Aᴴ = A (what CG and MINRES need).
      real_linear: the map is only real-linear on complex vectors (A(i v) ≠
        i A v, e.g. a non-holomorphic Gram matrix): the solvers then work on
        (real part, imaginary part) pairs, and ``to_dense`` returns the real
        matrix acting on ``[Re v; Im v]``.
      diagonal: the diagonal as a pytree shaped like the vectors, or a
        callable returning it (``diagonal()``, or ``diagonal(data)`` with
        `data`).
      transpose: ``w -> Aᵀ w`` (unconjugated; ``transpose(data, w)`` with
        `data`), if known in closed form. Otherwise ``.T`` transposes `matvec`
        with ``jax.linear_transpose`` (the collectives' transpose rules give
        the whole-program adjoint, docs/ad.md), which is Aᵀ in the sharded
        layout; in the replicated layout, when the matvec communicates, it is
        each rank's share of the adjoint, and ``.T`` averages it over ranks
        (one allreduce per transposed matvec): see :attr:`T`.
      data: the operator's arrays, a pytree (e.g. the matrix entries). They
        are the operator's pytree children: an operator passed to a jitted
        function carries them as traced arguments, and ``jax.grad`` with
        respect to an operator differentiates them.
      comm: communicator of the matvec (default distlinalg's).
      name: shown in repr and error messages.

    Pytree: every operator is one (see the module docstring). For a function
    operator the children are `data` (and a diagonal given as arrays);
    everything else is static. One built from a plain closure (no `data`)
    has no children: what the closure captures is a constant of every
    program it is passed into (build it inside the traced function when it
    should be traced).

    Composition: ``A @ B`` (the product, an operator), ``A @ v`` (the matvec,
    for a vector v: a pytree of arrays), ``A + B``, ``A - B``, ``-A``,
    ``c * A`` (c a scalar, possibly traced: a child of the product), ``A.T``,
    ``A.H``, ``A.conj()``. Operands must share layout and communicator (else
    ValueError).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from distlinalg.operators import LinearOperator
      >>> M = jnp.array([[2.0, 1.0], [0.0, 3.0]])
      >>> A = LinearOperator(lambda M, v: M @ v, data=M, input_structure=jnp.zeros(2),
      ...                    transpose=lambda M, w: M.T @ w)
      >>> A
      LinearOperator(layout='replicated')
      >>> jax.jit(lambda A, v: (2.0 * A + A.T) @ v)(A, jnp.ones(2))  # M is traced
      Array([ 8., 10.], dtype=float32)
    """

    # Declared by every operator, as dataclass fields or properties:
    in_structure: Structure | None
    out_structure: Structure | None
    layout: str
    comm: Communicator
    symmetric: bool = False
    hermitian: bool = False
    real_linear: bool = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """The function constructor, for a subclass not declared with
        :func:`operator_class` (deprecated): ``super().__init__(matvec, ...)``."""
        _install_legacy(self, function_operator(*args, **kwargs))

    # -- what an operator implements ---------------------------------------------
    def _matvec(self, v: Any) -> Any:
        """A v, this rank's piece (no checks: :meth:`matvec` checks)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement _matvec")

    def _transpose_matvec(self, w: Any) -> Any:
        """Aᵀ w in closed form, or NotImplemented (then derived by :meth:`transpose_matvec`)."""
        return NotImplemented

    def _diagonal(self) -> Any:
        raise NotImplementedError(f"distlinalg.operators: {self.name} does not know its diagonal")

    @property
    def has_diagonal(self) -> bool:
        """Whether :meth:`diagonal` is known (in closed form or computed from the operator's data)."""
        function = _legacy_function(self)
        if function is not None:
            return function.has_diagonal
        return type(self)._diagonal is not LinearOperator._diagonal

    @property
    def name(self) -> str:
        """Shown in repr and error messages."""
        function = _legacy_function(self)
        return type(self).__name__ if function is None else function.name

    @property
    def input_structure(self) -> Any:
        """The input vector's structure on this rank: a pytree of ``jax.ShapeDtypeStruct`` (or None)."""
        return None if self.in_structure is None else self.in_structure.tree

    @property
    def output_structure(self) -> Any:
        """The output's structure on this rank (or None)."""
        return None if self.out_structure is None else self.out_structure.tree

    # -- application ---------------------------------------------------------------
    def matvec(self, v: Any) -> Any:
        """A v (this rank's piece of the result); ``A @ v`` and ``A(v)`` call it.

        A vector of the declared input structure must map to the declared
        output structure (a ValueError at trace time otherwise).

        Example:
          >>> import jax.numpy as jnp
          >>> from distlinalg.operators import aslinearoperator
          >>> A = aslinearoperator(jnp.array([[1.0, 2.0], [3.0, 4.0]]))
          >>> A.matvec(jnp.array([1.0, 1.0]))
          Array([3., 7.], dtype=float32)
        """
        out = self._matvec(v)
        expected = self.out_structure
        if expected is not None and self.in_structure is not None and self.in_structure.fits(v):
            if not expected.fits(out):
                # (out_structure defaults to in_structure: a rectangular
                # matvec without it would otherwise fail later, inside JAX.)
                raise ValueError(
                    f"distlinalg.operators: {self.name}'s matvec maps {_trees.describe(v)} to "
                    f"{_trees.describe(out)}, but its output_structure is {expected.describe()}"
                    + ("" if expected != self.in_structure else
                       " (it defaults to input_structure: pass output_structure= for a rectangular operator)")
                )
        return out

    def __call__(self, v: Any) -> Any:
        return self.matvec(v)

    def __matmul__(self, other: Any) -> Any:
        if isinstance(other, LinearOperator):
            return product(self, other)
        return self.matvec(other)

    def __add__(self, other: Any) -> LinearOperator:
        if not isinstance(other, LinearOperator):
            return NotImplemented
        return operator_sum(self, other)

    def __sub__(self, other: Any) -> LinearOperator:
        if not isinstance(other, LinearOperator):
            return NotImplemented
        return operator_sum(self, scaled(-1, other))

    def __neg__(self) -> LinearOperator:
        return scaled(-1, self)

    def __mul__(self, c: Any) -> LinearOperator:
        if isinstance(c, LinearOperator) or jnp.ndim(c) != 0:
            return NotImplemented
        return scaled(c, self)

    __rmul__ = __mul__

    def __repr__(self) -> str:
        flags = [f for f in ("symmetric", "hermitian", "real_linear") if getattr(self, f)]
        return f"{self.name}(layout={self.layout!r}{''.join(', ' + f for f in flags)})"

    # -- derived operators ---------------------------------------------------------
    def _is_own_transpose(self) -> bool:
        return bool(self.symmetric or (self.hermitian and not self.real_linear
                                       and not (self.in_structure is not None and self.in_structure.is_complex)))

    def transpose_matvec(self, w: Any) -> Any:
        """Aᵀ w (unconjugated), this rank's piece; see :attr:`T`.

        Example:
          >>> import jax.numpy as jnp
          >>> from distlinalg.operators import aslinearoperator
          >>> A = aslinearoperator(jnp.array([[1.0, 2.0], [3.0, 4.0]]))
          >>> A.transpose_matvec(jnp.array([1.0, 1.0]))  # the same as A.T @ w
          Array([4., 6.], dtype=float32)
        """
        result = self._transpose_matvec(w)
        if result is not NotImplemented:
            return result
        if self._is_own_transpose():
            return self.matvec(w)
        if self.hermitian and not self.real_linear:
            return _trees.conj(self.matvec(_trees.conj(w)))
        if self.in_structure is None:
            raise ValueError(
                f"distlinalg.operators: {self.name}.T needs input_structure (or an explicit "
                "transpose) to transpose the matvec"
            )
        (result,) = jax.linear_transpose(self.matvec, self.input_structure)(w)
        if self.layout == "replicated" and self.comm.size > 1 and _communicates(self.matvec, self.in_structure):
            # The whole-program adjoint hands rank r its share of Aᵀ (e.g.
            # A_rᵀ Σ_s w_s for y = allreduce(A_r x)); the matrix transpose
            # every rank holds is their mean (docs/ad.md, "replicated
            # operators"). A rank-local matvec already gives Aᵀ w.
            result = mean_over_ranks(result, comm=self.comm)
        return result

    @property
    def T(self) -> LinearOperator:
        """Aᵀ (unconjugated), as an operator in the same layout.

        A closed-form transpose is used when the operator has one; symmetric
        (and real Hermitian) operators are their own transpose. Otherwise
        the matvec is transposed with ``jax.linear_transpose``. Sharded
        layout: that is the block of Aᵀ w this rank owns. Replicated layout,
        matvec that communicates: rank r's result is its share of the
        whole-program adjoint (docs/ad.md), not Aᵀ w; ``.T`` returns its
        mean over ranks, which is Aᵀ w for the matrix A every rank applies
        (one allreduce per matvec of the transpose). AD: differentiable like
        the matvec.

        Example:
          >>> import jax.numpy as jnp
          >>> from distlinalg.operators import LinearOperator
          >>> M = jnp.array([[1.0, 2.0], [3.0, 4.0]])
          >>> A = LinearOperator(lambda v: M @ v, input_structure=jnp.zeros(2))  # no transpose given
          >>> A.T @ jnp.array([1.0, 0.0])               # by jax.linear_transpose
          Array([1., 2.], dtype=float32)
          >>> bool(jnp.allclose(A.T.to_dense(), M.T))
          True
        """
        if self._is_own_transpose():
            return self
        return TransposedOperator(operand=self)

    @property
    def H(self) -> LinearOperator:
        """Aᴴ (conjugate transpose): w ↦ conj(Aᵀ conj(w)); see :attr:`T`.

        Example:
          >>> import jax.numpy as jnp
          >>> from distlinalg.operators import aslinearoperator
          >>> M = jnp.array([[1.0 + 1.0j, 2.0], [0.0, 3.0j]])
          >>> A = aslinearoperator(M)
          >>> bool(jnp.allclose(A.H @ jnp.ones(2), M.conj().T @ jnp.ones(2)))
          True
          >>> bool(jnp.allclose(A.H.to_dense(), M.conj().T))
          True
        """
        if self.hermitian:
            return self
        return AdjointOperator(operand=self)

    def conj(self) -> LinearOperator:
        """The entrywise conjugate Ā: v ↦ conj(A conj(v)).

        Example:
          >>> import jax.numpy as jnp
          >>> from distlinalg.operators import aslinearoperator
          >>> M = jnp.array([[1.0 + 1.0j, 2.0], [0.0, 3.0j]])
          >>> bool(jnp.allclose(aslinearoperator(M).conj().to_dense(), M.conj()))
          True
        """
        return ConjugatedOperator(operand=self)

    def real_pairs(self, like: Any) -> LinearOperator:
        """A real-linear operator on complex vectors shaped like `like`, as the
        real linear operator on their (Re, Im) pairs (what the solvers run on),
        in the same layout and communicator.

        Example:
          >>> import jax.numpy as jnp
          >>> from distlinalg.operators import LinearOperator
          >>> A = LinearOperator(jnp.conj, input_structure=jnp.zeros(2, complex), real_linear=True)
          >>> P = A.real_pairs(jnp.zeros(2, complex))   # (Re v, Im v) ↦ (Re v, −Im v)
          >>> [x.tolist() for x in P @ (jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0]))]
          [[1.0, 2.0], [-3.0, -4.0]]
        """
        return PairedOperator(operand=self, like=Structure.of(like))

    # -- structure -----------------------------------------------------------------
    def diagonal(self) -> Any:
        """The diagonal, shaped like the vectors (this rank's block when sharded).

        Example:
          >>> import jax.numpy as jnp
          >>> from distlinalg.operators import LinearOperator, aslinearoperator
          >>> aslinearoperator(jnp.array([[2.0, 1.0], [1.0, 3.0]])).diagonal()
          Array([2., 3.], dtype=float32)
          >>> d = jnp.array([1.0, 2.0, 3.0])
          >>> LinearOperator(lambda v: d * v, diagonal=d).diagonal()  # or a callable returning it
          Array([1., 2., 3.], dtype=float32)
        """
        return self._diagonal()

    def to_dense(self) -> jax.Array:
        """The global matrix, identical on every rank: for small problems and tests.

        Rows and columns follow the flattened vectors (``ravel_pytree``
        order), in the sharded layout rank 0's block first. A real-linear
        operator gives the real matrix acting on ``[Re v; Im v]``. Every rank
        must call it together (sharded layout: it exchanges block sizes and
        gathers the rows). The operator is linearised first (:func:`linearise`).

        Example:
          >>> import jax.numpy as jnp
          >>> from distlinalg import comm
          >>> from distlinalg.operators import Partition, dense_rows
          >>> M = jnp.arange(16.0).reshape(4, 4)       # the global matrix, on every rank
          >>> p = Partition.even(4, comm.size())
          >>> A = dense_rows(M[p.starts[comm.rank()] : p.starts[comm.rank() + 1]])  # this rank's rows
          >>> bool(jnp.array_equal(A.to_dense(), M))    # the whole matrix, on every rank
          True
        """
        if self.in_structure is None:
            raise ValueError(f"distlinalg.operators: {self.name}.to_dense needs input_structure")
        apply = linearise(self).matvec
        flat_in, unravel_in = ravel_pytree(self.in_structure.zeros())
        if self.real_linear and jnp.iscomplexobj(flat_in):
            basis_dtype = jnp.real(flat_in).dtype

            def column(e: Any) -> Any:
                out, _ = ravel_pytree(apply(unravel_in(_trees.unstack_complex(e, flat_in.dtype))))
                return _trees.stack_complex(out)

            local_in = 2 * flat_in.size
        else:
            basis_dtype = flat_in.dtype

            def column(e: Any) -> Any:
                return ravel_pytree(apply(unravel_in(e)))[0]

            local_in = flat_in.size

        if self.layout == "replicated":
            return jax.vmap(column)(jnp.eye(local_in, dtype=basis_dtype)).T
        sizes = exchange_sizes(local_in, self.comm)
        offset = int(sizes[: self.comm.rank].sum())
        basis = jnp.eye(int(sizes.sum()), dtype=basis_dtype)[:, offset : offset + local_in]
        rows = jax.vmap(column)(basis).T  # (this rank's outputs, total)
        return gather_rows(rows, self.comm)


def _communicates(fn: Callable[[Any], Any], structure: Structure) -> bool:
    """Whether `fn` calls a distlinalg collective (read off its jaxpr at trace time)."""
    effects = jax.make_jaxpr(fn)(structure.zeros()).effects
    return any(isinstance(e, MPIEffect) for e in effects)


# -- linearisation -------------------------------------------------------------------
@functools.singledispatch
def linearise(operator: LinearOperator) -> LinearOperator:
    """The operator with what its matvec derives from its data computed once.

    For operators whose matvec applies a model (the Gram operators, the
    Hessian, the Gauss–Newton matrix) this evaluates the model once,
    ``jax.linearize``-style, in the current trace, and returns a plain
    operator over that linearisation (its products are JVPs and VJPs only);
    for every other operator it is the operator itself, and compositions
    are linearised operand by operand. Idempotent. The solvers call it once
    in their own trace, before their loops; call it yourself before
    applying a model operator many times.

    Args:
      operator: a :class:`LinearOperator`.

    Returns:
      A :class:`LinearOperator` with the same products, layout and flags.
      AD: differentiable with respect to what the operator closes over, like
      the operator; the linearisation belongs to the trace it is made in
      (use it there).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from distlinalg import comm
      >>> from distlinalg.operators import gram, linearise
      >>> f = lambda w, x: jnp.tanh(x @ w)
      >>> x = jax.random.normal(jax.random.PRNGKey(comm.rank()), (4, 3))
      >>> S = gram(f, jnp.array([0.5, -0.3, 0.2]), x, diag_shift=1e-2)
      >>> L = linearise(S)                           # the model evaluated here, once
      >>> bool(jnp.allclose(L @ jnp.ones(3), S @ jnp.ones(3))), linearise(L) is L
      (True, True)
    """
    return operator


@jax.jit
def _linearised_product(operator: LinearOperator, v: Any) -> Any:
    return linearise(operator).matvec(v)


def eager_product(operator: LinearOperator, v: Any) -> Any:
    """A v for a model operator called outside any trace: its linearisation and
    product as one compiled program, cached by the operator's tree definition
    (a repeated eager ``S @ v`` then costs one program run, not the model's
    operations dispatched one by one). None inside a trace: the caller
    applies the model directly there."""
    return _linearised_product(operator, v) if jax_names.at_top_level() else None


# -- an operator from functions --------------------------------------------------------
@operator_class
class FunctionOperator(LinearOperator):
    """An operator made of functions: what ``LinearOperator(matvec, ...)`` returns.

    Its fields (the arguments of the constructor are :class:`LinearOperator`'s):
    `data`, the children, passed to the functions first when `bound`;
    `diagonal_value`, the diagonal as arrays (a child) or None; `fn`,
    `transpose_fn`, `diagonal_fn`, static functions compared by identity;
    `linearisation`, what the functions close over when the operator is the
    result of :func:`linearise` (e.g. the model's Jacobian), else None.

    Example:
      >>> import jax.numpy as jnp
      >>> from distlinalg.operators import FunctionOperator, LinearOperator
      >>> A = LinearOperator(lambda M, v: M @ v, data=jnp.eye(2), input_structure=jnp.zeros(2))
      >>> isinstance(A, FunctionOperator), A.bound, A.data.shape
      (True, True, (2, 2))
    """

    fn: Callable[..., Any] = static()
    data: Any = None
    bound: bool = static(default=False)
    transpose_fn: Callable[..., Any] | None = static(default=None)
    diagonal_fn: Callable[..., Any] | None = static(default=None)
    diagonal_value: Any = None
    in_structure: Structure | None = static(default=None)
    out_structure: Structure | None = static(default=None)
    layout: str = static(default="replicated")
    symmetric: bool = static(default=False)
    hermitian: bool = static(default=False)
    real_linear: bool = static(default=False)
    comm: Communicator = static(default=None)
    label: str = static(default="LinearOperator")
    linearisation: Any = static(default=None)

    @property
    def name(self) -> str:
        return self.label

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(self.data, *args) if self.bound else fn(*args)

    def _matvec(self, v: Any) -> Any:
        return self._call(self.fn, v)

    def _transpose_matvec(self, w: Any) -> Any:
        return NotImplemented if self.transpose_fn is None else self._call(self.transpose_fn, w)

    @property
    def has_diagonal(self) -> bool:
        return self.diagonal_value is not None or self.diagonal_fn is not None

    def _diagonal(self) -> Any:
        if self.diagonal_value is not None:
            return self.diagonal_value
        if self.diagonal_fn is None:
            return LinearOperator._diagonal(self)
        return self._call(self.diagonal_fn)


def function_operator(
    matvec: Callable[..., Any],
    *,
    input_structure: Any = None,
    output_structure: Any = None,
    layout: str = "replicated",
    symmetric: bool = False,
    hermitian: bool = False,
    real_linear: bool = False,
    diagonal: Any = None,
    transpose: Callable[..., Any] | None = None,
    data: Any = None,
    comm: Any = None,
    name: str = "LinearOperator",
    linearisation: Any = None,
) -> FunctionOperator:
    """``LinearOperator(matvec, ...)``: the arguments checked and normalised (see :class:`LinearOperator`)."""
    if layout not in LAYOUTS:
        raise ValueError(f"distlinalg.operators: layout must be one of {LAYOUTS}, got {layout!r}")
    if not callable(matvec):
        raise TypeError(f"distlinalg.operators: matvec must be callable, got {type(matvec).__name__}")
    in_structure = _trees.structure_of(input_structure)
    return FunctionOperator(
        fn=matvec, data=data, bound=data is not None, transpose_fn=transpose,
        diagonal_fn=diagonal if callable(diagonal) else None,
        diagonal_value=None if callable(diagonal) else diagonal,
        in_structure=in_structure,
        out_structure=in_structure if output_structure is None else Structure.of(output_structure),
        layout=layout, symmetric=bool(symmetric), hermitian=bool(hermitian), real_linear=bool(real_linear),
        comm=resolve_comm(comm), label=name, linearisation=linearisation,
    )


# -- a user's subclass in the style of earlier versions (deprecated) --------------------
_LEGACY_FIELDS = ("in_structure", "out_structure", "layout", "comm", "symmetric", "hermitian", "real_linear")
_LEGACY_HOOKS = ("_matvec", "_transpose_matvec", "_diagonal")
_LEGACY_REGISTERED: set[type] = set()


class _LegacyAux:
    """The static part of a legacy subclass's instance: the user's own attributes (by identity)."""

    __slots__ = ("items",)

    def __init__(self, items: dict[str, Any]):
        self.items = items

    def __eq__(self, other: Any) -> bool:
        return (isinstance(other, _LegacyAux) and self.items.keys() == other.items.keys()
                and all(a is b for a, b in zip(self.items.values(), other.items.values())))

    def __hash__(self) -> int:
        return hash(tuple(self.items))


def _legacy_subclass(cls: type, args: tuple, kwargs: dict) -> LinearOperator:
    """An instance of a user's plain subclass of LinearOperator, built with the
    function constructor: it holds a :class:`FunctionOperator` and reads its
    fields and hooks (the user's methods may override them and call super())."""
    if cls not in _LEGACY_REGISTERED:
        warnings.warn(f"distlinalg.operators: {cls.__name__} subclasses LinearOperator without "
                      "@operator_class: declare its fields (docs/operators.md)", DeprecationWarning, stacklevel=3)
        jax.tree_util.register_pytree_node(cls, _legacy_flatten, functools.partial(_legacy_unflatten, cls))
        _LEGACY_REGISTERED.add(cls)
    op = object.__new__(cls)
    op.__init__(*args, **kwargs)  # the subclass's own __init__, or LinearOperator's (the function constructor)
    return op


def _install_legacy(op: Any, function: FunctionOperator) -> None:
    op.__dict__["_function"] = function
    op.__dict__.update({name: getattr(function, name) for name in _LEGACY_FIELDS + _LEGACY_HOOKS})


def _legacy_instance(cls: type, items: dict[str, Any], function: FunctionOperator) -> LinearOperator:
    op = object.__new__(cls)
    op.__dict__.update(items)
    _install_legacy(op, function)
    return op


def _legacy_flatten(op: Any) -> tuple[tuple[Any], _LegacyAux]:
    own = {k: v for k, v in vars(op).items() if k not in ("_function", *_LEGACY_FIELDS, *_LEGACY_HOOKS)}
    return (op.__dict__["_function"],), _LegacyAux(own)


def _legacy_unflatten(cls: type, aux: _LegacyAux, children: tuple[Any]) -> Any:
    return _legacy_instance(cls, aux.items, children[0])


def _legacy_function(op: Any) -> FunctionOperator | None:
    return getattr(op, "__dict__", {}).get("_function")


# -- composition ---------------------------------------------------------------------------
def _check_compatible(a: LinearOperator, b: LinearOperator, what: str) -> None:
    if a.layout != b.layout:
        raise ValueError(f"distlinalg.operators: {what} of operators in different layouts "
                         f"({a.name}: {a.layout!r}, {b.name}: {b.layout!r})")
    if a.comm != b.comm:
        raise ValueError(f"distlinalg.operators: {what} of operators on different communicators "
                         f"({a.name}, {b.name})")
    if a.real_linear != b.real_linear:
        raise ValueError(f"distlinalg.operators: {what} of a real-linear and a complex-linear operator "
                         f"({a.name}, {b.name})")


def _same_structure(x: Structure | None, y: Structure | None) -> bool:
    return x is None or y is None or x == y


@operator_class
class _Unary(LinearOperator):
    """An operator derived from one other (its only child): the same vectors,
    layout, communicator and flags unless it says otherwise."""

    operand: LinearOperator

    @property
    def in_structure(self) -> Structure | None:
        return self.operand.in_structure

    @property
    def out_structure(self) -> Structure | None:
        return self.operand.out_structure

    @property
    def layout(self) -> str:
        return self.operand.layout

    @property
    def comm(self) -> Communicator:
        return self.operand.comm

    @property
    def symmetric(self) -> bool:
        return self.operand.symmetric

    @property
    def hermitian(self) -> bool:
        return self.operand.hermitian

    @property
    def real_linear(self) -> bool:
        return self.operand.real_linear

    @property
    def has_diagonal(self) -> bool:
        return self.operand.has_diagonal


@operator_class
class _Swapped(_Unary):
    """A transpose: input and output exchanged."""

    @property
    def in_structure(self) -> Structure | None:
        return self.operand.out_structure

    @property
    def out_structure(self) -> Structure | None:
        return self.operand.in_structure


@operator_class
class TransposedOperator(_Swapped):
    """Aᵀ (see :attr:`LinearOperator.T`)."""

    @property
    def name(self) -> str:
        return f"{self.operand.name}.T"

    def _matvec(self, v: Any) -> Any:
        return self.operand.transpose_matvec(v)

    def _transpose_matvec(self, w: Any) -> Any:
        return self.operand.matvec(w)

    def _diagonal(self) -> Any:
        return self.operand.diagonal()


@operator_class
class AdjointOperator(_Swapped):
    """Aᴴ (see :attr:`LinearOperator.H`)."""

    @property
    def name(self) -> str:
        return f"{self.operand.name}.H"

    def _matvec(self, w: Any) -> Any:
        return _trees.conj(self.operand.transpose_matvec(_trees.conj(w)))

    def _transpose_matvec(self, v: Any) -> Any:
        return _trees.conj(self.operand.matvec(_trees.conj(v)))

    def _diagonal(self) -> Any:
        return _trees.conj(self.operand.diagonal())


@operator_class
class ConjugatedOperator(_Unary):
    """Ā: v ↦ conj(A conj(v)) (see :meth:`LinearOperator.conj`)."""

    @property
    def name(self) -> str:
        return f"conj({self.operand.name})"

    def _matvec(self, v: Any) -> Any:
        return _trees.conj(self.operand.matvec(_trees.conj(v)))

    def _transpose_matvec(self, w: Any) -> Any:
        return _trees.conj(self.operand.transpose_matvec(_trees.conj(w)))

    def _diagonal(self) -> Any:
        return _trees.conj(self.operand.diagonal())


@operator_class
class PairedOperator(_Unary):
    """A real-linear operator as the real operator on (Re v, Im v) pairs
    (see :meth:`LinearOperator.real_pairs`); `like` is the complex vectors' structure."""

    like: Structure = static()

    @property
    def in_structure(self) -> Structure:
        return Structure.of(jax.eval_shape(_trees.split_complex, self.like.tree))

    @property
    def out_structure(self) -> Structure:
        return self.in_structure

    @property
    def real_linear(self) -> bool:
        return False

    @property
    def has_diagonal(self) -> bool:
        return False

    @property
    def name(self) -> str:
        return f"Paired({self.operand.name})"

    def _matvec(self, pair: Any) -> Any:
        return _trees.split_complex(self.operand.matvec(_trees.join_complex(pair, self.like.tree)))


@operator_class
class ProductOperator(LinearOperator):
    """``A @ B``: v ↦ A (B v). ``(A B)ᵀ = Bᵀ Aᵀ``."""

    left: LinearOperator
    right: LinearOperator

    @property
    def in_structure(self) -> Structure | None:
        return self.right.in_structure

    @property
    def out_structure(self) -> Structure | None:
        return self.left.out_structure

    @property
    def layout(self) -> str:
        return self.left.layout

    @property
    def comm(self) -> Communicator:
        return self.left.comm

    @property
    def real_linear(self) -> bool:
        return self.left.real_linear

    @property
    def name(self) -> str:
        return f"({self.left.name} @ {self.right.name})"

    def _matvec(self, v: Any) -> Any:
        return self.left.matvec(self.right.matvec(v))

    def _transpose_matvec(self, w: Any) -> Any:
        return self.right.transpose_matvec(self.left.transpose_matvec(w))


@operator_class
class SumOperator(LinearOperator):
    """``A + B``; symmetric/Hermitian when both are, diagonal when both know it."""

    left: LinearOperator
    right: LinearOperator

    @property
    def in_structure(self) -> Structure | None:
        return self.left.in_structure if self.left.in_structure is not None else self.right.in_structure

    @property
    def out_structure(self) -> Structure | None:
        return self.left.out_structure if self.left.out_structure is not None else self.right.out_structure

    @property
    def layout(self) -> str:
        return self.left.layout

    @property
    def comm(self) -> Communicator:
        return self.left.comm

    @property
    def symmetric(self) -> bool:
        return self.left.symmetric and self.right.symmetric

    @property
    def hermitian(self) -> bool:
        return self.left.hermitian and self.right.hermitian

    @property
    def real_linear(self) -> bool:
        return self.left.real_linear

    @property
    def has_diagonal(self) -> bool:
        return self.left.has_diagonal and self.right.has_diagonal

    @property
    def name(self) -> str:
        return f"({self.left.name} + {self.right.name})"

    def _matvec(self, v: Any) -> Any:
        return _trees.add(self.left.matvec(v), self.right.matvec(v))

    def _transpose_matvec(self, w: Any) -> Any:
        return _trees.add(self.left.transpose_matvec(w), self.right.transpose_matvec(w))

    def _diagonal(self) -> Any:
        return _trees.add(self.left.diagonal(), self.right.diagonal())


@operator_class
class ScaledOperator(_Unary):
    """``c * A`` for a scalar c (a child: possibly traced, differentiated)."""

    scale: Any

    @property
    def hermitian(self) -> bool:
        return self.operand.hermitian and not jnp.issubdtype(jnp.result_type(self.scale), jnp.complexfloating)

    @property
    def name(self) -> str:
        return f"c * {self.operand.name}"

    def _matvec(self, v: Any) -> Any:
        return _trees.scale(self.scale, self.operand.matvec(v))

    def _transpose_matvec(self, w: Any) -> Any:
        return _trees.scale(self.scale, self.operand.transpose_matvec(w))

    def _diagonal(self) -> Any:
        return _trees.scale(self.scale, self.operand.diagonal())


def product(a: LinearOperator, b: LinearOperator) -> LinearOperator:
    """``A @ B``: v ↦ A (B v), an operator whose children are A and B.

    Same layout and communicator required (ValueError otherwise); B's
    output structure must be A's input structure.
    """
    _check_compatible(a, b, "the product")
    if not _same_structure(b.out_structure, a.in_structure):
        raise ValueError(f"distlinalg.operators: {a.name} @ {b.name}: the output of {b.name} "
                         f"({b.output_structure}) is not the input of {a.name} ({a.input_structure})")
    return ProductOperator(left=a, right=b)


def operator_sum(a: LinearOperator, b: LinearOperator) -> LinearOperator:
    """``A + B`` (same layout, communicator and structures; ValueError otherwise)."""
    _check_compatible(a, b, "the sum")
    if not (_same_structure(a.in_structure, b.in_structure) and _same_structure(a.out_structure, b.out_structure)):
        raise ValueError(f"distlinalg.operators: {a.name} + {b.name}: the operators map different structures")
    return SumOperator(left=a, right=b)


def scaled(c: Any, a: LinearOperator) -> LinearOperator:
    """``c * A`` for a scalar c (a Python number or a 0-d array, possibly
    traced: it is a child of the result, so gradients reach it).

    Symmetry is kept; Hermitian only for a real c.
    """
    if jnp.ndim(c) != 0:
        raise ValueError(f"distlinalg.operators: an operator can be scaled by a scalar only, got shape {jnp.shape(c)}")
    return ScaledOperator(scale=c, operand=a)


@linearise.register
def _linearise_unary(operator: _Unary) -> LinearOperator:
    inner = linearise(operator.operand)
    return operator if inner is operator.operand else dataclasses.replace(operator, operand=inner)


@linearise.register(ProductOperator)
@linearise.register(SumOperator)
def _linearise_binary(operator: Any) -> LinearOperator:
    left, right = linearise(operator.left), linearise(operator.right)
    if left is operator.left and right is operator.right:
        return operator
    return dataclasses.replace(operator, left=left, right=right)
