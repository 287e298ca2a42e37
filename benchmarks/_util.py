"""Timing helpers shared by the benchmarks: medians over repeats, JSON output.

Every benchmark measures this project and its peers in the same run,
alternating them repeat by repeat, and reports medians: the machine is shared
and noisy, so only ratios against a peer measured alongside mean much.
Collective timings take the slowest rank (an MPI max of the elapsed times)
after a barrier.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

RANK_ENV = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MPI_LOCALRANKID")


def env_rank() -> int:
    """This process's rank from the launcher's environment (0 outside mpiexec), without importing MPI."""
    for key in RANK_ENV:
        if key in os.environ:
            return int(os.environ[key])
    return 0


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def timed_once(fn: Callable[[], Any], comm: Any = None) -> float:
    """Seconds for one fn() call; with an mpi4py comm: barrier first, slowest rank's time."""
    if comm is not None:
        comm.Barrier()
    start = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - start
    if comm is not None:
        from mpi4py import MPI

        elapsed = comm.allreduce(elapsed, op=MPI.MAX)
    return elapsed


def calls_for(seconds_per_call: float, target: float, lo: int = 1, hi: int = 100_000) -> int:
    """How many calls make one timed run last about `target` seconds."""
    if not seconds_per_call > 0:
        return hi
    return int(max(lo, min(hi, target / seconds_per_call)))


def calibrate(run: Callable[[int], Any], target: float, comm: Any = None, hi: int = 1_000_000) -> int:
    """Calls of run(count) that last about `target` seconds; grows the count 8x until a run
    lasts target/8, then scales. With a comm the count is rank 0's (ranks must agree)."""
    count = 1
    while True:
        elapsed = timed_once(lambda: run(count), comm)
        if elapsed >= target / 8 or count >= hi:
            break
        count *= 8
    result = calls_for(elapsed / count, target, hi=hi)
    return comm.bcast(result, root=0) if comm is not None else result


def alternate(contenders: dict[str, Callable[[], float]], repeats: int) -> dict[str, float]:
    """Run each contender's measurement `repeats` times, interleaved; medians by name.

    Each callable returns one sample (e.g. seconds per call) and must be
    collective-safe (every rank calls them in the same order).
    """
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(repeats):
        for name, fn in contenders.items():
            samples[name].append(fn())
    return {name: median(vals) for name, vals in samples.items()}


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        with open("/proc/meminfo") as f:
            kb = int(f.readline().split()[1])
            info["memory_gib"] = round(kb / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return info


def write_json(path: str | os.PathLike | None, payload: dict[str, Any]) -> None:
    """Write the benchmark's result (rank 0 only calls this); stdout when path is None."""
    text = json.dumps(payload, indent=1, default=float)
    if path is None:
        print(text)
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def skipped(reason: str) -> dict[str, Any]:
    return {"skipped": reason}


def stream_triad(n: int = 1 << 24, repeats: int = 5, comm: Any = None) -> dict[str, float]:
    """Memory bandwidth from a numpy triad a = b + s·c (float64, arrays far beyond cache).

    numpy runs it as two in-place passes (``np.multiply(c, s, out=a)``,
    ``np.add(a, b, out=a)``), which stream 5 arrays: read c, write a, read a,
    read b, write a. Bytes counted: 5·8·n per triad (write-allocate traffic
    not counted, as in STREAM). With a comm every rank runs it at the same
    time on its own arrays and the aggregate bandwidth (sum of bytes over
    the slowest rank's time) is returned too. Best of `repeats` (as STREAM).
    """
    import numpy as np

    a = np.zeros(n)
    b = np.ones(n)
    c = np.full(n, 2.0)
    best = float("inf")
    for _ in range(repeats):
        if comm is not None:
            comm.Barrier()
        start = time.perf_counter()
        np.multiply(c, 3.0, out=a)
        np.add(a, b, out=a)
        elapsed = time.perf_counter() - start
        if comm is not None:
            from mpi4py import MPI

            elapsed = comm.allreduce(elapsed, op=MPI.MAX)
        best = min(best, elapsed)
    nbytes = 5 * 8 * n
    procs = comm.Get_size() if comm is not None else 1
    return {"bytes_per_process": nbytes, "seconds": best, "processes": procs,
            "aggregate_gb_s": procs * nbytes / best / 1e9, "per_process_gb_s": nbytes / best / 1e9}


def versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for name in ("jax", "jaxlib", "numpy", "scipy", "mpi4py", "mpich", "distlinalg", "mpi4jax", "netket",
                 "petsc4py"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def git_revision(root: Path) -> str:
    try:
        env = dict(os.environ, GIT_OPTIONAL_LOCKS="0")  # read-only: never touch the index
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10, env=env).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, env=env).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def eprint(*args: Any) -> None:
    print(*args, file=sys.stderr, flush=True)
