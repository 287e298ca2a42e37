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
    of the NTK against every rank's samples (the samples are gathered, never a
    Jacobian), centred with one allreduce; memory per rank is what NetKet's
    lazy contraction needs for n_r rows, plus the replicated kernel (or its rows).

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
import netket.jax as nkjax
import numpy as np
from jax.flatten_util import ravel_pytree

from ..comm import allgather
from ..operators import Partition
from ..operators.sample_gram import ring_products
from ._ntk_solvers import default_ntk_solver, row_solver
from ._qgt import flat_samples, sum_over_ranks, tmap

__all__ = ["compute_loss_and_update", "sr_update"]


def centred_rows(jac: jax.Array, local_energies: jax.Array, n_total: int, comm: Any, mode: str):
    """(Ō rows (n_local·k, P), dv (n_local·k,)): NetKet's centred, normalised input
    with the means over all ranks' samples."""
    mean_row = sum_over_ranks(jnp.sum(jac, axis=0), comm) / n_total
    e = local_energies.reshape(-1)
    de = e - sum_over_ranks(jnp.sum(e), comm) / n_total
    mass = 1.0 / n_total
    O = (jac - mean_row[None]) * math.sqrt(mass)
    dv = 2.0 * de * math.sqrt(mass)
    if mode == "complex":  # (Re, Im) of each sample adjacent, as NetKet orders them
        return O.reshape(-1, O.shape[-1]), jnp.stack([jnp.real(dv), jnp.imag(dv)], axis=-1).reshape(-1)
    return O, jnp.real(dv)


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
    flat_params, unravel = ravel_pytree(params)
    n_local = samples.shape[0]
    n_total = n_local * comm.size
    jac = nkjax.jacobian(apply_fun, params, samples, model_state, mode=mode, dense=True, center=False,
                         chunk_size=chunk_size)
    O, dv = centred_rows(jac, local_energies, n_total, comm, mode)
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
    if mode == "complex" and jnp.iscomplexobj(flat_params):
        half = updates.shape[-1] // 2
        updates = updates[:half] + 1j * updates[half:]
    return unravel(updates), old_updates, info


def _real_model(apply_fun: Any, rebuild: Any, mode: str) -> Any:
    """(real parameters, samples, model_state) -> outputs (n,) or (n, 2) in `mode`, as the
    on-the-fly NTK works with them (complex parameters as real pairs)."""

    def outputs(parameters_real: Any, samples: jax.Array, model_state: Any) -> jax.Array:
        log_amp = apply_fun({"params": rebuild(parameters_real), **model_state}, samples)
        if mode == "complex":
            return jnp.stack([jnp.real(log_amp), jnp.imag(log_amp)], axis=-1)
        return jnp.real(log_amp)

    return outputs


def mean_jacobian_estimate(model: Any, parameters_real: Any, samples: jax.Array, model_state: Any,
                           n_subset: int = 32) -> Any:
    """The mean per-sample Jacobian over `n_subset` evenly strided samples: subtracted from
    every Jacobian block before the NTK contraction so that centring the NTK afterwards does
    not cancel a large common part (the NTK's centring removes any constant shift). The
    samples are every rank's, so the estimate is the same on every rank."""
    k = min(samples.shape[0], n_subset)
    subset = samples[jnp.arange(k) * (samples.shape[0] // k)]
    out, pullback = jax.vjp(lambda p: model(p, subset, model_state), parameters_real)
    if out.ndim == 1:
        return jax.lax.stop_gradient(pullback(jnp.full(out.shape, 1.0 / k, out.dtype))[0])
    selectors = jnp.broadcast_to(jnp.eye(out.shape[1], dtype=out.dtype)[:, None, :] / k, (out.shape[1], *out.shape))
    return jax.lax.stop_gradient(jax.vmap(lambda c: pullback(c)[0])(selectors))


def _chunked_rows(fn: Any, rows: jax.Array, chunk_size: int | None) -> jax.Array:
    """fn over `rows` (the first axis), `chunk_size` at a time (padding the last chunk)."""
    if chunk_size is None or chunk_size >= rows.shape[0]:
        return fn(rows)
    n = rows.shape[0]
    n_chunks = -(-n // chunk_size)
    padded = jnp.concatenate([rows, jnp.broadcast_to(rows[:1], (n_chunks * chunk_size - n, *rows.shape[1:]))])
    out = jax.lax.map(fn, padded.reshape(n_chunks, chunk_size, *rows.shape[1:]))
    return jnp.moveaxis(out, 0, 1).reshape(out.shape[1], n_chunks * chunk_size, *out.shape[3:])[:, :n]


def _chunked_pullback(model: Any, parameters_real: Any, samples: jax.Array, model_state: Any, cotangent: jax.Array,
                      chunk_size: int | None) -> Any:
    """Σ_k (∂ model_k/∂θ)ᵀ cotangent_k over this rank's samples, `chunk_size` at a time."""
    n = samples.shape[0]
    if chunk_size is None or chunk_size >= n:
        return jax.vjp(lambda p: model(p, samples, model_state), parameters_real)[1](cotangent)[0]
    n_chunks = -(-n // chunk_size)
    pad = n_chunks * chunk_size - n
    batches = jnp.concatenate([samples, jnp.broadcast_to(samples[:1], (pad, *samples.shape[1:]))])
    weights = jnp.concatenate([cotangent, jnp.zeros((pad, *cotangent.shape[1:]), cotangent.dtype)])

    def step(total: Any, item: Any) -> Any:
        x, w = item
        return tmap(jnp.add, total, jax.vjp(lambda p: model(p, x, model_state), parameters_real)[1](w)[0]), None

    total, _ = jax.lax.scan(step, tmap(jnp.zeros_like, parameters_real),
                            (batches.reshape(n_chunks, chunk_size, *samples.shape[1:]),
                             weights.reshape(n_chunks, chunk_size, *cotangent.shape[1:])))
    return total


@functools.partial(jax.jit, static_argnames=("apply_fun", "solver_fn", "mode", "chunk_size", "comm"))
def ntk_onthefly_update(apply_fun: Any, local_energies: jax.Array, params: Any, model_state: Any,
                        samples: jax.Array, *, diag_shift: Any, solver_fn: Any, mode: str, proj_reg: Any,
                        momentum: Any, old_updates: Any, chunk_size: int | None, comm: Any) -> tuple[Any, Any, Any]:
    """``VMC_SR(use_ntk=True, on_the_fly=True)`` over all ranks' samples, without forming Jacobians.

    NetKet's lazy formulation, distributed by its rows: this rank's rows of the NTK against
    every rank's samples (the samples, N × sites, are gathered; the Jacobian never exists),
    centred with the column means of all rows (one allreduce), gathered into the replicated
    N·k × N·k kernel for NetKet's solver; δ = Σ_ranks Ō_rᵀ x_r (one VJP, one allreduce).
    """
    from netket.jax import _ntk

    parameters_real, rebuild = nkjax.tree_to_real(params)
    model = _real_model(apply_fun, rebuild, mode)
    n_local = samples.shape[0]
    n_total = n_local * comm.size
    everyone = allgather(samples, comm=comm).reshape(n_total, *samples.shape[1:]) if comm.size > 1 else samples
    # The right-hand side: 2 (e − ē)/√N, in the channels of the mode.
    e = local_energies.reshape(-1)
    de = e - sum_over_ranks(jnp.sum(e), comm) / n_total
    dv = 2.0 * de / math.sqrt(n_total)
    dv = jnp.stack([jnp.real(dv), jnp.imag(dv)], axis=-1) if mode == "complex" else jnp.real(dv)
    if momentum is not None:
        if old_updates is None:
            old_updates = tmap(jnp.zeros_like, parameters_real)
        else:  # SPRING: dv − μ Ō δ_old, Ō δ_old centred over all samples
            previous = _chunked_rows(lambda x: jax.jvp(lambda p: model(p, x, model_state), (parameters_real,),
                                                      (old_updates,))[1][None], samples, chunk_size)[0]
            mean = sum_over_ranks(jnp.sum(previous, axis=0), comm) / n_total
            dv = dv - momentum * (previous - mean) / math.sqrt(n_total)
    rows_solver = row_solver(solver_fn) if comm.size > 1 else None
    # This rank's rows of the NTK against every sample, then centred: K − col − row + mean.
    shift = mean_jacobian_estimate(model, parameters_real, everyone, model_state)
    contraction = _ntk.empirical_ntk_by_jacobian(f=model, trace_axes=(), vmap_axes=0)
    # Columns one rank's block at a time (or `chunk_size`): the contraction then holds this
    # rank's Jacobian and one block's, 2 n_r × P, never the N × P of all samples.
    rows = _chunked_rows(lambda columns: contraction(samples, columns, parameters_real, model_state=model_state,
                                                     jacobian_shift=shift).real, everyone, chunk_size or n_local)
    if mode == "complex":  # (n_r, N, 2, 2)
        column_means = sum_over_ranks(jnp.sum(rows, axis=0, keepdims=True), comm) / n_total
        row_means = jnp.mean(rows, axis=1, keepdims=True)
        rows = rows - column_means - row_means + jnp.mean(column_means, axis=1, keepdims=True)
        rows = jnp.transpose(rows, (0, 2, 1, 3)).reshape(2 * n_local, 2 * n_total)
    else:
        column_means = sum_over_ranks(jnp.sum(rows, axis=0, keepdims=True), comm) / n_total
        rows = rows - column_means - jnp.mean(rows, axis=1, keepdims=True) + jnp.mean(column_means)
    if rows_solver is not None:  # the kernel stays split by rows: this rank's rows of x
        kernel = _add_to_my_diagonal(rows / n_total, diag_shift, comm)
        if proj_reg is not None:
            kernel = kernel + proj_reg / n_total  # as NetKet's on-the-fly NTK (per sample, not per row)
        x, info = _solution(rows_solver(kernel, dv.reshape(-1), comm))
        mine = x.reshape(dv.shape)
        # Centres Ō's rows: the mean over every rank's samples.
        mine = (mine - sum_over_ranks(jnp.sum(mine, axis=0, keepdims=True), comm) / n_total) / math.sqrt(n_total)
    else:
        rhs = allgather(dv, comm=comm).reshape(n_total, *dv.shape[1:]) if comm.size > 1 else dv
        kernel = _gather_rows(rows / n_total, comm) if comm.size > 1 else rows / n_total
        kernel = kernel + diag_shift * jnp.eye(kernel.shape[0], dtype=kernel.dtype)
        if proj_reg is not None:
            kernel = kernel + proj_reg / n_total  # as NetKet's on-the-fly NTK (per sample, not per row)
        x, info = _solution(solver_fn(kernel, rhs.reshape(-1)))
        x = jnp.squeeze(x)
        if mode == "complex":
            x = x.reshape(n_total, 2)
        x = (x - jnp.mean(x, axis=0, keepdims=True)) / math.sqrt(n_total)  # centres Ō's rows
        mine = x[comm.rank * n_local : (comm.rank + 1) * n_local]
    updates = sum_over_ranks(_chunked_pullback(model, parameters_real, samples, model_state, mine, chunk_size), comm)
    if momentum is not None:
        updates = tmap(lambda u, o: u + momentum * o, updates, old_updates)
        old_updates = updates
    return rebuild(updates), old_updates, info


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
