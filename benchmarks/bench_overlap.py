"""Communication hidden behind computation: non-blocking vs blocking, in one run.

    mpiexec -n 2 python benchmarks/bench_overlap.py                 # all three parts
    mpiexec -n 4 python benchmarks/bench_overlap.py --parts halo cg --grid 256
    MPIR_CVAR_ASYNC_PROGRESS=1 mpiexec -n 2 python benchmarks/bench_overlap.py   # MPICH progress thread

Three parts, each a set of jitted programs on the same data, interleaved,
median time of each:

allreduce  a `--bytes` allreduce and `--steps` matmuls of side `--work`:
           comm (the allreduce alone), compute (the work alone), blocking
           (allreduce, then the work), overlapped (iallreduce, the work
           pinned between start and wait by comm.overlap) and unpinned (the
           same written without overlap: XLA places the work where it likes).
           hidden = (blocking − overlapped) / min(comm, compute), the share
           of the shorter of the two that the overlap saved (0: none, 1: all).
halo       `--matvecs` matvecs of laplacian_2d(`--grid`) in a fori_loop,
           halo="blocking" (two sendrecvs, then the stencil) vs "overlapped"
           (isend/irecv while the interior stencil runs).
cg         `--iterations` iterations of cg on laplacian_2d(`--grid`): method="standard"
           (two blocking allreduces per iteration) and "pipelined" (one iallreduce, in
           flight during the matvec), each with both halo modes.

MPI moves a non-blocking message only inside MPI calls unless the library
runs a progress thread (MPICH: MPIR_CVAR_ASYNC_PROGRESS=1; it needs
MPI_THREAD_MULTIPLE, which distlinalg requests, and one more busy thread per
rank, so give each rank a spare core). Without it a large message moves at
the wait; small messages (halo rows, CG's scalars) go eagerly and the
overlap hides their latency and the ranks' skew instead.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _util import alternate, timed_once, write_json  # noqa: E402


def allreduce_part(args, jax, jnp, dl, comm):
    x = jnp.ones(max(1, args.bytes // 4), jnp.float32)
    w = jnp.eye(args.work, dtype=jnp.float32) * 0.5 + 0.01

    def work(m):
        for _ in range(args.steps):
            m = jnp.tanh(m @ w)
        return m

    def unpinned(x, m):
        request = dl.comm.iallreduce(x)
        out = work(m)
        return dl.comm.wait(request), out

    programs = {
        "comm": jax.jit(lambda x, m: (dl.comm.allreduce(x), m)),
        "compute": jax.jit(lambda x, m: (x, work(m))),
        "blocking": jax.jit(lambda x, m: (dl.comm.allreduce(x), work(m))),
        "overlapped": jax.jit(lambda x, m: dl.comm.overlap(dl.comm.iallreduce(x), work, m)),
        "unpinned": jax.jit(unpinned),
    }
    seconds = measure(programs, (x, w), args.repeats, jax, comm)
    shorter = min(seconds["comm"], seconds["compute"])
    hidden = (seconds["blocking"] - seconds["overlapped"]) / shorter if shorter > 0 else float("nan")
    title = f"allreduce {args.bytes} B, {args.steps} matmuls of {args.work}²"
    return title, seconds, {"hidden": hidden}


def halo_part(args, jax, jnp, dl, comm):
    operators = {halo: dl.operators.laplacian_2d(args.grid, halo=halo, dtype=jnp.float64)
                 for halo in ("blocking", "overlapped")}
    v = jnp.ones(operators["blocking"].input_structure.shape, jnp.float64)

    def repeated(A):
        return jax.jit(lambda v: jax.lax.fori_loop(0, args.matvecs, lambda _, u: 0.25 * (A @ u), v))

    programs = {halo: repeated(A) for halo, A in operators.items()}
    seconds = measure(programs, (v,), args.repeats, jax, comm)
    per_matvec = {name: s / args.matvecs for name, s in seconds.items()}
    title = f"laplacian_2d({args.grid}) matvec, {args.matvecs} per program"
    return title, per_matvec, {"overlapped / blocking": per_matvec["overlapped"] / per_matvec["blocking"]}


def cg_part(args, jax, jnp, dl, comm):
    operators = {halo: dl.operators.laplacian_2d(args.grid, halo=halo, dtype=jnp.float64)
                 for halo in ("blocking", "overlapped")}
    b = jnp.ones(operators["blocking"].input_structure.shape, jnp.float64)

    def solver(method, A):
        # A tolerance far below reach: every run does exactly `iterations` iterations.
        return jax.jit(lambda b: dl.cg(A, b, method=method, rtol=1e-300, maxiter=args.iterations)[1].iterations)

    programs = {f"{method}/{halo}": solver(method, A)
                for method in ("standard", "pipelined") for halo, A in operators.items()}
    seconds = measure(programs, (b,), args.repeats, jax, comm)
    per_iteration = {name: s / args.iterations for name, s in seconds.items()}
    title = f"cg on laplacian_2d({args.grid}) (method/halo), {args.iterations} iterations"
    base = per_iteration["standard/blocking"]
    ratios = {f"{name} / standard/blocking": t / base for name, t in per_iteration.items() if name != "standard/blocking"}
    return title, per_iteration, ratios


def measure(programs, inputs, repeats, jax, comm):
    for program in programs.values():
        jax.block_until_ready(program(*inputs))  # compile outside the measurement

    def timed(program):
        return lambda: timed_once(lambda: jax.block_until_ready(program(*inputs)), comm)

    return alternate({name: timed(p) for name, p in programs.items()}, repeats)


PARTS = {"allreduce": allreduce_part, "halo": halo_part, "cg": cg_part}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS))
    parser.add_argument("--bytes", type=int, default=16 << 20, help="allreduce message, bytes (float32)")
    parser.add_argument("--work", type=int, default=768, help="matrix side of the work between start and wait")
    parser.add_argument("--steps", type=int, default=4, help="matmuls in the work")
    parser.add_argument("--grid", type=int, default=128, help="laplacian_2d grid side (halo and cg parts)")
    parser.add_argument("--matvecs", type=int, default=200)
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json")
    args = parser.parse_args()

    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    from mpi4py import MPI

    import distlinalg as dl

    comm = MPI.COMM_WORLD
    progress = os.environ.get("MPIR_CVAR_ASYNC_PROGRESS", "0")
    results = {}
    for part in args.parts:
        title, seconds, ratios = PARTS[part](args, jax, jnp, dl, comm)
        results[part] = {"title": title, "seconds": seconds, **ratios}
        if comm.Get_rank() == 0:
            print(f"\n{comm.Get_size()} ranks, {title}; MPIR_CVAR_ASYNC_PROGRESS={progress}")
            print("| " + " | ".join(f"{name} ms" for name in seconds) + " | " + " | ".join(ratios) + " |")
            print("|" + "---:|" * (len(seconds) + len(ratios)))
            print("| " + " | ".join(f"{s * 1e3:.3f}" for s in seconds.values()) + " | "
                  + " | ".join(f"{r:.2f}" for r in ratios.values()) + " |")
    if comm.Get_rank() == 0 and args.json:
        write_json(args.json, {"bench": "overlap", "ranks": comm.Get_size(), "async_progress": progress,
                               "args": vars(args), "results": results})


if __name__ == "__main__":
    main()
