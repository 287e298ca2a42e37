"""The ScaLAPACK engine (distlinalg/linalg/_scalapack.py): Cholesky solve and eigh per call.

    mpiexec -n 1 python benchmarks/bench_scalapack_engine.py --numpy   # also numpy/scipy, one process
    mpiexec -n 2 python benchmarks/bench_scalapack_engine.py
    mpiexec -n 2 python benchmarks/bench_scalapack_engine.py --grid 2x1 --block 32 --sizes 2048

The matrix is the Kac-Murdock-Szego matrix A_ij = 0.5^|i-j| (+ I): symmetric positive
definite, and each rank makes only its own rows (even split), so nothing of size N x N
exists on any rank. One right-hand side. Each entry point runs under jax.jit, once to
warm up (compile, BLACS grid), then `--repeats` times; the median wall time of a call
(to block_until_ready, the slowest rank's, after a barrier) is printed, one line each.
numpy/scipy (OpenBLAS, all the cores this process may use) solve and decompose the
same matrix, gathered, in one process: the 1-process baseline.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax

# One heevd of N = 4096 runs for a minute on a busy 2-core machine: distlinalg's stall
# report (after 30 s in one call) would only say that it is still running.
os.environ.setdefault("DISTLINALG_STALL", "0")
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import distlinalg  # noqa: E402,F401
from distlinalg.linalg import _scalapack as engine  # noqa: E402


def kms_rows(start: int, stop: int, n: int) -> np.ndarray:
    i = np.arange(start, stop)[:, None]
    j = np.arange(n)[None, :]
    return 0.5 ** np.abs(i - j) + (i == j)


def timed(fn, repeats: int, comm) -> float:
    jax.block_until_ready(fn())  # warm-up: compile, grid
    times = []
    for _ in range(repeats):
        comm.Barrier()
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--grid", default=None, help="nprow x npcol, e.g. 2x1 (default: engine.default_grid)")
    parser.add_argument("--block", type=int, default=None)
    parser.add_argument("--numpy", action="store_true", help="also time numpy/scipy in one process (rank 0)")
    parser.add_argument("--only", choices=["solve", "eigh"], default=None)
    args = parser.parse_args()

    ok, why = engine.available()
    comm = MPI.COMM_WORLD
    rank, P = comm.Get_rank(), comm.Get_size()
    if rank == 0:
        print(f"# {why}; {len(os.sched_getaffinity(0))} cores on rank 0", flush=True)
    if not ok:
        raise SystemExit(why)
    grid = tuple(int(g) for g in args.grid.split("x")) if args.grid else engine.default_grid(P)
    for n in args.sizes:
        sizes = tuple(n // P + (r < n % P) for r in range(P))
        start = sum(sizes[:rank])
        a = jnp.asarray(kms_rows(start, start + sizes[rank], n))
        b = jnp.ones((sizes[rank], 1))
        block = args.block or engine.default_block(n, grid)
        tag = f"N={n} P={P} grid={grid[0]}x{grid[1]} nb={block} float64"
        if args.only in (None, "solve"):
            solve = jax.jit(lambda a, b: engine.potrf_solve(a, b, sizes, comm, block=block, grid=grid))
            t = timed(lambda: solve(a, b), args.repeats, comm)
            if rank == 0:
                print(f"scalapack potrf_solve {tag}: {t:.3f} s", flush=True)
        if args.only in (None, "eigh"):
            eigh = jax.jit(lambda a: engine.heevd(a, sizes, comm, block=block, grid=grid))
            t = timed(lambda: eigh(a), args.repeats, comm)
            if rank == 0:
                print(f"scalapack heevd       {tag}: {t:.3f} s", flush=True)
        a = b = None  # free this size's matrix before the next
        if args.numpy and rank == 0:
            import scipy.linalg

            A = kms_rows(0, n, n)
            rhs = np.ones((n, 1))
            one = MPI.COMM_SELF
            if args.only in (None, "solve"):
                t = timed(lambda: scipy.linalg.cho_solve(scipy.linalg.cho_factor(A), rhs), args.repeats, one)
                print(f"numpy  cho_solve      N={n} 1 process float64: {t:.3f} s", flush=True)
            if args.only in (None, "eigh"):
                t = timed(lambda: np.linalg.eigh(A), args.repeats, one)
                print(f"numpy  eigh           N={n} 1 process float64: {t:.3f} s", flush=True)


if __name__ == "__main__":
    main()
