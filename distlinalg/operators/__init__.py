"""Distributed linear operators for the Krylov solvers.

Explicit matrices split across ranks (``sparse_rows`` with a halo exchange,
``dense_rows`` / ``dense_columns``, the matrix-free ``laplacian_2d``) and
operators from automatic differentiation of a model on sharded data
(``gram``: the Jacobian Gram / QGT / Fisher matrix; ``sample_gram``: its
samples × samples counterpart for MinSR/SRt; ``hessian``;
``gauss_newton``). Every one is a :class:`LinearOperator` with a layout the
solvers read, and is differentiable with respect to what it closes over.
Operators are frozen dataclasses registered as pytrees, whose children are
their arrays (matrix entries, model parameters and samples, shifts): they
can be arguments of jitted functions and of ``jax.grad``, and compose
(``A @ B``, ``A + B``, ``c * A``, ``.T``, ``.H``, ``conj()``). The model
operators apply their model in every product; :func:`linearise` (which the
solvers call once) linearises it. docs/operators.md: the contract, and how
to add an operator.
"""

from .._trees import Structure
from ._base import LAYOUTS  # noqa: F401  (the layout names, for users' checks)
from ._base import FunctionOperator, LinearOperator, linearise, operator_class, static
from ._convert import aslinearoperator
from ._jacobian import Jacobian, Linearisation, ModelPoint
from ._partition import Partition
from .curvature import GaussNewtonOperator, HessianOperator, LossPoint, gauss_newton, hessian
from .dense import Dense, DenseColumns, DenseRows  # noqa: F401  (short aliases of the operator classes)
from .dense import DenseColumnsOperator, DenseOperator, DenseRowsOperator, dense_columns, dense_rows
from .gram import GramOperator, gram
from .sample_gram import SampleGramOperator, sample_gram
from .sparse import SparseRowsOperator, sparse_rows
from .stencil import Laplacian2D, Stencil2D, StencilGrid, SymmetricStencil2D, laplacian_2d, stencil_2d, symmetric_stencil

__all__ = [
    "LinearOperator",
    "FunctionOperator",
    "operator_class",
    "static",
    "Structure",
    "linearise",
    "aslinearoperator",
    "Partition",
    "ModelPoint",
    "Jacobian",
    "Linearisation",
    "LossPoint",
    "DenseOperator",
    "DenseRowsOperator",
    "DenseColumnsOperator",
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
    "stencil_2d",
    "symmetric_stencil",
    "SymmetricStencil2D",
    "Stencil2D",
    "StencilGrid",
]
