"""Machinery shared by every communication primitive.

Each primitive family lives in its own module (abstract eval, lowering, JVP,
transpose and batching rule side by side); this module supplies what they
share: the ordered MPI effect, primitive construction, the token-threading FFI
lowering, and small helpers for the AD rules.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import functools
import hashlib
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive

from .._runtime import jax_names
from .._runtime import patches
from .._runtime import env as _env
from .._runtime import mpi as _mpi
from .._runtime.jax_names import ad, batching, mlir
from .._runtime.mpi import Communicator


class MPIEffect(jax_names.Effect):
    """Ordered effect of every MPI operation.

    XLA threads one token through all primitives carrying it, so collectives
    execute in program order on every rank and are never removed as dead code.
    """

    def __repr__(self) -> str:
        return "MPIEffect"

    __str__ = __repr__


mpi_effect = MPIEffect()
patches.register_ordered_effect(MPIEffect)


# Eager calls of a primitive go through a twin without the ordered effect:
# programs with effects take JAX's Python dispatch path (hundreds of µs per
# call, most of it runtime-token bookkeeping), effect-free programs the C++
# fast path. Program order still holds eagerly: PJRT runs the computations
# of one device in dispatch order, and the custom call is marked as having a
# side effect so XLA never drops it.
_eager_twins: dict[Primitive, Primitive] = {}
# The thread inside an eager call on each communicator (by handle) and how
# deeply (composite calls nest): a second thread is refused (`_enter`).
_eager_users: dict[int, tuple[int, int]] = {}
_eager_users_lock = threading.Lock()
# The compiled program of an eager call, found with one dict lookup (the
# eager path's own cost is ~2x an MPI message of a few KiB; issue 18):
# (twin, *parameters) in `eager_impl`; (primitive, communicator, dtype,
# *parameters) in `apply_collective`, whose dtype checks ran when the entry
# was made.
_eager_programs: dict[tuple[Any, ...], Callable[..., Any]] = {}


class ReceivingPrimitive(Primitive):
    """A primitive with receive templates: differentiated whenever it is bound under AD.

    A receive's result is what its partner sent, so whether it carries a tangent is
    decided on the partner's rank, not by whether this rank's template does: a
    template made by ``jnp.empty_like`` (mpi4jax's examples, issue 67) is a constant,
    and JAX would skip the receive's JVP while the partner posts a tangent. Under a
    JVP or linearize trace the templates are given a zero tangent instead
    (jax_names.with_zero_tangents), so the receive always follows the protocol of
    differentiated messages (comm/sendrecv.py): it takes the partner's tangent when
    the partner flags one, and is exactly zero otherwise.
    """

    def __init__(self, name: str, templates: tuple[int, ...]):
        super().__init__(name)
        self.templates = templates

    def bind_with_trace(self, trace, args, *rest):
        return super().bind_with_trace(trace, jax_names.with_zero_tangents(trace, args, self.templates), *rest)


def _primitive(name: str, templates: tuple[int, ...]) -> Primitive:
    return ReceivingPrimitive(name, templates) if templates else Primitive(name)


def new_primitive(name: str, *, multiple_results: bool = False, templates: tuple[int, ...] = ()) -> Primitive:
    """A communication primitive and its effect-free twin for eager calls.

    `templates`: positions of the operands that are receive templates (see
    :class:`ReceivingPrimitive`).
    """
    prim = _primitive(f"distlinalg_{name}", templates)
    prim.multiple_results = multiple_results
    twin = Primitive(f"distlinalg_{name}_eager")
    # The twin always returns a list: primitives without results (send,
    # barrier) return a dummy scalar so the call is not dead code.
    twin.multiple_results = True
    _eager_twins[prim] = twin

    def eager_impl(*args: Any, **params: Any) -> Any:
        key = (twin, *params.items())  # a call site passes its parameters in one order
        program = _eager_programs.get(key)
        if program is None:
            program = _eager_programs[key] = _compiled(twin, tuple(sorted(params.items())))
        outs = run_eager(program, args, params.get("comm"))
        if not multiple_results:
            return outs[0]
        return outs[:-1] if _has_dummy_result(prim) else outs

    prim.def_impl(eager_impl)
    return prim


def run_eager(program: Callable[..., Any], args: Sequence[Any], comm: Communicator | None = None) -> Any:
    """Run an eager operation's compiled `program` on `args` to completion.

    Two Python threads using one communicator are an error (`_enter`): even
    taking turns, their collectives would reach MPI in an order that differs
    between ranks and pair up wrongly. Threads on communicators of their own
    run at once (MPI_THREAD_MULTIPLE; at lower thread levels the handlers
    take turns). A process-wide lock here made them deadlock: each rank's
    lock held by the thread whose partner waited for the other lock.
    """
    key = _enter(comm)
    try:
        wait_for_dispatched_programs()
        outs = program(*args)
        for out in outs:  # (not jax.block_until_ready: its pytree walk costs µs here)
            out.block_until_ready()
    finally:
        _leave(key)
    return outs


def wait_for_dispatched_programs() -> None:
    """Block until every program with MPI calls that this thread dispatched has finished.

    Compiled programs run asynchronously: ``y = jitted(x)`` returns while the
    program's collectives are still running (or waiting for a slower rank).
    An eager call (the effect-free twins) takes no part in the chain of MPI
    tokens that orders programs. PJRT's CPU client ran the twins after the
    programs dispatched before them in every run here, but nothing in JAX
    promises that across programs with and without effects (nor across GPU
    streams); an eager call that reached MPI while an earlier program's
    collective on the same communicator was still to come on this rank would
    pair up with a peer's instance of that collective ("Message truncated";
    issue 57: a trace-time exchange while the previous solve still ran). So
    the order is made explicit: the last MPI program's output token is ready
    when that program, and every one before it, has ended; waiting on a
    ready token costs about half a microsecond (benchmarks/README.md). A
    failed program's token is dropped (its error reaches the caller through
    its results), as at the next dispatch (``patches._recover_failed_tokens``).
    """
    try:
        jax_names.wait_for_effect_token(mpi_effect)
    except jax.errors.JaxRuntimeError:
        pass  # (that program's results carry its error to whoever reads them)


def _enter(comm: Communicator | None) -> int | None:
    """Mark this thread as inside an eager call on `comm`; raise if another thread is.

    The handlers make the same check for calls of compiled programs
    (csrc/checks.cc, CallRecord::Alone), which this lock does not serialise.
    """
    if comm is None or comm.size == 1:  # one rank: computed locally, nothing to pair up
        return None
    key, me = int(comm.handle), threading.get_ident()
    with _eager_users_lock:
        owner, depth = _eager_users.get(key, (me, 0))
        if owner != me:
            _mpi.mark_misused(key)  # the other thread's later calls on it fail too
            raise RuntimeError(
                f"distlinalg: rank {comm.rank}: another thread is inside a call on the same communicator. MPI "
                "forbids concurrent operations on one communicator, and the two threads' messages would pair "
                "up differently on different ranks (wrong results). Give each thread its own communicator "
                "(comm.Dup())."
            )
        _eager_users[key] = (me, depth + 1)
    return key


def _leave(key: int | None) -> None:
    if key is None:
        return
    with _eager_users_lock:
        owner, depth = _eager_users[key]
        if depth == 1:
            del _eager_users[key]
        else:
            _eager_users[key] = (owner, depth - 1)


@functools.lru_cache(maxsize=None)
def _compiled(prim: Primitive, params: tuple[tuple[str, Any], ...]) -> Callable[..., Any]:
    return jax.jit(functools.partial(prim.bind, **dict(params)))


def compiled_call(prim: Primitive, args: Sequence[Any], params: dict[str, Any]) -> Any:
    """``prim.bind(*args, **params)`` as a compiled program, cached per parameters,
    run to completion as every eager operation is (:func:`run_eager`).

    Completion matters on asynchronous backends (GPUs): a handler's error
    (a mismatch found by the checks) must be raised here, at the call, on
    every rank. Returned unfinished, the error would surface only where the
    results are read, after this rank had posted its next message, which
    its partner, having raised, never takes (a hang).
    """
    return run_eager(_compiled(prim, tuple(sorted(params.items()))), args, params.get("comm"))


def new_expanded_primitive(
    name: str,
    shape_rule: Callable[..., Any],
    expansion: Callable[..., Sequence[Any]],
    *,
    templates: tuple[int, ...] = (),
) -> Primitive:
    """A communication primitive defined by what it expands into.

    For the protocol primitives of differentiated point-to-point messages
    (``comm/sendrecv.py``, ``comm/sendrecv_status.py``): `expansion(*args,
    **params)` returns the list of results, computed by binding other
    communication primitives, whose lowerings are per platform. The
    expansion is the lowering on every platform, so a composite primitive
    lowers wherever its parts do (the CPU and, in builds with the CUDA
    handlers, CUDA). Eagerly it runs as
    one compiled program. Its JVP and batching rules are the caller's.

    Args:
      shape_rule: ``(*avals, **params) -> list of avals`` of the results.
      templates: positions of receive templates (:class:`ReceivingPrimitive`).
    """
    prim = _primitive(f"distlinalg_{name}", templates)
    prim.multiple_results = True
    prim.def_effectful_abstract_eval(lambda *avals, **params: (shape_rule(*avals, **params), {mpi_effect}))
    mlir.register_lowering(prim, mlir.lower_fun(expansion, multiple_results=True))
    prim.def_impl(lambda *args, **params: compiled_call(prim, args, params))
    return prim


def bind(prim: Primitive, *args: Any, **params: Any) -> Any:
    """`prim.bind`, short-circuited to the eager implementation at top level.

    Public functions call this: outside any transformation the result is the
    same as `prim.bind`, without JAX's per-bind trace lookup (which costs as
    much as the whole small-message MPI call).
    """
    if jax_names.at_top_level():
        return prim.impl(*args, **params)
    return prim.bind(*args, **params)




def as_array(x: Any) -> Any:
    """jnp.asarray, skipped for values that already are JAX arrays/tracers."""
    return x if isinstance(x, jax.Array) else jnp.asarray(x)


_dummy_results: set[Primitive] = set()


def _has_dummy_result(prim: Primitive) -> bool:
    return prim in _dummy_results


def def_abstract_eval(prim: Primitive, shape_rule: Callable[..., Any]) -> None:
    """Register `shape_rule(*avals, **params) -> aval(s)` with the MPI effect."""

    def abstract_eval(*avals, **params):
        return shape_rule(*avals, **params), {mpi_effect}

    prim.def_effectful_abstract_eval(abstract_eval)

    def twin_abstract_eval(*avals, **params):
        out = shape_rule(*avals, **params)
        if not prim.multiple_results:
            return [out]
        if len(out) == 0:
            _dummy_results.add(prim)
            return [_DUMMY_AVAL]
        return list(out)

    _eager_twins[prim].def_abstract_eval(twin_abstract_eval)


def shaped(shape: Sequence[int], dtype: Any) -> Any:
    return jax_names.ShapedArray(tuple(shape), dtype)


def register_lowering(
    prim: Primitive,
    target: str,
    attrs: Callable[..., dict[str, Any]],
    *,
    aliases: dict[int, int] | None = None,
    token_only_result: bool = False,
    on_lower: Callable[..., None] | None = None,
    local: Callable[..., Sequence[Any]] | None = None,
    local_if: Callable[..., bool] | None = None,
) -> None:
    """Lowering of `prim` to the FFI handler `target`, threading the token.

    Registered for the CPU and, in builds with the CUDA handlers, for CUDA
    (the same target name; XLA picks the handler of the platform).

    On a one-rank communicator an operation with a `local` rule lowers to
    that rule instead: plain XLA operations, no custom call, so nothing is
    staged through the host and nothing synchronises a GPU stream (a 1-rank
    solve runs as jax.scipy's would). JVP, transpose and batching rules bind
    the primitive again, so every AD and vmap mode gets the local lowering.
    The MPI token passes through unchanged: with one rank there is no other
    process to be ordered with.

    Args:
      attrs: params -> the handler's attributes (numpy scalars of their types).
      aliases: operand index -> result index (indices of the array operands
        and results, not counting the token) that may share a buffer.
      token_only_result: the handler returns only the token (send, barrier).
      on_lower: ``(ctx, **params)``, called when a traced program lowers the
        primitive (not for eager calls): a check that needs the whole traced
        program (the non-blocking operations' start/wait pairing).
      local: ``(*operands, **params) -> list of results``, jnp code
        computing what the operation returns when ``params["comm"].size == 1``.
      local_if: ``(*avals_in, **params) -> bool``, whether `local` applies
        to this call (default: always); a call it refuses (a message to
        itself that only MPI can match) lowers to the handler.
    """
    alias_map = None
    if aliases:
        alias_map = {i + 1: o + 1 for i, o in aliases.items()}

    def emit(ctx, token, operands, params, avals_out, site):
        patches.mark_mpi_module(ctx)
        sub = jax_names.replace_lowering_avals(
            ctx,
            [jax_names.abstract_token, *ctx.avals_in],
            [jax_names.abstract_token, *avals_out],
        )
        extra = {"operand_output_aliases": alias_map} if alias_map else {}
        rule = jax.ffi.ffi_lowering(target, has_side_effect=True, **extra)
        return rule(sub, token, *operands, site=np.int64(site), **attrs(**params))

    def local_results(ctx, operands, params, avals_out):
        """The results of `local`, lowered, or None when the call needs MPI."""
        if local is None or not elide_one_rank() or params["comm"].size != 1:
            return None
        if local_if is not None and not local_if(*ctx.avals_in, **params):
            return None
        sub = jax_names.effect_free_lowering_context(ctx, list(ctx.avals_in), avals_out)
        return mlir.lower_fun(lambda *xs: list(local(*xs, **params)), multiple_results=True)(sub, *operands)

    def lowering(ctx, *operands, **params):
        if on_lower is not None:
            on_lower(ctx, **params)
        avals_out = [] if token_only_result else list(ctx.avals_out)
        results = local_results(ctx, operands, params, avals_out)
        if results is not None:
            jax_names.set_token_out(ctx, mpi_effect, jax_names.token_in(ctx, mpi_effect))
            return list(results)
        token_out, *results = emit(
            ctx, jax_names.token_in(ctx, mpi_effect), operands, params, avals_out, call_site(ctx, prim)
        )
        jax_names.set_token_out(ctx, mpi_effect, token_out)
        return results

    def twin_lowering(ctx, *operands, **params):
        avals_out = [] if token_only_result else list(ctx.avals_out)
        results = local_results(ctx, operands, params, avals_out)
        if results is not None:
            return [mlir.ir_constant(np.zeros((), np.int32))] if token_only_result else list(results)
        # Site 0: an eager call, checked every time (csrc/checks.h).
        if token_only_result:
            emit(ctx, jax_names.fresh_token(), operands, params, [], EAGER_SITE)
            return [mlir.ir_constant(np.zeros((), np.int32))]
        _, *results = emit(ctx, jax_names.fresh_token(), operands, params, list(ctx.avals_out), EAGER_SITE)
        return results

    if _mpi.BUILD_INFO["cuda"]:
        platforms = ("cpu", "cuda")
    else:
        platforms = ("cpu",)
        _register_missing_cuda(prim)
    for platform in platforms:
        mlir.register_lowering(prim, lowering, platform=platform)
        mlir.register_lowering(_eager_twins[prim], twin_lowering, platform=platform)


# One-rank communicators: operations lower to their local result (see
# register_lowering). DISTLINALG_ONE_RANK_LOCAL=0 lowers them to the handlers
# as on any communicator (to test the handlers on one rank). Read when a
# program is lowered; programs already compiled keep what they were given.
ONE_RANK_LOCAL = _env.switch("DISTLINALG_ONE_RANK_LOCAL", True)


def elide_one_rank() -> bool:
    """Whether operations on one-rank communicators lower to their local result."""
    return ONE_RANK_LOCAL


# Call sites of compiled programs: the handler's `site` attribute. In the default
# check mode a site is checked across ranks during the first execution that meets
# it on its communicator, and not after (csrc/checks.h); eager calls (site 0) are
# checked every time. Whether a rank checks must not depend on what it compiled
# before: ranks whose local shapes differ compile at different times (one rank
# reuses a program for shapes it has seen while another compiles one for new
# shapes), and a rank that checks alone waits for the others. So a site is a
# function of the code alone, the same on every rank and in every process (see
# call_site), and the handler keys "seen before" by the site, the communicator
# and the call's signature (what the check compares: shapes, dtype, root, op),
# which every rank of a valid program shares. A program compiled for new shapes
# on every rank is checked again; one compiled anew on some ranks only, for
# local shapes the collective does not see, is not, on any rank.
EAGER_SITE = 0


def call_site(ctx: Any, prim: Primitive) -> int:
    """The `site` of one lowering of `prim`: a hash of the module's name, the name
    stack and the traced code's frames that led to the call (jax_names.lowering_call_path),
    with the primitive's name; in [1, 2**63)."""
    module_name, name_stack, frames = jax_names.lowering_call_path(ctx)
    text = repr((prim.name, module_name, name_stack, frames)).encode()
    value = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1
    return value or 1


def _register_missing_cuda(prim: Primitive) -> None:
    """A CUDA lowering that explains why there is none (instead of JAX's generic error)."""

    def unavailable(ctx, *operands, **params):
        raise NotImplementedError(
            f"{prim.name} on a CUDA device: this distlinalg build has no CUDA handlers "
            "(cuda.h was not found at build time). Rebuild with DISTLINALG_CUDA=on and "
            "CUDA_HOME pointing at a CUDA toolkit, or run on the CPU."
        )

    mlir.register_lowering(prim, unavailable, platform="cuda")
    mlir.register_lowering(_eager_twins[prim], unavailable, platform="cuda")


_DUMMY_AVAL = jax_names.ShapedArray((), np.int32)


def comm_attr(comm: Communicator) -> np.int64:
    """The handler attribute naming `comm`: its key, which every rank gives the same
    communicator (Communicator), so that the ranks' programs are alike."""
    if not comm.key:
        raise ValueError(f"distlinalg: {comm!r} was not made by distlinalg: pass the mpi4py communicator instead")
    return np.int64(comm.key)


# ---------------------------------------------------------------------------
# AD helpers
def instantiate(ct: Any) -> Any:
    """A concrete array for a possibly symbolic-zero (co)tangent.

    Rules call this before communicating: a rank whose (co)tangent is a
    symbolic zero must still take part in the collective its peers post.
    A Python number (``jax.jvp(f, (x,), (1.0,))``, which JAX accepts)
    becomes an array, so rules may read its dtype.
    """
    return as_array(ad.instantiate_zeros(ct))


def is_undefined(x: Any) -> bool:
    return ad.is_undefined_primal(x)


def moveaxis_or_broadcast(x: Any, bdim: Any, target: int, size: int) -> Any:
    """Put the batch dimension of `x` at `target` (broadcasting if unbatched)."""
    if bdim is jax_names.not_mapped:
        x = jnp.broadcast_to(x, (size, *np.shape(x)))
        bdim = 0
    return jnp.moveaxis(x, bdim, target)


not_mapped = jax_names.not_mapped




def check_leading_dim(a: Any, comm: Communicator, opname: str) -> None:
    """Ops taking one block per rank need a leading axis of length size."""
    shape = np.shape(a)
    if len(shape) == 0 or shape[0] != comm.size:
        raise ValueError(
            f"distlinalg.{opname}: x must have shape (size, ...) = ({comm.size}, ...), one block per "
            f"rank, got shape {tuple(shape)}"
        )


_LOGICAL_OPS = (_mpi.ReduceOp.LAND, _mpi.ReduceOp.LOR, _mpi.ReduceOp.LXOR)


def truth_values(x: Any, op: _mpi.ReduceOp | None) -> Any:
    """`x` as a logical reduction takes it: LAND, LOR and LXOR of integers give 0 or 1,
    but MPI returns a lone contribution (one rank's, rank 0's inclusive scan) as it is,
    so integer operands enter as 0/1 and every rank count gives the same answer."""
    if op in _LOGICAL_OPS and jnp.issubdtype(x.dtype, jnp.integer):
        return (x != 0).astype(x.dtype)
    return x


def apply_collective(
    prim: Primitive,
    x: Any,
    *,
    opname: str,
    comm: Communicator,
    op: _mpi.ReduceOp | None = None,
    one_block_per_rank: bool = False,
    **params: Any,
) -> Any:
    """The public wrapper of a collective: ``prim`` on every leaf of the pytree `x`.

    Every leaf is checked (dtype, the op on that dtype, and a leading axis of
    length ``comm.size`` where the op takes `one_block_per_rank`) before the
    first leaf is communicated: a bad third leaf must not leave the other ranks
    waiting in the second leaf's message. The checks depend only on shapes and
    dtypes, so every rank of a correct program takes the same path. `op` (if
    given) and the remaining `params` become the primitive's parameters.
    """
    if op is not None:
        params["op"] = op
    if isinstance(x, jax.Array) and jax_names.at_top_level():
        # The common eager case: one array, no pytree walk, checked once.
        key = (prim, comm, x.dtype, *params.items())
        program = _eager_programs.get(key)
        if program is None:
            _mpi.check_dtype(x.dtype, opname, op)
            program = _eager_programs[key] = _compiled(_eager_twins[prim], tuple(sorted({**params, "comm": comm}.items())))
        if one_block_per_rank:
            check_leading_dim(x, comm, opname)
        return run_eager(program, (truth_values(x, op),), comm)[0]
    if isinstance(x, jax.Array):
        leaves, treedef = [x], None
    else:
        leaves, treedef = jax.tree_util.tree_flatten(x)
    arrays = [as_array(leaf) for leaf in leaves]
    for a in arrays:
        _mpi.check_dtype(a.dtype, opname, op)
        if one_block_per_rank:
            check_leading_dim(a, comm, opname)
    outs = [bind(prim, truth_values(a, op), comm=comm, **params) for a in arrays]
    return outs[0] if treedef is None else jax.tree_util.tree_unflatten(treedef, outs)


# ---------------------------------------------------------------------------
# Program order inside primitives that hide their body.
#
# JAX threads one token per ordered effect through the equations that declare
# it. A primitive that runs user code but declares no effects (lineax's
# linear_solve_p, which lowers by re-tracing its impl) would hand that code no
# MPI token. distlinalg does not give such code a token of its own: a region
# with its own token is not ordered with the program's other collectives,
# and ranks whose shapes differ then run them in different orders (issue 57).
# Instead the hiding primitive is made to declare the MPI effect of its body
# (distlinalg/lineax/_effects.py for lineax), so the program's token flows
# through it. A primitive nobody taught this fails to lower (JAX's
# ``KeyError: MPIEffect``) on every rank alike: an error, never a race.
def lowering_without_mpi_token() -> bool:
    """Whether code traced now is being traced by a lowering rule (``mlir.lower_fun``,
    e.g. inside lineax's ``linear_solve``) rather than by jit/eval_shape."""
    return jax_names.lowering_trace()


__all__ = [
    "MPIEffect",
    "lowering_without_mpi_token",
    "mpi_effect",
    "new_primitive",
    "new_expanded_primitive",
    "compiled_call",
    "bind",
    "as_array",
    "def_abstract_eval",
    "shaped",
    "register_lowering",
    "comm_attr",
    "instantiate",
    "is_undefined",
    "moveaxis_or_broadcast",
    "not_mapped",

    "ad",
    "batching",
]
