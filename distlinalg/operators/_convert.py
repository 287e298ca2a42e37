"""What the solvers accept as an operator, made a :class:`LinearOperator`."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._base import LAYOUTS, LinearOperator, function_operator
from .dense import DenseOperator


def aslinearoperator(A: Any, *, layout: str = "replicated", comm: Any = None) -> LinearOperator:
    """A LinearOperator from an operator, a callable, a dense replicated matrix,
    or any object with ``__matmul__``.

    * a LinearOperator: returned as it is (it keeps its own layout);
    * a callable ``v -> A v``: an operator with that matvec in `layout`, with
      no children (what it closes over is a constant of the programs the
      operator is passed into);
    * a NumPy or JAX (M, N) matrix: a replicated :class:`DenseOperator` whose
      child is the matrix (traced when the operator is passed to a jitted
      function), with its diagonal and transpose, applied at the highest
      matmul precision (as jax.scipy's solvers apply matrices);
    * another object with ``__matmul__`` (a SciPy sparse matrix, a lineax
      operator wrapper, ...): ``v -> A @ v`` in `layout`.

    Args:
      A: what to wrap (see above).
      layout: ``"replicated"`` or ``"sharded"`` for callables and ``__matmul__``
        objects; a dense array is replicated (a ValueError otherwise: a matrix
        split by rows is :func:`distlinalg.operators.dense_rows`).
      comm: mpi4py communicator (default distlinalg's).

    Returns:
      A :class:`LinearOperator`; anything else is a TypeError.

    AD: a dense operator is differentiable with respect to its matrix; a
    callable with respect to what it closes over when it is called inside the
    differentiated function.

    Example:
      >>> import jax.numpy as jnp
      >>> from distlinalg.operators import aslinearoperator
      >>> A = aslinearoperator(jnp.array([[2.0, 1.0], [1.0, 3.0]]))
      >>> A @ jnp.ones(2)
      Array([3., 4.], dtype=float32)
      >>> A.diagonal()
      Array([2., 3.], dtype=float32)
    """
    if isinstance(A, LinearOperator):
        return A
    if layout not in LAYOUTS:
        raise ValueError(f"distlinalg.operators: layout must be one of {LAYOUTS}, got {layout!r}")
    if callable(A):
        return function_operator(A, layout=layout, comm=comm)
    if isinstance(A, (np.ndarray, jax.Array)):
        matrix = jnp.asarray(A)
        if matrix.ndim != 2:
            raise ValueError(f"distlinalg.operators: a dense operator must be a matrix, got shape {matrix.shape}")
        if layout != "replicated":
            raise ValueError("distlinalg.operators: a dense array is replicated; use dense_rows for row blocks")
        return DenseOperator(matrix=matrix, comm=comm)
    if hasattr(A, "__matmul__"):
        return function_operator(lambda v: A @ v, layout=layout, comm=comm,
                                 name=f"MatmulOperator({type(A).__name__})")
    raise TypeError(f"distlinalg.operators: cannot make a linear operator of {A!r}: pass a LinearOperator, "
                    "a callable, a 2-D array or an object with __matmul__")
