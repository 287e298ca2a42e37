"""Every use of JAX API outside its stable public surface, in one place.

Checked against jax/jaxlib 0.10.2 (Python 3.11, this project's CPU machines)
and 0.12 (Python 3.12, as on the GPU machines). When JAX moves one of these,
this is the only file to change.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import jax
import numpy as np
from jax.interpreters import ad, batching, mlir  # semi-public modules

from jax._src import effects as _effects  # private
from jax._src import core as _core  # private
from jax._src import dispatch as _dispatch  # private
from jax._src import dtypes as _dtypes  # private
from jax._src.lax import lax as _lax_internal  # private
from jax._src.lib.mlir.dialects import hlo as _hlo  # private

from ._env import switch

__all__ = [
    "Effect",
    "register_ordered_effect",
    "token_in",
    "set_token_out",
    "abstract_token",
    "ShapedArray",
    "not_mapped",
    "ad",
    "batching",
    "mlir",
    "convert_element_type",
    "is_weakly_typed",
]

Effect = _effects.Effect
ShapedArray = _core.ShapedArray
abstract_token = _core.abstract_token

def convert_element_type(x: Any, dtype: Any, weak_type: bool) -> Any:
    """`x` as `dtype`, weakly typed or not (the public astype always makes it strong).

    The solvers keep a weakly typed right-hand side (a Python float) weak in
    the solution, as jax.scipy.sparse.linalg does.
    """
    return _lax_internal._convert_element_type(x, dtype, weak_type)


def is_weakly_typed(x: Any) -> bool:
    """Whether `x` has a weak dtype (a Python scalar's, which yields in promotion)."""
    return bool(_dtypes.is_weakly_typed(x))


# The batch dimension of an unbatched operand in a batching rule: None in JAX
# 0.10 (batching.NotMapped = type(None)); older releases exported not_mapped.
not_mapped = getattr(batching, "not_mapped", None)


def register_ordered_effect(effect_type: type) -> None:
    """Declare an ordered effect that control flow, remat and custom rules accept.

    Ordered: XLA threads a token through every primitive carrying it, so the
    collectives run in program order and are never dropped as dead code.
    Kept in partial evaluation: when linearizing, a tangent collective whose
    result does not reach the outputs on this rank (a send, a value a rank
    discards) stays in the linear program, so its transpose still runs here
    while the other ranks' transposes wait for it.
    """
    _effects.ordered_effects.add_type(effect_type)
    _effects.lowerable_effects.add_type(effect_type)
    _effects.control_flow_allowed_effects.add_type(effect_type)
    _effects.custom_derivatives_allowed_effects.add_type(effect_type)
    _effects.remat_allowed_effects.add_type(effect_type)
    _effects.partial_eval_kept_effects.add_type(effect_type)
    _recover_failed_tokens_of(effect_type)
    _wait_for_programs_without_results(effect_type)
    _keep_ordered_effects_off_the_aot_fast_path()


def _keep_ordered_effects_off_the_aot_fast_path() -> None:
    """Let an ahead-of-time compiled program with an ordered effect run more than once.

    ``jax.jit(f).lower(x).compile()`` returns a ``Compiled`` whose calls go
    through ``MeshExecutable.create_cpp_call``: from the second call on a C++
    fast path that passes the arguments only. A program with an ordered
    effect also takes the effect's runtime token, so its second call failed
    with "Execution supplied 1 arguments but compiled program expected 2"
    (jax 0.10.2, any distlinalg operation). jit's own fast path leaves out
    programs with ordered effects (``pjit._get_fastpath_data``); JAX's
    ordered callbacks escape the AOT one only because they also have host
    callbacks. Ordered programs compiled ahead of time now take the Python
    path that threads the token, as under jit.
    """
    from jax._src.interpreters import pxla  # private

    executable = getattr(pxla, "MeshExecutable", None)
    current = getattr(executable, "create_cpp_call", None)
    if current is None:  # a JAX without that fast path
        return
    original = getattr(current, "_distlinalg_original", current)

    def create_cpp_call(self: Any, params: Any) -> Any:
        if getattr(getattr(self, "unsafe_call", None), "ordered_effects", None):
            return None
        return original(self, params)

    create_cpp_call._distlinalg_original = original  # type: ignore[attr-defined]
    executable.create_cpp_call = create_cpp_call


def _recover_failed_tokens_of(effect_type: type) -> None:
    """Let a program with this effect run after an earlier one failed.

    JAX hands each ordered effect's output token from one program to the
    next, and dispatching a program first blocks on the token it receives
    (``dispatch.RuntimeTokenSet.get_token_input``). On a backend that runs
    programs asynchronously (GPU), a program whose handler returned an error,
    e.g. a cross-rank mismatch found by the signature check, leaves that
    error in its output token: every later program with the effect would
    raise the old error at dispatch, so one caught mismatch would end all
    communication for the life of the process (seen on an H100 with jax
    0.11). The failed program's own outputs carry its error to the caller;
    the next dispatch drops the failed token and starts a fresh chain, as the
    CPU backend, where such errors are raised synchronously, behaves. Other
    effects' tokens are left to JAX.
    """
    token_set = _dispatch.RuntimeTokenSet
    original = getattr(token_set.get_token_input, "_distlinalg_original", token_set.get_token_input)
    recovered = set(getattr(token_set.get_token_input, "_distlinalg_effects", ())) | {effect_type}

    def get_token_input(self: Any, eff: Any, devices: Any) -> Any:
        try:
            return original(self, eff, devices)
        except jax.errors.JaxRuntimeError:
            if not isinstance(eff, tuple(recovered)):
                raise
            self.current_tokens.pop(eff, None)
            return original(self, eff, devices)

    get_token_input._distlinalg_original = original  # type: ignore[attr-defined]
    get_token_input._distlinalg_effects = tuple(recovered)  # type: ignore[attr-defined]
    token_set.get_token_input = get_token_input


def _wait_for_programs_without_results(effect_type: type) -> None:
    """Raise the error of a program with this effect and no array results at its call.

    A program's error reaches the caller through its results, when they are
    read. A program with none (``jax.jit(barrier)``, a lone ``send``) has
    only its effect token, and on a backend that runs programs
    asynchronously (GPU) the call returned while the program failed: a
    mismatch found by the signature check raised on the ranks whose program
    had results and on no other (seen on an H100, issue 40), and the next
    dispatch dropped the failed token (`_recover_failed_tokens_of`). Such a
    program now waits for its token before the call returns, so its error is
    raised there, on every rank, as on the CPU; the failed token is dropped
    at once. Programs with results are left asynchronous.
    """
    from jax._src.interpreters import pxla  # private

    executor = getattr(pxla, "ExecuteReplicated", None)
    current = getattr(executor, "__call__", None)
    if current is None:
        return
    original = getattr(current, "_distlinalg_original", current)
    effects = tuple(set(getattr(current, "_distlinalg_effects", ())) | {effect_type})

    def __call__(self: Any, *args: Any) -> Any:
        out = original(self, *args)
        ours = [eff for eff in (getattr(self, "ordered_effects", None) or ()) if isinstance(eff, effects)]
        if ours and not any(isinstance(leaf, jax.Array) for leaf in jax.tree_util.tree_leaves(out)):
            for eff in ours:
                wait_for_effect_token(eff)
        return out

    __call__._distlinalg_original = original  # type: ignore[attr-defined]
    __call__._distlinalg_effects = effects  # type: ignore[attr-defined]
    executor.__call__ = __call__


def effect_tokens() -> dict[Any, Any]:
    """This thread's ordered-effect tokens between programs (JAX's dispatch state)."""
    return _dispatch.runtime_tokens.current_tokens


def wait_for_effect_token(effect: Any) -> None:
    """Block until the last program of this thread with `effect` has ended.

    Its output token is ready then (and every earlier one's before it). A
    failed program's token is dropped, so that the next dispatch starts a
    fresh chain, and its error raised here.
    """
    tokens = _dispatch.runtime_tokens.current_tokens
    token = tokens.get(effect)
    if token is None:
        return
    try:
        token.block_until_ready()
    except jax.errors.JaxRuntimeError:
        tokens.pop(effect, None)
        raise


def token(buffer: Any) -> Any:
    """A JAX token wrapping `buffer` (what a program hands the next as its effect token)."""
    return _core.Token(buffer)


def at_top_level() -> bool:
    """True when no JAX transformation or trace is active (plain eager code)."""
    return type(_core.trace_ctx.trace) is _core.EvalTrace


def fresh_token() -> Any:
    """A new StableHLO token (for programs that carry no JAX ordered effect)."""
    return _hlo.create_token()


def token_in(ctx: Any, effect: Any) -> Any:
    """The ordering token for `effect` entering a lowering rule."""
    return ctx.tokens_in.get(effect)


def set_token_out(ctx: Any, effect: Any, token: Any) -> None:
    """Hand the token produced by a lowering back to the enclosing program."""
    ctx.set_tokens_out(mlir.TokenSet({effect: token}))


# ---------------------------------------------------------------------------
# XLA's GPU compiler and the ordered MPI custom calls.
#
# XLA's GPU "dynamic slice fusion" wraps a custom call whose operand is a
# slice of a larger buffer (the halo row x[-n:] that a sharded stencil sends)
# into a custom fusion, so the call reads the slice in place. With the MPI
# token among the call's operands and results, that fusion has a token
# parameter and a (token, array) result, and GPU cost analysis then aborts
# the process (shape_util.cc: "Check failed: shape.IsArray() ||
# shape.IsTuple()"; jaxlib 0.11-0.12 with the CUDA plugin: distributed CG and
# MINRES on laplacian_2d(160), float64, 2 ranks). The lowering marks every
# module that holds a distlinalg MPI call, and such modules are compiled for
# GPUs with that pass off; no other program's options change.
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


def _wrap_jax_compiler(name: str, marker: str, wrap: Any) -> bool:
    """Replace ``jax._src.compiler.<name>`` by ``wrap(original)``, once (the wrapper carries
    `marker`); False where this JAX has no such function."""
    try:
        from jax._src import compiler  # private
    except ImportError:  # pragma: no cover - JAX moved it
        return False
    original = getattr(compiler, name, None)
    if original is None:  # pragma: no cover - JAX moved it
        return False
    if not getattr(original, marker, False):
        wrapped = functools.wraps(original)(wrap(original))
        setattr(wrapped, marker, True)
        setattr(compiler, name, wrapped)
    return True


def route_gpu_compilations() -> bool:
    """Compile marked modules for GPUs with ``GPU_OPTIONS_FOR_MPI`` added to their
    options (a user's own entry for the same option wins). Installed once, at import;
    returns whether JAX's compile entry point was found."""

    def wrap(original: Any) -> Any:
        def compile_or_get_cached(backend: Any, computation: Any, devices: Any, compile_options: Any,
                                  *args: Any, **kwargs: Any) -> Any:
            compile_options = compile_options_for(backend, devices, computation, compile_options)
            return original(backend, computation, devices, compile_options, *args, **kwargs)

        return compile_or_get_cached

    return _wrap_jax_compiler("compile_or_get_cached", "_distlinalg_gpu_options", wrap)


def replace_lowering_avals(ctx: Any, avals_in: Any, avals_out: Any) -> Any:
    """A copy of a lowering context with other operand/result types."""
    return ctx.replace(avals_in=avals_in, avals_out=avals_out)


def effect_free_lowering_context(ctx: Any, avals_in: Any, avals_out: Any) -> Any:
    """A copy of a lowering context for lowering effect-free code inside a rule
    that sets the tokens itself (no tokens in, none handed out yet)."""
    return ctx.replace(avals_in=avals_in, avals_out=avals_out, tokens_in=mlir.TokenSet(), tokens_out=None)


# ---------------------------------------------------------------------------
# XLA CPU's YNN *reduce* fusions (jaxlib 0.10.2) miscompile a reduction of a
# dot: the result reads uninitialised memory (nondeterministic garbage), with
# or without MPI, e.g. jit(lambda X, s: jnp.sum(X @ jnp.broadcast_to(s, (8, 4)), 1))
# on a (1024, 8) X, or jnp.sum((X @ W) ** 2, 1). A solve with x0=None hits it
# (A x0 with x0 = zeros / scale is such a dot; reproducer in tests/operators/test_gram.py).
# distlinalg sets the YNN fusion types to YNN's individual dots only (its
# matmul kernels, correct on every pattern in tests/runtime/test_ynn.py and ~2x
# Eigen's speed on a 512x512 float64 product here): through XLA_FLAGS before
# XLA starts, else per compilation. A jaxlib without that type gets none.
_YNN_FLAG = "xla_cpu_experimental_ynn_fusion_type"
_YNN_DOTS = "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"  # XLA_FLAGS and compiler options both take the enum name


def _jaxlib_has(needle_text: str) -> bool:
    """Whether the installed jaxlib's shared libraries contain `needle_text`
    (a flag's name, an enum value's name: XLA aborts on unknown ones)."""
    import glob
    import mmap
    import os

    import jaxlib

    needle = needle_text.encode()
    for path in glob.glob(os.path.join(os.path.dirname(jaxlib.__file__), "*.so")):
        try:
            with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
                if data.find(needle) >= 0:
                    return True
        except (OSError, ValueError):
            continue
    return False


def _safe_ynn_types() -> str:
    """The value of the YNN flag that distlinalg sets: individual dots, or
    nothing where this jaxlib's flag does not know them."""
    return _YNN_DOTS if _jaxlib_has(_YNN_DOTS) else ""


def disable_ynn_fusion() -> str:
    """Set ``--xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT``
    (YNN's reduce fusions off, its matmuls kept) if it can still take effect;
    returns what was done (for ``python -m distlinalg``).

    ``DISTLINALG_YNN_FUSION=1`` keeps XLA's default; an XLA_FLAGS that
    already names the flag is left alone.
    """
    import os

    from jax._src import xla_bridge  # private

    flags = os.environ.get("XLA_FLAGS", "")
    if switch("DISTLINALG_YNN_FUSION", False):
        return "kept (DISTLINALG_YNN_FUSION=1)"
    if _YNN_FLAG in flags:
        return "as set in XLA_FLAGS"
    if not _jaxlib_has(_YNN_FLAG):
        return "not present in this jaxlib"
    value = _safe_ynn_types()
    kept = ": reduce fusions off, YNN matmuls kept" if value else ""
    if xla_bridge.backends_are_initialized():
        # XLA_FLAGS is read once, when the backend starts; the same debug
        # option is still accepted per compilation (compiler_options).
        if _disable_ynn_fusion_per_compile(value):
            return f"disabled per compilation{kept} (JAX's backend started before distlinalg was imported)"
        return "left on: JAX's backend started before distlinalg was imported"
    os.environ["XLA_FLAGS"] = f"{flags} --{_YNN_FLAG}={value}".strip()
    return f"disabled{kept}"


def _disable_ynn_fusion_per_compile(value: str) -> bool:
    """Add the YNN flag, set to `value`, to the options of every later jit compilation.

    Same effect as ``jax.jit(f, compiler_options={flag: value})`` on each jit;
    an explicit ``compiler_options`` entry for the flag wins. Programs
    compiled before this call keep the fusions (they hold no distlinalg
    call: distlinalg was not imported yet).
    """

    def wrap(original: Any) -> Any:
        def get_compile_options(*args: Any, **kwargs: Any) -> Any:
            backend = kwargs.get("backend")
            if backend is None or getattr(backend, "platform", "cpu") == "cpu":
                overrides = dict(kwargs.get("env_options_overrides") or {})
                overrides.setdefault(_YNN_FLAG, value)
                kwargs["env_options_overrides"] = overrides
            return original(*args, **kwargs)

        return get_compile_options

    return _wrap_jax_compiler("get_compile_options", "_distlinalg_no_ynn", wrap)


# ---------------------------------------------------------------------------
# GPU device selection (distlinalg/_cuda.py) sets JAX's CUDA device filter
# before the backend starts, as jax.distributed.initialize does.
def backends_started() -> bool:
    """Whether JAX has created its backends (device settings are then fixed)."""
    from jax._src import xla_bridge  # private

    return bool(xla_bridge.backends_are_initialized())


def cuda_visible_devices() -> str:
    """JAX's ``jax_cuda_visible_devices`` ("all" unless restricted)."""
    from jax._src import xla_bridge  # private

    return str(xla_bridge.CUDA_VISIBLE_DEVICES.value)


def set_cuda_visible_devices(devices: str) -> None:
    jax.config.update("jax_cuda_visible_devices", devices)


def requested_platforms() -> str:
    """JAX_PLATFORMS / jax_platforms as given ("" when JAX chooses)."""
    return str(jax.config.jax_platforms or "")


# ---------------------------------------------------------------------------
def apply_primitive(prim: Any, *args: Any, **params: Any) -> Any:
    """Evaluate a primitive eagerly by compiling it alone (JAX's default impl)."""
    from jax._src import dispatch  # private

    return dispatch.apply_primitive(prim, *args, **params)


def lowering_trace() -> bool:
    """Whether JAX is tracing Python code *while lowering* a program.

    That happens in lowering rules made by ``mlir.lower_fun`` (lineax's
    linear_solve_p re-traces its impl there), including the while-loop
    bodies and branches traced inside. An MLIR insertion point is active
    exactly while JAX emits a program; ordinary tracing (jit, eval_shape,
    make_jaxpr) happens before lowering, with none.
    """
    from jax._src.lib.mlir import ir  # private

    try:
        ir.InsertionPoint.current
    except ValueError:
        return False
    return True


def carries_tangent(x: Any) -> bool:
    """Whether `x` is being differentiated (a JVP or linearize tracer): for
    arguments that a library's own AD rule would silently treat as constant."""
    from jax._src.interpreters import ad as _ad  # private

    tracers = tuple(t for t in (getattr(_ad, "JVPTracer", None), getattr(_ad, "LinearizeTracer", None)) if t)
    return isinstance(x, tracers)
