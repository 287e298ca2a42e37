"""Row-partitioned sparse matrices with a halo exchange.

Rank r holds rows R_r of A in CSR form and block r of x. A row needs the
entries of x at its column indices; those owned by other ranks (the halo)
are found once, at construction, from the column pattern: each rank tells
every owner which of its entries it needs, and every matvec then moves just
those entries with one alltoall (blocks padded to the largest request, the
alltoallv of a fixed-size collective). The local product runs on the
extended vector z = [x_r; halo], stored by diagonals when the pattern has
few distinct offsets (stencils and banded matrices: a sum of shifted
slices, which XLA fuses into one streaming loop), else in ELLPACK form
(rows padded to the longest row: a gather, a multiply and a row sum) or,
for very uneven rows, as a segment sum. The pattern is static; the values may be
traced and are differentiated like any input.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._mpi import Communicator, resolve_comm
from ..comm.alltoall import alltoall
from ._base import LinearOperator
from ._partition import Partition, partition_of_local_sizes, resolve_partition

_NAME = "distlinalg.operators.sparse_rows"
_MAX_DIAGONALS = 32  # DIA storage beyond this many offsets unrolls too far


def _as_csr(matrix: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[int, int]]:
    """(data, indices, indptr, shape) from a scipy.sparse matrix or CSR pieces."""
    if isinstance(matrix, tuple):
        if len(matrix) != 4:
            raise ValueError(f"{_NAME}: CSR pieces are (data, indices, indptr, shape), got {len(matrix)} items")
        data, indices, indptr, shape = matrix
        return data, np.asarray(indices, np.int64), np.asarray(indptr, np.int64), tuple(int(s) for s in shape)
    try:
        import scipy.sparse as sp
    except ImportError as error:  # pragma: no cover - scipy is a test dependency
        raise ImportError(f"{_NAME}: building from a sparse matrix needs scipy") from error
    if not sp.issparse(matrix):
        raise TypeError(f"{_NAME}: expected a scipy.sparse matrix or (data, indices, indptr, shape), "
                        f"got {type(matrix).__name__}")
    csr = sp.csr_matrix(matrix)
    return csr.data, csr.indices.astype(np.int64), csr.indptr.astype(np.int64), csr.shape


def _exchange_table(row: np.ndarray, comm: Communicator) -> np.ndarray:
    """Every rank's small int vector `row`, stacked (size, len), at trace time."""
    if comm.size == 1:
        return row[None]
    from ..comm.allgather import allgather

    with jax.ensure_compile_time_eval():
        return np.asarray(allgather(jnp.asarray(row, jnp.int64), comm=comm))


def _exchange_requests(requests: np.ndarray, comm: Communicator) -> np.ndarray:
    """alltoall of (size, K) int blocks at trace time: block q of the result
    is what rank q asked of this rank."""
    with jax.ensure_compile_time_eval():
        return np.asarray(alltoall(jnp.asarray(requests, jnp.int64), comm=comm))


class HaloPlan(NamedTuple):
    """What one matvec exchanges: static index arrays."""

    send_index: np.ndarray  # (size, K) local indices of x to send to each rank
    send_mask: np.ndarray  # (size, K) which of them are real (not padding)
    width: int  # K; 0 when no rank needs anything from another


def _plan_halo(indices: np.ndarray, columns: Partition, comm: Communicator) -> tuple[HaloPlan, np.ndarray]:
    """The exchange plan and the CSR column indices remapped into z = [x_r; received]."""
    rank = comm.rank
    first, last = columns.starts[rank], columns.starts[rank + 1]
    own = (indices >= first) & (indices < last)
    needed = np.unique(indices[~own])
    owners = columns.owner(needed)
    counts = np.bincount(owners, minlength=comm.size).astype(np.int64)
    width = int(_exchange_table(counts, comm).max()) if comm.size > 1 else 0
    local_cols = np.empty_like(indices)
    local_cols[own] = indices[own] - first
    if width == 0:
        return HaloPlan(np.zeros((comm.size, 0), np.int64), np.zeros((comm.size, 0), bool), 0), local_cols
    requests = np.full((comm.size, width), -1, np.int64)
    slot_of_needed = np.empty(needed.size, np.int64)
    for q in range(comm.size):
        mine = np.flatnonzero(owners == q)
        requests[q, : mine.size] = needed[mine] - columns.starts[q]
        slot_of_needed[mine] = q * width + np.arange(mine.size)
    asked = _exchange_requests(requests, comm)
    n_own = last - first
    local_cols[~own] = n_own + slot_of_needed[np.searchsorted(needed, indices[~own])]
    plan = HaloPlan(np.where(asked >= 0, asked, 0), asked >= 0, width)
    return plan, local_cols


class SparseRowsOperator(LinearOperator):
    """A row-partitioned sparse matrix (see :func:`sparse_rows`)."""

    def __init__(self, *, data: Any, pattern: "_Pattern", symmetric: bool, hermitian: bool, comm: Communicator):
        self.pattern = pattern
        data = jnp.asarray(data)
        if data.shape != (pattern.nnz,):
            raise ValueError(f"{_NAME}: data must have shape ({pattern.nnz},) (this rank's nonzeros in CSR "
                             f"order), got {data.shape}")
        if not jnp.issubdtype(data.dtype, jnp.inexact):
            data = data.astype(jnp.result_type(float))
        self.data = data
        local_values = pattern.local_values(data)
        plan = pattern.plan

        def matvec(x: Any) -> Any:
            x = jnp.asarray(x)
            if plan.width:
                outgoing = jnp.where(plan.send_mask, x[plan.send_index], jnp.zeros((), x.dtype))
                received = alltoall(outgoing, comm=comm)
                z = jnp.concatenate([x, received.reshape(-1)])
            else:
                z = x
            return pattern.local_product(local_values, z)

        dtype = data.dtype
        diagonal = None
        if pattern.diagonal_positions is not None:
            rows_at, data_at = pattern.diagonal_positions

            def diagonal():
                return jnp.zeros(pattern.rows.size_of(comm.rank), dtype).at[rows_at].add(data[data_at])

        super().__init__(
            matvec,
            input_structure=jax.ShapeDtypeStruct((pattern.columns.size_of(comm.rank),), dtype),
            output_structure=jax.ShapeDtypeStruct((pattern.rows.size_of(comm.rank),), dtype),
            layout="sharded",
            symmetric=symmetric,
            hermitian=hermitian,
            diagonal=diagonal,
            comm=comm,
            name="SparseRowsOperator",
        )
        self._flags = (symmetric, hermitian)

    @property
    def local_csr(self) -> tuple[jax.Array, np.ndarray, np.ndarray]:
        """This rank's (data, global column indices, indptr): the order `data` follows."""
        return self.data, self.pattern.indices, self.pattern.indptr

    def with_data(self, data: Any) -> "SparseRowsOperator":
        """The same pattern (no communication to rebuild it) with new values."""
        symmetric, hermitian = self._flags
        return SparseRowsOperator(data=data, pattern=self.pattern, symmetric=symmetric,
                                  hermitian=hermitian, comm=self.comm)


class _Pattern:
    """The static part: partitions, halo plan and the local product's layout."""

    def __init__(self, indices: np.ndarray, indptr: np.ndarray, rows: Partition, columns: Partition,
                 comm: Communicator):
        self.indices, self.indptr = indices, indptr
        self.rows, self.columns = rows, columns
        self.nnz = int(indices.size)
        m = indptr.size - 1
        self.plan, local_cols = _plan_halo(indices, columns, comm)
        lengths = np.diff(indptr)
        width = int(lengths.max()) if m else 0
        self.row_ids = np.repeat(np.arange(m), lengths)
        self.local_cols = local_cols
        self.n_extended = columns.size_of(comm.rank) + self.plan.send_index.size
        # Local storage, the fastest that does not bloat the stored entries:
        # DIA when the (local row, extended column) pattern has few distinct
        # offsets (stencils, banded matrices: shifted slices, no gather),
        # ELLPACK when rows are of similar length (one gather), else a
        # segment sum.
        offsets = np.unique(local_cols - self.row_ids) if self.nnz else np.zeros(0, np.int64)
        if m and 0 < offsets.size <= _MAX_DIAGONALS and offsets.size * m <= 2 * self.nnz + m:
            self.format = "dia"
            self.offsets = offsets
            self.dia_positions = np.full((offsets.size, m), self.nnz, np.int64)  # nnz -> an appended 0
            self.dia_positions[np.searchsorted(offsets, local_cols - self.row_ids), self.row_ids] = np.arange(self.nnz)
            self.pad_before = max(0, -int(offsets.min()))
            self.pad_after = max(0, int(offsets.max()) + m - self.n_extended)
        elif m == 0 or width * m <= 2 * self.nnz + m:
            self.format = "ell"
            slot = np.arange(self.nnz) - indptr[self.row_ids]
            self.ell_positions = np.full((m, width), self.nnz, np.int64)
            self.ell_positions[self.row_ids, slot] = np.arange(self.nnz)
            self.ell_cols = np.zeros((m, width), np.int64)
            self.ell_cols[self.row_ids, slot] = local_cols
        else:
            self.format = "segment"
        square = rows == columns
        if square:
            global_rows = self.row_ids + rows.starts[comm.rank]
            on_diagonal = np.flatnonzero(indices == global_rows)
            self.diagonal_positions = (self.row_ids[on_diagonal], on_diagonal)
        else:
            self.diagonal_positions = None

    def local_values(self, data: jax.Array) -> jax.Array:
        """The stored values in the local format (computed once per operator)."""
        if self.format == "segment":
            return data
        padded = jnp.concatenate([data, jnp.zeros((1,), data.dtype)])
        return padded[self.dia_positions if self.format == "dia" else self.ell_positions]

    def local_product(self, values: jax.Array, z: jax.Array) -> jax.Array:
        """This rank's rows times the extended vector z = [x_r; halo]."""
        m = self.indptr.size - 1
        dtype = jnp.result_type(values, z)
        if m == 0:
            return jnp.zeros((0,), dtype)
        if self.format == "dia":
            z = jnp.pad(z, (self.pad_before, self.pad_after))
            terms = [values[k] * z[self.pad_before + d : self.pad_before + d + m] for k, d in enumerate(self.offsets)]
            return sum(terms[1:], terms[0]).astype(dtype)
        if self.format == "ell":
            return jnp.sum(values * z[self.ell_cols], axis=1)
        return jax.ops.segment_sum(values * z[self.local_cols], self.row_ids, num_segments=m,
                                   indices_are_sorted=True)


def sparse_rows(
    matrix: Any,
    *,
    local: bool = False,
    row_partition: Any = None,
    column_partition: Any = None,
    data: Any = None,
    symmetric: bool = False,
    hermitian: bool = False,
    comm: Any = None,
) -> SparseRowsOperator:
    """A sparse matrix split across ranks by rows, sharded layout.

    Args:
      matrix: a ``scipy.sparse`` matrix or CSR pieces ``(data, indices,
        indptr, shape)``. With ``local=False`` (default) it is the global
        (M, N) matrix, the same on every rank, and rank r keeps rows
        `row_partition[r]`; with ``local=True`` it is this rank's own row
        block (m_r, N), rank 0's rows first.
      local: see `matrix`.
      row_partition: block sizes of the rows, one per rank (global matrix
        only; default an even split, the first M % P ranks one row longer).
        They must add up to M.
      column_partition: block sizes of the input vector x (default: the row
        partition when M = N, else an even split).
      data: values replacing this rank's CSR values (shape (nnz_r,), in the
        order of :attr:`SparseRowsOperator.local_csr`); may be traced, so the
        operator can be differentiated with respect to its entries.
      symmetric, hermitian: declare Aᵀ = A / Aᴴ = A (not checked).
      comm: communicator (default distlinalg's).

    Returns:
      A :class:`SparseRowsOperator` x_r ↦ (A x)_r: one alltoall of the halo
      entries (only those the column pattern needs) per matvec, none on one
      rank or for block-diagonal patterns. ``.T`` transposes the matvec
      (the alltoall's transpose sends the halo cotangents back);
      ``diagonal()`` for square matrices; ``with_data`` reuses the pattern.

    Every rank must build it together: the halo pattern is exchanged once,
    at construction (also inside a jit trace).
    """
    comm = resolve_comm(comm)
    values, indices, indptr, shape = _as_csr(matrix)
    m, n = shape
    if local:
        if row_partition is not None:
            raise ValueError(f"{_NAME}: row_partition is implied by the local blocks; do not pass it with local=True")
        widths = _exchange_table(np.asarray([n], np.int64), comm)[:, 0]
        if np.any(widths != widths[0]):
            raise ValueError(f"{_NAME}: the local row blocks disagree on the number of columns: {widths.tolist()}")
        rows = partition_of_local_sizes(m, comm)
    else:
        rows = resolve_partition(row_partition, m, comm, "row_partition")
        first, last = rows.starts[comm.rank], rows.starts[comm.rank + 1]
        begin, end = int(indptr[first]), int(indptr[last])
        values = values[begin:end]
        indices = indices[begin:end]
        indptr = indptr[first : last + 1] - begin
    if indices.size and (indices.min() < 0 or indices.max() >= n):
        raise ValueError(f"{_NAME}: column indices must lie in [0, {n}), got [{indices.min()}, {indices.max()}]")
    if column_partition is None and rows.total == n:
        columns = rows
    else:
        columns = resolve_partition(column_partition, n, comm, "column_partition")
    pattern = _Pattern(indices, indptr, rows, columns, comm)
    return SparseRowsOperator(
        data=values if data is None else data, pattern=pattern, symmetric=symmetric, hermitian=hermitian, comm=comm
    )
