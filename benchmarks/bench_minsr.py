"""Sample-space natural gradient (MinSR / SRt) with many parameters: time per
step and peak memory per rank, distlinalg on 1 and 2 ranks against NetKet's
sample-space SR (``VMC_SR(use_ntk=True)``'s update) in one process.

    python benchmarks/bench_minsr.py --driver [--quick] [--output FILE]   # everything below
    [mpiexec -n P] python benchmarks/bench_minsr.py --contender distlinalg-cholesky|distlinalg-cg|netket

The problem: an RBM with real parameters, L = 100 visible units and α = 10
(101,100 parameters), 4096 samples over all ranks (random ±1: the solve does
not care where the samples come from), residuals standing in for the local
energies, diag_shift 1e-3. One "step" is the whole update δ from (θ,
samples, residuals): Jacobian, T = ŌŌᵀ/N, solve, δ = Ōᵀx/N.

  * ``distlinalg-cholesky``: ``natural_gradient(space="samples",
    solver="cholesky")``: each rank forms its own samples' Jacobian rows,
    T's rows come from a ring of row pieces, the N × N system is gathered and
    solved (what NetKet does, but the Jacobian is never gathered).
  * ``distlinalg-cg``: ``space="samples"``, matrix-free CG on T: no
    Jacobian at all, one VJP + JVP and one parameter-sized allreduce per
    iteration.
  * ``netket``: ``netket._src.ngd.sr_srt_common.srt`` with
    ``nk.optimizer.solver.cholesky`` (the update of ``VMC_SR(use_ntk=True)``),
    one process. Its update is 2δ (NetKet's convention); the driver checks
    that ratio.

Peak memory is the process's maximum resident set size (``ru_maxrss``) minus
the resident size before the first call (JAX's runtime and the inputs not
counted; compilation counted, as the user pays it), largest rank. Steps are
timed after one warm-up step (compilation), median of the repeats, the
slowest rank's time. Each contender runs in its own processes. Each contender runs in its own
processes; median step time of the repeats, the slowest rank's time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


def rss_bytes() -> int:
    """Current resident set size (Linux /proc), in bytes."""
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def problem(samples: int, visible: int, alpha: int, rank: int, size: int):
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    hidden = alpha * visible
    params = {"W": jnp.asarray(0.01 * rng.standard_normal((hidden, visible))),
              "b": jnp.asarray(0.01 * rng.standard_normal(hidden)),
              "a": jnp.asarray(0.01 * rng.standard_normal(visible))}
    X = rng.choice([-1.0, 1.0], size=(samples, visible))
    e = rng.standard_normal(samples)
    per_rank = samples // size
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    return params, jnp.asarray(X[mine]), jnp.asarray(e[mine]), jnp.asarray(X), jnp.asarray(e)


def log_psi(p, x):
    import jax.numpy as jnp

    return x @ p["a"] + jnp.sum(jnp.log(jnp.cosh(x @ p["W"].T + p["b"])), axis=-1)


def run_contender(args) -> None:
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    from jax.flatten_util import ravel_pytree

    if args.contender.startswith("distlinalg"):
        import distlinalg as dl
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        rank, size = comm.Get_rank(), comm.Get_size()
        params, X, e, _, _ = problem(args.samples, args.visible, args.alpha, rank, size)
        solver = args.contender.split("-", 1)[1]

        def step(p, x, r):
            update, info = dl.natural_gradient(log_psi, p, x, r, diag_shift=1e-3, space="samples", solver=solver,
                                               rtol=1e-8)
            return update, info.iterations

        def barrier():
            comm.Barrier()

        def slowest(t):
            return comm.allreduce(t, op=MPI.MAX)
    else:
        import netket as nk
        from netket._src.ngd.sr_srt_common import srt

        rank, size = 0, 1
        params, _, _, X, e = problem(args.samples, args.visible, args.alpha, 0, 1)

        def apply(variables, x):
            return log_psi(variables["params"], x)

        def step(p, x, r):
            update, _, _ = srt(apply, r, p, {}, x, diag_shift=1e-3, solver_fn=nk.optimizer.solver.cholesky,
                               mode="real")
            return update, jnp.asarray(0)

        def barrier():
            pass

        def slowest(t):
            return t

    if args.contender.startswith("distlinalg"):
        step = jax.jit(step)  # NetKet's srt is jitted inside
    # Memory counts from here: the inputs exist, nothing is compiled yet. The
    # peak is the process's maximum resident size (compilation included:
    # allocators keep freed buffers, so a peak after a warm-up is not visible).
    before = rss_bytes()
    times, iterations = [], 0
    for repeat in range(args.repeats + 1):  # the first one compiles
        barrier()
        start = time.perf_counter()
        update, its = step(params, X, e)
        jax.block_until_ready(update)
        elapsed = slowest(time.perf_counter() - start)
        if repeat:
            times.append(elapsed)
        iterations = int(its)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    if args.contender.startswith("distlinalg"):
        peak = comm.allreduce(peak, op=MPI.MAX)
    flat = ravel_pytree(update)[0]
    result = {"contender": args.contender, "ranks": size, "samples": args.samples,
              "params": int(flat.size), "step_seconds": sorted(times)[len(times) // 2],
              "peak_bytes_per_rank": int(peak), "update_norm": float(jnp.linalg.norm(flat)),
              "iterations": iterations}
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)


def run_driver(args) -> None:
    """Every contender in its own processes, then a markdown table."""
    python = sys.executable
    mpiexec = str(Path(python).with_name("mpiexec"))
    size = ["--samples", str(args.samples), "--visible", str(args.visible), "--alpha", str(args.alpha),
            "--repeats", str(args.repeats)]
    runs = [("netket", 1), ("distlinalg-cholesky", 1), ("distlinalg-cholesky", 2),
            ("distlinalg-cg", 1), ("distlinalg-cg", 2)]
    results = []
    for contender, ranks in runs:
        command = [python, __file__, "--contender", contender, *size]
        if contender != "netket":
            command = [mpiexec, "-n", str(ranks), *command]
        out = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
        found = [line[7:] for line in out.stdout.splitlines() if line.startswith("RESULT ")]
        if out.returncode or not found:
            reason = (out.stderr.strip().splitlines() or ["no output"])[-1][:200]
            results.append({"contender": contender, "ranks": ranks, "skipped": reason})
        else:
            results.append(json.loads(found[0]))
        print(results[-1], file=sys.stderr, flush=True)
    write_table(results, args)


def write_table(results, args) -> None:
    by = {(r["contender"], r["ranks"]): r for r in results}
    reference = by.get(("netket", 1), {})
    lines = ["## Sample-space natural gradient (MinSR / SRt), many parameters", "",
             f"RBM, {results[0].get('params', '?')} real parameters, {args.samples} samples over all ranks, "
             "diag_shift 1e-3; one step = the whole update (median of the repeats after a warm-up step). Peak "
             "memory: maximum resident set minus the resident size before the first call (compilation "
             "included), largest rank. Command: "
             f"`python benchmarks/bench_minsr.py --driver{' --quick' if args.quick else ''}`.", "",
             "| contender | ranks | step time | vs NetKet | peak memory per rank | vs same contender on 1 rank "
             "| update vs NetKet's / 2 |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        if "skipped" in r:
            lines.append(f"| {r['contender']} | {r['ranks']} | skipped: {r['skipped']} | | | | |")
            continue
        one = by.get((r["contender"], 1), {})
        t_ratio = f"{r['step_seconds'] / reference['step_seconds']:.2f}x" if "step_seconds" in reference else "n/a"
        m_ratio = f"{r['peak_bytes_per_rank'] / one['peak_bytes_per_rank']:.2f}x" if one.get("peak_bytes_per_rank") else "n/a"
        n_ratio = (f"{reference['update_norm'] / 2 / r['update_norm']:.6f}" if "update_norm" in reference
                   and r["contender"] != "netket" else "")
        its = f" ({r['iterations']} CG it.)" if r["contender"].endswith("cg") else ""
        lines.append(f"| {r['contender']} | {r['ranks']} | {r['step_seconds']:.2f} s{its} | {t_ratio} | "
                     f"{r['peak_bytes_per_rank'] / 2**20:.0f} MiB | {m_ratio} | {n_ratio} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output:
        Path(args.output).write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--driver", action="store_true")
    parser.add_argument("--contender", default="distlinalg-cholesky",
                        choices=["distlinalg-cholesky", "distlinalg-cg", "netket"])
    parser.add_argument("--quick", action="store_true", help="1024 samples, 1 repeat")
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--visible", type=int, default=100)
    parser.add_argument("--alpha", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=1800)
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results_minsr.md"))
    args = parser.parse_args()
    if args.quick:
        args.samples, args.repeats = 1024, 1
    if args.driver:
        run_driver(args)
    else:
        run_contender(args)


if __name__ == "__main__":
    main()
