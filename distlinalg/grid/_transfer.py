"""Between a global array and a CartesianGrid's blocks, and reductions over the grid.

``scatter``/``gather`` move each rank's interior to or from a root with one
point-to-point message per rank (uneven blocks travel at their own size, no padding);
``allgather`` pads the interiors to the largest block and allgathers them. Reductions
reduce the interior locally and then over the grid's communicator, or over the
sub-communicator of one axis (``CartesianGrid.axis_comm``). Every one is made of
distlinalg.comm operations, so it is differentiable in both modes (the receives take a
tangent whatever their templates: comm/_core.ReceivingPrimitive) and batches under vmap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax.numpy as jnp
import numpy as np

from .._runtime.mpi import check_rank, resolve_op
from ..comm.allgather import allgather as _allgather
from ..comm.allreduce import allreduce
from ..comm.send_recv import recv, send
from ..solvers._arguments import agree_options

if TYPE_CHECKING:
    from ._cartesian import CartesianGrid

_TAG = 64  # on the grid's own communicator, apart from the exchanges' tags


def _block_slices(grid: CartesianGrid, rank: int) -> tuple[slice, ...]:
    coords = np.unravel_index(rank, grid.dims)
    out = []
    for a, c in enumerate(coords):
        start = sum(grid.splits[a][:c])
        out.append(slice(start, start + grid.splits[a][c]))
    return tuple(out)


def _interior_shape(grid: CartesianGrid, rank: int) -> tuple[int, ...]:
    coords = np.unravel_index(rank, grid.dims)
    return tuple(grid.splits[a][c] for a, c in enumerate(coords))


def _with_halos(grid: CartesianGrid, interior: Any) -> Any:
    pads = [(h, h) for h in grid.halo] + [(0, 0)] * (interior.ndim - grid.ndim)
    return jnp.pad(interior, pads)


def scatter(self: CartesianGrid, array: Any, root: int = 0, *, fill_halos: bool = True) -> Any:
    """This rank's block (with halos) of `array`, a global array held by `root`.

    Args:
      array: on `root`, the global array: shape ``grid.shape`` plus any trailing component
        axes; on the other ranks ignored (pass None, or anything). Every rank must agree on
        the trailing axes and dtype, which the root announces: other ranks need not know them.
      root: the rank holding `array`.
      fill_halos: exchange the halos after the scatter (else they are 0).

    Returns:
      A block of shape ``grid.block_shape`` (plus the trailing axes).

    Messages: one per rank other than root, of that rank's interior.

    AD: both modes (the root's sends and the receives are differentiated); the
    transpose gathers the blocks' cotangents back into the root's array.

    Example:
      >>> import numpy as np, jax.numpy as jnp
      >>> from distlinalg.grid import CartesianGrid
      >>> grid = CartesianGrid((5, 4), periodic=True)
      >>> full = jnp.arange(20.0).reshape(5, 4)
      >>> u = grid.scatter(full if grid.rank == 0 else None)
      >>> bool(np.array_equal(u[grid.interior], full[grid.global_slices]))
      True
    """
    where = "distlinalg.grid.CartesianGrid.scatter"
    root = check_rank(root, self.comm, "root", where)
    problem, signature = "", ""
    if self.rank == root:
        array = jnp.asarray(array)
        if tuple(array.shape[: self.ndim]) != self.shape:
            problem = f"the root's array has shape {tuple(array.shape)}; the grid's is {self.shape} (+ components)"
        else:
            signature = "=" + str(array.dtype) + "|" + ",".join(str(n) for n in array.shape[self.ndim :])
    # Every rank learns the root's dtype and component axes (or its error) before any message.
    messages = _announce(self, problem or signature, root, where)
    if self.rank != root and messages.startswith("!"):
        raise ValueError(f"{where}: on the root (rank {root}): {messages[1:]}")
    if problem:
        raise ValueError(f"{where}: {problem}")
    dtype_name, _, components_text = messages[1:].partition("|")
    dtype = np.dtype(dtype_name)
    components = tuple(int(n) for n in components_text.split(",") if n)
    if self.rank == root:
        for r in range(self.size):
            if r != root:
                send(array[_block_slices(self, r)], r, tag=_TAG, comm=self.comm)
        interior = array[_block_slices(self, root)]
    else:
        interior = recv(jnp.zeros((*self.local_shape, *components), dtype), root, tag=_TAG, comm=self.comm)
    block = _with_halos(self, interior)
    return self.exchange(block) if fill_halos else block


def _announce(grid: CartesianGrid, message: str, root: int, where: str) -> str:
    """The root's `message` on every rank (its error prefixed by "!"), by one trace-time allgather."""
    from ..solvers._arguments import _exchange_messages

    text = message if grid.rank != root or message.startswith("=") else "!" + message
    if grid.size == 1:
        return text
    return _exchange_messages(text, grid.comm)[root]


def _check_block(grid: CartesianGrid, block: Any, where: str) -> Any:
    block = jnp.asarray(block)
    problem = ""
    if tuple(block.shape[: grid.ndim]) != grid.block_shape:
        problem = f"the block has shape {tuple(block.shape)}; this rank's block with halos is {grid.block_shape}"
    signature = repr((str(block.dtype), tuple(block.shape[grid.ndim :])))
    agree_options(where, problem, signature, grid.comm)
    return block


def gather(self: CartesianGrid, block: Any, root: int = 0) -> Any:
    """The global array assembled on `root` from every rank's block (halos dropped).

    Args:
      block: this rank's block, shape ``grid.block_shape`` (plus trailing component axes,
        the same on every rank).
      root: the rank receiving the global array.

    Returns:
      On `root` the global array (``grid.shape`` plus the trailing axes); zeros of that
      shape elsewhere (every rank returns the same structure, as ``comm.gather`` does).

    Messages: one per rank other than root, of that rank's interior.

    AD: both modes; the transpose scatters the global cotangent back to the blocks.

    Example:
      >>> import jax.numpy as jnp
      >>> from distlinalg.grid import CartesianGrid
      >>> grid = CartesianGrid((5, 4))
      >>> u = jnp.ones(grid.block_shape)
      >>> full = grid.gather(u)
      >>> float(full.sum()) == (20.0 if grid.rank == 0 else 0.0)
      True
    """
    where = "distlinalg.grid.CartesianGrid.gather"
    root = check_rank(root, self.comm, "root", where)
    block = _check_block(self, block, where)
    interior = block[(*self.interior, Ellipsis)]
    full = jnp.zeros((*self.shape, *block.shape[self.ndim :]), block.dtype)
    if self.rank != root:
        send(interior, root, tag=_TAG + 1, comm=self.comm)
        return full
    for r in range(self.size):
        part = interior if r == root else recv(
            jnp.zeros((*_interior_shape(self, r), *block.shape[self.ndim :]), block.dtype), r,
            tag=_TAG + 1, comm=self.comm,
        )
        full = full.at[(*_block_slices(self, r), Ellipsis)].set(part)
    return full


def allgather(self: CartesianGrid, block: Any) -> Any:
    """The global array on every rank, assembled from every rank's block (halos dropped).

    One allgather of the interiors padded to the largest block. AD: both modes (the
    transpose is a reduce-scatter of the global cotangent: each block gets the sum over
    ranks of its part).

    Example:
      >>> import jax.numpy as jnp
      >>> from distlinalg.grid import CartesianGrid
      >>> grid = CartesianGrid((5, 4))
      >>> float(grid.allgather(jnp.ones(grid.block_shape)).sum())
      20.0
    """
    block = _check_block(self, block, "distlinalg.grid.CartesianGrid.allgather")
    components = block.shape[self.ndim :]
    largest = tuple(max(blocks) for blocks in self.splits)
    interior = block[(*self.interior, Ellipsis)]
    pads = [(0, m - n) for m, n in zip(largest, self.local_shape)] + [(0, 0)] * len(components)
    stacked = _allgather(jnp.pad(interior, pads), comm=self.comm)
    full = jnp.zeros((*self.shape, *components), block.dtype)
    for r in range(self.size):
        shape = _interior_shape(self, r)
        full = full.at[(*_block_slices(self, r), Ellipsis)].set(stacked[(r, *(slice(0, n) for n in shape), Ellipsis)])
    return full


def reduce(self: CartesianGrid, field: Any, op: Any = "sum", axis: int | None = None) -> Any:
    """Reduce the interior of `field` over the whole grid, or along one global axis.

    Args:
      field: a block (``grid.block_shape`` plus trailing component axes).
      op: "sum", "max", "min" or "prod" (as ``comm.allreduce``).
      axis: None: over every grid axis (the result, the trailing axes' shape, is the
        same on every rank); an int a: along global axis a only (over this rank's
        interior, then over the ranks along a: ``grid.axis_comm(a)``), the result shaped
        like the interior without axis a, the same on every rank along a.

    AD: as ``comm.allreduce`` (sum: self-adjoint; every rank's copy of the result
    seeds its own cotangent: for a replicated loss use ``distlinalg.ad.grad``).

    Example:
      >>> import jax.numpy as jnp
      >>> from distlinalg.grid import CartesianGrid
      >>> grid = CartesianGrid((5, 4))
      >>> u = jnp.ones(grid.block_shape)
      >>> float(grid.reduce(u)), grid.reduce(u, axis=0).shape == (grid.local_shape[1],)
      (20.0, True)
    """
    where = "distlinalg.grid.CartesianGrid.reduce"
    if axis is not None and not (isinstance(axis, (int, np.integer)) and 0 <= axis < self.ndim):
        raise ValueError(f"{where}: axis must be None or an int in [0, {self.ndim}), got {axis!r}")
    field = _check_block(self, field, where)
    reduction = resolve_op(op).name.lower()
    local = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min, "prod": jnp.prod}.get(reduction)
    if local is None:
        raise ValueError(f"{where}: op must be sum, max, min or prod, got {op!r}")
    interior = field[(*self.interior, Ellipsis)]
    axes = tuple(range(self.ndim)) if axis is None else (int(axis),)
    comm = self.comm if axis is None else self.axis_comm(int(axis))
    return allreduce(local(interior, axis=axes), op, comm=comm)


def grid_sum(self: CartesianGrid, field: Any, axis: int | None = None) -> Any:
    """``reduce(field, "sum", axis)``: the sum of the interior over the grid (or along one axis).

    Example:
      >>> import jax.numpy as jnp
      >>> from distlinalg.grid import CartesianGrid
      >>> grid = CartesianGrid((5, 4))
      >>> float(grid.sum(jnp.ones(grid.block_shape)))
      20.0
    """
    return reduce(self, field, "sum", axis)
