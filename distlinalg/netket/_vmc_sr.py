"""NetKet's ``VMC_SR`` step over the samples of every rank.

``nk.driver.VMC_SR.compute_loss_and_update`` computes the energy statistics,
the Jacobian and the SR/NTK matrices from the samples of its own process. On a
:class:`distlinalg.netket.MCState` the driver runs :func:`compute_loss_and_update`
instead (installed by :mod:`._paths`), which computes what NetKet computes on
the gathered samples, in NetKet's formulation (so NetKet's ``linear_solver``
sees the same matrix and right-hand side):

    Ō = (O − 1 μ) / √N,   dv = 2 (e − ē) / √N     (N samples of all ranks)

  * ``use_ntk=False`` (SR):   (Ōᵀ Ō + λ I) δ = Ōᵀ dv (+ λ μ_m δ_old, SPRING)
    Ōᵀ Ō and Ōᵀ dv are sums of each rank's blocks (one P × P allreduce).
  * ``use_ntk=True, on_the_fly=False`` (MinSR / SRt):  (Ō Ōᵀ + λ I + proj_reg/M) x = dv − μ_m Ō δ_old,
    δ = Ōᵀ x (+ μ_m δ_old): the M × M kernel (M = N, or 2N in "complex" mode)
    is formed from the ranks' Jacobian rows passed around the ring of ranks
    (:func:`distlinalg.operators.sample_gram.ring_products`; the Jacobian is
    never gathered), the solve runs on the replicated kernel on every rank
    (or on its rows, below), and δ is one parameter-sized allreduce.

  * ``use_ntk=True, on_the_fly=True`` (NetKet's default for the NTK):
    :func:`ntk_onthefly_update`, NetKet's lazy kernel by rows: this rank's rows
    of the NTK against every rank's samples (the samples are gathered; their
    Jacobian rows are made one block at a time, never for all samples at
    once), centred with one allreduce; memory per rank is this rank's rows and
    one block's, plus the replicated kernel (or its rows).

Every Jacobian here is the operators' (:class:`distlinalg.operators.Jacobian`
at NetKet's model, :mod:`._model`): its rows, chunks, products and the sum of
its transposed products over ranks.

With a solver of :mod:`._ntk_solvers` (``dnk.cholesky_distributed``,
``dnk.pinv_smooth_distributed``, NetKet's ``nan_fallback`` of the two, which
replaces NetKet's default ``cholesky_with_fallback`` here), neither path gathers
the kernel: each rank adds λ to its own diagonal entries (and proj_reg/M to all
its entries), solves with its rows of the kernel and of dv through
:mod:`distlinalg.linalg`, and uses its rows of x directly (on the fly, x is
centred with its mean over all samples, one allreduce). Memory per rank is then
O(M²/P) for the kernel.

Rows are real: in "complex" mode each sample gives its (Re, Im) pair, as in
NetKet. The update, the momentum buffer and the solver's info are identical
on every rank. On one rank the driver keeps NetKet's own step (:mod:`._paths`).
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from .._trees import flat_size
from ..comm import allgather
from ..operators import Partition
from ..operators.sample_gram import ring_products
from ._model import dense_rows, from_model_space, model_point
from ._ntk_solvers import default_ntk_solver, row_solver
from ._qgt import flat_samples, sum_over_ranks, tmap

__all__ = ["compute_loss_and_update", "sr_update"]


def centred_energies(local_energies: jax.Array, n_total: int, comm: Any, mode: str) -> jax.Array:
    """dv = 2 (e − ē)/√N over all ranks' samples, in the mode's channels: (n_local,), or
    (n_local, 2) (Re, Im) in "complex" mode."""
    e = local_energies.reshape(-1)
    dv = 2.0 * (e - sum_over_ranks(jnp.sum(e), comm) / n_total) / math.sqrt(n_total)
    return jnp.stack([jnp.real(dv), jnp.imag(dv)], axis=-1) if mode == "complex" else jnp.real(dv)


def _solution(result: Any) -> tuple[jax.Array, Any]:
    if isinstance(result, tuple):
        x, info = result
        return x, ({} if info is None else info)
    return result, {}


@functools.partial(jax.jit, static_argnames=("apply_fun", "solver_fn", "mode", "chunk_size", "use_ntk", "comm"))
def sr_update(apply_fun: Any, local_energies: jax.Array, params: Any, model_state: Any, samples: jax.Array, *,
              diag_shift: Any, solver_fn: Any, mode: str, proj_reg: Any, momentum: Any, old_updates: Any,
              chunk_size: int | None, use_ntk: bool, comm: Any) -> tuple[Any, Any, Any]:
    """NetKet's ``VMC_SR`` update (δ, new momentum buffer, solver info) over all ranks' samples."""
    n_local = samples.shape[0]
    jacobian = model_point(apply_fun, params, model_state, samples, mode=mode, comm=comm,
                           chunk_size=chunk_size).jacobian()
    # This rank's rows of Ō/√N, (Re, Im) of a sample adjacent in "complex" mode, as NetKet orders them.
    O = dense_rows(jacobian).reshape(-1, flat_size(jacobian.theta))
    dv = centred_energies(local_energies, jacobian.n_total, comm, mode).reshape(-1)
    if old_updates is None and momentum is not None:
        old_updates = jnp.zeros(O.shape[-1], O.dtype)
    # NetKet keeps the on-the-fly NTK's momentum buffer as a pytree of the real
    # parameters; its ravelled form is the order of the dense Jacobian's columns.
    buffer_layout = None
    if old_updates is not None and not hasattr(old_updates, "ndim"):
        old_updates, buffer_layout = ravel_pytree(old_updates)
    if not use_ntk:
        if proj_reg is not None:
            raise ValueError("proj_reg not implemented for SR")
        force = sum_over_ranks(O.T @ dv, comm)
        if momentum is not None:
            force = force + diag_shift * momentum * old_updates
        matrix = sum_over_ranks(O.T @ O, comm)
        matrix = matrix + diag_shift * jnp.eye(matrix.shape[0], dtype=matrix.dtype)
        updates, info = _solution(solver_fn(matrix, force))
        if momentum is not None:
            old_updates = updates
    else:
        if momentum is not None:
            dv = dv - momentum * (O @ old_updates)
        per_sample = 2 if mode == "complex" else 1
        counts = np.full(comm.size, n_local, np.int64)
        kernel = ring_products(O, counts, per_sample, comm)  # this rank's rows of Ō Ōᵀ
        side = kernel.shape[1]
        rows_solver = row_solver(solver_fn) if comm.size > 1 else None
        if rows_solver is not None:  # the kernel stays split by rows: this rank's rows of x
            kernel = _add_to_my_diagonal(kernel, diag_shift, comm)
            if proj_reg is not None:
                kernel = kernel + proj_reg / side
            mine, info = _solution(rows_solver(kernel, dv, comm))
        else:
            kernel = _gather_rows(kernel, comm) if comm.size > 1 else kernel
            kernel = kernel + diag_shift * jnp.eye(side, dtype=kernel.dtype)
            if proj_reg is not None:
                kernel = kernel + proj_reg / side
            everyone = allgather(dv, comm=comm).reshape(-1) if comm.size > 1 else dv
            x, info = _solution(solver_fn(kernel, everyone))
            offset = comm.rank * n_local * per_sample  # this rank's rows of the kernel (rank-major)
            mine = x[offset : offset + n_local * per_sample]
        updates = sum_over_ranks(O.T @ mine, comm)
        if momentum is not None:
            updates = updates + momentum * old_updates
            old_updates = updates
    if buffer_layout is not None:
        old_updates = buffer_layout(old_updates)
    # δ's entries are the columns of the dense rows: NetKet's real parameters ravelled.
    return from_model_space(ravel_pytree(jacobian.theta)[1](updates), params, mode), old_updates, info


def mean_jacobian_estimate(apply_fun: Any, params: Any, model_state: Any, everyone: jax.Array, *, mode: str,
                           comm: Any, n_subset: int = 32) -> jax.Array:
    """The mean Jacobian row (k, P) over `n_subset` evenly strided samples of `everyone` (every
    rank's samples, so the estimate is the same on every rank): subtracted from every Jacobian
    block before the NTK contraction so that centring the NTK afterwards does not cancel a
    large common part (the NTK's centring removes any constant shift)."""
    k = min(everyone.shape[0], n_subset)
    subset = everyone[jnp.arange(k) * (everyone.shape[0] // k)]
    point = model_point(apply_fun, params, model_state, subset, mode=mode, comm=comm, center=False)
    rows = point.jacobian().local_rows().reshape(k, point.channels, -1)
    return jax.lax.stop_gradient(jnp.mean(rows, axis=0))


def ntk_block_rows(apply_fun: Any, params: Any, model_state: Any, samples: jax.Array, everyone: jax.Array, *,
                   mode: str, chunk_size: int | None, comm: Any) -> jax.Array:
    """This rank's rows of the uncentred NTK O_r O_allᵀ against every sample, (n_r·k, N·k):
    the operators' Jacobian rows of this rank's samples against those of every rank's samples,
    one rank's block of columns (or `chunk_size` samples) at a time, both shifted by the mean
    row's estimate. Memory: this rank's rows and one block's, never the N × P of all samples."""
    point = model_point(apply_fun, params, model_state, samples, mode=mode, comm=comm, center=False)
    shift = mean_jacobian_estimate(apply_fun, params, model_state, everyone, mode=mode, comm=comm)
    mine = (point.jacobian().local_rows().reshape(samples.shape[0], point.channels, -1) - shift[None])
    mine = mine.reshape(-1, mine.shape[-1])
    block = chunk_size or samples.shape[0]
    n_blocks = -(-everyone.shape[0] // block)
    padded = jnp.concatenate([everyone, jnp.broadcast_to(everyone[:1], (n_blocks * block - everyone.shape[0],
                                                                          *everyone.shape[1:]))])

    def columns(batch: jax.Array) -> jax.Array:
        other = model_point(apply_fun, params, model_state, batch, mode=mode, comm=comm, center=False)
        rows = other.jacobian().local_rows().reshape(block, point.channels, -1) - shift[None]
        return mine @ rows.reshape(-1, rows.shape[-1]).T  # (n_r·k, block·k)

    out = jax.lax.map(columns, padded.reshape(n_blocks, block, *everyone.shape[1:]))  # (blocks, n_r·k, block·k)
    out = jnp.moveaxis(out, 0, 1).reshape(mine.shape[0], n_blocks * block * point.channels)
    return out[:, : everyone.shape[0] * point.channels]


def centre_kernel_rows(rows: jax.Array, n_local: int, n_total: int, channels: int, comm: Any) -> jax.Array:
    """K − (column means) − (row means) + (mean) of this rank's rows (n_r·k, N·k) of the NTK,
    the means over every rank's samples (one allreduce): the kernel of the centred Jacobian."""
    rows = rows.reshape(n_local, channels, n_total, channels)
    column_means = sum_over_ranks(jnp.sum(rows, axis=0, keepdims=True), comm) / n_total
    row_means = jnp.mean(rows, axis=2, keepdims=True)
    rows = rows - column_means - row_means + jnp.mean(column_means, axis=2, keepdims=True)
    return rows.reshape(n_local * channels, n_total * channels)


@functools.partial(jax.jit, static_argnames=("apply_fun", "solver_fn", "mode", "chunk_size", "comm"))
def ntk_onthefly_update(apply_fun: Any, local_energies: jax.Array, params: Any, model_state: Any,
                        samples: jax.Array, *, diag_shift: Any, solver_fn: Any, mode: str, proj_reg: Any,
                        momentum: Any, old_updates: Any, chunk_size: int | None, comm: Any) -> tuple[Any, Any, Any]:
    """``VMC_SR(use_ntk=True, on_the_fly=True)`` over all ranks' samples, without a Jacobian of all samples.

    NetKet's lazy formulation, distributed by its rows: this rank's rows of the NTK against
    every rank's samples (the samples, N × sites, are gathered; their Jacobian rows are made a
    block at a time, :func:`ntk_block_rows`), centred with the column means of all rows (one
    allreduce), solved split by rows or gathered into the replicated N·k × N·k kernel for
    NetKet's solver; δ = Σ_ranks O_rᵀ x_r (the Jacobian's VJP: one allreduce).
    """
    point = model_point(apply_fun, params, model_state, samples, mode=mode, comm=comm, chunk_size=chunk_size,
                        center=False)
    jacobian = point.jacobian()
    n_local, n_total, channels = point.n_local, point.n_total, point.channels
    everyone = allgather(samples, comm=comm).reshape(n_total, *samples.shape[1:]) if comm.size > 1 else samples
    dv = centred_energies(local_energies, n_total, comm, mode).reshape(n_local, channels)
    if momentum is not None:
        if old_updates is None:  # NetKet's buffer: a pytree of its real parameters
            old_updates = tmap(jnp.zeros_like, jacobian.theta)
        else:  # SPRING: dv − μ Ō δ_old, Ō δ_old centred over all samples
            previous = jacobian.jvp(old_updates)
            mean = sum_over_ranks(jnp.sum(previous, axis=0), comm) / n_total
            dv = dv - momentum * (previous - mean) / math.sqrt(n_total)
    rows = ntk_block_rows(apply_fun, params, model_state, samples, everyone, mode=mode, chunk_size=chunk_size,
                          comm=comm)
    rows = centre_kernel_rows(rows, n_local, n_total, channels, comm) / n_total
    rows_solver = row_solver(solver_fn) if comm.size > 1 else None
    if rows_solver is not None:  # the kernel stays split by rows: this rank's rows of x
        kernel = _add_to_my_diagonal(rows, diag_shift, comm)
        if proj_reg is not None:
            kernel = kernel + proj_reg / n_total  # as NetKet's on-the-fly NTK (per sample, not per row)
        x, info = _solution(rows_solver(kernel, dv.reshape(-1), comm))
        mine = x.reshape(n_local, channels)
        mine = mine - sum_over_ranks(jnp.sum(mine, axis=0, keepdims=True), comm) / n_total  # centred as Ō's rows
    else:
        rhs = allgather(dv, comm=comm).reshape(-1) if comm.size > 1 else dv.reshape(-1)
        kernel = _gather_rows(rows, comm) if comm.size > 1 else rows
        kernel = kernel + diag_shift * jnp.eye(kernel.shape[0], dtype=kernel.dtype)
        if proj_reg is not None:
            kernel = kernel + proj_reg / n_total  # as NetKet's on-the-fly NTK (per sample, not per row)
        x, info = _solution(solver_fn(kernel, rhs))
        x = jnp.squeeze(x).reshape(n_total, channels)
        x = x - jnp.mean(x, axis=0, keepdims=True)  # centred as Ō's rows
        mine = x[comm.rank * n_local : (comm.rank + 1) * n_local]
    updates = jacobian.vjp(mine / math.sqrt(n_total))  # δ = Ōᵀ x summed over ranks
    if momentum is not None:
        updates = tmap(lambda u, o: u + momentum * o, updates, old_updates)
        old_updates = updates
    return from_model_space(updates, params, mode), old_updates, info


def _check_solver(solver_fn: Any) -> None:
    """A solver that asks for the local energies (``dv=``) would read this rank's only."""
    target = solver_fn.func if isinstance(solver_fn, functools.partial) else solver_fn
    try:
        accepts = "dv" in inspect.signature(target).parameters
    except (TypeError, ValueError):
        accepts = False
    if accepts:
        raise NotImplementedError(
            f"distlinalg.netket: the VMC_SR linear_solver {solver_fn!r} takes the local energies (dv=...), which on "
            "a distlinalg.netket.MCState are this rank's only; use a solver of (matrix, rhs)")


def compute_loss_and_update(driver: Any) -> tuple[Any, Any]:
    """``VMC_SR.compute_loss_and_update`` for a :class:`distlinalg.netket.MCState`."""
    import netket.stats as nkstats
    from netket._src.driver.vmc_sr import _MCMC_DIAGNOSTICS_MAX_LAG

    state = driver.state
    comm = state._distlinalg_comm
    local_energies = state._distlinalg_local_values(driver._ham)
    driver._loss_stats = state._distlinalg_statistics(local_energies)
    decay = driver._mcmc_convergence_diagnostics_ema_decay
    if decay is not None:
        # The running diagnostics see every rank's chains (the energies only: N numbers).
        everyone = local_energies if comm.size == 1 else allgather(local_energies, comm=comm).reshape(
            -1, *local_energies.shape[1:])
        old = driver._loss_stats_online
        if old is not None and old.n_samples == 0:
            old = None
        driver._loss_stats_online = nkstats.online_statistics(everyone, old_estimator=old, decay=decay,
                                                              max_lag=_MCMC_DIAGNOSTICS_MAX_LAG)
    diag_shift, proj_reg, momentum = driver.diag_shift, driver.proj_reg, driver.momentum
    if callable(diag_shift):
        diag_shift = diag_shift(driver.step_count)
    if callable(proj_reg):
        proj_reg = proj_reg(driver.step_count)
    if callable(momentum):
        momentum = momentum(driver.step_count)
    if not driver.use_ntk and driver.on_the_fly:
        raise NotImplementedError("VMC_SR: on_the_fly=True needs use_ntk=True (as in NetKet)")
    solver = driver._linear_solver
    _check_solver(solver)
    if driver.use_ntk and comm.size > 1:  # NetKet's default solver -> the same, with the kernel split by rows
        solver = default_ntk_solver(solver)
    if driver.use_ntk and driver.on_the_fly:
        driver._dp, driver._old_updates, driver.info = ntk_onthefly_update(
            state._apply_fun, local_energies, state.parameters, state.model_state, flat_samples(state),
            diag_shift=diag_shift, solver_fn=solver, mode=driver.mode, proj_reg=proj_reg,
            momentum=momentum, old_updates=driver._old_updates, chunk_size=driver.chunk_size_bwd, comm=comm)
        return driver._loss_stats, driver._dp
    driver._dp, driver._old_updates, driver.info = sr_update(
        state._apply_fun, local_energies, state.parameters, state.model_state, flat_samples(state),
        diag_shift=diag_shift, solver_fn=solver, mode=driver.mode, proj_reg=proj_reg,
        momentum=momentum, old_updates=driver._old_updates, chunk_size=driver.chunk_size_bwd,
        use_ntk=driver.use_ntk, comm=comm)
    return driver._loss_stats, driver._dp


def _add_to_my_diagonal(rows: jax.Array, shift: Any, comm: Any) -> jax.Array:
    """`shift` added to the diagonal entries of this rank's rows (n_r, M) of an M × M matrix held
    rank-major in equal pieces (a distlinalg.netket.MCState holds as many samples on every rank)."""
    n_r = rows.shape[0]
    mine = jnp.arange(n_r)
    return rows.at[mine, comm.rank * n_r + mine].add(jnp.asarray(shift, rows.dtype))


def _gather_rows(rows: jax.Array, comm: Any) -> jax.Array:
    """Every rank's rows (counts may differ), concatenated on every rank."""
    return Partition.of_local_sizes(rows.shape[0], comm).allgather(rows, comm)
