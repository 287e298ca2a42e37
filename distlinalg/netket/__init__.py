"""NetKet under ``mpiexec``: global Monte Carlo statistics and a distributed SR preconditioner.

NetKet 3.19+ has no MPI: started as ``mpiexec -n P python vmc.py``, a NetKet
script runs P independent copies, each estimating energies, gradients and the
quantum geometric tensor from its own samples only (and, with a fixed sampler
seed, from the *same* samples). This module makes a user's own
``nk.driver.VMC`` script a single computation over P ranks, with three
changed lines (a fourth keeps the output on rank 0)::

    import distlinalg.netket as dnk                                   # 1
    vstate = dnk.MCState(sampler, model, n_samples=1024, seed=0)      # 2  (was nk.vqs.MCState)
    driver = nk.driver.VMC(H, optimizer, variational_state=vstate,
                           preconditioner=dnk.SR(diag_shift=0.01))    # 3  (was nk.optimizer.SR)
    driver.run(300, out=log if dnk.rank() == 0 else (), show_progress=dnk.rank() == 0)

Design (why these pieces, and why here)
---------------------------------------
NetKet calls a preconditioner as ``preconditioner(vstate, gradient, step)``:
it sees neither the Hamiltonian nor the local energies, and the driver has
already stored (and will log) the energy statistics it computed. So the global
quantities must be produced where NetKet computes them, in the variational
state. (A preconditioner alone, given the Hamiltonian, can make the update
global, which :class:`SR` also supports, but the logged energy stays
rank-local and the local energies are computed twice; a driver subclass would
replace the user's ``nk.driver.VMC`` and every other driver would need one.)

* :class:`MCState` (a subclass of ``nk.vqs.MCState``, built on first use so
  that importing this module never imports NetKet) keeps NetKet's sampler,
  model, chunking and serialisation, and changes what depends on the rank:

  - ``n_samples`` counts the samples of *all* ranks (every rank runs the
    sampler's ``n_chains`` chains, ``chain_length = ceil(n_samples / (P
    n_chains))``), ``n_samples_per_rank`` those of one rank;
  - parameters start identical (NetKet's initialisation with the common
    ``seed``, a seed drawn on rank 0 when none is given, then a broadcast of
    rank 0's variables) while the chains differ (rank r > 0 folds r into the
    sampler seed; rank 0 keeps NetKet's own, so one rank reproduces
    ``nk.vqs.MCState`` exactly);
  - ``expect``, ``expect_and_grad`` and ``expect_and_forces`` return
    statistics over all ranks' chains (:func:`statistics`) and the gradient
    ``2 Re F`` / ``2 F`` with ``F = (1/N) Σ_k conj(O_k) (E_loc,k − E)`` over
    all ``N`` samples (one VJP on this rank's samples and one allreduce).
    The driver therefore logs and prints global energies and error bars, and
    first-order optimisers without a preconditioner are already correct;
  - ``expect_and_grad`` keeps the local energies of the current samples, so
    the preconditioner does not compute them again.

* :class:`SR` is the preconditioner: it reads those local energies and calls
  :func:`distlinalg.natural_gradient`, which solves ``(S + λ) δ = F`` over all
  ranks' samples (matrix-free CG/MINRES in parameter space or the solve in
  sample space), and returns ``2 δ``, NetKet's convention (NetKet's gradient is
  ``2 Re F`` for real and ``2 F`` for complex parameters, and ``nk.optimizer.SR``
  solves against that gradient). The update is identical, bit for bit, on every
  rank, so replicated parameters stay identical under any optax optimiser.

NetKet's own SR paths run unchanged on an :class:`MCState` (the one changed
line is the state): ``nk.driver.VMC(..., preconditioner=nk.optimizer.SR(...))``
with every QGT type (``QGTAuto``, ``QGTOnTheFly``, ``QGTJacobianDense``,
``QGTJacobianPyTree``; ``holomorphic``, ``diag_scale``, ``chunk_size``) and
every NetKet solver, ``vstate.quantum_geometric_tensor(...)``, and
``nk.driver.VMC_SR`` (``use_ntk``, ``on_the_fly``, ``momentum``, ``proj_reg``,
``linear_solver``, ``chunk_size_bwd``, schedules). Their QGTs and matrices
are formed over all ranks' samples (:mod:`._qgt`, :mod:`._vmc_sr`; the
entry points are routed in :mod:`._paths`), and the update is identical on
every rank. With ``use_ntk=True`` and ``linear_solver=`` :func:`cholesky_distributed`
or :func:`pinv_smooth_distributed` (NetKet's names; the default on more than
one rank when NetKet's default solver is left in place) the sample-space
kernel stays split by rows through the solve (:mod:`distlinalg.linalg`).
Drivers whose step cannot be global (TDVP, ``Infidelity_SR``, a subclass
with its own ``compute_loss_and_update``) raise at construction;
and the state checks after every parameter update that its parameters are
the same on every rank (one 8-byte allreduce), raising otherwise.
NetKet's ``jax.process_index()`` is 0 on every rank of an ``mpiexec`` job
(JAX is not told about MPI), so loggers and progress bars are switched off
on the other ranks by the script (last line above).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._runtime.mpi import resolve_comm
from ..comm import allgather, allreduce, bcast
from ._ntk_solvers import cholesky_distributed, pinv_smooth_distributed

__all__ = ["SR", "MCState", "statistics", "Statistics", "rank", "size", "cholesky_distributed",
           "pinv_smooth_distributed"]

# NetKet's blocking estimator (netket.stats, the default statistics) works with
# this many batches/blocks; kept equal so that the numbers agree with NetKet's.
_N_BATCHES = 32


def rank(comm: Any = None) -> int:
    """This process's rank in `comm` (default: distlinalg's communicator).

    Example:
      >>> import distlinalg.netket as dnk
      >>> from distlinalg import comm
      >>> dnk.rank() == comm.rank()                     # e.g. driver.run(..., show_progress=dnk.rank() == 0)
      True
    """
    return resolve_comm(comm).rank


def size(comm: Any = None) -> int:
    """The number of ranks in `comm` (default: distlinalg's communicator).

    Example:
      >>> import distlinalg.netket as dnk
      >>> from distlinalg import comm
      >>> dnk.size() == comm.size()
      True
    """
    return resolve_comm(comm).size


# -- statistics -------------------------------------------------------------------------
class Statistics(NamedTuple):
    """Fields of ``netket.stats.Stats`` (returned instead when NetKet is not installed).

    Example:
      >>> from distlinalg.netket import Statistics
      >>> Statistics._fields
      ('mean', 'error_of_mean', 'variance', 'tau_corr', 'R_hat')
    """

    mean: Any
    error_of_mean: Any
    variance: Any
    tau_corr: Any
    R_hat: Any


def _stats_type() -> Callable[..., Any]:
    try:  # NetKet's own type, so that drivers, loggers and progress bars accept it
        from netket.stats import Stats
    except ImportError:
        return Statistics
    return Stats


def statistics(data: Any, *, comm: Any = None) -> Any:
    """Monte Carlo statistics of the chains of all ranks, as ``nk.stats.statistics``
    computes them on the gathered chains.

    Args:
      data: this rank's values, shape ``(n_chains, chain_length)`` (rows are
        independent Markov chains; a vector is one chain), real or complex.
        Every rank must pass the same shape and dtype.
      comm: mpi4py intracommunicator (default: distlinalg's).

    Returns:
      ``netket.stats.Stats`` (``Statistics`` without NetKet) with ``mean``,
      ``error_of_mean``, ``variance``, ``tau_corr`` and ``R_hat`` of the
      ``P · n_chains`` chains, identical on every rank: NetKet's default
      (blocking) estimator, i.e. the error from the variance of the chain
      means when there are ≥ 32 chains and the chains are long enough against
      their autocorrelation, otherwise from blocks of ``chain_length // 32``
      steps, otherwise NaN; split-chain R̂.

    Only per-chain summaries travel: each rank's chain means and variances,
    block means and half-chain means go in one allgather (``(3 + blocks)·n_chains``
    numbers), so the cost does not grow with the chain length. The variance
    is the mean within-chain variance plus the variance of the chain means
    (exact for equal chain lengths). Works eagerly and under ``jax.jit``;
    differentiable in `data` (through the collectives' AD rules), though
    only ``mean`` usually has a useful derivative.

    Example:
      >>> import jax.numpy as jnp
      >>> import distlinalg.netket as dnk
      >>> data = jnp.tile(jnp.arange(64.0), (4, 1))     # this rank's 4 chains of 64 steps
      >>> stats = dnk.statistics(data)                  # over every rank's chains
      >>> float(stats.mean), float(stats.variance)
      (31.5, 341.25)
    """
    c = resolve_comm(comm)
    data = jnp.asarray(data)
    if data.ndim <= 1:
        data = data.reshape(1, -1)
    if data.ndim != 2:
        raise ValueError(f"statistics: data must have shape (n_chains, chain_length), got {data.shape}")
    n_chains, length = data.shape
    if n_chains == 0 or length == 0:
        raise ValueError(f"statistics: no data (shape {data.shape})")
    if not jnp.issubdtype(data.dtype, jnp.inexact):
        data = data.astype(jnp.result_type(float))
    real = jnp.finfo(data.dtype).dtype  # float64 for complex128

    block = max(1, length // _N_BATCHES)
    n_blocks = length // block
    half = length // 2
    chain_mean = jnp.mean(data, axis=1)
    chain_var = jnp.mean(jnp.abs(data - chain_mean[:, None]) ** 2, axis=1)
    block_mean = jnp.mean(data[:, : n_blocks * block].reshape(n_chains * n_blocks, block), axis=1)
    parts = [chain_mean, chain_var.astype(data.dtype), block_mean]
    if half > 0:  # split-chain R̂: each chain cut in two (odd lengths drop the last value)
        parts.append(jnp.mean(data[:, : 2 * half].reshape(2 * n_chains, half), axis=1))
    packed = jnp.concatenate(parts)
    everyone = allgather(packed, comm=c) if c.size > 1 else packed[None]  # (P, len(packed))

    def take(start: int, count: int) -> jax.Array:
        return everyone[:, start: start + count].reshape(-1)

    chain_mean = take(0, n_chains)
    chain_var = jnp.real(take(n_chains, n_chains))
    block_mean = take(2 * n_chains, n_chains * n_blocks)

    def var(x: jax.Array) -> jax.Array:  # population variance, |·|² for complex values
        return jnp.mean(jnp.abs(x - jnp.mean(x)) ** 2)

    total = c.size * n_chains * length
    n_batches = c.size * n_chains
    n_blocks_total = n_batches * n_blocks
    mean = jnp.mean(chain_mean)
    variance = jnp.mean(chain_var) + var(chain_mean)
    batch_var = var(chain_mean)
    block_var = var(block_mean)
    tau_batch = ((total / n_batches) * batch_var / variance - 1) * 0.5
    tau_block = ((total / n_blocks_total) * block_var / variance - 1) * 0.5
    batch_good = (tau_batch < 6 * length) & (n_batches >= _N_BATCHES)
    block_good = (tau_block < 6 * block) & (n_blocks_total >= _N_BATCHES)
    nan = jnp.asarray(jnp.nan, real)
    error = jnp.where(batch_good, jnp.sqrt(batch_var / n_batches),
                      jnp.where(block_good, jnp.sqrt(block_var / n_blocks_total), nan)).astype(real)
    tau = jnp.where(batch_good, jnp.clip(tau_batch, 0),
                    jnp.where(block_good, jnp.clip(tau_block, 0), nan)).astype(real)
    if n_batches > 1 and half > 0:
        half_mean = take(2 * n_chains + n_chains * n_blocks, 2 * n_chains)
        r_hat = jnp.sqrt((length - 1) / length + var(half_mean) / variance).astype(real)
    else:
        r_hat = nan
    return _stats_type()(mean, error, variance.astype(real), tau, r_hat)


_statistics_jit = jax.jit(statistics, static_argnames="comm")


# -- the SR preconditioner ----------------------------------------------------------------
@functools.partial(jax.jit, static_argnums=(0, 1))
def _sr_update(apply_fun: Callable, options: tuple, params: Any, model_state: Any, samples: jax.Array,
               residuals: jax.Array, diag_shift: jax.Array) -> tuple[Any, Any]:
    import distlinalg  # the package is fully imported by the time this traces

    def log_psi(p: Any, s: jax.Array) -> jax.Array:
        return apply_fun({"params": p, **model_state}, s)

    delta, info = distlinalg.natural_gradient(log_psi, params, samples, residuals, diag_shift=diag_shift,
                                              center=True, **dict(options))
    # NetKet's convention: its gradient is 2 Re F (2 F), and nk.optimizer.SR
    # returns (S + λ)⁻¹ of that gradient, i.e. 2 δ.
    return jax.tree_util.tree_map(lambda d: 2 * d, delta), info


class SR:
    """Stochastic reconfiguration over all ranks' samples, as a NetKet preconditioner.

    ``nk.driver.VMC(H, opt, variational_state=vstate, preconditioner=SR(...))``
    calls it once per step as ``sr(vstate, gradient, step)``. It returns the
    pytree ``2 δ`` (shaped like ``vstate.parameters``), where

        (S + λ) δ = F,   S = Ōᴴ Ō / N,   F = Ōᴴ ē / N,

    ``Ō`` are the centred log-derivatives of ``log ψ`` and ``ē`` the centred
    local energies of all ``N`` samples of all ranks (``2 δ`` is what
    ``nk.optimizer.SR`` returns for the same samples: NetKet's gradient is
    ``2 Re F``, or ``2 F`` for complex parameters). The update is computed by
    :func:`distlinalg.natural_gradient` inside one ``jax.jit`` (compiled once
    per model; a scheduled diagonal shift is a traced argument) and is
    identical, bitwise, on every rank. `gradient` is not used: the force is
    formed inside the solve from the local energies.

    The local energies come from :class:`MCState`, which keeps those of the
    current samples when the driver calls ``expect_and_grad``. For a plain
    ``nk.vqs.MCState`` pass ``hamiltonian=H``: they are then computed again
    here (one more local-energy evaluation), but the driver's logged energy
    stays rank-local and the chains of the ranks are only independent if
    the sampler seeds differ.

    Args:
      diag_shift: λ, a number or a schedule ``step -> λ`` (as NetKet's SR).
      space: where to solve: ``"auto"`` (distlinalg's choice), parameter
        space (``S``, n_params × n_params) or sample space (the N × N kernel
        matrix); see :func:`distlinalg.natural_gradient`.
      solver: ``"cg"``, ``"minres"``, ``"cholesky"`` (dense, for small systems)
        or a callable ``solver(operator, rhs) -> (x, info)``; see
        :func:`distlinalg.natural_gradient`.
      rtol, maxiter: solver tolerance and iteration limit (None: the
        defaults of :func:`distlinalg.natural_gradient`).
      mode: ``"real"``, ``"complex"``, ``"holomorphic"`` or None for NetKet's
        choice (real for real parameters with real output, complex otherwise).
      chunk_size: samples per chunk when linearising the model (memory).
      preconditioner: of the CG/MINRES solve: None, ``"nystrom"`` (a
        randomized Nyström preconditioner of rank 100) or a hashable callable
        ``operator -> M`` (e.g. ``functools.partial(distlinalg.solvers.nystrom,
        rank=300)``); see :func:`distlinalg.natural_gradient`.
      hamiltonian: only for a vstate that is not a :class:`MCState`.
      comm: mpi4py intracommunicator (default: the :class:`MCState`'s, else
        distlinalg's).

    Attributes:
      info: the :class:`distlinalg.solvers.SolverInfo` of the last call
        (identical on every rank), e.g. to log from a driver callback.

    AD: the call itself is NetKet's eager protocol and is not meant to be
    differentiated; :func:`distlinalg.natural_gradient`, which it wraps, is
    differentiable (meta-gradients: see ``examples/sharded_sr``).

    Example:
      >>> import jax
      >>> jax.config.update("jax_enable_x64", True)      # as `import netket` does
      >>> import netket as nk
      >>> import distlinalg.netket as dnk
      >>> from distlinalg import comm
      >>> hi = nk.hilbert.Spin(0.5, N=4)                  # a 4-site transverse-field Ising chain
      >>> H = nk.operator.Ising(hi, nk.graph.Chain(4), h=1.0)
      >>> vstate = dnk.MCState(nk.sampler.MetropolisLocal(hi, n_chains=4), nk.models.RBM(alpha=1),
      ...                      n_samples_per_rank=32, seed=0)
      >>> sr = dnk.SR(diag_shift=0.01)
      >>> driver = nk.driver.VMC(H, nk.optimizer.Sgd(0.05), variational_state=vstate, preconditioner=sr)
      >>> log = driver.run(3, out=(), show_progress=False)
      >>> bool(sr.info.converged)                          # the last solve, the same on every rank
      True
      >>> w = jax.tree_util.tree_leaves(vstate.parameters)
      >>> all(bool((comm.allreduce(x, "max") == comm.allreduce(x, "min")).all()) for x in w)
      True
    """

    def __init__(self, diag_shift: Any = 0.01, *, space: str = "auto", solver: str = "cg",
                 rtol: float | None = None, maxiter: int | None = None, mode: str | None = None,
                 chunk_size: int | None = None, hamiltonian: Any = None, comm: Any = None,
                 preconditioner: Any = None):
        self.diag_shift = diag_shift
        self.hamiltonian = hamiltonian
        self.comm = None if comm is None else resolve_comm(comm)
        options = {"space": space, "solver": solver, "rtol": rtol, "maxiter": maxiter, "mode": mode,
                   "chunk_size": chunk_size, "preconditioner": preconditioner}
        # Unset options keep natural_gradient's defaults; the rest is static
        # (hashable) so that the jitted update compiles once.
        self._options = tuple(sorted((k, v) for k, v in options.items() if v is not None))
        self.info = None

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self._options)
        return f"distlinalg.netket.SR(diag_shift={self.diag_shift!r}, {opts})"

    def residuals(self, vstate: Any) -> tuple[jax.Array, jax.Array]:
        """(samples ``(n, N_sites)``, local energies ``(n,)``) of this rank for the current samples."""
        samples = vstate.samples
        kept = getattr(vstate, "_distlinalg_local_energies", None)
        if kept is not None and kept[0] is samples:
            e_loc = kept[1]
        elif self.hamiltonian is not None:
            e_loc = vstate.local_estimators(self.hamiltonian).data
        else:
            raise TypeError(
                "distlinalg.netket.SR needs the local energies of the current samples: use "
                "distlinalg.netket.MCState as the variational state (it keeps them when the driver "
                "computes the energy), or pass hamiltonian=H to SR")
        return samples.reshape(-1, samples.shape[-1]), jnp.asarray(e_loc).reshape(-1)

    def __call__(self, vstate: Any, gradient: Any = None, step: Any = None) -> Any:
        shift = self.diag_shift
        if callable(shift):
            if step is None:
                raise TypeError("distlinalg.netket.SR: a scheduled diag_shift needs the step argument")
            shift = shift(step)
        samples, e_loc = self.residuals(vstate)
        comm = self.comm or resolve_comm(getattr(vstate, "_distlinalg_comm", None))
        params = vstate.parameters
        real = jnp.finfo(jax.tree_util.tree_leaves(params)[0].dtype).dtype
        update, self.info = _sr_update(vstate._apply_fun, self._options + (("comm", comm),), params,
                                       vstate.model_state, samples, e_loc, jnp.asarray(shift, real))
        return update


# -- the distributed variational state ---------------------------------------------------------
@functools.partial(jax.jit, static_argnums=(0, 1))
def _energy_and_force(apply_fun: Callable, comm: Any, params: Any, model_state: Any, samples: jax.Array,
                      e_loc: jax.Array) -> tuple[Any, Any]:
    """Global statistics of `e_loc` and F = (1/N) Σ conj(O_k)(E_loc,k − E), summed over ranks."""
    import netket.jax as nkjax  # only reached from MCState, which needs NetKet anyway

    stats = statistics(e_loc, comm=comm)
    n_total = e_loc.size * comm.size
    centred = e_loc.reshape(-1) - stats.mean
    # NetKet's VJP with conjugate=True handles every real/complex combination
    # of parameters and output the way NetKet's own force does.
    _, pullback = nkjax.vjp(lambda p: apply_fun({"params": p, **model_state}, samples), params, conjugate=True)
    (force,) = pullback(jnp.conjugate(centred) / n_total)
    if comm.size > 1:
        force = allreduce(force, "sum", comm=comm)
    return stats, force


@jax.jit
def _parameter_digest(params: Any) -> jax.Array:
    """(h, −h) with h a 31-bit digest of the parameters' bits: Σ_i w_i (2i + 1) mod 2³¹ over
    their 32-bit words w_i (a change of any one word changes h), leaf after leaf."""
    h = jnp.uint32(0)
    for position, leaf in enumerate(jax.tree_util.tree_leaves(params)):
        x = jnp.asarray(leaf)
        if jnp.iscomplexobj(x):
            x = jnp.stack([jnp.real(x), jnp.imag(x)])
        words = jax.lax.bitcast_convert_type(x.reshape(-1), jnp.uint32).reshape(-1)
        odd = (2 * jnp.arange(words.size, dtype=jnp.uint32) + 1) * jnp.uint32(2 * position + 1)
        h = h + jnp.sum(words * odd, dtype=jnp.uint32)
    h = (h & jnp.uint32(0x7FFFFFFF)).astype(jnp.int32)
    return jnp.stack([h, -h])


def _check_replicated(params: Any, comm: Any, update: int) -> None:
    """Raise, on every rank, when the parameters differ between ranks: one allreduce
    (max) of two int32 (h, −h) gives max h and −min h."""
    extremes = np.asarray(allreduce(_parameter_digest(params), "max", comm=comm))
    if extremes[0] != -extremes[1]:
        raise RuntimeError(
            f"distlinalg.netket.MCState: after parameter update {update} the parameters differ between ranks "
            "(a digest of their bits is not the same on every rank). Some step computed its update from one "
            "rank's samples: use nk.driver.VMC (with nk.optimizer.SR or distlinalg.netket.SR) or "
            "nk.driver.VMC_SR, and set the parameters identically on every rank. "
            "(MCState(..., check_parameters=False) turns this check off.)")


def _force_to_grad(force: Any, params: Any) -> Any:
    """NetKet's gradient: 2 Re F for real parameters, 2 F for complex ones."""
    return jax.tree_util.tree_map(
        lambda f, p: 2 * (f if jnp.iscomplexobj(p) else jnp.real(f)).astype(p.dtype), force, params)


def _make_mcstate() -> type:
    import netket as nk
    import netket.jax as nkjax

    base = nk.vqs.MCState

    class MCState(base):  # noqa: D401 - the docstring is set below
        def __init__(self, sampler: Any, model: Any = None, *, n_samples: int | None = None,
                     n_samples_per_rank: int | None = None, seed: Any = None, sampler_seed: Any = None,
                     comm: Any = None, check_parameters: bool = True, **kwargs: Any):
            # Needed by the n_samples setters, which NetKet's __init__ calls.
            self._distlinalg_comm = c = resolve_comm(comm)
            self._distlinalg_local_energies = None
            # The replicated-parameter check starts once the parameters are broadcast below.
            self._distlinalg_check = False
            self._distlinalg_updates = 0
            if seed is None:  # one random seed for all ranks, drawn on rank 0
                drawn = np.random.default_rng().integers(2**31) if c.rank == 0 else 0
                seed = int(bcast(jnp.asarray(drawn, jnp.int32), comm=c)) if c.size > 1 else int(drawn)
            # The sampler seed NetKet would use (derived from `seed` when not
            # given); rank r > 0 folds r into it, so each rank has its own chains.
            key = (jax.random.split(nkjax.PRNGKey(seed), 2)[1] if sampler_seed is None
                   else nkjax.PRNGKey(sampler_seed))
            if c.rank > 0:
                key = jax.random.fold_in(key, c.rank)
            if n_samples is None and n_samples_per_rank is None:  # NetKet's default: about 1000 in all
                n_samples = math.ceil(1000 / (sampler.n_chains * c.size)) * sampler.n_chains * c.size
            super().__init__(sampler, model, n_samples=n_samples, n_samples_per_rank=n_samples_per_rank,
                             seed=seed, sampler_seed=key, **kwargs)
            if c.size > 1:  # identical parameters whatever the initialisation did
                self.variables = bcast(self.variables, comm=c)
                # Every global estimate divides by P × (this rank's count), and the ring of the
                # NTK sends equal pieces: the ranks must hold as many samples each.
                count = jnp.asarray([self.n_samples_per_rank, -self.n_samples_per_rank], jnp.int32)
                most, least = (int(v) for v in allreduce(count, "max", comm=c))
                if most != -least:
                    raise ValueError(
                        f"distlinalg.netket.MCState: the ranks hold between {-least} and {most} samples per step "
                        "(sampler.n_chains and n_samples_per_rank must be the same on every rank)")
            self._distlinalg_check = bool(check_parameters) and c.size > 1

        # parameters: replicated, and checked to stay so ---------------------------------------
        @property
        def parameters(self) -> Any:
            return base.parameters.fget(self)

        @parameters.setter
        def parameters(self, pars: Any) -> None:
            base.parameters.fset(self, pars)
            if getattr(self, "_distlinalg_check", False):
                self._distlinalg_updates += 1
                _check_replicated(self._parameters, self._distlinalg_comm, self._distlinalg_updates)

        def quantum_geometric_tensor(self, qgt_T: Any = None) -> Any:
            """NetKet's QGT of type `qgt_T` (``QGTAuto`` when None, ``QGTOnTheFly``,
            ``QGTJacobianDense``, ``QGTJacobianPyTree`` or a partial of one) over every
            rank's samples; products, solves and ``to_dense()`` are identical on every rank."""
            from ._qgt import distributed_qgt

            return distributed_qgt(self, qgt_T)

        def _distlinalg_statistics(self, values: Any) -> Any:
            return jax.block_until_ready(_statistics_jit(values, comm=self._distlinalg_comm))

        # sample counts ------------------------------------------------------------------
        @property
        def n_samples(self) -> int:
            """The number of samples of every sampling step, all ranks together."""
            return self.chain_length * self.sampler.n_chains * self._distlinalg_comm.size

        @n_samples.setter
        def n_samples(self, n_samples: int) -> None:
            per_chain = self.sampler.n_chains * self._distlinalg_comm.size
            if n_samples <= 0:
                raise ValueError(f"Invalid number of samples: n_samples={n_samples}")
            self.chain_length = math.ceil(n_samples / per_chain)

        @property
        def n_samples_per_rank(self) -> int:
            """The number of samples of every sampling step on this MPI rank."""
            return self.chain_length * self.sampler.n_chains

        @n_samples_per_rank.setter
        def n_samples_per_rank(self, n_samples_per_rank: int) -> None:
            if n_samples_per_rank <= 0:
                raise ValueError(f"Invalid number of samples: n_samples_per_rank={n_samples_per_rank}")
            self.chain_length = math.ceil(n_samples_per_rank / self.sampler.n_chains)

        def sample(self, *, chain_length: int | None = None, n_samples: int | None = None,
                   n_discard_per_chain: int | None = None) -> jax.Array:
            if n_samples is not None and chain_length is None:  # all ranks together -> this rank's chains
                chain_length = math.ceil(n_samples / (self.sampler.n_chains * self._distlinalg_comm.size))
                n_samples = None
            return super().sample(chain_length=chain_length, n_samples=n_samples,
                                  n_discard_per_chain=n_discard_per_chain)

        # global estimates --------------------------------------------------------------------
        def _distlinalg_local_values(self, O: Any) -> jax.Array:
            values = self.local_estimators(O)
            if getattr(values, "combinator", None) is not None:
                raise NotImplementedError(
                    "distlinalg.netket.MCState: observables with several channels (nonlinear "
                    "observables) are not supported under MPI")
            return values.data

        def expect(self, O: Any) -> Any:
            """Statistics of ⟨O⟩ over all ranks' samples (identical on every rank)."""
            # Waited for: in `E = vstate.expect(H); if rank == 0: print(E)` the other ranks
            # never read E, and a collective still queued when such a rank reaches the end
            # of its program would meet distlinalg's end-of-program check instead.
            return self._distlinalg_statistics(self._distlinalg_local_values(O))

        def expect_and_forces(self, O: Any, *, mutable: Any = None) -> tuple[Any, Any]:
            """(statistics of ⟨O⟩, F = Cov(∂ log ψ, O_loc)) over all ranks' samples."""
            if mutable is None:
                mutable = self.mutable
            if mutable is not False:
                raise NotImplementedError("distlinalg.netket.MCState: models with mutable state are not supported")
            samples = self.samples
            e_loc = self._distlinalg_local_values(O)
            # Kept for distlinalg.netket.SR, tied to these samples (checked by identity).
            self._distlinalg_local_energies = (samples, e_loc)
            return _energy_and_force(self._apply_fun, self._distlinalg_comm, self.parameters, self.model_state,
                                     samples.reshape(-1, samples.shape[-1]), e_loc)

        def expect_and_grad(self, O: Any, *, mutable: Any = None, use_covariance: bool | None = None,
                            **kwargs: Any) -> tuple[Any, Any]:
            """(statistics of ⟨O⟩, its gradient 2 Re F / 2 F) over all ranks' samples."""
            hermitian = getattr(O, "is_hermitian", True) and not isinstance(O, nk.operator.Squared)
            if use_covariance is False or (use_covariance is None and not hermitian):
                raise NotImplementedError(
                    "distlinalg.netket.MCState: only the covariance gradient of Hermitian operators is "
                    "distributed")
            if kwargs:
                raise TypeError(f"distlinalg.netket.MCState.expect_and_grad: unexpected {sorted(kwargs)}")
            stats, force = self.expect_and_forces(O, mutable=mutable)
            return stats, _force_to_grad(force, self.parameters)

    from . import _paths

    _paths.install()
    MCState.__name__ = MCState.__qualname__ = "MCState"
    MCState.__module__ = __name__
    MCState.__doc__ = _MCSTATE_DOC

    # flax serialisation (NetKet's loggers and checkpoints) looks the exact type up.
    from flax import serialization
    from netket.vqs.mc.mc_state.state import deserialize_MCState, serialize_MCState

    def deserialize(vstate: Any, state_dict: Any) -> Any:
        new = deserialize_MCState(vstate, state_dict)
        # A checkpoint holds one rank's sampler state (rank 0 writes it): the other ranks
        # fold their rank into its key, so that their chains differ again.
        c = new._distlinalg_comm
        if c.rank > 0 and hasattr(new.sampler_state, "rng"):
            new.sampler_state = new.sampler_state.replace(rng=jax.random.fold_in(new.sampler_state.rng, c.rank))
        return new

    serialization.register_serialization_state(MCState, serialize_MCState, deserialize)
    return MCState


_MCSTATE_DOC = """``nk.vqs.MCState`` whose estimates cover the samples of all MPI ranks.

    ``MCState(sampler, model, *, n_samples=None, n_samples_per_rank=None,
    seed=None, sampler_seed=None, comm=None, check_parameters=True, **netket_kwargs)``; the other
    keyword arguments (``n_discard_per_chain``, ``chunk_size``, ``variables``,
    ...) are NetKet's.

    * Every rank runs ``sampler.n_chains`` chains; ``n_samples`` is the total
      over all ranks (rounded up to a multiple of ``P · n_chains``) and
      ``n_samples_per_rank`` that of one rank. ``vstate.samples`` holds this
      rank's ``(n_chains, chain_length, N_sites)`` samples.
    * Parameters are identical on every rank (NetKet's initialisation with the
      common `seed`, then a broadcast of rank 0's variables; with no `seed`
      rank 0 draws one). Rank 0's sampler seed is NetKet's (so one rank gives
      exactly ``nk.vqs.MCState``), rank r > 0 folds r into it.
    * ``expect(O)`` returns :func:`statistics` of the local estimators over
      all ranks; ``expect_and_forces(O)`` also the force
      ``F = (1/N) Σ_k conj(O_k) (O_loc,k − ⟨O⟩)`` over all ``N`` samples
      (one VJP of this rank's samples, one allreduce); ``expect_and_grad(O)``
      NetKet's gradient ``2 Re F`` (real parameters) or ``2 F`` (complex).
      Values are identical on every rank. They also keep the local energies
      of the current samples for :class:`SR`.

    * ``quantum_geometric_tensor(qgt_T)`` returns NetKet's QGT of that type
      over all ranks' samples (``nk.optimizer.SR`` and ``nk.driver.VMC_SR``
      use them unchanged; see the module docstring).
    * After every parameter update the parameters are checked to be the
      same on every rank (a 31-bit digest of their bits, min and max in one
      allreduce of two int32); a difference raises a RuntimeError on every
      rank naming the update. ``check_parameters=False`` turns it off.

    Not distributed: nonlinear (multi-channel) observables, models with
    mutable state, non-Hermitian gradients, and drivers other than VMC and
    VMC_SR (these raise). The force's VJP runs on all local samples at once
    (``chunk_size`` applies to the local energies only).

    Example:
      >>> import jax
      >>> jax.config.update("jax_enable_x64", True)      # as `import netket` does
      >>> import netket as nk
      >>> import distlinalg.netket as dnk
      >>> from distlinalg import comm
      >>> hi = nk.hilbert.Spin(0.5, N=4)                  # a 4-site transverse-field Ising chain
      >>> H = nk.operator.Ising(hi, nk.graph.Chain(4), h=1.0)
      >>> vstate = dnk.MCState(nk.sampler.MetropolisLocal(hi, n_chains=4), nk.models.RBM(alpha=1),
      ...                      n_samples=64 * dnk.size(), seed=0)
      >>> vstate.n_samples == 64 * dnk.size(), vstate.n_samples_per_rank
      (True, 64)
      >>> E = vstate.expect(H)              # mean and error bar over all ranks' chains
      >>> e = E.mean.real
      >>> bool(comm.allreduce(e, "max") == comm.allreduce(e, "min"))   # identical on every rank
      True
"""


def __getattr__(name: str) -> Any:
    # MCState subclasses NetKet's class, so it is built (and NetKet imported)
    # only when first asked for: importing this module never imports NetKet.
    if name == "MCState":
        cls = _make_mcstate()
        globals()["MCState"] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
