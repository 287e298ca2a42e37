"""(Re, Im) pairs: complex vectors seen as real vectors of twice the size.

A map that is only real-linear on complex vectors (A(i v) ≠ i A v: a Gram
matrix of a non-holomorphic model in "complex" mode) is a linear map of
R²ⁿ, v ↦ (Re v, Im v). The operators build their parameter space from these
pairs, the solvers run their recurrences on them (Krylov methods need the
real inner product Re⟨u, v⟩ there, not the complex one), and dense matrices
of such maps act on ``[Re v; Im v]``. This module is the one place where
that pairing is written, for pytrees and for flat vectors.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def split_complex(tree: Any) -> tuple[Any, Any]:
    """v ↦ (Re v, Im v), leaf by leaf (real leaves get a zero imaginary part)."""
    return jax.tree_util.tree_map(jnp.real, tree), jax.tree_util.tree_map(jnp.imag, tree)


def join_complex(pair: tuple[Any, Any], like: Any = None) -> Any:
    """(Re v, Im v) ↦ v; in the dtypes of `like` when given (else complex)."""
    if like is None:
        return jax.tree_util.tree_map(lambda re, im: re + 1j * im, *pair)
    return jax.tree_util.tree_map(lambda re, im, x: (re + 1j * im).astype(jnp.result_type(x)), *pair, like)


def stack_complex(flat: jax.Array) -> jax.Array:
    """A flat complex vector v as the real vector [Re v; Im v] (twice the length)."""
    return jnp.concatenate([jnp.real(flat), jnp.imag(flat)])


def unstack_complex(stacked: jax.Array, dtype: Any = None) -> jax.Array:
    """[Re v; Im v] ↦ v (of `dtype` when given)."""
    n = stacked.shape[0] // 2
    v = stacked[:n] + 1j * stacked[n:]
    return v if dtype is None else v.astype(dtype)


def paired_operator(op: Any, like: Any) -> Any:
    """A real-linear LinearOperator on complex vectors shaped like `like`, as a
    linear operator on their (Re, Im) pairs, in the same layout and communicator."""
    from ._base import LinearOperator  # _base imports this module (to_dense)

    def matvec(pair: Any) -> Any:
        return split_complex(op.matvec(join_complex(pair, like)))

    return LinearOperator(matvec, layout=op.layout, comm=op.comm, name=f"Paired({op.name})")
