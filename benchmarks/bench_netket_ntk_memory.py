"""VMC_SR(use_ntk=True) at 10^5 parameters: step time and peak memory per rank.

    .venv/bin/python benchmarks/bench_netket_ntk_memory.py --impl netket        # NetKet, one process
    .venv/bin/python benchmarks/bench_netket_ntk_memory.py --impl distlinalg    # dnk.MCState, 1 rank
    mpiexec -n 2 .venv/bin/python benchmarks/bench_netket_ntk_memory.py --impl distlinalg
    mpiexec -n 2 .venv/bin/python benchmarks/bench_netket_ntk_memory.py --impl distlinalg \
        --samples 8192 --solver cholesky_distributed --on-the-fly 0

TFIM chain L=64, RBM α=25 (104,064 real parameters), 4096 samples in all (16
chains per rank), ``nk.driver.VMC_SR(use_ntk=True)`` with NetKet's default
``on_the_fly`` and solver, diag_shift 0.01. Each run is a separate process, so
that its peak resident memory (``ru_maxrss``, the largest over the ranks) is its
own; the step time is the median of ``--steps`` steps after one warm-up step.

``--solver``: the driver's ``linear_solver``: ``default`` (NetKet's default left in
place; on a dnk.MCState with P > 1 that is the row-split Cholesky with the
pinv_smooth fallback), ``cholesky_distributed`` / ``pinv_smooth_distributed``
(distlinalg.netket's, the kernel split by rows), ``netket_cholesky``
(``nk.optimizer.solver.cholesky``: on a dnk.MCState the kernel is gathered on every
rank). ``--on-the-fly``: NetKet's lazy NTK (1) or the Jacobian's (0); unset: NetKet's
choice (1 for ``use_ntk=True``).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _util  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impl", choices=("netket", "distlinalg"), required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--sites", type=int, default=64)
    parser.add_argument("--alpha", type=int, default=25)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--solver", default="default",
                        choices=("default", "cholesky_distributed", "pinv_smooth_distributed", "netket_cholesky"))
    parser.add_argument("--on-the-fly", type=int, choices=(0, 1), default=None)
    parser.add_argument("--json")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import jax
    import netket as nk
    import optax
    from mpi4py import MPI

    import distlinalg.netket as dnk

    comm = MPI.COMM_WORLD
    hilbert = nk.hilbert.Spin(0.5, N=args.sites)
    H = nk.operator.Ising(hilbert, nk.graph.Chain(args.sites, pbc=True), h=1.0, J=1.0)
    sampler = nk.sampler.MetropolisLocal(hilbert, n_chains=16)
    model = nk.models.RBM(alpha=args.alpha, param_dtype=float)
    if args.impl == "netket":
        if comm.Get_size() > 1:
            raise SystemExit("--impl netket runs in one process")
        vstate = nk.vqs.MCState(sampler, model, n_samples=args.samples, n_discard_per_chain=2, seed=0)
    else:
        vstate = dnk.MCState(sampler, model, n_samples=args.samples, n_discard_per_chain=2, seed=0)
    options = {} if args.on_the_fly is None else {"on_the_fly": bool(args.on_the_fly)}
    solvers = {"cholesky_distributed": dnk.cholesky_distributed, "pinv_smooth_distributed": dnk.pinv_smooth_distributed,
               "netket_cholesky": nk.optimizer.solver.cholesky}
    if args.solver != "default":
        options["linear_solver"] = solvers[args.solver]
    driver = nk.driver.VMC_SR(H, optax.sgd(0.01), variational_state=vstate, diag_shift=0.01, use_ntk=True,
                              **options)
    stamps = []

    def stamp(step, log, driver):
        jax.block_until_ready(driver.state.parameters)
        stamps.append(time.perf_counter())
        return True

    driver.run(1 + args.steps, out=(), show_progress=False, callback=stamp)
    step = statistics.median(b - a for a, b in zip(stamps, stamps[1:]))
    peak = max(comm.allgather(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20))  # GiB
    if comm.Get_rank() == 0:
        payload = {"bench": "netket_ntk_memory", "impl": args.impl, "ranks": comm.Get_size(),
                   "parameters": vstate.n_parameters, "samples": vstate.n_samples, "step_s": step,
                   "peak_rss_gib_per_rank": peak, "on_the_fly": driver.on_the_fly, "solver": args.solver}
        print(f"{args.impl} ranks={comm.Get_size()} params={vstate.n_parameters} samples={vstate.n_samples} "
              f"on_the_fly={driver.on_the_fly} solver={args.solver}: step {step:.2f} s, peak RSS per rank "
              f"{peak:.2f} GiB", flush=True)
        _util.write_json(args.json, payload)


if __name__ == "__main__":
    main()
