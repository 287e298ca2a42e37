"""Block Jacobi: each rank solves with its own diagonal block, M = blockdiag(A_rr)⁻¹, no message.

For operators without a grid (``sparse_rows``, ``dense_rows``; the stencil operators too), where
geometric multigrid does not apply. Each rank's diagonal block A_rr (its rows, its own columns)
gets a local solver:

* ``"cholesky"``: the dense Cholesky factor of A_rr (for blocks of up to a few thousand rows);
* ``"amg"``: an algebraic multigrid hierarchy of A_rr built by pyamg (smoothed aggregation, the
  well-kept library for it: ``pip install pyamg``, ``make pyamg``), applied in JAX: one V-cycle
  with Chebyshev smoothing in D⁻¹A on [hi/4, hi] (hi from Gershgorin's theorem), the coarsest
  level solved by a dense LU. pyamg's setup runs on the host, once, on the block's values (so an
  "amg" block-Jacobi is built eagerly, from concrete values).

Symmetric positive definite for SPD A (every A_rr is SPD, and each local solver is). The
iteration count grows with the number of ranks (the coupling between blocks is left to the Krylov
method), the price of needing no message; for a grid operator, multigrid does not have it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np

from .._runtime.mpi import Communicator
from ..operators import LinearOperator, operator_class, static
from ..operators._partition import exchange_rows
from ..operators.dense import DenseRowsOperator
from ..operators.sparse import SparseRowsOperator
from ..operators.stencil import StencilGrid, stencil_entries
from ._arguments import agree_options
from .chebyshev import chebyshev_polynomial
from .multigrid import stencil_coefficients

LOCAL_SOLVERS = ("cholesky", "amg")
CHOLESKY_UP_TO = 4096  # local=None: a dense Cholesky for blocks of up to this many rows, else AMG
AMG_SMOOTHER_DEGREE = 2
AMG_LOWER_FRACTION = 0.25


@jax.tree_util.register_pytree_node_class
class CSR(NamedTuple):
    """A local sparse matrix for products in JAX: values, columns and sorted row ids (children), shape (static)."""

    values: Any
    columns: Any  # int32 (nnz,)
    row_ids: Any  # int32 (nnz,), sorted
    shape: tuple[int, int]

    def tree_flatten(self) -> tuple[tuple, tuple[int, int]]:
        return (self.values, self.columns, self.row_ids), self.shape

    @classmethod
    def tree_unflatten(cls, shape: tuple[int, int], children: tuple) -> "CSR":
        return cls(*children, shape)

    def matvec(self, x: jax.Array) -> jax.Array:
        return jax.ops.segment_sum(self.values * x[self.columns], self.row_ids, num_segments=self.shape[0],
                                   indices_are_sorted=True)

    @staticmethod
    def of(matrix: Any, dtype: Any) -> "CSR":
        m = matrix.tocsr()
        m.sort_indices()
        rows = np.repeat(np.arange(m.shape[0], dtype=np.int32), np.diff(m.indptr))
        return CSR(jnp.asarray(m.data, dtype), jnp.asarray(m.indices, jnp.int32), jnp.asarray(rows), m.shape)


# ---------------------------------------------------------------------------
# The diagonal block of each operator kind: (rows, columns, values) of A_rr, local indices
def diagonal_block(A: LinearOperator) -> tuple[np.ndarray, np.ndarray, Any, int]:
    """(row indices, column indices, values, size) of this rank's diagonal block, in local indices."""
    rank = A.comm.rank
    if isinstance(A, SparseRowsOperator):
        data, indices, indptr = A.local_csr
        pattern = A.pattern
        start, end = pattern.columns.starts[rank], pattern.columns.starts[rank + 1]
        rows = np.repeat(np.arange(indptr.size - 1), np.diff(indptr))
        own = (indices >= start) & (indices < end)
        return rows[own], (indices[own] - start), data[np.flatnonzero(own)], indptr.size - 1
    if isinstance(A, DenseRowsOperator):
        start, end = A.column_partition.starts[rank], A.column_partition.starts[rank + 1]
        block = A.rows[:, start:end]
        m = block.shape[0]
        rows, cols = np.meshgrid(np.arange(m), np.arange(end - start), indexing="ij")
        return rows.ravel(), cols.ravel(), block.reshape(-1), m
    grid = getattr(A, "stencil_grid", None)
    if isinstance(grid, StencilGrid):  # a stencil on a grid: its coefficients, probed where it has none
        mine, nx = grid.row_partition.size_of(rank), grid.shape[1]
        coefficients = stencil_coefficients(A, grid, A.comm, A.in_structure.leaves[0].dtype)
        rows, cols, values = stencil_entries(coefficients, (mine, nx))  # this rank's rows only
        return rows, cols, values, mine * nx
    raise TypeError(
        "distlinalg.solvers.block_jacobi: A must be an operator whose diagonal blocks are known: sparse_rows, "
        f"dense_rows, or one with a stencil_grid (laplacian_2d, stencil_2d); got {type(A).__name__}"
    )


# ---------------------------------------------------------------------------
# Local solvers
class _AmgLevel(NamedTuple):
    A: CSR
    inverse_diagonal: Any
    upper: Any  # Gershgorin bound of D⁻¹A (a scalar array)
    P: CSR
    R: CSR


def _amg_hierarchy(rows: np.ndarray, cols: np.ndarray, values: np.ndarray, size: int, dtype: Any
                   ) -> tuple[list[_AmgLevel], Any, Any]:
    try:
        import pyamg
    except ImportError as error:
        raise ImportError("distlinalg.solvers.block_jacobi(local='amg') needs pyamg (pip install pyamg, or "
                          "make pyamg)") from error
    import scipy.sparse as sp

    if size == 0:  # a rank with no rows: nothing to solve
        return [], jnp.zeros((0, 0), dtype), jnp.zeros((0,), jnp.int32)
    block = sp.csr_matrix((values, (rows, cols)), shape=(size, size))
    solver = pyamg.smoothed_aggregation_solver(block, max_coarse=100)
    levels = []
    for level in solver.levels[:-1]:
        A = level.A.tocsr()
        diagonal = A.diagonal()
        safe = np.where(diagonal == 0, 1.0, diagonal)
        upper = float(np.max(np.asarray(abs(A).sum(axis=1)).ravel() / np.abs(safe))) if A.shape[0] else 1.0
        levels.append(_AmgLevel(CSR.of(A, dtype), jnp.asarray(1 / safe, dtype), jnp.asarray(upper, dtype),
                                CSR.of(level.P, dtype),
                                CSR.of(level.R, dtype)))
    coarsest = solver.levels[-1].A.toarray()
    lu, pivots = jsl.lu_factor(jnp.asarray(coarsest, dtype)) if coarsest.size else (jnp.zeros((0, 0), dtype),
                                                                                     jnp.zeros((0,), jnp.int32))
    return levels, lu, pivots


def _amg_cycle(levels: list[_AmgLevel], lu: Any, pivots: Any, b: jax.Array, depth: int = 0) -> jax.Array:
    if depth == len(levels):
        return jsl.lu_solve((lu, pivots), b) if b.shape[0] else b
    level = levels[depth]
    hi = level.upper
    smooth = lambda rhs: chebyshev_polynomial(level.A.matvec, rhs, AMG_LOWER_FRACTION * hi, hi,  # noqa: E731
                                              AMG_SMOOTHER_DEGREE, level.inverse_diagonal)
    x = smooth(b)
    x = x + level.P.matvec(_amg_cycle(levels, lu, pivots, level.R.matvec(b - level.A.matvec(x)), depth + 1))
    return x + smooth(b - level.A.matvec(x))


@operator_class
class BlockJacobi(LinearOperator):
    """M = blockdiag(A_rr)⁻¹ of :func:`block_jacobi`; applied with no message, a constant of the solve.

    Attributes:
      factor: "cholesky": this rank's Cholesky factor (lower) of A_rr.
      hierarchy: "amg": the levels (matrices as CSR, smoother data) and the coarsest LU.
      local: the local solver, "cholesky" or "amg".

    Example:
      >>> import distlinalg as dl
      >>> from distlinalg.operators import laplacian_2d
      >>> M = dl.solvers.block_jacobi(laplacian_2d(8))    # small blocks: a Cholesky factor each
      >>> M.local, M.layout
      ('cholesky', 'sharded')
    """

    factor: Any
    hierarchy: Any
    structure: Any = static()
    comm: Communicator = static()
    local: str = static()

    layout = "sharded"
    symmetric = True
    hermitian = True

    @property
    def in_structure(self) -> Any:
        return self.structure

    @property
    def out_structure(self) -> Any:
        return self.structure

    def _matvec(self, v: Any) -> Any:
        v = jnp.asarray(v)
        if v.shape[0] == 0:
            return v
        if self.local == "cholesky":
            return jsl.cho_solve((jax.lax.stop_gradient(self.factor), True), v)
        levels, lu, pivots = jax.lax.stop_gradient(self.hierarchy)
        return _amg_cycle(list(levels), lu, pivots, v)


def block_jacobi(A: Any, *, local: str | None = None) -> BlockJacobi:
    """A block-Jacobi preconditioner: each rank applies the inverse of its diagonal block.

    Args:
      A: a sharded, symmetric positive definite distlinalg operator whose
        rows split as its columns: ``sparse_rows``, ``dense_rows``, or an
        operator with a ``stencil_grid`` (``laplacian_2d``, ``stencil_2d``,
        a user's: its block's coefficients are found by 9 products).
      local: the local solver of each diagonal block A_rr: "cholesky" (its
        dense Cholesky factor: n_r² memory, n_r³/3 flops once), "amg" (an
        algebraic multigrid V-cycle from pyamg's smoothed aggregation,
        applied in JAX; the setup runs on the host, so A's values must be
        concrete: build it outside jit), or None: "cholesky" for blocks of up
        to 4096 rows, else "amg". Every rank must pass the same.

    Returns:
      A :class:`BlockJacobi` operator (sharded, symmetric positive definite
      for SPD A), usable as ``M=`` in cg, minres, gmres, bicgstab and
      ``eigsh(method="lobpcg")``. Application: no message; "cholesky" two
      triangular solves of n_r², "amg" one V-cycle (about a dozen sparse
      products of the block's size).

    AD: a constant of the solve (stop_gradient).

    Errors (on every rank, before any message): an operator of another kind
    (TypeError), an unknown or differing ``local`` (ValueError), "amg"
    without pyamg (ImportError) or on traced values (ValueError).

    Example:
      >>> import jax.numpy as jnp, numpy as np, scipy.sparse as sp
      >>> import distlinalg as dl
      >>> from distlinalg import comm
      >>> from distlinalg.operators import Partition, sparse_rows
      >>> n = 40                                       # a 1-D Poisson matrix with a varying diagonal
      >>> T = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(n, n)) + sp.diags(np.linspace(0.1, 10, n))
      >>> p = Partition.even(n, comm.size())
      >>> r = comm.rank()
      >>> A = sparse_rows(T.tocsr()[p.starts[r]:p.starts[r + 1]], local=True, symmetric=True)  # my rows
      >>> M = dl.solvers.block_jacobi(A, local="cholesky")
      >>> x, info = dl.cg(A, jnp.ones(p.size_of(r)), M=M, rtol=1e-5)
      >>> bool(info.converged)
      True
    """
    if not isinstance(A, LinearOperator) or A.layout != "sharded":
        raise TypeError("distlinalg.solvers.block_jacobi: A must be a sharded distlinalg operator "
                        f"(sparse_rows, dense_rows, laplacian_2d, stencil_2d); got {type(A).__name__}")
    comm = A.comm
    rows, cols, values, size = diagonal_block(A)
    problem = "" if local is None or local in LOCAL_SOLVERS else \
        f"local must be None or one of {LOCAL_SOLVERS}, got {local!r}"
    agree_options("distlinalg.solvers.block_jacobi", problem, f"local={local!r}", comm)
    values = jax.lax.stop_gradient(values)
    concrete = not isinstance(values, jax.core.Tracer)
    table = exchange_rows(np.asarray([size, concrete], np.int64), comm)  # the largest block; all concrete?
    largest, all_concrete = int(table[:, 0].max()), bool(np.all(table[:, 1]))
    chosen = local or ("cholesky" if largest <= CHOLESKY_UP_TO else "amg")
    dtype = jnp.result_type(values)
    if chosen == "cholesky":
        dense = jnp.zeros((size, size), dtype).at[rows, cols].add(values)
        factor = jnp.linalg.cholesky(dense) if size else dense
        return BlockJacobi(factor=factor, hierarchy=None, structure=A.in_structure, comm=comm, local="cholesky")
    if not all_concrete:
        raise ValueError("distlinalg.solvers.block_jacobi(local='amg'): pyamg's setup needs concrete values; "
                         "build the preconditioner outside jax.jit (and pass it in as an argument)")
    levels, lu, pivots = _amg_hierarchy(rows, cols, np.asarray(values), size, dtype)
    return BlockJacobi(factor=None, hierarchy=(tuple(levels), lu, pivots), structure=A.in_structure, comm=comm,
                       local="amg")
