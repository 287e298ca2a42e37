"""distlinalg allreduce against mpi4py, measured side by side in one run.

    mpiexec -n 2 python benchmarks/bench_comm.py [--repeats 7] [--output FILE]

Cases (issue targets in brackets, as ratios distlinalg / mpi4py):
  * in-jit allreduce of 1 float64: a lax.fori_loop of 10^4 calls vs a Python
    loop of 10^4 `comm.Allreduce` on numpy arrays              [<= 1.0]
  * in-jit allreduce of 2^20 float64 (fori_loop of 20 calls) vs mpi4py [<= 1.05]
  * eager (un-jitted) allreduce of 1 float64, after the first call  [<= 3.0],
    reported next to the cost of one eager JAX op (`x + 0`), the floor of
    any eager path that returns a jax.Array
Each case is timed `repeats` times, alternating the peers; the median per
call is reported. Machines are shared and noisy: only the ratios mean much.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import distlinalg as dl  # noqa: E402
from distlinalg.comm import allreduce  # noqa: E402


def timed(fn, calls: int) -> float:
    """Seconds per call of fn() (fn runs `calls` operations), ranks in step."""
    dl._mpi.DEFAULT_COMM.comm.Barrier()
    start = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - start
    # The slowest rank defines the time of a collective.
    return dl._mpi.DEFAULT_COMM.comm.allreduce(elapsed, op=MPI.MAX) / calls


def case_in_jit(elements: int, calls: int, repeats: int):
    comm = MPI.COMM_WORLD.Dup()
    x_np = np.ones(elements)
    y_np = np.empty_like(x_np)
    x = jnp.ones(elements)

    loop = jax.jit(lambda a: jax.lax.fori_loop(0, calls, lambda i, v: allreduce(v), a))
    loop(x).block_until_ready()

    def ours():
        loop(x).block_until_ready()

    def theirs():
        for _ in range(calls):
            comm.Allreduce(x_np, y_np)

    theirs()
    ours_t, theirs_t = [], []
    for _ in range(repeats):
        ours_t.append(timed(ours, calls))
        theirs_t.append(timed(theirs, calls))
    comm.Free()
    return statistics.median(ours_t), statistics.median(theirs_t)


def case_eager(calls: int, repeats: int):
    comm = MPI.COMM_WORLD.Dup()
    x_np = np.ones(1)
    y_np = np.empty_like(x_np)
    x = jnp.ones(1)
    allreduce(x).block_until_ready()

    def ours():
        for _ in range(calls):
            out = allreduce(x)
        out.block_until_ready()

    def theirs():
        for _ in range(calls):
            comm.Allreduce(x_np, y_np)

    def floor():
        for _ in range(calls):
            out = x + 0
        out.block_until_ready()

    ours_t, theirs_t, floor_t = [], [], []
    for _ in range(repeats):
        ours_t.append(timed(ours, calls))
        theirs_t.append(timed(theirs, calls))
        floor_t.append(timed(floor, calls))
    comm.Free()
    return statistics.median(ours_t), statistics.median(theirs_t), statistics.median(floor_t)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--output", help="append the markdown table to this file")
    args = parser.parse_args()
    rows = [
        ("in-jit allreduce, 1 float64 (fori_loop of 10^4)", *case_in_jit(1, 10_000, args.repeats), 1.0),
        ("in-jit allreduce, 2^20 float64 (fori_loop of 20)", *case_in_jit(2**20, 20, args.repeats), 1.05),
    ]
    eager, mpi4py_eager, jax_floor = case_eager(2_000, args.repeats)
    rows.append(("eager allreduce, 1 float64 (after the first call)", eager, mpi4py_eager, 3.0))
    if dl.rank() != 0:
        return
    lines = [
        f"### allreduce vs mpi4py `Allreduce` on numpy, {dl.size()} ranks "
        f"(jax {jax.__version__}, {MPI.Get_library_version().splitlines()[0].strip()})",
        "",
        "| case | distlinalg per call | mpi4py per call | ratio | target |",
        "|---|---|---|---|---|",
    ]
    for name, ours, theirs, target in rows:
        ratio = ours / theirs
        mark = "ok" if ratio <= target else "MISSED"
        lines.append(f"| {name} | {ours * 1e6:.2f} µs | {theirs * 1e6:.2f} µs | {ratio:.2f} | ≤ {target} ({mark}) |")
    lines += [
        "",
        f"For scale: one eager JAX op (`x + 0` on the same 1-element array) costs "
        f"{jax_floor * 1e6:.2f} µs here ({jax_floor / mpi4py_eager:.1f}x mpi4py's allreduce): "
        f"the eager allreduce costs {eager / jax_floor:.2f} eager JAX ops.",
    ]
    text = "\n".join(lines)
    print(text)
    if args.output:
        with open(args.output, "a") as f:
            f.write(text + "\n\n")


if __name__ == "__main__":
    main()
