"""Latency cost of the cross-rank checks (README "When things go wrong").

    mpiexec -n 2 python benchmarks/bench_checks.py [--repeats 5]

Small-message (8 B) allreduce, per call, in three settings of
distlinalg.comm.configure(check=...): inside one jitted fori_loop (the
steady state of compiled code), one jitted call per allreduce, and eager;
against mpi4py's Allreduce on numpy in the same run. Then the same three
with the stall report off and on (configure(stall=0 / 30), default checks):
the monitor thread's cost in steady state. Prints medians over repeats and
the ratios to mpi4py and to check="off" (stall off).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

import distlinalg as dl
from distlinalg.comm import allreduce, configure


def per_call(fn, calls: int) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--loop", type=int, default=20000)
    parser.add_argument("--calls", type=int, default=500)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    x = jnp.ones(1)
    loop = jax.jit(lambda v: jax.lax.fori_loop(0, args.loop, lambda i, w: allreduce(w) * 0.5, v))
    single = jax.jit(lambda v: allreduce(v))
    buf, out = np.ones(1), np.empty(1)

    def mpi4py_calls():
        for _ in range(args.calls):
            comm.Allreduce(buf, out)

    results: dict[str, list[float]] = {}

    def measure(setting: str) -> None:
        """The three cases under the current configuration, recorded as '<case>, <setting>'."""
        cases = {
            "in-jit loop": (lambda: loop(x), args.loop),
            "jit call": (lambda: [single(x) for _ in range(args.calls)], args.calls),
            "eager": (lambda: [allreduce(x) for _ in range(args.calls)], args.calls),
        }
        for case, (fn, calls) in cases.items():
            comm.Barrier()
            results.setdefault(f"{case}, {setting}", []).append(per_call(fn, calls))

    for _ in range(args.repeats):
        comm.Barrier()
        t = time.perf_counter()
        mpi4py_calls()
        results.setdefault("mpi4py", []).append((time.perf_counter() - t) / args.calls * 1e6)
        for mode in ("off", "first-run", "every-call"):
            configure(check=mode)
            loop(x).block_until_ready()
            single(x).block_until_ready()  # compiled and checked once
            measure(mode)
        configure(check="first-run")
        for stall in (0, 30):
            configure(stall=stall)
            measure("stall off" if stall == 0 else f"stall {stall} s")
    configure(check="first-run", stall=30)
    if dl.rank() == 0:
        peer = np.median(results["mpi4py"])
        print(f"8-byte allreduce on {dl.size()} ranks, median of {args.repeats} (µs per call)")
        print(f"{'case':32s} {'µs':>9s} {'/ mpi4py':>9s} {'/ off':>7s}")
        for name, values in results.items():
            case, setting = name.rsplit(", ", 1) if ", " in name else (name, "")
            base = case + (", stall off" if setting.startswith("stall") else ", off")
            ratio_off = np.median(values) / np.median(results[base]) if base in results else float("nan")
            print(f"{name:32s} {np.median(values):9.2f} {np.median(values) / peer:9.2f} {ratio_off:7.2f}")


if __name__ == "__main__":
    main()
