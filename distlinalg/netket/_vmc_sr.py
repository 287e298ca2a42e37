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
  * ``use_ntk=True`` (MinSR / SRt):  (Ō Ōᵀ + λ I + proj_reg/M) x = dv − μ_m Ō δ_old,
    δ = Ōᵀ x (+ μ_m δ_old): the M × M kernel (M = N, or 2N in "complex" mode)
    is formed from the ranks' Jacobian rows passed around the ring of ranks
    (:func:`distlinalg.operators.sample_gram.ring_products`; the Jacobian is
    never gathered), the solve runs on the replicated kernel on every rank,
    and δ is one parameter-sized allreduce.

Rows are real: in "complex" mode each sample gives its (Re, Im) pair, as in
NetKet. The update, the momentum buffer and the solver's info are identical
on every rank.
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
from ..operators._base import gather_rows
from ..operators.sample_gram import ring_products
from ._qgt import flat_samples, sum_over_ranks

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
        kernel = gather_rows(kernel, comm) if comm.size > 1 else kernel
        side = kernel.shape[0]
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
    _check_solver(driver._linear_solver)
    driver._dp, driver._old_updates, driver.info = sr_update(
        state._apply_fun, local_energies, state.parameters, state.model_state, flat_samples(state),
        diag_shift=diag_shift, solver_fn=driver._linear_solver, mode=driver.mode, proj_reg=proj_reg,
        momentum=momentum, old_updates=driver._old_updates, chunk_size=driver.chunk_size_bwd,
        use_ntk=driver.use_ntk, comm=comm)
    return driver._loss_stats, driver._dp
