"""Row-partitioned sparse matrices with a halo exchange.

Rank r holds rows R_r of A in CSR form and block r of x. A row needs the
entries of x at its column indices; those owned by other ranks (the halo)
are found once, at construction, from the column pattern: each rank tells
every owner which of its entries it needs, and every matvec then moves just
those entries, in one of two ways (``halo=``):

* ``"blocking"`` (default): one alltoall (blocks padded to the largest
  request, the alltoallv of a fixed-size collective), then the product.
  Derivatives of every order.
* ``"overlapped"``: one isend/irecv per neighbour, exactly the entries it
  needs, while the own-column product (the bulk) is computed
  (comm.overlap); the halo product follows. Derivatives of first order.

The local product is split in two, so that the bulk never touches the halo:

* the *own block* (the columns this rank owns) times x_r, stored by
  diagonals when it has few distinct offsets (stencils and banded
  matrices: x_r padded by the widest offset, then a sum of shifted slices
  that XLA fuses into one streaming loop), else in ELLPACK form (rows
  padded to the longest row: a gather, a multiply and a row sum) or, for
  very uneven rows, as a segment sum;
* the *halo block* (the other columns) times the received entries,
  restricted to the rows that have any (for a stencil, the grid rows next
  to the block boundaries), stored the same way and added into those rows
  in place.

Why split: in one combined column space [x_r; received] a halo entry lies
~len(x_r) columns right of its row, a diagonal that is zero almost
everywhere. Stored by diagonals, every matvec then built that vector (a
copy of x_r), padded it to up to twice its length (another copy) and
streamed the empty diagonals, far slower than the split product
(benchmarks/README.md, "Sparse row blocks"). The pattern is static; the values may be traced and are differentiated like
any input.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._runtime.mpi import Communicator, resolve_comm
from ..comm.alltoall import alltoall
from ..comm.nonblocking_p2p import irecv, isend
from ..comm.overlap import overlap
from .._trees import Structure
from ._base import LinearOperator, operator_class, static
from ._partition import Partition, exchange_rows, exchange_sizes, partition_of_local_sizes, resolve_halo_mode, resolve_partition

_NAME = "distlinalg.operators.sparse_rows"
_MAX_DIAGONALS = 32  # DIA storage beyond this many offsets unrolls too far
_HALO_TAG = 3


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


def _exchange_requests(requests: np.ndarray, comm: Communicator) -> np.ndarray:
    """alltoall of (size, K) int blocks at trace time: block q of the result
    is what rank q asked of this rank. The int64 entries travel as pairs of
    int32 words (exact whether or not JAX has x64 enabled)."""
    requests = np.ascontiguousarray(requests, np.int64)
    with jax.ensure_compile_time_eval():
        words = np.asarray(alltoall(jnp.asarray(requests.view(np.int32)), comm=comm), np.int32)
    return np.ascontiguousarray(words).view(np.int64).reshape(requests.shape)


class HaloPlan(NamedTuple):
    """What one matvec exchanges: static index arrays."""

    send_index: np.ndarray  # (size, K) local indices of x to send to each rank
    send_mask: np.ndarray  # (size, K) which of them are real (not padding), a prefix of each row
    width: int  # K; 0 when no rank needs anything from another
    recv_counts: np.ndarray  # (size,) entries this rank receives from each rank (≤ K)

    def send_count(self, q: int) -> int:
        return int(self.send_mask[q].sum())


def _plan_halo(indices: np.ndarray, columns: Partition,
               comm: Communicator) -> tuple[HaloPlan, np.ndarray, np.ndarray]:
    """The exchange plan and where each stored entry finds its x value.

    Args:
      indices: (nnz,) global column indices of this rank's entries.

    Returns:
      (plan, own, local_cols): `own` (nnz,) bool marks the entries whose
      column this rank owns; `local_cols` (nnz,) is, for those, the index
      into x_r, and for the others the index into the flattened (size·K,)
      received buffer (block q, slot i at q·K + i).
    """
    rank = comm.rank
    first, last = columns.starts[rank], columns.starts[rank + 1]
    own = (indices >= first) & (indices < last)
    needed = np.unique(indices[~own])
    owners = columns.owner(needed)
    counts = np.bincount(owners, minlength=comm.size).astype(np.int64)
    width = int(exchange_rows(counts, comm).max()) if comm.size > 1 else 0
    local_cols = np.empty_like(indices)
    local_cols[own] = indices[own] - first
    if width == 0:
        empty = HaloPlan(np.zeros((comm.size, 0), np.int64), np.zeros((comm.size, 0), bool), 0, counts)
        return empty, own, local_cols
    requests = np.full((comm.size, width), -1, np.int64)
    slot_of_needed = np.empty(needed.size, np.int64)
    for q in range(comm.size):
        mine = np.flatnonzero(owners == q)
        requests[q, : mine.size] = needed[mine] - columns.starts[q]
        slot_of_needed[mine] = q * width + np.arange(mine.size)
    asked = _exchange_requests(requests, comm)
    local_cols[~own] = slot_of_needed[np.searchsorted(needed, indices[~own])]
    plan = HaloPlan(np.where(asked >= 0, asked, 0), asked >= 0, width, counts)
    return plan, own, local_cols


def _storage_format(m: int, nnz: int, n_offsets: int, width: int) -> str:
    """The fastest storage of m rows and nnz entries that stores at most
    about twice the entries: DIA (n_offsets distinct column − row offsets),
    else ELLPACK (rows padded to the longest, `width`), else a segment sum."""
    if m and 0 < n_offsets <= _MAX_DIAGONALS and n_offsets * m <= 2 * nnz + m:
        return "dia"
    if m == 0 or width * m <= 2 * nnz + m:
        return "ell"
    return "segment"


class _Block:
    """Some of this rank's entries times one input vector, in one storage format.

    The block's rows are 0..m-1 and its columns index an input vector of
    length `n_in`. `format` (see :func:`_storage_format`):

    * ``"dia"``: few distinct offsets column − row (stencils, banded
      matrices): values (D, m), row k on the diagonal `offsets[k]`; a sum
      of shifted slices of the input, no gather.
    * ``"ell"``: rows of similar length: values and `ell_cols` (m, W), W the
      longest row; one gather, a multiply and a row sum.
    * ``"segment"``: very uneven rows: values (k,); a gather, a multiply
      and a sorted segment sum.

    `storage` holds, in that layout, the positions of the values in the
    rank's `data`; padding points at a zero appended to `data`.
    """

    def __init__(self, rows: np.ndarray, cols: np.ndarray, positions: np.ndarray, m: int, n_in: int, nnz_data: int):
        """rows, cols, positions: (k,) ints in CSR order (sorted by row);
        positions index `data`, of length nnz_data."""
        self.m, self.n_in, self.nnz = m, n_in, int(rows.size)
        self.rows, self.cols = rows, cols
        lengths = np.bincount(rows, minlength=m)
        offsets = np.unique(cols - rows)
        self.format = _storage_format(m, self.nnz, offsets.size, int(lengths.max()) if m else 0)
        if self.format == "dia":
            self._lay_out_dia(offsets, positions, nnz_data)
        elif self.format == "ell":
            self._lay_out_ell(lengths, positions, nnz_data)
        else:
            self.storage = positions

    def _lay_out_dia(self, offsets: np.ndarray, positions: np.ndarray, nnz_data: int) -> None:
        self.offsets = offsets
        self.storage = np.full((offsets.size, self.m), nnz_data, np.int64)
        self.storage[np.searchsorted(offsets, self.cols - self.rows), self.rows] = positions
        # The input is padded so that every diagonal is one in-bounds slice.
        self.pad_before = max(0, -int(offsets.min()))
        self.pad_after = max(0, int(offsets.max()) + self.m - self.n_in)

    def _lay_out_ell(self, lengths: np.ndarray, positions: np.ndarray, nnz_data: int) -> None:
        width = int(lengths.max()) if self.m else 0
        row_starts = np.cumsum(lengths) - lengths
        slot = np.arange(self.nnz) - row_starts[self.rows]
        self.storage = np.full((self.m, width), nnz_data, np.int64)
        self.storage[self.rows, slot] = positions
        self.ell_cols = np.zeros((self.m, width), np.int64)
        self.ell_cols[self.rows, slot] = self.cols

    def values(self, padded_data: jax.Array) -> jax.Array:
        """The stored values in this block's layout, from `data` with one zero
        appended, (nnz_data + 1,)."""
        return padded_data[self.storage]

    def product(self, values: jax.Array, v: jax.Array) -> jax.Array:
        """(m,): the block times v (n_in,), in the dtype of values·v."""
        dtype = jnp.result_type(values, v)
        if self.m == 0:
            return jnp.zeros((0,), dtype)
        if self.format == "dia":
            # One padded copy of v, then plain slices: XLA vectorises this sum
            # better than one of slices each padded to length m
            # (benchmarks/README.md, "Sparse row blocks").
            v = jnp.pad(v, (self.pad_before, self.pad_after))
            start = self.pad_before
            terms = [values[k] * v[start + d : start + d + self.m] for k, d in enumerate(self.offsets)]
            return sum(terms[1:], terms[0]).astype(dtype)
        if self.format == "ell":
            return jnp.sum(values * v[self.ell_cols], axis=1).astype(dtype)
        return jax.ops.segment_sum(values * v[self.cols], self.rows, num_segments=self.m,
                                   indices_are_sorted=True).astype(dtype)


@operator_class
class SparseRowsOperator(LinearOperator):
    """A row-partitioned sparse matrix (see :func:`sparse_rows`).

    Pytree: the children are this rank's values in CSR order (`data`) and
    their copies laid out for the local product (`laid_out`, made once from
    `data` when the operator is built or by :meth:`with_data`); the pattern
    (partitions, halo plan, storage) is static, compared by identity, and
    the flags and communicator by value. Differentiate with respect to the
    values by building the operator inside the differentiated function
    (``with_data``), or with respect to an operator passed in.

    Example:
      >>> import jax.numpy as jnp, scipy.sparse as sp
      >>> from distlinalg.operators import SparseRowsOperator, sparse_rows
      >>> M = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(8, 8), format="csr")
      >>> A = sparse_rows(M)
      >>> B = A.with_data(3.0 * A.data)             # the same pattern, new values
      >>> isinstance(B, SparseRowsOperator), bool(jnp.allclose(B.to_dense(), 3.0 * M.toarray()))
      (True, True)
    """

    data: Any
    pattern: _Pattern = static()
    symmetric: bool = static(default=False)
    hermitian: bool = static(default=False)
    comm: Communicator = static(default=None)
    laid_out: Any = None

    layout = "sharded"

    def __post_init__(self) -> None:
        if self.laid_out is not None:  # (unflattened: children as they come)
            return
        # Built here: the values checked and laid out for the product, a
        # gather done once rather than in every matvec.
        data = jnp.asarray(self.data)
        if data.shape != (self.pattern.nnz,):
            raise ValueError(f"{_NAME}: data must have shape ({self.pattern.nnz},) (this rank's nonzeros in CSR "
                             f"order), got {data.shape}")
        if not jnp.issubdtype(data.dtype, jnp.inexact):
            data = data.astype(jnp.result_type(float))
        object.__setattr__(self, "data", data)
        object.__setattr__(self, "comm", resolve_comm(self.comm))
        object.__setattr__(self, "laid_out", self.pattern.local_values(data))

    @property
    def in_structure(self) -> Structure:
        return Structure.of(jax.ShapeDtypeStruct((self.pattern.columns.size_of(self.comm.rank),),
                                                 jnp.result_type(self.data)))

    @property
    def out_structure(self) -> Structure:
        return Structure.of(jax.ShapeDtypeStruct((self.pattern.rows.size_of(self.comm.rank),),
                                                 jnp.result_type(self.data)))

    @property
    def has_diagonal(self) -> bool:
        return self.pattern.diagonal_positions is not None

    @property
    def local_csr(self) -> tuple[jax.Array, np.ndarray, np.ndarray]:
        """This rank's (data, global column indices, indptr): the order `data` follows."""
        return self.data, self.pattern.indices, self.pattern.indptr

    def with_data(self, data: Any) -> SparseRowsOperator:
        """The same pattern (no communication to rebuild it) with new values."""
        return SparseRowsOperator(data=data, pattern=self.pattern, symmetric=self.symmetric,
                                  hermitian=self.hermitian, comm=self.comm)

    def _matvec(self, x: Any) -> Any:
        return _sparse_matvec(self.laid_out, x, pattern=self.pattern, comm=self.comm)

    def _transpose_matvec(self, w: Any) -> Any:
        return _sparse_transpose(self.laid_out, w, dtype=jnp.result_type(self.data), pattern=self.pattern,
                                 comm=self.comm)

    def _diagonal(self) -> Any:
        rows_at, data_at = self.pattern.diagonal_positions
        return jnp.zeros(self.pattern.rows.size_of(self.comm.rank), self.data.dtype).at[rows_at].add(self.data[data_at])


def _sparse_matvec(laid_out: tuple, x: Any, *, pattern: _Pattern, comm: Communicator, blocking: bool = False) -> Any:
    """(A x)_r from the laid-out values, the halo entries exchanged as `pattern.halo_mode` says."""
    x = jnp.asarray(x)
    plan = pattern.plan
    own_values, halo_values = laid_out
    if not plan.width:  # no rank needs anything from another
        return pattern.own.product(own_values, x)
    if blocking or pattern.halo_mode == "blocking":  # a collective: every rank takes part, halo or not
        if x.shape[0]:
            outgoing = jnp.where(plan.send_mask, x[plan.send_index], jnp.zeros((), x.dtype))
        else:  # a rank without columns sends nothing (and an empty x has nothing to gather from)
            outgoing = jnp.zeros(plan.send_index.shape, x.dtype) + jnp.sum(x)
        received = alltoall(outgoing, comm=comm).reshape(-1)
        return pattern.add_halo_product(halo_values, pattern.own.product(own_values, x), received)
    received, y = _exchange_while(lambda x: pattern.own.product(own_values, x), x, plan, comm)
    return pattern.add_halo_product(halo_values, y, received)


def _sparse_transpose(laid_out: tuple, w: Any, *, dtype: Any, pattern: _Pattern, comm: Communicator) -> Any:
    """(Aᵀ w)_r: the transpose of the matvec with the blocking exchange (the alltoall's
    transpose sends the halo cotangents back), whichever the halo mode.

    Not the overlapped exchange: transposed on its own (jax.linear_transpose,
    no JVP), a point-to-point message cannot tell its sender whether the
    returning cotangent is batched, and ``.T.to_dense()`` maps it over a basis.
    """
    structure = jax.ShapeDtypeStruct((pattern.columns.size_of(comm.rank),), dtype)
    matvec = functools.partial(_sparse_matvec, laid_out, pattern=pattern, comm=comm, blocking=True)
    (result,) = jax.linear_transpose(matvec, structure)(jnp.asarray(w, dtype))
    return result


def _exchange_while(own_product: Any, x: jax.Array, plan: HaloPlan, comm: Communicator) -> tuple[jax.Array, Any]:
    """(the halo entries in the (size·K,) layout of the blocking exchange, own_product(x)),
    the product computed while the entries travel: one message per neighbour, unpadded."""
    width = plan.width
    # Receive templates: zeros that depend on x (the sum of none of its
    # entries), so a receive is differentiated exactly when the sends are.
    zero = jnp.sum(x[:0])
    receives, senders = [], []
    for q in range(comm.size):
        if plan.recv_counts[q]:
            template = jnp.zeros((int(plan.recv_counts[q]),), x.dtype) + zero
            receives.append(irecv(template, q, tag=_HALO_TAG, comm=comm))
            senders.append(q)
    sends = [isend(x[plan.send_index[q, : plan.send_count(q)]], q, tag=_HALO_TAG, comm=comm)
             for q in range(comm.size) if plan.send_count(q)]
    arrived, y = overlap(receives + sends, own_product, x)
    blocks = [jnp.zeros((width,), x.dtype)] * comm.size
    for q, piece in zip(senders, arrived):
        blocks[q] = jnp.pad(piece, (0, width - piece.shape[0]))
    return jnp.concatenate(blocks), y


class _Pattern:
    """The static part: partitions, halo plan and the local product's layout.

    Attributes (besides the partitions, `indices`/`indptr` and `plan`):
      own: the :class:`_Block` of the entries in this rank's own columns,
        all m_r rows, input x_r.
      halo: the :class:`_Block` of the other entries, over the rows
        `halo_rows` only, input the flattened received buffer (size·K,);
        None when this rank's rows need nothing from another rank.
      halo_rows: (h,) sorted local rows with at least one halo entry.
      format: ``own.format`` (``"dia"``, ``"ell"`` or ``"segment"``), the
        storage of the bulk of the product.
      halo_format: ``halo.format``, or None without halo entries.
    """

    def __init__(self, indices: np.ndarray, indptr: np.ndarray, rows: Partition, columns: Partition,
                 comm: Communicator, halo_mode: str = "blocking"):
        self.halo_mode = halo_mode
        self.indices, self.indptr = indices, indptr
        self.rows, self.columns = rows, columns
        self.nnz = int(indices.size)
        m = indptr.size - 1
        self.plan, own, local_cols = _plan_halo(indices, columns, comm)
        row_ids = np.repeat(np.arange(m), np.diff(indptr))
        positions = np.arange(self.nnz)
        self.own = _Block(row_ids[own], local_cols[own], positions[own], m, columns.size_of(comm.rank), self.nnz)
        self.halo_rows = np.unique(row_ids[~own])
        if self.halo_rows.size:
            self.halo = _Block(np.searchsorted(self.halo_rows, row_ids[~own]), local_cols[~own], positions[~own],
                               self.halo_rows.size, self.plan.send_index.size, self.nnz)
        else:
            self.halo = None
        self.format = self.own.format
        self.halo_format = None if self.halo is None else self.halo.format
        square = rows == columns
        if square:
            global_rows = row_ids + rows.starts[comm.rank]
            on_diagonal = np.flatnonzero(indices == global_rows)
            self.diagonal_positions = (row_ids[on_diagonal], on_diagonal)
        else:
            self.diagonal_positions = None

    def local_values(self, data: jax.Array) -> tuple[jax.Array, Any]:
        """(own values, halo values or None) in the blocks' layouts (once per operator)."""
        padded = jnp.concatenate([data, jnp.zeros((1,), data.dtype)])
        return self.own.values(padded), None if self.halo is None else self.halo.values(padded)

    def add_halo_product(self, halo_values: Any, y: jax.Array, received: jax.Array) -> jax.Array:
        """y (the own block · x_r, (m_r,)) plus the halo block · received (size·K,),
        the latter added into the rows `halo_rows`."""
        if self.halo is None:
            # Nothing of `received` is used here, but the exchange is a collective: y
            # must still depend on it (an empty sum, folded away by XLA), or its
            # transpose would get a symbolic zero cotangent, unbatched under vmap
            # on this rank while batched on ranks with a halo (mismatched messages).
            return y + jnp.sum(received[:0])
        h = self.halo.product(halo_values, received)
        # Unique sorted rows: XLA adds into the few rows of y in place
        # instead of rewriting y.
        return y.at[self.halo_rows].add(h, indices_are_sorted=True, unique_indices=True)


def sparse_rows(
    matrix: Any,
    *,
    local: bool = False,
    row_partition: Any = None,
    column_partition: Any = None,
    data: Any = None,
    symmetric: bool = False,
    hermitian: bool = False,
    halo: str = "blocking",
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
      halo: "blocking" (default: one alltoall, then the product;
        derivatives of every order, e.g. Hessians through the matvec) or
        "overlapped" (one isend/irecv per neighbour rank while the
        own-column product is computed; derivatives of first order).
      comm: communicator (default distlinalg's).

    Returns:
      A :class:`SparseRowsOperator` x_r ↦ (A x)_r: the halo entries (only
      those the column pattern needs) move once per matvec, not at all on
      one rank or for block-diagonal patterns. ``.T`` transposes the matvec
      (the transposed exchange sends the halo cotangents back);
      ``diagonal()`` for square matrices; ``with_data`` reuses the pattern.
      ``.pattern.format`` names the storage of this rank's own-column block
      (the bulk: ``"dia"``, ``"ell"`` or ``"segment"``), and
      ``.pattern.halo_format`` that of its off-rank entries (None if none).

    Every rank must build it together: the halo pattern is exchanged once,
    at construction (also inside a jit trace).

    Example:
      >>> import jax, jax.numpy as jnp, scipy.sparse as sp
      >>> import distlinalg as dl
      >>> from distlinalg.operators import sparse_rows
      >>> M = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(8, 8), format="csr")  # on every rank
      >>> A = sparse_rows(M, symmetric=True)        # rank r keeps its block of rows
      >>> b = jnp.ones(A.input_structure.shape)     # this rank's block of b
      >>> x, info = jax.jit(dl.cg)(A, b)
      >>> bool(info.converged), bool(jnp.allclose(A @ x, b, atol=1e-4))
      (True, True)
      >>> bool(jnp.allclose(A.to_dense(), M.toarray()))
      True
    """
    comm = resolve_comm(comm)
    halo = resolve_halo_mode(halo, comm, _NAME)
    values, indices, indptr, shape = _as_csr(matrix)
    m, n = shape
    if local:
        if row_partition is not None:
            raise ValueError(f"{_NAME}: row_partition is implied by the local blocks; do not pass it with local=True")
        widths = exchange_sizes(n, comm)
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
    # Resolved (and compared across ranks) on every rank, also when it is
    # the row partition: n comes from this rank's matrix.
    columns = resolve_partition(rows if column_partition is None and rows.total == n else column_partition,
                                n, comm, "column_partition")
    pattern = _Pattern(indices, indptr, rows, columns, comm, halo)
    return SparseRowsOperator(
        data=values if data is None else data, pattern=pattern, symmetric=symmetric, hermitian=hermitian, comm=comm
    )
