"""Every change distlinalg makes to another library, in one table, with the versions it was checked on.

distlinalg needs a few things that JAX, XLA, OpenBLAS, NetKet and optimistix
offer no public hook for. Each is a row of :data:`TABLE`: what is replaced
or set, why, and the versions it was checked on. The JAX rows are applied by
:func:`apply_jax_patches` (from ``distlinalg._runtime.start``, at ``import
distlinalg``); the XLA and OpenBLAS settings by ``xla_flags`` and ``cpu``
at the same start-up; the NetKet rows by ``distlinalg.netket`` when its
first distributed state is made; lineax's by ``import distlinalg.lineax``;
optimistix's only by an explicit ``distlinalg.lineax.install_least_squares()``.
Whoever applies a row records what happened (:func:`record`), and
``python -m distlinalg`` prints the table with that state.

Outside the checked versions a row warns once, naming the version and the
row (:func:`warn_outside_checked`). A row whose target is gone raises a
clear ImportError naming it, unless the row says that a library without the
target does not need it (``absent_means``).

The JAX rows' code is below the table; the others live beside the code they
serve (``netket/_paths.py``, ``lineax/_effects.py``, ``lineax/_optimistix.py``,
``_runtime/xla_flags.py``, ``_runtime/cpu.py``).
"""

from __future__ import annotations

import copy
import functools
import importlib.metadata
import warnings
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from jax._src import dispatch as _dispatch  # private
from jax._src import effects as _effects  # private

__all__ = ["Patch", "TABLE", "CHECKED_VERSIONS", "apply_jax_patches", "record", "state", "table_text",
           "markdown_table", "warn_outside_checked", "register_ordered_effect", "mark_mpi_module", "share_mlir_contexts",
           "share_compiles_between_ranks",
           "MPI_MODULE_ATTRIBUTE", "compile_options_for", "disable_ynn_per_compile"]

# The release lines each library was checked on (a version is inside when it starts with one of
# them: "0.10" takes 0.10.2; "3.23" takes 3.23.0). CI runs jax 0.10.2 (Python 3.11, with NetKet
# 3.23, lineax 0.1.1, optimistix 0.1.0) and the newest jax PyPI serves for Python 3.12 (0.12);
# jax 0.11 ran on an H100.
CHECKED_VERSIONS: dict[str, tuple[str, ...]] = {
    "jax": ("0.10", "0.11", "0.12"),
    "jaxlib": ("0.10", "0.11", "0.12"),
    "netket": ("3.23",),
    "lineax": ("0.1",),
    "equinox": ("0.13",),
    "optimistix": ("0.1",),
}


# Lowerings one shared MLIR context serves before a fresh one is made (row jax-shared-mlir-context).
SHARED_CONTEXT_USES = 64


@dataclass(frozen=True)
class Patch:
    """One row: `target` (a dotted name or a setting) of `library` is replaced or set, and why.

    `applied_by` names the distlinalg code that applies it; `absent_means` is None when a
    library without the target cannot run distlinalg correctly (ImportError), else what its
    absence means (the row is then recorded as not needed).
    """

    name: str
    library: str
    target: str
    action: str
    why: str
    applied_by: str
    absent_means: str | None = None


TABLE: tuple[Patch, ...] = (
    Patch("jax-effect-registries", "jax", "jax._src.effects: ordered, lowerable, control-flow, custom-derivative, "
          "remat and partial-eval-kept effect sets", "registers distlinalg's MPI effect in each",
          "collectives run in program order, inside lax control flow, custom rules and remat, and stay in the "
          "linear program when linearizing (a tangent send whose result this rank drops still runs)",
          "patches.register_ordered_effect"),
    Patch("jax-aot-fast-path", "jax", "jax._src.interpreters.pxla.MeshExecutable.create_cpp_call",
          "no C++ fast path for programs with an ordered effect",
          "jit(f).lower(x).compile() called twice failed: the fast path passes the arguments only, not the "
          "effect token (jit's own fast path already leaves ordered programs out)",
          "patches.apply_jax_patches", absent_means="this JAX has no such fast path"),
    Patch("jax-scan-known-hoisting", "jax", "jax._src.lax.control_flow.loops._scan_known_hoisting",
          "no loop-invariant hoisting out of the known half of a linearized scan that holds an MPI call",
          "linearizing a scan, JAX evaluates once, outside the loop, every known computation that depends on "
          "loop constants only; an MPI call among them (a receive into a constant template) then ran once "
          "instead of once per iteration while its partner's ran every time (issue 67: mpi4jax's shallow-water "
          "loop under jax.grad)", "patches.apply_jax_patches"),
    Patch("jax-failed-token", "jax", "jax._src.dispatch.RuntimeTokenSet.get_token_input",
          "a failed program's MPI token is dropped at the next dispatch",
          "on a GPU, one caught cross-rank mismatch left its error in the effect token, and every later "
          "distlinalg program raised it again (jax 0.11, H100)", "patches.apply_jax_patches"),
    Patch("jax-programs-without-results", "jax", "jax._src.interpreters.pxla.ExecuteReplicated.__call__",
          "a program with the MPI effect and no array result waits for its token",
          "on a GPU, a mismatch in jit(barrier) or a lone send raised on the ranks whose programs had results "
          "and on no other (issue 40)", "patches.apply_jax_patches"),
    Patch("jax-gpu-compile-options", "jax", "jax._src.compiler.compile_or_get_cached",
          "modules holding an MPI call compile for GPUs with xla_gpu_enable_dynamic_slice_fusion off",
          "XLA's GPU dynamic slice fusion wraps a custom call with a token operand and its cost analysis "
          "aborts the process (jaxlib 0.11-0.12, CUDA: distributed CG on laplacian_2d)",
          "patches.apply_jax_patches"),
    Patch("jax-shared-mlir-context", "jax", "jax._src.interpreters.mlir.make_ir_context",
          "opt-in (DISTLINALG_SHARED_MLIR_CONTEXT=1; the test worlds set it): one MLIR context per thread, "
          f"reused for {SHARED_CONTEXT_USES} lowerings",
          "JAX makes a context and loads every dialect into it for each program it lowers: 10 ms of the "
          "~20 ms a small program's lowering takes on CPU (jax 0.10.2), the lowering half of the test "
          "suite's. Off by default: a shared context keeps the uniqued constants of its programs until the "
          "last of them is freed", "patches.share_mlir_contexts",
          absent_means="this JAX makes its MLIR contexts another way: nothing shared (jax 0.12 reuses one "
          "10 times per thread itself)"),
    Patch("jax-shared-compiles", "jax", "jax._src.compiler._cache_read and _compile_and_write_cache",
          "opt-in (DISTLINALG_SHARED_COMPILES=1, with JAX's persistent compilation cache on; the test worlds "
          "set it): a program missing from the cache is compiled by one rank under a lock of its key, and "
          "the node's other ranks wait and load it; reads take the key's lock shared",
          "every rank compiles the same programs: on a node of P ranks XLA compiles each one P times (3 ranks "
          "on 2 cores: test_solvers.py 226 s -> 148 s, measured 2026-12-02). JAX writes a cache entry in place "
          "and shares compiles only between hosts of jax.distributed",
          "patches.share_compiles_between_ranks",
          absent_means="this JAX compiles through other functions: every rank compiles its own"),
    Patch("xla-ynn-fusions", "xla", "XLA_FLAGS --xla_cpu_experimental_ynn_fusion_type",
          "set to LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT (YNN's reduce fusions off, its matmuls kept)",
          "jaxlib 0.10.2's YNN reduce fusions miscompile a reduction of a dot (jnp.sum((X @ W) ** 2, 1)), "
          "which a solve with x0=None hits; DISTLINALG_YNN_FUSION=1 keeps XLA's default",
          "xla_flags.disable_ynn_fusion", absent_means="this jaxlib has no YNN fusions"),
    Patch("jax-ynn-per-compile", "jax", "jax._src.compiler.get_compile_options",
          "the YNN flag above added to every later CPU compilation",
          "only when JAX's backend started before distlinalg was imported (XLA_FLAGS is read once)",
          "xla_flags.disable_ynn_fusion", absent_means="the YNN flag is then left to the user"),
    Patch("openblas-threads", "openblas", "openblas_set_num_threads / OPENBLAS_NUM_THREADS",
          "max(1, cores // ranks) threads per rank when unbound ranks share a node",
          "every rank's OpenBLAS pool spun on the cores the others needed: a 288 x 288 SR solve took "
          "40-130 ms instead of 4-6; DISTLINALG_CPU_AFFINITY=none leaves it alone", "cpu.partition_cores",
          absent_means="no OpenBLAS loaded: nothing to set"),
    Patch("netket-qgt-constructors", "netket", "netket.optimizer.qgt.QGTJacobianDense, QGTJacobianPyTree, "
          "QGTOnTheFly (the function in their partial_from_kwargs closure)",
          "dispatch to the distributed QGT for a distlinalg.netket.MCState",
          "NetKet 3.19+ has no MPI: its QGTs read this rank's samples only, and offer no hook",
          "netket._paths.install"),
    Patch("netket-sr-lhs", "netket", "netket.optimizer.SR.lhs_constructor",
          "the distributed QGT for a distributed state", "as above, for nk.optimizer.SR",
          "netket._paths.install"),
    Patch("netket-vmc-sr-step", "netket", "netket.driver.VMC_SR.compute_loss_and_update",
          "the distributed step on more than one rank", "VMC_SR forms its matrices from this rank's samples",
          "netket._paths.install"),
    Patch("netket-driver-guard", "netket", "netket._src.driver.abstract_variational_driver.AbstractDriver.__init__",
          "raises for a driver whose step is not distributed",
          "TDVP, Infidelity_SR and others would compute from one rank's samples, silently",
          "netket._paths.install"),
    Patch("lineax-solve-effect", "lineax", "lineax._solve.linear_solve_p and equinox's _vprim_p abstract "
          "evaluation", "declares the MPI effect of the solve it runs",
          "lineax lowers the solve by re-tracing it with the equation's tokens; without the effect its "
          "collectives were unordered with the program's others (issue 57: Dogleg aborted at 2 ranks)",
          "lineax._effects.install"),
    Patch("optimistix-least-squares", "optimistix", "optimistix.least_squares",
          "distlinalg.lineax.least_squares (global solvers for distributed residuals)",
          "only by an explicit distlinalg.lineax.install_least_squares(); importing distlinalg.lineax "
          "changes nothing in optimistix", "lineax._optimistix.install_least_squares"),
)

_BY_NAME = {patch.name: patch for patch in TABLE}
_STATE: dict[str, str] = {}
_WARNED: set[str] = set()


def record(name: str, what: str) -> None:
    """Record what became of row `name` ("applied", "not needed: ...", "kept: ...")."""
    if name not in _BY_NAME:
        raise KeyError(f"distlinalg: no patch named {name!r} in the table")
    _STATE[name] = what


def state(name: str) -> str:
    """What became of row `name` in this process ("not applied" until its code ran)."""
    return _STATE.get(name, "not applied")


def missing(name: str, detail: str = "") -> str:
    """Row `name`'s target is not in the installed library: record it as not needed, or raise ImportError."""
    patch = _BY_NAME[name]
    if patch.absent_means is not None:
        record(name, f"not needed: {patch.absent_means}")
        return state(name)
    raise ImportError(
        f"distlinalg: cannot apply its patch {name!r}: {patch.target} is not in {patch.library} "
        f"{_version(patch.library) or '(version unknown)'}{': ' + detail if detail else ''}. It was checked on "
        f"{patch.library} {', '.join(CHECKED_VERSIONS.get(patch.library, ('?',)))}.x; why it is needed: {patch.why}")


def _version(library: str) -> str | None:
    try:
        return importlib.metadata.version(library)
    except importlib.metadata.PackageNotFoundError:
        return None


def inside_checked(library: str, version: str) -> bool:
    """Whether `version` of `library` is on one of its checked release lines."""
    lines = CHECKED_VERSIONS.get(library)
    if not lines:
        return True
    return any(version == line or version.startswith(line + ".") for line in lines)


def warn_outside_checked(library: str) -> None:
    """Warn once when the installed `library` is outside its checked versions, naming its patches."""
    version = _version(library)
    if version is None or library in _WARNED or inside_checked(library, version):
        return
    _WARNED.add(library)
    names = ", ".join(p.name for p in TABLE if p.library == library) or "none"
    warnings.warn(
        f"distlinalg: {library} {version} is outside the versions distlinalg was checked on "
        f"({', '.join(CHECKED_VERSIONS[library])}.x); its patches of {library} ({names}) may not hold. "
        "`python -m distlinalg` lists them.", RuntimeWarning, stacklevel=3)


def table_text() -> str:
    """The table with this process's state, one block per row (for ``python -m distlinalg``)."""
    lines = []
    for patch in TABLE:
        version = _version(patch.library) if patch.library not in ("xla", "openblas") else None
        checked = CHECKED_VERSIONS.get(patch.library)
        where = f" {version}" if version else ""
        if version and checked and not inside_checked(patch.library, version):
            where += f" (outside the checked {', '.join(checked)}.x)"
        lines.append(f"  {patch.name} [{patch.library}{where}]: {state(patch.name)}")
        lines.append(f"      {patch.target}: {patch.action}")
    return "\n".join(lines)


def markdown_table() -> str:
    """The table as Markdown (the docs render it: docs/runtime.md)."""
    rows = ["| patch | library (checked on) | what is replaced or set | why |", "|---|---|---|---|"]
    for patch in TABLE:
        checked = ", ".join(f"{line}.x" for line in CHECKED_VERSIONS.get(patch.library, ())) or "any"
        rows.append(f"| `{patch.name}` | {patch.library} ({checked}) | `{patch.target}`: {patch.action} | "
                    f"{patch.why}{'' if patch.absent_means is None else f'. Where absent: {patch.absent_means}'} |")
    return "\n".join(rows)


# ---------------------------------------------------------------------------
# The JAX rows.

# distlinalg's ordered effect types, which the token and program patches serve.
_OUR_EFFECTS: list[type] = []


def register_ordered_effect(effect_type: type) -> None:
    """Declare an ordered effect that control flow, remat and custom rules accept (row
    ``jax-effect-registries``).

    Ordered: XLA threads a token through every primitive carrying it, so the
    collectives run in program order and are never dropped as dead code.
    Kept in partial evaluation: when linearizing, a tangent collective whose
    result does not reach the outputs on this rank (a send, a value a rank
    discards) stays in the linear program, so its transpose still runs here
    while the other ranks' transposes wait for it.
    """
    for registry in ("ordered_effects", "lowerable_effects", "control_flow_allowed_effects",
                     "custom_derivatives_allowed_effects", "remat_allowed_effects", "partial_eval_kept_effects"):
        getattr(_effects, registry).add_type(effect_type)
    if effect_type not in _OUR_EFFECTS:
        _OUR_EFFECTS.append(effect_type)
    record("jax-effect-registries", "applied")


def _ours(effect: Any) -> bool:
    return isinstance(effect, tuple(_OUR_EFFECTS))


def _replace(owner: Any, attribute: str, make: Any) -> bool:
    """``owner.attribute = make(original)``, once (the replacement keeps the original)."""
    current = getattr(owner, attribute, None)
    if current is None:
        return False
    original = getattr(current, "_distlinalg_original", current)
    replacement = make(original)
    replacement._distlinalg_original = original
    setattr(owner, attribute, replacement)
    return True


def _keep_ordered_programs_off_the_aot_fast_path() -> None:
    """Row ``jax-aot-fast-path``: ``jax.jit(f).lower(x).compile()`` returns a ``Compiled``
    whose calls, from the second on, take a C++ fast path that passes the arguments only;
    a program with an ordered effect also takes the effect's runtime token ("Execution
    supplied 1 arguments but compiled program expected 2", jax 0.10.2). Such programs take
    the Python path that threads the token, as under jit."""
    from jax._src.interpreters import pxla  # private

    def make(original: Any) -> Any:
        def create_cpp_call(self: Any, params: Any) -> Any:
            if getattr(getattr(self, "unsafe_call", None), "ordered_effects", None):
                return None
            return original(self, params)

        return create_cpp_call

    if _replace(getattr(pxla, "MeshExecutable", None), "create_cpp_call", make):
        record("jax-aot-fast-path", "applied")
    else:
        missing("jax-aot-fast-path")


def _keep_mpi_calls_in_linearized_scans() -> None:
    """Row ``jax-scan-known-hoisting``: when JAX partially evaluates a scan (linearize, grad,
    remat), it re-traces the known half of the body with the loop constants known and hoists
    what depends on them alone out of the loop, evaluating it once. An MPI call is a
    computation too, but running it once instead of once per iteration changes the messages
    (its partner, whose call depends on the carry, still posts one per iteration). A known
    half that holds an MPI call is left as it is (JAX's own way to switch the hoisting off)."""
    from jax._src.lax.control_flow import loops  # private

    def make(original: Any) -> Any:
        # (jaxpr_known, known_consts, num_res) on jax 0.10; (..., num_ures, num_sres) on 0.12,
        # where only the first count's residuals may be hoisted.
        def _scan_known_hoisting(jaxpr_known: Any, known_consts: Any, num_res: int, *counts: int) -> Any:
            if any(_ours(effect) for effect in jaxpr_known.effects):
                return jaxpr_known, known_consts, [False] * num_res, []
            return original(jaxpr_known, known_consts, num_res, *counts)

        return _scan_known_hoisting

    if _replace(loops, "_scan_known_hoisting", make):
        record("jax-scan-known-hoisting", "applied")
    else:
        missing("jax-scan-known-hoisting")


def _recover_failed_tokens() -> None:
    """Row ``jax-failed-token``: JAX hands each ordered effect's output token from one
    program to the next and blocks on it at dispatch. On a backend that runs programs
    asynchronously (GPU), a program whose handler returned an error leaves it in its
    token, and every later program with the effect would raise it again: one caught
    mismatch ended all communication. The failed program's outputs carry its error to
    the caller; the next dispatch drops the failed token and starts a fresh chain, as the
    CPU backend, where such errors are raised synchronously, behaves."""
    token_set = getattr(_dispatch, "RuntimeTokenSet", None)

    def make(original: Any) -> Any:
        def get_token_input(self: Any, eff: Any, devices: Any) -> Any:
            try:
                return original(self, eff, devices)
            except jax.errors.JaxRuntimeError:
                if not _ours(eff):
                    raise
                self.current_tokens.pop(eff, None)
                return original(self, eff, devices)

        return get_token_input

    if _replace(token_set, "get_token_input", make):
        record("jax-failed-token", "applied")
    else:
        missing("jax-failed-token")


def _wait_for_programs_without_results() -> None:
    """Row ``jax-programs-without-results``: a program's error reaches the caller through
    its results; one with none (``jax.jit(barrier)``, a lone ``send``) has only its
    effect token, so on a GPU the call returned while the program failed, and a mismatch
    raised on some ranks only. Such a program now waits for its token before the call
    returns, so its error is raised there on every rank, as on the CPU."""
    from jax._src.interpreters import pxla  # private

    def make(original: Any) -> Any:
        def __call__(self: Any, *args: Any) -> Any:
            out = original(self, *args)
            ours = [eff for eff in (getattr(self, "ordered_effects", None) or ()) if _ours(eff)]
            if ours and not any(isinstance(leaf, jax.Array) for leaf in jax.tree_util.tree_leaves(out)):
                from .jax_names import wait_for_effect_token

                for eff in ours:
                    wait_for_effect_token(eff)
            return out

        return __call__

    if _replace(getattr(pxla, "ExecuteReplicated", None), "__call__", make):
        record("jax-programs-without-results", "applied")
    else:
        missing("jax-programs-without-results")


# Row jax-gpu-compile-options. XLA's GPU "dynamic slice fusion" wraps a custom call whose
# operand is a slice of a larger buffer (the halo row x[-n:] that a sharded stencil sends)
# into a custom fusion; with the MPI token among the call's operands and results, that
# fusion has a token parameter and a (token, array) result, and GPU cost analysis aborts
# the process (shape_util.cc: "Check failed: shape.IsArray() || shape.IsTuple()"). The
# lowering marks every module that holds a distlinalg MPI call, and such modules are
# compiled for GPUs with that pass off; no other program's options change.
MPI_MODULE_ATTRIBUTE = "distlinalg.mpi"
GPU_OPTIONS_FOR_MPI = (("xla_gpu_enable_dynamic_slice_fusion", False),)


def mark_mpi_module(ctx: Any) -> None:
    """Mark the module being lowered as holding an ordered MPI custom call."""
    from jax._src.lib.mlir import ir  # private

    attributes = ctx.module_context.module.operation.attributes
    if MPI_MODULE_ATTRIBUTE not in attributes:
        attributes[MPI_MODULE_ATTRIBUTE] = ir.UnitAttr.get()


def _is_gpu(backend: Any, devices: Any) -> bool:
    platform = getattr(backend, "platform", None)
    if platform is None:
        try:
            platform = next(iter(np.asarray(devices).flat)).platform
        except (StopIteration, AttributeError, TypeError):
            return False
    return str(platform).lower() in ("cuda", "rocm", "gpu")


def compile_options_for(backend: Any, devices: Any, computation: Any, compile_options: Any) -> Any:
    """`compile_options`, plus ``GPU_OPTIONS_FOR_MPI`` (in a copy) for a marked module
    compiled for a GPU; options the caller set by name are kept."""
    if not (_is_gpu(backend, devices) and MPI_MODULE_ATTRIBUTE in computation.operation.attributes):
        return compile_options
    given = list(compile_options.env_option_overrides)
    named = {name for name, _ in given}
    extra = [(name, value) for name, value in GPU_OPTIONS_FOR_MPI if name not in named]
    if not extra:
        return compile_options
    compile_options = copy.deepcopy(compile_options)
    compile_options.env_option_overrides = given + extra
    return compile_options


def _wrap_jax_compiler(name: str, wrap: Any) -> bool:
    """Replace ``jax._src.compiler.<name>`` by ``wrap(original)``, once; False where this JAX
    has no such function."""
    from jax._src import compiler  # private

    return _replace(compiler, name, lambda original: functools.wraps(original)(wrap(original)))


def _route_gpu_compilations() -> None:
    def wrap(original: Any) -> Any:
        def compile_or_get_cached(backend: Any, computation: Any, devices: Any, compile_options: Any,
                                  *args: Any, **kwargs: Any) -> Any:
            compile_options = compile_options_for(backend, devices, computation, compile_options)
            return original(backend, computation, devices, compile_options, *args, **kwargs)

        return compile_or_get_cached

    if _wrap_jax_compiler("compile_or_get_cached", wrap):
        record("jax-gpu-compile-options", "applied")
    else:
        missing("jax-gpu-compile-options")


def disable_ynn_per_compile(flag: str, value: str) -> bool:
    """Row ``jax-ynn-per-compile``: add ``flag=value`` to the options of every later CPU
    compilation (as ``jax.jit(f, compiler_options={flag: value})`` on each jit; an explicit
    entry for the flag wins). Programs compiled before hold no distlinalg call."""

    def wrap(original: Any) -> Any:
        def get_compile_options(*args: Any, **kwargs: Any) -> Any:
            backend = kwargs.get("backend")
            if backend is None or getattr(backend, "platform", "cpu") == "cpu":
                overrides = dict(kwargs.get("env_options_overrides") or {})
                overrides.setdefault(flag, value)
                kwargs["env_options_overrides"] = overrides
            return original(*args, **kwargs)

        return get_compile_options

    if not _wrap_jax_compiler("get_compile_options", wrap):
        missing("jax-ynn-per-compile")
        return False
    record("jax-ynn-per-compile", "applied")
    return True


def share_mlir_contexts() -> None:
    """Row ``jax-shared-mlir-context`` (opt-in): ``make_ir_context`` hands each thread one
    context for ``SHARED_CONTEXT_USES`` lowerings, then a fresh one. A program's module
    lives in the context it was lowered in whatever else the context holds, so nothing a
    program computes changes; what changes is that a context, and the constants uniqued in
    it, is freed only with the last module of its lowerings."""
    from .env import switch

    if not switch("DISTLINALG_SHARED_MLIR_CONTEXT", False):
        record("jax-shared-mlir-context", "off (DISTLINALG_SHARED_MLIR_CONTEXT=1 turns it on)")
        return
    from jax._src.interpreters import mlir  # private

    if not callable(getattr(mlir, "make_ir_context", None)):
        missing("jax-shared-mlir-context")
        return
    if hasattr(mlir, "_thread_local_context"):  # jax 0.12 reuses a context 10 times per thread itself
        record("jax-shared-mlir-context", "not needed: this JAX reuses its MLIR contexts per thread")
        return
    import threading

    from jax._src.lib.mlir import ir  # private

    per_thread = threading.local()

    def inside_a_lowering() -> bool:
        """Whether this thread is inside a lowering (a context is entered): an eager
        operation run by a lowering rule (lineax's, on concrete values) is lowered then,
        and its module made in the outer lowering's context would be built at the outer
        insertion point, inside the outer module."""
        try:
            return ir.Context.current is not None  # None (or, in some MLIR builds, a ValueError) outside
        except ValueError:
            return False

    def make(original: Any) -> Any:
        def make_ir_context() -> Any:
            if inside_a_lowering():
                return original()
            uses = getattr(per_thread, "uses", SHARED_CONTEXT_USES)
            if uses >= SHARED_CONTEXT_USES:
                per_thread.context, uses = original(), 0
            per_thread.uses = uses + 1
            return per_thread.context

        return make_ir_context

    _replace(mlir, "make_ir_context", make)
    record("jax-shared-mlir-context", "applied")


def share_compiles_between_ranks() -> None:
    """Row ``jax-shared-compiles`` (opt-in). With JAX's persistent cache on, a rank that
    misses it takes an exclusive lock of the program's key (a file beside the cache), looks
    again, and compiles and writes the entry only if it is still missing; a rank reading an
    entry takes the key's lock shared, so it never reads one being written. The ranks of a
    node then compile each program once. Every rank writes (JAX writes from process 0,
    which every MPI rank is to JAX), so the cache's minimum compile time applies to all."""
    from .env import switch

    if not switch("DISTLINALG_SHARED_COMPILES", False):
        record("jax-shared-compiles", "off (DISTLINALG_SHARED_COMPILES=1 turns it on)")
        return
    from jax._src import compiler, monitoring  # private

    if not (callable(getattr(compiler, "_cache_read", None))
            and callable(getattr(compiler, "_compile_and_write_cache", None))):
        missing("jax-shared-compiles")
        return
    import contextlib
    import fcntl
    import inspect
    import os

    @contextlib.contextmanager
    def key_lock(cache_key: str, exclusive: bool) -> Any:
        directory = jax.config.jax_compilation_cache_dir
        if not directory or "://" in str(directory):  # a remote cache: no file locks
            yield
            return
        locks = os.path.join(directory, "distlinalg-locks")
        os.makedirs(locks, exist_ok=True)
        fd = os.open(os.path.join(locks, f"{cache_key}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)  # releases the lock

    read = compiler._cache_read
    read = getattr(read, "_distlinalg_original", read)
    # jax 0.12 passes the host callbacks to the read as well (0.10: five arguments).
    read_takes_callbacks = "host_callbacks" in inspect.signature(read).parameters

    def make_read(original: Any) -> Any:
        def _cache_read(module_name: str, cache_key: str, *args: Any, **kwargs: Any) -> Any:
            with key_lock(cache_key, exclusive=False):
                return original(module_name, cache_key, *args, **kwargs)

        return _cache_read

    def make_compile(original: Any) -> Any:
        def _compile_and_write_cache(backend: Any, computation: Any, executable_devices: Any, compile_options: Any,
                                     host_callbacks: Any, module_name: str, cache_key: str, *args: Any,
                                     **kwargs: Any) -> Any:
            with key_lock(cache_key, exclusive=True):
                extra = (host_callbacks,) if read_takes_callbacks else ()
                executable, _ = read(module_name, cache_key, compile_options, backend, executable_devices, *extra)
                if executable is not None:  # another rank compiled it while this one waited
                    monitoring.record_event("/jax/compilation_cache/cache_hits")
                    return executable
                return original(backend, computation, executable_devices, compile_options, host_callbacks,
                                module_name, cache_key, *args, **kwargs)

        return _compile_and_write_cache

    _replace(compiler, "_cache_read", make_read)
    _replace(compiler, "_compile_and_write_cache", make_compile)
    record("jax-shared-compiles", "applied")


def apply_jax_patches() -> None:
    """Apply the JAX rows (idempotent); warn once if JAX is outside its checked versions."""
    warn_outside_checked("jax")
    warn_outside_checked("jaxlib")
    _keep_ordered_programs_off_the_aot_fast_path()
    _keep_mpi_calls_in_linearized_scans()
    _recover_failed_tokens()
    _wait_for_programs_without_results()
    _route_gpu_compilations()
    share_mlir_contexts()
    share_compiles_between_ranks()
