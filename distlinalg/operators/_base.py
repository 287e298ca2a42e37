"""LinearOperator: a matvec with its layout, symmetry, diagonal and transpose.

A distributed operator maps this rank's piece of a vector to this rank's
piece of the result. In the *replicated* layout every rank holds whole,
identical vectors; in the *sharded* layout rank r holds block r of a
global vector (the blocks' sizes may differ), and the matvec communicates
as it needs. Vectors are pytrees of arrays.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from .._mpi import Communicator, resolve_comm
from ..comm.fused import tree_allreduce
from ._pairs import stack_complex, unstack_complex
from ._partition import allgather_blocks, exchange_sizes, partition_of_local_sizes

LAYOUTS = ("replicated", "sharded")


def _structure(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), tree)


def _zeros(structure: Any) -> Any:
    return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), structure)


def _conj(tree: Any) -> Any:
    return jax.tree_util.tree_map(jnp.conj, tree)


def _shapes(tree: Any) -> tuple[Any, tuple[tuple[int, ...], ...]] | None:
    """A vector's tree structure and leaf shapes (None for no structure)."""
    if tree is None:
        return None
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple(tuple(jnp.shape(leaf)) for leaf in leaves)


def _describe(tree: Any) -> str:
    leaves = jax.tree_util.tree_leaves(tree)
    shapes = ", ".join(f"{jnp.result_type(leaf)}{list(jnp.shape(leaf))}" for leaf in leaves)
    return shapes if len(leaves) == 1 else f"{jax.tree_util.tree_structure(tree)} of ({shapes})"


def _is_complex(structure: Any) -> bool:
    return any(jnp.issubdtype(s.dtype, jnp.complexfloating) for s in jax.tree_util.tree_leaves(structure))


def _is_traced(tree: Any) -> bool:
    return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(tree))


def _communicates(fn: Callable[[Any], Any], structure: Any) -> bool:
    """Whether `fn` calls a distlinalg collective (read off its jaxpr at trace time)."""
    from ..comm._core import MPIEffect

    effects = jax.make_jaxpr(fn)(_zeros(structure)).effects
    return any(isinstance(e, MPIEffect) for e in effects)


class _Static:
    """The static part of an operator (pytree aux data): its attributes by name.

    jit compares the aux data of its arguments to decide whether it may reuse
    a compilation. Functions compare by identity (two flattenings of the same
    operator, or of copies made by unflattening, hold the very same function
    objects; a closure is never compared by what it captured); values
    (numbers, strings, dtypes, communicators, and the vector structures: pytrees
    of ``ShapeDtypeStruct``) by value, so an operator rebuilt with the same
    functions and new arrays of the same shapes reuses the compilation.
    """

    __slots__ = ("items",)

    def __init__(self, items: dict[str, Any]):
        self.items = items

    def _key(self) -> tuple:
        return tuple(self.items)

    def __eq__(self, other: Any) -> bool:
        if not isinstance(other, _Static) or self._key() != other._key():
            return False
        return all(_same_static(value, other.items[name]) for name, value in self.items.items())

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"_Static({sorted(self.items)})"


_STATIC_VALUES = (str, int, float, complex, bool, np.dtype, jax.ShapeDtypeStruct, Communicator)


def _same_static(a: Any, b: Any) -> bool:
    """`a` is `b`, or both are equal values, or equal containers of such."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, _STATIC_VALUES):
        return bool(a == b)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same_static(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_static(a[k], b[k]) for k in a)
    return False


class LinearOperator:
    """A linear map between pytrees of arrays, possibly across MPI ranks.

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
        `data`; computed on first use).
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

    Pytree: operators are pytrees. The children are `data` (and a diagonal
    given as arrays); everything else (the functions, structures, layout,
    flags, communicator, partitions) is static. An operator built from a
    plain closure (no `data`) has no children: what the closure captures is
    a constant of every program it is passed into (build it inside the
    traced function when it should be traced).

    Composition: ``A @ B`` (the product, an operator), ``A @ v`` (the matvec,
    for a vector v: a pytree of arrays), ``A + B``, ``A - B``, ``-A``,
    ``c * A`` (c a scalar, possibly traced: a child of the product), ``A.T``,
    ``A.H``. Operands must share layout and communicator (else ValueError).

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

    # Attributes that are pytree children; subclasses may add their own.
    _children: tuple[str, ...] = ("_data", "_diagonal_value")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        jax.tree_util.register_pytree_node(cls, cls._tree_flatten, cls._tree_unflatten)

    def __init__(
        self,
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
    ):
        if layout not in LAYOUTS:
            raise ValueError(f"distlinalg.operators: layout must be one of {LAYOUTS}, got {layout!r}")
        if not callable(matvec):
            raise TypeError(f"distlinalg.operators: matvec must be callable, got {type(matvec).__name__}")
        self._matvec = matvec
        self._bound = data is not None
        self._data = data
        self.input_structure = None if input_structure is None else _structure(input_structure)
        self.output_structure = (
            self.input_structure if output_structure is None else _structure(output_structure)
        )
        self.layout = layout
        self.symmetric = bool(symmetric)
        self.hermitian = bool(hermitian)
        self.real_linear = bool(real_linear)
        # A diagonal given as arrays is a child; a callable is static (and
        # its value, once computed outside any trace, is cached).
        self._diagonal_fn = diagonal if callable(diagonal) else None
        self._diagonal_value = None if callable(diagonal) else diagonal
        self._transpose = transpose
        self.comm = resolve_comm(comm)
        self.name = name

    # -- pytree --------------------------------------------------------------
    def _tree_flatten(self) -> tuple[tuple[Any, ...], Any]:
        names = type(self)._children
        children = tuple(self.__dict__.get(n) for n in names)
        static = {k: v for k, v in self.__dict__.items() if k not in names}
        return children, _Static(static)

    @classmethod
    def _tree_unflatten(cls, static: _Static, children: tuple[Any, ...]) -> "LinearOperator":
        op = object.__new__(cls)
        op.__dict__.update(static.items)
        op.__dict__.update(zip(cls._children, children))
        return op

    # -- application -------------------------------------------------------
    def matvec(self, v: Any) -> Any:
        """A v (this rank's piece of the result); ``A @ v`` and ``A(v)`` call it.

        Example:
          >>> import jax.numpy as jnp
          >>> from distlinalg.operators import aslinearoperator
          >>> A = aslinearoperator(jnp.array([[1.0, 2.0], [3.0, 4.0]]))
          >>> A.matvec(jnp.array([1.0, 1.0]))
          Array([3., 7.], dtype=float32)
        """
        out = self._matvec(self._data, v) if self._bound else self._matvec(v)
        if self.output_structure is not None and _shapes(v) == _shapes(self.input_structure):
            if _shapes(out) != _shapes(self.output_structure):
                # (output_structure defaults to input_structure: a rectangular
                # matvec without it would otherwise fail later, inside JAX.)
                raise ValueError(
                    f"distlinalg.operators: {self.name}'s matvec maps {_describe(v)} to {_describe(out)}, "
                    f"but its output_structure is {_describe(self.output_structure)}"
                    + ("" if self.output_structure is not self.input_structure else
                       " (it defaults to input_structure: pass output_structure= for a rectangular operator)")
                )
        return out

    def __call__(self, v: Any) -> Any:
        return self.matvec(v)

    def __matmul__(self, other: Any) -> Any:
        if isinstance(other, LinearOperator):
            return product(self, other)
        return self.matvec(other)

    def __add__(self, other: Any) -> "LinearOperator":
        if not isinstance(other, LinearOperator):
            return NotImplemented
        return operator_sum(self, other)

    def __sub__(self, other: Any) -> "LinearOperator":
        if not isinstance(other, LinearOperator):
            return NotImplemented
        return operator_sum(self, scaled(-1, other))

    def __neg__(self) -> "LinearOperator":
        return scaled(-1, self)

    def __mul__(self, c: Any) -> "LinearOperator":
        if isinstance(c, LinearOperator) or jnp.ndim(c) != 0:
            return NotImplemented
        return scaled(c, self)

    __rmul__ = __mul__

    def __repr__(self) -> str:
        flags = [f for f in ("symmetric", "hermitian", "real_linear") if getattr(self, f)]
        return f"{self.name}(layout={self.layout!r}{''.join(', ' + f for f in flags)})"

    # -- derived operators -------------------------------------------------
    def transpose_matvec(self, w: Any) -> Any:
        """Aᵀ w (unconjugated), this rank's piece; see :attr:`T`.

        Example:
          >>> import jax.numpy as jnp
          >>> from distlinalg.operators import aslinearoperator
          >>> A = aslinearoperator(jnp.array([[1.0, 2.0], [3.0, 4.0]]))
          >>> A.transpose_matvec(jnp.array([1.0, 1.0]))  # the same as A.T @ w
          Array([4., 6.], dtype=float32)
        """
        if self._transpose is not None:
            return self._transpose(self._data, w) if self._bound else self._transpose(w)
        if self.symmetric or (self.hermitian and not self.real_linear and not _is_complex(self.input_structure)):
            return self.matvec(w)
        if self.hermitian and not self.real_linear:
            return _conj(self.matvec(_conj(w)))
        if self.output_structure is None or self.input_structure is None:
            raise ValueError(
                f"distlinalg.operators: {self.name}.T needs input_structure (or an explicit "
                "transpose) to transpose the matvec"
            )
        (result,) = jax.linear_transpose(self.matvec, self.input_structure)(w)
        if self.layout == "replicated" and self.comm.size > 1 and _communicates(self.matvec, self.input_structure):
            # The whole-program adjoint hands rank r its share of Aᵀ (e.g.
            # A_rᵀ Σ_s w_s for y = allreduce(A_r x)); the matrix transpose
            # every rank holds is their mean (docs/ad.md, "replicated
            # operators"). A rank-local matvec already gives Aᵀ w.
            result = jax.tree_util.tree_map(lambda t: t / self.comm.size, tree_allreduce(result, comm=self.comm))
        return result

    @property
    def T(self) -> "LinearOperator":
        """Aᵀ (unconjugated), as an operator in the same layout.

        A closed-form `transpose` is used when given; symmetric (and real
        Hermitian) operators are their own transpose. Otherwise the matvec is
        transposed with ``jax.linear_transpose``. Sharded layout: that is
        the block of Aᵀ w this rank owns. Replicated layout, matvec that
        communicates: rank r's result is its share of the whole-program
        adjoint (docs/ad.md), not Aᵀ w; ``.T`` returns its mean over ranks,
        which is Aᵀ w for the matrix A every rank applies (one allreduce per
        matvec of the transpose). AD: differentiable like the matvec.

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
        if self.symmetric or (self.hermitian and not self.real_linear and not _is_complex(self.input_structure)):
            return self
        return LinearOperator(
            _transposed_matvec,
            data=self,
            transpose=_plain_matvec,
            input_structure=self.output_structure,
            output_structure=self.input_structure,
            layout=self.layout,
            symmetric=self.symmetric,
            hermitian=self.hermitian,
            real_linear=self.real_linear,
            diagonal=_operand_diagonal if self._has_diagonal() else None,
            comm=self.comm,
            name=f"{self.name}.T",
        )

    @property
    def H(self) -> "LinearOperator":
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
        return LinearOperator(
            _adjoint_matvec,
            data=self,
            transpose=_conjugated_matvec,
            input_structure=self.output_structure,
            output_structure=self.input_structure,
            layout=self.layout,
            real_linear=self.real_linear,
            diagonal=_conjugated_diagonal if self._has_diagonal() else None,
            comm=self.comm,
            name=f"{self.name}.H",
        )

    # -- structure ---------------------------------------------------------
    def _has_diagonal(self) -> bool:
        return self._diagonal_fn is not None or self._diagonal_value is not None

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
        if self._diagonal_value is not None:
            return self._diagonal_value
        if self._diagonal_fn is None:
            raise NotImplementedError(f"distlinalg.operators: {self.name} does not know its diagonal")
        value = self._diagonal_fn(self._data) if self._bound else self._diagonal_fn()
        if not self._bound and not _is_traced(value):
            # Cached only when concrete (a traced value must not outlive its
            # trace) and not computed from children (which may be replaced).
            self._diagonal_value = value
        return value

    def to_dense(self) -> jax.Array:
        """The global matrix, identical on every rank: for small problems and tests.

        Rows and columns follow the flattened vectors (``ravel_pytree``
        order), in the sharded layout rank 0's block first. A real-linear
        operator gives the real matrix acting on ``[Re v; Im v]``. Every rank
        must call it together (sharded layout: it exchanges block sizes and
        gathers the rows).

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
        if self.input_structure is None:
            raise ValueError(f"distlinalg.operators: {self.name}.to_dense needs input_structure")
        example_in = _zeros(self.input_structure)
        flat_in, unravel_in = ravel_pytree(example_in)
        real_pairs = self.real_linear and jnp.iscomplexobj(flat_in)
        if real_pairs:
            n_in = flat_in.size
            basis_dtype = jnp.real(flat_in).dtype

            def column(e: Any) -> Any:
                out, _ = ravel_pytree(self.matvec(unravel_in(unstack_complex(e, flat_in.dtype))))
                return stack_complex(out)

            local_in = 2 * n_in
        else:
            basis_dtype = flat_in.dtype

            def column(e: Any) -> Any:
                out, _ = ravel_pytree(self.matvec(unravel_in(e)))
                return out

            local_in = flat_in.size

        if self.layout == "replicated":
            return jax.vmap(column)(jnp.eye(local_in, dtype=basis_dtype)).T
        sizes = exchange_sizes(local_in, self.comm)
        offset = int(sizes[: self.comm.rank].sum())
        total = int(sizes.sum())
        basis = jnp.eye(total, dtype=basis_dtype)[:, offset : offset + local_in]
        rows = jax.vmap(column)(basis).T  # (this rank's outputs, total)
        return gather_rows(rows, self.comm)




# -- the functions of derived operators (module level: they are static data) --
def _transposed_matvec(op: LinearOperator, w: Any) -> Any:
    return op.transpose_matvec(w)


def _plain_matvec(op: LinearOperator, v: Any) -> Any:
    return op.matvec(v)


def _adjoint_matvec(op: LinearOperator, w: Any) -> Any:
    return _conj(op.transpose_matvec(_conj(w)))


def _conjugated_matvec(op: LinearOperator, v: Any) -> Any:
    return _conj(op.matvec(_conj(v)))


def _operand_diagonal(op: LinearOperator) -> Any:
    return op.diagonal()


def _conjugated_diagonal(op: LinearOperator) -> Any:
    return _conj(op.diagonal())


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


def _same_structure(x: Any, y: Any) -> bool:
    if x is None or y is None:
        return True
    return jax.tree_util.tree_structure(x) == jax.tree_util.tree_structure(y) and all(
        (a.shape, a.dtype) == (b.shape, b.dtype) for a, b in zip(jax.tree_util.tree_leaves(x),
                                                                 jax.tree_util.tree_leaves(y)))


def product(a: LinearOperator, b: LinearOperator) -> LinearOperator:
    """``A @ B``: v ↦ A (B v), an operator whose children are A's and B's.

    Same layout and communicator required (ValueError otherwise); B's
    output structure must be A's input structure. ``(A B)ᵀ = Bᵀ Aᵀ``.
    """
    _check_compatible(a, b, "the product")
    if not _same_structure(b.output_structure, a.input_structure):
        raise ValueError(f"distlinalg.operators: {a.name} @ {b.name}: the output of {b.name} "
                         f"({b.output_structure}) is not the input of {a.name} ({a.input_structure})")
    return LinearOperator(
        _product_matvec,
        data=(a, b),
        transpose=_product_transpose,
        input_structure=b.input_structure,
        output_structure=a.output_structure,
        layout=a.layout,
        real_linear=a.real_linear,
        comm=a.comm,
        name=f"({a.name} @ {b.name})",
    )


def _product_matvec(ops: tuple, v: Any) -> Any:
    return ops[0].matvec(ops[1].matvec(v))


def _product_transpose(ops: tuple, w: Any) -> Any:
    return ops[1].transpose_matvec(ops[0].transpose_matvec(w))


def operator_sum(a: LinearOperator, b: LinearOperator) -> LinearOperator:
    """``A + B``; symmetric/Hermitian when both are, diagonal when both know it."""
    _check_compatible(a, b, "the sum")
    if not (_same_structure(a.input_structure, b.input_structure)
            and _same_structure(a.output_structure, b.output_structure)):
        raise ValueError(f"distlinalg.operators: {a.name} + {b.name}: the operators map different structures")
    return LinearOperator(
        _sum_matvec,
        data=(a, b),
        transpose=_sum_transpose,
        input_structure=a.input_structure if a.input_structure is not None else b.input_structure,
        output_structure=a.output_structure if a.output_structure is not None else b.output_structure,
        layout=a.layout,
        symmetric=a.symmetric and b.symmetric,
        hermitian=a.hermitian and b.hermitian,
        real_linear=a.real_linear,
        diagonal=_sum_diagonal if a._has_diagonal() and b._has_diagonal() else None,
        comm=a.comm,
        name=f"({a.name} + {b.name})",
    )


def _sum_matvec(ops: tuple, v: Any) -> Any:
    return jax.tree_util.tree_map(jnp.add, ops[0].matvec(v), ops[1].matvec(v))


def _sum_transpose(ops: tuple, w: Any) -> Any:
    return jax.tree_util.tree_map(jnp.add, ops[0].transpose_matvec(w), ops[1].transpose_matvec(w))


def _sum_diagonal(ops: tuple) -> Any:
    return jax.tree_util.tree_map(jnp.add, ops[0].diagonal(), ops[1].diagonal())


def scaled(c: Any, a: LinearOperator) -> LinearOperator:
    """``c * A`` for a scalar c (a Python number or a 0-d array, possibly
    traced: it is a child of the result, so gradients reach it).

    Symmetry is kept; Hermitian only for a real c.
    """
    if jnp.ndim(c) != 0:
        raise ValueError(f"distlinalg.operators: an operator can be scaled by a scalar only, got shape {jnp.shape(c)}")
    real = not jnp.issubdtype(jnp.result_type(c), jnp.complexfloating)
    return LinearOperator(
        _scaled_matvec,
        data=(c, a),
        transpose=_scaled_transpose,
        input_structure=a.input_structure,
        output_structure=a.output_structure,
        layout=a.layout,
        symmetric=a.symmetric,
        hermitian=a.hermitian and real,
        real_linear=a.real_linear,
        diagonal=_scaled_diagonal if a._has_diagonal() else None,
        comm=a.comm,
        name=f"c * {a.name}",
    )


def _scale_tree(c: Any, tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda x: (c * x).astype(jnp.result_type(x, c)), tree)


def _scaled_matvec(data: tuple, v: Any) -> Any:
    c, a = data
    return _scale_tree(c, a.matvec(v))


def _scaled_transpose(data: tuple, w: Any) -> Any:
    c, a = data
    return _scale_tree(c, a.transpose_matvec(w))


def _scaled_diagonal(data: tuple) -> Any:
    c, a = data
    return _scale_tree(c, a.diagonal())


jax.tree_util.register_pytree_node(LinearOperator, LinearOperator._tree_flatten, LinearOperator._tree_unflatten)


def gather_rows(rows: jax.Array, comm: Communicator) -> jax.Array:
    """Concatenate every rank's rows (counts may differ) on every rank."""
    return allgather_blocks(rows, partition_of_local_sizes(rows.shape[0], comm), comm)


def aslinearoperator(A: Any, *, layout: str = "replicated", comm: Any = None) -> LinearOperator:
    """A LinearOperator from an operator, a callable, a dense replicated matrix,
    or any object with ``__matmul__``.

    * a LinearOperator: returned as it is (it keeps its own layout);
    * a callable ``v -> A v``: an operator with that matvec in `layout`, with
      no children (what it closes over is a constant of the programs the
      operator is passed into);
    * a NumPy or JAX (M, N) matrix: a replicated operator whose child is the
      matrix (traced when the operator is passed to a jitted function), with
      its diagonal and transpose, applied at the highest matmul precision (as
      jax.scipy's solvers apply matrices);
    * another object with ``__matmul__`` (a SciPy sparse matrix, a lineax
      operator wrapper, ...): ``v -> A @ v`` in `layout`.

    Args:
      A: what to wrap (see above).
      layout: ``"replicated"`` or ``"sharded"`` for callables and ``__matmul__``
        objects; a dense array is replicated (a ValueError otherwise: a matrix
        split by rows is :func:`distlinalg.operators.dense_rows`).
      comm: mpi4py communicator (default distlinalg's).

    Returns:
      A :class:`LinearOperator`; anything else is a TypeError.

    AD: a dense operator is differentiable with respect to its matrix; a
    callable with respect to what it closes over when it is called inside the
    differentiated function.

    Example:
      >>> import jax.numpy as jnp
      >>> from distlinalg.operators import aslinearoperator
      >>> A = aslinearoperator(jnp.array([[2.0, 1.0], [1.0, 3.0]]))
      >>> A @ jnp.ones(2)
      Array([3., 4.], dtype=float32)
      >>> A.diagonal()
      Array([2., 3.], dtype=float32)
    """
    if isinstance(A, LinearOperator):
        return A
    if layout not in LAYOUTS:
        raise ValueError(f"distlinalg.operators: layout must be one of {LAYOUTS}, got {layout!r}")
    if callable(A):
        return LinearOperator(A, layout=layout, comm=comm)
    if isinstance(A, (np.ndarray, jax.Array)):
        matrix = jnp.asarray(A)
        if matrix.ndim != 2:
            raise ValueError(f"distlinalg.operators: a dense operator must be a matrix, got shape {matrix.shape}")
        if layout != "replicated":
            raise ValueError("distlinalg.operators: a dense array is replicated; use dense_rows for row blocks")
        return LinearOperator(
            _dense_matvec,
            data=matrix,
            input_structure=jax.ShapeDtypeStruct((matrix.shape[1],), matrix.dtype),
            output_structure=jax.ShapeDtypeStruct((matrix.shape[0],), matrix.dtype),
            diagonal=jnp.diagonal if matrix.shape[0] == matrix.shape[1] else None,
            transpose=_dense_transpose,
            comm=comm,
            name="DenseOperator",
        )
    if hasattr(A, "__matmul__"):
        return LinearOperator(lambda v: A @ v, layout=layout, comm=comm, name=f"MatmulOperator({type(A).__name__})")
    raise TypeError(f"distlinalg.operators: cannot make a linear operator of {A!r}: pass a LinearOperator, "
                    "a callable, a 2-D array or an object with __matmul__")


def _dense_matvec(matrix: jax.Array, v: Any) -> Any:
    return jnp.matmul(matrix, v, precision=jax.lax.Precision.HIGHEST)


def _dense_transpose(matrix: jax.Array, w: Any) -> Any:
    return jnp.matmul(matrix.T, w, precision=jax.lax.Precision.HIGHEST)
