"""Machinery shared by every communication primitive.

Each primitive family lives in its own module (abstract eval, lowering, JVP,
transpose and batching rule side by side); this module supplies what they
share: the ordered MPI effect, primitive construction, the token-threading FFI
lowering, and small helpers for the AD rules.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive

from .. import _compat
from .._compat import ad, batching, mlir
from .._mpi import Communicator


class MPIEffect(_compat.Effect):
    """Ordered effect of every MPI operation.

    XLA threads one token through all primitives carrying it, so collectives
    execute in program order on every rank and are never removed as dead code.
    """

    def __repr__(self) -> str:
        return "MPIEffect"

    __str__ = __repr__


mpi_effect = MPIEffect()
_compat.register_ordered_effect(MPIEffect)


def new_primitive(name: str, *, multiple_results: bool = False) -> Primitive:
    """A primitive with eager evaluation through a compiled single-op program."""
    prim = Primitive(f"distlinalg_{name}")
    prim.multiple_results = multiple_results
    prim.def_impl(partial(_compat.apply_primitive, prim))
    return prim


def def_abstract_eval(prim: Primitive, shape_rule: Callable[..., Any]) -> None:
    """Register `shape_rule(*avals, **params) -> aval(s)` with the MPI effect."""

    def abstract_eval(*avals, **params):
        return shape_rule(*avals, **params), {mpi_effect}

    prim.def_effectful_abstract_eval(abstract_eval)


def shaped(shape: Sequence[int], dtype: Any) -> Any:
    return _compat.ShapedArray(tuple(shape), dtype)


def register_lowering(
    prim: Primitive,
    target: str,
    attrs: Callable[..., dict[str, Any]],
    *,
    aliases: dict[int, int] | None = None,
    token_only_result: bool = False,
) -> None:
    """CPU lowering of `prim` to the FFI handler `target`, threading the token.

    Args:
      attrs: params -> the handler's attributes (numpy scalars of their types).
      aliases: operand index -> result index (indices of the array operands
        and results, not counting the token) that may share a buffer.
      token_only_result: the handler returns only the token (send, barrier).
    """
    alias_map = None
    if aliases:
        alias_map = {i + 1: o + 1 for i, o in aliases.items()}

    def lowering(ctx, *operands, **params):
        token = _compat.token_in(ctx, mpi_effect)
        avals_out = [] if token_only_result else list(ctx.avals_out)
        sub = _compat.replace_lowering_avals(
            ctx,
            [_compat.abstract_token, *ctx.avals_in],
            [_compat.abstract_token, *avals_out],
        )
        extra = {"operand_output_aliases": alias_map} if alias_map else {}
        rule = jax.ffi.ffi_lowering(target, has_side_effect=True, **extra)
        token_out, *results = rule(sub, token, *operands, **attrs(**params))
        _compat.set_token_out(ctx, mpi_effect, token_out)
        return results

    mlir.register_lowering(prim, lowering, platform="cpu")


def comm_attr(comm: Communicator) -> np.int64:
    return np.int64(comm.handle)


# ---------------------------------------------------------------------------
# AD helpers
def instantiate(ct: Any) -> Any:
    """A concrete array for a possibly symbolic-zero (co)tangent.

    Rules call this before communicating: a rank whose (co)tangent is a
    symbolic zero must still take part in the collective its peers post.
    """
    return ad.instantiate_zeros(ct)


def is_undefined(x: Any) -> bool:
    return ad.is_undefined_primal(x)


def moveaxis_or_broadcast(x: Any, bdim: Any, target: int, size: int) -> Any:
    """Put the batch dimension of `x` at `target` (broadcasting if unbatched)."""
    if bdim is _compat.not_mapped:
        x = jnp.broadcast_to(x, (size, *np.shape(x)))
        bdim = 0
    return jnp.moveaxis(x, bdim, target)


not_mapped = _compat.not_mapped


def inexact(dtype: Any) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.inexact))


def float0_zeros(aval: Any) -> Any:
    return np.zeros(aval.shape, jax.dtypes.float0)


def tree_apply(fn: Callable[[Any], Any], tree: Any) -> Any:
    """Apply a per-array operation to every leaf of a pytree."""
    return jax.tree_util.tree_map(fn, tree)


__all__ = [
    "MPIEffect",
    "mpi_effect",
    "new_primitive",
    "def_abstract_eval",
    "shaped",
    "register_lowering",
    "comm_attr",
    "instantiate",
    "is_undefined",
    "moveaxis_or_broadcast",
    "not_mapped",
    "inexact",
    "tree_apply",
    "ad",
    "batching",
]
