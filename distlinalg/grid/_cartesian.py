"""The Cartesian domain decomposition: which rank holds which block of a global grid.

Everything here is decided from the constructor's arguments and the communicator's size
alone, the same on every rank: the process grid, the split of each axis, this rank's
coordinates, block and neighbours. One exchange at construction checks that every rank
passed the same arguments (``agree_options``), so an argument that differs on one rank
is a ValueError on every rank, before any message of the grid.
"""

from __future__ import annotations

from collections.abc import Sequence
import itertools
from typing import Any

import numpy as np
from mpi4py import MPI

from .._runtime.mpi import PROC_NULL, Communicator, resolve_comm
from ..solvers._arguments import agree_options

_WHERE = "distlinalg.grid.CartesianGrid"
STENCILS = ("star", "box")


def _per_axis(value: Any, ndim: int, what: str, kind: type) -> tuple[Any, ...]:
    """`value` for every axis: one value for all, or a sequence of `ndim` of them."""
    if isinstance(value, (bool, int, np.integer, np.bool_)) and not isinstance(value, Sequence):
        values = (value,) * ndim
    else:
        values = tuple(value)
    if len(values) != ndim:
        raise ValueError(f"{_WHERE}: {what} must be one value or {ndim} (one per axis), got {value!r}")
    if kind is bool:
        if not all(isinstance(v, (bool, np.bool_)) for v in values):
            raise ValueError(f"{_WHERE}: {what} must be booleans, got {value!r}")
        return tuple(bool(v) for v in values)
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) for v in values):
        raise ValueError(f"{_WHERE}: {what} must be integers, got {value!r}")
    return tuple(int(v) for v in values)


def even_split(n: int, parts: int) -> tuple[int, ...]:
    """`n` cells in `parts` blocks as even as possible (the first ``n % parts`` one larger).

    Example:
      >>> from distlinalg.grid import even_split
      >>> even_split(10, 3)
      (4, 3, 3)
    """
    base, extra = divmod(n, parts)
    return tuple(base + (1 if i < extra else 0) for i in range(parts))


def process_grid(size: int, ndim: int, dims: Any = None) -> tuple[int, ...]:
    """The process grid for `size` ranks: `dims` completed by ``MPI_Dims_create`` (0 = free).

    Example:
      >>> from distlinalg.grid import process_grid
      >>> process_grid(4, 2), process_grid(6, 2, dims=(0, 3)), process_grid(8, 3)
      ((2, 2), (2, 3), (2, 2, 2))
    """
    requested = (0,) * ndim if dims is None else _per_axis(dims, ndim, "dims", int)
    if any(d < 0 for d in requested):
        raise ValueError(f"{_WHERE}: dims must be positive (0: chosen for you), got {dims!r}")
    fixed = int(np.prod([d for d in requested if d > 0])) if any(requested) else 1
    if (all(requested) and fixed != size) or size % fixed:
        raise ValueError(
            f"{_WHERE}: dims {tuple(requested)} do not multiply to the communicator's size {size} "
            f"(give 0 for the axes MPI_Dims_create may choose)"
        )
    return tuple(int(d) for d in MPI.Compute_dims(size, list(requested)))


class CartesianGrid:
    """A 2-D or 3-D global grid split into blocks, one per rank, on MPI's Cartesian topology.

    Each rank holds its block of the global array *with halos*: ``halo[a]`` cells on both
    sides of every axis ``a``, copies of the neighbours' cells (or of the other end of a
    periodic axis), filled by :meth:`exchange`. A field is an array of shape
    ``block_shape`` (optionally with trailing component axes); its interior,
    ``field[grid.interior]``, is this rank's part of the global array,
    ``global_array[grid.global_slices]``.

    Args:
      shape: the global grid's shape (2 or 3 axes, each at least 1).
      dims: the process grid (ranks per axis); 0 or None lets ``MPI_Dims_create`` choose.
        Must multiply to the communicator's size.
      periodic: per-axis periodicity (one bool for all axes, or one per axis).
      halo: halo width per axis (an int for all axes, or one per axis; 0 allowed).
      stencil: ``"star"`` (faces only: the 2·ndim neighbours across a face) or ``"box"``
        (faces, edges and corners: all 3**ndim − 1 neighbours).
      splits: per axis, the block sizes along it (``dims[a]`` positive ints summing to
        ``shape[a]``); default :func:`even_split`. Every block must be at least ``halo[a]``
        wide where it has a neighbour along ``a`` to serve.
      comm: the communicator (default distlinalg's); the grid's own Cartesian
        communicator (``grid.comm``) is a new one over the same ranks, ranks unchanged.

    Attributes: ``ndim``, ``shape``, ``dims``, ``periodic``, ``halo``, ``stencil``,
    ``splits``; ``coords`` (this rank's position in the process grid), ``local_shape`` (its
    interior), ``block_shape`` (with halos), ``interior`` (slices of a block: the interior),
    ``global_slices`` (slices of the global array: this rank's interior), ``offsets``
    (global index of the interior's first cell per axis), ``comm`` (the Cartesian
    :class:`~distlinalg.comm.Communicator`), ``rank``, ``size``.

    Construction is collective (``MPI_Cart_create`` and one check that every rank passed the
    same arguments: a mismatch or an invalid argument is a ValueError on every rank).

    Example:
      >>> from distlinalg.grid import CartesianGrid
      >>> grid = CartesianGrid((6, 5), dims=(0, 1), periodic=(False, True), halo=1)
      >>> grid.dims[1], grid.halo, grid.block_shape[1]
      (1, (1, 1), 7)
      >>> grid.allreduce_int(grid.local_shape[0])  # the blocks' rows add up to the grid's
      6
    """

    def __init__(
        self,
        shape: Sequence[int],
        dims: Any = None,
        periodic: Any = False,
        halo: Any = 1,
        stencil: str = "star",
        splits: Sequence[Sequence[int]] | None = None,
        comm: Any = None,
    ):
        parent = resolve_comm(comm)
        problem, signature = "", ""
        try:
            self._decide(shape, dims, periodic, halo, stencil, splits, parent.size, parent.rank)
            signature = repr((self.shape, self.dims, self.periodic, self.halo, self.stencil, self.splits))
        except ValueError as error:
            problem = str(error).removeprefix(f"{_WHERE}: ")
        # Same arguments on every rank (else a ValueError on every rank), before any message.
        agree_options(_WHERE, problem, signature, parent)
        cart = parent.comm.Create_cart(list(self.dims), list(self.periodic), reorder=False)
        cart.Set_errhandler(MPI.ERRORS_RETURN)
        self.comm: Communicator = resolve_comm(cart)
        self.parent = parent
        self._axis_comms: dict[tuple[int, ...], Communicator] = {}

    def _decide(self, shape, dims, periodic, halo, stencil, splits, size, rank) -> None:
        shape = tuple(shape)
        if len(shape) not in (2, 3) or not all(isinstance(n, (int, np.integer)) and n >= 1 for n in shape):
            raise ValueError(f"{_WHERE}: shape must be 2 or 3 positive ints, got {shape!r}")
        self.shape = tuple(int(n) for n in shape)
        self.ndim = ndim = len(shape)
        if stencil not in STENCILS:
            raise ValueError(f"{_WHERE}: stencil must be one of {STENCILS}, got {stencil!r}")
        self.stencil = stencil
        self.periodic = _per_axis(periodic, ndim, "periodic", bool)
        self.halo = _per_axis(halo, ndim, "halo", int)
        if any(h < 0 for h in self.halo):
            raise ValueError(f"{_WHERE}: halo widths must be >= 0, got {halo!r}")
        self.dims = process_grid(size, ndim, dims)
        if splits is None:
            self.splits = tuple(even_split(n, p) for n, p in zip(self.shape, self.dims))
        else:
            self.splits = tuple(tuple(int(b) for b in axis) for axis in splits)
            if len(self.splits) != ndim:
                raise ValueError(f"{_WHERE}: splits must give {ndim} axes, got {len(self.splits)}")
        for a, (blocks, n, p, h) in enumerate(zip(self.splits, self.shape, self.dims, self.halo)):
            if len(blocks) != p or sum(blocks) != n or min(blocks) < 1:
                raise ValueError(
                    f"{_WHERE}: splits[{a}] must be {p} positive block sizes summing to {n}, got {blocks}"
                )
            # A block serves its neighbours its outer `h` cells: it must have them.
            serves = p > 1 or self.periodic[a]
            if serves and min(blocks) < h:
                raise ValueError(
                    f"{_WHERE}: along axis {a} a block of {min(blocks)} cells cannot fill a halo of {h} "
                    f"(splits {blocks}); use fewer ranks along it, a smaller halo or other splits"
                )
        self.size, self.rank = size, rank
        # MPI's Cartesian order: row-major over the process grid, ranks unchanged (reorder=False).
        self.coords = tuple(int(c) for c in np.unravel_index(rank, self.dims))
        self.local_shape = tuple(self.splits[a][c] for a, c in enumerate(self.coords))
        self.offsets = tuple(sum(self.splits[a][:c]) for a, c in enumerate(self.coords))
        self.block_shape = tuple(n + 2 * h for n, h in zip(self.local_shape, self.halo))
        self.interior = tuple(slice(h, h + n) for n, h in zip(self.local_shape, self.halo))
        self.global_slices = tuple(slice(o, o + n) for o, n in zip(self.offsets, self.local_shape))

    # ------------------------------------------------------------------ layout
    def rank_at(self, coords: Sequence[int]) -> int:
        """The rank at process-grid `coords`, wrapped along periodic axes; PROC_NULL off a closed edge."""
        wrapped = []
        for a, c in enumerate(coords):
            if self.periodic[a]:
                c %= self.dims[a]
            elif not 0 <= c < self.dims[a]:
                return PROC_NULL
            wrapped.append(int(c))
        return int(np.ravel_multi_index(wrapped, self.dims))

    def neighbour(self, offset: Sequence[int]) -> int:
        """The rank across `offset` (each entry −1, 0 or +1) from this one, or PROC_NULL.

        Example:
          >>> from distlinalg.grid import CartesianGrid
          >>> grid = CartesianGrid((4, 4), dims=(0, 1), periodic=(False, True))
          >>> grid.neighbour((0, 1)) == grid.rank   # one rank along a periodic axis: itself
          True
        """
        return self.rank_at([c + o for c, o in zip(self.coords, offset)])

    def directions(self) -> list[tuple[int, ...]]:
        """The offsets of the neighbours a halo exchange serves: the faces (star) or every
        neighbour (box), in a fixed order (the same on every rank)."""
        every = [o for o in itertools.product((-1, 0, 1), repeat=self.ndim) if any(o)]
        if self.stencil == "star":
            every = [o for o in every if sum(map(abs, o)) == 1]
        # An axis without halo has nothing to exchange across it.
        return [o for o in every if all(self.halo[a] > 0 for a in range(self.ndim) if o[a])]

    def block_indices(self, axis: int) -> np.ndarray:
        """Global indices of this block's cells along `axis`, halos included (periodic axes
        wrapped into [0, shape); closed axes run past the ends: −1, ..., shape).

        For fields that depend on global coordinates: ``x = grid.block_indices(1) * dx``.

        Example:
          >>> from distlinalg.grid import CartesianGrid
          >>> grid = CartesianGrid((4, 3), dims=(0, 1), periodic=(False, True))
          >>> grid.block_indices(1).tolist()
          [2, 0, 1, 2, 0]
        """
        h, o, n = self.halo[axis], self.offsets[axis], self.local_shape[axis]
        idx = np.arange(o - h, o + n + h)
        return idx % self.shape[axis] if self.periodic[axis] else idx

    def axis_comm(self, axes: int | Sequence[int]) -> Communicator:
        """The communicator of the ranks that share this rank's coordinates on every axis
        not in `axes` (``MPI_Cart_sub``; collective the first time, then cached).

        Example:
          >>> from distlinalg.grid import CartesianGrid
          >>> grid = CartesianGrid((4, 4))
          >>> grid.axis_comm(0).size == grid.dims[0]
          True
        """
        axes = (axes,) if isinstance(axes, (int, np.integer)) else tuple(sorted(set(int(a) for a in axes)))
        if not all(0 <= a < self.ndim for a in axes):
            raise ValueError(f"distlinalg.grid.CartesianGrid.axis_comm: axes must be in [0, {self.ndim}), got {axes}")
        found = self._axis_comms.get(axes)
        if found is None:
            sub = self.comm.comm.Sub([a in axes for a in range(self.ndim)])
            sub.Set_errhandler(MPI.ERRORS_RETURN)
            found = self._axis_comms[axes] = resolve_comm(sub)
        return found

    def allreduce_int(self, value: int) -> int:
        """The sum over ranks of a Python int (an eager mpi4py allreduce, for set-up code)."""
        return int(self.comm.comm.allreduce(int(value)))

    def __repr__(self) -> str:
        return (
            f"CartesianGrid(shape={self.shape}, dims={self.dims}, periodic={self.periodic}, halo={self.halo}, "
            f"stencil={self.stencil!r}, rank {self.rank} at {self.coords} holds {self.local_shape})"
        )

    # The exchange and the transfers live in their own modules (grid/_halo.py, grid/_transfer.py).
    from ._halo import exchange, exchange_finish, exchange_overlapped, exchange_start  # noqa: E402
    from ._transfer import allgather, gather, reduce, scatter  # noqa: E402
    from ._transfer import grid_sum as sum  # noqa: E402, A001
