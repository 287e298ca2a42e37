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
from ._partition import allgather_blocks, exchange_sizes, partition_of_local_sizes

LAYOUTS = ("replicated", "sharded")


def _structure(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), tree)


def _zeros(structure: Any) -> Any:
    return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), structure)


def _conj(tree: Any) -> Any:
    return jax.tree_util.tree_map(jnp.conj, tree)


def _is_complex(structure: Any) -> bool:
    return any(jnp.issubdtype(s.dtype, jnp.complexfloating) for s in jax.tree_util.tree_leaves(structure))


from ..ad.grad import sum_tree_over_ranks as sum_over_ranks  # noqa: E402,F401  (re-exported)


class LinearOperator:
    """A linear map between pytrees of arrays, possibly across MPI ranks.

    Args:
      matvec: ``v -> A v`` on this rank's piece of the vector (whole vectors
        in the replicated layout, this rank's block in the sharded layout).
        Must be linear and traceable; may call distlinalg collectives.
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
        zero-argument callable returning it (computed on first use).
      transpose: ``w -> Aᵀ w`` (unconjugated), if known in closed form;
        otherwise ``.T`` transposes `matvec` with ``jax.linear_transpose``
        (the collectives' transpose rules give the distributed transpose).
      comm: communicator of the matvec (default distlinalg's).
      name: shown in repr and error messages.

    Operators are plain Python objects (not pytrees): build them inside the
    traced function when what they close over is traced; the solvers
    differentiate with respect to everything the matvec closes over.
    """

    def __init__(
        self,
        matvec: Callable[[Any], Any],
        *,
        input_structure: Any = None,
        output_structure: Any = None,
        layout: str = "replicated",
        symmetric: bool = False,
        hermitian: bool = False,
        real_linear: bool = False,
        diagonal: Any = None,
        transpose: Callable[[Any], Any] | None = None,
        comm: Any = None,
        name: str = "LinearOperator",
    ):
        if layout not in LAYOUTS:
            raise ValueError(f"distlinalg.operators: layout must be one of {LAYOUTS}, got {layout!r}")
        if not callable(matvec):
            raise TypeError(f"distlinalg.operators: matvec must be callable, got {type(matvec).__name__}")
        self._matvec = matvec
        self.input_structure = None if input_structure is None else _structure(input_structure)
        self.output_structure = (
            self.input_structure if output_structure is None else _structure(output_structure)
        )
        self.layout = layout
        self.symmetric = bool(symmetric)
        self.hermitian = bool(hermitian)
        self.real_linear = bool(real_linear)
        self._diagonal = diagonal
        self._transpose = transpose
        self.comm = resolve_comm(comm)
        self.name = name

    # -- application -------------------------------------------------------
    def matvec(self, v: Any) -> Any:
        """A v (this rank's piece of the result)."""
        return self._matvec(v)

    def __matmul__(self, v: Any) -> Any:
        return self.matvec(v)

    def __call__(self, v: Any) -> Any:
        return self.matvec(v)

    def __repr__(self) -> str:
        flags = [f for f in ("symmetric", "hermitian", "real_linear") if getattr(self, f)]
        return f"{self.name}(layout={self.layout!r}{''.join(', ' + f for f in flags)})"

    # -- derived operators -------------------------------------------------
    @property
    def T(self) -> "LinearOperator":
        """Aᵀ (unconjugated), as an operator in the same layout."""
        if self._transpose is not None:
            transpose = self._transpose
        elif self.symmetric or (self.hermitian and not _is_complex(self.input_structure) and not self.real_linear):
            return self
        elif self.hermitian and not self.real_linear:

            def transpose(w: Any) -> Any:
                return _conj(self.matvec(_conj(w)))

        else:
            if self.input_structure is None:
                raise ValueError(
                    f"distlinalg.operators: {self.name}.T needs input_structure (or an explicit "
                    "transpose) to transpose the matvec"
                )
            transpose_of = jax.linear_transpose(self.matvec, self.input_structure)

            def transpose(w: Any) -> Any:
                (result,) = transpose_of(w)
                return result

        return LinearOperator(
            transpose,
            input_structure=self.output_structure,
            output_structure=self.input_structure,
            layout=self.layout,
            symmetric=self.symmetric,
            hermitian=self.hermitian,
            real_linear=self.real_linear,
            diagonal=self._diagonal,
            transpose=self.matvec,
            comm=self.comm,
            name=f"{self.name}.T",
        )

    @property
    def H(self) -> "LinearOperator":
        """Aᴴ (conjugate transpose)."""
        if self.hermitian:
            return self
        transposed = self.T

        def adjoint(w: Any) -> Any:
            return _conj(transposed.matvec(_conj(w)))

        return LinearOperator(
            adjoint,
            input_structure=self.output_structure,
            output_structure=self.input_structure,
            layout=self.layout,
            real_linear=self.real_linear,
            comm=self.comm,
            name=f"{self.name}.H",
        )

    # -- structure ---------------------------------------------------------
    def diagonal(self) -> Any:
        """The diagonal, shaped like the vectors (this rank's block when sharded)."""
        if self._diagonal is None:
            raise NotImplementedError(f"distlinalg.operators: {self.name} does not know its diagonal")
        if callable(self._diagonal):
            self._diagonal = self._diagonal()
        return self._diagonal

    def to_dense(self) -> jax.Array:
        """The global matrix, identical on every rank: for small problems and tests.

        Rows and columns follow the flattened vectors (``ravel_pytree``
        order), in the sharded layout rank 0's block first. A real-linear
        operator gives the real matrix acting on ``[Re v; Im v]``. Every rank
        must call it together (sharded layout: it exchanges block sizes and
        gathers the rows).
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
                v = unravel_in((e[:n_in] + 1j * e[n_in:]).astype(flat_in.dtype))
                out, _ = ravel_pytree(self.matvec(v))
                return jnp.concatenate([jnp.real(out), jnp.imag(out)])

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


def gather_rows(rows: jax.Array, comm: Communicator) -> jax.Array:
    """Concatenate every rank's rows (counts may differ) on every rank."""
    return allgather_blocks(rows, partition_of_local_sizes(rows.shape[0], comm), comm)


def aslinearoperator(A: Any, *, layout: str = "replicated", comm: Any = None) -> LinearOperator:
    """A LinearOperator from an operator, a dense replicated matrix, or a callable."""
    if isinstance(A, LinearOperator):
        return A
    if callable(A):
        return LinearOperator(A, layout=layout, comm=comm)
    matrix = jnp.asarray(A)
    if matrix.ndim != 2:
        raise ValueError(f"distlinalg.operators: a dense operator must be a matrix, got shape {matrix.shape}")
    if layout != "replicated":
        raise ValueError("distlinalg.operators: a dense array is replicated; use dense_rows for row blocks")
    return LinearOperator(
        lambda v: matrix @ v,
        input_structure=jax.ShapeDtypeStruct((matrix.shape[1],), matrix.dtype),
        output_structure=jax.ShapeDtypeStruct((matrix.shape[0],), matrix.dtype),
        diagonal=(lambda: jnp.diagonal(matrix)) if matrix.shape[0] == matrix.shape[1] else None,
        transpose=lambda w: matrix.T @ w,
        comm=comm,
        name="DenseOperator",
    )
