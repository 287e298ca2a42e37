"""Vector algebra of the Krylov recurrences, on pytrees of this rank's pieces.

Every update keeps each leaf in its own dtype: the recurrences' scalars are
real (norms, HPD inner products) or of the system's dtype, and are cast to
each leaf before use, so the solvers run under
``jax_numpy_dtype_promotion="strict"`` and keep weakly typed inputs weak.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._runtime import jax_names
from ..comm.overlap import fence
from .._kernels.fused_update import fused_update
from .._kernels.local_dots import HANDLER_DTYPES, local_dots

# Below this many bytes per rank, a carried vector's copy costs about what
# the fence that avoids it does (one FFI call); figures in
# benchmarks/README.md, section "In-place carried vectors".
_IN_PLACE_MIN_BYTES = 64 * 1024
# Below this many bytes per leaf, XLA's fused vdot is as fast as a call of
# the local-dots handler, whose gain grows with the leaf; figures in
# benchmarks/README.md, section "Local dots".
_LOCAL_DOTS_MIN_BYTES = 8 * 1024
# The same for a fused update (one FFI call against XLA's fused elementwise ops).
_FUSED_UPDATE_MIN_BYTES = 8 * 1024


def as_coefficient(alpha: Any, leaf: Any) -> Any:
    """The scalar `alpha` in `leaf`'s dtype (and weak type); real leaves take Re alpha."""
    if not jnp.iscomplexobj(leaf) and jnp.iscomplexobj(alpha):
        alpha = jnp.real(alpha)
    return jax_names.convert_element_type(alpha, jnp.result_type(leaf), jax_names.is_weakly_typed(leaf))


def axpy(alpha: Any, x: Any, y: Any) -> Any:
    """α x + y."""
    return jax.tree_util.tree_map(lambda a, b: as_coefficient(alpha, b) * a.astype(b.dtype) + b, x, y)


def xpby(x: Any, beta: Any, y: Any) -> Any:
    """x + β y."""
    return jax.tree_util.tree_map(lambda a, b: a + as_coefficient(beta, a) * b.astype(a.dtype), x, y)


def sub(x: Any, y: Any) -> Any:
    """x − y."""
    return jax.tree_util.tree_map(jnp.subtract, x, y)


def scale(alpha: Any, x: Any) -> Any:
    """α x."""
    return jax.tree_util.tree_map(lambda a: as_coefficient(alpha, a) * a, x)


def after(done: Any, carried: Any) -> Any:
    """`carried`, for uses that must come after `done` is computed: lets XLA
    update a loop-carried vector in place.

    A Krylov step reads the old value of a carried vector v in two unordered
    updates, e.g. x ← x + α v and v ← z + β v. XLA must then assume that the
    x update might run after the new v is written, so it cannot write the
    new v over the old one and copies v at the top of every iteration (a
    whole extra read and write). Passing v to the second update as
    ``after(x, v)`` orders the two: a fence (comm.overlap) reads `done` and
    hands `carried` on (v + 0, fused into its use; nothing is copied).
    What it saves: benchmarks/README.md, section "In-place carried vectors".

    Off the CPU the fence is an optimization barrier (``mpi_order=False``):
    XLA's GPU compiler honours it, and the loop body gets no custom call
    (one FFI call per use, each a launch on the stream).

    Vectors below 64 KiB per rank are returned as they are (their copy is
    cheap). Values and derivatives are the identity; the fence has no
    effect on what is computed, only on when.
    """
    leaves = jax.tree_util.tree_leaves(carried)
    if sum(leaf.size * leaf.dtype.itemsize for leaf in leaves) < _IN_PLACE_MIN_BYTES:
        return carried
    return fence((done, carried), mpi_order=False)[1]


def zeros_like(x: Any) -> Any:
    """0 shaped like x."""
    return jax.tree_util.tree_map(jnp.zeros_like, x)


def local_vdot(x: Any, y: Any) -> Any:
    """Σ conj(x)·y over all leaves of this rank's pieces (complex when inputs are).

    Leaves of different dtypes (a real and a complex leaf in one pytree) are
    summed in their common dtype, explicitly (strict dtype promotion).
    """
    return local_vdots([(x, y)])[0]


def local_vdots(pairs: Sequence[tuple[Any, Any]]) -> list[Any]:
    """``[local_vdot(x, y) for x, y in pairs]``, reading every large leaf once.

    Leaf pairs of 8 KiB and more in float32/64 or complex64/128 go to one
    ``local_dots`` call (one pass over all of them; on the CPU faster than
    XLA's vdot, see distlinalg._kernels.local_dots and benchmarks/README.md,
    section "Local dots"); smaller ones, where the call costs more than it
    saves, and other dtypes to ``jnp.vdot``. Which path a leaf
    takes depends on its size on this rank only: it changes the rounding of
    a local sum, never what is communicated.
    """
    parts: list[list[Any]] = [[] for _ in pairs]
    batched, where = [], []
    for i, (x, y) in enumerate(pairs):
        for a, b in zip(jax.tree_util.tree_leaves(x), jax.tree_util.tree_leaves(y)):
            a, b = jnp.asarray(a), jnp.asarray(b)
            if (a.shape == b.shape and a.dtype == b.dtype and np.dtype(a.dtype) in HANDLER_DTYPES
                    and a.size * a.dtype.itemsize >= _LOCAL_DOTS_MIN_BYTES):
                batched.append((a, b))
                where.append(i)
            else:
                parts[i].append(jnp.vdot(a, b, precision=jax.lax.Precision.HIGHEST))
    for i, value in zip(where, local_dots(batched)):
        parts[i].append(value)
    return [_sum_in_common_dtype(values) for values in parts]


def _sum_in_common_dtype(values: Sequence[Any]) -> Any:
    """Σ of one inner product's per-leaf values, in the dtype that holds them all."""
    dtype = common_dtype(*[v.dtype for v in values])
    values = [v.astype(dtype) for v in values]
    return sum(values[1:], values[0])


class Update(NamedTuple):
    """A new vector of `update_and_dots`: ``name ← Σ c·v`` over `terms`.

    `terms` are ``(coefficient, vector)`` pairs; a vector is a pytree (an old
    vector), or the name of a new vector of an earlier `Update` of the same
    call. The new vector has the dtypes of its first term's vector and is
    written over it where nothing reads that vector's old value afterwards
    (a loop-carried vector stays in its buffer).
    """

    name: str
    terms: Sequence[tuple[Any, Any]]


class Dot(NamedTuple):
    """An inner product of `update_and_dots`: Σ conj(a)·b over this rank's
    leaves (no communication), `a` and `b` each a pytree (an old vector) or
    the name of a new vector of the same call."""

    a: Any
    b: Any


class _New(NamedTuple):
    """The j-th new vector of an `update_and_dots` call (a name, resolved)."""

    index: int


def _resolve(updates: Sequence[Update], dots: Sequence[Dot]) -> tuple[list[list[tuple[Any, Any]]], list[tuple]]:
    """The updates' terms and the dots with every name replaced by its `_New` index."""
    index: dict[str, int] = {}

    def vector(v: Any, what: str) -> Any:
        if not isinstance(v, str):
            return v
        if v not in index:
            raise ValueError(f"update_and_dots: {what} names {v!r}, which is not a new vector defined before it "
                             f"(new vectors so far: {sorted(index)})")
        return _New(index[v])

    terms = []
    for j, update in enumerate(updates):
        if not isinstance(update, Update) or not isinstance(update.name, str):
            raise TypeError(f"update_and_dots: the new vectors are Update(name, terms), got {update!r}")
        if update.name in index:
            raise ValueError(f"update_and_dots: two new vectors named {update.name!r}")
        terms.append([(c, vector(v, f"the update of {update.name!r}")) for c, v in update.terms])
        index[update.name] = j
    pairs = [(vector(a, "a dot"), vector(b, "a dot")) for a, b in dots]
    return terms, pairs


def update_and_dots(
    *updates: Update,
    dots: Sequence[Dot] = (),
    wait_for: Any = None,
) -> tuple[tuple[Any, ...], list[Any]]:
    """New vectors ``Σ c·v`` and this rank's inner products of old and new ones, in one pass.

    Args:
      updates: the new vectors, each an `Update` (its name, and its terms
        ``(coefficient, vector)``), computed in this order: a term may name
        a new vector of an earlier `Update`. Old vectors are pytrees, all of
        one structure.
      dots: `Dot` pairs of vectors (pytrees, or names of new vectors): Σ
        conj(a)·b over this rank's leaves (no communication), as `local_vdots`.
      wait_for: a vector (pytree of the same structure) whose computation
        must come first, as in `after`: the last reader of the old value of
        a vector written over here, when nothing else orders the two.

    Returns:
      ``(new_vectors, dot_values)``: the new vectors in the order of
      `updates`, and one value per `Dot`.

    Leaves of 8 KiB and more in float32/64 or complex64/128, of one shape and
    dtype across the vectors, go to one ``fused_update`` call per leaf (every
    vector read once, the new ones written once, the dots taken on the fly);
    the others are computed with jnp and `local_vdots`. Which path a leaf
    takes depends on its local size only.

    Example: standard CG's step, x ← x + α p, r ← r − α q, ρ = ⟨r, r⟩ of the new r::

      (x, r), (rho,) = update_and_dots(Update("x", [(1, x), (alpha, p)]),
                                       Update("r", [(1, r), (-alpha, q)]),
                                       dots=[Dot("r", "r")])
    """
    terms_of, pairs = _resolve(updates, dots)
    trees = {id(v): v for terms in terms_of for _, v in terms if not isinstance(v, _New)}
    trees.update({id(v): v for pair in pairs for v in pair if not isinstance(v, _New)})
    treedef = jax.tree_util.tree_structure(next(iter(trees.values())))
    leaves = {key: treedef.flatten_up_to(tree) for key, tree in trees.items()}
    waits = [] if wait_for is None else treedef.flatten_up_to(wait_for)
    new_leaves: list[list[Any]] = [[] for _ in terms_of]
    parts: list[list[Any]] = [[] for _ in pairs]  # each dot's value per leaf
    for i in range(treedef.num_leaves):
        def leaf(v: Any) -> Any:
            return v.index if isinstance(v, _New) else leaves[id(v)][i]

        def value(v: Any) -> Any:
            return new_leaves[v.index][i] if isinstance(v, _New) else leaves[id(v)][i]

        given = [jnp.asarray(vs[i]) for vs in [*leaves.values(), *([waits] if waits else [])]]
        first = given[0]
        if (np.dtype(first.dtype) in HANDLER_DTYPES and first.size * first.dtype.itemsize >= _FUSED_UPDATE_MIN_BYTES
                and all(g.shape == first.shape and g.dtype == first.dtype for g in given)):
            outs, values = fused_update([[(as_coefficient(c, first), leaf(v)) for c, v in terms] for terms in terms_of],
                                        [(leaf(a), leaf(b)) for a, b in pairs], after=[waits[i]] if waits else [])
            for j, out in enumerate(outs):
                new_leaves[j].append(out)
        else:
            for j, terms in enumerate(terms_of):
                target = jnp.asarray(value(terms[0][1]))
                if waits and j == 0:
                    target = after(waits[i], target)
                new_leaves[j].append(sum(
                    (as_coefficient(c, target) * jnp.asarray(value(v)).astype(target.dtype) for c, v in terms[1:]),
                    as_coefficient(terms[0][0], target) * target))
            values = local_vdots([(value(a), value(b)) for a, b in pairs]) if pairs else []
        for d, v in enumerate(values):
            parts[d].append(v)
    return tuple(treedef.unflatten(new) for new in new_leaves), [_sum_in_common_dtype(values) for values in parts]


def common_dtype(*dtypes: Any) -> Any:
    """The dtype that holds all of `dtypes`, by JAX's standard promotion (also
    under ``jax_numpy_dtype_promotion="strict"``: callers cast explicitly)."""
    with jax.numpy_dtype_promotion("standard"):
        return jnp.result_type(*dtypes)


def scalar_dtype(tree: Any) -> Any:
    """The dtype of the recurrences' scalars for vectors shaped like `tree`."""
    return common_dtype(*[jnp.result_type(leaf) for leaf in jax.tree_util.tree_leaves(tree)])


def real_dtype(tree: Any) -> Any:
    """The real dtype of norms of vectors shaped like `tree` (float for integer vectors)."""
    dtype = scalar_dtype(tree)
    return jnp.finfo(dtype).dtype if jnp.issubdtype(dtype, jnp.inexact) else jnp.result_type(float)
