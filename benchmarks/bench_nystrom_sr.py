"""Nyström-preconditioned CG on the SR systems of NetKet models, against plain CG, in one run.

    [mpiexec -n P] python benchmarks/bench_nystrom_sr.py [--shifts 1e-3 1e-4] [--rank 100 200] [--write]

Systems: (S + λ) δ = F in parameter space (``distlinalg.natural_gradient``, solver "cg", rtol 1e-8,
maxiter 5000), on the samples and local energies of a NetKet ``MCState`` after a few plain SR
steps (so the spectrum is that of a trained state, not of the initialisation):

* ``tfim-rbm``: transverse-field Ising chain L = 16 (h = 1), RBM α = 1 (288 parameters),
  the examples' problem;
* ``tfim-rbm-wide``: the same chain, RBM α = 64 (17,424 parameters);
* ``heisenberg-mlp``: Heisenberg chain L = 16, a two-layer MLP (64, 64) with a log-cosh output
  (about 6,000 parameters) (NetKet's ``nk.models.MLP``).

1024 samples (MetropolisLocal, 16 chains). For each shift λ: the iterations and the time of one
solve (compiled first, best of 3), plain and with ``preconditioner=lambda S: nystrom(S, rank)``
(its build, ``rank`` products with S, included in the time).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax

jax.config.update("jax_enable_x64", True)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def problems():
    import netket as nk

    chain = nk.graph.Chain(16)
    hi = nk.hilbert.Spin(0.5, N=16)
    tfim = nk.operator.Ising(hi, chain, h=1.0)
    heis_hi = nk.hilbert.Spin(0.5, N=16, total_sz=0)
    heis = nk.operator.Heisenberg(heis_hi, chain)
    mlp = nk.models.MLP(hidden_dims=(64, 64), hidden_activations=nk.nn.log_cosh, output_activation=None)
    return {
        "tfim-rbm": (hi, tfim, nk.models.RBM(alpha=1), nk.sampler.MetropolisLocal(hi, n_chains=16)),
        "tfim-rbm-wide": (hi, tfim, nk.models.RBM(alpha=64), nk.sampler.MetropolisLocal(hi, n_chains=16)),
        "heisenberg-mlp": (heis_hi, heis, mlp, nk.sampler.MetropolisExchange(heis_hi, graph=chain, n_chains=16)),
    }


def measure(name, shifts, ranks, warm_steps):
    import netket as nk
    import jax.numpy as jnp

    import distlinalg as dl

    hi, H, model, sampler = problems()[name]
    vstate = nk.vqs.MCState(sampler, model, n_samples=1024, seed=0, sampler_seed=1)
    driver = nk.driver.VMC(H, nk.optimizer.Sgd(0.02), variational_state=vstate,
                           preconditioner=nk.optimizer.SR(diag_shift=0.01))
    driver.run(warm_steps, out=(), show_progress=False)
    samples = vstate.samples.reshape(-1, hi.size)
    e_loc = jnp.asarray(vstate.local_estimators(H)).reshape(-1)
    params = vstate.parameters
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))

    def log_psi(p, s):
        return vstate._apply_fun({"params": p, **vstate.model_state}, s)

    def solver(shift, rank):
        pre = None if rank is None else (lambda S: dl.solvers.nystrom(S, rank=rank))
        return jax.jit(lambda p, s, e: dl.natural_gradient(log_psi, p, s, e, diag_shift=shift, space="parameters",
                                                           solver="cg", rtol=1e-8, maxiter=5000,
                                                           preconditioner=pre))

    rows = []
    for shift in shifts:
        for rank in [None, *ranks]:
            program = solver(shift, rank)
            delta, info = program(params, samples, e_loc)
            jax.block_until_ready(delta)
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                delta, info = program(params, samples, e_loc)
                jax.block_until_ready(delta)
                best = min(best, time.perf_counter() - start)
            rows.append({"problem": name, "params": int(n_params), "shift": shift, "rank": rank,
                         "iterations": int(info.iterations), "converged": bool(info.converged), "seconds": best})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def table(rows):
    lines = ["| problem | parameters | λ | preconditioner | CG iterations | solve s (build incl.) | iterations / plain "
             "| time / plain |", "|---|---|---|---|---|---|---|---|"]
    plain = {(r["problem"], r["shift"]): r for r in rows if r["rank"] is None}
    for r in rows:
        base = plain[(r["problem"], r["shift"])]
        label = "none" if r["rank"] is None else f"nystrom, rank {r['rank']}"
        conv = "" if r["converged"] else " (not converged)"
        lines.append(f"| {r['problem']} | {r['params']:,} | {r['shift']:g} | {label} | {r['iterations']}{conv} "
                     f"| {r['seconds']:.3f} | {r['iterations'] / base['iterations']:.2f} "
                     f"| {r['seconds'] / base['seconds']:.2f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", nargs="+", default=["tfim-rbm", "tfim-rbm-wide", "heisenberg-mlp"])
    parser.add_argument("--shifts", type=float, nargs="+", default=[1e-3, 1e-4])
    parser.add_argument("--rank", type=int, nargs="+", default=[100, 200])
    parser.add_argument("--warm-steps", type=int, default=20)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    rows = []
    for name in args.problems:
        rows += measure(name, args.shifts, args.rank, args.warm_steps)
    text = table(rows)
    print(text)
    if args.write:
        (ROOT / "benchmarks" / "results_nystrom.md").write_text(
            "# Nyström-preconditioned CG on SR systems\n\n"
            f"`python benchmarks/bench_nystrom_sr.py --write` ({time.strftime('%Y-%m-%d')}, 1 process, this "
            "2-core machine). Parameter-space SR systems (S + λ) δ = F of NetKet states after 20 SR steps, "
            "1024 samples, CG to rtol 1e-8 (maxiter 5000); times are the best of 3 after compilation, the "
            "Nyström build (rank products with S, batched) included.\n\n" + text + "\n")


if __name__ == "__main__":
    main()
