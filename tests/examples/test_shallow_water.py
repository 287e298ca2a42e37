"""examples/shallow_water across rank counts (mpiexec jobs of tests/scripts/shallow_water_job.py).

Decomposition invariance: 1, 2 and 4 ranks and an uneven split give the same state after
1000 float64 steps; the gradient of a misfit by jax.grad through the whole run is the same
on every rank count, equals the JVP (the dot test) and central differences, and so do the
checkpointed gradient and a Hessian-vector product.
"""

from __future__ import annotations

import os
from pathlib import Path
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.serial
JOB = Path(__file__).resolve().parents[1] / "scripts" / "shallow_water_job.py"
NY, NX = 24, 40  # small enough for 4 ranks on 2 cores


def _run(tmp_path, ranks: int, steps: int, *extra: str) -> dict:
    out = tmp_path / f"p{ranks}{'-'.join(extra).replace(',', '_').replace(':', '__')}.npz"
    cmd = [str(Path(sys.executable).parent / "mpiexec"), "-n", str(ranks), sys.executable, str(JOB),
           str(out), str(NY), str(NX), str(steps), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return dict(np.load(out))


@pytest.mark.timeout(900)
def test_decomposition_invariant_after_1000_steps(tmp_path):
    """P = 1, 2, 4 and an uneven 3 x 1 split: the same final state to 1e-12."""
    runs = {"1": _run(tmp_path, 1, 1000), "2": _run(tmp_path, 2, 1000), "4": _run(tmp_path, 4, 1000),
            "uneven": _run(tmp_path, 3, 1000, "--splits", "10,9,5:40")}
    reference = runs["1"]
    assert np.isfinite(reference["final_h"]).all() and np.ptp(reference["final_h"]) > 1.0
    for name, run in runs.items():
        for field in ("final_h", "final_u", "final_v"):
            scale = np.max(np.abs(reference[field])) + 1.0
            np.testing.assert_allclose(run[field], reference[field], rtol=0, atol=1e-12 * scale, err_msg=f"{name} {field}")


@pytest.mark.timeout(900)
def test_gradient_through_the_run(tmp_path):
    """jax.grad through 20 steps: the same on 1 and 2 ranks and an uneven split, the dot test,
    central differences, the checkpointed gradient and a Hessian-vector product."""
    runs = {"1": _run(tmp_path, 1, 20, "--gradient"), "2": _run(tmp_path, 2, 20, "--gradient"),
            "uneven": _run(tmp_path, 2, 20, "--gradient", "--splits", "15,9:40")}
    reference = runs["1"]
    assert reference["misfit"] > 0
    for name, run in runs.items():
        scale = np.max(np.abs(reference["gradient"]))
        np.testing.assert_allclose(run["gradient"], reference["gradient"], rtol=0, atol=1e-10 * scale, err_msg=name)
        np.testing.assert_allclose(run["gradient_checkpointed"], run["gradient"], rtol=0, atol=1e-12 * scale)
        # The dot test across ranks, and central differences.
        assert abs(run["grad_dot"] - run["jvp"]) <= 1e-12 * abs(run["jvp"]), name
        assert abs(run["central_difference"] - run["jvp"]) <= 1e-7 * abs(run["jvp"]), name
        hscale = np.max(np.abs(run["hvp"]))
        np.testing.assert_allclose(run["hvp"], run["hvp_difference"], rtol=0, atol=1e-6 * hscale, err_msg=name)
