"""XLA CPU's YNN reduce fusions (jaxlib 0.10.2) miscompile a reduced dot
(with a broadcast-scalar operand; of a squared product): distlinalg must
switch them off whatever the import order (before XLA starts through
XLA_FLAGS, after it per compilation), and keeps YNN's matmuls (individual
dots), which compute every pattern here correctly."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO_ROOT

pytestmark = pytest.mark.serial

PROBE = textwrap.dedent(
    """
    import re, sys
    import jax
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import numpy as np
    if sys.argv[1] == "jax-first":
        jnp.zeros(1).block_until_ready()  # the backend starts before distlinalg
    import distlinalg
    rng = np.random.default_rng(0)
    X, W = rng.standard_normal((4096, 8)), rng.standard_normal((8, 16))
    patterns = {  # (function, arguments, reference in numpy)
        "sum(X @ broadcast)": (lambda X, s: jnp.sum(X @ jnp.broadcast_to(s, (8, 4)), axis=1), (X, 0.7),
                               (X @ np.full((8, 4), 0.7)).sum(axis=1)),
        "sum((X @ W)**2)": (lambda X, W: jnp.sum((X @ W) ** 2, axis=1), (X, W), ((X @ W) ** 2).sum(axis=1)),
        "X @ W": (lambda X, W: X @ W, (X, W), X @ W),
    }
    error, ynn_reduce, ynn_dot = 0.0, False, False
    for f, args, want in patterns.values():
        f = jax.jit(f)
        error = max(error, float(np.max(np.abs(np.asarray(f(*args)) - want)) / np.max(np.abs(want))))
        text = f.lower(*args).compile().as_text()
        for called in re.findall(r'calls=(%[^,\\s]+)[^\\n]*__ynn_fusion', text):
            body = text[text.index(called + " ("):]
            body = body[:body.index("\\n}")]
            ynn_reduce |= " reduce(" in body
            ynn_dot |= " dot(" in body
    print(distlinalg.YNN_FUSION)
    print("ynn-reduce" if ynn_reduce else "no-ynn-reduce", "ynn-dot" if ynn_dot else "no-ynn-dot")
    print("max-error", error)
    """
)


@pytest.mark.parametrize("order", ["distlinalg-first", "jax-first"])
def test_ynn_fusions_off_whatever_the_import_order(order):
    # This process imported distlinalg, which put the flag into XLA_FLAGS:
    # the child must start without it to see what distlinalg itself does.
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "ynn_fusion" not in f)
    env = dict(os.environ, XLA_FLAGS=flags)
    out = subprocess.run([sys.executable, "-c", PROBE, order], capture_output=True, text=True,
                         timeout=300, cwd=REPO_ROOT, env=env)
    assert out.returncode == 0, out.stderr
    status, program, error = out.stdout.strip().splitlines()[-3:]
    if status == "not present in this jaxlib":
        pytest.skip("this jaxlib has no YNN fusions")
    assert status.startswith("disabled"), status
    reduce, dot = program.split()
    assert reduce == "no-ynn-reduce", out.stdout
    # YNN's matmuls are kept where the jaxlib knows them (it does from 0.10.2 on).
    assert dot == ("ynn-dot" if "matmuls kept" in status else "no-ynn-dot"), out.stdout
    assert float(error.split()[1]) < 1e-12, out.stdout
