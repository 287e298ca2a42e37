#!/usr/bin/env python3
"""Run the test suite under mpiexec, one rank count after another.

The single-process tests (marked ``serial``; they start their own mpiexec
jobs) run in the background beside a first world of one rank, which leaves
a core free (--serial-first: alone, before the worlds).

    python tests/run_mpi.py --ranks 1 2 3 -- [pytest args]
    python tests/run_mpi.py --mpiexec-only -n 2 -- python script.py

Each rank writes its own log (.mpitest/n<N>/rank<r>.log, or under
$MPITEST_LOGS so that concurrent runs do not overwrite each other's). Rank 0's log is
shown; a rank that fails has its log shown too. pytest-timeout bounds every
test (a deadlock fails that test, names it and dumps the rank's stacks), and
a wall-clock limit on the whole mpiexec run catches anything else.

The rank counts of one run share XLA executables through a JAX persistent
compilation cache that lives as long as the run (see use_compilation_cache;
--no-compile-cache turns it off), and compile with XLA's quicker CPU code
generation (see FAST_COMPILE_FLAGS; --xla-defaults turns it off), and JAX
lowers them into shared MLIR contexts (DISTLINALG_SHARED_MLIR_CONTEXT, set
in main).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOGS = Path(os.environ.get("MPITEST_LOGS", ROOT / ".mpitest"))  # per-checkout by default
RANK_ENV = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MPI_LOCALRANKID")


def find_mpiexec() -> list[str]:
    explicit = os.environ.get("MPIEXEC")
    if explicit:
        return explicit.split()
    beside = Path(sys.executable).parent / "mpiexec"
    exe = str(beside) if beside.exists() else shutil.which("mpiexec")
    if exe is None:
        sys.exit("run_mpi: no mpiexec found (set MPIEXEC=/path/to/mpiexec)")
    cmd = [exe]
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    if "Open MPI" in version or "OpenRTE" in version or "prterun" in version.lower():
        # Oversubscription (3 ranks on 2 cores) must be allowed explicitly,
        # and idle ranks should yield the core instead of spinning.
        cmd += ["--oversubscribe", "--mca", "mpi_yield_when_idle", "1"]
    return cmd


# XLA options of the MPI worlds. Compiling is most of the suite's time: a
# 1-rank world compiles ~11,600 programs, and XLA's compiles, JAX's tracing and
# lowering are nearly all of its time; the tests check values, HLO and
# messages, not the machine code LLVM makes of XLA's loops. Three options,
# measured on tests/solvers/test_solvers.py (jaxlib 0.10.2, 2 cores; 1 rank /
# 2 ranks, whole file):
# - XLA's classic CPU emitters (not its fusion emitters) compile a small eager
#   operation in 44 ms instead of 75: CI's MPICH worlds 1392 s instead of 1744.
# - One LLVM module per program instead of XLA's split into pieces compiled in
#   parallel: 73 s -> 49 s and 119 s -> 85 s. The pieces' threads compete with
#   the other ranks' compiles, and small programs gain nothing from splitting.
#   It does not change what a program computes.
# - LLVM at -O0: 49 -> 44 s and 85 -> 58 s (the compiles: 26 -> 13 s, 48 ->
#   22 s). With the split modules it computed wrong eigenvalues (test_eigsh's
#   vmapped sharded LOBPCG at 2 ranks, every run; right with the split off, or
#   the concurrency-optimized scheduler off, or -O2: XLA's split codegen at
#   -O0, not distlinalg); with one module the whole suite passes.
# XLA's defaults stay covered: the single-process tests (test_ynn.py among
# them: the miscompile it guards against is in the default path), the
# doctests, the demo and CI's Open MPI worlds (--xla-defaults) run without
# these flags.
FAST_COMPILE_FLAGS = ("--xla_cpu_use_fusion_emitters=false", "--xla_cpu_parallel_codegen_split_count=1",
                      "--xla_backend_optimization_level=0")


def fast_compile_flags() -> str:
    """XLA_FLAGS for the worlds: the caller's, plus FAST_COMPILE_FLAGS where
    this jaxlib knows them (XLA aborts on a flag it does not know, so they
    are tried once in a child process first)."""
    flags = " ".join([os.environ.get("XLA_FLAGS", ""), *FAST_COMPILE_FLAGS]).strip()
    probe = subprocess.run(
        [sys.executable, "-c", "import jax.numpy as jnp; jnp.arange(3.0).sum().block_until_ready()"],
        env=dict(os.environ, XLA_FLAGS=flags), capture_output=True, text=True, timeout=300,
    )
    if probe.returncode != 0:
        print(f"=== this jaxlib refuses {' '.join(FAST_COMPILE_FLAGS)}; compiling with XLA's defaults", flush=True)
        return os.environ.get("XLA_FLAGS", "")
    return flags


def use_compilation_cache(cache_dir: str, writer: bool) -> None:
    """Load executables that an earlier world of this run compiled (set before JAX is imported).

    Compiling is most of the suite's time, every rank compiles the same
    programs, and most of them do not depend on the rank count. JAX's
    persistent cache is keyed by the lowered program, so distlinalg's rules
    and lowerings still run in every world; only XLA's compilation of a
    program already compiled in this run is skipped. JAX writes entries in
    place without a lock: with DISTLINALG_SHARED_COMPILES (the default of a
    run) every rank writes, under the key's lock, and reads under it too;
    without, rank 0 alone writes, and a reader that meets an entry being
    written compiles instead (with a warning).
    """
    os.environ["JAX_COMPILATION_CACHE_DIR"] = cache_dir
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0" if writer else "1e9"


def worker(argv: list[str]) -> int:
    """Inside mpiexec: redirect this rank's output to its log, run pytest."""
    log_dir, cache_dir = Path(argv[0]), argv[1]
    rank = next((os.environ[k] for k in RANK_ENV if k in os.environ), "0")
    if cache_dir:
        # With shared compiles every rank may be the one that compiles a program (and
        # writes it, under the key's lock); without, rank 0 writes alone.
        use_compilation_cache(cache_dir, writer=rank == "0" or os.environ.get("DISTLINALG_SHARED_COMPILES") == "1")
    log_dir.mkdir(parents=True, exist_ok=True)
    log = open(log_dir / f"rank{rank}.log", "w", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    import pytest

    code = pytest.main(argv[2:])
    sys.stdout.flush()
    sys.stderr.flush()
    (log_dir / f"rank{rank}.rc").write_text(str(int(code)))
    return int(code)


class World:
    """One mpiexec job of the suite (a world of `nprocs` ranks, or one shard of a 1-rank world)."""

    def __init__(self, nprocs: int, pytest_args: list[str], cache_dir: str, xla_flags: str | None,
                 log_dir: Path, label: str) -> None:
        self.nprocs, self.log_dir, self.label = nprocs, log_dir, label
        shutil.rmtree(log_dir, ignore_errors=True)
        cmd = find_mpiexec() + [
            "-n", str(nprocs), sys.executable, __file__, "--worker", str(log_dir), cache_dir,
            "-p", "no:cacheprovider", "-m", "not serial",
            # A rank blocked inside MPI never returns to the interpreter, so
            # SIGALRM-based timeouts would never fire: use the timer thread.
            "--timeout-method=thread", *pytest_args,
        ]
        env = dict(os.environ)
        if xla_flags is not None:
            env["XLA_FLAGS"] = xla_flags
        if nprocs > len(os.sched_getaffinity(0)):
            # Oversubscribed: MPICH's progress loop (MPI_THREAD_MULTIPLE) yields its
            # lock with sched_yield, which leaves a rank that waits spinning on a
            # core that a compiling rank needs. With nanosleep, test_gram.py and
            # test_collectives.py on 3 ranks / 2 cores took 116 s against 132 s (one
            # A/B; no change at 2 ranks). Open MPI's counterpart: mpi_yield_when_idle.
            env.setdefault("MPIR_CVAR_ENABLE_HEAVY_YIELD", "1")
        shown_flags = f"XLA_FLAGS='{xla_flags}' " if xla_flags else ""
        print(f"=== {label}: {shown_flags}{' '.join(cmd)}", flush=True)
        self.start = time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, env=env)

    def finish(self, timeout: float) -> bool:
        """Wait for the job (until `timeout` s after its start), show its logs; whether it passed."""
        try:
            self.proc.wait(timeout=max(1.0, timeout - (time.monotonic() - self.start)))
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            timed_out = True
        elapsed = time.monotonic() - self.start
        codes = {}
        for r in range(self.nprocs):
            rc_file = self.log_dir / f"rank{r}.rc"
            codes[r] = int(rc_file.read_text()) if rc_file.exists() else None
        ok = not timed_out and self.proc.returncode == 0 and all(c == 0 for c in codes.values())
        # pytest exit 5 = nothing collected (e.g. a -k filter) is not a failure.
        if not timed_out and all(c in (0, 5) for c in codes.values()) and self.proc.returncode in (0, 5):
            ok = True
        rank0 = self.log_dir / "rank0.log"
        print(rank0.read_text() if rank0.exists() else "(rank 0 wrote no log)", flush=True)
        if not ok:
            reason = f"timed out after {timeout:.0f} s" if timed_out else f"mpiexec exit {self.proc.returncode}"
            print(f"!!! {self.label} FAILED ({reason}); per-rank exit codes {codes}", flush=True)
            for r in range(1, self.nprocs):
                if codes[r] != 0:
                    log = self.log_dir / f"rank{r}.log"
                    text = log.read_text() if log.exists() else "(no log)"
                    print(f"----- rank {r} of {self.nprocs} (exit {codes[r]}) -----\n{text}", flush=True)
        print(f"=== {self.label}: {'ok' if ok else 'FAILED'} in {elapsed:.0f} s", flush=True)
        return ok

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def run_ranks(nprocs: int, pytest_args: list[str], timeout: float, cache_dir: str,
              xla_flags: str | None = None) -> bool:
    world = World(nprocs, pytest_args, cache_dir, xla_flags, LOGS / f"n{nprocs}", f"{nprocs} rank(s)")
    try:
        return world.finish(timeout)
    finally:
        world.stop()


# A world of one rank is one process, which compiles on one core: on a machine with
# more, the test files are spread over that many concurrent one-rank jobs (shards),
# balanced by each file's recorded time (SHARD_WEIGHTS, seconds at one rank; a file
# not listed counts by its size), the single-process tests beside the first shard.
# Files are never split, so every file still runs in one process in its own order.
SHARD_WEIGHTS = Path(__file__).resolve().parent / "shard_weights.json"
FILE_OVERHEAD_S = 8.0  # per file, besides its recorded test times (fitted on a 2-shard run)
# pytest options that take the next argument as their value (so it is not a path).
_VALUE_OPTIONS = {"-k", "-m", "-p", "-c", "-o", "-W", "-r", "--durations", "--timeout", "--rootdir",
                  "--basetemp", "--deselect", "--ignore", "--maxfail", "--junitxml"}


def record_shard_weights(log: Path, serial_seconds: float) -> None:
    """Write SHARD_WEIGHTS from a 1-rank log of ``--durations=0`` (every test's phases summed per file):
    ``run_mpi.py --no-serial --no-shards --ranks 1 -- --durations=0``, then
    ``run_mpi.py --shard-weights-from .mpitest/n1/rank0.log``."""
    totals: dict[str, float] = {}
    for line in log.read_text().splitlines():
        match = re.match(r"([\d.]+)s (?:call|setup|teardown)\s+(\S+?)::", line)
        if match:
            totals[match.group(2)] = totals.get(match.group(2), 0.0) + float(match.group(1))
    weights = {f: round(t, 1) for f, t in sorted(totals.items())} | {"serial": serial_seconds}
    SHARD_WEIGHTS.write_text(json.dumps(weights, indent=1, sort_keys=True) + "\n")
    print(f"=== {SHARD_WEIGHTS}: {len(totals)} files, {sum(totals.values()):.0f} s", flush=True)


def split_paths(pytest_args: list[str]) -> tuple[list[str], list[str]] | None:
    """(the test files named by `pytest_args`, the other arguments), or None where they name
    single tests (file::test), which are left to one process."""
    paths, options, previous = [], [], ""
    for arg in pytest_args:
        if not arg.startswith("-") and previous not in _VALUE_OPTIONS and (ROOT / arg.split("::")[0]).exists():
            if "::" in arg:
                return None
            paths.append(arg)
        else:
            options.append(arg)
        previous = arg
    files = []
    for path in paths or ["tests"]:
        full = ROOT / path
        found = sorted(full.rglob("test_*.py")) if full.is_dir() else [full]
        files += [str(f.relative_to(ROOT)) for f in found if f.relative_to(ROOT).as_posix() not in files]
    return files, options


def shard_files(files: list[str], shards: int, first_load: float) -> list[list[str]]:
    """`files` in `shards` groups of about equal recorded time (longest first onto the
    least loaded group), the first group starting at `first_load` seconds."""
    weights = json.loads(SHARD_WEIGHTS.read_text()) if SHARD_WEIGHTS.exists() else {}
    # Each file also costs its collection (imports, module set-up) outside its tests' times.
    cost = {f: FILE_OVERHEAD_S + float(weights.get(f, (ROOT / f).stat().st_size / 2000)) for f in files}
    groups: list[list[str]] = [[] for _ in range(shards)]
    loads = [first_load] + [0.0] * (shards - 1)
    for f in sorted(files, key=lambda f: -cost[f]):
        k = loads.index(min(loads))
        groups[k].append(f)
        loads[k] += cost[f]
    return [sorted(g) for g in groups if g]


def run_one_rank_sharded(pytest_args: list[str], timeout: float, cache_dir: str, xla_flags: str | None,
                         serial_beside: bool) -> bool:
    """The 1-rank world as concurrent one-rank jobs over disjoint groups of files."""
    split = split_paths(pytest_args)
    cpus = len(os.sched_getaffinity(0))
    if split is None or cpus < 2 or len(split[0]) < 2:
        return run_ranks(1, pytest_args, timeout, cache_dir, xla_flags)
    files, options = split
    weights = json.loads(SHARD_WEIGHTS.read_text()) if SHARD_WEIGHTS.exists() else {}
    groups = shard_files(files, cpus, float(weights.get("serial", 0.0)) if serial_beside else 0.0)
    start = time.monotonic()
    print(f"=== 1 rank(s): {len(files)} test files in {len(groups)} concurrent one-rank jobs", flush=True)
    worlds = [World(1, [*group, *options], cache_dir, xla_flags, LOGS / "n1" / f"shard{k}", f"1 rank, shard {k}")
              for k, group in enumerate(groups)]
    try:
        results = [world.finish(timeout) for world in worlds]
    finally:
        for world in worlds:
            world.stop()
    ok = all(results)
    print(f"=== 1 rank(s): {'ok' if ok else 'FAILED'} in {time.monotonic() - start:.0f} s "
          f"({sum(results)} of {len(results)} shards passed)", flush=True)
    return ok


class SerialRun:
    """The single-process tests (pytest -m serial) in the background, their
    output in a log that is shown when they end."""

    def __init__(self, cmd: list[str]) -> None:
        LOGS.mkdir(parents=True, exist_ok=True)
        self.log_path = LOGS / "serial.log"
        self.log = open(self.log_path, "w")
        print(f"=== single-process tests, beside the first world (report after it): {' '.join(cmd)}", flush=True)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def finish(self) -> bool:
        code = self.proc.wait()
        self.log.close()
        print("=== single-process tests", flush=True)
        print(self.log_path.read_text(), flush=True)
        ok = code in (0, 5)  # 5: nothing collected (e.g. a -k filter)
        # (their own time is in pytest's summary above; this point is after the world as well)
        print(f"=== single-process tests: {'ok' if ok else 'FAILED'}", flush=True)
        return ok

    def stop(self) -> None:
        """Interrupted (Ctrl-C, an error in the harness): end them with their process group."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--timeout", type=float, default=3000.0, help="wall-clock limit per rank count (s; a hang is caught sooner by each test's own pytest-timeout): the 3-rank world took 2427 s on a slow day here")
    parser.add_argument("--no-serial", action="store_true", help="skip the single-process tests")
    parser.add_argument("--serial-first", action="store_true",
                        help="run the single-process tests alone before the worlds (by default they run beside a "
                             "first world of one rank)")
    parser.add_argument("--no-compile-cache", action="store_true",
                        help="compile everything afresh in every world (no shared JAX compilation cache)")
    parser.add_argument("--xla-defaults", action="store_true",
                        help="compile with XLA's default CPU code generation (not FAST_COMPILE_FLAGS)")
    parser.add_argument("--no-shards", action="store_true",
                        help="run a 1-rank world as one process (by default its test files are spread over one "
                             "concurrent one-rank job per core)")
    parser.add_argument("--shard-weights-from", type=Path, metavar="LOG",
                        help="write tests/shard_weights.json from a 1-rank log of --durations=0, and exit")
    parser.add_argument("--serial-seconds", type=float, default=300.0,
                        help="with --shard-weights-from: the single-process tests' time")
    parser.add_argument("--mpiexec-only", action="store_true", help="run a command under mpiexec")
    parser.add_argument("-n", type=int, default=2, help="ranks for --mpiexec-only")
    parser.add_argument("rest", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    # Everything this run starts lowers into shared MLIR contexts (the patch row
    # jax-shared-mlir-context): making a context with every dialect loaded was half of
    # JAX's lowering time, 10 ms a program; test_collectives.py in one process lowered its
    # 923 programs in 6 s instead of 17. DISTLINALG_SHARED_MLIR_CONTEXT=0 keeps JAX's own.
    os.environ.setdefault("DISTLINALG_SHARED_MLIR_CONTEXT", "1")
    # And the ranks of a world compile each program once (row jax-shared-compiles): one rank
    # compiles under the program's lock in the run's cache, the others load it.
    # DISTLINALG_SHARED_COMPILES=0 lets every rank compile its own.
    os.environ.setdefault("DISTLINALG_SHARED_COMPILES", "1")
    if args.shard_weights_from:
        record_shard_weights(args.shard_weights_from, args.serial_seconds)
        return 0
    if args.mpiexec_only:
        return subprocess.call(find_mpiexec() + ["-n", str(args.n), *rest], cwd=ROOT)
    results = []
    serial = None
    if not args.no_serial:
        serial_cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-m", "serial", *rest]
        if args.ranks[:1] == [1] and len(os.sched_getaffinity(0)) >= 2 and not args.serial_first:
            # The single-process tests mostly wait (for watchdogs, stall reports,
            # the mpiexec jobs they start), and a one-rank world leaves a core
            # free: they run beside it, and their report follows its report.
            serial = SerialRun(serial_cmd)
        else:
            print("=== single-process tests", flush=True)
            results.append(subprocess.call(serial_cmd, cwd=ROOT) in (0, 5))
    cache_dir = "" if args.no_compile_cache else tempfile.mkdtemp(prefix="distlinalg-jax-cache-")
    xla_flags = None if args.xla_defaults else fast_compile_flags()
    try:
        for n in args.ranks:
            if n == 1 and not args.no_shards:
                results.append(run_one_rank_sharded(rest, args.timeout, cache_dir, xla_flags, serial is not None))
            else:
                results.append(run_ranks(n, rest, args.timeout, cache_dir, xla_flags))
            if serial is not None:
                results.append(serial.finish())
                serial = None
    finally:
        if serial is not None:
            serial.stop()
        if cache_dir:
            shutil.rmtree(cache_dir, ignore_errors=True)
    print(f"=== summary: {sum(results)} of {len(results)} runs passed", flush=True)
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
