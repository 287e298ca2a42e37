"""Once per solve: the ranks agree on the solve's inputs, in-graph.

One small max-allreduce, before the iteration, carries every input that
steers control flow or that the layout says is the same on every rank:

  * rtol and atol (and their negatives, so the max also gives the min);
  * maxiter, exactly (16-bit halves, exact in any float ≥ float32), or a
    marker for the default;
  * a flag "this rank's inputs are invalid" (a traced rtol that is NaN or
    negative, a traced maxiter below 0; concrete values were checked at
    trace time);
  * the size of b: replicated layout, the global size (it must agree);
    sharded layout, the local block (its max sets the default maxiter);
  * replicated layout only: ‖b‖ and a fixed pseudo-random projection ⟨w, b⟩
    of the user's right-hand side (the norm alone misses a b negated or
    permuted on one rank), with their scales and a "not finite" flag.

Every rank then derives the same verdict from the same message: whether the
inputs agree, and the values the iteration uses (the max over ranks of rtol
and atol, the iteration limit), so the loop's control flow is identical on
every rank by construction even when the verdict is "inconsistent" (the
solve then stops at iteration 0 with ``Reason.DIVERGED_INCONSISTENT_RANKS``).

The right-hand side is compared before the replicated driver averages it
over ranks (see `_driver`), and only for the primal solve: tangents and
cotangents may legitimately differ between ranks.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..comm.allreduce import allreduce
from . import _arguments
from . import _common as C
from ._vectors import common_dtype, scalar_dtype

_HALF = 1 << 16  # maxiter is sent as two 16-bit halves (exact in float32)
_SIZE_HALF = 1 << 20  # sizes as hi * 2^20 + lo: exact in float32 up to 2^44


class Agreement(NamedTuple):
    """The verdict on a solve's inputs, identical on every rank."""

    consistent: Any  # bool scalar (Python True when nothing needed checking)
    rtol: Any  # the max over ranks (equal to every rank's value when consistent)
    atol: Any
    maxiter: Any  # Python int or int32 scalar; identical wherever it is used


def agree_inputs(b: Any, problem: _arguments.Problem) -> Agreement:
    """Compare the inputs across ranks (one allreduce; none on one rank)."""
    red = problem.reductions
    comm, layout = red.comm, red.layout
    dtype = _message_dtype(b)
    if comm.size == 1:
        maxiter = problem.maxiter if problem.maxiter is not None else _arguments.default_maxiter(b)
        consistent = True if problem.invalid is False else ~problem.invalid
        return Agreement(consistent, problem.rtol, problem.atol, maxiter)
    b = jax.lax.stop_gradient(b)
    entries: list[Any] = []

    # Each entry goes into one message; `pair` gives back (max, min) over
    # ranks (min = −max of −v), `single` the max. No entry is ever NaN (see
    # `_finite` and `_rhs_statistics`), so every verdict is well defined.
    def pair(value):
        at = len(entries)
        entries.extend([value, -value])
        return lambda m: (m[at], -m[at + 1])

    def single(value):
        at = len(entries)
        entries.append(value)
        return lambda m: m[at]

    rtol = _finite(jnp.asarray(problem.rtol, dtype))
    atol = _finite(jnp.asarray(problem.atol, dtype))
    rtol_at, atol_at = pair(rtol), pair(atol)
    maxiter_at = [pair(jnp.asarray(half, dtype)) for half in _halves(problem.maxiter, _HALF)]
    invalid_at = single(jnp.asarray(problem.invalid, dtype))
    local_size = _arguments.global_size(b)
    if layout == "replicated":
        size_at = [pair(jnp.asarray(h, dtype)) for h in _halves(local_size, _SIZE_HALF)]
        stats = _rhs_statistics(b, dtype)
        norm_at, projection_at = pair(stats.norm), pair(stats.projection)
        scale_at, nonfinite_at = single(stats.scale), single(stats.nonfinite)
    else:
        block_at = single(jnp.asarray(local_size, dtype))

    m = allreduce(jnp.stack([jnp.asarray(e, dtype) for e in entries]), "max", comm=comm)
    tol = C.consistency_tolerance(dtype)
    ok = _close(*rtol_at(m), tol) & _close(*atol_at(m), tol) & (invalid_at(m) == 0)
    for at in maxiter_at:
        ok = ok & _equal(*at(m))
    if layout == "replicated":
        for at in size_at:
            ok = ok & _equal(*at(m))
        # A b that is not finite somewhere is left to the iteration, which
        # reports DIVERGED_NANORINF on every rank.
        b_same = _close(*norm_at(m), tol) & _within(*projection_at(m), tol * scale_at(m))
        ok = ok & ((nonfinite_at(m) > 0) | b_same)
    if problem.maxiter is not None:
        maxiter = problem.maxiter  # equal on every rank wherever `ok` (else unused)
    elif layout == "replicated":
        maxiter = _arguments.default_maxiter(b)
    else:
        maxiter = _sharded_default(block_at(m), comm.size)
    return Agreement(ok, rtol_at(m)[0], atol_at(m)[0], maxiter)


def _message_dtype(b: Any) -> Any:
    """The real dtype of the solve, at least float32 (maxiter halves stay exact)."""
    dtype = scalar_dtype(b)
    real = jnp.finfo(dtype).dtype if jnp.issubdtype(dtype, jnp.inexact) else jnp.result_type(float)
    return common_dtype(real, jnp.float32)


def _finite(value: Any) -> Any:
    # An invalid (NaN) traced tolerance is flagged separately; in the message
    # it becomes 0 so that no comparison below sees a NaN.
    return jnp.where(jnp.isfinite(value), value, jnp.zeros_like(value))


def _halves(value: Any, base: int) -> list[Any]:
    """`value` as (value // base, value % base); (−1, −1) for None (the default)."""
    if value is None:
        return [-1, -1]
    if _arguments.is_traced(value):
        value = jnp.maximum(value, 0)
        return [value // base, value % base]
    return [int(value) // base, int(value) % base]


def _equal(high: Any, low: Any) -> Any:
    return high == low


def _close(high: Any, low: Any, tol: float) -> Any:
    return jnp.abs(high - low) <= tol * jnp.maximum(jnp.abs(high), jnp.abs(low))


def _within(high: Any, low: Any, bound: Any) -> Any:
    return jnp.abs(high - low) <= bound


def _sharded_default(largest_block: Any, size: int) -> Any:
    """10 × ranks × the largest block, identical on every rank (int32, no overflow).

    The block sizes come out of the message as floats; a float32 message
    rounds blocks beyond 2^24 entries, identically on every rank, which is
    irrelevant for a default.
    """
    per_block = 10 * size
    blocks = jnp.minimum(largest_block, float(1 << 30)).astype(jnp.int32)
    return jnp.minimum(blocks, _arguments.INT32_MAX // per_block) * per_block


class _RhsStatistics(NamedTuple):
    norm: Any  # ‖b‖
    projection: Any  # ⟨w, b⟩, w fixed pseudo-random in [−½, ½)
    scale: Any  # Σ |w_i| |b_i|: what rounding of b can change ⟨w, b⟩ by, per eps
    nonfinite: Any  # 1 where b has a NaN or an infinity


def _rhs_statistics(b: Any, dtype: Any) -> _RhsStatistics:
    """Scalars of this rank's replicated right-hand side to compare across ranks.

    Computed on b / max|b| (rescaled afterwards) so that neither a tiny nor a
    huge b under- or overflows in the squares. The weights come from an
    integer hash of the global index (exact and identical on every rank,
    whatever the float rounding).
    """
    parts = []
    for leaf in jax.tree_util.tree_leaves(b):
        leaf = jnp.ravel(jnp.asarray(leaf))
        if jnp.iscomplexobj(leaf):
            parts += [jnp.real(leaf), jnp.imag(leaf)]
        else:
            parts.append(leaf)
    if not parts:
        zero = jnp.zeros((), dtype)
        return _RhsStatistics(zero, zero, zero, zero)
    largest = jnp.max(jnp.stack([jnp.max(jnp.abs(p), initial=0).astype(dtype) for p in parts]))
    nonfinite = ~jnp.isfinite(largest)
    scale = jnp.where((largest > 0) & ~nonfinite, largest, jnp.ones_like(largest))
    squares, projection, absolute, offset = jnp.zeros((), dtype), jnp.zeros((), dtype), jnp.zeros((), dtype), 0
    for part in parts:
        v = part.astype(dtype) / scale
        w = _weights(offset, v.size, dtype)
        offset += v.size
        squares = squares + jnp.sum(v * v)
        projection = projection + jnp.sum(w * v)
        absolute = absolute + jnp.sum(jnp.abs(w) * jnp.abs(v))
    stats = _RhsStatistics(scale * jnp.sqrt(squares), scale * projection, scale * absolute,
                           nonfinite.astype(dtype))
    # Not finite: every statistic becomes 0 and the flag says why.
    return _RhsStatistics(*(jnp.where(nonfinite, jnp.zeros_like(s), s) for s in stats[:3]), stats.nonfinite)


def _weights(offset: int, count: int, dtype: Any) -> Any:
    """w_i ∈ [−½, ½) for global indices offset..offset+count−1 (Knuth's multiplicative hash)."""
    index = jnp.arange(count, dtype=jnp.uint32) + np.uint32(offset % (1 << 32))
    hashed = index * np.uint32(2654435761)
    return (hashed >> np.uint32(8)).astype(dtype) / float(1 << 24) - 0.5
