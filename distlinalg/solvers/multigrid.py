"""Geometric multigrid for stencil operators on a row-decomposed 2-D grid: a preconditioner
whose iteration count does not grow with the grid.

The hierarchy (built once, by :func:`multigrid`):

* Grids. Level ℓ + 1 keeps the odd-numbered grid rows and columns of level ℓ
  (0-based), so an (ny, nx) grid has an (ny // 2, nx // 2) coarse grid, for
  any ny and nx. A coarse row lives on the rank that holds its fine row:
  coarse row J on the owner of fine row 2J + 1, which makes the coarse
  split ``starts // 2`` of the fine one. As the grids shrink, ranks drop out
  (they hold no coarse rows and skip the coarse levels' messages), so the
  coarse levels gather onto fewer and fewer ranks by construction. The
  coarsest grid (at most 256 points by default) is gathered onto every
  rank and solved directly (an LU factorisation made at setup).
* Transfers. Prolongation P is bilinear interpolation (a fine point between
  coarse points takes their mean). Restriction is R = Pᵀ (full weighting,
  weights (½, 1, ½) ⊗ (½, 1, ½), unscaled). Each costs one halo exchange of
  one grid row each way on the fine level.
* Coarse operators. Galerkin products A_{ℓ+1} = R A_ℓ P, which are again
  3 × 3 stencils (:class:`~distlinalg.operators.Stencil2D`). Their
  coefficients are computed from A_ℓ's by stencil algebra
  (:func:`galerkin_coefficients`: P and R are tensor products of
  (½, 1, ½), so one pass along the columns and one along the rows, and
  one halo exchange of boundary coefficient rows per level; no product).
  The fine operator's coefficients are read from its
  ``stencil_coefficients()`` (laplacian_2d, stencil_2d). An operator that
  only declares its grid (``stencil_grid``) and is a stencil of at most
  3 × 3 points has them found by probing: A applied to the 9 indicator
  vectors of the grid points (J mod 3, K mod 3) gives every coefficient,
  because two points of a class are at least three apart (9 products at
  setup). Probing R A P as well, as this module did first, cost more than
  half a solve at n = 2000 (docs/preconditioners.md, "What was tried").
* Smoothing. Chebyshev (default; degree 2: one matvec) or damped Jacobi, in
  D⁻¹A on the interval [hi/4, hi], hi the Gershgorin bound of D⁻¹A (an upper
  bound: so the smoother converges and the cycle is positive definite). No
  inner products: a V-cycle's messages are halo rows, plus one allgather of
  the coarsest grid.

The cycle (W by default: the coarse correction twice; or V) pre-smooths,
corrects from the coarse level, and post-smooths with the same polynomial, so
the preconditioner is symmetric (positive definite for symmetric positive
definite A): CG takes it. On the 2-D Laplacian, CG with it reaches rtol
1e-8 in 5-6 iterations from n = 128 to n = 2000 (benchmarks/results_multigrid.md).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np

from .._runtime.mpi import Communicator, ReduceOp
from ..comm.allreduce import allreduce
from ..operators import LinearOperator, linearise, operator_class, static
from ..operators._partition import Partition
from ..operators.stencil import Stencil2D, StencilGrid, grid_neighbours, halo_rows, stencil_entries, half_stored_stencil
from ._arguments import agree_options
from .chebyshev import chebyshev_polynomial

COARSEST_POINTS = 256  # coarsen until the grid has at most this many points (its LU: 11 MFlop at setup)
MAX_DIRECT_POINTS = 4096  # the coarsest grid's dense LU lives on every rank: at most 4096² entries
LOWER_FRACTION = 0.25  # the smoother's interval is [hi · this, hi]: the upper part of D⁻¹A's spectrum
SMOOTHERS = ("chebyshev", "jacobi")
CYCLES = ("V", "W")


# ---------------------------------------------------------------------------
# Grids and transfers
def plan_grids(grid: StencilGrid, levels: int | None) -> list[StencilGrid]:
    """The grids of the hierarchy, finest first (module docstring)."""
    grids = [grid]
    while True:
        (ny, nx), partition = grids[-1].shape, grids[-1].row_partition
        if levels is None and ny * nx <= COARSEST_POINTS:
            break
        if levels is not None and len(grids) == levels:
            break
        if ny // 2 < 1 or nx // 2 < 1:
            if levels is None:
                break
            raise ValueError(f"distlinalg.solvers.multigrid: a {grid.shape[0]} × {grid.shape[1]} grid has at most "
                             f"{len(grids)} levels (levels={levels} asked for more)")
        coarse = Partition(tuple(s // 2 for s in partition.starts))
        grids.append(StencilGrid((ny // 2, nx // 2), coarse))
    return grids


def _interleave(between: jax.Array, points: jax.Array, axis: int) -> jax.Array:
    """[between₀, points₀, between₁, points₁, …, points_{k−1}, between_k] along `axis` (k points, k + 1 between)."""
    k = points.shape[axis]
    head = jnp.stack([jax.lax.slice_in_dim(between, 0, k, axis=axis), points], axis=axis + 1)
    shape = list(points.shape)
    shape[axis] = 2 * k
    return jnp.concatenate([head.reshape(shape), jax.lax.slice_in_dim(between, k, k + 1, axis=axis)], axis=axis)


def _halo(u: jax.Array, grid: StencilGrid, comm: Communicator) -> tuple[jax.Array, jax.Array]:
    """(row above, row below) of a block of rows of `grid`'s split (zeros at the grid's edges).

    `u` may have no rows (a rank whose fine rows hold no coarse row): it
    still exchanges with its neighbours on the grid, sending zeros, which
    they do not use (a coarse row lives on the rank of its fine row).
    """
    mine, up, down = grid_neighbours(grid.row_partition, comm)
    if not mine:
        zero = jnp.zeros(u.shape[1:], u.dtype)
        return zero, zero
    if u.shape[0] == 0:
        # A zero row made from u (not jnp.zeros), so that under vmap it is batched as u is: the
        # neighbours' messages have the batch's size.
        return halo_rows(jnp.pad(u, ((0, 1),) + ((0, 0),) * (u.ndim - 1)), up, down, comm)
    return halo_rows(u, up, down, comm)


def restrict(r: jax.Array, fine: StencilGrid, coarse: StencilGrid, comm: Communicator) -> jax.Array:
    """R r = Pᵀ r: full weighting onto the coarse points, weights (½, 1, ½) ⊗ (½, 1, ½) (flat in, flat out).

    Coarse point (J, K) is fine point (2J + 1, 2K + 1); it gathers fine rows
    2J … 2J + 2, of which the first or the last may be a neighbour's (one
    halo row each way on the fine grid).
    """
    rows, nx = fine.row_partition.size_of(comm.rank), fine.shape[1]
    coarse_rows, coarse_nx = coarse.row_partition.size_of(comm.rank), coarse.shape[1]
    if not rows:
        return r
    u = r.reshape(rows, nx)
    above, below = _halo(u, fine, comm)
    extended = jnp.concatenate([above[None], u, below[None]])  # fine rows s − 1 … e
    parity = fine.row_partition.starts[comm.rank] % 2
    rows_at = lambda first: extended[first :: 2][:coarse_rows]  # noqa: E731
    t = rows_at(2 - parity) + 0.5 * (rows_at(1 - parity) + rows_at(3 - parity))
    t = jnp.pad(t, ((0, 0), (0, 1)))  # fine column nx (beyond the grid) is zero
    cols_at = lambda first: t[:, first::2][:, :coarse_nx]  # noqa: E731
    return (cols_at(1) + 0.5 * (cols_at(0) + cols_at(2))).reshape(-1)


def prolong(e: jax.Array, fine: StencilGrid, coarse: StencilGrid, comm: Communicator) -> jax.Array:
    """P e: bilinear interpolation of a coarse vector onto the fine grid (flat in, flat out).

    A fine point on a coarse row and column takes its value; between two it
    takes their mean (zero beyond the grid). This rank's first or last fine
    row may lie between its coarse rows and a neighbour's (one halo row each
    way on the fine grid).
    """
    rows, nx = fine.row_partition.size_of(comm.rank), fine.shape[1]
    coarse_rows, coarse_nx = coarse.row_partition.size_of(comm.rank), coarse.shape[1]
    if not rows:
        return jnp.zeros((0,), e.dtype)
    c = e.reshape(coarse_rows, coarse_nx)
    # Columns first (local): fine columns 0 … 2·coarse_nx, then the last one dropped where nx is even.
    padded = jnp.pad(c, ((0, 0), (1, 1)))
    y = _interleave(0.5 * (padded[:, :-1] + padded[:, 1:]), c, axis=1)[:, :nx]
    # Then rows: the coarse rows J0 − 1 … J0 + coarse_rows, the neighbours' from the halo.
    above, below = _halo(y, fine, comm)
    z = jnp.concatenate([above[None], y, below[None]])
    sequence = _interleave(0.5 * (z[:-1] + z[1:]), y, axis=0)  # fine rows 2·J0 … 2·(J0 + coarse_rows)
    first = fine.row_partition.starts[comm.rank] % 2
    return sequence[first : first + rows].reshape(-1)


def probe_coefficients(matvec: Any, grid: StencilGrid, comm: Communicator, dtype: Any) -> jax.Array:
    """The (3, 3, rows, nx) coefficients of a stencil operator of at most 3 × 3 points, from 9 products.

    Product (a, b) applies the operator to the indicator of the points (J, K)
    with J ≡ a, K ≡ b (mod 3); at a point (J, K), the neighbour at offset
    (a' − 1, b' − 1) is the only point of its class among the nine, so its
    coefficient is the value there of the product of its class.
    """
    rows, nx = grid.row_partition.size_of(comm.rank), grid.shape[1]
    J = grid.row_partition.starts[comm.rank] + jax.lax.broadcasted_iota(jnp.int32, (rows, nx), 0)
    K = jax.lax.broadcasted_iota(jnp.int32, (rows, nx), 1)
    classes = [(a, b) for a in range(3) for b in range(3)]
    indicators = jnp.stack([((J % 3 == a) & (K % 3 == b)).astype(dtype).reshape(-1) for a, b in classes])
    # The nine products as one batch (one program, one message per halo row for all nine).
    batch = jax.vmap(matvec)(indicators).reshape(9, rows, nx)
    products = {ab: batch[i] for i, ab in enumerate(classes)}

    def of_class(a_of: jax.Array, b_of: jax.Array) -> jax.Array:
        out = jnp.zeros((rows, nx), dtype)
        for (a, b), product in products.items():
            out = jnp.where((a_of == a) & (b_of == b), product, out)
        return out

    return jnp.stack([jnp.stack([of_class((J + da - 1) % 3, (K + db - 1) % 3) for db in range(3)])
                      for da in range(3)])


def stencil_coefficients(A: Any, grid: StencilGrid, comm: Communicator, dtype: Any) -> jax.Array:
    """A's (3, 3, rows, nx) coefficients on this rank's grid rows, the couplings beyond the grid zeroed.

    Read from ``A.stencil_coefficients()`` where the operator has it (no
    product, no message); found by 9 products otherwise (:func:`probe_coefficients`).
    """
    method = getattr(A, "stencil_coefficients", None)
    if method is None:
        return probe_coefficients(linearise(A).matvec, grid, comm, dtype)
    rows, nx = grid.row_partition.size_of(comm.rank), grid.shape[1]
    coefficients = jnp.asarray(method(), dtype)
    problem = "" if coefficients.shape == (3, 3, rows, nx) else (
        f"{type(A).__name__}.stencil_coefficients() must have shape (3, 3, {rows}, {nx}) on rank {comm.rank}, "
        f"got {coefficients.shape}")
    agree_options("distlinalg.solvers (a stencil's coefficients)", problem, "", comm)  # on every rank, before a halo
    return inside_grid(coefficients, grid, comm)


def inside_grid(coefficients: jax.Array, grid: StencilGrid, comm: Communicator) -> jax.Array:
    """The coefficients with every coupling to a point beyond the grid set to zero (what a product sees)."""
    (ny, nx), rows = grid.shape, coefficients.shape[2]
    J = grid.row_partition.starts[comm.rank] + jax.lax.broadcasted_iota(jnp.int32, (rows, nx), 0)
    K = jax.lax.broadcasted_iota(jnp.int32, (rows, nx), 1)
    masked = [[jnp.where((J + a - 1 >= 0) & (J + a - 1 < ny) & (K + b - 1 >= 0) & (K + b - 1 < nx),
                         coefficients[a, b], 0) for b in range(3)] for a in range(3)]
    return jnp.stack([jnp.stack(row) for row in masked])


_WEIGHT = {-1: 0.5, 0: 1.0, 1: 0.5}  # bilinear interpolation's weight at an offset of −1, 0, 1 fine points


def galerkin_coefficients(fine: jax.Array, fine_grid: StencilGrid, coarse_grid: StencilGrid,
                          comm: Communicator) -> jax.Array:
    """The (3, 3, coarse rows, coarse nx) coefficients of R A P, from A's by stencil algebra (no product).

    With coarse point J at fine point 2J + 1 and P's weight w(d) = Π ½^|d_k|
    at fine offset d ∈ {−1, 0, 1}², the coupling of coarse J with J + t is

        C_t(J) = Σ_{d, s} w(d) · A_s(2J + 1 + d) · w(d + s − 2t),

    over the fine offsets d and A's stencil offsets s with d + s − 2t in
    {−1, 0, 1}² (fine point i = 2J + 1 + d couples to i + s, which coarse
    J + t interpolates to). A's couplings beyond the grid must be zero
    (:func:`inside_grid`); fine points beyond it contribute nothing, and
    the couplings to coarse points beyond the coarse grid are set to zero.
    One halo exchange of A's boundary rows (a coarse row reads fine rows
    2J … 2J + 2, of which the first or last may be a neighbour's): 9 fine
    passes where probing took 9 products of R A P.
    """
    cny, cnx = coarse_grid.shape
    rows = fine_grid.row_partition.size_of(comm.rank)
    coarse_rows = coarse_grid.row_partition.size_of(comm.rank)
    if not rows:
        return jnp.zeros((3, 3, 0, cnx), fine.dtype)
    # Columns first, on this rank's fine rows: B[sa, tb](i, K) = Σ_{dc, sb} w(dc) A_(sa, sb)(i, 2K + 1 + dc)
    # w(dc + sb − 2 tb), for coarse columns K (fine column nx, beyond the grid, is zero).
    padded = jnp.pad(fine, ((0, 0), (0, 0), (0, 0), (0, 1)))
    columns = {dc: padded[..., 1 + dc :: 2][..., :cnx] for dc in (-1, 0, 1)}   # (3, 3, rows, cnx) each
    K = jax.lax.broadcasted_iota(jnp.int32, (1, cnx), 1)
    half = jnp.stack([jnp.stack([_coarsened(lambda dc, sb: columns[dc][sa + 1, sb + 1], tb, (K + tb >= 0) & (K + tb < cnx))
                                 for tb in (-1, 0, 1)]) for sa in (-1, 0, 1)])   # (3 sa, 3 tb, rows, cnx)
    # Then rows: C[ta, tb](J, K) = Σ_{dr, sa} w(dr) B[sa, tb](2J + 1 + dr, K) w(dr + sa − 2 ta). A coarse row
    # reads fine rows 2J … 2J + 2, of which the first or last may be a neighbour's (their boundary rows
    # of B travel; B is zero beyond the grid).
    above, below = _halo(jnp.stack([half[:, :, 0], half[:, :, -1]]), fine_grid, comm)
    extended = jnp.concatenate([above[:, :, None], half, below[:, :, None]], axis=2)  # fine rows s − 1 … e
    first = 2 - fine_grid.row_partition.starts[comm.rank] % 2  # row of fine 2J + 1 for the first J
    rows_at = {dr: extended[:, :, first + dr :: 2][:, :, :coarse_rows] for dr in (-1, 0, 1)}
    J = coarse_grid.row_partition.starts[comm.rank] + jax.lax.broadcasted_iota(jnp.int32, (coarse_rows, 1), 0)
    return jnp.stack([jnp.stack([_coarsened(lambda dr, sa: rows_at[dr][sa + 1, tb + 1], ta, (J + ta >= 0) & (J + ta < cny))
                                 for tb in (-1, 0, 1)]) for ta in (-1, 0, 1)])


def _coarsened(term: Any, t: int, inside: jax.Array) -> jax.Array:
    """Σ_{d, s} w(d) term(d, s) w(d + s − 2t) over d, s ∈ {−1, 0, 1} with |d + s − 2t| ≤ 1 (one axis of R A P),
    zero where the coarse neighbour at offset t is beyond the grid."""
    total = sum(_WEIGHT[d] * _WEIGHT[d + s - 2 * t] * term(d, s)
                for d in (-1, 0, 1) for s in (-1, 0, 1) if abs(d + s - 2 * t) <= 1)
    return jnp.where(inside, total, 0)


def gershgorin_upper(coefficients: jax.Array) -> jax.Array:
    """max over this rank's points of Σ|c| / |c_centre|: an upper bound of D⁻¹A's spectrum (0 if no rows)."""
    centre = jnp.abs(coefficients[1, 1])
    sums = jnp.sum(jnp.abs(coefficients), axis=(0, 1))
    ratio = jnp.where(centre > 0, sums / jnp.where(centre > 0, centre, 1), 0)
    return jnp.max(ratio, initial=0.0)


def assemble_dense(coefficients: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """The (ny·nx)² matrix of a stencil from its whole-grid coefficients (3, 3, ny, nx)."""
    rows, cols, values = stencil_entries(coefficients, shape)
    return jnp.zeros((shape[0] * shape[1],) * 2, coefficients.dtype).at[rows, cols].add(values)


# ---------------------------------------------------------------------------
# The preconditioner
@operator_class
class Multigrid(LinearOperator):
    """One multigrid cycle, v ↦ M v ≈ A⁻¹ v, for the operator A it was built from (:func:`multigrid`).

    Attributes:
      A: the fine operator (a child).
      coarse: the Galerkin operators of levels 1, 2, … (:class:`~distlinalg.operators.SymmetricStencil2D`
        for symmetric or Hermitian A, :class:`~distlinalg.operators.Stencil2D` otherwise).
      inverse_diagonals: D⁻¹ of every level but the coarsest (flat, this rank's rows).
      upper: the Gershgorin bound of D⁻¹A per level (replicated).
      lu, pivots: the coarsest level's LU factors (replicated).
      grids: every level's grid, finest first (static).
      smoother, degree, cycle: as passed (static).

    Example:
      >>> import distlinalg as dl
      >>> from distlinalg.operators import laplacian_2d
      >>> M = dl.solvers.multigrid(laplacian_2d(40))    # coarsened until at most 256 points
      >>> M.levels, [grid.shape for grid in M.grids], M.cycle
      (3, [(40, 40), (20, 20), (10, 10)], 'W')
    """

    A: Any
    coarse: tuple
    inverse_diagonals: tuple
    upper: Any
    lu: Any
    pivots: Any
    grids: tuple = static()
    smoother: str = static(default="chebyshev")
    degree: int = static(default=2)
    cycle: str = static(default="W")

    layout = "sharded"
    symmetric = True
    hermitian = True

    @property
    def comm(self) -> Communicator:
        return self.A.comm

    @property
    def levels(self) -> int:
        return len(self.grids)

    @property
    def in_structure(self) -> Any:
        return self.A.in_structure

    @property
    def out_structure(self) -> Any:
        return self.A.in_structure

    def _matvec(self, v: Any) -> Any:
        constant = jax.lax.stop_gradient(self)
        return constant._cycle(0, jnp.asarray(v))

    def _operator(self, level: int) -> Any:
        return self.A.matvec if level == 0 else self.coarse[level - 1].matvec

    def _smooth(self, level: int, b: jax.Array) -> jax.Array:
        """x ≈ A⁻¹ b from x₀ = 0: the smoother's polynomial in D⁻¹A on [hi/4, hi]."""
        hi = self.upper[level]
        dinv = self.inverse_diagonals[level]
        if self.smoother == "jacobi":
            weight = 4 / (3 * hi)  # 2/3 for the 5-point Laplacian (hi = 2)
            x = weight * dinv * b
            for _ in range(self.degree - 1):
                x = x + weight * dinv * (b - self._operator(level)(x))
            return x
        return chebyshev_polynomial(self._operator(level), b, LOWER_FRACTION * hi, hi, self.degree, dinv)

    def _cycle(self, level: int, b: jax.Array) -> jax.Array:
        if level == self.levels - 1:
            return self._direct(b)
        matvec, fine, coarse = self._operator(level), self.grids[level], self.grids[level + 1]
        x = self._smooth(level, b)                                       # pre-smoothing
        residual = restrict(b - matvec(x), fine, coarse, self.comm)      # r_c = R (b − A x)
        if self.cycle == "W" and level + 1 < self.levels - 1:
            # Twice: e_c ← e_c + cycle(r_c − A_c e_c) from e_c = 0, as a loop of two steps, so that the
            # coarse cycle is traced once (called twice in Python, the program would grow like 2^levels:
            # 93 s of compilation at n = 2000 on 2 ranks). The first step's A_c·0 is the price.
            def correct(_: Any, e: jax.Array) -> jax.Array:
                return e + self._cycle(level + 1, residual - self._operator(level + 1)(e))

            correction = jax.lax.fori_loop(0, 2, correct, jnp.zeros_like(residual))
        else:
            correction = self._cycle(level + 1, residual)                # e_c ≈ A_c⁻¹ r_c
        x = x + prolong(correction, fine, coarse, self.comm)             # x ← x + P e_c
        return x + self._smooth(level, b - matvec(x))                    # post-smoothing

    def _direct(self, b: jax.Array) -> jax.Array:
        """The coarsest level: gather b onto every rank, solve with the LU factors, keep this rank's rows."""
        grid, comm = self.grids[-1], self.comm
        (_, nx), partition = grid.shape, grid.row_partition
        whole = partition.allgather(b.reshape(partition.size_of(comm.rank), nx), comm).reshape(-1)
        x = jsl.lu_solve((self.lu, self.pivots), whole)
        start, end = partition.starts[comm.rank], partition.starts[comm.rank + 1]
        return x[start * nx : end * nx]


def multigrid(A: Any, *, levels: int | None = None, smoother: str = "chebyshev", cycle: str = "W",
              degree: int = 2) -> Multigrid:
    """A geometric multigrid preconditioner for a stencil operator on a 2-D grid (:func:`laplacian_2d`).

    Args:
      A: a sharded operator that declares its grid (``A.stencil_grid``: the
        operators :func:`~distlinalg.operators.laplacian_2d` and
        :func:`~distlinalg.operators.stencil_2d`; another operator declares it
        to say that it is a stencil of at most 3 × 3 points on that grid,
        see :class:`~distlinalg.operators.StencilGrid`). Any grid size and
        any rank count (ranks may hold no grid rows).
      levels: the number of grids, finest included (default: coarsen until
        the grid has at most 256 points). The coarsest is solved directly
        on every rank, so it may have at most 4096 points.
      smoother: "chebyshev" (default) or "jacobi" (damped, weight 4/(3·hi)).
      cycle: "W" (default) or "V". On grids of 2^k − 1 points per side both
        keep CG at 6 iterations (rtol 1e-8) from n = 127 to 2047. Other sizes
        coarsen with one coarse spacing of h at an edge, and there the V-cycle
        lets the count grow (6 at n = 128, 11 at n = 2000) where the W-cycle
        keeps it at 5-6, in the same time per solve on 1 and 2 ranks
        (benchmarks/results_multigrid.md). The W-cycle visits level ℓ 2^ℓ
        times: more, smaller messages on the coarse levels, which "V" saves
        where latency dominates.
      degree: the smoother's degree (Chebyshev) or sweeps (Jacobi), before
        and after the coarse correction; d − 1 matvecs each for Chebyshev.

    Returns:
      A :class:`Multigrid` operator (sharded, symmetric: positive definite
      for symmetric positive definite A), usable as ``M=`` in cg, minres,
      gmres and bicgstab and in ``eigsh(method="lobpcg")``. Setup: no
      product where A has ``stencil_coefficients()`` (9 products of A
      otherwise), one halo exchange of coefficient rows per coarse level,
      one allreduce and one allgather of the coarsest grid. Per application on the fine
      level: 2·degree + 1 matvecs (Chebyshev), 2 transfers (one halo
      exchange each); no reduction but the coarsest grid's allgather.
      Eager and inside jit (built inside a jitted function, the setup is
      part of the program).

    AD: a constant of the solve (stop_gradient on everything it holds): the
    derivatives of a solve with M are those of the solve without it.

    Errors (on every rank, before any message): A without a grid, or not
    sharded (TypeError); bad or differing levels, smoother, cycle or degree
    (ValueError).

    Example:
      >>> import jax.numpy as jnp
      >>> import distlinalg as dl
      >>> from distlinalg.operators import laplacian_2d
      >>> A = laplacian_2d(100)                     # 10⁴ unknowns
      >>> b = jnp.ones(A.input_structure.shape)
      >>> M = dl.solvers.multigrid(A)
      >>> M.levels
      4
      >>> x, info = dl.cg(A, b, M=M, rtol=1e-4)   # float32: its rounding floor is near 1e-5 here
      >>> bool(info.converged), int(info.iterations) <= 10
      (True, True)
    """
    grid = getattr(A, "stencil_grid", None)
    if not isinstance(A, LinearOperator) or not isinstance(grid, StencilGrid) or A.layout != "sharded":
        raise TypeError(
            "distlinalg.solvers.multigrid: A must be a sharded operator on a grid that declares it "
            "(stencil_grid: laplacian_2d, stencil_2d, or an operator of your own, see StencilGrid); got "
            f"{type(A).__name__}. For operators without a grid, use another preconditioner "
            "(jacobi, chebyshev)"
        )
    comm = A.comm
    _check_options(levels, smoother, cycle, degree, comm)
    (_, nx), partition = grid.shape, grid.row_partition
    leaves = A.in_structure.leaves if A.in_structure is not None else []
    if len(leaves) != 1 or leaves[0].shape != (partition.size_of(comm.rank) * nx,):
        raise TypeError("distlinalg.solvers.multigrid: A's vectors must be one flat array of this rank's grid "
                        f"rows (shape ({partition.size_of(comm.rank) * nx},)), got {A.in_structure}")
    dtype = leaves[0].dtype
    grids = plan_grids(grid, levels)
    coarsest = grids[-1].shape[0] * grids[-1].shape[1]
    if coarsest > MAX_DIRECT_POINTS:
        raise ValueError(f"distlinalg.solvers.multigrid: the coarsest grid ({grids[-1].shape[0]} × "
                         f"{grids[-1].shape[1]}) would be solved directly on every rank; at most "
                         f"{MAX_DIRECT_POINTS} points: pass more levels")

    A = jax.lax.stop_gradient(A)
    coefficients = [stencil_coefficients(A, grid, comm, dtype)]
    coarse_operators = []
    for level in range(len(grids) - 1):
        f, c = grids[level], grids[level + 1]
        coefficients.append(galerkin_coefficients(coefficients[-1], f, c, comm))
        coarse_operators.append(_coarse_operator(coefficients[-1], c, A, comm))

    upper = allreduce(jnp.stack([gershgorin_upper(c) for c in coefficients]).astype(jnp.finfo(dtype).dtype),
                      ReduceOp.MAX, comm=comm)
    inverse_diagonals = tuple(_inverse(c[1, 1]).reshape(-1) for c in coefficients[:-1])
    last = grids[-1]
    whole = last.row_partition.allgather(jnp.moveaxis(coefficients[-1], 2, 0), comm)  # (ny, 3, 3, nx)
    lu, pivots = jsl.lu_factor(assemble_dense(jnp.moveaxis(whole, 0, 2), last.shape))
    return Multigrid(A=A, coarse=tuple(coarse_operators), inverse_diagonals=inverse_diagonals, upper=upper,
                     lu=lu, pivots=pivots, grids=tuple(grids), smoother=smoother, degree=int(degree), cycle=cycle)


def _coarse_operator(coefficients: jax.Array, grid: StencilGrid, A: Any, comm: Communicator) -> Any:
    """R A P as an operator: stored by half its couplings where A is symmetric or Hermitian (so is R A P:
    R = Pᵀ), which the cycle reads five coefficient arrays of instead of nine."""
    if A.symmetric or A.hermitian:
        return half_stored_stencil(coefficients, grid, comm, hermitian=bool(A.hermitian and not A.symmetric))
    return Stencil2D(coefficients=coefficients, shape=grid.shape, row_partition=grid.row_partition, comm=comm)


def _inverse(diagonal: jax.Array) -> jax.Array:
    return 1 / jnp.where(diagonal == 0, jnp.ones_like(diagonal), diagonal)


def _check_options(levels: Any, smoother: Any, cycle: Any, degree: Any, comm: Communicator) -> None:
    """The same ValueError on every rank for options that are bad, or that differ between ranks."""
    problems = []
    if levels is not None and (not isinstance(levels, (int, np.integer)) or isinstance(levels, bool) or levels < 1):
        problems.append(f"levels must be None or an int >= 1, got {levels!r}")
    if smoother not in SMOOTHERS:
        problems.append(f"smoother must be one of {SMOOTHERS}, got {smoother!r}")
    if cycle not in CYCLES:
        problems.append(f"cycle must be one of {CYCLES}, got {cycle!r}")
    if not isinstance(degree, (int, np.integer)) or isinstance(degree, bool) or degree < 1:
        problems.append(f"degree must be an int >= 1, got {degree!r}")
    agree_options("distlinalg.solvers.multigrid", "; ".join(problems),
                  f"levels={levels!r} smoother={smoother!r} cycle={cycle!r} degree={degree!r}", comm)
