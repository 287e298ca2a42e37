#!/usr/bin/env python3
"""Run mpi4jax's own test suite against distlinalg.mpi4jax.

    python tests/peers/run_mpi4jax_suite.py [--ranks 1 2 3] [--source DIR] [-- pytest args]

1. Gets mpi4jax 0.9.1's tests: the sdist from PyPI through pip (cached under
   build/mpi4jax-suite/), or the tests/ and examples/ of an mpi4jax source tree
   given with --source (e.g. a checkout of its tag v0.9.1).
2. Copies tests/ and examples/ into a directory without mpi4jax's own package,
   beside a shim package named ``mpi4jax`` that re-exports
   ``distlinalg.mpi4jax`` (on PYTHONPATH, so the tests' subprocesses see it
   too). mpi4jax itself is never installed or imported.
3. Runs pytest under mpiexec for each rank count, each rank writing a JUnit
   report, and prints per rank count: passed, failed as expected (below, with
   the reason), failed unexpectedly, skipped. A test counts as passed when it
   passed on every rank that ran it.

Exit status 0 when no test failed unexpectedly.

Tests that are expected to fail (see docs/mpi4jax.md):
  * identity-transpose assertions: mpi4jax transposes allreduce(SUM) to the
    identity; distlinalg to an allreduce-sum of the cotangents (the adjoint of
    the SPMD program), which differs by the factor P on P > 1 ranks;
  * mpi4jax's own limitations and messages that distlinalg does not share;
  * tests of mpi4jax's private modules (``mpi4jax._src``), which are not part
    of its API.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORK = ROOT / "build" / "mpi4jax-suite"
SDIST = "mpi4jax==0.9.1.post2"

IDENTITY_TRANSPOSE = (
    "asserts mpi4jax's identity transpose of allreduce(SUM); distlinalg's transpose is the "
    "allreduce-sum of the cotangents, so the value is P times mpi4jax's on P ranks"
)
# Test id (file::name) -> why it fails by design. Ids missing here must pass.
EXPECTED_FAILURES = {
    "collective_ops/test_allreduce.py::test_allreduce_transpose": IDENTITY_TRANSPOSE,
    "collective_ops/test_allreduce.py::test_allreduce_transpose_jit": IDENTITY_TRANSPOSE,
    "collective_ops/test_allreduce.py::test_allreduce_grad": IDENTITY_TRANSPOSE,
    "collective_ops/test_allreduce.py::test_allreduce_vjp": IDENTITY_TRANSPOSE,
    "collective_ops/test_allreduce.py::test_allreduce_chained": IDENTITY_TRANSPOSE,
    "collective_ops/test_allreduce.py::test_allreduce_chained_jit": IDENTITY_TRANSPOSE,
    **{
        f"collective_ops/test_allreduce_matvec.py::{name}": IDENTITY_TRANSPOSE
        for name in (
            # mvT computes linear_transpose(allreduce) in its forward pass.
            "test_matvecT", "test_matvecT_jit", "test_matvecT_jvp", "test_matvecT_jvp_jit",
            "test_matvec_transpose", "test_matvec_transpose_jit",
            "test_matvecT_transpose2", "test_matvecT_transpose2_jit",
            "test_matvec_transpose3", "test_matvec_transpose3_jit",
            "test_matvec_vjp", "test_matvec_vjp_jit", "test_matvecT_vjp", "test_matvecT_vjp_jit",
        )
    },
    "collective_ops/test_sendrecv.py::test_sendrecv_jacfwd": (
        "asserts that forward mode raises RuntimeError (an mpi4jax limitation); distlinalg "
        "differentiates sendrecv in forward mode"
    ),
    "collective_ops/test_common.py::test_abort_on_error": (
        "asserts mpi4jax's MPI_Abort message for send(dest=100); distlinalg raises a ValueError "
        "at trace time instead ('dest=100 is not a rank ...'), the subprocess still exits non-zero"
    ),
}
# Tests that cannot run on some rank counts whatever the library (they fail
# before or without any communication): test id -> (reason, rank counts).
UNSUPPORTED_WORLDS = {
    "collective_ops/test_alltoall.py::test_alltoall_transpose": (
        "reshapes a 256-wide array into rank-count blocks (256 % P != 0) before any MPI call",
        lambda n: 256 % n != 0,
    ),
    "test_examples.py::test_shallow_water_demo": (
        "the shallow-water example itself refuses this rank count (supported: 1, 2, 4, 6, 8, 16)",
        lambda n: n not in (1, 2, 4, 6, 8, 16),
    ),
}
PRIVATE = "imports mpi4jax._src (mpi4jax's private modules), not part of its API"
PRIVATE_TESTS = (
    "collective_ops/test_common.py::test_debug_logging",
    "collective_ops/test_common.py::test_set_logging_from_envvar",
    "collective_ops/test_common.py::test_mpi_abi_info",
    "collective_ops/test_common.py::test_mpi_abi_compatibility_check",
    "collective_ops/test_common.py::test_mpi_abi_skip_check",
    "test_decorators.py::",
    "test_jax_compat.py::",
    "test_validation.py::",
)


def expected_reason(test_id: str, n: int) -> str | None:
    if test_id in UNSUPPORTED_WORLDS and UNSUPPORTED_WORLDS[test_id][1](n):
        return UNSUPPORTED_WORLDS[test_id][0]
    if test_id in EXPECTED_FAILURES:
        return EXPECTED_FAILURES[test_id]
    if any(test_id.startswith(p) for p in PRIVATE_TESTS):
        return PRIVATE
    return None


def run(cmd: list[str], **kw) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)


def fetch_sdist() -> Path:
    """mpi4jax's sdist through pip (no install; only its tests and examples are used)."""
    tree = next(WORK.glob("mpi4jax-*/tests"), None)
    if tree is not None:
        return tree.parent
    WORK.mkdir(parents=True, exist_ok=True)
    # pip prepares an sdist's metadata even for `download`; mpi4jax's setup.py
    # needs setuptools' bdist_wheel, so give pip one in a private directory.
    tools = WORK / "build-tools"
    run([sys.executable, "-m", "pip", "install", "-q", "--target", str(tools), "setuptools>=70.1", "wheel"])
    env = dict(os.environ, PYTHONPATH=str(tools))
    run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-build-isolation",
         "--no-binary", "mpi4jax", SDIST, "-d", str(WORK)], env=env)
    archive = next(WORK.glob("mpi4jax-*.tar.gz"))
    with tarfile.open(archive) as tar:
        tar.extractall(WORK, filter="data")
    return next(WORK.glob("mpi4jax-*/tests")).parent


def prepare(source: Path) -> tuple[Path, Path]:
    """The suite (tests + examples, no mpi4jax package) and the shim directory."""
    suite = WORK / "suite"
    shutil.rmtree(suite, ignore_errors=True)
    shutil.copytree(source / "tests", suite / "tests")
    if (source / "examples").exists():
        shutil.copytree(source / "examples", suite / "examples")
    # The suite's own rootdir: no pytest configuration of distlinalg's (or of
    # mpi4jax's package tree) applies.
    (suite / "pytest.ini").write_text("[pytest]\n")
    shim = WORK / "shim" / "mpi4jax"
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "__init__.py").write_text(textwrap.dedent('''\
        """Stand-in for mpi4jax: distlinalg.mpi4jax under mpi4jax's name (tests only)."""
        from distlinalg.mpi4jax import *  # noqa: F401,F403
        from distlinalg.mpi4jax import __all__, __version__  # noqa: F401
    '''))
    return suite, shim.parent


RANK_WRAPPER = textwrap.dedent('''\
    import os, sys
    import pytest
    rank = next((os.environ[k] for k in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK") if k in os.environ), "0")
    out = sys.argv[1]
    sys.stdout = sys.stderr = open(os.path.join(out, f"rank{rank}.log"), "w", buffering=1)
    sys.exit(pytest.main([f"--junitxml={os.path.join(out, f'rank{rank}.xml')}", *sys.argv[2:]]))
''')


def mpiexec() -> list[str]:
    beside = Path(sys.executable).parent / "mpiexec"
    return [str(beside) if beside.exists() else "mpiexec"]


def run_world(n: int, suite: Path, shim: Path, pytest_args: list[str], timeout: float) -> Path:
    out = WORK / f"n{n}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    wrapper = WORK / "rank_pytest.py"
    wrapper.write_text(RANK_WRAPPER)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shim), env.get("PYTHONPATH", "")]))
    env.setdefault("JAX_PLATFORMS", "cpu")
    cmd = [*mpiexec(), "-n", str(n), sys.executable, str(wrapper), str(out),
           "tests", "-q", "-p", "no:cacheprovider", "--timeout=180", "--timeout-method=thread", *pytest_args]
    print(f"=== {n} rank(s): {' '.join(cmd)}", flush=True)
    start = time.time()
    try:
        proc = subprocess.run(cmd, cwd=suite, env=env, timeout=timeout)
        print(f"=== {n} rank(s): mpiexec exit {proc.returncode} after {time.time() - start:.0f} s")
    except subprocess.TimeoutExpired:
        print(f"=== {n} rank(s): timed out after {timeout:.0f} s")
    return out


def outcomes(out: Path, n: int) -> dict[str, set[str]]:
    """test id -> the set of per-rank outcomes ('passed', 'failed', 'skipped', 'missing')."""
    result: dict[str, set[str]] = {}
    for r in range(n):
        path = out / f"rank{r}.xml"
        if not path.exists():
            continue
        for case in ET.parse(path).iter("testcase"):
            module = case.get("classname", "").replace(".", "/")
            test_id = f"{module.removeprefix('tests/')}.py::{case.get('name')}"
            if case.find("failure") is not None or case.find("error") is not None:
                kind = "failed"
            elif case.find("skipped") is not None:
                kind = "skipped"
            else:
                kind = "passed"
            result.setdefault(test_id, set()).add(kind)
    return result


def summarise(n: int, res: dict[str, set[str]]) -> tuple[int, list[str]]:
    passed = skipped = 0
    expected, unexpected = [], []
    for test_id in sorted(res):
        kinds = res[test_id]
        if "failed" in kinds:
            (expected if expected_reason(test_id, n) else unexpected).append(test_id)
        elif "passed" in kinds:
            passed += 1
        else:
            skipped += 1
    total = len(res)
    print(f"\n=== {n} rank(s): {total} tests: {passed} passed, {len(expected)} failed as expected, "
          f"{len(unexpected)} failed unexpectedly, {skipped} skipped on every rank")
    for test_id in expected:
        print(f"  expected  {test_id}: {expected_reason(test_id, n)}")
    for test_id in unexpected:
        print(f"  UNEXPECTED {test_id}  (logs: {WORK / f'n{n}'})")
    # Expected failures that passed (e.g. identity-transpose tests on 1 rank, where P = 1).
    for test_id in sorted(res):
        if "failed" not in res[test_id] and expected_reason(test_id, n) and "passed" in res[test_id]:
            print(f"  passes    {test_id} (listed as expected to fail)")
    return len(unexpected), unexpected


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--source", type=Path, help="an mpi4jax source tree (tests/, examples/) instead of the sdist")
    parser.add_argument("--timeout", type=float, default=1500.0, help="wall-clock limit per rank count (s)")
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="-- extra pytest arguments")
    args = parser.parse_args()
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    source = args.source.resolve() if args.source else fetch_sdist()
    suite, shim = prepare(source)
    bad = 0
    for n in args.ranks:
        out = run_world(n, suite, shim, rest, args.timeout)
        res = outcomes(out, n)
        if not res:
            print(f"=== {n} rank(s): no results (see {out})")
            bad += 1
            continue
        bad += summarise(n, res)[0]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
