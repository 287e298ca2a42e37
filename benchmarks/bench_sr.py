"""Step time of the SR example (examples/sharded_sr), in one process or under mpiexec.

    [mpiexec -n 2] python benchmarks/bench_sr.py [--iters 50] [--warmup 3] [--json FILE]

The problem is NetKet's standard benchmark: TFIM chain L=16 (h = J = 1), RBM
α=1 (real parameters), 1008 samples per step over all ranks, SR with CG
(rtol 1e-6 as the example's default), diag_shift 0.01, learning rate 0.05.
The example's own ``build`` constructs the VMC; each ``vmc.step`` is timed
(host-synchronised: the step returns Python floats), the slowest rank's
time counts, after `warmup` steps that absorb compilation. Reported: median
step time, the mean SR-solver iterations, the energy after the last step.
If the example is not importable (it is being written), the benchmark
reports "skipped: <reason>" instead of failing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

from mpi4py import MPI  # noqa: E402

import _util  # noqa: E402

PROBLEM = ["--model", "tfim", "--L", "16", "--alpha", "1", "--samples", "1008", "--solver", "cg",
           "--diag-shift", "0.01", "--lr", "0.05", "--quiet"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    payload = {"bench": "sr", "ranks": size, "iters": args.iters, "problem": " ".join(PROBLEM),
               "oversubscribed": size > (__import__("os").cpu_count() or 1)}
    try:
        from examples.sharded_sr.run import build, parse_args

        sr_args = parse_args(PROBLEM + ["--iters", str(args.iters)])
        vmc, params, state, couplings = build(sr_args)
    except Exception as exc:  # noqa: BLE001
        payload["skipped"] = f"examples.sharded_sr not usable: {type(exc).__name__}: {str(exc)[:300]}"
        if rank == 0:
            _util.write_json(args.json, payload)
        return
    times, solver_its, energy = [], [], None
    t0 = time.perf_counter()
    try:
        for it in range(args.warmup + args.iters):
            comm.Barrier()
            start = time.perf_counter()
            params, state, rec = vmc.step(params, state, couplings)
            jax.block_until_ready(params)
            elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
            if it >= args.warmup:
                times.append(elapsed)
                solver_its.append(int(rec.get("solver_iterations", 0)))
                energy = float(rec.get("energy", float("nan")))
    except Exception as exc:  # noqa: BLE001
        payload["skipped"] = f"examples.sharded_sr step failed: {type(exc).__name__}: {str(exc)[:300]}"
        if rank == 0:
            _util.write_json(args.json, payload)
        return
    payload.update(step_seconds=_util.median(times), step_samples=times,
                   mean_solver_iterations=sum(solver_its) / max(1, len(solver_its)), energy=energy,
                   seconds=time.perf_counter() - t0, n_params=int(sum(v.size for v in jax.tree_util.tree_leaves(params))),
                   versions=_util.versions())
    if rank == 0:
        _util.eprint(f"[sr n={size}] step {payload['step_seconds'] * 1e3:.1f} ms, "
                     f"{payload['mean_solver_iterations']:.1f} CG it/step, E={energy:.5f}")
        _util.write_json(args.json, payload)


if __name__ == "__main__":
    main()
