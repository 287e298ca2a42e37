"""NetKet's distributed NTK solvers (``cholesky_distributed``, ``pinv_smooth_distributed``) on MPI ranks.

NetKet 3.23 has ``nk.optimizer.solver.cholesky_distributed`` and
``pinv_smooth_distributed`` for a kernel sharded over GPUs (jaxmg). These are
the same solvers, by name and parameters, for a :class:`distlinalg.netket.MCState`
under ``mpiexec``: given as ``nk.driver.VMC_SR(..., use_ntk=True,
linear_solver=dnk.cholesky_distributed)``, the distributed step of
:mod:`._vmc_sr` keeps the M × M kernel (M = N, or 2N in "complex" mode) split by
rows from its construction to the solution: rank r passes its n_r·k rows of
the kernel and of the right-hand side to :mod:`distlinalg.linalg`
(``cholesky_solve`` / ``pinv_smooth``) and gets its rows of x back, which the
update uses directly. No rank holds the M × M kernel.

Called anywhere else (NetKet's own one-process step, a user's code) they are
NetKet solvers of a whole matrix: ``solver(A, b) -> (x, info)`` with the
replicated A solved on each process by itself. A matrix that is not square
(a rank's rows, whose communicator only the driver knows) raises.

``local_tile_size`` is the engine's block size (``block_size``) and
``process_grid`` its process grid (``grid``); as in NetKet, a call with
keywords only returns a (hashable) partial.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["cholesky_distributed", "pinv_smooth_distributed", "row_solver", "default_ntk_solver"]


class _KeywordSolver(functools.partial):
    """``solver(**options)``: a partial equal (and hashing equal) to any other of the same solver
    and options, so that jitted steps compile once per choice."""

    def __eq__(self, other: Any) -> bool:
        return (type(other) is _KeywordSolver and self.func is other.func and self.args == other.args
                and self.keywords == other.keywords)

    def __hash__(self) -> int:
        return hash((self.func, self.args, frozenset(self.keywords.items())))

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.keywords.items())
        return f"distlinalg.netket.{self.func.__name__}({opts})"


def _partial_from_kwargs(func: Any) -> Any:
    """NetKet's ``partial_from_kwargs``: keywords only -> a partial; (A, b, ...) -> the solve."""
    options = [p.name for p in inspect.signature(func).parameters.values() if p.kind == p.KEYWORD_ONLY]

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if args:
            return func(*args, **kwargs)
        unknown = sorted(set(kwargs) - set(options))
        if unknown:
            raise TypeError(f"distlinalg.netket.{func.__name__}: unexpected keyword argument(s) {unknown}; "
                            f"valid ones are {options}")
        return _KeywordSolver(wrapper, **kwargs)

    return wrapper


def _engine_options(local_tile_size: Any, process_grid: Any) -> dict:
    options = {"block_size": local_tile_size}
    if process_grid is not None:
        options["grid"] = tuple(process_grid)
    return options


# -- the solves on this rank's rows ----------------------------------------------------------------
def _cholesky_rows(A_rows: jax.Array, b_rows: jax.Array, comm: Any, *, local_tile_size: Any = None,
                   process_grid: Any = None) -> tuple[jax.Array, Any]:
    import distlinalg.linalg as dll

    return dll.cholesky_solve(A_rows, b_rows, comm=comm, **_engine_options(local_tile_size, process_grid)), None


def _pinv_smooth_rows(A_rows: jax.Array, b_rows: jax.Array, comm: Any, *, rtol: float = 1e-14,
                      rtol_smooth: float = 1e-14, local_tile_size: Any = None,
                      process_grid: Any = None) -> tuple[jax.Array, Any]:
    import distlinalg.linalg as dll

    return dll.pinv_smooth(A_rows, b_rows, rtol=rtol, rtol_smooth=rtol_smooth, comm=comm,
                           **_engine_options(local_tile_size, process_grid))


def _fallback_rows(primary: Any, fallback: Any, A_rows: jax.Array, b_rows: jax.Array,
                   comm: Any) -> tuple[jax.Array, Any]:
    """NetKet's ``nan_fallback`` on rows: `fallback` when the input or `primary`'s x has a NaN/Inf
    on any rank (the flag is reduced over the ranks, so every rank takes the same branch)."""
    from ..comm import allreduce

    x, info = primary(A_rows, b_rows, comm)
    bad = (jnp.any(jnp.isnan(b_rows)) | jnp.any(jnp.isnan(A_rows)) | jnp.any(jnp.isnan(x))
           | jnp.any(jnp.isinf(x)))
    if comm.size > 1:
        bad = allreduce(bad.astype(jnp.int32), "max", comm=comm) > 0
    x = jax.lax.cond(bad, lambda: fallback(A_rows, b_rows, comm)[0].astype(x.dtype), lambda: x)
    return x, {**(info or {}), "solver_fallback": bad}


# -- NetKet's solvers of a whole matrix -------------------------------------------------------------
def _replicated(name: str, rows_fn: Any, A: Any, b: Any, options: dict) -> tuple[Any, Any]:
    """The solve of a whole (replicated) matrix on each process by itself."""
    from jax.flatten_util import ravel_pytree
    from mpi4py import MPI

    from .._runtime.mpi import resolve_comm

    if not isinstance(A, jax.Array) and hasattr(A, "to_dense"):
        A = A.to_dense()
    A = jnp.asarray(A)
    b_flat, unravel = ravel_pytree(b)
    if A.ndim != 2 or A.shape[0] != A.shape[1] or A.shape[0] != b_flat.shape[0]:
        raise ValueError(
            f"distlinalg.netket.{name}: got a {tuple(A.shape)} matrix and {b_flat.shape[0]} right-hand-side "
            "entries. Called directly (outside the VMC_SR step of a distlinalg.netket.MCState, which passes "
            "each rank's rows itself), it solves a whole, replicated N x N matrix; for a matrix split by rows "
            "over ranks use distlinalg.linalg with comm=")
    x, info = rows_fn(A, b_flat, resolve_comm(MPI.COMM_SELF), **options)
    return unravel(x), info


@_partial_from_kwargs
def cholesky_distributed(A: Any, b: Any, *, local_tile_size: Any = None, process_grid: Any = None,
                         x0: Any = None) -> tuple[Any, None]:
    """NetKet's ``cholesky_distributed`` for :class:`MCState`: the Cholesky solve of the NTK split by rows
    over the MPI ranks.

    ``nk.driver.VMC_SR(..., use_ntk=True, linear_solver=dnk.cholesky_distributed(...))`` on a
    :class:`MCState` solves ``(K + λ I) x = dv`` with each rank holding only its rows of the
    kernel (:func:`distlinalg.linalg.cholesky_solve`); it is the default of that driver on more
    than one rank (see the module docstring). Called directly, ``cholesky_distributed(A, b)``
    solves a whole N × N matrix on each process (NetKet's ``cholesky``).

    Args:
      A, b: the matrix (Hermitian positive definite) and right-hand side (vector or pytree).
      local_tile_size: the block size of distlinalg's dense engine (None: its choice).
      process_grid: the engine's process grid (None: its choice).
      x0: unused (NetKet's signature).

    Returns:
      ``(x, None)``; with keywords only, a partial capturing them.

    Example:
      >>> import jax.numpy as jnp
      >>> import distlinalg.netket as dnk
      >>> solver = dnk.cholesky_distributed(local_tile_size=64)     # for VMC_SR(linear_solver=...)
      >>> x, _ = solver(jnp.diag(jnp.array([2.0, 4.0])), jnp.ones(2))   # a whole matrix, directly
      >>> [round(float(v), 12) for v in x]
      [0.5, 0.25]
    """
    del x0
    return _replicated("cholesky_distributed", _cholesky_rows, A, b,
                       {"local_tile_size": local_tile_size, "process_grid": process_grid})


@_partial_from_kwargs
def pinv_smooth_distributed(A: Any, b: Any, *, rtol: float = 1e-14, rtol_smooth: float = 1e-14,
                            local_tile_size: Any = None, process_grid: Any = None,
                            x0: Any = None) -> tuple[Any, dict]:
    """NetKet's ``pinv_smooth_distributed`` for :class:`MCState`: NetKet's smoothed pseudo-inverse
    (``pinv_smooth``) of the NTK split by rows over the MPI ranks.

    As :func:`cholesky_distributed`, with the distributed eigendecomposition of
    :func:`distlinalg.linalg.pinv_smooth`: eigenvalues below ``rtol · λ_max`` are dropped and
    the others filtered by ``1 / (1 + (rtol_smooth λ_max / λ)^6)``.

    Returns:
      ``(x, info)`` with NetKet's ``pinv_smooth`` info (``eval_min``, ``eval_max``, ``rank``,
      ``cond_number``), identical on every rank; with keywords only, a partial capturing them.

    Example:
      >>> import jax.numpy as jnp
      >>> import distlinalg.netket as dnk
      >>> x, info = dnk.pinv_smooth_distributed(jnp.diag(jnp.array([1.0, 1e-20])), jnp.ones(2))
      >>> [round(float(v), 12) for v in x], int(info["rank"])       # the tiny eigenvalue is dropped
      ([1.0, 0.0], 1)
    """
    del x0
    return _replicated("pinv_smooth_distributed", _pinv_smooth_rows, A, b,
                       {"rtol": rtol, "rtol_smooth": rtol_smooth, "local_tile_size": local_tile_size,
                        "process_grid": process_grid})


_ROWS = {cholesky_distributed: _cholesky_rows, pinv_smooth_distributed: _pinv_smooth_rows}


def _rows_of(solver: Any) -> Any:
    """`solver` (one of ours, or a partial of one) -> (A_rows, b_rows, comm) -> (x_rows, info), or None."""
    if isinstance(solver, _KeywordSolver) and solver.func in _ROWS and not solver.args:
        return functools.partial(_ROWS[solver.func], **{k: v for k, v in solver.keywords.items() if k != "x0"})
    if callable(solver) and not isinstance(solver, functools.partial):
        try:
            rows = _ROWS.get(solver)
        except TypeError:  # unhashable callables are not ours
            return None
        return rows
    return None


def row_solver(solver: Any) -> Any:
    """The solve on this rank's rows for a VMC_SR ``linear_solver`` that has one, else None:
    :func:`cholesky_distributed`, :func:`pinv_smooth_distributed` (or partials of them), and
    NetKet's ``nan_fallback(primary, fallback)`` of two of them."""
    rows = _rows_of(solver)
    if rows is not None:
        return rows
    if isinstance(solver, functools.partial) and len(solver.args) == 2 and not solver.keywords:
        from netket._src.solvers.nan_fallback import _nan_fallback_solver

        if solver.func is _nan_fallback_solver:
            primary, fallback = (_rows_of(s) for s in solver.args)
            if primary is not None and fallback is not None:
                return functools.partial(_fallback_rows, primary, fallback)
    return None


def default_ntk_solver(solver: Any) -> Any:
    """`solver`, or its distributed counterpart when it is NetKet's default ``cholesky_with_fallback``
    (the NTK step of VMC_SR on a distributed state, P > 1): NetKet's default, cholesky with a
    pinv_smooth fallback on NaN/Inf, with the kernel split by rows."""
    from netket.optimizer.solver import cholesky_with_fallback, nan_fallback

    if solver is cholesky_with_fallback:
        return nan_fallback(cholesky_distributed, pinv_smooth_distributed(rtol=1e-14, rtol_smooth=1e-14))
    return solver
