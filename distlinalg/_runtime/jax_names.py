"""Read-only uses of JAX names outside its stable public surface, in one place.

Nothing here changes JAX: the names and small helpers below read JAX's
state or build its objects. What distlinalg replaces in JAX is in
``patches.py`` (its table), the XLA flags it sets in ``xla_flags.py``.
Checked against jax/jaxlib 0.10.2 (Python 3.11, this project's CPU machines)
and 0.12 (Python 3.12, as on the GPU machines); ``patches.CHECKED_VERSIONS``.
When JAX moves one of these, this is the only file to change.
"""

from __future__ import annotations

import functools
import os
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


__all__ = [
    "Effect",
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


def replace_lowering_avals(ctx: Any, avals_in: Any, avals_out: Any) -> Any:
    """A copy of a lowering context with other operand/result types."""
    return ctx.replace(avals_in=avals_in, avals_out=avals_out)


def effect_free_lowering_context(ctx: Any, avals_in: Any, avals_out: Any) -> Any:
    """A copy of a lowering context for lowering effect-free code inside a rule
    that sets the tokens itself (no tokens in, none handed out yet)."""
    return ctx.replace(avals_in=avals_in, avals_out=avals_out, tokens_in=mlir.TokenSet(), tokens_out=None)


def lowering_call_path(ctx: Any) -> tuple[str, str, tuple[tuple[str, str, int], ...]]:
    """Where a lowering rule's equation comes from, in terms that depend on the code only:
    (the module's name, the name stack, the innermost run of frames outside JAX and the
    standard library, as (file, function, bytecode offset)).

    The innermost run stops at the first JAX frame above it: the frames beyond belong to
    whatever called the traced function, which a trace cache may have seen from another
    caller (a jaxpr traced once and reused). What is inside it is the traced code itself.
    """
    sym_name = ctx.module_context.module.operation.attributes["sym_name"]
    module_name = mlir.ir.StringAttr(sym_name).value
    frames: list[tuple[str, str, int]] = []
    traceback = ctx.traceback
    if traceback is not None:
        codes, offsets = traceback.raw_frames()  # innermost first
        for code, offset in zip(codes, offsets):
            if _is_jax_or_stdlib(code.co_filename):
                if frames:
                    break
                continue
            frames.append((code.co_filename, getattr(code, "co_qualname", code.co_name), int(offset)))
    return module_name, str(ctx.name_stack), tuple(frames)


_SKIPPED_PREFIXES = (
    os.path.dirname(jax.__file__) + os.sep,
    os.path.dirname(os.path.dirname(jax.__file__)) + os.sep + "jaxlib" + os.sep,
    os.path.dirname(os.__file__) + os.sep,  # the standard library
    "<frozen",
)


@functools.lru_cache(maxsize=4096)
def _is_jax_or_stdlib(filename: str) -> bool:
    return filename.startswith(_SKIPPED_PREFIXES)


# ---------------------------------------------------------------------------
# GPU device selection (distlinalg/_runtime/cuda.py) sets JAX's CUDA device filter
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
        ir.InsertionPoint.current  # noqa: B018  (raises ValueError outside a lowering)
    except ValueError:
        return False
    return True


def carries_tangent(x: Any) -> bool:
    """Whether `x` is being differentiated (a JVP or linearize tracer): for
    arguments that a library's own AD rule would silently treat as constant."""
    from jax._src.interpreters import ad as _ad  # private

    tracers = tuple(t for t in (getattr(_ad, "JVPTracer", None), getattr(_ad, "LinearizeTracer", None)) if t)
    return isinstance(x, tracers)


def with_zero_tangents(trace: Any, args: Any, positions: tuple[int, ...]) -> Any:
    """`args` of a primitive bound on `trace`, with those at `positions` carrying a zero
    tangent (instantiated) when `trace` differentiates and no argument carries one.

    For receive templates (comm/_core.new_primitive's ``templates``): JAX differentiates a
    primitive only when an input carries a tangent, but what a receive returns depends on
    what its *partner* sends, which this rank cannot see. Under a JVP or linearize trace
    the receive is therefore always differentiated (its template lifted to a tracer of
    that trace with a zero tangent), so that it takes the tangent its partner may send.
    Arguments of integer or boolean dtypes have no tangent and are left as they are.
    Checked on jax 0.10.2 and 0.12 (``JVPTrace``/``LinearizeTrace``, their tracers,
    ``to_primal_tangent_pair``, the tangent's trace: the parent's for JVP, the tangent
    trace for linearize).
    """
    from jax._src.interpreters import ad as _ad  # private

    if isinstance(trace, _ad.JVPTrace):
        make, zeros_trace = _ad.JVPTracer, trace.parent_trace
    elif isinstance(trace, _ad.LinearizeTrace):
        make, zeros_trace = _ad.LinearizeTracer, trace.tangent_trace
    else:
        return args
    pairs = [trace.to_primal_tangent_pair(a) for a in args]
    if any(type(t) is not _ad.Zero for _, t in pairs):
        return args  # differentiated anyway; the rule instantiates the zeros
    lifted = list(args)
    for i in positions:
        primal, tangent = pairs[i]
        if not np.issubdtype(_core.typeof(primal).dtype, np.inexact):
            continue
        with _core.set_current_trace(zeros_trace):
            zero = linear_zeros(tangent.aval)
        lifted[i] = make(trace, primal, zero)
    return lifted


def linear_zeros(aval: Any) -> Any:
    """Zeros that JAX's reverse mode treats as a linear value of the program being
    differentiated, not as a constant (what `with_zero_tangents` gives a template).

    A constant tangent would be evaluated with the primal program (partial evaluation
    calls it known) and, in the linear program, evaluated instead of transposed (the
    backward pass transposes only equations that read a linear value): a receive of a
    tangent must instead be transposed into the return of the cotangent to its source.
    So the zeros come from `_linear_zeros_p`, which partial evaluation always stages into
    the linear program (its rules below, for ``partial_eval_jaxpr_nounits`` as scan and
    linearize use it and ``partial_eval_jaxpr_custom`` as remat does), held in a fresh
    frozen reference, which the backward pass treats as an accumulator whatever it holds
    (``ad.backward_pass3``, jax 0.10.2 and 0.12).
    """
    zeros = _linear_zeros_primitive().bind(shape=tuple(aval.shape), dtype=np.dtype(aval.dtype))
    return jax.freeze(jax.new_ref(zeros))


@functools.cache
def _linear_zeros_primitive() -> Any:
    from jax.extend.core import Primitive
    from jax._src.interpreters import partial_eval as _pe  # private
    from jax._src import source_info_util as _source_info  # private

    prim = Primitive("distlinalg_linear_zeros")
    prim.def_impl(lambda *, shape, dtype: jax.numpy.zeros(shape, dtype))
    prim.def_abstract_eval(lambda *, shape, dtype: _core.ShapedArray(shape, dtype))
    mlir.register_lowering(prim, mlir.lower_fun(lambda *, shape, dtype: jax.numpy.zeros(shape, dtype),
                                                multiple_results=False))

    def staged(trace: Any, *, shape: Any, dtype: Any) -> Any:
        out = _pe.JaxprTracer(trace, _pe.PartialVal.unknown(_core.ShapedArray(shape, dtype)), None)
        out.recipe = _pe.new_eqn_recipe(trace, [], [out], prim, dict(shape=shape, dtype=dtype),
                                        _core.no_effects, _source_info.current())
        return out

    _pe.custom_partial_eval_rules[prim] = staged
    _pe.partial_eval_jaxpr_custom_rules[prim] = lambda saveable, unks_in, inst_in, eqn: (
        None, eqn, [True], [True], [])
    return prim
