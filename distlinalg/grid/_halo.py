"""Halo exchange on a CartesianGrid: every field of a neighbour in one message.

The blocking exchange goes axis by axis: along axis a, each rank sends the outer
``halo[a]`` interior layers of every field to its two neighbours and receives their
layers into its halos (two ``sendrecv`` calls, one per direction, each a shift of the
whole process grid: no cycle of waiting ranks). For the box stencil the layers sent
along a later axis span the halos already filled along the earlier ones, so the edges
and corners arrive through the faces: 2·ndim messages in all, for any stencil. The
split-phase form (``exchange_start`` / ``exchange_finish``) posts one message per
neighbour, diagonal ones included for the box stencil, all at once (isend/irecv), so
that the interior computation can run between the two calls.

AD follows from the messages: a halo is overwritten by what arrives (``x.at[halo].set``),
so its cotangent goes back to the owner of the cells, which adds it into theirs (the
owner-accumulating adjoint); the blocking form has every order of both modes, the
split-phase form first order (comm.isend/irecv). vmap batches every field's message.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from .._runtime.mpi import PROC_NULL, check_dtype
from ..comm.nonblocking import Request, wait
from ..comm.nonblocking_p2p import irecv, isend
from ..comm.overlap import overlap
from ..comm.sendrecv import sendrecv
from ..solvers._arguments import agree_options

if TYPE_CHECKING:
    from ._cartesian import CartesianGrid

# Tags on the grid's own communicator: the blocking exchange's 2·ndim directions, then the
# split-phase form's 3**ndim offsets.
_SPLIT_PHASE_TAG = 8


def check_fields(grid: CartesianGrid, leaves: Sequence[Any], where: str) -> None:
    """Every leaf is a block of `grid` with halos (trailing component axes allowed), checked
    on every rank together before any message: a bad field on one rank is a ValueError on
    every rank, and so are fields whose dtypes or component axes differ between ranks."""
    problem = ""
    if not leaves:
        problem = "no fields given"
    for i, leaf in enumerate(leaves):
        shape = tuple(np.shape(leaf))
        if shape[: grid.ndim] != grid.block_shape:
            problem = (
                f"field {i} has shape {shape}; this rank's block with halos is {grid.block_shape} "
                f"(interior {grid.local_shape}, halo {grid.halo}), optionally followed by component axes"
            )
            break
        try:
            check_dtype(jnp.result_type(leaf), where)
        except (TypeError, ValueError) as error:
            problem = f"field {i}: {error}"
            break
    signature = repr([(str(jnp.result_type(leaf)), tuple(np.shape(leaf))[grid.ndim :]) for leaf in leaves])
    agree_options(where, problem, signature, grid.comm)


def _axis_slices(grid: CartesianGrid, axis: int, side: int, *, halo: bool, span: Sequence[slice | None]) -> tuple:
    """Block slices of the layers along `axis` on `side` (+1 high, −1 low): the interior's
    outer layers (`halo` False: what is sent) or the halo beyond them (what is received);
    along the other axes the interior, or `span[a]` where given (the interior and the halos
    already filled along an earlier axis)."""
    out = []
    for a in range(grid.ndim):
        h, n = grid.halo[a], grid.local_shape[a]
        if a == axis:
            if halo:
                out.append(slice(h + n, n + 2 * h) if side > 0 else slice(0, h))
            else:
                out.append(slice(n, n + h) if side > 0 else slice(h, 2 * h))
        else:
            out.append(slice(h, h + n) if span[a] is None else span[a])
    return tuple(out)


def _offset_slices(grid: CartesianGrid, offset: Sequence[int], *, halo: bool) -> tuple:
    """Block slices of the region toward `offset` (entries −1, 0, +1): the interior cells
    next to that side (`halo` False) or the halo on that side (`halo` True)."""
    out = []
    for a, o in enumerate(offset):
        h, n = grid.halo[a], grid.local_shape[a]
        if o == 0:
            out.append(slice(h, h + n))
        elif halo:
            out.append(slice(h + n, n + 2 * h) if o > 0 else slice(0, h))
        else:
            out.append(slice(n, n + h) if o > 0 else slice(h, 2 * h))
    return tuple(out)


def _groups(leaves: Sequence[Any]) -> list[list[int]]:
    """Leaf indices grouped by dtype (one message per dtype), in first-seen order."""
    groups: dict[Any, list[int]] = {}
    for i, leaf in enumerate(leaves):
        groups.setdefault(jnp.result_type(leaf), []).append(i)
    return list(groups.values())


def _pack(leaves: Sequence[Any], indices: Sequence[int], region: tuple) -> Any:
    parts = [jnp.ravel(leaves[i][(*region, Ellipsis)]) for i in indices]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def _unpack(leaves: list[Any], indices: Sequence[int], region: tuple, message: Any) -> None:
    start = 0
    for i in indices:
        shape = leaves[i][(*region, Ellipsis)].shape
        size = int(np.prod(shape))
        leaves[i] = leaves[i].at[(*region, Ellipsis)].set(message[start : start + size].reshape(shape))
        start += size


def exchange(self: CartesianGrid, fields: Any) -> Any:
    """Fill the halos of `fields` (a pytree of blocks with halos) from the neighbours.

    Args:
      fields: an array or pytree of arrays, each of shape ``grid.block_shape`` (plus any
        trailing component axes, the same on every rank); dtypes may differ (one message
        per dtype per direction).

    Returns:
      `fields` with every halo cell that has an owner (a neighbour, or the other end of a
      periodic axis) set to that owner's value; halos beyond a closed edge keep theirs
      (set them as the boundary condition requires). Interiors are unchanged.

    Messages: two per axis (one per direction) whatever the number of fields: 4 in 2-D,
    6 in 3-D; for the box stencil the edges and corners arrive through the faces.

    AD: every order of forward and reverse mode; the transpose of the exchange adds each
    halo's cotangent into the owner's cells and zeroes the halo's (the owner-accumulating
    adjoint). vmap, scan, remat: as its messages (``comm.sendrecv``).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from distlinalg.grid import CartesianGrid
      >>> grid = CartesianGrid((4, 3), dims=(0, 1), periodic=True, stencil="box")
      >>> u = jnp.zeros(grid.block_shape).at[grid.interior].set(1.0)
      >>> u = jax.jit(grid.exchange)(u)
      >>> float(u.sum()) == (grid.local_shape[0] + 2) * 5   # every halo has an owner
      True
    """
    leaves, tree = jax.tree_util.tree_flatten(fields)
    leaves = [jnp.asarray(leaf) for leaf in leaves]
    check_fields(self, leaves, "distlinalg.grid.CartesianGrid.exchange")
    span: list[slice | None] = [None] * self.ndim
    for axis in range(self.ndim):
        if self.halo[axis] == 0:
            continue
        for k, side in enumerate((+1, -1)):
            step = [0] * self.ndim
            step[axis] = side
            dest, source = self.neighbour(step), self.neighbour([-s for s in step])
            if dest == PROC_NULL and source == PROC_NULL:
                continue  # no rank sends to this one in this direction, nor does it send
            # Sent: the layers on `side`; received into the halo on the other side.
            sent = _axis_slices(self, axis, side, halo=False, span=span)
            into = _axis_slices(self, axis, -side, halo=True, span=span)
            for group in _groups(leaves):
                got = sendrecv(
                    _pack(leaves, group, sent), _pack(leaves, group, into), source, dest,
                    sendtag=2 * axis + k, recvtag=2 * axis + k, comm=self.comm,
                )
                _unpack(leaves, group, into, got)
        if self.stencil == "box":
            # Later axes carry this axis's halos too (edges and corners), but only those with
            # an owner: a halo beyond a closed edge keeps its values, as the split-phase form
            # leaves it. Ranks that exchange along a later axis share this axis's coordinate,
            # so they agree on the extent.
            h, n = self.halo[axis], self.local_shape[axis]
            low = [0] * self.ndim
            low[axis] = -1
            high = [0] * self.ndim
            high[axis] = 1
            span[axis] = slice(0 if self.neighbour(low) != PROC_NULL else h,
                               n + 2 * h if self.neighbour(high) != PROC_NULL else h + n)
    return jax.tree_util.tree_unflatten(tree, leaves)


@dataclass
class PendingExchange:
    """A split-phase halo exchange under way (from :meth:`CartesianGrid.exchange_start`).

    Its ``requests`` are the receives and sends posted (for ``comm.overlap``).

    Example:
      >>> import jax.numpy as jnp
      >>> from distlinalg.grid import CartesianGrid, PendingExchange
      >>> grid = CartesianGrid((4, 4), periodic=True)
      >>> pending = grid.exchange_start(jnp.ones(grid.block_shape))
      >>> isinstance(pending, PendingExchange), grid.exchange_finish(pending).shape == grid.block_shape
      (True, True)
    """

    leaves: list[Any]
    tree: Any
    receives: list[tuple[tuple, list[int], Request]]  # (halo region, leaf indices, request)
    sends: list[Request]

    @property
    def requests(self) -> list[Request]:
        return [r for _, _, r in self.receives] + self.sends


def exchange_start(self: CartesianGrid, fields: Any) -> PendingExchange:
    """Start a halo exchange of `fields`; :meth:`exchange_finish` completes it.

    One message per neighbour and dtype (the faces; edges and corners too for the box
    stencil), all posted at once. Between the two calls, compute what does not read the
    halos (the interior update) to hide the messages behind it, or pass that computation
    to :meth:`exchange_overlapped`, which pins it between them under jit.

    Args:
      fields: as for :meth:`exchange`.

    Returns:
      A :class:`PendingExchange`.

    AD: first order, both modes (comm.isend/irecv); vmap as they do.

    Example:
      >>> import jax.numpy as jnp
      >>> from distlinalg.grid import CartesianGrid
      >>> grid = CartesianGrid((4, 4), periodic=True, stencil="box")
      >>> u = jnp.ones(grid.block_shape)
      >>> pending = grid.exchange_start(u)
      >>> inner = 2.0 * u[grid.interior]            # work that needs no halo
      >>> float(grid.exchange_finish(pending).sum()) == u.size
      True
    """
    leaves, tree = jax.tree_util.tree_flatten(fields)
    leaves = [jnp.asarray(leaf) for leaf in leaves]
    check_fields(self, leaves, "distlinalg.grid.CartesianGrid.exchange_start")
    every = [tuple(o) for o in np.ndindex(*(3,) * self.ndim)]
    receives, sends = [], []
    for offset in self.directions():
        tag = _SPLIT_PHASE_TAG + every.index(tuple(o + 1 for o in offset))
        dest, source = self.neighbour(offset), self.neighbour([-o for o in offset])
        if dest == PROC_NULL and source == PROC_NULL:
            continue
        # What travels toward `offset` lands in the receiver's halo on the side −offset.
        sent = _offset_slices(self, offset, halo=False)
        into = _offset_slices(self, [-o for o in offset], halo=True)
        for group in _groups(leaves):
            receives.append((into, group, irecv(_pack(leaves, group, into), source, tag=tag, comm=self.comm)))
            sends.append(isend(_pack(leaves, group, sent), dest, tag=tag, comm=self.comm))
    return PendingExchange(leaves, tree, receives, sends)


def exchange_finish(self: CartesianGrid, pending: PendingExchange) -> Any:
    """Complete a split-phase exchange: `fields` with their halos filled (as :meth:`exchange`).

    Example:
      See :meth:`exchange_start`.
    """
    if not isinstance(pending, PendingExchange):
        raise TypeError("distlinalg.grid.CartesianGrid.exchange_finish: expected what exchange_start returned")
    return _with_received(pending, [wait(r) for r in pending.requests])


def _with_received(pending: PendingExchange, results: Sequence[Any]) -> Any:
    """The pending fields with what each receive brought written into its halo (the
    receives' results come first in `results`, as in ``pending.requests``)."""
    leaves = list(pending.leaves)
    for (into, group, _), got in zip(pending.receives, results):
        _unpack(leaves, group, into, got)
    return jax.tree_util.tree_unflatten(pending.tree, leaves)


def exchange_overlapped(self: CartesianGrid, fields: Any, fn: Callable[..., Any], *args: Any) -> tuple[Any, Any]:
    """``(exchange(fields), fn(*args))`` with `fn` computed while the halos travel.

    The split-phase exchange with `fn` pinned between its start and its finish under jit
    (``comm.overlap``); `fn` must not need the new halos (the interior update).

    AD: first order, both modes; in reverse mode `fn`'s backward pass runs while the
    halos' cotangents travel.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from distlinalg.grid import CartesianGrid
      >>> grid = CartesianGrid((4, 4), periodic=True)
      >>> u = jnp.ones(grid.block_shape)
      >>> u, inner = jax.jit(lambda u: grid.exchange_overlapped(u, lambda v: 2 * v[grid.interior], u))(u)
      >>> float(inner.sum()) == 2 * grid.local_shape[0] * grid.local_shape[1]
      True
    """
    pending = exchange_start(self, fields)
    if not pending.requests:
        return _with_received(pending, []), fn(*args)
    results, out = overlap(pending.requests, fn, *args)
    return _with_received(pending, results), out
