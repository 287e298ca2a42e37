"""Dense matrices split across ranks by rows or by columns.

Row-partitioned A (rank r holds rows R_r): y_r = A[R_r, :] x needs the
whole x, gathered from its blocks (one allgather). Column-partitioned A
(rank r holds columns C_r): y = Σ_r A[:, C_r] x_r, each rank keeping its
block of the sum (one reduce_scatter). Each is the other's transpose, which
is also what the collectives' transpose rules give for the matvec.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from .._mpi import resolve_comm
from ._base import LinearOperator
from ._partition import (
    allgather_blocks,
    partition_of_local_sizes,
    reduce_scatter_blocks,
    resolve_partition,
)


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
    dtype = rows.dtype

    diagonal = None
    if square and col_partition == row_partition:
        diagonal = functools.partial(_diagonal_of_block, offset=row_partition.starts[comm.rank], rows=True)
    return LinearOperator(
        functools.partial(_rows_matvec, partition=col_partition, comm=comm),
        data=rows,
        input_structure=jax.ShapeDtypeStruct((col_partition.size_of(comm.rank),), dtype),
        output_structure=jax.ShapeDtypeStruct((rows.shape[0],), dtype),
        layout="sharded",
        symmetric=symmetric,
        hermitian=hermitian,
        diagonal=diagonal,
        transpose=functools.partial(_rows_transpose, partition=col_partition, comm=comm),
        comm=comm,
        name="DenseRowsOperator",
    )


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
    dtype = columns.dtype

    diagonal = None
    if square and out_partition == col_partition:
        diagonal = functools.partial(_diagonal_of_block, offset=col_partition.starts[comm.rank], rows=False)
    return LinearOperator(
        functools.partial(_columns_matvec, partition=out_partition, comm=comm),
        data=columns,
        input_structure=jax.ShapeDtypeStruct((columns.shape[1],), dtype),
        output_structure=jax.ShapeDtypeStruct((out_partition.size_of(comm.rank),), dtype),
        layout="sharded",
        symmetric=symmetric,
        hermitian=hermitian,
        diagonal=diagonal,
        transpose=functools.partial(_columns_transpose, partition=out_partition, comm=comm),
        comm=comm,
        name="DenseColumnsOperator",
    )


# The matvecs take the block (the operator's child) first: static functions
# of (block, vector), so an operator passed to a jitted function traces it.
def _rows_matvec(rows: jax.Array, x: Any, *, partition: Any, comm: Any) -> Any:
    return rows @ allgather_blocks(x, partition, comm)


def _rows_transpose(rows: jax.Array, w: Any, *, partition: Any, comm: Any) -> Any:
    return reduce_scatter_blocks(rows.T @ w, partition, comm)


def _columns_matvec(columns: jax.Array, x: Any, *, partition: Any, comm: Any) -> Any:
    return reduce_scatter_blocks(columns @ x, partition, comm)


def _columns_transpose(columns: jax.Array, w: Any, *, partition: Any, comm: Any) -> Any:
    return columns.T @ allgather_blocks(w, partition, comm)
