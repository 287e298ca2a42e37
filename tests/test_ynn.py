"""XLA CPU's YNN fusions (jaxlib 0.10.2) miscompile a reduced dot with a
broadcast-scalar operand: distlinalg must switch them off whatever the
import order (before XLA starts through XLA_FLAGS, after it per compilation)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.serial

ROOT = Path(__file__).resolve().parent.parent

PROBE = textwrap.dedent(
    """
    import sys
    import jax
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import numpy as np
    if sys.argv[1] == "jax-first":
        jnp.zeros(1).block_until_ready()  # the backend starts before distlinalg
    import distlinalg
    f = jax.jit(lambda X, s: jnp.sum(X @ jnp.broadcast_to(s, (8, 4)), axis=1))
    X = np.random.default_rng(0).standard_normal((4096, 8))
    got = np.asarray(f(X, 0.7))
    want = (X @ np.full((8, 4), 0.7)).sum(axis=1)
    print(distlinalg.YNN_FUSION)
    print("ynn-fusion-in-program" if "__ynn_fusion" in f.lower(X, 0.7).compile().as_text() else "no-ynn")
    print("max-error", float(np.max(np.abs(got - want))))
    """
)


@pytest.mark.parametrize("order", ["distlinalg-first", "jax-first"])
def test_ynn_fusions_off_whatever_the_import_order(order):
    # This process imported distlinalg, which put the flag into XLA_FLAGS:
    # the child must start without it to see what distlinalg itself does.
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "ynn_fusion" not in f)
    env = dict(os.environ, XLA_FLAGS=flags)
    out = subprocess.run([sys.executable, "-c", PROBE, order], capture_output=True, text=True,
                         timeout=300, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr
    status, program, error = out.stdout.strip().splitlines()[-3:]
    if status == "not present in this jaxlib":
        pytest.skip("this jaxlib has no YNN fusions")
    assert status.startswith("disabled"), status
    assert program == "no-ynn", out.stdout
    assert float(error.split()[1]) < 1e-10, out.stdout
