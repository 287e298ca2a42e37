"""Preconditioners for the Krylov solvers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..operators import LinearOperator, aslinearoperator


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

    AD: the preconditioner is a constant of the solve (the solvers do not
    differentiate through M).

    Example:
      >>> import jax.numpy as jnp
      >>> import distlinalg as dl
      >>> from distlinalg.operators import laplacian_2d
      >>> L = laplacian_2d(8)                       # sharded; diagonal() is 4
      >>> b = jnp.ones(L.input_structure.shape)
      >>> x, info = dl.cg(L, b, M=dl.solvers.jacobi(L), rtol=1e-6)
      >>> bool(info.converged)
      True
      >>> M = dl.solvers.jacobi(jnp.array([[2.0, 1.0], [1.0, 4.0]]))   # a dense matrix
      >>> M(jnp.ones(2))
      Array([0.5 , 0.25], dtype=float32)
    """
    if isinstance(A_or_diagonal, LinearOperator) or _is_dense_matrix(A_or_diagonal):
        diagonal = aslinearoperator(A_or_diagonal).diagonal()
    elif hasattr(A_or_diagonal, "diagonal") and callable(A_or_diagonal.diagonal) and not isinstance(
        A_or_diagonal, (jax.Array, np.ndarray)
    ):
        diagonal = A_or_diagonal.diagonal()  # another object that knows its diagonal
    else:
        diagonal = A_or_diagonal
    inverse = jax.tree_util.tree_map(lambda d: 1 / jnp.where(d == 0, jnp.ones_like(d), d), diagonal)

    def apply(v: Any) -> Any:
        return jax.tree_util.tree_map(lambda a, b: a * b, inverse, v)

    return apply


def _is_dense_matrix(value: Any) -> bool:
    """A single 2-D array is a matrix (a pytree of vectors is a diagonal); it must be square."""
    if not isinstance(value, (jax.Array, np.ndarray)) or value.ndim != 2:
        return False
    if value.shape[0] != value.shape[1]:
        raise ValueError(f"distlinalg.jacobi: a dense A must be square, got {value.shape}")
    return True
