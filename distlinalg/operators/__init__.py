"""Distributed linear operators for the Krylov solvers.

Explicit matrices split across ranks (``sparse_rows`` with a halo exchange,
``dense_rows`` / ``dense_columns``, the matrix-free ``laplacian_2d``) and
operators from automatic differentiation of a model on sharded data
(``gram``: the Jacobian Gram / QGT / Fisher matrix; ``sample_gram``: its
samples × samples counterpart for MinSR/SRt; ``hessian``;
``gauss_newton``). Every one is a :class:`LinearOperator` with a layout the
solvers read, and is differentiable with respect to what it closes over.
Operators are pytrees whose children are their arrays (matrix entries,
model parameters and samples, shifts): they can be arguments of jitted
functions and of ``jax.grad``, and compose (``A @ B``, ``A + B``, ``c * A``,
``.T``, ``.H``).
"""

from ._base import LinearOperator, aslinearoperator
from ._partition import Partition
from .curvature import GaussNewtonOperator, HessianOperator, gauss_newton, hessian
from .dense import dense_columns, dense_rows
from .gram import GramOperator, gram
from .sample_gram import SampleGramOperator, sample_gram
from .sparse import SparseRowsOperator, sparse_rows
from .stencil import Laplacian2D, laplacian_2d

__all__ = [
    "LinearOperator",
    "aslinearoperator",
    "Partition",
    "gram",
    "GramOperator",
    "sample_gram",
    "SampleGramOperator",
    "hessian",
    "HessianOperator",
    "gauss_newton",
    "GaussNewtonOperator",
    "sparse_rows",
    "SparseRowsOperator",
    "dense_rows",
    "dense_columns",
    "laplacian_2d",
    "Laplacian2D",
]
