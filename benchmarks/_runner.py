"""Launching the benchmarks: each one under mpiexec, its JSON collected (run_all.py's runner).

``Runner`` starts one benchmark script under the launcher of a venv (the project's, or the
peers' benchmarks/.venv-peers), streams its progress lines, and returns the JSON it wrote,
or ``{"skipped": reason}`` when it fails or times out. ``run_benchmarks`` runs the selected
sections with the rank counts and arguments each needs (peers installed first, see
peers.py) and stores each section's runs in the results dict, saved after every section.
Every child runs with OPENBLAS_NUM_THREADS=OMP_NUM_THREADS=MKL_NUM_THREADS=1.

Also here: the paths and constants the driver's modules share, ``log``, and the readers of
a run's skip convention (``failed``, ``skipped_contenders``).
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import peers  # noqa: E402

OUT = ROOT / "build" / "bench"
CORES = os.cpu_count() or 1
BENCHES = ("collectives", "ad", "krylov", "sr", "operators")


def log(msg: str) -> None:
    """A timestamped progress line of the driver."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def failed(run) -> str | None:
    """The reason a whole run was skipped (a str under "skipped"), else None."""
    if run is None:
        return "not run"
    why = run.get("skipped")
    return why if isinstance(why, str) else None


def skipped_contenders(run) -> dict:
    """{contender: reason} for the contenders a run that did run skipped (a dict under "skipped")."""
    why = run.get("skipped") if run else None
    return why if isinstance(why, dict) else {}


def mpiexec_for(bin_dir: Path) -> list[str]:
    """The launcher command of the venv whose bin/ is bin_dir (else mpiexec on PATH); Open MPI's
    gets --oversubscribe and yield-when-idle (4 ranks run on 2 cores)."""
    exe = bin_dir / "mpiexec"
    exe = str(exe) if exe.exists() else shutil.which("mpiexec")
    if exe is None:
        raise SystemExit("run_all: no mpiexec found")
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    cmd = [exe]
    if "Open MPI" in version or "OpenRTE" in version or "prterun" in version.lower():
        cmd += ["--oversubscribe", "--mca", "mpi_yield_when_idle", "1"]
    return cmd


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a benchmark run: single-threaded BLAS, unbuffered output, no PYTHONPATH."""
    env = dict(os.environ)
    env.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)
    env.update(extra or {})
    return env


class Runner:
    """Runs benchmark scripts with one venv's python and mpiexec; records every command line."""

    def __init__(self, python: Path, timeout: float):
        self.python = python
        self.mpiexec = mpiexec_for(python.parent)
        self.timeout = timeout
        self.commands: list[str] = []

    def run(self, nprocs: int, script: str, args: list[str], json_path: Path, env: dict | None = None,
            timeout: float | None = None) -> dict:
        """One mpiexec run; its JSON, or {"skipped": reason} when it fails."""
        cmd = self.mpiexec + ["-n", str(nprocs), str(self.python), str(HERE / script), *args,
                              "--json", str(json_path)]
        return self.execute(cmd, json_path, env, timeout)

    def run_driver(self, script: str, args: list[str], json_path: Path, timeout: float | None = None) -> dict:
        """A benchmark that launches its own mpiexec runs (e.g. 1 and R ranks to compare)."""
        cmd = [str(self.python), str(HERE / script), *args, "--json", str(json_path)]
        return self.execute(cmd, json_path, None, timeout)

    def execute(self, cmd: list[str], json_path: Path, env: dict | None, timeout: float | None) -> dict:
        """Run cmd in its own process group (killed as a whole on timeout); the JSON it wrote at
        json_path plus wall time, command and load average, or {"skipped": reason}."""
        json_path.unlink(missing_ok=True)
        shown = " ".join(shlex.quote(str(c)).replace(str(ROOT) + "/", "") for c in cmd)
        self.commands.append(shown)
        log(f"$ {shown}")
        start = time.monotonic()
        load0 = os.getloadavg()[0]
        proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(env), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        lines: list[str] = []

        def pump():  # stream the benchmarks' progress lines ("[<bench> n=P] ...") as they come
            for line in proc.stdout:
                lines.append(line.rstrip("\n"))
                if line.startswith("[") and " n=" in line.split("]")[0]:
                    print("    " + line.rstrip(), flush=True)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            proc.wait(timeout=timeout or self.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the run's own process group only
            proc.wait()
            reader.join(5)
            return {"skipped": f"timed out after {timeout or self.timeout:.0f} s", "log": "\n".join(lines[-20:]),
                    "command": shown}
        reader.join(10)
        out = "\n".join(lines)
        if proc.returncode or not json_path.exists():
            tail = " | ".join(line for line in out.strip().splitlines()[-4:])
            return {"skipped": f"run failed (exit {proc.returncode}): {tail[-500:]}", "command": shown}
        data = json.loads(json_path.read_text())
        data.update(wall_seconds=time.monotonic() - start, command=shown, load=[load0, os.getloadavg()[0]])
        return data


# ---------------------------------------------------------------------------
def run_benchmarks(args, res: dict, save) -> dict:
    """Run the selected benchmarks into `res` (sections replaced as they finish; save(res) after each)."""
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    project = Runner(Path(sys.executable), timeout=900)
    peer_status: dict[str, tuple[bool, str]] = {}
    wanted_peers = [] if args.no_peers else ["mpi4jax"] * ("collectives" in args.only) + ["netket"] * (
        "sr" in args.only) + ["petsc"] * (args.with_petsc and "krylov" in args.only)
    for name in dict.fromkeys(wanted_peers):
        log(f"peer {name}: checking / installing (cached in {peers.VENV.relative_to(ROOT)})")
        try:
            peer_status[name] = peers.ensure(name, log=log)
        except Exception as exc:  # noqa: BLE001
            peer_status[name] = (False, f"{type(exc).__name__}: {exc}")
        log(f"peer {name}: {'ok ' + peer_status[name][1] if peer_status[name][0] else 'skipped: ' + peer_status[name][1]}")
    for name, prev in (res.get("peers") or {}).items():  # --only: keep what the last run found
        if name not in peer_status and prev.get("ok"):
            peer_status[name] = (True, prev["detail"])
    for name in ("mpi4jax", "netket", "petsc"):
        if name not in peer_status:
            why = "not requested (--no-peers)" if args.no_peers else (
                "not requested (--with-petsc builds it, about 15 minutes)" if name == "petsc" else "not needed")
            peer_status[name] = (False, why)
    peer_runner = Runner(peers.PY, timeout=900) if peers.PY.exists() else None
    q = args.quick
    res["peers"] = {k: {"ok": ok, "detail": d} for k, (ok, d) in peer_status.items()}
    sections = res.setdefault("sections", {})

    def done(section):  # stamp the section, save what has run so far
        sections[section] = {"date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
                             "quick": q}
        save(res)

    if "collectives" in args.only:
        common = (["--quick", "--repeats", "3", "--target", "0.03"] if q else ["--repeats", "5", "--target", "0.1"])
        ops_small = ["--ops", "allreduce", "allgather"] if q else []
        coll = res["collectives"] = {}
        for nprocs in (2, 4):
            # 4 ranks (oversubscribed): fewer ops in quick mode, every other size in full mode.
            extra = ops_small if (q and nprocs == 4) else []
            if not q and nprocs == 4:
                extra = ["--sizes", *(str(8 ** k) for k in (1, 3, 5, 7)), str(64 << 20)]
            runs = coll[str(nprocs)] = {}
            runs["main"] = project.run(nprocs, "bench_collectives.py",
                                       ["--contenders", "distlinalg-jit", "distlinalg-eager", "jax-eager-floor", "mpi4py", *common,
                                        *extra], out / f"collectives_n{nprocs}_main.json")
            if not (q and nprocs == 4):
                runs["jax-gloo"] = project.run(nprocs, "bench_collectives.py",
                                               ["--contenders", "jax-gloo", *common, *extra],
                                               out / f"collectives_n{nprocs}_gloo.json")
            if peer_status["mpi4jax"][0] and peer_runner:
                runs["mpi4jax"] = peer_runner.run(nprocs, "bench_collectives.py",
                                                  ["--contenders", "mpi4jax", *common, *extra],
                                                  out / f"collectives_n{nprocs}_mpi4jax.json")
            else:
                runs["mpi4jax"] = {"skipped": peer_status["mpi4jax"][1]}
        done("collectives")

    if "ad" in args.only:
        res["ad"] = project.run(2, "bench_ad.py", (["--quick", "--repeats", "3"] if q else ["--repeats", "7"]),
                                out / "ad_n2.json")
        done("ad")

    if "krylov" in args.only:
        n, iters = ("300", "100") if q else ("1000", "200")
        kr = res["krylov"] = {}
        base = ["--n", n, "--iters", iters, "--repeats", "3" if q else "5"]
        if q:
            base += ["--triad-elements", str(1 << 22)]
        for nprocs in (1, 2, 4):
            # distlinalg's solvers on operators.laplacian_2d (bench_krylov's default), with cg on
            # bench_krylov's own stencil as the comparison row. Iterations to rtol do not depend on the rank count: one solve to convergence on
            # 1 rank (quick) or on 1 and 2 ranks (full); the budget runs give ms/iteration.
            converge = ["--converge"] if nprocs == 1 or (nprocs == 2 and not q) else []
            # gmres and bicgstab with their jax.scipy peers on 1 and 2 ranks (the targets' runs; about
            # 2 minutes per run at n = 1000, mostly jax.scipy's gmres), not on 4 (oversubscribed). --converge
            # leaves GMRES out (bench_krylov.py: ~20x cg's matvecs to rtol).
            nonsymmetric = ["distlinalg-gmres", "distlinalg-bicgstab", "jax-scipy-gmres",
                            "jax-scipy-bicgstab"] if nprocs <= 2 else []
            kr[str(nprocs)] = project.run(
                nprocs, "bench_krylov.py",
                ["--contenders", "distlinalg-cg", "distlinalg-cg-sr", "distlinalg-minres", "distlinalg-cg-local",
                 "jax-scipy-cg", "scipy-cg", *nonsymmetric, *base, *converge], out / f"krylov_n{nprocs}.json",
                timeout=1800)
            if peer_status["petsc"][0] and peer_runner:
                kr[f"{nprocs}-petsc"] = peer_runner.run(
                    nprocs, "bench_krylov.py", ["--contenders", "petsc-cg", "petsc-minres", "jax-scipy-cg", *base],
                    out / f"krylov_n{nprocs}_petsc.json", timeout=1800)
        if not q:
            # The bandwidth targets where the bound binds: at n = 1000 the vectors (8 MB) half fit in
            # a 32 MiB last-level cache and a solver can beat the DRAM-streaming model; at n = 2000
            # (32 MB each) they do not.
            kr["1-dram"] = project.run(
                1, "bench_krylov.py", ["--contenders", "distlinalg-cg", "distlinalg-minres", "jax-scipy-cg",
                                       "--n", "2000", "--iters", "50", "--repeats", "5"],
                out / "krylov_n1_n2000.json", timeout=1800)
        done("krylov")

    if "sr" in args.only:
        its = ["--iters", "10" if q else "50"]
        sr = res["sr"] = {}
        for nprocs in ((1, 2) if q else (1, 2, 4)):
            sr[str(nprocs)] = project.run(nprocs, "bench_sr.py", its, out / f"sr_n{nprocs}.json")
        nk = res["netket"] = {}
        for nprocs in (1, 2):
            if peer_status["netket"][0] and peer_runner:
                nk[str(nprocs)] = peer_runner.run(nprocs, "bench_netket.py", its, out / f"netket_n{nprocs}.json")
            else:
                nk[str(nprocs)] = {"skipped": f"NetKet not installed: {peer_status['netket'][1]}"}
        # NetKet's own SR paths on a dnk.MCState (main venv, the [netket] extra) against NetKet in one process.
        paths = res["netket_paths"] = {}
        for nprocs in (1, 2):
            paths[str(nprocs)] = project.run(nprocs, "bench_netket_paths.py", ["--iters", "10" if q else "30"],
                                             out / f"netket_paths_n{nprocs}.json")
        done("sr")

    if "operators" in args.only:
        res["operators"] = project.run_driver("bench_operators.py", ["--quick"] if q else [],
                                              out / "operators.json", timeout=1800)
        done("operators")
    return res
