"""What the eigensolvers share: their static parameters, start vectors, blocks of vectors.

A *block* is a pytree whose leaves carry a leading axis (the vector index):
the Lanczos basis, LOBPCG's X, W and P, the returned eigenvectors. Inner
products of blocks are local matrices summed over ranks in one allreduce
(sharded layout) or taken locally (replicated layout), as
:class:`~distlinalg.solvers._common.Reductions` does for vectors.
"""

from __future__ import annotations

import functools

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._runtime.mpi import Communicator
from . import _arguments
from ._common import Reductions

WHICH = ("SA", "LA", "SM", "LM")
CONVERGED, MAX_ITERATIONS = 1, -3


class Params(NamedTuple):
    """The static part of an eigensolve (hashable: custom_jvp's non-differentiated argument)."""

    k: int
    which: str
    ncv: int            # Lanczos: basis size; LOBPCG: unused (its basis is 3k)
    cycles: int         # Lanczos: restart cycles; LOBPCG: iterations
    tol: float
    layout: str
    comm: Communicator
    method: str = "lanczos"
    operator_consts: int = 0   # how many of the closure-converted constants are A's (the rest are M's)
    sigma: float | None = None  # shift-invert: Lanczos on (A − σI)⁻¹, the eigenvalues nearest σ


class Found(NamedTuple):
    """What a method returns: the k wanted Ritz pairs (most wanted first) and its counts."""

    theta: Any        # (k,) Ritz values
    X: Any            # block of k Ritz vectors, orthonormal
    iterations: Any   # Lanczos steps / LOBPCG iterations
    restarts: Any     # Lanczos restart cycles (LOBPCG: 0)
    matvecs: Any      # applications of A
    converged: Any    # how many of the k pairs met the tolerance (identical on every rank)


def template(A: Any, v0: Any) -> Any:
    """A vector shaped like A's input on this rank."""
    if v0 is not None:
        return _arguments.as_arrays(v0)
    structure = getattr(A, "input_structure", None)
    if structure is not None:
        return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), structure)
    if isinstance(A, (np.ndarray, jax.Array)) and jnp.ndim(A) == 2:
        return jnp.zeros(A.shape[1], A.dtype)
    shape = getattr(A, "shape", None)
    if shape is not None and len(shape) == 2:
        return jnp.zeros(shape[1], getattr(A, "dtype", float))
    raise ValueError("distlinalg.eigsh: pass v0 (the operator does not say the shape of its vectors)")


def start_vector(template: Any, v0: Any, dtype: Any, comm: Communicator, layout: str, salt: Any = 0) -> Any:
    """v0, or a fixed pseudo-random vector (this rank's rows of one global vector when sharded;
    `salt` (possibly traced, identical on every rank) gives further ones)."""
    if v0 is not None:
        return jax.tree_util.tree_map(lambda leaf: jnp.asarray(leaf, dtype), template)
    key = jax.random.fold_in(jax.random.PRNGKey(2026), salt)
    if layout == "sharded":
        key = jax.random.fold_in(key, comm.rank)
    leaves, treedef = jax.tree_util.tree_flatten(template)
    keys = jax.random.split(key, len(leaves))
    real = jnp.finfo(dtype).dtype
    made = []
    for sub, leaf in zip(keys, leaves):
        re, im = jax.random.split(sub)
        value = jax.random.uniform(re, jnp.shape(leaf), real, -1.0, 1.0)
        if jnp.issubdtype(dtype, jnp.complexfloating):
            value = value + 1j * jax.random.uniform(im, jnp.shape(leaf), real, -1.0, 1.0)
        made.append(value.astype(dtype))
    return jax.tree_util.tree_unflatten(treedef, made)


def vector_dtype(vector: Any) -> Any:
    """The dtype of a vector (or block): of its leaves together."""
    return jnp.result_type(*jax.tree_util.tree_leaves(vector))


def wanted_key(theta: Any, which: str) -> Any:
    """Smaller is more wanted."""
    return {"SA": theta, "LA": -theta, "SM": jnp.abs(theta), "LM": -jnp.abs(theta)}[which]


def ordering(theta: Any, which: str) -> Any:
    """Indices of the Ritz values, most wanted first."""
    return jnp.argsort(wanted_key(theta, which), stable=True)


# ---------------------------------------------------------------------------
# Blocks
GRAM_CHUNK = 1024  # the contraction of a long Gram product, split into rows of this many entries


def local_gram(X: Any, Y: Any) -> Any:
    """This rank's part of Xᴴ Y: (rows of X, rows of Y)."""
    return sum(_leaf_gram(Xl, Yl) for Xl, Yl in zip(jax.tree_util.tree_leaves(X), jax.tree_util.tree_leaves(Y)))


def _leaf_gram(Xl: Any, Yl: Any) -> Any:
    """Xlᴴ Yl over every axis but the first.

    XLA's CPU dot of two blocks of vectors, contracting one long minor axis of both, runs far
    below the memory bandwidth; the same sum over (n / GRAM_CHUNK, GRAM_CHUNK) is a dot over two
    axes, which made LOBPCG's iteration 3x faster (k = 10 vectors of 10⁶; the rest of the length,
    below one chunk, is its own small dot). Against a single vector (Lanczos' basis dots, a
    matrix-vector product) the plain dot is the fast one, and stays.
    """
    a, b = jnp.conj(Xl).reshape(Xl.shape[0], -1), Yl.reshape(Yl.shape[0], -1)
    n = a.shape[1]
    whole = n // GRAM_CHUNK * GRAM_CHUNK
    dot = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)
    if whole < 16 * GRAM_CHUNK or a.shape[0] == 1 or b.shape[0] == 1:
        return dot("ik,jk->ij", a, b)
    out = dot("ipq,jpq->ij", a[:, :whole].reshape(a.shape[0], -1, GRAM_CHUNK),
              b[:, :whole].reshape(b.shape[0], -1, GRAM_CHUNK))
    return out if whole == n else out + dot("ik,jk->ij", a[:, whole:], b[:, whole:])


def grams(red: Reductions, pairs: Sequence[tuple[Any, Any]], also: Sequence[Any] = ()) -> list[Any]:
    """[Xᴴ Y for (X, Y) in pairs] + also (further local partial sums), over all ranks in one allreduce."""
    local = [local_gram(X, Y) for X, Y in pairs] + [jnp.asarray(a) for a in also]
    dtype = jnp.result_type(*local)
    flat = red.sum(jnp.concatenate([m.astype(dtype).ravel() for m in local]))
    out, at = [], 0
    for m in local:
        out.append(flat[at:at + m.size].reshape(m.shape).astype(m.dtype))
        at += m.size
    return out


def basis_dots(red: Reductions, V: Any, w: Any) -> Any:
    """Vᴴ w over all ranks: (rows of V,)."""
    single = jax.tree_util.tree_map(lambda leaf: leaf[None], w)
    return grams(red, [(V, single)])[0][:, 0]


def combine(coefficients: Any, V: Any) -> Any:
    """Σ_j c_j V_j (coefficients (rows,)) or, for a matrix (rows, q), the q combinations."""
    return jax.tree_util.tree_map(
        lambda Vl: jnp.tensordot(coefficients.astype(Vl.dtype), Vl, axes=([0], [0]),
                                 precision=jax.lax.Precision.HIGHEST), V)


def row(V: Any, i: Any) -> Any:
    """Vector i of a block."""
    return jax.tree_util.tree_map(lambda Vl: Vl[i], V)


def stack(blocks: Sequence[Any]) -> Any:
    """Blocks side by side: one block of all their vectors."""
    return jax.tree_util.tree_map(lambda *ls: jnp.concatenate(ls, axis=0), *blocks)


def norm(red: Reductions, w: Any) -> Any:
    """‖w‖ over all ranks."""
    return jnp.sqrt(jnp.real(red.dots([(w, w)])[0]))


def residuals(red: Reductions, mv: Callable[[Any], Any], X: Any, k: int) -> tuple[Any, Any]:
    """(Rayleigh quotients xᵢᴴ A xᵢ, ‖A xᵢ − θᵢ xᵢ‖) of a block's k vectors, from k matvecs."""
    quotients, norms = [], []
    for i in range(k):
        x = row(X, i)
        ax = mv(x)
        q = jnp.real(red.dots([(x, ax)])[0])
        r = jax.tree_util.tree_map(lambda a, b: a - q.astype(b.dtype) * b, ax, x)
        quotients.append(q)
        norms.append(norm(red, r))
    return jnp.stack(quotients), jnp.stack(norms)
