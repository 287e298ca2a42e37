"""Compile every program of tests/cuda/test_cuda_lowering.py with XLA's GPU compiler, without a GPU.

    python tests/cuda_compile.py [--target h100] [--ranks 2] [-- pytest args]

Run with the Python of the venv to test (``make test-cuda-compile`` builds one on the newest
Python ≥ 3.12 it finds, so that the newest jaxlib, the one GPU machines carry, is the one
compiled with). JAX's CUDA plugin for that venv's jaxlib (CUDA 13 where PyPI has it for this
jaxlib, else CUDA 12) and ptxas (nvidia-cuda-nvcc) are installed into <venv>/cuda-compile,
outside the venv's site-packages, so that no other test ever sees a CUDA plugin. The tests
then run under mpiexec with ``DISTLINALG_CUDA_COMPILE=<target>``: each program is lowered and
compiled for a deviceless topology made from tests/cuda_targets/<target>.txtpb. A program
XLA's GPU pipeline rejects fails its test; an abort ends the rank and fails the run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def install_plugin(site: Path) -> str:
    """The CUDA plugin matching this jaxlib in `site` (once); returns what is installed."""
    import jaxlib

    version = jaxlib.__version__
    stamp = site / f".installed-{version}"
    if stamp.exists():
        return stamp.read_text()
    errors = []
    for cuda, nvcc in (("13", "nvidia-cuda-nvcc"), ("12", "nvidia-cuda-nvcc-cu12")):
        wheels = [f"jax-cuda{cuda}-plugin=={version}", f"jax-cuda{cuda}-pjrt=={version}", nvcc]
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--upgrade", "--target",
                               str(site), *wheels], capture_output=True, text=True)
        if proc.returncode == 0:
            stamp.write_text(f"jax-cuda{cuda}-plugin {version}")
            return stamp.read_text()
        errors.append(proc.stderr.strip().splitlines()[-1:] or [""])
    raise SystemExit(f"no CUDA plugin for jaxlib {version} on PyPI: {errors}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="h100")
    parser.add_argument("--ranks", nargs="+", default=["2"])
    parser.add_argument("pytest_args", nargs="*")
    args = parser.parse_args()
    site = Path(sys.prefix) / "cuda-compile"
    site.mkdir(exist_ok=True)
    import jax

    print(f"=== deviceless CUDA compilation for {args.target}: Python {sys.version.split()[0]}, jax {jax.__version__}, "
          f"{install_plugin(site)}", flush=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
               JAX_PLATFORMS="cpu", JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1", DISTLINALG_CUDA_COMPILE=args.target)
    # The CPU-only XLA flags of the test worlds are unknown to the GPU compiler, which aborts on them.
    cmd = [sys.executable, str(ROOT / "tests" / "run_mpi.py"), "--ranks", *args.ranks, "--xla-defaults", "--",
           str(ROOT / "tests" / "cuda" / "test_cuda_lowering.py"), *args.pytest_args]
    return subprocess.run(cmd, env=env, cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
