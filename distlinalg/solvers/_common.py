"""What the Krylov solvers share: operators, layouts, reductions, info, monitors.

Layouts
  * ``"replicated"``: every rank holds the whole vector (natural-gradient
    solves: parameters replicated, samples sharded, the matvec allreduces).
    Inner products are local; the one scalar that decides whether to stop is
    made identical on every rank by an allreduce (max), so ranks can never
    disagree about the iteration count, whatever the matvec does.
  * ``"sharded"``: each rank holds its block of rows; the inner products of
    one iteration are stacked into one small vector and allreduced together.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._mpi import Communicator, ReduceOp, resolve_comm
from ..comm.allreduce import allreduce

LAYOUTS = ("replicated", "sharded")


class Reason(enum.IntEnum):
    """Why a solve stopped. Values follow PETSc's KSPConvergedReason."""

    CONVERGED_RTOL = 2
    CONVERGED_ATOL = 3
    CONVERGED_HAPPY_BREAKDOWN = 5  # exact solution found (Krylov space exhausted)
    ITERATING = 0
    DIVERGED_MAX_IT = -3
    DIVERGED_BREAKDOWN = -5
    DIVERGED_INDEFINITE_PC = -8
    DIVERGED_NANORINF = -9
    DIVERGED_INDEFINITE_MAT = -10


class SolverInfo(NamedTuple):
    """Convergence information, a pytree usable under jit; identical on every rank.

    Attributes:
      iterations: iterations performed (int32 scalar).
      residual_norm: final residual norm ||b - A x|| (unpreconditioned, 2-norm of
        the global vector) as given by the method's recurrence, not recomputed.
      converged: whether a convergence criterion was met (bool scalar).
      reason: a :class:`Reason` code (int32 scalar); ``Reason(int(info.reason))``.
      history: residual norms of iterations 0..history_size-1 (NaN past the
        last iteration), or None when not requested.
    """

    iterations: Any
    residual_norm: Any
    converged: Any
    reason: Any
    history: Any = None


# ---------------------------------------------------------------------------
# Operators
def as_matvec(A: Any, layout: str) -> Callable[[Any], Any]:
    """A callable, a dense array (rows of this rank in the sharded layout is
    NOT supported for dense arrays: pass an operator) or a distlinalg operator."""
    op_layout = getattr(A, "layout", None)
    if op_layout is not None and hasattr(A, "matvec"):
        if op_layout != layout:
            raise ValueError(
                f"distlinalg: the operator's layout is {op_layout!r} but the solve was asked "
                f"for layout={layout!r}; pass layout={op_layout!r}"
            )
        return A.matvec
    if callable(A):
        return A
    A = jnp.asarray(A)
    if A.ndim != 2 or A.shape[0] != A.shape[1]:
        raise ValueError(f"distlinalg: a dense A must be a square matrix, got shape {A.shape}")
    if layout != "replicated":
        raise ValueError(
            "distlinalg: a dense array A is a replicated operator (every rank holds all of A); "
            "use layout='replicated' or a sharded operator from distlinalg.operators"
        )
    return lambda v: A @ v


def identity(v: Any) -> Any:
    return v


def check_layout(layout: str | None) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"distlinalg: layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def check_same_structure(b: Any, x0: Any) -> None:
    sb, sx = jax.tree_util.tree_structure(b), jax.tree_util.tree_structure(x0)
    if sb != sx:
        raise ValueError(f"distlinalg: x0 and b must have the same pytree structure, got {sx} and {sb}")
    for lb, lx in zip(jax.tree_util.tree_leaves(b), jax.tree_util.tree_leaves(x0)):
        if jnp.shape(lb) != jnp.shape(lx):
            raise ValueError(f"distlinalg: x0 and b leaves differ in shape: {jnp.shape(lx)} vs {jnp.shape(lb)}")


# ---------------------------------------------------------------------------
# Vector algebra on pytrees
def tree_axpy(alpha: Any, x: Any, y: Any) -> Any:
    """alpha * x + y."""
    return jax.tree_util.tree_map(lambda a, b: (alpha * a).astype(b.dtype) + b, x, y)


def tree_scale_add(x: Any, beta: Any, y: Any) -> Any:
    """x + beta * y."""
    return jax.tree_util.tree_map(lambda a, b: a + (beta * b).astype(a.dtype), x, y)


def tree_sub(x: Any, y: Any) -> Any:
    return jax.tree_util.tree_map(jnp.subtract, x, y)


def tree_scale(alpha: Any, x: Any) -> Any:
    return jax.tree_util.tree_map(lambda a: (alpha * a).astype(a.dtype), x)


def local_vdot(x: Any, y: Any) -> Any:
    """Σ conj(x)·y over all leaves of this rank's pieces (complex when inputs are)."""
    parts = [jnp.vdot(a, b) for a, b in zip(jax.tree_util.tree_leaves(x), jax.tree_util.tree_leaves(y))]
    return sum(parts[1:], parts[0])


def scalar_dtype(tree: Any) -> Any:
    return jnp.result_type(*jax.tree_util.tree_leaves(tree))


class Reductions:
    """Inner products in a layout, several fused into one allreduce.

    ``dots(pairs)`` returns Σ_ranks <x, y> for each pair in the sharded
    layout (one allreduce for all pairs) and the local values in the
    replicated layout (no communication).
    """

    def __init__(self, layout: str, comm: Communicator):
        self.layout = layout
        self.comm = comm
        self.count = 0  # allreduces emitted per traced iteration (benchmarks read it)

    def dots(self, pairs: Sequence[tuple[Any, Any]]) -> list[Any]:
        values = jnp.stack([local_vdot(x, y) for x, y in pairs])
        if self.layout == "sharded":
            self.count += 1
            values = allreduce(values, "sum", comm=self.comm)
        return [values[i] for i in range(len(pairs))]

    def max_abs(self, tree: Any) -> Any:
        """max |v_i| over the whole (global) vector, identical on every rank.

        Used once per solve to scale the right-hand side: unlike the 2-norm,
        it cannot underflow (a vector of 1e-300 entries has a squared norm of
        0 in floating point).
        """
        leaves = [jnp.max(jnp.abs(leaf), initial=0.0) for leaf in jax.tree_util.tree_leaves(tree)]
        value = jnp.max(jnp.stack(leaves)) if leaves else jnp.zeros(())
        if self.comm.size == 1:
            return value
        return allreduce(value, "max", comm=self.comm)

    def agree(self, value: Any) -> Any:
        """The max over ranks of a local stopping quantity (replicated layout).

        Local inner products of replicated vectors agree on every rank only if
        the matvec returns bitwise identical vectors everywhere; this makes the
        stopping decision identical regardless. Sharded values already agree.
        """
        if self.layout == "sharded" or self.comm.size == 1:
            return value
        self.count += 1
        return allreduce(value, "max", comm=self.comm)


def stopping_threshold(b_norm: Any, rtol: Any, atol: Any) -> tuple[Any, Any]:
    """(threshold on ||r||, whether it came from atol)."""
    rtol_part = rtol * b_norm
    return jnp.maximum(rtol_part, atol), atol >= rtol_part


def resolve_tolerances(tol: Any, rtol: Any, atol: Any) -> tuple[Any, Any]:
    if tol is not None:
        rtol = tol
    if np.ndim(rtol) or np.ndim(atol):
        raise ValueError("distlinalg: rtol and atol must be scalars")
    return rtol, atol


def default_maxiter(b: Any, layout: str, comm: Communicator) -> int:
    n = sum(int(np.size(leaf)) for leaf in jax.tree_util.tree_leaves(b))
    if layout == "sharded":
        n *= comm.size
    return 10 * n


def new_history(size: int, dtype: Any) -> Any:
    if size <= 0:
        return None
    return jnp.full((size,), jnp.nan, dtype)


def record(history: Any, k: Any, value: Any) -> Any:
    if history is None:
        return None
    return jax.lax.cond(k < history.shape[0], lambda h: h.at[k].set(value), lambda h: h, history)


def monitor_print(name: str, comm: Communicator, enabled: bool, k: Any, rnorm: Any) -> None:
    """PETSc-style ``-ksp_monitor`` line on rank 0 (jax.debug.print, ordered)."""
    if enabled and comm.rank == 0:
        jax.debug.print(name + " {k:4d} KSP Residual norm {r:.12e}", k=k, r=rnorm, ordered=True)


def finish_reason(converged_atol: Any, converged: Any, k: Any, maxiter: int, reason: Any) -> Any:
    """The final reason code from the loop state."""
    final = jnp.where(
        reason != Reason.ITERATING,
        reason,
        jnp.where(
            converged,
            jnp.where(converged_atol, Reason.CONVERGED_ATOL, Reason.CONVERGED_RTOL),
            jnp.where(k >= maxiter, Reason.DIVERGED_MAX_IT, Reason.ITERATING),
        ),
    )
    return final.astype(jnp.int32)


def resolve(comm: Any, layout: str) -> tuple[Communicator, str]:
    return resolve_comm(comm), check_layout(layout)


class Problem(NamedTuple):
    """A solve's validated inputs (shared by every method)."""

    matvec: Callable[[Any], Any]
    precond: Callable[[Any], Any]
    x0: Any
    rtol: Any
    atol: Any
    maxiter: int
    reductions: Reductions


def setup(A: Any, b: Any, x0: Any, M: Any, tol: Any, rtol: Any, atol: Any, maxiter: Any,
          layout: str | None, comm: Any) -> Problem:
    """Resolve and check the arguments common to cg and minres (trace time).

    A distlinalg operator brings its layout and communicator: ``layout=None``
    and ``comm=None`` take them from `A`.
    """
    is_operator = hasattr(A, "matvec") and getattr(A, "layout", None) is not None
    if layout is None:
        layout = A.layout if is_operator else "replicated"
    if comm is None and is_operator:
        comm = getattr(A, "comm", None)
    comm, layout = resolve(comm, layout)
    matvec = as_matvec(A, layout)
    precond = identity if M is None else as_matvec(M, layout)
    rtol, atol = resolve_tolerances(tol, rtol, atol)
    if x0 is None:
        x0 = jax.tree_util.tree_map(jnp.zeros_like, b)
    check_same_structure(b, x0)
    if maxiter is None:
        maxiter = default_maxiter(b, layout, comm)
    return Problem(matvec, precond, x0, rtol, atol, int(maxiter), Reductions(layout, comm))


# ---------------------------------------------------------------------------
# Real-linear operators on complex vectors
def _split(tree: Any) -> tuple[Any, Any]:
    return (jax.tree_util.tree_map(jnp.real, tree), jax.tree_util.tree_map(jnp.imag, tree))


def _merge(pair: tuple[Any, Any], like: Any) -> Any:
    return jax.tree_util.tree_map(lambda r, i, x: (r + 1j * i).astype(jnp.result_type(x)), *pair, like)


class _RealPairs:
    """A real-linear map of complex vectors as a linear map of (Re, Im) pairs."""

    def __init__(self, op: Any, like: Any, layout: str | None):
        apply = op.matvec if hasattr(op, "matvec") else op
        self.matvec = lambda pair: _split(apply(_merge(pair, like)))
        self.layout = getattr(op, "layout", None) or layout or "replicated"
        self.comm = getattr(op, "comm", None)


def is_real_linear(A: Any) -> bool:
    return bool(getattr(A, "real_linear", False))


def solve_real_linear(solver: Callable[..., Any], A: Any, b: Any, x0: Any, M: Any, **options: Any) -> Any:
    """Run `solver` on the real system of (Re, Im) pairs of a real-linear A.

    An operator that is only real-linear on complex vectors (A(i v) ≠ i A v)
    is a symmetric real operator on R²ⁿ; the Krylov recurrences need that
    real inner product, Re⟨u, v⟩, not the complex one.
    """
    layout = options.get("layout")
    pair_b = _split(b)
    pair_x0 = None if x0 is None else _split(x0)
    pair_M = None if M is None else _RealPairs(M, b, layout)
    x, info = solver(_RealPairs(A, b, layout), pair_b, pair_x0, M=pair_M, **options)
    return _merge(x, b), info


__all__ = [
    "Reason",
    "SolverInfo",
    "Reductions",
    "as_matvec",
    "identity",
    "LAYOUTS",
    "ReduceOp",
]
