"""What the Krylov solvers share: operators, layouts, reductions, info, monitors.

Layouts
  * ``"replicated"``: every rank holds the whole vector (natural-gradient
    solves: parameters replicated, samples sharded, the matvec allreduces).
    Inner products are local; the one scalar that decides whether to stop is
    made identical on every rank by an allreduce (max), so ranks can never
    disagree about the iteration count, whatever the matvec does.
  * ``"sharded"``: each rank holds its block of rows; the inner products of
    one iteration are stacked into one small vector and allreduced together.

Rule: whatever steers control flow (the iteration limit, the stopping
threshold, the stopping quantity, failure codes) is identical on every rank
by construction, i.e. it comes out of an allreduce. Inputs that may differ
between ranks are compared in-graph (see ``_agreement``); a disagreement
stops every rank at the same point with ``Reason.DIVERGED_INCONSISTENT_RANKS``.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import _compat
from .._mpi import Communicator, ReduceOp, resolve_comm
from ..comm.allgather import allgather
from ..comm.allreduce import allreduce
from ..comm.nonblocking import iallreduce, wait
from ..comm.overlap import overlap
from ..operators._base import LinearOperator  # operators never import the solvers

LAYOUTS = ("replicated", "sharded")


class Reason(enum.IntEnum):
    """Why a solve stopped. Values follow PETSc's KSPConvergedReason.

    ``DIVERGED_INCONSISTENT_RANKS`` (-20, not a PETSc code) is distlinalg's
    own: the ranks did not agree, so every rank stopped at the same point
    without a trustworthy answer. Raised when
      * rtol, atol or maxiter differ between ranks, or a traced value of
        them is invalid (NaN, negative, non-finite) on some rank;
      * replicated layout: the right-hand side differs between ranks (its
        size, norm or a fixed random projection, compared to about half the
        working precision);
      * replicated layout: the stopping quantity (residual norm) or the
        curvature of the first Krylov direction differs between ranks in the
        first iteration beyond what rounding explains: a "replicated"
        operator that is in fact rank-local (e.g. a Gram matrix of each
        rank's own samples without the allreduce).
    These checks are one-sided evidence: passing them does not prove that the
    operator is identical on every rank (an operator that differs only by a
    scale factor is caught only through the curvature).
    """

    CONVERGED_RTOL = 2
    CONVERGED_ATOL = 3
    CONVERGED_HAPPY_BREAKDOWN = 5  # exact solution found (Krylov space exhausted)
    ITERATING = 0
    DIVERGED_MAX_IT = -3
    DIVERGED_BREAKDOWN = -5
    DIVERGED_INDEFINITE_PC = -8
    DIVERGED_NANORINF = -9
    DIVERGED_INDEFINITE_MAT = -10
    DIVERGED_INCONSISTENT_RANKS = -20


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
def is_operator(A: Any) -> bool:
    """A distlinalg operator (:class:`distlinalg.operators.LinearOperator` or a
    subclass: it brings its layout and communicator), as opposed to a plain
    callable, matrix or ``__matmul__`` object."""
    return isinstance(A, LinearOperator)


def as_matvec(A: Any, layout: str, like: Any = None, what: str = "A") -> Callable[[Any], Any]:
    """``v -> A v`` for what jax.scipy.sparse.linalg accepts, and distlinalg operators.

    * a distlinalg operator: its matvec (its layout must be the solve's);
    * a callable: itself;
    * a NumPy or JAX array: a square matrix, replicated layout only (a
      sharded matrix is an operator from distlinalg.operators), applied at
      the highest matmul precision as jax.scipy does;
    * any other object with ``__matmul__`` (and, if it has one, a square
      ``shape``): ``A @ v``.
    Anything else is a TypeError. The messages start with jax.scipy's wording.
    """
    if is_operator(A):
        if A.layout != layout:
            raise ValueError(
                f"distlinalg: the operator's layout is {A.layout!r} but the solve was asked "
                f"for layout={layout!r}; pass layout={A.layout!r}"
            )
        return A.matvec
    if callable(A):
        return A
    if isinstance(A, (np.ndarray, jax.Array)):
        if A.ndim != 2 or A.shape[0] != A.shape[1]:
            raise ValueError(f"linear operator must be a square matrix, but has shape: {A.shape} "
                             f"(distlinalg: {what} as a dense array)")
        if layout != "replicated":
            raise ValueError(
                f"distlinalg: a dense array {what} is a replicated operator (every rank holds all of it); "
                "use layout='replicated' or a sharded operator from distlinalg.operators"
            )
        if like is not None and not _fits_dense(A, like):
            shapes = [jnp.shape(leaf) for leaf in jax.tree_util.tree_leaves(like)]
            raise ValueError(f"distlinalg: a dense {what} of shape {A.shape} does not fit b (leaf shapes {shapes})")
        matrix = A
        return lambda v: jnp.matmul(matrix, v, precision=jax.lax.Precision.HIGHEST)
    if hasattr(A, "__matmul__"):
        shape = getattr(A, "shape", None)
        if shape is not None and (len(shape) != 2 or shape[0] != shape[1]):
            raise ValueError(f"linear operator must be a square matrix, but has shape: {shape}")
        return lambda v: A @ v
    raise TypeError(f"linear operator must be either a function or ndarray: {A!r} "
                    f"(distlinalg: {what} may be a callable, an array, an object with __matmul__ "
                    "or a distlinalg operator)")


def _fits_dense(A: Any, like: Any) -> bool:
    leaves = jax.tree_util.tree_leaves(like)
    return len(leaves) == 1 and jnp.ndim(leaves[0]) >= 1 and jnp.shape(leaves[0])[0] == A.shape[1]


def identity(v: Any) -> Any:
    return v


def check_layout(layout: str | None) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"distlinalg: layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def check_same_structure(b: Any, x0: Any) -> None:
    """x0 fits b (jax.scipy's wording, so code that matches its errors keeps working)."""
    sb, sx = jax.tree_util.tree_structure(b), jax.tree_util.tree_structure(x0)
    if sb != sx:
        raise ValueError(f"x0 and b must have matching tree structure: {sx} vs {sb}")
    shapes_b = [jnp.shape(leaf) for leaf in jax.tree_util.tree_leaves(b)]
    shapes_x = [jnp.shape(leaf) for leaf in jax.tree_util.tree_leaves(x0)]
    if shapes_b != shapes_x:
        raise ValueError(f"arrays in x0 and b must have matching shapes: {shapes_x} vs {shapes_b}")


# ---------------------------------------------------------------------------
# Vector algebra on pytrees
def as_coefficient(alpha: Any, leaf: Any) -> Any:
    """The scalar `alpha` in `leaf`'s dtype (and weak type).

    The recurrences' scalars are real (norms, HPD inner products) or of the
    system's dtype; casting them to each leaf first keeps every vector update
    in the vectors' own dtype, so the solvers run under
    ``jax_numpy_dtype_promotion="strict"`` and keep weakly typed inputs weak.
    """
    if not jnp.iscomplexobj(leaf) and jnp.iscomplexobj(alpha):
        alpha = jnp.real(alpha)
    return _compat.convert_element_type(alpha, jnp.result_type(leaf), _compat.is_weakly_typed(leaf))


def tree_axpy(alpha: Any, x: Any, y: Any) -> Any:
    """alpha * x + y."""
    return jax.tree_util.tree_map(lambda a, b: as_coefficient(alpha, b) * a.astype(b.dtype) + b, x, y)


def tree_scale_add(x: Any, beta: Any, y: Any) -> Any:
    """x + beta * y."""
    return jax.tree_util.tree_map(lambda a, b: a + as_coefficient(beta, a) * b.astype(a.dtype), x, y)


def tree_sub(x: Any, y: Any) -> Any:
    return jax.tree_util.tree_map(jnp.subtract, x, y)


def tree_scale(alpha: Any, x: Any) -> Any:
    return jax.tree_util.tree_map(lambda a: as_coefficient(alpha, a) * a, x)


def local_vdot(x: Any, y: Any) -> Any:
    """Σ conj(x)·y over all leaves of this rank's pieces (complex when inputs are).

    Leaves of different dtypes (a real and a complex leaf in one pytree) are
    summed in their common dtype, explicitly (strict dtype promotion).
    """
    parts = [jnp.vdot(a, b, precision=jax.lax.Precision.HIGHEST)
             for a, b in zip(jax.tree_util.tree_leaves(x), jax.tree_util.tree_leaves(y))]
    dtype = common_dtype(*[p.dtype for p in parts])
    parts = [p.astype(dtype) for p in parts]
    return sum(parts[1:], parts[0])


def common_dtype(*dtypes: Any) -> Any:
    """The dtype that holds all of `dtypes`, by JAX's standard promotion.

    Used where the solvers combine values explicitly (then cast), so it also
    holds under ``jax_numpy_dtype_promotion="strict"``.
    """
    with jax.numpy_dtype_promotion("standard"):
        return jnp.result_type(*dtypes)


def scalar_dtype(tree: Any) -> Any:
    return common_dtype(*[jnp.result_type(leaf) for leaf in jax.tree_util.tree_leaves(tree)])


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
        local = [local_vdot(x, y) for x, y in pairs]
        dtype = common_dtype(*[v.dtype for v in local])
        values = self.sum(jnp.stack([v.astype(dtype) for v in local]))
        return [values[i] for i in range(len(pairs))]

    def start_dots(self, pairs: Sequence[tuple[Any, Any]]) -> "PendingDots":
        """Start ``dots(pairs)`` without waiting; :meth:`finish` returns the values.

        Sharded layout: one non-blocking allreduce (``iallreduce``) of the local
        inner products, in flight until `finish`, so the work traced in between
        (a pipelined solver's matvec and preconditioner) overlaps it. Replicated
        layout: the local values, nothing to wait for.
        """
        local = [local_vdot(x, y) for x, y in pairs]
        dtype = common_dtype(*[v.dtype for v in local])
        stacked = jnp.stack([v.astype(dtype) for v in local])
        if self.layout == "sharded":
            self.count += 1
            return PendingDots(iallreduce(stacked, "sum", comm=self.comm), None)
        return PendingDots(None, stacked)

    def finish(self, pending: "PendingDots") -> list[Any]:
        """The values of a :meth:`start_dots` (waits for its reduction)."""
        values = pending.values if pending.request is None else wait(pending.request)
        return [values[i] for i in range(values.shape[0])]

    def finish_while(self, pending: "PendingDots", work: Callable[..., Any], *args: Any) -> tuple[list[Any], Any]:
        """``(finish(pending), work(*args))``, `work` computed while the reduction travels.

        Sharded layout: comm.overlap pins `work` between the reduction's
        start and its wait (XLA would otherwise be free to run the wait first).
        """
        if pending.request is None:
            return self.finish(pending), work(*args)
        values, out = overlap(pending.request, work, *args)
        return [values[i] for i in range(values.shape[0])], out

    def sum(self, values: Any) -> Any:
        """Σ over ranks of a small vector of local partial sums (sharded layout;
        the replicated layout's local values are already whole)."""
        if self.layout == "sharded":
            self.count += 1
            values = allreduce(values, "sum", comm=self.comm)
        return values

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

    def agree(self, value: Any, failure: Any, also: Sequence[Any] = (), probe: Any = None) -> "Agreed":
        """Replicated layout: the stopping quantities made identical on every rank.

        Local inner products of replicated vectors agree on every rank only if
        the matvec returns bitwise identical vectors everywhere; one fused
        max-allreduce of (v, −v, −code, *also[, p, −p, scale]) makes the stopping
        decision identical regardless: failure codes are ≤ 0, so the most
        negative wins everywhere. The minima (−max of −v) come in the same
        message, for `inconsistent`. `value`, `also` and `probe` are real
        scalars of one dtype; `probe` is ``(p, scale)``. Sharded values (and a
        single rank's) already agree: no message.

        Every rank decides from the same message, and a NaN on some rank
        always comes with a failure code (the callers' contract), so no
        decision depends on how MPI orders NaNs in its max.
        """
        if self.layout == "sharded" or self.comm.size == 1:
            p, scale = probe if probe is not None else (None, None)
            return Agreed(value, value, failure.astype(jnp.int32), list(also), p, p, scale, compared=False)
        dtype = value.dtype
        entries = [value, -value, -failure.astype(dtype), *[jnp.asarray(a, dtype) for a in also]]
        if probe is not None:
            entries += [probe[0], -probe[0], probe[1]]
        self.count += 1
        m = allreduce(jnp.stack([jnp.asarray(e, dtype) for e in entries]), "max", comm=self.comm)
        n = 3 + len(also)
        code = (-m[2]).astype(jnp.int32)
        also_max = [m[3 + i] for i in range(len(also))]
        if probe is None:
            return Agreed(m[0], -m[1], code, also_max, None, None, None, compared=True)
        return Agreed(m[0], -m[1], code, also_max, m[n], -m[n + 1], m[n + 2], compared=True)


class PendingDots(NamedTuple):
    """Inner products under way (`Reductions.start_dots`): a request, or the local values."""

    request: Any  # distlinalg.comm.Request of the sharded layout's reduction, else None
    values: Any  # the replicated layout's local values, else None


class Agreed(NamedTuple):
    """What `Reductions.agree` returns: maxima (and minima) over ranks."""

    value: Any  # max of the stopping quantity
    low: Any  # its min
    failure: Any  # agreed failure code (int32)
    also: list  # max of each extra scalar
    probe: Any  # max of the probe (None without one)
    probe_low: Any
    probe_scale: Any
    compared: bool  # whether the ranks' values met in a message (else nothing to compare)


def consistency_tolerance(dtype: Any) -> float:
    """Relative tolerance of the cross-rank comparisons: 8 √eps of `dtype`.

    Legitimately replicated values differ only by rounding (ranks may run
    different XLA thread counts, so reductions round differently); that is
    a few eps, amplified in the first Krylov step by at most about κ(A) eps.
    8 √eps (1.2e-7 in float64, 2.8e-3 in float32) leaves room for
    κ up to about 1/√eps, yet any real difference between ranks' data
    (another sample set, another b) is orders of magnitude larger.
    """
    return 8.0 * math.sqrt(float(jnp.finfo(dtype).eps))


def inconsistent(agreed: Agreed, enabled: Any, scale: Any, squared: bool) -> Any:
    """Whether the ranks' stopping quantities (and probes) disagree beyond rounding.

    Compares ‖r‖_max with ‖r‖_min (√ of the agreed squares when `squared`)
    relative to max(`scale`, ‖r‖_max), `scale` being ‖b‖: an absolute
    comparison in units of the right-hand side, so a residual that has
    already dropped by many orders (where rounding dominates it) never
    trips it. The probe (the curvature of the step) is compared relative to
    its own scale. Only called in the first iterations (`enabled`): later,
    rank-dependent rounding legitimately makes replicated Krylov runs drift
    apart (CG and MINRES amplify it exponentially on ill-conditioned
    problems), while a rank-local operator shows in the first step.
    Identical on every rank: computed from one message.
    """
    if not agreed.compared:  # sharded layout or one rank: the values are global already
        return jnp.bool_(False)
    tol = consistency_tolerance(agreed.value.dtype)
    high, low = agreed.value, agreed.low
    if squared:
        high, low = jnp.sqrt(jnp.maximum(high, 0)), jnp.sqrt(jnp.maximum(low, 0))
    differ = jnp.abs(high - low) > tol * jnp.maximum(scale, high)
    if agreed.probe is not None:
        differ = differ | (jnp.abs(agreed.probe - agreed.probe_low) > tol * agreed.probe_scale)
    return enabled & (agreed.failure == Reason.ITERATING) & differ


def mark_inconsistent(failure: Any, flag: Any) -> Any:
    return jnp.where(flag, jnp.int32(Reason.DIVERGED_INCONSISTENT_RANKS), failure).astype(jnp.int32)


def stopping_threshold(b_norm: Any, rtol: Any, atol: Any) -> tuple[Any, Any]:
    """(threshold on ||r||, whether it came from atol)."""
    rtol_part = rtol * b_norm
    return jnp.maximum(rtol_part, atol), atol >= rtol_part


INT32_MAX = 2**31 - 1


def is_traced(value: Any) -> bool:
    return isinstance(value, jax.core.Tracer)


def resolve_tolerances(tol: Any, rtol: Any, atol: Any) -> tuple[Any, Any, Any]:
    """(rtol, atol, invalid): checked tolerances.

    Python (and other concrete) numbers are checked here and raise a
    ValueError at trace time (on every rank: `setup` runs this `collectively`).
    Traced values cannot be checked before the program runs: `invalid` is
    then a traced bool that the input agreement turns into
    ``DIVERGED_INCONSISTENT_RANKS`` on every rank (False when all are concrete).
    """
    if tol is not None:
        rtol = tol
    invalid: Any = False
    for name, value in (("rtol", rtol), ("atol", atol)):
        if np.ndim(value):
            raise ValueError(f"distlinalg: {name} must be a scalar, got shape {np.shape(value)}")
        dtype = _dtype_of(value)
        if dtype is None or not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)) \
                or dtype == jnp.bool_:
            raise ValueError(f"distlinalg: {name} must be a real number, got {value!r}")
        if is_traced(value):
            invalid = invalid | ~jnp.isfinite(value) | (value < 0)
        elif not (math.isfinite(float(value)) and float(value) >= 0):
            raise ValueError(f"distlinalg: {name} must be a finite number >= 0, got {value!r}")
    if not is_traced(rtol) and not is_traced(atol):
        if float(rtol) == 0 and float(atol) == 0:
            raise ValueError("distlinalg: rtol or atol must be positive (both are 0: nothing could converge)")
    else:
        invalid = invalid | ((rtol == 0) & (atol == 0))
    return rtol, atol, invalid


def _dtype_of(value: Any) -> Any:
    """The dtype of a scalar argument, or None for something that is not a number."""
    try:
        return jnp.result_type(value)
    except (TypeError, ValueError):
        return None


def check_maxiter(maxiter: Any) -> tuple[Any, Any]:
    """(maxiter, invalid): None, a Python int (clamped to int32), or a traced int32.

    A negative or non-integer concrete value raises (trace time, every
    rank); a traced value must have an integer dtype, and a negative one is
    flagged in-graph like a bad traced tolerance.
    """
    if maxiter is None:
        return None, False
    if np.ndim(maxiter):
        raise ValueError(f"distlinalg: maxiter must be a scalar, got shape {np.shape(maxiter)}")
    dtype = _dtype_of(maxiter)
    if isinstance(maxiter, bool) or dtype is None or dtype == jnp.bool_ or not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(f"distlinalg: maxiter must be an integer, got {maxiter!r}")
    if is_traced(maxiter):
        # The loop counter is int32: clamp, after noting a negative value.
        return jnp.clip(maxiter, 0, INT32_MAX).astype(jnp.int32), maxiter < 0
    if int(maxiter) < 0:
        raise ValueError(f"distlinalg: maxiter must be >= 0, got {maxiter!r}")
    return min(int(maxiter), INT32_MAX), False


def global_size(b: Any) -> int:
    """Entries of this rank's `b` (all leaves)."""
    return sum(int(np.size(leaf)) for leaf in jax.tree_util.tree_leaves(b))


def default_maxiter(b: Any) -> int:
    """Replicated layout: 10 × the size of b, the same on every rank.

    (The input agreement checks that b's size agrees. The sharded default,
    10 × ranks × the largest block, needs the blocks of every rank, so it
    comes out of the agreement message: `_agreement._sharded_default`.)
    """
    return min(10 * global_size(b), INT32_MAX)


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


def finish_reason(converged_atol: Any, converged: Any, k: Any, maxiter: Any, reason: Any) -> Any:
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


class Problem(NamedTuple):
    """A solve's validated inputs (shared by every method).

    rtol, atol and maxiter are this rank's values: the iteration uses the
    ones agreed across ranks (`_agreement.agree_inputs`). `maxiter` is None
    for the default. `invalid` says that a traced rtol, atol or maxiter is
    invalid on this rank (a traced bool; False when all are concrete, which
    `setup` has checked).
    """

    matvec: Callable[[Any], Any]
    precond: Callable[[Any], Any]
    x0: Any
    rtol: Any
    atol: Any
    maxiter: Any
    reductions: Reductions
    invalid: Any
    b: Any  # the right-hand side as arrays (Python scalars become weakly typed arrays)


def as_arrays(tree: Any) -> Any:
    """Every leaf as a JAX array (Python numbers stay weakly typed, as in jax.scipy)."""
    return jax.tree_util.tree_map(jnp.asarray, tree)


def setup(A: Any, b: Any, x0: Any, M: Any, tol: Any, rtol: Any, atol: Any, maxiter: Any,
          layout: str | None, comm: Any) -> Problem:
    """Resolve and check the arguments common to cg and minres (trace time).

    A distlinalg operator brings its layout and communicator: ``layout=None``
    and ``comm=None`` take them from `A`. Every check is collective (see
    `collectively`): an argument that is invalid on some rank raises a
    ValueError on every rank.
    """
    if layout is None:
        layout = A.layout if is_operator(A) else "replicated"
    if comm is None and is_operator(A):
        comm = A.comm
    comm = resolve_comm(comm)

    def build() -> Problem:
        checked_layout = check_layout(layout)
        rtol_, atol_, bad_tolerance = resolve_tolerances(tol, rtol, atol)
        maxiter_, bad_maxiter = check_maxiter(maxiter)
        b_ = as_arrays(b)
        x0_ = jax.tree_util.tree_map(jnp.zeros_like, b_) if x0 is None else as_arrays(x0)
        check_same_structure(b_, x0_)
        matvec = as_matvec(A, checked_layout, b_, "A")
        precond = identity if M is None else as_matvec(M, checked_layout, b_, "M")
        return Problem(matvec, precond, x0_, rtol_, atol_, maxiter_, Reductions(checked_layout, comm),
                       bad_tolerance | bad_maxiter, b_)

    return collectively(build, comm)


_MESSAGE_BYTES = 256


def collectively(build: Callable[[], Any], comm: Communicator) -> Any:
    """`build()`, with its ValueError (or TypeError) raised on every rank if it is raised on any.

    Argument checks run at trace time on each rank, and the arguments of a
    replicated solve can differ between ranks (a b built by rank-dependent
    code): a rank raising alone would leave the others blocked in the
    solve's first allreduce. So the ranks exchange their outcome (one small
    eager allgather of the error messages, at trace time, like the size
    exchanges of the operators; it is ordered after what the rank dispatched
    before): a rank whose arguments are invalid raises its own error, the
    others an error naming it and its message.
    """
    try:
        value, error = build(), None
    except (ValueError, TypeError) as raised:
        value, error = None, raised
    if comm.size > 1:
        # The first byte of a message names the exception type (V or T).
        mine = "" if error is None else ("T" if isinstance(error, TypeError) else "V") + str(error)
        messages = _exchange_messages(mine, comm)
        failed = [r for r, message in enumerate(messages) if message]
        if failed and error is None:
            details = "; ".join(f"rank {r}: {messages[r][1:]}" for r in failed)
            kind = TypeError if all(messages[r][0] == "T" for r in failed) else ValueError
            raise kind(f"distlinalg: invalid solver arguments on rank(s) {failed} ({details})")
    if error is not None:
        raise error
    return value


def _exchange_messages(message: str, comm: Communicator) -> list[str]:
    """Every rank's `message` (cut to 255 bytes), on every rank, at trace time."""
    data = message.encode()[: _MESSAGE_BYTES - 1]
    row = np.zeros(_MESSAGE_BYTES, np.uint8)
    row[0] = len(data)
    row[1 : 1 + len(data)] = np.frombuffer(data, np.uint8)
    with jax.ensure_compile_time_eval():
        table = np.asarray(allgather(jnp.asarray(row), comm=comm))
    return [bytes(r[1 : 1 + int(r[0])]).decode(errors="replace") for r in table]


# ---------------------------------------------------------------------------
# Real-linear operators on complex vectors
def _split(tree: Any) -> tuple[Any, Any]:
    return (jax.tree_util.tree_map(jnp.real, tree), jax.tree_util.tree_map(jnp.imag, tree))


def _merge(pair: tuple[Any, Any], like: Any) -> Any:
    return jax.tree_util.tree_map(lambda r, i, x: (r + 1j * i).astype(jnp.result_type(x)), *pair, like)


def _real_pairs(op: Any, like: Any, layout: str | None) -> LinearOperator:
    """A real-linear map of complex vectors as a linear map of (Re, Im) pairs."""
    apply = op.matvec if is_operator(op) else as_matvec(op, layout or "replicated", like, "M")
    return LinearOperator(lambda pair: _split(apply(_merge(pair, like))),
                          layout=(op.layout if is_operator(op) else None) or layout or "replicated",
                          comm=op.comm if is_operator(op) else None, name="RealPairs")


def is_real_linear(A: Any) -> bool:
    return is_operator(A) and A.real_linear


def solve_real_linear(solver: Callable[..., Any], A: Any, b: Any, x0: Any, M: Any, **options: Any) -> Any:
    """Run `solver` on the real system of (Re, Im) pairs of a real-linear A.

    An operator that is only real-linear on complex vectors (A(i v) ≠ i A v)
    is a symmetric real operator on R²ⁿ; the Krylov recurrences need that
    real inner product, Re⟨u, v⟩, not the complex one.
    """
    layout = options.get("layout")
    pair_b = _split(b)
    pair_x0 = None if x0 is None else _split(x0)
    pair_M = None if M is None else _real_pairs(M, b, layout)
    x, info = solver(_real_pairs(A, b, layout), pair_b, pair_x0, M=pair_M, **options)
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
