"""The patch table (distlinalg/_runtime/patches.py): every row recorded, versions outside the
checked lines warn, a target that is gone raises, the adapters change nothing at import, and
the environment switches read anywhere in the package are all in the docs' table."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings

import pytest

from conftest import REPO_ROOT

import distlinalg  # noqa: F401  (the start-up under test)
from distlinalg import _runtime
from distlinalg._runtime import patches

pytestmark = pytest.mark.serial


def test_every_jax_row_is_applied_once_at_import():
    for name in ("jax-effect-registries", "jax-aot-fast-path", "jax-failed-token", "jax-programs-without-results",
                 "jax-gpu-compile-options"):
        assert patches.state(name) == "applied", name
    shared = os.environ.get("DISTLINALG_SHARED_MLIR_CONTEXT", "0") == "1"
    # On a JAX that reuses its contexts itself (0.12) the row is not needed.
    assert patches.state("jax-shared-mlir-context").startswith(("applied", "not needed")) if shared else \
        patches.state("jax-shared-mlir-context").startswith("off")
    compiles = os.environ.get("DISTLINALG_SHARED_COMPILES", "0") == "1"
    assert patches.state("jax-shared-compiles") == "applied" if compiles else \
        patches.state("jax-shared-compiles").startswith("off")
    assert patches.state("xla-ynn-fusions") == distlinalg.YNN_FUSION
    from jax._src import dispatch
    from jax._src.interpreters import pxla

    wrapped = [pxla.MeshExecutable.create_cpp_call, dispatch.RuntimeTokenSet.get_token_input,
               pxla.ExecuteReplicated.__call__]
    # A second start-up (and a second application) wraps nothing twice.
    assert _runtime.start() == distlinalg.YNN_FUSION
    patches.apply_jax_patches()
    for before, after in zip(wrapped, [pxla.MeshExecutable.create_cpp_call, dispatch.RuntimeTokenSet.get_token_input,
                                       pxla.ExecuteReplicated.__call__]):
        assert after._distlinalg_original is before._distlinalg_original
        assert not hasattr(after._distlinalg_original, "_distlinalg_original")


def test_rows_name_known_libraries_and_render():
    names = [p.name for p in patches.TABLE]
    assert len(names) == len(set(names))
    assert {p.library for p in patches.TABLE} <= set(patches.CHECKED_VERSIONS) | {"xla", "openblas"}
    table = patches.markdown_table()
    for patch in patches.TABLE:
        assert f"| `{patch.name}` |" in table
    text = patches.table_text()
    assert all(f"  {name} [" in text for name in names)
    with pytest.raises(KeyError, match="no patch named"):
        patches.record("no-such-row", "applied")


@pytest.mark.parametrize("version, inside", [("0.10.2", True), ("0.12.0.1", True), ("0.11.0", True),
                                             ("0.13.0", False), ("0.9.1", False), ("0.100.0", False)])
def test_checked_release_lines(version, inside):
    assert patches.inside_checked("jax", version) is inside


def test_a_version_outside_the_checked_lines_warns_once_naming_it_and_its_rows(monkeypatch):
    monkeypatch.setitem(patches.CHECKED_VERSIONS, "jax", ("0.0",))
    monkeypatch.setattr(patches, "_WARNED", set())
    with pytest.warns(RuntimeWarning, match=r"jax \S+ is outside .*0\.0\.x.*jax-aot-fast-path.*jax-failed-token"):
        patches.warn_outside_checked("jax")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        patches.warn_outside_checked("jax")  # once per process


def test_a_target_that_is_gone_is_an_import_error_or_not_needed(monkeypatch):
    monkeypatch.setattr(patches, "_STATE", dict(patches._STATE))
    with pytest.raises(ImportError, match=r"jax-failed-token.*RuntimeTokenSet.get_token_input.*checked on jax"):
        patches.missing("jax-failed-token")
    assert patches.missing("jax-aot-fast-path") == "not needed: this JAX has no such fast path"
    assert patches.state("jax-aot-fast-path").startswith("not needed")


@pytest.mark.parametrize("switch", ["0", "1"])
def test_shared_mlir_context_is_opt_in_and_changes_no_result(switch):
    """DISTLINALG_SHARED_MLIR_CONTEXT=1: one MLIR context serves SHARED_CONTEXT_USES lowerings
    (per thread), then a fresh one; programs compiled from it (an MPI call among them, and an
    eager operation run by a lowering rule, which is lowered inside the outer lowering) compute
    what they compute without it. Off (the default): JAX's own contexts."""
    probe = (
        "import threading, jax, jax.numpy as jnp, numpy as np, distlinalg as dl\n"
        "from distlinalg._runtime import patches\n"
        "from jax._src.interpreters import mlir\n"
        "contexts = [mlir.make_ir_context() for _ in range(patches.SHARED_CONTEXT_USES + 1)]\n"
        "other = []\n"
        "t = threading.Thread(target=lambda: other.append(mlir.make_ir_context())); t.start(); t.join()\n"
        "same = all(c is contexts[0] for c in contexts[:-1]) and contexts[-1] is not contexts[0]\n"
        "values = [float(jax.jit(lambda x, k=k: dl.comm.allreduce(jnp.sin(x * k), 'sum').sum())(jnp.arange(3.0)))\n"
        "          for k in range(1, 2 * patches.SHARED_CONTEXT_USES)]\n"
        "expected = [float(np.sin(np.arange(3.0) * k).sum()) for k in range(1, 2 * patches.SHARED_CONTEXT_USES)]\n"
        "# A lowering rule that runs an eager operation (as lineax's do on concrete values): that\n"
        "# program is lowered inside the outer lowering, and gets a context of its own.\n"
        "from jax.extend.core import Primitive\n"
        "eager_inside = Primitive('eager_inside'); eager_inside.def_abstract_eval(lambda x: x)\n"
        "def lower(ctx, x):\n"
        "    k = float(jnp.ones((7, 5), jnp.int16).sum())\n"
        "    return mlir.lower_fun(lambda x: [x * k], multiple_results=True)(ctx, x)\n"
        "mlir.register_lowering(eager_inside, lower)\n"
        "values.append(float(jax.jit(lambda x: eager_inside.bind(x).sum())(jnp.arange(3.0))))\n"
        "expected.append(105.0)\n"
        "print(patches.state('jax-shared-mlir-context'), same, other[0] is not contexts[-1],\n"
        "      np.allclose(values, expected, rtol=1e-5, atol=1e-4), sep=' | ')\n"
    )
    env = dict(os.environ, DISTLINALG_SHARED_MLIR_CONTEXT=switch)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
                         env=env)
    assert out.returncode == 0, out.stderr
    state, same, per_thread, equal = (part.strip() for part in out.stdout.split("\n")[-2].split("|"))
    assert equal == "True", out.stdout
    if switch == "1" and state.startswith("not needed"):  # jax 0.12 reuses its contexts itself
        assert "reuses its MLIR contexts" in state, out.stdout
    elif switch == "1":
        assert (state, same, per_thread) == ("applied", "True", "True"), out.stdout
    else:
        assert state.startswith("off") and same == "False", out.stdout


SHARED_COMPILES_PROBE = """
import jax, jax.numpy as jnp, numpy as np
from mpi4py import MPI
import distlinalg as dl
from distlinalg._runtime import patches
# "compiled": JAX's compile step (which a load from the persistent cache is part of);
# "loaded": its cache hits.
counts = {"compiled": 0, "loaded": 0}
def on_duration(event, duration, **_):
    if event == "/jax/core/compile/backend_compile_duration":
        counts["compiled"] += 1
def on_event(event, **_):
    if event == "/jax/compilation_cache/cache_hits":
        counts["loaded"] += 1
jax.monitoring.register_event_duration_secs_listener(on_duration)
jax.monitoring.register_event_listener(on_event)
x = np.arange(4.0, dtype=np.float32)
local = [float(jax.jit(lambda x, k=k: (jnp.cos(x) * k).sum())(x)) for k in range(1, 9)]
mine = dict(counts)  # programs without an MPI call
# Programs with an MPI call name the communicator by its key, not by this rank's handle
# (which MPICH numbers per process), so they are the same module on every rank too, and a
# program one rank compiled runs on the other rank's own communicator.
total = [float(jax.jit(lambda x, k=k: dl.comm.allreduce(jnp.cos(x) * k, "sum").sum())(x)) for k in range(1, 4)]
mine["mpi compiled"] = counts["compiled"] - mine["compiled"]
mine["mpi loaded"] = counts["loaded"] - mine["loaded"]
everyone = MPI.COMM_WORLD.allgather(mine)
expected = [float(np.cos(np.arange(4.0)).sum()) * k for k in range(1, 9)]
ok = np.allclose(local, expected, rtol=1e-5) and np.allclose(total, [MPI.COMM_WORLD.Get_size() * e for e in expected[:3]],
                                                            rtol=1e-5)
if MPI.COMM_WORLD.Get_rank() == 0:
    print(patches.state("jax-shared-compiles"), "|", ok, "|", sum(c["loaded"] for c in everyone), "|",
          [c["compiled"] for c in everyone], "|", sum(c["mpi loaded"] for c in everyone), "|",
          [c["mpi compiled"] for c in everyone])
"""


@pytest.mark.parametrize("switch", ["0", "1"])
def test_shared_compiles_compile_each_program_once_per_node(tmp_path, switch):
    """DISTLINALG_SHARED_COMPILES=1 with JAX's persistent cache: of 2 ranks running the same
    programs, exactly one compiles each (the other loads it), and the results are right;
    off (the default), every rank compiles its own."""
    from run_mpi import find_mpiexec

    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTLINALG_SHARED_COMPILES")}
    env.update(DISTLINALG_SHARED_COMPILES=switch, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    out = subprocess.run(find_mpiexec() + ["-n", "2", sys.executable, "-c", SHARED_COMPILES_PROBE],
                         capture_output=True, text=True, timeout=300, cwd=REPO_ROOT, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    line = out.stdout.strip().splitlines()[-1]
    state, ok, loaded, programs, mpi_loaded, mpi_programs = (part.strip() for part in line.split("|"))
    assert ok == "True", line
    programs = [int(n) for n in programs.strip("[]").split(",")]
    mpi_programs = [int(n) for n in mpi_programs.strip("[]").split(",")]
    assert programs[0] == programs[1] == 8 and mpi_programs[0] == mpi_programs[1] == 3, line
    if switch == "1":  # every program compiled by one rank and loaded by the other: 2·8 − 8 compiles
        assert state == "applied" and int(loaded) == 8 and int(mpi_loaded) == 3, line
    else:
        assert state.startswith("off"), line


def test_adapters_change_nothing_at_import():
    """`import distlinalg.lineax` leaves optimistix.least_squares alone (and records it so);
    install_least_squares() replaces it; importing distlinalg.netket patches no NetKet code
    until a distributed state is made."""
    pytest.importorskip("optimistix")
    probe = (
        "import optimistix as optx, distlinalg.lineax as dlx\n"
        "from distlinalg._runtime import patches\n"
        "own = optx.least_squares\n"
        "print(own is not dlx.least_squares, patches.state('optimistix-least-squares'))\n"
        "dlx.install_least_squares()\n"
        "print(optx.least_squares is dlx.least_squares, patches.state('optimistix-least-squares'))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["True not applied", "True applied"], out.stdout


def test_every_environment_switch_is_in_the_docs_table():
    """docs/cluster.md's table lists every DISTLINALG_* variable the package, the extension
    and the build read."""
    sources = [*REPO_ROOT.joinpath("distlinalg").rglob("*.py"), *REPO_ROOT.joinpath("csrc").glob("*"),
               REPO_ROOT / "CMakeLists.txt", REPO_ROOT / "Makefile"]
    read = set()
    for path in sources:
        read |= set(re.findall(r"DISTLINALG_[A-Z_]*[A-Z]", path.read_text(errors="replace")))
    documented = set(re.findall(r"^\| `(DISTLINALG_[A-Z_]+)", (REPO_ROOT / "docs" / "cluster.md").read_text(), re.M))
    assert read - documented == set(), sorted(read - documented)
