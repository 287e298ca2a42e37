"""A non-linear shallow-water model on distlinalg.grid, differentiable end to end.

The physics of the mpi4jax paper's benchmark (a zonal jet in geostrophic balance on a beta
plane, Arakawa C-grid, Adams-Bashforth 2 in time, lateral friction; periodic in x, walls in
y), written on a CartesianGrid: each rank holds a block of every field with a one-cell halo
and the halos are filled by three exchanges per step, each carrying every field it needs
(the fluxes; the vorticity and kinetic energy; the state).

Arrays are indexed [y, x]. In a block with its halo, ``inner(a) = a[1:-1, 1:-1]`` is the
rank's interior and ``east(a)``, ``north(a)``, ... the same cells shifted by one.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from distlinalg.grid import CartesianGrid

GRAVITY = 9.81
DEPTH = 100.0
CORIOLIS_F = 2e-4
CORIOLIS_BETA = 2e-11
DX = DY = 5e3
LATERAL_VISCOSITY = 1e-3 * CORIOLIS_F * DX**2
AB_NEW, AB_OLD = 1.5 + 0.1, -(0.5 + 0.1)  # Adams-Bashforth 2, slightly damped
DT = 0.125 * min(DX, DY) / np.sqrt(GRAVITY * DEPTH)  # CFL
DAY = 86_400.0
PAPER_GRID = (1800, 3600)  # (ny, nx): the mpi4jax paper's benchmark
SMALL_GRID = (180, 360)  # mpi4jax's example file


class State(NamedTuple):
    """Height and velocities, and their last tendencies (for Adams-Bashforth), each a block with halos."""

    h: jax.Array
    u: jax.Array
    v: jax.Array
    dh: jax.Array
    du: jax.Array
    dv: jax.Array


def make_grid(shape=SMALL_GRID, dims=None, splits=None, comm=None) -> CartesianGrid:
    """The model's decomposition: walls in y (axis 0), periodic in x (axis 1), box halos of 1."""
    return CartesianGrid(shape, dims=dims, periodic=(False, True), halo=1, stencil="box", splits=splits, comm=comm)


def inner(a):
    return a[1:-1, 1:-1]


def east(a):
    return a[1:-1, 2:]


def west(a):
    return a[1:-1, :-2]


def north(a):
    return a[2:, 1:-1]


def south(a):
    return a[:-2, 1:-1]


def northeast(a):
    return a[2:, 2:]


def northwest(a):
    return a[2:, :-2]


def southeast(a):
    return a[:-2, 2:]


def with_inner(a, value):
    return a.at[1:-1, 1:-1].set(value)


def coordinates(grid: CartesianGrid):
    """(y, x) of this block's cells, halos included (x wrapped; y runs past the walls), in metres."""
    y = grid.block_indices(0) * DY
    x = grid.block_indices(1) * DX
    return np.meshgrid(y, x, indexing="ij")


def initial_state(grid: CartesianGrid) -> State:
    """A zonal jet in geostrophic balance with a small perturbation, on this rank's block."""
    ny, nx = grid.shape
    length_x, length_y = (nx - 1) * DX, (ny - 1) * DY
    # Balance h_y = -(f/g) u along the whole y axis, walls' ghost rows included.
    y_all = np.arange(-1, ny + 1) * DY
    jet_all = 10 * np.exp(-((y_all - 0.5 * length_y) ** 2) / (0.02 * length_x) ** 2)
    h_all = np.cumsum(-DY * jet_all * (CORIOLIS_F + y_all * CORIOLIS_BETA) / GRAVITY)
    h_all -= h_all[1:-1].mean()
    rows = grid.block_indices(0) + 1  # into y_all
    yy, xx = coordinates(grid)
    u0 = jet_all[rows][:, None] * np.ones_like(xx)
    h0 = DEPTH + h_all[rows][:, None] + 0.2 * np.sin(xx / length_x * 10 * np.pi) * np.cos(yy / length_y * 8 * np.pi)
    zeros = np.zeros(grid.block_shape)
    return State(*(jnp.asarray(a) for a in (h0, u0, zeros, zeros, zeros, zeros)))


def _walls(grid: CartesianGrid, a, *, reflect: bool):
    """`a` with the halo rows beyond the walls set: copies of the rows inside (zero gradient)."""
    if not reflect:
        return a
    if grid.coords[0] == 0:
        a = a.at[0, :].set(a[1, :])
    if grid.coords[0] == grid.dims[0] - 1:
        a = a.at[-1, :].set(a[-2, :])
    return a


def step(grid: CartesianGrid, state: State, first: bool = False) -> State:
    """One time step on every rank's block (halos of the result filled)."""
    h, u, v, dh, du, dv = state
    zeros = jnp.zeros_like(h)
    coriolis = jnp.asarray(CORIOLIS_F + coordinates(grid)[0] * CORIOLIS_BETA)
    hc = _walls(grid, h, reflect=True)

    # Mass fluxes and the height tendency.
    fe = with_inner(zeros, 0.5 * (inner(hc) + east(hc)) * inner(u))
    fn = with_inner(zeros, 0.5 * (inner(hc) + north(hc)) * inner(v))
    fe, fn = grid.exchange((fe, fn))
    dh_new = -(inner(fe) - west(fe)) / DX - (inner(fn) - south(fn)) / DY

    # Potential vorticity and kinetic energy.
    vorticity = inner(coriolis) + (east(v) - inner(v)) / DX - (north(u) - inner(u)) / DY
    q = vorticity / (0.25 * (inner(hc) + east(hc) + north(hc) + northeast(hc)))
    ke = 0.5 * (0.5 * (inner(u) ** 2 + west(u) ** 2) + 0.5 * (inner(v) ** 2 + south(v) ** 2))
    q, ke = grid.exchange((with_inner(zeros, q), with_inner(zeros, ke)))

    # Momentum tendencies: pressure gradient, Coriolis on the fluxes, kinetic energy gradient.
    du_new = (
        -GRAVITY * (east(h) - inner(h)) / DX
        + 0.5 * (inner(q) * 0.5 * (inner(fn) + east(fn)) + south(q) * 0.5 * (south(fn) + southeast(fn)))
        - (east(ke) - inner(ke)) / DX
    )
    dv_new = (
        -GRAVITY * (north(h) - inner(h)) / DY
        - 0.5 * (inner(q) * 0.5 * (inner(fe) + north(fe)) + west(q) * 0.5 * (west(fe) + northwest(fe)))
        - (north(ke) - inner(ke)) / DY
    )

    # Lateral friction, from the velocities' halos (no exchange).
    friction_u = LATERAL_VISCOSITY * ((east(u) - 2 * inner(u) + west(u)) / DX**2 + (north(u) - 2 * inner(u) + south(u)) / DY**2)
    friction_v = LATERAL_VISCOSITY * ((east(v) - 2 * inner(v) + west(v)) / DX**2 + (north(v) - 2 * inner(v) + south(v)) / DY**2)

    new, old = (1.0, 0.0) if first else (AB_NEW, AB_OLD)
    h = with_inner(h, inner(h) + DT * (new * dh_new + old * inner(dh)))
    u = with_inner(u, inner(u) + DT * (new * du_new + old * inner(du) + friction_u))
    v = with_inner(v, inner(v) + DT * (new * dv_new + old * inner(dv) + friction_v))
    if grid.coords[0] == grid.dims[0] - 1:
        v = v.at[-2, :].set(0.0)  # no flow through the northern wall
    h, u, v = grid.exchange((h, u, v))
    return State(h, u, v, with_inner(zeros, dh_new), with_inner(zeros, du_new), with_inner(zeros, dv_new))


def run(grid: CartesianGrid, state: State, steps: int, checkpoints: int | None = None) -> State:
    """`steps` steps after `state` (the first one an Euler step when ``state.dh`` is all zero
    is the caller's business: use :func:`start`). In reverse mode the loop keeps every step's
    state, or, with `checkpoints`, only that many, recomputing the rest (equinox's
    checkpointed scan, treeverse: peak memory of about ``checkpoints + 2`` states)."""

    def body(state, _):
        return step(grid, state), None

    if checkpoints is None:
        return jax.lax.scan(body, state, None, length=steps)[0]
    try:
        import equinox.internal as eqxi
    except ImportError as error:  # pragma: no cover - the lineax extra brings it
        raise ImportError("checkpointed runs need equinox (make lineax, or pip install equinox)") from error
    return eqxi.scan(body, state, None, length=steps, kind="checkpointed", checkpoints=checkpoints)[0]


def start(grid: CartesianGrid, state: State) -> State:
    """The first (Euler) step, after filling the halos of `state` from their owners (so that
    a derivative with respect to a field's block is the one with respect to its interior:
    the exchange's adjoint adds the halos' cotangents into the owners' cells)."""
    h, u, v = grid.exchange((state.h, state.u, state.v))
    return step(grid, state._replace(h=h, u=u, v=v), first=True)
