"""Stencil operators on a row-decomposed 2-D grid: the matrix-free 5-point Laplacian, and
general 3 × 3 stencils with coefficients per grid point.

The n×n interior grid of the unit square (Dirichlet boundary, unscaled: 4
on the diagonal, -1 for each of the four neighbours) is split into blocks
of whole grid rows; a matvec needs one grid row from the block above and
one from the block below (the ends of the chain talk to PROC_NULL). The
standard Krylov benchmark problem.

Two ways to exchange the halo rows, chosen by ``halo=``:

* ``"blocking"`` (default): two sendrecvs, then the stencil. Derivatives
  of every order.
* ``"overlapped"``: isend/irecv of the two boundary rows, the interior
  stencil computed while they travel (comm.overlap), the halo rows
  subtracted from the first and last row when they have arrived.
  Derivatives of first order (forward and reverse; the solvers need no
  more). On 2 ranks of one machine (messages cheap) CG with it takes
  1.4–1.7× as long per iteration as with the blocking exchange
  (benchmarks/results_overlap.md).

Both declare their grid (``stencil_grid``: the grid's shape and how its rows
are split), which is what :func:`distlinalg.solvers.multigrid` coarsens.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._runtime.mpi import MPI, Communicator, resolve_comm
from ..comm.nonblocking_p2p import irecv, isend
from ..comm.overlap import fence, overlap
from ..comm.p2p import sendrecv
from .._trees import Structure
from ._base import LinearOperator, operator_class, static
from ._partition import Partition, exchange_rows, resolve_halo_mode, resolve_partition


class StencilGrid(NamedTuple):
    """The grid behind a stencil operator: what :func:`distlinalg.solvers.multigrid` coarsens.

    An operator that has a ``stencil_grid`` promises that its vectors are this
    rank's grid rows [s_r, s_{r+1}) of a ``shape = (ny, nx)`` grid, flattened
    in row-major order (shape ((s_{r+1} − s_r)·nx,)), that ``row_partition``
    splits the ny grid rows over the ranks of ``comm``, and that its matvec
    couples each grid point only with its eight neighbours (a stencil of at
    most 3 × 3 points; grid points beyond the edge are zero, as with a
    Dirichlet boundary).

    Such an operator may also have a method ``stencil_coefficients()``
    returning this rank's (3, 3, rows, nx) coefficients (``[a, b, i, j]``
    multiplies u[i + a − 1, j + b − 1], as in :class:`Stencil2D`; couplings
    beyond the grid are ignored). :func:`distlinalg.solvers.multigrid` and
    :func:`~distlinalg.solvers.block_jacobi` then read them instead of
    finding them by 9 products of the operator (``laplacian_2d`` and
    ``stencil_2d`` have it).

    Example:
      >>> from distlinalg.operators import laplacian_2d
      >>> grid = laplacian_2d(6).stencil_grid
      >>> grid.shape, grid.row_partition.total
      ((6, 6), 6)
    """

    shape: tuple[int, int]
    row_partition: Partition


def grid_neighbours(row_partition: Partition, comm: Communicator) -> tuple[int, int, int]:
    """(this rank's grid rows, the rank holding the rows above, the rank holding the rows below).

    Ranks holding no rows are skipped: the neighbours are the nearest ranks
    that hold rows (PROC_NULL at the ends of the grid, and on a rank that
    holds none).
    """
    rank = comm.rank
    mine = row_partition.size_of(rank)
    holders = [r for r in range(comm.size) if row_partition.size_of(r) > 0]
    if not mine:
        return 0, MPI.PROC_NULL, MPI.PROC_NULL
    position = holders.index(rank)
    up = holders[position - 1] if position > 0 else MPI.PROC_NULL
    down = holders[position + 1] if position + 1 < len(holders) else MPI.PROC_NULL
    return mine, up, down


def halo_rows(u: jax.Array, up: int, down: int, comm: Communicator) -> tuple[jax.Array, jax.Array]:
    """(the grid row above this block, the grid row below it): two sendrecvs, zeros beyond the grid.

    `u` is this rank's block of grid rows (rows, nx), rows ≥ 1. No message
    when the block has no neighbour (one rank).
    """
    boundary = jnp.zeros(u.shape[1:], u.dtype)
    above = _exchange_row(u[-1], boundary, up, down, _ABOVE_TAG, comm)
    below = _exchange_row(u[0], boundary, down, up, _BELOW_TAG, comm)
    return (boundary if above is None else above), (boundary if below is None else below)


def _interior_stencil(u: jax.Array) -> jax.Array:
    """4u − the four neighbours, with zero grid rows beyond the block.

    The halo rows are subtracted from the first and last row afterwards
    (_subtract_halo). Concatenating them onto the block instead made XLA's
    CPU backend materialise the shifted copies and run the stencil on one
    thread (benchmarks/README.md, "The 2-D Laplacian's stencil").
    """
    up = jnp.pad(u[:-1], ((1, 0), (0, 0)))
    down = jnp.pad(u[1:], ((0, 1), (0, 0)))
    left = jnp.pad(u[:, :-1], ((0, 0), (1, 0)))
    right = jnp.pad(u[:, 1:], ((0, 0), (0, 1)))
    return 4 * u - up - down - left - right


def _subtract_halo(inner: jax.Array, above: jax.Array | None, below: jax.Array | None) -> jax.Array:
    """The neighbours beyond the block: −(row above) in the first row, −(row below) in the last.

    None: no block there (the boundary of the grid), nothing to subtract.
    One elementwise pass that XLA fuses into the stencil's loop or into the
    matvec's consumer. Each row is broadcast over the block and selected by
    row index, so every load stays inside the row. Two other ways are slow
    on XLA's CPU backend:

    * An in-place update of the first and last rows (``.at[0].add``) makes
      XLA copy the whole result, up to three times per iteration, when a
      solver keeps it in its loop carry (single-reduction and pipelined CG,
      BiCGSTAB).
    * Zero-padding a row to the block (``jnp.pad``), or an in-place update
      fused with its consumer, compiles to masked vector loads of the row at
      every index of the block. The masked-off lanes address up to the
      block's size past the row; where that memory is unmapped, each load
      takes a fault-suppression assist, an order of magnitude slower in
      most runs (benchmarks/README.md, "Where the gaps came from").
    """
    present = [r for r in (above, below) if r is not None]
    if not present:
        return inner
    if inner.shape[0] == 1:  # one grid row: both neighbours border it
        return inner - sum(present)[None, :]
    row = jax.lax.broadcasted_iota(jnp.int32, inner.shape, 0)
    halo = jnp.zeros((), inner.dtype)
    if below is not None:
        halo = jnp.where(row == inner.shape[0] - 1, below[None, :], halo)
    if above is not None:
        halo = jnp.where(row == 0, above[None, :], halo)
    return inner - halo


def _materialized(block: jax.Array) -> jax.Array:
    """`block`, computed once into its own buffer (a fence that reads it; the overlapped path has one).

    A solver uses A·v twice (CG: ⟨p, q⟩ and r − αq). Left to itself, XLA's
    CPU backend fuses the stencil into both uses and, to feed them, writes
    the four shifted copies of v to memory: five vector writes and ten
    reads per matvec instead of one write and two reads, about twice the
    time per CG iteration (benchmarks/README.md, "The 2-D Laplacian's
    stencil"). An optimization_barrier does not stop it (XLA's CPU pipeline removes barriers before fusion).

    Off the CPU this fence is the identity (``mpi_order=False``, no
    ``pass_through``): XLA's GPU fusions recompute the stencil where it is
    used, from the cached input, as for jax.scipy's cg; a custom call
    there would only add a launch and a vector written and read back.
    """
    return fence(block, pass_through=False, mpi_order=False)


@operator_class
class Laplacian2D(LinearOperator):
    """The matrix-free 2-D Laplacian of :func:`laplacian_2d` (rank's block of grid rows).

    Pytree: no children (the operator has no arrays). Its static fields
    (n, the grid-row partition, dtype, communicator, halo mode) are compared
    by value, so every ``laplacian_2d(n)`` of the same arguments has the
    same tree definition and a jitted function taking it compiles once.
    Rebuilding it from them neither computes nor communicates (the
    partition was agreed at construction).

    Attributes:
      n: grid points per side.
      row_partition: the grid rows of every rank (a :class:`Partition`).
      grid_rows: this rank's grid rows (s_r, s_{r+1}).
      halo: "overlapped" or "blocking" (module docstring).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import distlinalg as dl
      >>> from distlinalg.operators import laplacian_2d
      >>> solve = jax.jit(lambda A, b: dl.cg(A, b)[0])  # the operator is an argument
      >>> A = laplacian_2d(4)
      >>> x = solve(A, jnp.ones(A.input_structure.shape))
      >>> A.n, A.halo, bool(jnp.allclose(A @ x, 1.0, atol=1e-4))
      (4, 'blocking', True)
    """

    n: int = static()
    row_partition: Partition = static()
    dtype: Any = static()
    comm: Communicator = static()
    halo: str = static(default="blocking")

    layout = "sharded"
    symmetric = True
    hermitian = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))

    @property
    def grid_rows(self) -> tuple[int, int]:
        rank = self.comm.rank
        return self.row_partition.starts[rank], self.row_partition.starts[rank + 1]

    @property
    def stencil_grid(self) -> StencilGrid:
        """The n × n grid and its row split (what :func:`distlinalg.solvers.multigrid` coarsens)."""
        return StencilGrid((self.n, self.n), self.row_partition)

    @property
    def in_structure(self) -> Structure:
        return Structure.of(jax.ShapeDtypeStruct((self.row_partition.size_of(self.comm.rank) * self.n,), self.dtype))

    @property
    def out_structure(self) -> Structure:
        return self.in_structure

    def _geometry(self) -> _Geometry:
        """This rank's rows and its neighbours (the ranks holding the rows above and below)."""
        mine, up, down = grid_neighbours(self.row_partition, self.comm)
        return _Geometry(self.n, mine, up, down, self.comm, self.halo)

    def _matvec(self, v: Any) -> Any:
        return _laplacian_matvec(v, geometry=self._geometry())

    def _diagonal(self) -> Any:
        return jnp.full(self.in_structure.leaves[0].shape, 4, self.dtype)

    def stencil_coefficients(self) -> jax.Array:
        """This rank's (3, 3, rows, n) coefficients: 4 at the centre, −1 at the four neighbours (no message)."""
        stencil = jnp.asarray([[0, -1, 0], [-1, 4, -1], [0, -1, 0]], self.dtype)[:, :, None, None]
        return jnp.broadcast_to(stencil, (3, 3, self.row_partition.size_of(self.comm.rank), self.n))


class _Geometry(NamedTuple):
    n: int
    mine: int  # grid rows on this rank
    up: int  # the rank holding the rows above (or PROC_NULL)
    down: int
    comm: Communicator
    halo: str  # "overlapped" or "blocking"


# Tags: a block's last row travels down as its neighbour's row above (tag 1),
# its first row up as its neighbour's row below (tag 2).
_ABOVE_TAG, _BELOW_TAG = 1, 2


def _laplacian_matvec(v: Any, *, geometry: _Geometry) -> Any:
    n, mine, up, down, comm, halo = geometry
    v = jnp.asarray(v)
    if not mine:
        return v
    u = v.reshape(mine, n)
    if halo == "blocking":
        boundary = jnp.zeros((n,), v.dtype)
        above = _exchange_row(u[-1], boundary, up, down, _ABOVE_TAG, comm)
        below = _exchange_row(u[0], boundary, down, up, _BELOW_TAG, comm)
        return _materialized(_subtract_halo(_interior_stencil(u), above, below)).reshape(-1)
    above, below, inner = _overlapped_halo(u, geometry)
    return _subtract_halo(inner, above, below).reshape(-1)


def _exchange_row(row: jax.Array, boundary: jax.Array, source: int, dest: int, tag: int,
                  comm: Communicator) -> jax.Array | None:
    """Send `row` to `dest`, receive the neighbour's from `source` (`boundary`, zeros, from PROC_NULL).

    None, and no message, when both are PROC_NULL (a block with no
    neighbour: one rank). Otherwise the received row is used even where it
    is the zero boundary: a rank that drops its received value takes part in
    fewer messages of the derivative programs (second order and up) than
    its partner.
    """
    if source == MPI.PROC_NULL and dest == MPI.PROC_NULL:
        return None
    return sendrecv(row, boundary, source, dest, sendtag=tag, recvtag=tag, comm=comm)


def _overlapped_halo(u: jax.Array, geometry: _Geometry) -> tuple[Any, Any, jax.Array]:
    """(row above, row below, interior stencil), the stencil computed while the rows travel;
    None for a row beyond the grid."""
    _, _, up, down, comm, _ = geometry
    receives, sends = [], []
    # Receive templates are boundary rows of u: their values are overwritten,
    # and they make the receives differentiated exactly when the sends are.
    if up != MPI.PROC_NULL:
        receives.append(irecv(u[0], up, tag=_ABOVE_TAG, comm=comm))
        sends.append(isend(u[0], up, tag=_BELOW_TAG, comm=comm))
    if down != MPI.PROC_NULL:
        receives.append(irecv(u[-1], down, tag=_BELOW_TAG, comm=comm))
        sends.append(isend(u[-1], down, tag=_ABOVE_TAG, comm=comm))
    arrived, inner = overlap(receives + sends, _interior_stencil, u)
    above = arrived.pop(0) if up != MPI.PROC_NULL else None
    below = arrived.pop(0) if down != MPI.PROC_NULL else None
    return above, below, inner


def laplacian_2d(
    n: int, *, row_partition: Any = None, dtype: Any = None, halo: str = "blocking", comm: Any = None
) -> Laplacian2D:
    """The 2-D 5-point Laplacian on an n×n grid, grid rows split across ranks.

    Args:
      n: grid points per side (the matrix is n² × n²), any n ≥ 1 and any
        number of ranks (ranks beyond n hold no rows and skip the exchange).
      row_partition: grid rows per rank (default an even split, the first
        n % P ranks one row more); must add up to n.
      dtype: of the vectors (default float64 with x64 enabled, else float32).
      halo: "blocking" (default: two sendrecvs before the stencil;
        derivatives of every order, e.g. Hessians of a loss through the
        matvec) or "overlapped" (isend/irecv of the boundary rows while the
        interior stencil is computed; derivatives of first order).
      comm: communicator (default distlinalg's).

    Returns:
      A sharded, symmetric :class:`Laplacian2D` on flat vectors: rank r
      holds grid rows [s_r, s_{r+1}) in row-major order, a vector of shape
      ((s_{r+1} − s_r)·n,) — the rows of the matrix
      ``kron(I, T) + kron(T, I)``, T = tridiag(−1, 2, −1), that rank owns.
      Two messages of n entries each way per matvec (none on one rank); ``diagonal()`` is 4.
      ``op.grid_rows`` is this rank's (s_r, s_{r+1}).

    Every rank must build it together (the partition is checked across
    ranks, once). A pytree with no children: pass it to a jitted function
    as an argument (every laplacian_2d of the same arguments shares the
    compilation).

    Example:
      >>> import jax.numpy as jnp
      >>> from distlinalg.operators import laplacian_2d
      >>> A = laplacian_2d(4)                       # 16 × 16, the 4 grid rows split across ranks
      >>> T = 2 * jnp.eye(4) - jnp.eye(4, k=1) - jnp.eye(4, k=-1)
      >>> L = jnp.kron(jnp.eye(4), T) + jnp.kron(T, jnp.eye(4))  # the dense reference
      >>> first, last = A.grid_rows                 # this rank's grid rows
      >>> x = jnp.arange(16.0)
      >>> bool(jnp.array_equal(A @ x[4 * first : 4 * last], (L @ x)[4 * first : 4 * last]))
      True
    """
    comm = resolve_comm(comm)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"distlinalg.operators.laplacian_2d: n must be a positive int, got {n!r}")
    dtype = jnp.dtype(dtype) if dtype is not None else jnp.result_type(float)
    halo = resolve_halo_mode(halo, comm, "distlinalg.operators.laplacian_2d")
    grid_rows: Partition = resolve_partition(row_partition, n, comm, "row_partition")
    return Laplacian2D(n=n, row_partition=grid_rows, dtype=dtype, comm=comm, halo=halo)


# ---------------------------------------------------------------------------
# General 3 × 3 stencils
@operator_class
class Stencil2D(LinearOperator):
    """A 3 × 3 stencil with coefficients per grid point, on a row-decomposed grid (:func:`stencil_2d`).

    ``coefficients[a, b, i, j]`` multiplies u[i + a − 1, j + b − 1] in row
    (i, j) of the product (i local to this rank's block of grid rows); the
    neighbours beyond the grid are zero. One halo row each way per matvec
    (two sendrecvs, none on one rank). The coarse levels of
    :func:`distlinalg.solvers.multigrid` are these operators.

    Pytree: the coefficients are the child (differentiable); the grid, its
    row split, the communicator and the symmetry flags are static.

    Example:
      >>> import jax.numpy as jnp
      >>> from distlinalg.operators import Stencil2D, laplacian_2d
      >>> A = laplacian_2d(4)
      >>> first, last = A.grid_rows
      >>> c = jnp.zeros((3, 3, last - first, 4)).at[1, 1].set(4.0)
      >>> c = c.at[0, 1].set(-1.0).at[2, 1].set(-1.0).at[1, 0].set(-1.0).at[1, 2].set(-1.0)
      >>> S = Stencil2D(coefficients=c, shape=(4, 4), row_partition=A.row_partition, comm=A.comm)
      >>> x = jnp.arange(16.0)[4 * first : 4 * last]
      >>> bool(jnp.allclose(S @ x, A @ x))
      True
    """

    coefficients: Any
    shape: tuple[int, int] = static()
    row_partition: Partition = static()
    comm: Communicator = static()
    symmetric: bool = static(default=False)
    hermitian: bool = static(default=False)

    layout = "sharded"

    @property
    def stencil_grid(self) -> StencilGrid:
        return StencilGrid(tuple(self.shape), self.row_partition)

    @property
    def grid_rows(self) -> tuple[int, int]:
        rank = self.comm.rank
        return self.row_partition.starts[rank], self.row_partition.starts[rank + 1]

    @property
    def in_structure(self) -> Structure:
        rows = self.row_partition.size_of(self.comm.rank)
        return Structure.of(jax.ShapeDtypeStruct((rows * self.shape[1],), jnp.result_type(self.coefficients)))

    @property
    def out_structure(self) -> Structure:
        return self.in_structure

    def _matvec(self, v: Any) -> Any:
        return apply_stencil(self.coefficients, jnp.asarray(v), self.row_partition, self.comm)

    def _diagonal(self) -> Any:
        return self.coefficients[1, 1].reshape(-1)

    def stencil_coefficients(self) -> jax.Array:
        """This rank's (3, 3, rows, nx) coefficients, as held."""
        return self.coefficients


@operator_class
class SymmetricStencil2D(LinearOperator):
    """A symmetric (or Hermitian) 3 × 3 stencil stored by half its couplings (:func:`symmetric_stencil`).

    The coupling of point (i, j) with (i, j − 1), (i − 1, j + 1), (i − 1, j)
    and (i − 1, j − 1) is that of the neighbour with (i, j) (conjugated when
    ``hermitian`` and complex), so only the centre and the couplings east,
    south-west, south and south-east are held: five coefficient arrays read
    per product instead of nine. The coarse levels of
    :func:`distlinalg.solvers.multigrid` are these when A is symmetric or
    Hermitian: a stencil's product is bound by memory bandwidth, so fewer
    arrays read make a faster product (docs/preconditioners.md).

    Attributes:
      centre: (rows, nx), this rank's diagonal.
      forward: (4, rows + 1, nx + 2): the couplings east, south-west, south
        and south-east of grid rows s − 1 … e − 1 (the first row is the row
        above this rank's block, from its owner; zero at the top edge),
        with a zero column on each side.
      shape, row_partition, comm: the grid, its row split, the communicator (static).
      conjugate: whether the mirrored couplings are conjugated (Hermitian, complex).

    Example:
      >>> import jax.numpy as jnp
      >>> from distlinalg.operators import laplacian_2d, symmetric_stencil
      >>> A = laplacian_2d(6)
      >>> S = symmetric_stencil(A.stencil_coefficients(), A.stencil_grid, A.comm)
      >>> x = jnp.arange(36.0)[6 * A.grid_rows[0] : 6 * A.grid_rows[1]]
      >>> bool(jnp.allclose(S @ x, A @ x))
      True
    """

    centre: Any
    forward: Any
    shape: tuple[int, int] = static()
    row_partition: Partition = static()
    comm: Communicator = static()
    conjugate: bool = static(default=False)

    layout = "sharded"

    @property
    def symmetric(self) -> bool:
        return not self.conjugate

    @property
    def hermitian(self) -> bool:
        return self.conjugate or not jnp.iscomplexobj(self.centre)

    @property
    def stencil_grid(self) -> StencilGrid:
        return StencilGrid(tuple(self.shape), self.row_partition)

    @property
    def in_structure(self) -> Structure:
        rows = self.row_partition.size_of(self.comm.rank)
        return Structure.of(jax.ShapeDtypeStruct((rows * self.shape[1],), jnp.result_type(self.centre)))

    @property
    def out_structure(self) -> Structure:
        return self.in_structure

    def _matvec(self, v: Any) -> Any:
        mine, up, down = grid_neighbours(self.row_partition, self.comm)
        if not mine:
            return v
        nx = self.shape[1]
        u = jnp.asarray(v).reshape(mine, nx)
        above, below = halo_rows(u, up, down, self.comm)
        U = jnp.pad(jnp.concatenate([above[None], u, below[None]]), ((0, 0), (1, 1)))  # rows s − 1 … e
        F = self.forward
        mirrored = jnp.conj(F) if self.conjugate else F
        east, southwest, south, southeast = (F[d, 1:, 1 : nx + 1] for d in range(4))
        out = (self.centre * u
               + east * U[1:-1, 2:] + southwest * U[2:, :nx] + south * U[2:, 1:-1] + southeast * U[2:, 2:]
               + mirrored[0, 1:, :nx] * U[1:-1, :nx]               # west: east coupling of (i, j − 1)
               + mirrored[1, :mine, 2:] * U[:mine, 2:]             # north-east: south-west of (i − 1, j + 1)
               + mirrored[2, :mine, 1 : nx + 1] * U[:mine, 1:-1]   # north: south of (i − 1, j)
               + mirrored[3, :mine, :nx] * U[:mine, :nx])          # north-west: south-east of (i − 1, j − 1)
        return out.reshape(-1)

    def _diagonal(self) -> Any:
        return self.centre.reshape(-1)

    def stencil_coefficients(self) -> jax.Array:
        """This rank's (3, 3, rows, nx) coefficients, the mirrored half unfolded."""
        nx, rows = self.shape[1], self.centre.shape[0]  # rows may be 0: every slice below is then empty
        F = self.forward
        mirrored = jnp.conj(F) if self.conjugate else F
        north = [mirrored[3, :rows, :nx], mirrored[2, :rows, 1 : nx + 1], mirrored[1, :rows, 2:]]
        middle = [mirrored[0, 1:, :nx], self.centre, F[0, 1:, 1 : nx + 1]]
        south = [F[1, 1:, 1 : nx + 1], F[2, 1:, 1 : nx + 1], F[3, 1:, 1 : nx + 1]]
        return jnp.stack([jnp.stack(row) for row in (north, middle, south)])


def symmetric_stencil(coefficients: Any, grid: StencilGrid, comm: Any = None, *,
                      hermitian: bool = False) -> SymmetricStencil2D:
    """A :class:`SymmetricStencil2D` from the (3, 3, rows, nx) coefficients of a symmetric (Hermitian) stencil.

    Only the centre and the couplings east, south-west, south and south-east
    are kept (the other four are taken as their mirrors: nothing is checked);
    one halo exchange brings the row above's. Couplings beyond the grid
    must be zero. ``hermitian``: mirrored couplings are conjugated (complex
    coefficients).

    Errors: coefficients that are not (3, 3, this rank's grid rows, nx) on
    some rank raise the same ValueError on every rank, before the halo
    exchange (one exchange of a flag per rank).

    AD: linear in the coefficients it keeps and in v; both modes.

    Example:
      >>> import jax.numpy as jnp
      >>> from distlinalg.operators import laplacian_2d, symmetric_stencil
      >>> A = laplacian_2d(5)
      >>> S = symmetric_stencil(A.stencil_coefficients(), A.stencil_grid)
      >>> S.forward.shape[0], S.symmetric      # east, south-west, south, south-east
      (4, True)
      >>> bool(jnp.allclose(S.diagonal(), 4.0))
      True
    """
    comm = resolve_comm(comm)
    coefficients = jnp.asarray(coefficients)
    expected = (3, 3, grid.row_partition.size_of(comm.rank), grid.shape[1])
    flags = exchange_rows(np.asarray([coefficients.shape != expected]), comm)[:, 0]
    if flags.any():
        raise ValueError(f"distlinalg.operators.symmetric_stencil: the coefficients must be (3, 3, rows, nx) of each "
                         f"rank's grid rows; rank(s) {np.flatnonzero(flags).tolist()} passed another shape "
                         f"(rank {comm.rank}: {coefficients.shape}, expected {expected})")
    return half_stored_stencil(coefficients, grid, comm, hermitian=hermitian)


def half_stored_stencil(coefficients: jax.Array, grid: StencilGrid, comm: Communicator, *,
                        hermitian: bool = False) -> SymmetricStencil2D:
    """:func:`symmetric_stencil` without its check (for coefficients of known shape: multigrid's levels)."""
    mine, up, down = grid_neighbours(grid.row_partition, comm)
    nx = grid.shape[1]
    forward = jnp.stack([coefficients[1, 2], coefficients[2, 0], coefficients[2, 1], coefficients[2, 2]])
    if mine:
        above, _ = halo_rows(jnp.moveaxis(forward, 1, 0), up, down, comm)  # the row above's (4, nx)
        forward = jnp.concatenate([above[:, None], forward], axis=1)
    else:
        forward = jnp.zeros((4, 1, nx), coefficients.dtype)
    return SymmetricStencil2D(centre=coefficients[1, 1], forward=jnp.pad(forward, ((0, 0), (0, 0), (1, 1))),
                              shape=tuple(grid.shape), row_partition=grid.row_partition, comm=comm,
                              conjugate=bool(hermitian and jnp.iscomplexobj(coefficients)))


def apply_stencil(coefficients: jax.Array, v: jax.Array, row_partition: Partition, comm: Communicator) -> jax.Array:
    """Σ_ab c[a, b] ⊙ (v shifted by (a − 1, b − 1)) on this rank's grid rows (flat in, flat out).

    The halo rows are concatenated onto the block: the product reads nine
    coefficient arrays and is bound by memory bandwidth, and the Laplacian's
    way (shifts inside the block, the halo row selected by row index) was
    slower here (docs/preconditioners.md, "What was tried").
    """
    mine, up, down = grid_neighbours(row_partition, comm)
    if not mine:
        return v
    nx = coefficients.shape[-1]
    u = v.reshape(mine, nx)
    above, below = halo_rows(u, up, down, comm)
    extended = jnp.pad(jnp.concatenate([above[None], u, below[None]]), ((0, 0), (1, 1)))
    out = sum(coefficients[a, b] * extended[a : a + mine, b : b + nx] for a in range(3) for b in range(3))
    return out.reshape(-1)


def stencil_entries(coefficients: Any, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, Any]:
    """(row, column, value) of every entry of a stencil on a (ny, nx) grid, from its (3, 3, ny, nx)
    coefficients; the couplings beyond the grid are dropped (flat row-major indices)."""
    ny, nx = shape
    J, K = np.meshgrid(np.arange(ny), np.arange(nx), indexing="ij")
    rows, cols, values = [], [], []
    for a in range(3):
        for b in range(3):
            Jn, Kn = J + a - 1, K + b - 1
            inside = (Jn >= 0) & (Jn < ny) & (Kn >= 0) & (Kn < nx)
            rows.append((J * nx + K)[inside])
            cols.append((Jn * nx + Kn)[inside])
            values.append(coefficients[a, b][inside])
    return np.concatenate(rows), np.concatenate(cols), jnp.concatenate(values)


def stencil_2d(coefficients: Any, *, symmetric: bool = False, hermitian: bool = False,
               comm: Any = None) -> Stencil2D:
    """A 3 × 3 stencil operator from this rank's coefficients, grid rows split as the coefficients are.

    Args:
      coefficients: (3, 3, rows, nx), this rank's grid rows: ``[a, b, i, j]``
        multiplies u[i + a − 1, j + b − 1] (global grid rows, zero beyond the
        grid). rows may differ between ranks (0 included); nx must not.
      symmetric, hermitian: what the caller knows of the matrix (the solvers
        read them; nothing is checked).
      comm: communicator (default distlinalg's).

    Returns:
      A sharded :class:`Stencil2D` on flat vectors of shape (rows·nx,), with
      ``stencil_grid`` (so :func:`distlinalg.solvers.multigrid` takes it).
      Every rank builds it together (the row counts are exchanged once).

    AD: linear in the coefficients and in v; both modes, every order.

    Example:
      >>> import jax.numpy as jnp
      >>> from distlinalg import comm
      >>> from distlinalg.operators import stencil_2d
      >>> rows = 2                                   # this rank's grid rows
      >>> c = jnp.zeros((3, 3, rows, 5)).at[1, 1].set(2.0)
      >>> S = stencil_2d(c, symmetric=True)          # 2·I on a (2·size) × 5 grid
      >>> S.stencil_grid.shape == (2 * comm.size(), 5)
      True
      >>> S @ jnp.ones(rows * 5)
      Array([2., 2., 2., 2., 2., 2., 2., 2., 2., 2.], dtype=float32)
    """
    comm = resolve_comm(comm)
    coefficients = jnp.asarray(coefficients)
    shape_ok = coefficients.ndim == 4 and coefficients.shape[:2] == (3, 3)
    rows, nx = (coefficients.shape[2], coefficients.shape[3]) if shape_ok else (-1, -1)
    table = exchange_rows(np.asarray([rows, nx], np.int64), comm)
    if np.any(table[:, 0] < 0):
        bad = [r for r in range(comm.size) if table[r, 0] < 0]
        raise ValueError(f"distlinalg.operators.stencil_2d: coefficients must have shape (3, 3, rows, nx); "
                         f"rank(s) {bad} passed another shape")
    if np.any(table[:, 1] != table[0, 1]):
        raise ValueError(f"distlinalg.operators.stencil_2d: every rank's coefficients must have the same nx; "
                         f"got {table[:, 1].tolist()}")
    partition = Partition.from_sizes(table[:, 0])
    return Stencil2D(coefficients=coefficients, shape=(partition.total, int(table[0, 1])), row_partition=partition, comm=comm,
                     symmetric=bool(symmetric), hermitian=bool(hermitian))
