"""Computation pinned between the start and the wait of non-blocking operations.

``iallreduce``/``iallgather``/``isend``/``irecv`` and ``wait`` are ordered
among themselves, but XLA places pure computation wherever its data allows:
work that does not read a request's result may run before the start or after
the wait, and then nothing overlaps. (A request's markers cannot tie it: they
hold no data, and XLA folds zero-element arrays into constants.)

:func:`overlap` ties the work to the communication with ``fence``, the
identity on arrays that is ordered with the MPI operations:

  start(s) → fence(args) → fn(args) → fence(outs) → wait(s)

In the compiled program a fence is a custom call that reads its arrays and
hands the MPI effect's token on, so every distlinalg operation after it
waits for them: the waits run after `fn` has computed its outputs. The
arrays pass by as they are (nothing is copied) and the call does nothing at
run time, on the CPU and on GPUs. (An ``optimization_barrier`` would not do:
XLA's CPU pipeline removes barriers before it schedules.) That the starts
run before `fn` is left to XLA's scheduler, which issues a start as soon as
its operand is ready in the programs checked here (tests/comm/test_overlap.py
reads the compiled schedule); a data dependency could force it only by
copying `fn`'s inputs.

AD: a fence is the identity on arrays. Its JVP fences the primals and the
tangents separately; its transpose fences the cotangents. In reverse mode
the transposed first fence reads the cotangents of `fn`'s inputs, so the
transposed start (the wait for the adjoint message) runs after `fn`'s
backward pass, and the transposed wait (the adjoint message's start) comes
before it in program order.
vmap: batched arrays pass through as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

from .._runtime import jax_names
from .._runtime import patches
from .._runtime import mpi as _mpi
from . import _core
from ._core import ad, batching
from .nonblocking import Request, wait

# ---------------------------------------------------------------------------
# fence: arrays -> the same arrays, ordered with the MPI operations.
#   pass_through=False: the fence reads the arrays; what comes after it in
#     program order (the next distlinalg operation) waits for them.
#   pass_through=True: also, the arrays it returns are computed from its
#     run-time zero (x + 0), so their uses wait for what came before it.
#   mpi_order=False: only XLA's own computations need the order (the
#     in-place updates of the solvers, the stencil's materialised block).
#     On the CPU that is still the custom call (XLA's CPU pipeline removes
#     optimization barriers before it schedules); on GPUs it lowers to an
#     optimization barrier (the identity without pass_through, where
#     nothing waits for the arrays), which XLA's GPU compiler honours, and
#     the MPI token passes through: no custom call, nothing launched.
fence_p = Primitive("distlinalg_fence")
fence_p.multiple_results = True
fence_p.def_effectful_abstract_eval(lambda *avals, pass_through, mpi_order: (list(avals), {_core.mpi_effect}))
# Eagerly (and in jax.jvp of eager code) operations run one after the other
# in program order already: the fence has nothing to do.
fence_p.def_impl(lambda *xs, pass_through, mpi_order: list(xs))


def _plus(zero: Any, x: Any) -> Any:
    """x + zero, with a zero XLA cannot fold: x itself (except that −0.0 becomes +0.0)."""
    if x.dtype == jnp.bool_:
        return x | (zero != 0)
    return x + zero.astype(x.dtype)


def _fence_lowering(ctx: Any, *xs: Any, pass_through: bool, mpi_order: bool) -> Sequence[Any]:
    # The handler (csrc/nonblocking.cc) reads the arrays, hands the token on
    # and writes a float32 zero; it does nothing else, on the CPU and on
    # GPUs (no stream synchronisation). An optimization_barrier would not
    # do: XLA's CPU pipeline removes barriers before it schedules.
    zero_aval = _core.shaped((), np.float32)
    patches.mark_mpi_module(ctx)
    sub = jax_names.replace_lowering_avals(
        ctx, [jax_names.abstract_token, *ctx.avals_in], [jax_names.abstract_token, zero_aval]
    )
    rule = jax.ffi.ffi_lowering("distlinalg_fence", has_side_effect=True)
    token_out, zero = rule(sub, jax_names.token_in(ctx, _core.mpi_effect), *xs)
    jax_names.set_token_out(ctx, _core.mpi_effect, token_out)
    if not pass_through:
        return xs
    add = jax_names.effect_free_lowering_context(ctx, [zero_aval, *ctx.avals_in], ctx.avals_out)
    return mlir.lower_fun(lambda z, *xs: [_plus(z, x) for x in xs], multiple_results=True)(add, zero, *xs)


def _gpu_fence_lowering(ctx: Any, *xs: Any, pass_through: bool, mpi_order: bool) -> Sequence[Any]:
    if mpi_order:
        return _fence_lowering(ctx, *xs, pass_through=pass_through, mpi_order=mpi_order)
    jax_names.set_token_out(ctx, _core.mpi_effect, jax_names.token_in(ctx, _core.mpi_effect))
    if not pass_through:  # nothing waits for the arrays: the identity
        return xs
    barrier = jax_names.effect_free_lowering_context(ctx, ctx.avals_in, ctx.avals_out)
    return mlir.lower_fun(lambda *xs: list(jax.lax.optimization_barrier(xs)), multiple_results=True)(barrier, *xs)


def _fence_jvp(primals: Sequence[Any], tangents: Sequence[Any], *, pass_through: bool,
               mpi_order: bool) -> tuple[list, list]:
    # Two fences, not one: the primal fence stays in the forward pass when
    # JAX splits a linearised program, the tangent fence becomes the
    # cotangents' fence of the backward pass.
    outs = fence_p.bind(*primals, pass_through=pass_through, mpi_order=mpi_order)
    present = [i for i, t in enumerate(tangents) if not isinstance(t, ad.Zero)]
    fenced = fence_p.bind(*(tangents[i] for i in present), pass_through=pass_through,
                          mpi_order=mpi_order) if present else []
    out_tangents = list(tangents)
    for i, t in zip(present, fenced):
        out_tangents[i] = t
    return outs, out_tangents


def _fence_transpose(cts: Sequence[Any], *xs: Any, pass_through: bool, mpi_order: bool) -> list:
    # Reversed, the roles swap: the fence after a start (pass-through) now
    # stands before the transposed start, where it must only be read; the
    # fence before a wait now stands after the transposed wait, where the
    # cotangents it hands on must wait for it.
    linear = [i for i, x in enumerate(xs) if _core.is_undefined(x)]
    cts_in = [_core.instantiate(cts[i]) for i in linear]
    fenced = fence_p.bind(*cts_in, pass_through=not pass_through, mpi_order=mpi_order) if linear else []
    result: list = [None] * len(xs)
    for i, ct in zip(linear, fenced):
        result[i] = ct
    return result


def _fence_batch(args: Sequence[Any], dims: Sequence[Any], *, pass_through: bool,
                 mpi_order: bool) -> tuple[list, Sequence[Any]]:
    return fence_p.bind(*args, pass_through=pass_through, mpi_order=mpi_order), dims


mlir.register_lowering(fence_p, _fence_lowering, platform="cpu")
if _mpi.BUILD_INFO["cuda"]:
    mlir.register_lowering(fence_p, _gpu_fence_lowering, platform="cuda")
ad.primitive_jvps[fence_p] = _fence_jvp
ad.primitive_transposes[fence_p] = _fence_transpose
batching.primitive_batchers[fence_p] = _fence_batch


def fence(tree: Any, *, pass_through: bool = True, mpi_order: bool = True) -> Any:
    """`tree` (a pytree of arrays), ordered with the MPI operations.

    Every distlinalg operation traced after the fence runs after `tree` has
    been computed; with ``pass_through`` (default), computation on the
    result also runs after every distlinalg operation traced before the
    fence. The identity on values (but −0.0 becomes +0.0 with
    ``pass_through``) and on derivatives. Eagerly a no-op.

    ``pass_through`` costs one elementwise add per array, which XLA fuses
    into its first use when that is elementwise (a stencil); without it
    the fence costs nothing at run time.

    ``mpi_order=False``: only XLA's computations need the order (no MPI
    operation waits for `tree`). Off the CPU the fence is then an
    optimization barrier, or the identity without ``pass_through`` (no
    custom call); the CPU keeps the custom call.
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if not leaves or jax_names.at_top_level():
        return tree
    leaves = [_core.as_array(leaf) for leaf in leaves]
    return jax.tree_util.tree_unflatten(treedef, fence_p.bind(*leaves, pass_through=pass_through, mpi_order=mpi_order))


def overlap(requests: Request | Sequence[Request], fn: Callable[..., Any], *args: Any) -> tuple[Any, Any]:
    """``(wait(requests), fn(*args))``, with `fn` running while the requests are under way.

    Args:
      requests: a :class:`~distlinalg.comm.Request` or a list/tuple of them
        (from iallreduce, iallgather, isend, irecv), started and not yet
        waited for.
      fn: the computation to hide the communication behind; it must not need
        the requests' results.
      *args: `fn`'s arguments (pytrees of arrays).

    Returns:
      ``(results, out)``: what ``wait`` returns for each request (a list for
      a list of requests), and ``fn(*args)``.

    Under jit, `fn` is pinned between the starts and the waits (module
    docstring): without this, XLA may run it before the starts or after the
    waits. Whether the message then moves during `fn` depends on the MPI
    library's progress (README, "Overlapping communication"). Eagerly the
    operations run in program order anyway.

    AD: as the operations and `fn` (forward and reverse mode; in reverse mode
    `fn`'s backward pass runs while the adjoint messages are under way).
    vmap: as the operations and `fn`.

    Example:
      The heart of a pipelined CG: two inner products travel while ``A @ w`` is computed.

      >>> import jax
      >>> import jax.numpy as jnp
      >>> from distlinalg import comm
      >>> A = 2 * jnp.eye(4)
      >>> @jax.jit
      ... def step(r, w):
      ...     request = comm.iallreduce(jnp.stack([jnp.vdot(r, r), jnp.vdot(w, r)]))
      ...     return comm.overlap(request, lambda w: A @ w, w)   # A @ w between start and wait
      >>> dots, q = step(jnp.ones(4), jnp.ones(4))
      >>> dots.tolist() == [4.0 * comm.size()] * 2, q.tolist()
      (True, [2.0, 2.0, 2.0, 2.0])
    """
    single = isinstance(requests, Request)
    listed = [requests] if single else list(requests)
    for request in listed:
        if not isinstance(request, Request):
            raise TypeError(
                "distlinalg.comm.overlap: expected a Request or a list of Requests (from iallreduce, iallgather, "
                f"isend or irecv), got {type(request).__name__}"
            )
    if not listed:  # nothing under way: nothing to order
        return ([] if not single else None), fn(*args)
    if all(_local(request) for request in listed):  # computed at the start: nothing to hide
        return _waited(listed, single), fn(*args)
    # The second fence only reads `out` (the waits follow it); `out` itself
    # is returned through it so that in reverse mode the cotangent passes the
    # transposed fence, which hands it on after the adjoint messages' starts.
    out = fence(fn(*fence(args)), pass_through=False)
    return _waited(listed, single), out


def _waited(listed: list[Request], single: bool) -> Any:
    results = [wait(request) for request in listed]
    return results[0] if single else results


def _local(request: Request) -> bool:
    """Whether `request` is a collective on a one-rank communicator, computed where it started."""
    return request.start in _LOCAL_STARTS and request.comm.size == 1 and _core.elide_one_rank()


# The non-blocking collectives that a one-rank communicator computes locally
# (point-to-point requests still go through MPI there).
_LOCAL_STARTS = frozenset({"iallreduce", "iallgather", "ireduce_scatter"})


__all__ = ["fence", "fence_p", "overlap"]
