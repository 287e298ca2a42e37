"""distlinalg.grid: CartesianGrid's layout, halo exchange (values, pytrees, AD, split phase, vmap),
transfers and reductions, and its errors.

Every value is checked against numpy/jnp on the global array (the same random array on every
rank, from one seed): the exchange against the global index of each block cell, derivatives
against the same computation done on the padded global array in one process. Each rank checks
its own block and the ranks compare their outcomes (assert_no_failures), so a wrong value on one
rank fails the test on every rank alike. The layouts are chosen from the world's size: the
process grid is a column of ranks along one axis (1, 2 or 3 is prime: no 2-D process grid), with
even and uneven splits, closed and periodic axes, halo widths 0, 1 and 2.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distlinalg._runtime.mpi import PROC_NULL
from distlinalg.comm.allreduce import allreduce
from distlinalg.grid import CartesianGrid, PendingExchange, even_split

from conftest import assert_no_failures, failure_of

SENTINEL = -7.0

# Uneven splits, one entry per rank along the split axis, none of them the default even split.
UNEVEN_7 = {1: (7,), 2: (2, 5), 3: (2, 3, 2)}
UNEVEN_7_HALO_2 = {1: (7,), 2: (3, 4), 3: (2, 2, 3)}
UNEVEN_4 = {1: (4,), 2: (1, 3), 3: (1, 2, 1)}

# Layouts by name, each a function of the world's size giving CartesianGrid's arguments.
LAYOUTS = {
    "2d-closed-h1": lambda size: dict(shape=(7, 5), dims=(size, 1), periodic=False, halo=1),
    "2d-periodic-h2": lambda size: dict(shape=(7, 5), dims=(size, 1), periodic=True, halo=2),
    "2d-mixed-uneven": lambda size: dict(shape=(7, 5), dims=(size, 1), periodic=(False, True), halo=1,
                                         splits=(UNEVEN_7[size], (5,))),
    # A periodic axis split over every rank, per-axis halo widths.
    "2d-periodic-split-axis1": lambda size: dict(shape=(4, 7), dims=(1, size), periodic=(False, True), halo=(1, 2),
                                                 splits=((4,), UNEVEN_7_HALO_2[size])),
    # The process grid chosen by MPI_Dims_create.
    "3d-closed-auto": lambda size: dict(shape=(5, 4, 3), dims=None, periodic=False, halo=1),
    # Axis 1 split unevenly (a block of one cell), a periodic axis without halo.
    "3d-mixed-uneven": lambda size: dict(shape=(5, 4, 3), dims=(1, size, 1), periodic=(True, False, True),
                                         halo=(2, 1, 0), splits=((5,), UNEVEN_4[size], (3,))),
}


def make_grid(layout, comm, stencil="star"):
    return CartesianGrid(**LAYOUTS[layout](comm.Get_size()), stencil=stencil, comm=comm)


def assert_in_step(comm):
    """A final collective: every rank is still at the same point of the program."""
    np.testing.assert_allclose(allreduce(jnp.ones(1), comm=comm), [comm.Get_size()])


def global_array(shape, seed=0, components=(), scale=1.0):
    """The same random global array on every rank (one seed)."""
    return scale * np.random.default_rng(seed).standard_normal((*shape, *components))


def mismatch(actual, expected, what, *, rtol=0.0, atol=0.0):
    """"" when `actual` matches `expected` (shape, and values exactly by default), else what differs."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    try:
        assert actual.shape == expected.shape, f"shape {actual.shape}, expected {expected.shape}"
        np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)
    except AssertionError as error:
        return f"{what}: {error}"
    return ""


def assert_all_match(failures, comm):
    assert_no_failures("; ".join(f for f in failures if f), comm)


def block_of(grid, G, fill=SENTINEL, dtype=np.float64):
    """This rank's block: the interior G[global_slices], every halo cell `fill` (or the array `fill`)."""
    components = G.shape[grid.ndim:]
    block = np.broadcast_to(np.asarray(fill, dtype), (*grid.block_shape, *components)).copy()
    block[grid.interior] = G[grid.global_slices]
    return block


def cell_indices(grid, axis):
    """Global indices (unwrapped) of the block's cells along `axis`, from the splits."""
    start = sum(grid.splits[axis][: grid.coords[axis]])
    h, n = grid.halo[axis], grid.splits[axis][grid.coords[axis]]
    return np.arange(start - h, start + n + h)


def halo_map(grid):
    """Per block cell: its global index (wrapped on periodic axes, clipped), whether that index
    lies in the global grid, and along how many axes the cell is in the halo."""
    wrapped, inside, halo_axes = [], [], []
    for a in range(grid.ndim):
        idx = cell_indices(grid, a)
        n = grid.shape[a]
        if grid.periodic[a]:
            idx = idx % n
        h, m = grid.halo[a], len(idx)
        wrapped.append(np.clip(idx, 0, n - 1))
        inside.append((idx >= 0) & (idx < n))
        halo_axes.append((np.arange(m) < h) | (np.arange(m) >= m - h))
    inside_all = np.logical_and.reduce(np.broadcast_arrays(*along_axes(inside)))
    count = np.broadcast_to(sum(along_axes([x.astype(int) for x in halo_axes])), inside_all.shape)
    return wrapped, inside_all, count


def along_axes(vectors):
    """One 1-D array per axis, each shaped to broadcast along its own axis (np.ix_ without its boolean rule)."""
    ndim = len(vectors)
    return [np.reshape(v, [-1 if b == a else 1 for b in range(ndim)]) for a, v in enumerate(vectors)]


def filled_cells(grid):
    """Halo cells the exchange fills: those with an owner (their global index inside the grid);
    for the star stencil only those in the halo along one axis (faces)."""
    _, inside, count = halo_map(grid)
    filled = inside & (count >= 1)
    return filled & (count <= 1) if grid.stencil == "star" else filled


def expected_exchange(grid, G, block):
    """`block` with every filled halo cell set to G at its global index (the reference)."""
    wrapped, _, _ = halo_map(grid)
    block = np.asarray(block)
    mask = filled_cells(grid).reshape(grid.block_shape + (1,) * (block.ndim - grid.ndim))
    return np.where(mask, G[np.ix_(*wrapped)].astype(block.dtype), block)


def assemble(grid, block, comm):
    """The global array of every rank's interior, on every rank (mpi4py, not the grid's transfers)."""
    block = np.asarray(block)
    out = np.zeros(grid.shape + block.shape[grid.ndim:], block.dtype)
    for slices, interior in comm.allgather((grid.global_slices, block[grid.interior])):
        out[slices] = interior
    return out


def expected_transpose(grid, cotangent, comm):
    """The owner-accumulating adjoint of the exchange applied to this rank's `cotangent`: each
    filled halo cell's cotangent added into the cell of the global grid it copies, on its
    owner; the filled halo cells' own cotangent zero (from every rank's cotangent)."""
    wrapped, _, _ = halo_map(grid)
    filled = filled_cells(grid)
    cotangent = np.asarray(cotangent)
    index = np.broadcast_arrays(*np.ix_(*wrapped))
    everyone = comm.allgather(([i[filled] for i in index], cotangent[filled]))
    total = np.zeros(grid.shape + cotangent.shape[grid.ndim:])
    for cells, values in everyone:
        np.add.at(total, tuple(cells), values)
    out = np.where(filled.reshape(filled.shape + (1,) * (cotangent.ndim - grid.ndim)), 0.0, cotangent)
    out[grid.interior] += total[grid.global_slices]
    return out


# ---------------------------------------------------------------------------
# Layout
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_tiles_the_global_grid(comm, rank, size, layout):
    """Coordinates, blocks, global indices, neighbours and axis communicators of every layout."""
    spec = LAYOUTS[layout](size)
    grid = make_grid(layout, comm)
    ndim = len(spec["shape"])
    halo = (spec["halo"],) * ndim if isinstance(spec["halo"], int) else spec["halo"]
    failures = []
    if int(np.prod(grid.dims)) != size or (spec["dims"] is not None and grid.dims != spec["dims"]):
        failures.append(f"dims {grid.dims}")
    splits = spec.get("splits") or tuple(even_split(n, p) for n, p in zip(spec["shape"], grid.dims))
    if grid.splits != tuple(tuple(s) for s in splits):
        failures.append(f"splits {grid.splits}, expected {splits}")
    if grid.coords != tuple(grid.comm.comm.Get_coords(rank)):
        failures.append(f"coords {grid.coords}, MPI's {grid.comm.comm.Get_coords(rank)}")
    if grid.comm.rank != rank:
        failures.append(f"the Cartesian communicator renumbered rank {rank} as {grid.comm.rank}")
    lengths = tuple(s.stop - s.start for s in grid.global_slices)
    if grid.local_shape != lengths or grid.block_shape != tuple(n + 2 * h for n, h in zip(lengths, halo)):
        failures.append(f"local {grid.local_shape}, block {grid.block_shape}, slices {grid.global_slices}")
    if grid.interior != tuple(slice(h, h + n) for h, n in zip(halo, lengths)):
        failures.append(f"interior {grid.interior}")
    for a in range(ndim):
        idx = np.arange(grid.offsets[a] - halo[a], grid.offsets[a] + lengths[a] + halo[a])
        if grid.periodic[a]:
            idx = idx % spec["shape"][a]
        failures.append(mismatch(grid.block_indices(a), idx, f"block_indices({a})"))
    # The interiors tile the global grid: every cell exactly once.
    count = np.zeros(spec["shape"], int)
    for slices in comm.allgather(grid.global_slices):
        count[slices] += 1
    failures.append(mismatch(count, np.ones_like(count), "cells covered"))
    # Neighbours from every rank's coordinates.
    coords = comm.allgather(grid.coords)
    for offset in itertools.product((-1, 0, 1), repeat=ndim):
        target = [c + o for c, o in zip(grid.coords, offset)]
        if all(grid.periodic[a] or 0 <= target[a] < grid.dims[a] for a in range(ndim)):
            wanted = tuple(t % d for t, d in zip(target, grid.dims))
            expected = coords.index(wanted)
        else:
            expected = PROC_NULL
        if grid.neighbour(offset) != expected:
            failures.append(f"neighbour({offset}) = {grid.neighbour(offset)}, expected {expected}")
    # The communicator along one axis: the ranks that share the other coordinates.
    for a in range(ndim):
        sub = grid.axis_comm(a)
        peers = sub.comm.allgather(grid.coords)
        others = {tuple(c for b, c in enumerate(p) if b != a) for p in peers}
        if sub.size != grid.dims[a] or len(others) != 1 or sorted(p[a] for p in peers) != list(range(grid.dims[a])):
            failures.append(f"axis_comm({a}): size {sub.size}, peers {peers}")
    assert_all_match(failures, comm)


# ---------------------------------------------------------------------------
# Exchange values
EXCHANGE_CASES = [
    ("2d-closed-h1", "star"), ("2d-closed-h1", "box"), ("2d-periodic-h2", "box"),
    ("2d-mixed-uneven", "star"), ("2d-mixed-uneven", "box"), ("2d-periodic-split-axis1", "box"),
    ("3d-closed-auto", "star"), ("3d-closed-auto", "box"), ("3d-mixed-uneven", "star"), ("3d-mixed-uneven", "box"),
]


@pytest.mark.parametrize("layout,stencil", EXCHANGE_CASES, ids=[f"{a}-{b}" for a, b in EXCHANGE_CASES])
def test_exchange_values(comm, rank, layout, stencil):
    """Every halo cell with an owner holds G at its global index; the others keep the sentinel."""
    grid = make_grid(layout, comm, stencil)
    G = global_array(grid.shape, seed=1)
    block = block_of(grid, G)
    out = jax.jit(grid.exchange)(jnp.asarray(block))
    failures = [mismatch(out, expected_exchange(grid, G, block), f"rank {rank} {grid}")]
    if out.dtype != jnp.float64:
        failures.append(f"dtype {out.dtype}")
    assert_all_match(failures, comm)


PYTREE_CASES = [("2d-mixed-uneven", "box"), ("3d-mixed-uneven", "star")]


@pytest.mark.parametrize("layout,stencil", PYTREE_CASES, ids=[f"{a}-{b}" for a, b in PYTREE_CASES])
def test_exchange_pytree_of_dtypes_and_components(comm, rank, layout, stencil):
    """float64, float32 and a field with a trailing component axis in one call: each as alone."""
    grid = make_grid(layout, comm, stencil)
    G64, G32, Gc = global_array(grid.shape, 2), global_array(grid.shape, 3), global_array(grid.shape, 4, (2,))
    fields = {"u": jnp.asarray(block_of(grid, G64)),
              "rest": (jnp.asarray(block_of(grid, G32, dtype=np.float32)), jnp.asarray(block_of(grid, Gc)))}
    together = jax.jit(grid.exchange)(fields)
    alone = [jax.jit(grid.exchange)(leaf) for leaf in jax.tree.leaves(fields)]
    failures = []
    if jax.tree.structure(together) != jax.tree.structure(fields):
        failures.append(f"structure {jax.tree.structure(together)}")
    # Leaves in the pytree's order: "rest" (float32, components), then "u".
    for name, got, single, leaf, G in zip(["float32", "components", "u"], jax.tree.leaves(together), alone,
                                          jax.tree.leaves(fields), [G32, Gc, G64]):
        if got.dtype != leaf.dtype or single.dtype != leaf.dtype:
            failures.append(f"{name}: dtype {got.dtype} / {single.dtype}, expected {leaf.dtype}")
        failures.append(mismatch(got, single, f"rank {rank} {name}: together against alone"))
        expected = expected_exchange(grid, G.astype(leaf.dtype), np.asarray(leaf))
        failures.append(mismatch(got, expected, f"rank {rank} {name}: against the reference"))
    assert_all_match(failures, comm)


# ---------------------------------------------------------------------------
# AD of the exchange
ADJOINT_CASES = [("2d-periodic-h2", "star"), ("2d-mixed-uneven", "box"), ("3d-closed-auto", "star"),
                 ("3d-mixed-uneven", "box")]


@pytest.mark.parametrize("layout,stencil", ADJOINT_CASES, ids=[f"{a}-{b}" for a, b in ADJOINT_CASES])
def test_exchange_adjoint_dot_test_and_jvp(comm, rank, layout, stencil):
    """<E d, w> == <d, E^T w> over the ranks (jax.vjp); jax.jvp gives (E d, E t) (E is linear)."""
    grid = make_grid(layout, comm, stencil)
    rng = np.random.default_rng(100 + rank)
    d, w, t = (jnp.asarray(rng.standard_normal(grid.block_shape)) for _ in range(3))
    Ed = jax.jit(grid.exchange)(d)
    (ETw,) = jax.jit(lambda d, w: jax.vjp(grid.exchange, d)[1](w))(d, w)
    left = comm.allreduce(float(jnp.vdot(Ed, w)))
    right = comm.allreduce(float(jnp.vdot(d, ETw)))
    assert abs(left - right) <= 1e-12 * max(abs(left), abs(right)), (left, right)
    primal, tangent = jax.jit(lambda d, t: jax.jvp(grid.exchange, (d,), (t,)))(d, t)
    # E t's interior and filled halos against the reference (the halo cells without an owner: see
    # test_halos_beyond_a_closed_edge_keep_their_values).
    checked = filled_cells(grid)
    checked[grid.interior] = True
    failures = [mismatch(primal, Ed, f"rank {rank}: jvp's primal"),
                mismatch(tangent, jax.jit(grid.exchange)(t), f"rank {rank}: jvp's tangent against E t"),
                mismatch(np.asarray(tangent)[checked], expected_exchange(grid, assemble(grid, t, comm), t)[checked],
                         f"rank {rank}: E t")]
    assert_all_match(failures, comm)


def stencil_offsets(ndim, stencil):
    every = [o for o in itertools.product((-1, 0, 1), repeat=ndim) if any(o)]
    return [o for o in every if sum(map(abs, o)) == 1] if stencil == "star" else every


def apply_stencil(v, halo, core_shape, offsets):
    """Sum over the stencil's neighbours of (neighbour - centre), on the core of `v` (`halo` wide around it)."""
    def view(o):
        return v[tuple(slice(h + d, h + d + n) for h, d, n in zip(halo, o, core_shape))]

    centre = view((0,) * len(core_shape))
    return sum(view(o) - centre for o in offsets)


def pad_global(U, grid):
    """The global array with the grid's halos around it: wrapped on periodic axes, zero on closed ones."""
    for a in range(grid.ndim):
        pads = [(0, 0)] * U.ndim
        pads[a] = (grid.halo[a], grid.halo[a])
        U = jnp.pad(U, pads, mode="wrap") if grid.periodic[a] else jnp.pad(U, pads)
    return U


RATE, STEPS = 0.1, 3
STEP_CASES = [("2d-mixed-uneven", "star"), ("2d-periodic-h2", "box"), ("3d-closed-auto", "star")]


@pytest.mark.parametrize("layout,stencil", STEP_CASES, ids=[f"{a}-{b}" for a, b in STEP_CASES])
def test_gradient_through_nonlinear_stencil_steps(comm, rank, layout, stencil):
    """jax.grad, jax.jvp and a checkpointed step of 3 steps u <- u + 0.1 lap(E u)**2, against the global program."""
    grid = make_grid(layout, comm, stencil)
    offsets = stencil_offsets(grid.ndim, stencil)
    G = global_array(grid.shape, 5, scale=0.3)
    W = global_array(grid.shape, 6)
    T = global_array(grid.shape, 7)
    interior = grid.interior

    def step(u):
        v = grid.exchange(u)
        lap = apply_stencil(v, grid.halo, grid.local_shape, offsets)
        return u.at[interior].set(v[interior] + RATE * lap**2)

    def final_interior(u0, step=step):
        return jax.lax.fori_loop(0, STEPS, lambda i, u: step(u), u0)[interior]

    w_local = jnp.asarray(W[grid.global_slices])

    def loss(u0, step=step):  # this rank's part of the global loss: no allreduce
        return jnp.sum(w_local * final_interior(u0, step))

    def global_final(U):
        def global_step(i, U):
            return U + RATE * apply_stencil(pad_global(U, grid), grid.halo, grid.shape, offsets) ** 2
        return jax.lax.fori_loop(0, STEPS, global_step, U)

    ref_final, ref_tangent = jax.jit(lambda U, T: jax.jvp(global_final, (U,), (T,)))(jnp.asarray(G), jnp.asarray(T))
    ref_grad = jax.jit(jax.grad(lambda U: jnp.sum(W * global_final(U))))(jnp.asarray(G))
    mine = grid.global_slices

    u0 = jnp.asarray(block_of(grid, G, fill=0.0))
    t0 = jnp.asarray(block_of(grid, T, fill=0.0))
    grad = jax.jit(jax.grad(loss))(u0)
    grad_checkpointed = jax.jit(jax.grad(lambda u: loss(u, jax.checkpoint(step))))(u0)
    primal, tangent = jax.jit(lambda u, t: jax.jvp(final_interior, (u,), (t,)))(u0, t0)
    tol = dict(rtol=1e-11, atol=1e-12 * float(np.max(np.abs(ref_grad))))
    owned_halo = filled_cells(grid)  # overwritten by the first exchange: no gradient
    failures = [
        mismatch(primal, ref_final[mine], f"rank {rank}: final field", rtol=1e-12, atol=1e-14),
        mismatch(tangent, ref_tangent[mine], f"rank {rank}: jvp", rtol=1e-11,
                 atol=1e-12 * float(np.max(np.abs(ref_tangent)))),
        mismatch(grad[interior], ref_grad[mine], f"rank {rank}: grad", **tol),
        mismatch(np.asarray(grad)[owned_halo], np.zeros(int(owned_halo.sum())), f"rank {rank}: grad of filled halos"),
        mismatch(grad_checkpointed, grad, f"rank {rank}: checkpointed step's grad", rtol=1e-13, atol=1e-15),
    ]
    assert_all_match(failures, comm)


# ---------------------------------------------------------------------------
# Split-phase exchange
SPLIT_CASES = [("2d-periodic-split-axis1", "star"), ("2d-periodic-h2", "box"), ("3d-closed-auto", "box"),
               ("3d-mixed-uneven", "star")]


@pytest.mark.parametrize("layout,stencil", SPLIT_CASES, ids=[f"{a}-{b}" for a, b in SPLIT_CASES])
def test_split_phase_equals_blocking(comm, rank, layout, stencil):
    """exchange_start/finish (eager, jit) and exchange_overlapped give the blocking exchange's values and gradient."""
    grid = make_grid(layout, comm, stencil)
    G = global_array(grid.shape, 8)
    u = jnp.asarray(block_of(grid, G))
    interior = grid.interior
    expected = expected_exchange(grid, G, u)
    blocking = jax.jit(grid.exchange)(u)
    pending = grid.exchange_start(u)
    assert isinstance(pending, PendingExchange)
    split_eager = grid.exchange_finish(pending)
    split_jit = jax.jit(lambda u: grid.exchange_finish(grid.exchange_start(u)))(u)
    overlapped, inner = jax.jit(lambda u: grid.exchange_overlapped(u, lambda v: 2.0 * v[interior], u))(u)
    failures = [mismatch(blocking, expected, f"rank {rank}: blocking"),
                mismatch(split_eager, expected, f"rank {rank}: start/finish"),
                mismatch(split_jit, expected, f"rank {rank}: start/finish under jit"),
                mismatch(overlapped, expected, f"rank {rank}: overlapped"),
                mismatch(inner, 2.0 * G[grid.global_slices], f"rank {rank}: overlapped fn's result")]

    # First-order gradient of a loss over the whole exchanged block; for exchange_overlapped plus
    # sum(fn(u)) with fn(u) = u[interior]**2, whose backward pass runs while the cotangents travel.
    W = jnp.asarray(np.random.default_rng(200 + rank).standard_normal(grid.block_shape))

    def overlapped_loss(u):
        v, inner = grid.exchange_overlapped(u, lambda x: x[interior] ** 2, u)
        return jnp.sum(W * jnp.sin(v)) + jnp.sum(inner)

    grads = {
        "blocking": jax.grad(lambda u: jnp.sum(W * jnp.sin(grid.exchange(u)))),
        "start/finish": jax.grad(lambda u: jnp.sum(W * jnp.sin(grid.exchange_finish(grid.exchange_start(u))))),
        "overlapped": jax.grad(overlapped_loss),
    }
    got = {name: jax.jit(fn)(u) for name, fn in grads.items()}
    reference = expected_transpose(grid, np.asarray(W) * np.cos(expected), comm)
    fn_part = block_of(grid, 2.0 * G, fill=0.0)
    for name, g in got.items():
        wanted = reference + fn_part if name == "overlapped" else reference
        failures.append(mismatch(g, wanted, f"rank {rank}: {name} grad", rtol=1e-13, atol=1e-14))
    failures.append(mismatch(got["overlapped"] - fn_part, got["blocking"], f"rank {rank}: overlapped against blocking",
                             rtol=1e-13, atol=1e-14))
    assert_all_match(failures, comm)


@pytest.mark.parametrize("stencil", ["star", "box"])
def test_halos_beyond_a_closed_edge_keep_their_values(comm, rank, stencil):
    """Halo cells beyond a closed edge keep their own values (blocking and split-phase), whatever each rank holds there."""
    grid = CartesianGrid((4, 3), dims=(comm.Get_size(), 1), periodic=(False, True), halo=1, stencil=stencil, comm=comm)
    G = global_array(grid.shape, 9)
    # Rank- and cell-dependent halo values: a copy of another cell's halo shows.
    fill = -(100.0 * (rank + 1) + np.arange(np.prod(grid.block_shape)).reshape(grid.block_shape))
    u = block_of(grid, G, fill=fill)
    expected = expected_exchange(grid, G, u)
    blocking = jax.jit(grid.exchange)(jnp.asarray(u))
    split = grid.exchange_finish(grid.exchange_start(jnp.asarray(u)))
    assert_all_match([mismatch(blocking, expected, f"rank {rank}: blocking"),
                      mismatch(split, expected, f"rank {rank}: start/finish")], comm)


# ---------------------------------------------------------------------------
# Transfers and vmap
@pytest.mark.parametrize("layout,components,root", [("2d-mixed-uneven", (), "first"), ("3d-mixed-uneven", (2,), "last")])
def test_scatter_gather_allgather_round_trip(comm, rank, size, layout, components, root):
    """scatter from the root (None elsewhere) gives each block with its halos; gather and allgather give G back."""
    grid = make_grid(layout, comm, "box")
    root = 0 if root == "first" else size - 1
    G = global_array(grid.shape, 10, components)
    block = grid.scatter(G if rank == root else None, root=root)
    raw = grid.scatter(G if rank == root else None, root=root, fill_halos=False)
    zero_halos = block_of(grid, G, fill=0.0)
    full = jax.jit(lambda b: grid.gather(b, root=root))(block)
    every = jax.jit(grid.allgather)(block)
    failures = [mismatch(raw, zero_halos, f"rank {rank}: scatter without halos"),
                mismatch(block, expected_exchange(grid, G, zero_halos), f"rank {rank}: scatter"),
                mismatch(full, G if rank == root else np.zeros_like(G), f"rank {rank}: gather"),
                mismatch(every, G, f"rank {rank}: allgather")]
    for name, x in [("scatter", block), ("gather", full), ("allgather", every)]:
        if x.dtype != jnp.float64:
            failures.append(f"{name}: dtype {x.dtype}")
    assert_all_match(failures, comm)


VMAP_CASES = [("2d-periodic-split-axis1", "box"), ("3d-mixed-uneven", "star")]


@pytest.mark.parametrize("layout,stencil", VMAP_CASES, ids=[f"{a}-{b}" for a, b in VMAP_CASES])
def test_vmap_exchange_over_a_batch(comm, rank, layout, stencil):
    """vmap of the exchange over a leading batch axis equals a loop of exchanges and the reference."""
    grid = make_grid(layout, comm, stencil)
    Gs = [global_array(grid.shape, 20 + k) for k in range(3)]
    blocks = [block_of(grid, G) for G in Gs]
    batched = jax.jit(jax.vmap(grid.exchange))(jnp.stack(blocks))
    exchange = jax.jit(grid.exchange)
    looped = jnp.stack([exchange(jnp.asarray(b)) for b in blocks])
    expected = np.stack([expected_exchange(grid, G, b) for G, b in zip(Gs, blocks)])
    assert_all_match([mismatch(batched, looped, f"rank {rank}: vmap against a loop"),
                      mismatch(batched, expected, f"rank {rank}: vmap against the reference")], comm)


# ---------------------------------------------------------------------------
# Reductions
@pytest.mark.parametrize("layout", ["2d-mixed-uneven", "2d-periodic-split-axis1", "3d-mixed-uneven"])
def test_reductions_over_the_grid_and_along_each_axis(comm, rank, layout):
    """grid.sum and grid.reduce(op="max") over the grid and along each axis against numpy on G (halos ignored)."""
    grid = make_grid(layout, comm)
    G = global_array(grid.shape, 11)
    field = jnp.asarray(block_of(grid, G, fill=1e3))  # halos larger than any value: a max that reads them shows
    failures = [mismatch(grid.sum(field), G.sum(), f"rank {rank}: sum", rtol=1e-13),
                mismatch(grid.reduce(field, op="max"), G.max(), f"rank {rank}: max"),
                mismatch(jax.jit(grid.sum)(field), G.sum(), f"rank {rank}: jitted sum", rtol=1e-13)]
    for a in range(grid.ndim):
        rest = tuple(s for b, s in enumerate(grid.global_slices) if b != a)
        failures.append(mismatch(grid.sum(field, axis=a), G.sum(axis=a)[rest], f"rank {rank}: sum along {a}",
                                 rtol=1e-13, atol=1e-14))
        failures.append(mismatch(grid.reduce(field, op="max", axis=a), G.max(axis=a)[rest],
                                 f"rank {rank}: max along {a}"))
    assert_all_match(failures, comm)


# ---------------------------------------------------------------------------
# Errors on every rank
def test_wrong_field_on_one_rank_is_an_error_on_every_rank(comm, rank, size):
    """A field of the wrong shape on the last rank only: a ValueError on every rank, before any message."""
    grid = make_grid("2d-mixed-uneven", comm, "box")
    G = global_array(grid.shape, 12)
    good = jnp.asarray(block_of(grid, G))
    bad = jnp.zeros((grid.block_shape[0] + 1, grid.block_shape[1])) if rank == size - 1 else good
    failures = [failure_of(lambda: grid.exchange(bad), r"field 0 has shape"),
                failure_of(lambda: jax.jit(grid.exchange)(bad), r"field 0 has shape"),
                failure_of(lambda: grid.exchange_start({"a": good, "b": bad}), r"field 1 has shape"),
                failure_of(lambda: grid.gather(bad), r"the block has shape"),
                failure_of(lambda: grid.sum(bad), r"the block has shape")]
    if size > 1:  # a dtype or component axes that differ between ranks
        other = good.astype(jnp.float32) if rank == 0 else good
        failures.append(failure_of(lambda: grid.exchange(other), r"the ranks passed different options"))
        components = jnp.stack([good] * (2 if rank == 0 else 3), axis=-1)
        failures.append(failure_of(lambda: grid.exchange(components), r"the ranks passed different options"))
    failures.append(failure_of(lambda: grid.exchange_finish(good), r"expected what exchange_start returned"))
    assert_no_failures("; ".join(f for f in failures if f), comm)
    # Nothing was sent: the communicators are in step and the next exchange is right.
    assert_in_step(comm)
    assert_all_match([mismatch(grid.exchange(good), expected_exchange(grid, G, good), f"rank {rank}: after")], comm)


def test_invalid_grid_arguments_are_an_error_on_every_rank(comm, rank, size):
    """dims that do not multiply to the size, splits that do not sum to the shape, blocks narrower than the halo."""
    cases = [
        (dict(shape=(7, 5), dims=(size + 1, 1)), r"do not multiply to the communicator's size"),
        (dict(shape=(7, 5), dims=(size, 1), splits=(even_split(6, size), (5,))), r"splits\[0\] must be"),
        (dict(shape=(7, 5), dims=(size, 1), splits=(even_split(7, size + 1), (5,))), r"splits\[0\] must be"),
        (dict(shape=(7, 5), dims=(size, 1), splits=(even_split(7, size), (2, 3))), r"splits\[1\] must be"),
        (dict(shape=(7, 1), periodic=(False, True), halo=2, dims=(size, 1)), r"cannot fill a halo of 2"),
        (dict(shape=(7,)), r"shape must be 2 or 3"),
        (dict(shape=(7, 5), stencil="diamond"), r"stencil must be one of"),
    ]
    if size > 1:  # a block of one cell with a neighbour to serve a halo of 2
        cases.append((dict(shape=(7, 5), dims=(size, 1), halo=2, splits=((1, *even_split(6, size - 1)), (5,))),
                      r"cannot fill a halo of 2"))
    failures = [failure_of(lambda: CartesianGrid(**kwargs, comm=comm), pattern) for kwargs, pattern in cases]
    assert_no_failures("; ".join(f for f in failures if f), comm)
    assert_in_step(comm)


def test_different_arguments_on_different_ranks_are_an_error_on_every_rank(comm, rank, size):
    """halo=1 on rank 0 and 2 elsewhere, or an invalid argument on the last rank only: a ValueError on every rank."""
    if size == 1:
        pytest.skip("needs two ranks")
    failures = [
        failure_of(lambda: CartesianGrid((7, 5), dims=(size, 1), halo=1 if rank == 0 else 2, comm=comm),
                   r"the ranks passed different options"),
        failure_of(lambda: CartesianGrid((7, 5), dims=(size, 1), periodic=rank == 0, comm=comm),
                   r"the ranks passed different options"),
        failure_of(lambda: CartesianGrid((7, 5), dims=(size, 1), stencil="diamond" if rank == size - 1 else "box",
                                         comm=comm), rf"invalid options on rank\(s\) \[{size - 1}\]|stencil must be"),
    ]
    assert_no_failures("; ".join(f for f in failures if f), comm)
    assert_in_step(comm)
