"""Preconditioners for the Krylov solvers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def jacobi(A_or_diagonal: Any) -> Callable[[Any], Any]:
    """Jacobi (diagonal) preconditioner v ↦ D⁻¹ v.

    Args:
      A_or_diagonal: the diagonal of A as a pytree shaped like the vectors
        (this rank's block in the sharded layout), a dense square matrix, or
        an operator with a ``diagonal()`` method (distlinalg.operators).

    Returns:
      A callable usable as ``M=`` in :func:`cg` / :func:`minres`. Entries of
      the diagonal that are zero are treated as one (no scaling), so the
      preconditioner stays SPD on SPD problems with a zero diagonal entry
      only where the row is empty.
    """
    if hasattr(A_or_diagonal, "diagonal") and callable(getattr(A_or_diagonal, "diagonal")) and not isinstance(
        A_or_diagonal, jax.Array
    ):
        diagonal = A_or_diagonal.diagonal()
    else:
        leaves = jax.tree_util.tree_leaves(A_or_diagonal)
        if len(leaves) == 1 and jnp.ndim(leaves[0]) == 2:
            matrix = jnp.asarray(leaves[0])
            if matrix.shape[0] != matrix.shape[1]:
                raise ValueError(f"distlinalg.jacobi: a dense A must be square, got {matrix.shape}")
            diagonal = jnp.diagonal(matrix)
        else:
            diagonal = A_or_diagonal
    inverse = jax.tree_util.tree_map(lambda d: 1 / jnp.where(d == 0, jnp.ones_like(d), d), diagonal)

    def apply(v: Any) -> Any:
        return jax.tree_util.tree_map(lambda a, b: a * b, inverse, v)

    return apply
