"""Local inner products of several vector pairs in one pass: the solvers' dots.

``local_dots([(x₀, y₀), (x₁, y₁), …])`` is ``[Σ conj(x₀)·y₀, Σ conj(x₁)·y₁, …]``
over this rank's pieces, without communication (the solvers allreduce the
results). It exists for speed on the CPU, where XLA computes ``jnp.vdot`` as
a multiply that writes the product vector and reductions that read it back
(four passes over memory for two input vectors), and a Krylov iteration
spent much of its time in its dots (benchmarks/README.md, section "Local
dots"). The CPU lowering is an FFI handler (csrc/local_dots.cc) that reads
each vector once, all pairs block by block (a vector in two pairs, such as
r in ⟨r, u⟩ and ⟨r, r⟩, is read from memory once), with XLA's intra-op
threads; it accumulates in float64 with a
pairwise cascade, so its rounding error is at most that of XLA's tree
reduction. Other platforms, and dtypes other than float32, float64,
complex64 and complex128, lower to ``sum(conj(x) * y)``.

The primitive's operands are x₀, y₀, x₁, y₁, …, each pair of one dtype and
shape; the first ``batch_ndim`` dimensions are batch dimensions (result i has
shape ``x_i.shape[:batch_ndim]``), the rest are summed over.

AD: bilinear. d⟨x, y⟩ = conj(⟨y, dx⟩) + ⟨x, dy⟩ (one more call over the
tangents); transposed, ⟨x, ·⟩ gives conj(x)·ct and ⟨·, y⟩ gives
conj(ct·y) (JAX's convention for complex linear maps: that of
``jnp.vdot``). vmap: the mapped dimension becomes a batch dimension.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive

from .._runtime import jax_names
from .._runtime.jax_names import ad, batching, mlir
from ..comm._core import moveaxis_or_broadcast

# The dtypes of the CPU handler; others lower to jnp.
HANDLER_DTYPES = frozenset(np.dtype(d) for d in ("float32", "float64", "complex64", "complex128"))

local_dots_p = Primitive("distlinalg_local_dots")
local_dots_p.multiple_results = True


def _pairs(operands: Sequence[Any]) -> list[tuple[Any, Any]]:
    return list(zip(operands[0::2], operands[1::2]))


def _abstract_eval(*avals: Any, batch_ndim: int) -> list[Any]:
    return [jax_names.ShapedArray(x.shape[:batch_ndim], x.dtype, weak_type=x.weak_type and y.weak_type)
            for x, y in _pairs(avals)]


def _sum_of_products(*operands: Any, batch_ndim: int) -> list[Any]:
    """The reference: Σ conj(x)·y over the non-batch dimensions, with jnp."""
    return [jnp.sum(jnp.conj(x) * y, axis=tuple(range(batch_ndim, x.ndim)), dtype=x.dtype)
            for x, y in _pairs(operands)]


_reference_lowering = mlir.lower_fun(_sum_of_products, multiple_results=True)


def _cpu_lowering(ctx: Any, *operands: Any, batch_ndim: int) -> Sequence[Any]:
    if all(np.dtype(aval.dtype) in HANDLER_DTYPES for aval in ctx.avals_in):
        return jax.ffi.ffi_lowering("distlinalg_local_dots")(ctx, *operands)
    return _reference_lowering(ctx, *operands, batch_ndim=batch_ndim)


def _jvp(primals: Sequence[Any], tangents: Sequence[Any], *, batch_ndim: int) -> tuple[list, list]:
    outs = local_dots_p.bind(*primals, batch_ndim=batch_ndim)
    # d⟨x, y⟩ = conj(⟨y, dx⟩) + ⟨x, dy⟩, every pair's terms in one call.
    operands, terms = [], []
    for i, ((x, y), (dx, dy)) in enumerate(zip(_pairs(primals), _pairs(tangents))):
        if not isinstance(dx, ad.Zero):
            operands += [y, dx]
            terms.append((i, True))
        if not isinstance(dy, ad.Zero):
            operands += [x, dy]
            terms.append((i, False))
    values = local_dots_p.bind(*operands, batch_ndim=batch_ndim) if operands else []
    out_tangents = [jnp.zeros_like(out) for out in outs]
    for (i, conjugate), value in zip(terms, values):
        out_tangents[i] = out_tangents[i] + (jnp.conj(value) if conjugate else value)
    return outs, out_tangents


def _transpose(cts: Sequence[Any], *operands: Any, batch_ndim: int) -> list[Any]:
    result: list[Any] = [None] * len(operands)
    for i, ((x, y), ct) in enumerate(zip(_pairs(operands), cts)):
        x_linear, y_linear = ad.is_undefined_primal(x), ad.is_undefined_primal(y)
        if x_linear and y_linear:
            raise NotImplementedError("distlinalg local_dots: transpose of a product of two linear inputs")
        if type(ct) is ad.Zero or not (x_linear or y_linear):
            continue
        aval = x.aval if x_linear else y.aval
        ct = jnp.reshape(ct, ct.shape + (1,) * (len(aval.shape) - batch_ndim))  # over the summed dimensions
        if y_linear:  # ⟨x, ·⟩: ct ↦ conj(x)·ct
            result[2 * i + 1] = (jnp.conj(x) * ct).astype(aval.dtype)
        else:         # ⟨·, y⟩ = conj(⟨y, ·⟩): ct ↦ conj(ct·y)
            result[2 * i] = jnp.conj(ct * y).astype(aval.dtype)
    return result


def leading_batch_rule(prim: Primitive) -> Any:
    """The vmap rule of a primitive whose operands all share ``batch_ndim``
    leading batch dimensions (local_dots, fused_update): the mapped dimension
    becomes one more, in front; an unbatched operand is broadcast (read once
    per batch entry)."""

    def rule(args: Sequence[Any], dims: Sequence[Any], *, batch_ndim: int, **params: Any) -> tuple[list, list]:
        size = next(a.shape[d] for a, d in zip(args, dims) if d is not jax_names.not_mapped)
        moved = [moveaxis_or_broadcast(a, d, 0, size) for a, d in zip(args, dims)]
        outs = prim.bind(*moved, batch_ndim=batch_ndim + 1, **params)
        return outs, [0] * len(outs)

    return rule


local_dots_p.def_abstract_eval(_abstract_eval)
local_dots_p.def_impl(partial(jax_names.apply_primitive, local_dots_p))
mlir.register_lowering(local_dots_p, _reference_lowering)
mlir.register_lowering(local_dots_p, _cpu_lowering, platform="cpu")
ad.primitive_jvps[local_dots_p] = _jvp
ad.primitive_transposes[local_dots_p] = _transpose
batching.primitive_batchers[local_dots_p] = leading_batch_rule(local_dots_p)


def local_dots(pairs: Sequence[tuple[Any, Any]]) -> list[Any]:
    """``[Σ conj(x)·y for x, y in pairs]``, each pair of arrays of one shape and dtype.

    Every pair is read in one pass over memory (module docstring); no
    communication. Returns scalars of the pairs' dtypes.

    Example:
      >>> import jax.numpy as jnp
      >>> from distlinalg._kernels.local_dots import local_dots
      >>> r, u = jnp.arange(4.0), jnp.ones(4)
      >>> [float(v) for v in local_dots([(r, u), (r, r)])]
      [6.0, 14.0]
    """
    operands = []
    for x, y in pairs:
        x, y = jnp.asarray(x), jnp.asarray(y)
        if x.shape != y.shape or x.dtype != y.dtype:
            raise ValueError(f"local_dots: a pair needs one shape and dtype, got {x.shape} {x.dtype} and "
                             f"{y.shape} {y.dtype}")
        operands += [x, y]
    return local_dots_p.bind(*operands, batch_ndim=0) if operands else []
