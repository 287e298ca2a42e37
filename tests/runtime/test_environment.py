"""Single-process checks of the build, the import-time MPI checks and the harness."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO_ROOT

pytestmark = pytest.mark.serial

RUNNER = REPO_ROOT / "tests" / "run_mpi.py"


def run(cmd, timeout=300, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT, **kw)


def test_environment_report_under_mpiexec():
    out = run([sys.executable, str(RUNNER), "--mpiexec-only", "-n", "2", "--",
               sys.executable, "-m", "distlinalg"])
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for key in ["distlinalg:", "jax:", "jaxlib:", "mpi4py:", "numpy:", "MPI at run time:",
                "MPI at build time:", "thread level:", "world size:     2", "CUDA handlers:",
                "MPI CUDA-aware:", "GPU transport:", "GPU device:", "CPU affinity:"]:
        assert key in text, (key, text)
    assert "rank 0 of 2" in text and "rank 1 of 2" in text
    assert "cross-rank check (DISTLINALG_CHECK): first-run" in text, text
    # The patch table, with each JAX row's state in this process.
    assert "patches (distlinalg/_runtime/patches.py" in text, text
    for row in ("jax-aot-fast-path", "jax-failed-token", "jax-programs-without-results", "jax-gpu-compile-options"):
        assert f"  {row} [jax " in text and text.split(f"  {row} [jax ")[1].split("\n")[0].endswith(": applied"), text


@pytest.mark.parametrize("value", ["0", "-3", "2147483648", "lots"])
def test_bad_max_count_is_an_import_error_not_a_hang(value):
    # A count of 0 used to be accepted at import, and every chunked call then looped forever.
    env = dict(os.environ, DISTLINALG_MAX_COUNT=value)
    out = run([sys.executable, "-c", "import distlinalg"], timeout=120, env=env)
    assert out.returncode != 0
    assert "DISTLINALG_MAX_COUNT must be" in out.stderr and repr(value) in out.stderr, out.stderr


def test_library_mismatch_is_an_import_error(monkeypatch):
    from distlinalg._runtime import mpi as _mpi

    class OtherLibrary:
        def __getattr__(self, name):
            return getattr(_mpi._native, name)

        @staticmethod
        def runtime_library_version():
            return "Open MPI v5.0.0, package: elsewhere"

    monkeypatch.setattr(_mpi, "_native", OtherLibrary())
    with pytest.raises(ImportError, match="different MPI libraries(.|\n)*Rebuild distlinalg"):
        _mpi._check_library()


def test_abi_mismatch_is_an_import_error(monkeypatch):
    from distlinalg._runtime import mpi as _mpi

    monkeypatch.setitem(_mpi.BUILD_INFO, "comm_world_handle", 12345)
    with pytest.raises(ImportError, match="different MPI ABIs(.|\n)*Rebuild"):
        _mpi._check_library()


def test_low_thread_level_is_an_import_error():
    code = textwrap.dedent(
        """
        import mpi4py
        mpi4py.rc.thread_level = "funneled"
        from mpi4py import MPI
        try:
            import distlinalg
        except ImportError as err:
            print("IMPORT ERROR:", err)
        """
    )
    out = run([sys.executable, "-c", code])
    assert "IMPORT ERROR:" in out.stdout and "SERIALIZED or MULTIPLE" in out.stdout, out.stdout + out.stderr


def test_build_without_mpi_compiler_says_how_to_get_one(tmp_path):
    import jax  # noqa: F401  (the configure step imports it too)

    env = dict(os.environ, DISTLINALG_MPICC=str(tmp_path / "no-such-mpicc"))
    out = run(["cmake", "-S", str(REPO_ROOT), "-B", str(tmp_path / "build"),
               f"-DPython_EXECUTABLE={sys.executable}"], env=env)
    assert out.returncode != 0
    message = out.stdout + out.stderr
    assert "no MPI compiler wrapper" in message and "pip install mpich mpi4py" in message, message


def test_harness_reports_a_deadlocked_test_and_its_rank(tmp_path):
    test_file = tmp_path / "test_hang.py"
    test_file.write_text(textwrap.dedent(
        """
        import pytest
        import jax.numpy as jnp
        import distlinalg
        from distlinalg.comm import allreduce

        @pytest.mark.timeout(10)
        def test_only_rank_zero_communicates():
            if distlinalg.rank() == 0:
                allreduce(jnp.ones(1)).block_until_ready()
        """
    ))
    # The harness's own deadlock report: with the default checks on, the end-of-program
    # check would turn this deadlock into an error first (tests/runtime/test_checks.py).
    # Its logs in tmp_path: never over those of a world of the suite's own run.
    env = dict(os.environ, DISTLINALG_CHECK="0", MPITEST_LOGS=str(tmp_path / "logs"))
    out = run([sys.executable, str(RUNNER), "--ranks", "2", "--no-serial", "--timeout", "120",
               "--", str(test_file)], timeout=200, env=env)
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert "FAILED" in text and "test_only_rank_zero_communicates" in text, text
    assert "Timeout" in text, text


@pytest.mark.parametrize(("choice", "library", "expected"), [
    ("auto", "MPICH Version:      5.0.2", True),
    ("auto", "Open MPI v5.0.8, package: Open MPI", False),
    ("", "MPICH Version:      5.0.2", True),
    ("1", "Open MPI v5.0.8", True),
    ("0", "MPICH Version:      5.0.2", False),
])
def test_cancellable_waits_setting(choice, library, expected):
    """DISTLINALG_CANCELLABLE_WAITS (issue 57): collectives wait cancellably except under Open
    MPI by default (its nonblocking collectives are 1.8-2.6x slower); 1/0 force it."""
    from distlinalg._runtime import mpi as _mpi

    assert _mpi._cancellable_collectives(choice, library) is expected


def test_cancellable_waits_setting_rejects_other_values():
    from distlinalg._runtime import mpi as _mpi

    with pytest.raises(ValueError, match="DISTLINALG_CANCELLABLE_WAITS must be auto, 1 or 0"):
        _mpi._cancellable_collectives("sometimes", "MPICH")
