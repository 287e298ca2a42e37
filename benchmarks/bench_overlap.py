"""How much of a non-blocking allreduce hides behind computation, in one run.

    mpiexec -n 2 python benchmarks/bench_overlap.py [--bytes 16777216] [--work 1024] [--repeats 7]
    MPIR_CVAR_ASYNC_PROGRESS=1 mpiexec -n 2 python benchmarks/bench_overlap.py   # MPICH progress thread

Four jitted programs on the same data, interleaved, median time of each:
  comm        allreduce(x) alone
  compute     the work alone: `--work`² matmuls, chained (independent of x)
  blocking    allreduce(x), then the work
  overlapped  iallreduce(x), the work, wait
hidden = (blocking − overlapped) / min(comm, compute): the share of the
shorter of the two that the overlap saved (0: none, 1: all). MPI moves a
non-blocking message only inside MPI calls unless the library runs a
progress thread: MPICH's is MPIR_CVAR_ASYNC_PROGRESS=1 (it needs
MPI_THREAD_MULTIPLE, which distlinalg requests, and one more busy thread per
rank, so give each rank a spare core). Without it the data moves at the wait
and `hidden` stays near 0, except for messages small enough to go eagerly.

XLA's schedule matters too: distlinalg's operations are ordered among
themselves, but XLA may place pure work on either side of a start or a wait
(on the CPU, jax 0.10, the wait of `overlapped` lands between the matmuls).
The zero-byte request markers do not pin it: XLA folds zero-element arrays
into constants, so an optimization_barrier on them has no effect. Pinning
needs a real (scalar) dependency out of the start and into the wait: open
work in issue 20.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _util import alternate, median, timed_once, write_json  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bytes", type=int, default=16 << 20, help="allreduce message, bytes (float32)")
    parser.add_argument("--work", type=int, default=768, help="matrix side of the work between start and wait")
    parser.add_argument("--steps", type=int, default=4, help="matmuls in the work")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    from mpi4py import MPI

    import distlinalg as dl

    comm = MPI.COMM_WORLD
    x = jnp.ones(max(1, args.bytes // 4), jnp.float32)
    w = jnp.eye(args.work, dtype=jnp.float32) * 0.5 + 0.01

    def work(m):
        for _ in range(args.steps):
            m = jnp.tanh(m @ w)
        return m

    programs = {
        "comm": jax.jit(lambda x, m: (dl.comm.allreduce(x), m)),
        "compute": jax.jit(lambda x, m: (x, work(m))),
        "blocking": jax.jit(lambda x, m: (dl.comm.allreduce(x), work(m))),
        "overlapped": jax.jit(lambda x, m: (lambda r: (lambda out: (dl.comm.wait(r), out))(work(m)))(
            dl.comm.iallreduce(x))),
    }
    for program in programs.values():
        jax.block_until_ready(program(x, w))  # compile outside the measurement

    def timed(program):
        return lambda: timed_once(lambda: jax.block_until_ready(program(x, w)), comm)

    seconds = alternate({name: timed(p) for name, p in programs.items()}, args.repeats)
    shorter = min(seconds["comm"], seconds["compute"])
    hidden = (seconds["blocking"] - seconds["overlapped"]) / shorter if shorter > 0 else float("nan")
    if comm.Get_rank() == 0:
        progress = os.environ.get("MPIR_CVAR_ASYNC_PROGRESS", "0")
        print(f"{comm.Get_size()} ranks, allreduce {args.bytes} B, work {args.steps}×{args.work}² matmul; "
              f"MPIR_CVAR_ASYNC_PROGRESS={progress}")
        print("| comm ms | compute ms | blocking ms | overlapped ms | hidden |")
        print("|---:|---:|---:|---:|---:|")
        print(f"| {seconds['comm'] * 1e3:.2f} | {seconds['compute'] * 1e3:.2f} | {seconds['blocking'] * 1e3:.2f} | "
              f"{seconds['overlapped'] * 1e3:.2f} | {hidden:.2f} |")
        if args.json:
            write_json(args.json, {"bench": "overlap", "ranks": comm.Get_size(), "bytes": args.bytes,
                                   "work": args.work, "steps": args.steps, "async_progress": progress,
                                   "seconds": seconds, "hidden": hidden})


if __name__ == "__main__":
    main()
