"""Vector updates and the inner products of their results in one pass: a Krylov step's vector work.

``fused_update_p`` computes new vectors, each a linear combination of given
vectors (and of the new vectors before it), and inner products among all of
them, reading and writing every vector once. Each new vector may be written
over one of the given ones (``in_place``), so that a loop-carried vector is
updated in its own buffer. Standard CG's

    x ← x + α p,   r ← r − α q,   ρ = ⟨r, r⟩

is one call: x, p, r, q read once, x and r written once (XLA's CPU backend
makes it two update passes and a dot that reads r again: it has no
multi-output fusion). The CPU lowering is an FFI handler
(csrc/fused_update.cc) that runs block by block on XLA's intra-op threads
and accumulates the dots as ``local_dots`` does (float64, pairwise
cascade; the same bits for any thread count). Other platforms, and dtypes
other than float32, float64, complex64 and complex128, lower to the same
arithmetic in jnp.

Operands: ``coefficients`` (``batch + (T,)``, the vectors' dtype), then the
vectors v₀ … v_{n−1} (``batch + shape``, one shape and dtype). Results: the
m new vectors, then the dots (``batch + (D,)``). Parameters, all static:

* ``counts`` (m ints): how many terms each new vector has;
* ``terms`` (T ints): each term's vector, an index into
  L = (v₀, …, v_{n−1}, out₀, …, out_{m−1}); out_j uses outputs before it only;
  out_j = Σ_t coefficients[..., t] · L[terms[t]] over its terms;
* ``dots`` (2D ints): pairs (a, b) of indices into L, each Σ conj(L[a])·L[b]
  over the non-batch dimensions;
* ``in_place`` (m ints): the operand each new vector is written over, or -1;
* ``batch_ndim``: the leading dimensions that are batch dimensions.

AD: the JVP is that of the same arithmetic in jnp (linear in the vectors,
bilinear in coefficients × vectors and in the dots); the tangent program is
ordinary jnp, so it transposes. vmap: the mapped dimension becomes a batch
dimension, of the coefficients too.
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
from .local_dots import HANDLER_DTYPES, leading_batch_rule

MAX_OUTPUTS = 8  # new vectors per call (csrc/fused_update.cc: kMaxOutputs)

fused_update_p = Primitive("distlinalg_fused_update")
fused_update_p.multiple_results = True


def _abstract_eval(coefficients: Any, *vectors: Any, counts, terms, dots, in_place, batch_ndim) -> list[Any]:
    v = vectors[0]
    outs = [jax_names.ShapedArray(v.shape, v.dtype, weak_type=v.weak_type) for _ in counts]
    return outs + [jax_names.ShapedArray(v.shape[:batch_ndim] + (len(dots) // 2,), v.dtype)]


def _reference(coefficients: Any, *vectors: Any, counts, terms, dots, in_place, batch_ndim) -> list[Any]:
    """The same arithmetic in jnp (the JVP, and the lowering off the CPU: `_ordered_reference`)."""
    values = list(vectors)
    extra = vectors[0].ndim - batch_ndim  # the vector dimensions, over which a coefficient broadcasts
    t = 0
    for count in counts:
        new = None
        for index in terms[t:t + count]:
            c = jnp.reshape(coefficients[..., t], coefficients.shape[:-1] + (1,) * extra)
            new = c * values[index] if new is None else new + c * values[index]
            t += 1
        values.append(new)
    axes = tuple(range(batch_ndim, vectors[0].ndim))
    products = [jnp.sum(jnp.conj(values[a]) * values[b], axis=axes, dtype=vectors[0].dtype)
                for a, b in zip(dots[0::2], dots[1::2])]
    batch = vectors[0].shape[:batch_ndim]
    stacked = jnp.stack(products, axis=-1) if products else jnp.zeros(batch + (0,), vectors[0].dtype)
    return values[len(vectors):] + [stacked]


def _ordered_reference(coefficients: Any, *vectors: Any, counts, terms, dots, in_place, batch_ndim) -> list[Any]:
    """`_reference` after the call's ``after`` operands: the lowering off the CPU.

    The CPU handler takes the ``after`` operands (those no term or dot reads)
    as operands, which orders it behind them. XLA's own fusions do not: a
    vector written over in place is read here through an optimization
    barrier together with them, so that its new value is computed after the
    other readers of its old one, and XLA updates the loop slot in place
    instead of copying it (seen in MINRES compiled for an H100: one whole
    vector copied per iteration).
    """
    unread = set(range(len(vectors))) - set(terms) - set(dots)
    waits = [vectors[i] for i in sorted(unread)]
    targets = sorted({i for i in in_place if i >= 0})
    if waits and targets:
        _, ordered = jax.lax.optimization_barrier((waits, [vectors[i] for i in targets]))
        vectors = tuple(ordered[targets.index(i)] if i in targets else v for i, v in enumerate(vectors))
    return _reference(coefficients, *vectors, counts=counts, terms=terms, dots=dots, in_place=in_place,
                      batch_ndim=batch_ndim)


_reference_lowering = mlir.lower_fun(_ordered_reference, multiple_results=True)


def _cpu_lowering(ctx: Any, coefficients: Any, *vectors: Any, counts, terms, dots, in_place, batch_ndim):
    if np.dtype(ctx.avals_in[0].dtype) not in HANDLER_DTYPES:
        return _reference_lowering(ctx, coefficients, *vectors, counts=counts, terms=terms, dots=dots,
                                   in_place=in_place, batch_ndim=batch_ndim)
    # Operand 1 + i is vector i; result j is written over it (XLA copies the
    # operand first only if its old value is still needed afterwards).
    aliases = {1 + i: j for j, i in enumerate(in_place) if i >= 0}
    return jax.ffi.ffi_lowering("distlinalg_fused_update", operand_output_aliases=aliases or None)(
        ctx, coefficients, *vectors, counts=np.asarray(counts, np.int64), terms=np.asarray(terms, np.int64),
        dots=np.asarray(dots, np.int64))


def _jvp(primals: Sequence[Any], tangents: Sequence[Any], **params: Any) -> tuple[Any, Any]:
    outs = fused_update_p.bind(*primals, **params)
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    _, out_tangents = jax.jvp(partial(_reference, **params), list(primals), tangents)
    return outs, out_tangents


fused_update_p.def_abstract_eval(_abstract_eval)
fused_update_p.def_impl(partial(jax_names.apply_primitive, fused_update_p))
mlir.register_lowering(fused_update_p, _reference_lowering)
mlir.register_lowering(fused_update_p, _cpu_lowering, platform="cpu")
ad.primitive_jvps[fused_update_p] = _jvp
batching.primitive_batchers[fused_update_p] = leading_batch_rule(fused_update_p)


def fused_update(
    updates: Sequence[Sequence[tuple[Any, Any]]],
    dots: Sequence[tuple[Any, Any]] = (),
    after: Sequence[Any] = (),
) -> tuple[list[Any], list[Any]]:
    """New vectors ``Σ c·v`` and inner products among old and new vectors, in one pass.

    Args:
      updates: one list of ``(coefficient, vector)`` terms per new vector; a
        vector is an array, or an int j for the j-th new vector (earlier ones
        only). Each new vector is written over the array of its first term
        when that term is an array (in place, if nothing reads that array's
        old value afterwards).
      dots: pairs ``(a, b)``, each an array or an int as above: Σ conj(a)·b.
      after: arrays the call waits for without reading them (operands that
        no term or dot uses). A loop-carried vector is written in place only
        after every reader of its old value: a reader that the call does not
        otherwise depend on goes here (its result, as an ordering).

    All arrays share one shape and dtype (float32/64 or complex64/128 take the
    CPU handler); coefficients are scalars, cast to that dtype. No
    communication.

    Returns:
      ``(new_vectors, dot_values)``.

    Example:
      >>> import jax.numpy as jnp
      >>> from distlinalg._kernels.fused_update import fused_update
      >>> x, p, r, q = jnp.zeros(4), jnp.ones(4), jnp.arange(4.0), jnp.full(4, 2.0)
      >>> (x, r), (rr,) = fused_update([[(1.0, x), (0.5, p)], [(1.0, r), (-0.5, q)]], dots=[(1, 1)])
      >>> x.tolist(), r.tolist(), float(rr)
      ([0.5, 0.5, 0.5, 0.5], [-1.0, 0.0, 1.0, 2.0], 6.0)
    """
    vectors: list[Any] = []
    index_of: dict[int, int] = {}

    def operand(v: Any) -> Any:
        if isinstance(v, int):
            return ("out", v)
        key = id(v)
        if key not in index_of:
            index_of[key] = len(vectors)
            vectors.append(v)
        return ("in", index_of[key])

    if not 1 <= len(updates) <= MAX_OUTPUTS:
        raise ValueError(f"fused_update: 1 to {MAX_OUTPUTS} new vectors per call, got {len(updates)}")
    counts, coefficients, raw_terms, in_place = [], [], [], []
    for j, terms in enumerate(updates):
        if not terms:
            raise ValueError("fused_update: every new vector needs a term")
        counts.append(len(terms))
        for t, (c, v) in enumerate(terms):
            ref = operand(v)
            if ref[0] == "out" and not 0 <= ref[1] < j:
                raise ValueError(f"fused_update: new vector {j} may use new vectors 0..{j - 1} only, got {ref[1]}")
            raw_terms.append(ref)
            coefficients.append(c)
        first = raw_terms[-len(terms)]
        in_place.append(first[1] if first[0] == "in" else -1)
    raw_dots = [operand(v) for pair in dots for v in pair]
    for v in after:
        operand(v)
    for ref in raw_dots:
        if ref[0] == "out" and not 0 <= ref[1] < len(updates):
            raise ValueError(f"fused_update: a dot refers to new vector {ref[1]} of {len(updates)}")
    # A vector is written over once: by the first new vector that starts with it.
    in_place = [i if i >= 0 and in_place.index(i) == j else -1 for j, i in enumerate(in_place)]
    shape, dtype = jnp.shape(vectors[0]), jnp.result_type(vectors[0])
    for v in vectors:
        if jnp.shape(v) != shape or jnp.result_type(v) != dtype:
            raise ValueError(f"fused_update: vectors need one shape and dtype, got {shape} {dtype} and "
                             f"{jnp.shape(v)} {jnp.result_type(v)}")
    n = len(vectors)
    flat = lambda ref: ref[1] if ref[0] == "in" else n + ref[1]  # noqa: E731 - index into L
    weak = jax_names.is_weakly_typed(vectors[0])
    coefficient_array = jnp.stack([jax_names.convert_element_type(c, dtype, weak) for c in coefficients])
    results = fused_update_p.bind(coefficient_array, *vectors, counts=tuple(counts),
                                  terms=tuple(flat(r) for r in raw_terms), dots=tuple(flat(r) for r in raw_dots),
                                  in_place=tuple(in_place), batch_ndim=0)
    return results[:-1], [results[-1][d] for d in range(len(dots))]
