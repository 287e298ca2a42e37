"""Dense matrices split across ranks by rows or by columns.

Row-partitioned A (rank r holds rows R_r): y_r = A[R_r, :] x needs the
whole x, gathered from its blocks (one allgather). Column-partitioned A
(rank r holds columns C_r): y = Σ_r A[:, C_r] x_r, each rank keeping its
block of the sum (one reduce_scatter). Each is the other's transpose, which
is also what the collectives' transpose rules give for the matvec.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .._runtime.mpi import Communicator, resolve_comm
from .._trees import Structure
from ._base import LinearOperator, operator_class, static
from ._partition import Partition, allgather_blocks, partition_of_local_sizes, reduce_scatter_blocks, resolve_partition


def _local_matrix(block: Any, what: str) -> jax.Array:
    block = jnp.asarray(block)
    if block.ndim != 2:
        raise ValueError(f"distlinalg.operators.{what}: expected this rank's 2-D block, got shape {block.shape}")
    if not jnp.issubdtype(block.dtype, jnp.inexact):
        block = block.astype(jnp.result_type(float))
    return block


def _diagonal_of_block(block: jax.Array, offset: int, rows: bool) -> jax.Array:
    """Entries A[i, i] of a row block starting at row `offset` (or column block)."""
    k = block.shape[0] if rows else block.shape[1]
    index = jnp.arange(k)
    return block[index, index + offset] if rows else block[index + offset, index]


def dense_rows(
    rows: Any,
    *,
    column_partition: Any = None,
    symmetric: bool = False,
    hermitian: bool = False,
    comm: Any = None,
) -> LinearOperator:
    """A dense (M, N) matrix held as row blocks, sharded layout.

    Args:
      rows: this rank's rows of A, shape (m_r, N); the row blocks, rank 0's
        first, stack to A (block sizes may differ between ranks). May be
        traced: the operator is differentiable with respect to its entries.
      column_partition: how the input vector x (length N) is split: one block
        size per rank. Default: the row partition when A is square, else an
        even split (the first N % P ranks one longer).
      symmetric, hermitian: declare Aᵀ = A / Aᴴ = A (not checked).
      comm: communicator (default distlinalg's).

    Returns:
      A sharded LinearOperator: x_r of shape (n_r,) ↦ y_r = A[R_r, :] x of
      shape (m_r,), one allgather of x per matvec. ``.T`` is the
      column-partitioned Aᵀ (one reduce_scatter); ``diagonal()`` for square A.

    Every rank must build it together (the block sizes are exchanged once,
    at trace time). The block is the operator's pytree child: pass the
    operator to a jitted function, or differentiate with respect to it.

    Example:
      >>> import jax.numpy as jnp
      >>> from distlinalg import comm
      >>> from distlinalg.operators import Partition, dense_rows
      >>> M = jnp.arange(36.0).reshape(6, 6)       # the global matrix, on every rank
      >>> p = Partition.even(6, comm.size())
      >>> mine = slice(p.starts[comm.rank()], p.starts[comm.rank() + 1])
      >>> A = dense_rows(M[mine])                   # this rank's rows
      >>> x = jnp.arange(6.0)
      >>> bool(jnp.allclose(A @ x[mine], (M @ x)[mine]))  # this rank's block of M x
      True
      >>> bool(jnp.allclose(A.T @ x[mine], (M.T @ x)[mine]))
      True
    """
    comm = resolve_comm(comm)
    rows = _local_matrix(rows, "dense_rows")
    row_partition = partition_of_local_sizes(rows.shape[0], comm)
    n_total = rows.shape[1]
    square = row_partition.total == n_total
    # Resolved (and compared across ranks) on every rank, also when it is
    # the row partition: `square` depends on this rank's block.
    col_partition = resolve_partition(row_partition if column_partition is None and square else column_partition,
                                      n_total, comm, "column_partition")
    return DenseRowsOperator(rows=rows, row_partition=row_partition, column_partition=col_partition,
                             symmetric=bool(symmetric), hermitian=bool(hermitian), comm=comm)


def dense_columns(
    columns: Any,
    *,
    row_partition: Any = None,
    symmetric: bool = False,
    hermitian: bool = False,
    comm: Any = None,
) -> LinearOperator:
    """A dense (M, N) matrix held as column blocks, sharded layout.

    Args:
      columns: this rank's columns of A, shape (M, n_r); the column blocks,
        rank 0's first, concatenate to A. May be traced.
      row_partition: how the output y (length M) is split; default: the
        column partition when A is square, else an even split.
      symmetric, hermitian, comm: as for :func:`dense_rows`.

    Returns:
      A sharded LinearOperator: x_r (n_r,) ↦ y_r, rank r's block of
      Σ_q A[:, C_q] x_q (one reduce_scatter per matvec). ``.T`` is the
      row-partitioned Aᵀ. The block is the operator's pytree child.

    Example:
      >>> import jax.numpy as jnp
      >>> from distlinalg import comm
      >>> from distlinalg.operators import Partition, dense_columns
      >>> M = jnp.arange(36.0).reshape(6, 6)       # the global matrix, on every rank
      >>> p = Partition.even(6, comm.size())
      >>> mine = slice(p.starts[comm.rank()], p.starts[comm.rank() + 1])
      >>> A = dense_columns(M[:, mine])             # this rank's columns
      >>> x = jnp.arange(6.0)
      >>> bool(jnp.allclose(A @ x[mine], (M @ x)[mine]))  # this rank's block of M x
      True
      >>> A.to_dense().shape
      (6, 6)
    """
    comm = resolve_comm(comm)
    columns = _local_matrix(columns, "dense_columns")
    col_partition = partition_of_local_sizes(columns.shape[1], comm)
    m_total = columns.shape[0]
    square = col_partition.total == m_total
    # Resolved (and compared across ranks) on every rank, also when it is
    # the column partition: `square` depends on this rank's block.
    out_partition = resolve_partition(col_partition if row_partition is None and square else row_partition,
                                      m_total, comm, "row_partition")
    return DenseColumnsOperator(columns=columns, row_partition=out_partition, column_partition=col_partition,
                                symmetric=bool(symmetric), hermitian=bool(hermitian), comm=comm)


# -- the operators ---------------------------------------------------------------------
@operator_class
class DenseOperator(LinearOperator):
    """A dense (M, N) matrix held whole by every rank (replicated layout), applied at
    the highest matmul precision, as jax.scipy's solvers apply matrices; what
    :func:`distlinalg.operators.aslinearoperator` makes of an array.

    Pytree: the matrix is the child.

    Example:
      >>> import jax.numpy as jnp
      >>> from distlinalg.operators import DenseOperator
      >>> A = DenseOperator(matrix=jnp.array([[2.0, 1.0], [1.0, 3.0]]))
      >>> A @ jnp.ones(2), A.T.to_dense().shape
      (Array([3., 4.], dtype=float32), (2, 2))
    """

    matrix: jax.Array
    comm: Communicator = static(default=None)

    layout = "replicated"

    def __post_init__(self) -> None:
        object.__setattr__(self, "comm", resolve_comm(self.comm))

    @property
    def in_structure(self) -> Structure:
        return Structure.of(jax.ShapeDtypeStruct((jnp.shape(self.matrix)[1],), jnp.result_type(self.matrix)))

    @property
    def out_structure(self) -> Structure:
        return Structure.of(jax.ShapeDtypeStruct((jnp.shape(self.matrix)[0],), jnp.result_type(self.matrix)))

    @property
    def has_diagonal(self) -> bool:
        return jnp.shape(self.matrix)[0] == jnp.shape(self.matrix)[1]

    def _matvec(self, v: Any) -> Any:
        return jnp.matmul(self.matrix, v, precision=jax.lax.Precision.HIGHEST)

    def _transpose_matvec(self, w: Any) -> Any:
        return jnp.matmul(self.matrix.T, w, precision=jax.lax.Precision.HIGHEST)

    def _diagonal(self) -> Any:
        return jnp.diagonal(self.matrix)


@operator_class
class _DenseBlocks(LinearOperator):
    """What the row and the column form share: partitions, flags, communicator."""

    row_partition: Partition = static()
    column_partition: Partition = static()
    symmetric: bool = static(default=False)
    hermitian: bool = static(default=False)
    comm: Communicator = static(default=None)

    layout = "sharded"

    @property
    def has_diagonal(self) -> bool:
        return self.row_partition == self.column_partition


@operator_class
class DenseRowsOperator(_DenseBlocks):
    """A dense matrix split across ranks by rows (see :func:`dense_rows`).

    Rank r holds rows R_r; y_r = A[R_r, :] x needs the whole x, gathered from
    its blocks (one allgather). Its transpose is the column form
    (:class:`DenseColumnsOperator`): one reduce_scatter.

    Pytree: the row block is the child; the partitions, flags and
    communicator are static and compared by value.

    Example:
      >>> import jax.numpy as jnp
      >>> from distlinalg import comm
      >>> from distlinalg.operators import DenseRowsOperator, Partition, dense_rows
      >>> p = Partition.even(4, comm.size())
      >>> A = dense_rows(jnp.ones((p.size_of(comm.rank()), 4)))
      >>> isinstance(A, DenseRowsOperator), A.row_partition == p, type(A.T).__name__
      (True, True, 'TransposedOperator')
    """

    rows: jax.Array

    @property
    def in_structure(self) -> Structure:
        dtype = jnp.result_type(self.rows)
        return Structure.of(jax.ShapeDtypeStruct((self.column_partition.size_of(self.comm.rank),), dtype))

    @property
    def out_structure(self) -> Structure:
        dtype = jnp.result_type(self.rows)
        return Structure.of(jax.ShapeDtypeStruct((self.row_partition.size_of(self.comm.rank),), dtype))

    def _matvec(self, x: Any) -> Any:
        return self.rows @ allgather_blocks(x, self.column_partition, self.comm)

    def _transpose_matvec(self, w: Any) -> Any:
        return reduce_scatter_blocks(self.rows.T @ w, self.column_partition, self.comm)

    def _diagonal(self) -> Any:
        return _diagonal_of_block(self.rows, self.row_partition.starts[self.comm.rank], rows=True)


@operator_class
class DenseColumnsOperator(_DenseBlocks):
    """A dense matrix split across ranks by columns (see :func:`dense_columns`):
    the transpose of the row form of Aᵀ, whose rows are these columns.

    Rank r holds columns C_r; y = Σ_r A[:, C_r] x_r, each rank keeping its
    block of the sum (one reduce_scatter). Pytree: the column block is the
    child; the partitions, flags and communicator are static.

    Example:
      >>> import jax.numpy as jnp
      >>> from distlinalg import comm
      >>> from distlinalg.operators import DenseColumnsOperator, Partition, dense_columns
      >>> p = Partition.even(4, comm.size())
      >>> A = dense_columns(2 * jnp.eye(4)[:, p.starts[comm.rank()] : p.starts[comm.rank() + 1]])
      >>> isinstance(A, DenseColumnsOperator), bool(jnp.allclose(A.to_dense(), 2 * jnp.eye(4)))
      (True, True)
    """

    columns: jax.Array

    def _rows_form(self) -> DenseRowsOperator:
        """Aᵀ held by rows: its rows are this operator's columns."""
        return DenseRowsOperator(rows=self.columns.T, row_partition=self.column_partition,
                                 column_partition=self.row_partition, comm=self.comm)

    @property
    def in_structure(self) -> Structure:
        return self._rows_form().out_structure

    @property
    def out_structure(self) -> Structure:
        return self._rows_form().in_structure

    def _matvec(self, x: Any) -> Any:
        return self._rows_form().transpose_matvec(x)

    def _transpose_matvec(self, w: Any) -> Any:
        return self._rows_form().matvec(w)

    def _diagonal(self) -> Any:
        return self._rows_form().diagonal()


# The names of earlier issues and notes.
DenseRows, DenseColumns, Dense = DenseRowsOperator, DenseColumnsOperator, DenseOperator
