"""CPU placement: each rank on a node gets its own share of the node's cores.

XLA's CPU client sizes its intra-op thread pool by the CPUs the process may
run on. When R ranks share a node and the launcher did not bind them
(MPICH's ``mpiexec`` does not by default), every rank starts a pool as large
as the node, and R pools then compete for the same cores, while a rank that
waits in MPI busy-polls a core another rank's pool needs. On a 2-core
machine this made a 2-rank Gram matvec 1.5 ms instead of 1.0 ms
(``benchmarks/bench_operators.py``).

``DISTLINALG_CPU_AFFINITY``:
  ``auto`` (default): give node-local rank i the i-th contiguous block of the
  node's CPUs, for every thread of the process, when all of these hold:
  several ranks share the node, they all see the same CPU set (so the
  launcher did not bind them), that set has at least one CPU per rank (an
  oversubscribed node is left to the OS scheduler), and JAX's backend has
  not started (its thread pool is sized when it starts).
  ``none``: leave the affinity alone.

BLAS threads: JAX's CPU LAPACK calls (Cholesky, solves, SVD: what NetKet's
dense SR solvers run) go through SciPy's OpenBLAS, whose pool is sized by
the CPUs it sees when it loads, and whose idle threads spin. With R ranks
unbound on C cores, every rank's pool spun on the cores the others needed: a
288 × 288 Cholesky solve of a 2-rank SR step took 40–130 ms instead of 4–6
(``benchmarks/bench_netket_paths.py``). So, in the same cases as the
affinity (ranks sharing a node, not bound by the launcher, whatever the
import order), each rank's OpenBLAS gets max(1, C // R) threads: loaded
libraries through their ``openblas_set_num_threads`` entry point, later
ones through ``OPENBLAS_NUM_THREADS`` (a value the user set is kept).
``DISTLINALG_CPU_AFFINITY=none`` leaves this alone too.

Idle waits (``DISTLINALG_IDLE_WAIT``): a distlinalg wait polls MPI, spinning
first, then yielding the core on every poll (csrc/checks.h, PollPacer). Where
the node's ranks have fewer CPUs among them than there are ranks
(``mpiexec -n 3`` on two cores), a yielding waiter still takes about half of
the core it shares with the rank it waits for: a rank computing while two
others waited for it took 2.2 s instead of 1.0. There (``auto``, the
default) a wait that outlasts its spinning and yielding polls sleeps 20 µs
between polls instead. ``sleep`` and ``yield`` force either. Dedicated cores
keep yielding: a sleep would add its length to the wait of a partner that is
just late.

Runs once, at import, on every rank (``distlinalg._runtime.mpi`` calls it after MPI
is initialised); what was decided is in ``STATE`` for ``python -m distlinalg``.
"""

from __future__ import annotations

import os
from typing import Any

from . import jax_names, patches

STATE: dict[str, str] = {}


def share_of(cpus: list[int], local_rank: int, local_size: int) -> list[int]:
    """The contiguous block of `cpus` (sorted) for `local_rank` of `local_size`.

    Blocks differ in size by at most one CPU; contiguous ids keep a rank's
    CPUs on one socket and, where SMT siblings are numbered apart (as Linux
    usually numbers them), on distinct physical cores.
    """
    if not 0 <= local_rank < local_size <= len(cpus):
        raise ValueError(f"cannot share {len(cpus)} CPUs among {local_size} ranks (rank {local_rank})")
    base, extra = divmod(len(cpus), local_size)
    start = local_rank * base + min(local_rank, extra)
    return sorted(cpus)[start : start + base + (local_rank < extra)]


def _restrict_all_threads(cpus: list[int]) -> None:
    # sched_setaffinity(0, ...) only moves the calling thread; threads that
    # already exist (BLAS pools started by numpy, MPI progress threads) keep
    # the old mask unless each is moved.
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]
    for tid in threads:
        try:
            os.sched_setaffinity(tid, cpus)
        except (ProcessLookupError, PermissionError):
            continue  # a thread that ended meanwhile, or one we may not move


# The thread-count setters of OpenBLAS builds: plain, and SciPy's/NumPy's
# renamed ones (32- and 64-bit integer interfaces).
_OPENBLAS_SETTERS = ("openblas_set_num_threads", "openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
                     "scipy_openblas_set_num_threads64_")


def limit_blas_threads(threads: int) -> str:
    """Give this process's OpenBLAS pools `threads` threads: the libraries loaded now
    (found in /proc/self/maps) and, through ``OPENBLAS_NUM_THREADS``, those loaded later.
    A value of ``OPENBLAS_NUM_THREADS`` set by the user is kept. Returns what was done."""
    import ctypes

    if "OPENBLAS_NUM_THREADS" in os.environ:
        return f"left alone (OPENBLAS_NUM_THREADS={os.environ['OPENBLAS_NUM_THREADS']})"
    os.environ["OPENBLAS_NUM_THREADS"] = str(threads)
    try:
        with open("/proc/self/maps") as maps:
            loaded = sorted({line.split()[-1] for line in maps if "openblas" in line and ".so" in line})
    except OSError:
        loaded = []
    for path in loaded:
        try:
            library = ctypes.CDLL(path)
        except OSError:
            continue
        for name in _OPENBLAS_SETTERS:
            setter = getattr(library, name, None)
            if setter is not None:
                setter(ctypes.c_int(threads))
                break
    return f"{threads} OpenBLAS thread(s) per rank ({len(loaded)} library(ies) loaded now)"


def partition_cores(node: Any) -> str:
    """Apply ``DISTLINALG_CPU_AFFINITY`` (see the module docstring); returns what was done.

    `node`: the ranks sharing this node (an ``MPI_COMM_TYPE_SHARED`` split,
    made once at import by ``distlinalg._runtime.mpi``). Collective over `node`: the
    CPU sets are exchanged on every rank whatever the outcome, so ranks never
    disagree about taking part, and a bad setting fails on all of them.
    """
    choice = os.environ.get("DISTLINALG_CPU_AFFINITY", "auto").strip().lower() or "auto"
    local_rank, local_size = node.Get_rank(), node.Get_size()
    try:
        mine = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        mine = []
    everyone = node.allgather(mine)
    if choice not in ("auto", "none", "off", "0"):
        raise ValueError(f"DISTLINALG_CPU_AFFINITY must be auto or none, not {choice!r}")
    unbound_shared = choice == "auto" and bool(mine) and local_size > 1 and all(cpus == mine for cpus in everyone)
    STATE["blas"] = (limit_blas_threads(max(1, len(mine) // local_size)) if unbound_shared
                     else "left alone")
    patches.record("openblas-threads", STATE["blas"])
    if choice != "auto":
        result = "left alone (DISTLINALG_CPU_AFFINITY=none)"
    elif not mine:
        result = "left alone (this OS does not report CPU affinity)"
    elif local_size == 1:
        result = f"left alone (one rank on this node, {len(mine)} CPU(s))"
    elif any(cpus != mine for cpus in everyone):
        result = f"left alone (the launcher bound the ranks: CPUs {_ranges(mine)})"
    elif len(mine) < local_size:
        result = f"left alone ({local_size} ranks share {len(mine)} CPU(s) on this node: oversubscribed)"
    elif jax_names.backends_started():
        result = "left alone (JAX's backend started before distlinalg was imported)"
    else:
        share = share_of(mine, local_rank, local_size)
        _restrict_all_threads(share)
        result = f"CPUs {_ranges(share)} (node-local rank {local_rank} of {local_size}, {len(mine)} CPUs)"
    STATE["affinity"] = result
    STATE["idle wait"] = idle_wait(os.environ.get("DISTLINALG_IDLE_WAIT", "auto"), everyone, local_size)
    return result


IDLE_SLEEP = False  # what idle_wait chose: the handlers' waits sleep once they outlast their polls


def idle_wait(choice: str, everyone: list[list[int]], local_size: int) -> str:
    """Apply ``DISTLINALG_IDLE_WAIT`` (see the module docstring); returns what was chosen.

    `everyone`: the CPU sets of the node's ranks (empty where the OS does not
    report them: then only ``sleep`` sleeps). The node is oversubscribed when
    the union of those sets has fewer CPUs than the node has ranks.
    """
    global IDLE_SLEEP
    choice = (choice or "auto").strip().lower()
    if choice not in ("auto", "sleep", "yield"):
        raise ValueError(f"DISTLINALG_IDLE_WAIT must be auto, sleep or yield, not {choice!r}")
    cpus = set().union(*map(set, everyone))
    oversubscribed = bool(cpus) and len(cpus) < local_size
    IDLE_SLEEP = choice == "sleep" or (choice == "auto" and oversubscribed)
    if choice != "auto":
        return f"{choice} (DISTLINALG_IDLE_WAIT={choice})"
    if oversubscribed:
        return f"sleep ({local_size} ranks share {len(cpus)} CPU(s) on this node)"
    return "yield (a core per rank)" if cpus else "yield (this OS does not report CPU affinity)"


def _ranges(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    parts: list[str] = []
    for cpu in sorted(cpus):
        if parts and cpu == int(parts[-1].split("-")[-1]) + 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{cpu}"
        else:
            parts.append(str(cpu))
    return ",".join(parts)
