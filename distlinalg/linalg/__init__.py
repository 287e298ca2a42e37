"""Distributed dense linear algebra on an N × N matrix held by rows, differentiable.

Layout: rank r holds rows [s_r, s_{r+1}) of A, an ``(n_r, N)`` array, with any
split of the rows (uneven, a rank may hold none; the operators' default split
is :meth:`distlinalg.operators.Partition.even`). Right-hand sides ``b`` and
solutions ``x`` are this rank's rows, ``(n_r,)`` or ``(n_r, m)``. ``eigh``'s
eigenvalues ``w`` are replicated and ascending, its eigenvectors ``V`` are this
rank's rows ``(n_r, N)``. No rank ever holds an N × N buffer: memory per rank is
O(N² / P).

Engines (``engine=``): ``"scalapack"`` (MKL's ScaLAPACK from the ``mkl`` wheel,
on a 2-D block-cyclic grid; the field's engine), ``"distlinalg"`` (blocked
algorithms of distlinalg's own on its collectives, for where ScaLAPACK does not
load), ``"auto"`` (ScaLAPACK where every rank loaded it, else distlinalg's).
On one rank both call LAPACK through JAX. Which engine ran is in the info of
``return_info=True``.

Derivatives, both modes, with respect to A and b, follow docs/ad.md (the
adjoint of the whole SPMD program): solves through ``lax.custom_linear_solve``
(one more solve with the same factorisation), eigh through the eigenvalue and
eigenvector rules of :func:`jax.numpy.linalg.eigh`, computed by rows.

Failures: arguments that do not make one square system on every rank raise the
same ValueError on every rank before any message. A matrix that is not positive
definite (``cholesky_solve``) or singular (``solve``) gives NaN solutions and a
reason code identical on every rank; called eagerly, every rank raises
:class:`numpy.linalg.LinAlgError`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..comm.allreduce import allreduce
from . import _arguments, _cholesky, _eigh, _engines, _lu
from ._layout import RowSplit, hermitian_part

__all__ = ["cholesky_solve", "solve", "eigh", "pinv_smooth", "LinalgInfo", "Reason", "engine_status"]


class Reason:
    """Why a factorisation stopped (``LinalgInfo.reason``; identical on every rank).

    Example:
      >>> import distlinalg.linalg as dll
      >>> dll.Reason.names[dll.Reason.NOT_POSITIVE_DEFINITE]
      'not positive definite'
    """

    SUCCESS = 0
    NOT_POSITIVE_DEFINITE = 1
    SINGULAR = 2
    NOT_CONVERGED = 3  # eigh: distlinalg's Jacobi sweeps reached their limit
    FAILED = 4  # the engine reported an error of its own (ScaLAPACK's INFO < 0)

    names = {0: "success", 1: "not positive definite", 2: "singular", 3: "not converged", 4: "engine error"}


@functools.partial(jax.tree_util.register_dataclass, data_fields=["reason"], meta_fields=["engine"])
@dataclasses.dataclass(frozen=True)
class LinalgInfo:
    """What ``return_info=True`` returns beside the result (a pytree: jit can return it).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import distlinalg as dl, distlinalg.linalg as dll
      >>> from distlinalg.operators import Partition
      >>> rows = Partition.even(4, dl.size())
      >>> mine = slice(rows.starts[dl.rank()], rows.starts[dl.rank() + 1])
      >>> A = -jnp.eye(4)[mine]                                  # negative definite
      >>> solve = jax.jit(lambda a, b: dll.cholesky_solve(a, b, return_info=True))
      >>> x, info = solve(A, jnp.ones(rows.size_of(dl.rank())))
      >>> int(info.reason) == dll.Reason.NOT_POSITIVE_DEFINITE, bool(jnp.isnan(x).all())
      (True, True)
    """

    reason: Any  # int32 scalar, a Reason code, identical on every rank
    engine: str  # "scalapack", "distlinalg" or "lapack" (one rank); static


def engine_status() -> tuple[bool, str]:
    """(ScaLAPACK loaded in this process, a sentence saying from where or why not).

    ``python -m distlinalg`` prints it too. ``engine="auto"`` uses ScaLAPACK where every
    rank loaded it (and the backend is the CPU), else distlinalg's own engine.

    Example:
      >>> import distlinalg.linalg as dll
      >>> loaded, why = dll.engine_status()
      >>> isinstance(loaded, bool) and isinstance(why, str)
      True
    """
    return _engines.scalapack_status()


def _finish(what: str, result: Any, reason: Any, engine: str, return_info: bool) -> Any:
    """Raise on every rank when an eager call failed (the reason is replicated); else the result."""
    if not isinstance(reason, jax.core.Tracer):
        code = int(reason)
        if code != Reason.SUCCESS:
            raise np.linalg.LinAlgError(f"{what}: the matrix is {Reason.names.get(code, code)} "
                                        f"(engine {engine}; the same on every rank)")
    return (result, LinalgInfo(reason, engine)) if return_info else result


def _nan_anywhere(x: jax.Array, split: RowSplit) -> jax.Array:
    """Whether any rank's solution holds a NaN (one scalar allreduce; a rank may hold no rows)."""
    mine = jnp.any(jnp.isnan(jax.lax.stop_gradient(x))).astype(jnp.int32)
    return allreduce(mine, op="max", comm=split.comm) > 0


def _custom_solve(A_rows: jax.Array, b: jax.Array, split: RowSplit, apply_inverse: Any, hermitian: bool) -> jax.Array:
    """x = A⁻¹ b through lax.custom_linear_solve: the derivative is one more application of the
    inverse, dx = A⁻¹ (db − dA x), and its transpose with Aᵀ (= conj A for Hermitian A)."""
    def matvec(x: jax.Array) -> jax.Array:
        return A_rows @ split.gather(x)

    def inverse(_matvec: Any, r: jax.Array) -> jax.Array:
        return apply_inverse(r)

    def transpose_inverse(_vecmat: Any, r: jax.Array) -> jax.Array:
        if hermitian:  # Aᵀ = conj(A)
            return jnp.conj(apply_inverse(jnp.conj(r)))
        return apply_inverse(r, transpose=True)

    real_symmetric = hermitian and not jnp.iscomplexobj(A_rows)
    return jax.lax.custom_linear_solve(matvec, b, inverse, None if real_symmetric else transpose_inverse,
                                       symmetric=real_symmetric)


def cholesky_solve(A_rows: Any, b: Any, *, comm: Any = None, engine: str = "auto", block_size: int | None = None,
                   grid: tuple[int, int] | None = None, return_info: bool = False) -> Any:
    """Solve A x = b for Hermitian positive definite A held by rows (Cholesky).

    Args:
      A_rows: this rank's rows of A, ``(n_r, N)``; the rows of all ranks make the N × N
        matrix. Only the factorisation reads it; A should be Hermitian (the
        derivative assumes it).
      b: this rank's rows of the right-hand side, ``(n_r,)`` or ``(n_r, m)``.
      comm: the communicator (default: distlinalg's world).
      engine: ``"auto"``, ``"scalapack"`` or ``"distlinalg"`` (see the module).
      block_size: rows per block (the ScaLAPACK block, or the rows per elimination
        step of distlinalg's engine); default chosen from N and P.
      grid: ScaLAPACK's process grid (rows, columns) with rows · columns = P; default the
        squarest, 1 × 2 at two ranks (measured faster than 2 × 1). distlinalg's engine
        has no grid (its layout is the rows) and ignores it.
      return_info: also return a :class:`LinalgInfo`.

    Returns:
      x, this rank's rows, shaped like b (and the info).

    Derivatives: both modes, in A and b (dx = A⁻¹ (db − dA x), one more solve).

    Example:
      >>> import numpy as np, jax.numpy as jnp
      >>> import distlinalg as dl, distlinalg.linalg as dll
      >>> from distlinalg.operators import Partition
      >>> N = 6
      >>> A = 4 * np.eye(N) + np.ones((N, N))
      >>> rows = Partition.even(N, dl.size())
      >>> mine = slice(rows.starts[dl.rank()], rows.starts[dl.rank() + 1])
      >>> x = dll.cholesky_solve(jnp.asarray(A[mine]), jnp.ones(rows.size_of(dl.rank())))
      >>> bool(np.allclose(x, np.linalg.solve(A, np.ones(N))[mine]))
      True
    """
    what = "distlinalg.linalg.cholesky_solve"
    status = _engines.scalapack_status()[0] if engine != "distlinalg" else False
    split, A, b, chosen = _arguments.check(what, A_rows, b, comm=comm, engine=engine, block_size=block_size,
                                           scalapack_loaded=status, options=_grid_code(grid))
    x, reason = _compute(_hermitian_solve, (A, b), split=split, engine=chosen, block_size=block_size,
                         grid=_grid(grid))
    return _finish(what, x, reason, _engine_used(split, chosen), return_info)


def _grid_code(grid: Any) -> tuple[int, int]:
    return (-1, -1) if grid is None else _grid(grid)


def _grid(grid: Any) -> tuple[int, int] | None:
    return None if grid is None else (int(grid[0]), int(grid[1]))


def _engine_used(split: RowSplit, engine: str) -> str:
    return "lapack" if split.size == 1 else engine


def _compute(core: Any, arrays: tuple, **static: Any) -> Any:
    """core(*arrays, **static); called eagerly, as one compiled program (cached by the
    agreed split and the options: every rank hits or misses the cache together, and the
    core makes no trace-time exchange, the arguments having been agreed before)."""
    if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(arrays)):
        return core(*arrays, **static)
    return _compiled(core)(*arrays, **static)


@functools.lru_cache(maxsize=None)
def _compiled(core: Any) -> Any:
    import inspect

    static = [name for name in inspect.signature(core).parameters if name not in ("A", "b")]
    return jax.jit(core, static_argnames=static)


def _hermitian_solve(A: jax.Array, b: jax.Array, *, split: RowSplit, engine: str, block_size: Any, grid: Any):
    fixed = jax.lax.stop_gradient(A)
    if split.size == 1:
        factor = jax.scipy.linalg.cho_factor(fixed, lower=False)
        failed = jnp.any(jnp.isnan(jnp.real(jnp.diagonal(factor[0]))))

        def apply_inverse(r, transpose=False):
            return jax.scipy.linalg.cho_solve(factor, r)

    elif engine == "scalapack":
        from . import _scalapack

        sizes, block = split.partition.sizes, block_size

        def apply_inverse(r, transpose=False):
            return _scalapack.potrf_solve(fixed, r, sizes, split.comm, block=block, grid=grid)[0]

        failed = None  # from the solution: ScaLAPACK's handler fills it with NaN on every rank
    else:
        sched = _cholesky.schedule(split, _arguments.default_block(split, block_size))
        U, failed = _cholesky.factor(fixed, split, sched)

        def apply_inverse(r, transpose=False):
            return _cholesky.solve(U, r, split, sched)

    x = _custom_solve(A, b, split, apply_inverse, hermitian=True)
    if failed is None:
        failed = _nan_anywhere(x, split)
    reason = jnp.where(failed, Reason.NOT_POSITIVE_DEFINITE, Reason.SUCCESS).astype(jnp.int32)
    return x, reason


def solve(A_rows: Any, b: Any, *, assume_a: str = "gen", comm: Any = None, engine: str = "auto",
          block_size: int | None = None, grid: tuple[int, int] | None = None, return_info: bool = False) -> Any:
    """Solve A x = b for A held by rows, as :func:`scipy.linalg.solve`.

    Args:
      A_rows, b, comm, engine, block_size, grid, return_info: as :func:`cholesky_solve`.
      assume_a: ``"pos"`` (Hermitian positive definite: Cholesky), ``"her"`` (Hermitian,
        indefinite allowed) or ``"gen"`` (general): LU with partial pivoting. (ScaLAPACK has
        no symmetric-indefinite factorisation, so ``"her"`` uses LU too; the solution is the
        same up to rounding.)

    Returns:
      x, this rank's rows, shaped like b (and the info; a singular matrix gives
      ``Reason.SINGULAR`` and NaN).

    Derivatives: both modes, in A and b.

    Example:
      >>> import numpy as np, jax.numpy as jnp
      >>> import distlinalg as dl, distlinalg.linalg as dll
      >>> from distlinalg.operators import Partition
      >>> N = 5
      >>> A = np.eye(N) * 3 + np.triu(np.ones((N, N)), 1)          # not symmetric
      >>> rows = Partition.even(N, dl.size())
      >>> mine = slice(rows.starts[dl.rank()], rows.starts[dl.rank() + 1])
      >>> x = dll.solve(jnp.asarray(A[mine]), jnp.ones(rows.size_of(dl.rank())))
      >>> bool(np.allclose(x, np.linalg.solve(A, np.ones(N))[mine]))
      True
    """
    what = "distlinalg.linalg.solve"
    if assume_a not in ("gen", "her", "pos", "sym"):
        from ..solvers._arguments import collectively

        def bad() -> None:
            raise ValueError(f"{what}: assume_a must be 'gen', 'her', 'sym' or 'pos', not {assume_a!r}")

        collectively(bad, _arguments.resolve_comm(comm))
    status = _engines.scalapack_status()[0] if engine != "distlinalg" else False
    split, A, b, chosen = _arguments.check(what, A_rows, b, comm=comm, engine=engine, block_size=block_size,
                                           scalapack_loaded=status,
                                           options=(*_grid_code(grid), ("gen", "her", "pos", "sym").index(assume_a)))
    if assume_a == "pos":
        x, reason = _compute(_hermitian_solve, (A, b), split=split, engine=chosen, block_size=block_size,
                         grid=_grid(grid))
    else:
        hermitian = assume_a == "her" or (assume_a == "sym" and not jnp.iscomplexobj(A))
        x, reason = _compute(_general_solve, (A, b), split=split, engine=chosen, block_size=block_size,
                             grid=_grid(grid), hermitian=hermitian)
    return _finish(what, x, reason, _engine_used(split, chosen), return_info)


def _general_solve(A: jax.Array, b: jax.Array, *, split: RowSplit, engine: str, block_size: Any, grid: Any,
                   hermitian: bool):
    fixed = jax.lax.stop_gradient(A)
    if split.size == 1:
        lu = jax.scipy.linalg.lu_factor(fixed)
        failed = jnp.any(jnp.diagonal(lu[0]) == 0)

        def apply_inverse(r, transpose=False):
            return jax.scipy.linalg.lu_solve(lu, r, trans=1 if transpose else 0)

    elif engine == "scalapack":
        from . import _scalapack
        from ._layout import rows_to_columns

        sizes = split.partition.sizes
        transposed = []  # Aᵀ by rows (A's columns, one alltoall), formed once if reverse mode asks

        def apply_inverse(r, transpose=False):
            if not transpose:
                return _scalapack.gesv(fixed, r, sizes, split.comm, block=block_size, grid=grid)[0]
            if not transposed:
                transposed.append(rows_to_columns(fixed, split, split.partition).T)
            return _scalapack.gesv(transposed[0], r, sizes, split.comm, block=block_size, grid=grid)[0]

        failed = None
    else:
        factors = _lu.factor(fixed, split, _arguments.default_block(split, block_size))
        failed = factors.singular

        def apply_inverse(r, transpose=False):
            return _lu.solve(factors, r, split, transpose=transpose)

    x = _custom_solve(A, b, split, apply_inverse, hermitian=hermitian)
    if failed is None:
        failed = _nan_anywhere(x, split)
    reason = jnp.where(failed, Reason.SINGULAR, Reason.SUCCESS).astype(jnp.int32)
    return x, reason


def eigh(A_rows: Any, *, comm: Any = None, engine: str = "auto", block_size: int | None = None,
         grid: tuple[int, int] | None = None, return_info: bool = False) -> Any:
    """All eigenvalues and eigenvectors of a Hermitian matrix held by rows, as :func:`jax.numpy.linalg.eigh`.

    Args:
      A_rows: this rank's rows of A, ``(n_r, N)``. As in jax, the Hermitian part
        (A + Aᴴ)/2 is decomposed (one alltoall forms its rows).
      comm, engine, block_size, grid, return_info: as :func:`cholesky_solve`. distlinalg's
        engine is a one-sided block Jacobi method (parallel tournament of column
        blocks); ScaLAPACK's is p?syevd / p?heevd.

    Returns:
      ``(w, V_rows)``: w ``(N,)`` ascending, identical on every rank; V_rows
      ``(n_r, N)`` this rank's rows of the unitary V with A V = V diag(w) (and the info).

    Derivatives: both modes, jax's rules (dw = diag(Vᴴ dA V), dV = V (F ∘ Vᴴ dA V),
    F_ij = 1/(w_j − w_i)), computed by rows with ring products (no N × N buffer);
    as in jax, eigenvectors of repeated eigenvalues have no derivative.

    Example:
      >>> import numpy as np, jax.numpy as jnp
      >>> import distlinalg as dl, distlinalg.linalg as dll
      >>> from distlinalg.operators import Partition
      >>> A = np.diag(np.arange(1.0, 6.0)) + 0.1
      >>> rows = Partition.even(5, dl.size())
      >>> mine = slice(rows.starts[dl.rank()], rows.starts[dl.rank() + 1])
      >>> w, V = dll.eigh(jnp.asarray(A[mine]))
      >>> bool(np.allclose(w, np.linalg.eigvalsh(A)))
      True
    """
    what = "distlinalg.linalg.eigh"
    status = _engines.scalapack_status()[0] if engine != "distlinalg" else False
    split, A, _, chosen = _arguments.check(what, A_rows, comm=comm, engine=engine, block_size=block_size,
                                           scalapack_loaded=status, options=_grid_code(grid))
    w, V, reason = _compute(_eigh_core, (A,), split=split, engine=chosen, block_size=block_size,
                         grid=_grid(grid))
    return _finish(what, (w, V), reason, _engine_used(split, chosen), return_info)


def _eigh_core(A: jax.Array, *, split: RowSplit, engine: str, block_size: Any, grid: Any):
    if split.size == 1:
        w, V = jnp.linalg.eigh(A)
        return w, V, jnp.where(jnp.any(jnp.isnan(w)), Reason.FAILED, Reason.SUCCESS).astype(jnp.int32)
    return _eigh.eigh(hermitian_part(A, split), split, engine, block_size, grid)


def pinv_smooth(A_rows: Any, b: Any, *, rtol: float = 1e-14, rtol_smooth: float = 1e-14, comm: Any = None,
                engine: str = "auto", block_size: int | None = None,
                grid: tuple[int, int] | None = None) -> tuple[Any, dict]:
    """NetKet's ``pinv_smooth`` on a matrix held by rows: x = V f(w) Vᴴ b.

    f(λ) = 1/λ where ``abs(λ/λ_max) > rtol`` (else 0), times ``1 / (1 + (rtol_smooth / abs(λ/λ_max))**6)``
    (Medvidovic & Sels 2022), with λ_max the largest eigenvalue, exactly as
    :func:`netket.optimizer.solver.pinv_smooth`.

    Args:
      A_rows: this rank's rows of a Hermitian A, ``(n_r, N)``.
      b: this rank's rows of the right-hand side, ``(n_r,)`` or ``(n_r, m)``.
      rtol, rtol_smooth: NetKet's cut-offs.
      comm, engine, block_size, grid: as :func:`eigh`.

    Returns:
      ``(x, info)``: x this rank's rows, shaped like b; info NetKet's dict (``eval_min``,
      ``eval_max``, ``rank``, ``cond_number``), identical on every rank.

    Derivatives: both modes, through :func:`eigh`'s rules.

    Example:
      >>> import numpy as np, jax.numpy as jnp
      >>> import distlinalg as dl, distlinalg.linalg as dll
      >>> from distlinalg.operators import Partition
      >>> A = np.diag([1.0, 2.0, 4.0, 8.0])
      >>> rows = Partition.even(4, dl.size())
      >>> mine = slice(rows.starts[dl.rank()], rows.starts[dl.rank() + 1])
      >>> x, info = dll.pinv_smooth(jnp.asarray(A[mine]), jnp.ones(rows.size_of(dl.rank())))
      >>> bool(np.allclose(x, (1 / np.diag(A))[mine])), int(info["rank"])
      (True, 4)
    """
    w, V = eigh(A_rows, comm=comm, engine=engine, block_size=block_size, grid=grid)
    comm = _arguments.resolve_comm(comm)
    b = jnp.asarray(b).astype(V.dtype)
    ratio = jnp.abs(w / w[-1])
    inverse = jnp.where(ratio > rtol, jnp.reciprocal(w), 0.0) / (1.0 + (rtol_smooth / ratio) ** 6)
    projections = jnp.conj(V).T @ b  # this rank's share of Vᴴ b
    if comm.size > 1:
        projections = allreduce(projections, comm=comm)
    scaled = inverse[:, None] * projections if projections.ndim == 2 else inverse * projections
    x = V @ scaled.astype(V.dtype)
    info = {"eval_min": w[0], "eval_max": w[-1], "rank": jnp.sum(w > rtol * w[-1]), "cond_number": w[-1] / w[0]}
    return x, info
