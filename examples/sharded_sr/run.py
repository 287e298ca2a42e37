"""Command line and training loop of the VMC/SR example.

    mpiexec -n 2 python -m examples.sharded_sr --model tfim --L 16 --iters 100
    mpiexec -n 2 python examples/sharded_sr/run.py ...      (same thing)

Every rank runs this; rank 0 prints and writes files. See README.md for
every option.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pickle
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    __package__ = "examples.sharded_sr"

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from distlinalg.comm import communicator  # noqa: E402

from .exact import basis_spins, exact_energy, variational_energy  # noqa: E402
from .hamiltonians import heisenberg, tfim  # noqa: E402
from .models import RBM, ShardedRBM  # noqa: E402
from .sampler import MetropolisSampler, SamplerState  # noqa: E402
from .sr import VMC, SRConfig  # noqa: E402


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m examples.sharded_sr",
                                description="VMC with stochastic reconfiguration over MPI (distlinalg)")
    a = p.add_argument
    a("--model", choices=["tfim", "heisenberg"], default="tfim", help="Hamiltonian (default tfim)")
    a("--L", type=int, default=8, help="chain length (default 8)")
    a("--h", type=float, default=1.0, help="TFIM transverse field h (default 1)")
    a("--J", type=float, default=1.0, help="coupling J (default 1)")
    a("--no-marshall", action="store_true", help="Heisenberg without the Marshall sign rotation (needs --dtype complex)")
    a("--iters", type=int, default=50, help="SR iterations (default 50)")
    a("--solver", choices=["cg", "minres"], default="cg", help="linear solver of each SR step (default cg)")
    a("--rtol", type=float, default=1e-6, help="solver relative tolerance (default 1e-6)")
    a("--maxiter", type=int, default=None, help="solver iteration limit (default 10 x #params)")
    a("--max-retries", type=int, default=3, help="retries of a failed solve, each with 10x diag-shift (default 3)")
    a("--samples", type=int, default=1008, help="total samples per step over all ranks (rounded up; default 1008)")
    a("--chains", type=int, default=16, help="Markov chains per rank (default 16)")
    a("--discard", type=int, default=4, help="thermalisation sweeps per step (default 4)")
    a("--lr", type=float, default=0.05, help="learning rate eta (default 0.05)")
    a("--diag-shift", type=float, default=0.01, help="diagonal shift lambda of S (default 0.01)")
    a("--diag-scale", type=float, default=None, help="relative diagonal regularisation epsilon (default off)")
    a("--alpha", type=int, default=1, help="hidden-unit density of the RBM (default 1)")
    a("--dtype", choices=["real", "complex"], default="real", help="RBM parameters (default real)")
    a("--mode", choices=["real", "holomorphic", "complex"], default=None,
      help="Gram operator mode (default: real for real, holomorphic for complex parameters)")
    a("--seed", type=int, default=0, help="random seed (parameters: seed, sampler: seed+1, folded with the rank)")
    a("--sharded-params", action="store_true", help="split the RBM's hidden units across ranks (sharded layout)")
    a("--output", default="sharded_sr_out", help="output folder for log.json and energy.png")
    a("--checkpoint", default=None, help="checkpoint file (pickle), written atomically by rank 0")
    a("--checkpoint-every", type=int, default=10, help="checkpoint every K iterations (default 10)")
    a("--resume", action="store_true", help="continue from --checkpoint (every rank reads it)")
    a("--meta-grad", action="store_true", help="after training, d(post-step energy)/d(diag_shift, lr, coupling) "
      "by AD through the solve, next to finite differences")
    a("--quiet", action="store_true", help="no per-step progress lines")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parser().parse_args(argv)


# -- construction (cached: tests build the same run repeatedly, and every new VMC
#    would recompile its jitted step) ---------------------------------------------
_CACHE: dict[Any, Any] = {}


def sr_config(args: argparse.Namespace) -> SRConfig:
    return SRConfig(lr=args.lr, diag_shift=args.diag_shift, diag_scale=args.diag_scale, solver=args.solver,
                    rtol=args.rtol, maxiter=args.maxiter, max_retries=args.max_retries, mode=args.mode)


def build(args: argparse.Namespace, comm: Any = None) -> tuple[VMC, Any, SamplerState, dict]:
    """(vmc, initial params (this rank's block if sharded), sampler state, couplings)."""
    c = communicator(comm)
    dtype = jnp.complex128 if args.dtype == "complex" else jnp.float64
    if args.model == "tfim":
        ham, move = tfim(args.L, h=args.h, J=args.J), "flip"
    else:
        ham, move = heisenberg(args.L, J=args.J, marshall=not args.no_marshall), "exchange"
    sweeps = max(1, math.ceil(args.samples / (c.size * args.chains)))
    sampler = MetropolisSampler(args.L, move, args.chains, sweeps, args.discard)
    model = ShardedRBM(args.L, args.alpha, dtype, comm=c) if args.sharded_params else RBM(args.L, args.alpha, dtype)
    params = model.init(jax.random.PRNGKey(args.seed))
    key = (args.model, args.L, args.no_marshall, move, args.chains, sweeps, args.discard, args.alpha, args.dtype,
           args.sharded_params, sr_config(args), c.handle)
    if key not in _CACHE:
        _CACHE[key] = VMC(ham, model, sampler, sr_config(args), params, comm=c)
    vmc = _CACHE[key]
    return vmc, params, sampler.init_state(args.seed + 1, c.rank), ham.couplings(h=args.h, J=args.J) \
        if args.model == "tfim" else ham.couplings(J=args.J)


# -- checkpoints -----------------------------------------------------------------------
def full_params(vmc: VMC, params: Any) -> dict:
    """Host copy of the whole parameter set (gathered when sharded)."""
    if vmc.sharded:
        params = vmc.model.gather(params)
    return {k: np.asarray(v) for k, v in params.items()}


def save_checkpoint(path: str, vmc: VMC, params: Any, state: SamplerState, iteration: int, log: dict) -> None:
    """Collective. Rank 0 writes params + every rank's chains and key +
    iteration + log to a temp file and renames it (atomic on POSIX)."""
    c = vmc.comm
    full = full_params(vmc, params)
    chains = c.comm.gather(np.asarray(state.chains), root=0)
    keys = c.comm.gather(np.asarray(state.key), root=0)
    if c.rank == 0:
        blob = {"iteration": iteration, "params": full, "chains": chains, "keys": keys, "log": log, "size": c.size}
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "wb") as fh:
            pickle.dump(blob, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    c.comm.Barrier()  # nobody resumes from (or overwrites) a half-written file


def load_checkpoint(path: str, vmc: VMC) -> tuple[Any, SamplerState, int, dict]:
    """Every rank reads the file and takes its own block/chains/key."""
    c = vmc.comm
    with open(path, "rb") as fh:
        blob = pickle.load(fh)
    if blob["size"] != c.size:
        raise ValueError(f"checkpoint written by {blob['size']} ranks, resuming on {c.size}")
    params = {k: jnp.asarray(v) for k, v in blob["params"].items()}
    if vmc.sharded:
        params = vmc.model.block(params)
    state = SamplerState(jnp.asarray(blob["chains"][c.rank]), jnp.asarray(blob["keys"][c.rank]))
    return params, state, int(blob["iteration"]), blob["log"]


# -- the loop ----------------------------------------------------------------------------------
LOG_KEYS = ("energy", "energy_error", "variance", "acceptance", "solver_iterations", "solver_residual",
            "solver_reason", "diag_shift", "retries", "skipped", "time")


def new_log(args: argparse.Namespace, exact: float | None, n_samples: int, size: int) -> dict:
    log = {k: [] for k in LOG_KEYS}
    log.update(exact_energy=exact, failures=[], ranks=size, samples_total=n_samples,
               args={k: v for k, v in vars(args).items()})
    return log


def relative_error(log: dict, last: int = 10) -> float | None:
    """|mean of the last `last` energies − exact| / |exact| (None without exact)."""
    if log["exact_energy"] is None or not log["energy"]:
        return None
    tail = log["energy"][-last:]
    return abs(float(np.mean(tail)) - log["exact_energy"]) / abs(log["exact_energy"])


def train(args: argparse.Namespace, comm: Any = None) -> dict:
    """Run (or resume) the optimisation; returns {"log", "params", "state", "vmc"} on every rank."""
    vmc, params, state, couplings = build(args, comm)
    c = vmc.comm
    rank0 = c.rank == 0
    exact = None
    if rank0:
        name = "tfim" if args.model == "tfim" else "heisenberg"
        exact = exact_energy(name, args.L, {"h": args.h, "J": args.J})
    exact = c.comm.bcast(exact, root=0)
    log = new_log(args, exact, vmc.sampler.n_local * c.size, c.size)
    start = 0
    if args.resume:
        if not args.checkpoint or not os.path.exists(args.checkpoint):
            raise FileNotFoundError(f"--resume needs an existing --checkpoint file, got {args.checkpoint!r}")
        params, state, start, log = load_checkpoint(args.checkpoint, vmc)
        if rank0 and not args.quiet:
            print(f"resumed from {args.checkpoint} at iteration {start}", flush=True)
    wall = time.perf_counter()
    for it in range(start, args.iters):
        params, state, rec = vmc.step(params, state, couplings)
        for k in LOG_KEYS:
            log[k].append(rec[k])
        if rec["retries"] or rec["skipped"]:
            log["failures"].append({"iteration": it, "attempts": rec["attempts"], "skipped": rec["skipped"]})
            if rank0:
                tried = ", ".join(f"λ={a['diag_shift']:.1e}: {a['reason_name']} after {a['iterations']} it"
                                  for a in rec["attempts"])
                verdict = "step SKIPPED (parameters unchanged)" if rec["skipped"] else "retried"
                print(f"[iter {it}] solver failure: {tried} -> {verdict}", flush=True)
        if rank0 and not args.quiet:
            rel = "" if exact is None else f" rel.err {abs(rec['energy'] - exact) / abs(exact):.2e}"
            print(f"{it:5d}  E = {rec['energy']:.6f} ± {rec['energy_error']:.6f}{rel}  | {args.solver} "
                  f"{rec['solver_iterations']:4d} it, res {rec['solver_residual']:.1e} {rec['solver_reason']}"
                  f" | {rec['time']:.3f} s", flush=True)
        if args.checkpoint and (it + 1) % args.checkpoint_every == 0:
            save_checkpoint(args.checkpoint, vmc, params, state, it + 1, log)
    log["wall_time"] = log.get("wall_time", 0.0) + time.perf_counter() - wall
    log["relative_error"] = relative_error(log)
    log["relative_error_last"] = (None if exact is None or not log["energy"]
                                  else abs(log["energy"][-1] - exact) / abs(exact))
    log["variational_energy"] = log["variational_relative_error"] = None
    if args.L <= 16 and exact is not None:
        # No sampling noise: ⟨H⟩ of the final ψ on the whole (Sz = 0 for
        # Heisenberg) Hilbert space. Collective for the sharded model.
        logs = np.asarray(jax.jit(vmc.log_psi)(params, jnp.asarray(basis_spins(args.L))))
        if rank0:
            ev = variational_energy(logs, args.model, args.L, {"h": args.h, "J": args.J},
                                    marshall=not args.no_marshall)
            log["variational_energy"], log["variational_relative_error"] = ev, abs(ev - exact) / abs(exact)
        log["variational_energy"], log["variational_relative_error"] = c.comm.bcast(
            (log["variational_energy"], log["variational_relative_error"]), root=0)
    return {"log": log, "params": params, "state": state, "vmc": vmc, "couplings": couplings}


def meta_grad(args: argparse.Namespace, result: dict) -> dict:
    """Derivatives of the post-step energy (fixed samples, reweighted) with
    respect to diag_shift, lr and the coupling (h for TFIM, J for Heisenberg),
    by AD through the solve and by central differences."""
    vmc0 = result["vmc"]
    # A tight tolerance so the finite differences see a smooth function.
    tight = vmc0.with_config(dataclasses.replace(vmc0.cfg, rtol=1e-12, maxiter=None))
    out = tight.sample(result["params"], result["state"], result["couplings"])
    coupling = "h" if args.model == "tfim" else "J"
    return tight.meta_gradient(result["params"], out["samples"], args.diag_shift, args.lr, result["couplings"],
                               coupling)


def plot(log: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("warning: matplotlib is not installed; skipping the energy plot", flush=True)
        return False
    e = np.asarray(log["energy"])
    err = np.asarray(log["energy_error"])
    it = np.arange(len(e))
    fig, axes = plt.subplots(1, 2 if log["exact_energy"] is not None else 1, figsize=(11, 4), squeeze=False)
    ax = axes[0, 0]
    ax.errorbar(it, e, yerr=err, fmt=".-", ms=3, lw=0.8, label="VMC energy (naive error bars)")
    if log["exact_energy"] is not None:
        ax.axhline(log["exact_energy"], color="k", ls="--", label=f"exact {log['exact_energy']:.6f}")
        rel = np.abs(e - log["exact_energy"]) / abs(log["exact_energy"])
        axes[0, 1].semilogy(it, rel, ".-", ms=3, lw=0.8)
        axes[0, 1].set_xlabel("iteration")
        axes[0, 1].set_ylabel("|E − E₀| / |E₀|")
        axes[0, 1].grid(True, which="both", alpha=0.3)
    a = log["args"]
    ax.set_title(f"{a['model']} L={a['L']}, {log['ranks']} ranks, {log['samples_total']} samples, {a['solver']}")
    ax.set_xlabel("iteration")
    ax.set_ylabel("energy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    result = train(args)
    log = result["log"]
    c = result["vmc"].comm
    if args.meta_grad:
        mg = meta_grad(args, result)
        log["meta_grad"] = mg
        if c.rank == 0:
            print(f"meta-gradient of the post-step energy ({mg['energy']:.8f}) on fixed samples:")
            for name, g in mg["grad"].items():
                fd = mg["fd"][name]
                print(f"  d/d{name:<10s} AD {g: .10e}   FD {fd: .10e}   rel.diff {abs(g - fd) / max(abs(fd), 1e-300):.1e}")
    if c.rank == 0:
        out = Path(args.output)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "log.json", "w") as fh:
            json.dump(log, fh, indent=1)
        plotted = plot(log, out / "energy.png")
        rel = log["relative_error"]
        print(f"done: {len(log['energy'])} iterations, {log['wall_time']:.1f} s; final energy "
              f"{np.mean(log['energy'][-10:]):.6f} (mean of last 10), exact {log['exact_energy']}, "
              f"relative error {rel if rel is None else f'{rel:.2e}'}"
              + ("" if log["variational_energy"] is None else
                 f"; exact <H> of the final state {log['variational_energy']:.6f} "
                 f"(relative error {log['variational_relative_error']:.2e})")
              + f"; wrote {out / 'log.json'}"
              + (f" and {out / 'energy.png'}" if plotted else ""), flush=True)
    return result


if __name__ == "__main__":
    main()
