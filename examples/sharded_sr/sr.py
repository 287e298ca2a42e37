"""Stochastic reconfiguration: estimators, the force, the SR solve, the
step with failure handling, and the meta-gradient through the solve.

Conventions (N = total samples over all ranks, ΔX = X − mean over all N):
  E   = (1/N) Σ_k E_loc(σ_k)                       (allreduced)
  σ_E = sqrt(Var E_loc / N)                        naive: ignores autocorrelation
  O_k = ∂ log ψ(σ_k)/∂θ
  F   = (1/N) Σ_k conj(ΔO_k) ΔE_loc,k = (1/N) Σ_k conj(O_k) ΔE_loc,k
        (ΔE_loc sums to zero over all samples, so centring O is free)
  S   = (1/N) ΔOᴴ ΔO  (distlinalg.operators.gram, center=True)

Modes (those of the Gram operator):
  "real": real θ. ∂E/∂θ = 2 Re F, and S = Re(ΔOᴴΔO)/N; SR solves
    S δ = Re F. (With a complex log ψ this is the real-part convention of
    the operator, where Re and Im of log ψ are two real outputs.)
  "holomorphic": complex θ, holomorphic log ψ: ∂E/∂θ* = F, S complex,
    S δ = F.
  "complex": complex θ seen as (Re θ, Im θ) ∈ R²ⁿ; force and S are those
    of "real" mode on the 2n real parameters, packed as re + i·im exactly as
    the operator packs its vectors. For a holomorphic model it equals the
    holomorphic force.
Update: θ ← θ − η δ.

The force is one VJP of log ψ with the cotangent conj(ΔE_loc)/N (JAX's VJP
does not conjugate), allreduced for replicated parameters; for sharded
parameters the VJP of the communicating model already sums every rank's
samples into this rank's block (distlinalg's AD convention).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import distlinalg
import distlinalg.ad as dad
from distlinalg.comm import communicator
from distlinalg.comm import allreduce
from distlinalg.operators import gram
from distlinalg.solvers import Reason

from .hamiltonians import Hamiltonian
from .sampler import MetropolisSampler, SamplerState

tmap = jax.tree_util.tree_map


@dataclass(frozen=True)
class SRConfig:
    """Hyperparameters of the SR step.

    lr: η. diag_shift: λ. diag_scale: ε (adds ε·diag(S), None = off).
    solver: "cg" or "minres". rtol/maxiter: solver tolerance and limit
    (None = distlinalg's default, 10 × the parameter count). max_retries:
    how many times a failed solve is retried with a 10× larger λ.
    mode: Gram mode, None = "real" for real and "holomorphic" for complex
    parameters. chunk_size: the Gram operator's sample chunk (None: off).
    """

    lr: float = 0.05
    diag_shift: float = 0.01
    diag_scale: float | None = None
    solver: str = "cg"
    rtol: float = 1e-6
    maxiter: int | None = None
    max_retries: int = 3
    mode: str | None = None
    chunk_size: int | None = None


def default_mode(params: Any) -> str:
    complex_ = any(jnp.iscomplexobj(x) for x in jax.tree_util.tree_leaves(params))
    return "holomorphic" if complex_ else "real"


# -- estimators -----------------------------------------------------------------
def energy_stats(e_loc: jax.Array, comm: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(E (complex or real mean), Var E_loc, naive σ_E) over all ranks' samples.

    Needs equal sample counts per rank (N = P·n). Values identical on every rank.
    """
    c = communicator(comm)
    n_total = e_loc.shape[0] * c.size
    mean = allreduce(jnp.sum(e_loc), "sum", comm=c) / n_total
    var = allreduce(jnp.sum(jnp.abs(e_loc - mean) ** 2), "sum", comm=c) / n_total
    return mean, var, jnp.sqrt(var / n_total)


def force(log_psi: Callable[[Any, jax.Array], jax.Array], params: Any, samples: jax.Array,
          weights: jax.Array, mode: str, sharded: bool, comm: Any) -> Any:
    """Σ_k conj(O_k) w_k over all ranks' samples, in the solver's convention.

    weights: (n,) this rank's w_k (= ΔE_loc,k / N for the SR force).
    Returns a pytree like params (this rank's block when sharded).
    """
    ct = jnp.conj(weights)
    if mode == "complex":
        split = (tmap(jnp.real, params), tmap(jnp.imag, params))
        g = lambda t: log_psi(tmap(lambda r, i: r + 1j * i, *t), samples)  # noqa: E731
        out_dtype = jax.eval_shape(g, split).dtype
        (re, im), = jax.vjp(g, split)[1](ct.astype(out_dtype))
        out = tmap(lambda r, i: r + 1j * i, re, im)
    else:
        out_dtype = jax.eval_shape(lambda p: log_psi(p, samples), params).dtype
        (out,) = jax.vjp(lambda p: log_psi(p, samples), params)[1](ct.astype(out_dtype))
        if mode == "holomorphic":
            out = tmap(jnp.conj, out)
    if not sharded and communicator(comm).size > 1:
        out = allreduce(out, "sum", comm=comm)
    return out


def sr_solve(log_psi: Callable[[Any, jax.Array], jax.Array], params: Any, samples: jax.Array, rhs: Any,
             diag_shift: Any, cfg: SRConfig, mode: str, sharded: bool, comm: Any) -> tuple[Any, Any]:
    """δ = (S + λ + ε diag S)⁻¹ rhs with distlinalg.cg / minres; (δ, SolverInfo).

    The Gram operator is built here, inside whatever is traced, so jax.grad
    through this function differentiates through the solve (one extra
    solve, lax.custom_linear_solve) and through S's dependence on λ and θ.
    """
    S = gram(log_psi, params, samples, diag_shift=diag_shift, diag_scale=cfg.diag_scale, mode=mode,
             comm=comm, sharded_params=sharded, equal_samples=True, chunk_size=cfg.chunk_size)
    solver = {"cg": distlinalg.cg, "minres": distlinalg.minres}[cfg.solver]
    return solver(S, rhs, rtol=cfg.rtol, maxiter=cfg.maxiter)


def reweighted_energy(vmc: "VMC", params_new: Any, log_psi_old: jax.Array, samples: jax.Array,
                      couplings: Mapping[str, Any]) -> jax.Array:
    """Re ⟨H⟩ of ψ_new estimated on samples drawn from |ψ_old|²:
    Σ w_k E_loc,new(σ_k) / Σ w_k, w_k = |ψ_new/ψ_old|² (importance sampling).

    The largest log-weight is subtracted for stability; it cancels in the
    ratio, so it is held constant for AD (stop_gradient + allreduce max).
    """
    log_w = 2.0 * jnp.real(vmc.log_psi(params_new, samples) - log_psi_old)
    top = allreduce(jax.lax.stop_gradient(jnp.max(log_w)), "max", comm=vmc.comm)
    w = jnp.exp(log_w - top)
    e_new = vmc.hamiltonian.local_energy(vmc.log_psi, params_new, samples, couplings)
    num = allreduce(jnp.sum(w * e_new), "sum", comm=vmc.comm)
    den = allreduce(jnp.sum(w), "sum", comm=vmc.comm)
    return jnp.real(num / den)


# -- the driver ---------------------------------------------------------------------
class VMC:
    """A VMC/SR run: Hamiltonian, model, sampler, SR settings, communicator.

    ``model`` has ``log_psi(params, x)`` and ``sharded`` (True: params are
    this rank's block, the operator and solve use the sharded layout).
    Jitted pieces: ``sample`` (Metropolis + local energies + statistics +
    force) and ``solve_update`` (Gram operator, solve, θ − ηδ). The retry
    decision between them is taken in Python from SolverInfo and allreduced
    flags, identical on every rank, so every rank takes the same path.
    """

    def __init__(self, hamiltonian: Hamiltonian, model: Any, sampler: MetropolisSampler, cfg: SRConfig,
                 params_like: Any, comm: Any = None):
        self.hamiltonian, self.model, self.sampler, self.cfg = hamiltonian, model, sampler, cfg
        self.comm = communicator(comm)
        self.sharded = bool(getattr(model, "sharded", False))
        self.mode = cfg.mode or default_mode(params_like)
        self.log_psi = model.log_psi
        self.sample = jax.jit(self._sample)
        self.solve_update = jax.jit(self._solve_update)

    def with_config(self, cfg: SRConfig) -> "VMC":
        """A VMC with other SR settings that reuses this one's compiled sampler."""
        other = VMC.__new__(VMC)
        other.__dict__.update(self.__dict__)
        other.cfg = cfg
        other.solve_update = jax.jit(other._solve_update)
        return other

    # jitted bodies -------------------------------------------------------------
    def _sample(self, params: Any, state: SamplerState, couplings: Mapping[str, Any]) -> dict[str, Any]:
        samples, state, acceptance = self.sampler.sample(self.log_psi, params, state)
        return {"samples": samples, "state": state, "acceptance": acceptance,
                **self._estimate(params, samples, couplings)}

    def _estimate(self, params: Any, samples: jax.Array, couplings: Mapping[str, Any]) -> dict[str, Any]:
        e_loc = self.hamiltonian.local_energy(self.log_psi, params, samples, couplings)
        mean, var, err = energy_stats(e_loc, self.comm)
        n_total = samples.shape[0] * self.comm.size
        F = force(self.log_psi, params, samples, (e_loc - mean) / n_total, self.mode, self.sharded, self.comm)
        return {"e_loc": e_loc, "energy": jnp.real(mean), "variance": var, "error": err, "force": F}

    def _solve_update(self, params: Any, samples: jax.Array, F: Any, diag_shift: Any,
                      lr: Any) -> tuple[Any, Any, Any]:
        delta, info = sr_solve(self.log_psi, params, samples, F, diag_shift, self.cfg, self.mode, self.sharded,
                               self.comm)
        new = tmap(lambda p, d: p - lr * d, params, delta)
        # Non-finite entries anywhere (any rank's block) fail the step on every rank.
        bad = sum(jnp.sum(~jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(new)).astype(jnp.float64)
        bad = allreduce(bad, "sum", comm=self.comm) if self.comm.size > 1 else bad
        return new, info, bad

    def estimate(self, params: Any, samples: jax.Array, couplings: Mapping[str, Any]) -> dict[str, Any]:
        return jax.jit(self._estimate)(params, samples, couplings)

    # one SR step -----------------------------------------------------------------
    def step(self, params: Any, state: SamplerState, couplings: Mapping[str, Any]) -> tuple[Any, SamplerState, dict]:
        """Sample, estimate, solve (retrying failed solves with 10× λ), update.

        A solve counts as failed when its reason is not a convergence
        (max iterations, breakdown, indefinite, NaN/Inf) or the new
        parameters are not finite. After ``max_retries`` failed retries the
        step is skipped: parameters unchanged, recorded as "skipped".
        Returns (params, sampler state, record of plain Python values).
        """
        t0 = time.perf_counter()
        out = self.sample(params, state, couplings)
        shift = float(self.cfg.diag_shift)
        attempts = []
        new_params = None
        for _ in range(self.cfg.max_retries + 1):
            candidate, info, bad = self.solve_update(params, out["samples"], out["force"], shift, self.cfg.lr)
            reason = int(info.reason)
            ok = reason > 0 and float(bad) == 0.0
            attempts.append({"diag_shift": shift, "iterations": int(info.iterations),
                             "residual": float(info.residual_norm), "reason": reason, "reason_name": Reason(reason).name,
                             "ok": ok})
            if ok:
                new_params = candidate
                break
            shift *= 10.0
        jax.block_until_ready(new_params if new_params is not None else params)
        record = {
            "energy": float(out["energy"]), "energy_error": float(out["error"]), "variance": float(out["variance"]),
            "acceptance": float(allreduce(out["acceptance"], "sum", comm=self.comm)) / self.comm.size,
            "solver_iterations": attempts[-1]["iterations"], "solver_residual": attempts[-1]["residual"],
            "solver_reason": attempts[-1]["reason_name"], "diag_shift": attempts[-1]["diag_shift"],
            "retries": len(attempts) - 1, "skipped": new_params is None, "attempts": attempts,
            "time": time.perf_counter() - t0,
        }
        return (params if new_params is None else new_params), out["state"], record

    # meta-gradient ------------------------------------------------------------------
    def post_step_energy(self, params: Any, samples: jax.Array, diag_shift: Any, lr: Any,
                         couplings: Mapping[str, Any]) -> jax.Array:
        """The energy after one SR step, on fixed samples (reweighted), as a
        replicated scalar function of (λ, η, couplings): differentiable end to
        end, through the local energies, the force and the CG/MINRES solve."""
        est = self._estimate(params, samples, couplings)
        new, _, _ = self._solve_update(params, samples, est["force"], diag_shift, lr)
        return reweighted_energy(self, new, self.log_psi(params, samples), samples, couplings)

    def meta_gradient(self, params: Any, samples: jax.Array, diag_shift: float, lr: float,
                      couplings: Mapping[str, Any], coupling: str, eps: float = 1e-5) -> dict[str, Any]:
        """dE_post/dλ, dE_post/dη and dE_post/d(coupling) by reverse mode
        (distlinalg.ad.grad: exact for a replicated loss on any rank count)
        and by central finite differences with relative step `eps`."""

        def loss(shift: Any, rate: Any, g: Any) -> jax.Array:
            return self.post_step_energy(params, samples, shift, rate, {**couplings, coupling: g})

        args = (jnp.asarray(diag_shift, jnp.float64), jnp.asarray(lr, jnp.float64),
                jnp.asarray(couplings[coupling], jnp.float64))
        value = jax.jit(loss)(*args)
        grads = jax.jit(dad.grad(loss, argnums=(0, 1, 2), comm=self.comm))(*args)
        f = jax.jit(loss)
        fd = []
        for i in range(3):
            step = eps * max(abs(float(args[i])), 1e-3)
            plus = list(args)
            minus = list(args)
            plus[i] = args[i] + step
            minus[i] = args[i] - step
            fd.append((float(f(*plus)) - float(f(*minus))) / (2 * step))
        names = ["diag_shift", "lr", coupling]
        return {"energy": float(value), "grad": dict(zip(names, map(float, grads))), "fd": dict(zip(names, fd))}


def params_equal_across_ranks(params: Any, comm: Any) -> bool:
    """Bitwise equality of replicated parameters on every rank (host side)."""
    c = communicator(comm)
    flat = np.concatenate([np.asarray(x).ravel().view(np.uint8) for x in jax.tree_util.tree_leaves(params)])
    return all(np.array_equal(flat, other) for other in c.comm.allgather(flat))
