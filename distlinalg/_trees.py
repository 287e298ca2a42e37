"""Pytrees of arrays: their static description and the algebra every module shares.

A vector in distlinalg is a pytree of arrays (this rank's piece of it).
What the operators and the solvers need to know about one without its
values is its :class:`Structure`: the tree definition and each leaf's shape
and dtype, hashable and compared by value, so it can be static data of a
pytree (an operator's declared input and output) and a key of jit's cache.

Complex vectors of a map that is only real-linear (A(i v) ≠ i A v: a Gram
matrix of a non-holomorphic model in "complex" mode) are handled as
(Re v, Im v) pairs, a real vector of twice the size: :func:`split_complex`
and :func:`join_complex` for pytrees, :func:`stack_complex` and
:func:`unstack_complex` for flat vectors (the rows and columns of a dense
matrix of such a map act on ``[Re v; Im v]``). This module is the one place
where that pairing is written.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Structure:
    """A pytree of arrays without its values: treedef and (shape, dtype) per leaf.

    Hashable and compared by value. ``tree`` is the same description as a
    pytree of ``jax.ShapeDtypeStruct`` (what ``jax.eval_shape`` returns).

    Example:
      >>> import jax.numpy as jnp
      >>> from distlinalg._trees import Structure
      >>> s = Structure.of({"w": jnp.zeros((2, 3)), "b": jnp.zeros(3)})
      >>> s == Structure.of({"w": jnp.ones((2, 3)), "b": jnp.ones(3)}), s.size
      (True, 9)
    """

    treedef: Any
    leaves: tuple[jax.ShapeDtypeStruct, ...]

    @staticmethod
    def of(tree: Any) -> Structure:
        """The structure of a pytree of arrays, of ShapeDtypeStructs, or a Structure (returned as is)."""
        if isinstance(tree, Structure):
            return tree
        flat, treedef = jax.tree_util.tree_flatten(tree)
        return Structure(treedef, tuple(jax.ShapeDtypeStruct(tuple(jnp.shape(x)), jnp.dtype(jnp.result_type(x)))
                                        for x in flat))

    @property
    def tree(self) -> Any:
        """The pytree of ``jax.ShapeDtypeStruct``."""
        return jax.tree_util.tree_unflatten(self.treedef, list(self.leaves))

    @property
    def size(self) -> int:
        """Entries over all leaves."""
        return int(sum(np.prod(leaf.shape, dtype=np.int64) for leaf in self.leaves))

    @property
    def is_complex(self) -> bool:
        return any(jnp.issubdtype(leaf.dtype, jnp.complexfloating) for leaf in self.leaves)

    def zeros(self) -> Any:
        """A pytree of zeros of this structure."""
        return jax.tree_util.tree_unflatten(self.treedef, [jnp.zeros(s.shape, s.dtype) for s in self.leaves])

    def fits(self, tree: Any) -> bool:
        """Whether `tree` has this tree definition and these leaf shapes (dtypes may differ)."""
        if tree is None:
            return False
        flat, treedef = jax.tree_util.tree_flatten(tree)
        return treedef == self.treedef and all(tuple(jnp.shape(x)) == s.shape for x, s in zip(flat, self.leaves))

    def describe(self) -> str:
        shapes = ", ".join(f"{s.dtype}{list(s.shape)}" for s in self.leaves)
        return shapes if len(self.leaves) == 1 else f"{self.treedef} of ({shapes})"


def structure_of(tree: Any) -> Structure | None:
    """:meth:`Structure.of`, with None for None (an operator that does not know its vectors)."""
    return None if tree is None else Structure.of(tree)


def describe(tree: Any) -> str:
    """A short description of a pytree's leaves (dtype and shape), for error messages."""
    return Structure.of(tree).describe()


def tree_map(fn: Callable[..., Any], *trees: Any) -> Any:
    return jax.tree_util.tree_map(fn, *trees)


def leaves(tree: Any) -> list[Any]:
    return jax.tree_util.tree_leaves(tree)


def flat_size(tree: Any) -> int:
    """Entries over all leaves of a pytree of arrays."""
    return int(sum(np.prod(jnp.shape(x), dtype=np.int64) for x in leaves(tree)))


def is_complex(tree: Any) -> bool:
    """Whether any leaf is complex."""
    return any(jnp.iscomplexobj(x) for x in leaves(tree))


def conj(tree: Any) -> Any:
    return tree_map(jnp.conj, tree)


def add(x: Any, y: Any) -> Any:
    return tree_map(jnp.add, x, y)


def scale(c: Any, tree: Any) -> Any:
    """c · tree, each leaf in the promoted dtype of the leaf and c."""
    return tree_map(lambda x: (c * x).astype(jnp.result_type(x, c)), tree)


# -- (Re, Im) pairs ------------------------------------------------------------
def split_complex(tree: Any) -> tuple[Any, Any]:
    """v ↦ (Re v, Im v), leaf by leaf (real leaves get a zero imaginary part)."""
    return tree_map(jnp.real, tree), tree_map(jnp.imag, tree)


def join_complex(pair: tuple[Any, Any], like: Any = None) -> Any:
    """(Re v, Im v) ↦ v; in the dtypes of `like` when given (else complex)."""
    if like is None:
        return tree_map(lambda re, im: re + 1j * im, *pair)
    return tree_map(lambda re, im, x: (re + 1j * im).astype(jnp.result_type(x)), *pair, like)


def stack_complex(flat: jax.Array) -> jax.Array:
    """A flat complex vector v as the real vector [Re v; Im v] (twice the length)."""
    return jnp.concatenate([jnp.real(flat), jnp.imag(flat)])


def unstack_complex(stacked: jax.Array, dtype: Any = None) -> jax.Array:
    """[Re v; Im v] ↦ v (of `dtype` when given)."""
    n = stacked.shape[0] // 2
    v = stacked[:n] + 1j * stacked[n:]
    return v if dtype is None else v.astype(dtype)
