"""Cartesian domain decomposition: blocks of a global grid, halo exchange, transfers.

``CartesianGrid`` splits a 2-D or 3-D global grid over the ranks (MPI's Cartesian
topology; automatic or given process grid, per-axis periodicity and halo widths, star
or box stencils, uneven splits). ``grid.exchange(fields)`` fills the halos of a pytree of
blocks, every field of a neighbour in one message, differentiable in every mode;
``grid.exchange_start`` / ``exchange_finish`` / ``exchange_overlapped`` split it around
the interior computation. ``grid.scatter`` / ``gather`` / ``allgather`` move blocks to and
from a global array, ``grid.sum`` / ``reduce`` reduce over the grid or one axis.
See docs/grid.md.
"""

from ._cartesian import CartesianGrid, even_split, process_grid
from ._halo import PendingExchange

__all__ = ["CartesianGrid", "PendingExchange", "even_split", "process_grid"]
