"""What the Krylov methods share: reasons, info, reductions, stopping.

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

Elsewhere: the arguments of a solve (``_arguments``), the vector algebra of
the recurrences (``_vectors``), the differentiable wrapper (``_driver``).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .._runtime.mpi import Communicator
from ..comm.allreduce import allreduce
from ..comm.nonblocking import iallreduce, wait
from ..comm.overlap import overlap
from ._vectors import common_dtype, local_vdots


class Reason(enum.IntEnum):
    """Why a solve stopped. Values follow PETSc's KSPConvergedReason.

    ``DIVERGED_INCONSISTENT_RANKS`` (-20, not a PETSc code) is distlinalg's
    own: the ranks did not agree, so every rank stopped at the same point
    without a trustworthy answer. Raised when:

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

    ``DIVERGED_ACCURACY_LOST`` (-21, distlinalg's own; Belos's "loss of
    accuracy"): the method's recurrence met the tolerance, but the true
    residual ‖b − A x‖ did not, also after restarting from it (see
    ``verify_residual`` of the solvers, docs/solvers.md).

    Example:
      >>> import jax.numpy as jnp
      >>> import distlinalg as dl
      >>> x, info = dl.cg(jnp.eye(3), jnp.ones(3), maxiter=0)
      >>> dl.solvers.Reason(int(info.reason)).name
      'DIVERGED_MAX_IT'
      >>> dl.solvers.Reason.CONVERGED_RTOL > 0   # converged codes are positive
      True
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
    DIVERGED_ACCURACY_LOST = -21  # the recurrence converged, the true residual did not (restarts did not help)


class SolverInfo(NamedTuple):
    """Convergence information, a pytree usable under jit; identical on every rank.

    Attributes:
      iterations: iterations performed (int32 scalar).
      residual_norm: final residual norm ||b - A x|| (unpreconditioned, 2-norm of
        the global vector): the true norm, computed once, when the iteration
        claimed convergence (``verify_residual``, the default), else as given
        by the method's recurrence.
      converged: whether a convergence criterion was met (bool scalar).
      reason: a :class:`Reason` code (int32 scalar); ``Reason(int(info.reason))``.
      history: residual norms of iterations 0..history_size-1 (NaN past the
        last iteration), or None when not requested.

    Example:
      >>> import jax.numpy as jnp
      >>> import distlinalg as dl
      >>> A = jnp.diag(jnp.array([1.0, 2.0, 3.0]))
      >>> x, info = dl.cg(A, jnp.ones(3), rtol=1e-6, history=5)
      >>> int(info.iterations), bool(info.converged), info.history.shape
      (3, True, (5,))
    """

    iterations: Any
    residual_norm: Any
    converged: Any
    reason: Any
    history: Any = None


class Reductions:
    """Inner products in a layout, several fused into one allreduce.

    ``dots(pairs)`` returns Σ_ranks <x, y> for each pair in the sharded
    layout (one allreduce for all pairs) and the local values in the
    replicated layout (no communication).
    """

    def __init__(self, layout: str, comm: Communicator):
        self.layout = layout
        self.comm = comm

    def dots(self, pairs: Sequence[tuple[Any, Any]]) -> list[Any]:
        return self.totals(local_vdots(pairs))

    def totals(self, local: Sequence[Any]) -> list[Any]:
        """Σ over ranks of this rank's inner products `local` (computed
        elsewhere, e.g. by ``update_and_dots``), in one allreduce."""
        dtype = common_dtype(*[v.dtype for v in local])
        values = self.sum(jnp.stack([v.astype(dtype) for v in local]))
        return [values[i] for i in range(len(local))]

    def start_dots(self, pairs: Sequence[tuple[Any, Any]]) -> "PendingDots":
        """Start ``dots(pairs)`` without waiting; :meth:`finish` returns the values.

        Sharded layout: one non-blocking allreduce (``iallreduce``) of the local
        inner products, in flight until `finish`, so the work traced in between
        (a pipelined solver's matvec and preconditioner) overlaps it. Replicated
        layout: the local values, nothing to wait for.
        """
        return self.start_totals(local_vdots(pairs))

    def start_totals(self, local: Sequence[Any]) -> "PendingDots":
        """:meth:`totals` of this rank's values `local`, started as :meth:`start_dots` is."""
        dtype = common_dtype(*[v.dtype for v in local])
        stacked = jnp.stack([v.astype(dtype) for v in local])
        if self.layout == "sharded":
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
        m = allreduce(jnp.stack([jnp.asarray(e, dtype) for e in entries]), "max", comm=self.comm)
        n = 3 + len(also)
        code = (-m[2]).astype(jnp.int32)
        also_max = [m[3 + i] for i in range(len(also))]
        if probe is None:
            return Agreed(m[0], -m[1], code, also_max, None, None, None, compared=True)
        return Agreed(m[0], -m[1], code, also_max, m[n], -m[n + 1], m[n + 2], compared=True)

    def agree_step(self, value: Any, failure: Any, *, check: Any, scale: Any, squared: bool,
                   probe: Any = None) -> tuple[Any, Any]:
        """(value, failure) of an iteration, identical on every rank (`agree`).

        Where `check` (the first iteration), values that differ between ranks
        beyond rounding turn the failure into DIVERGED_INCONSISTENT_RANKS
        (`inconsistent`, relative to `scale` = ‖b‖; `squared`: `value` is a
        squared norm).
        """
        agreed = self.agree(value, failure, probe=probe)
        return agreed.value, mark_inconsistent(agreed.failure, inconsistent(agreed, check, scale, squared=squared))



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


class Run(NamedTuple):
    """One run of a method's iteration: what `_driver.krylov_solve` hands the method.

    The method body (``cg._standard``, ``minres._minres``, ...) reads the
    system, the agreed stopping settings and the solve's fixed options from
    here, in place of a dozen positional arguments. Nothing is
    differentiated through the iterations: ``lax.custom_linear_solve``
    differentiates the solve through `matvec` and b, and x0, the tolerances
    and the preconditioner are not differentiated.
    """

    matvec: Callable[[Any], Any]   # A v, as custom_linear_solve hands it (A, or its transpose)
    b: Any                         # the right-hand side, scaled to a largest entry of 1
    x0: Any                        # the start, scaled like b
    rtol: Any                      # agreed across ranks
    atol: Any                      # agreed across ranks, scaled like b
    maxiter: Any                   # agreed (a rerun from the true residual: what is left of it)
    start: Any                     # reason code to start from: ITERATING, or DIVERGED_INCONSISTENT_RANKS
    precond: Callable[[Any], Any]  # M v (``_arguments.identity`` without a preconditioner)
    red: Reductions                # the layout's inner products and agreements
    history: int                   # the length of info.history
    monitor: bool                  # print the residual norms on rank 0


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


def first_reason(*cases: tuple[Any, int], otherwise: Any = Reason.ITERATING) -> Any:
    """The reason of the first condition that holds, in the order given, else `otherwise` (int32).

    ``first_reason((~finite, DIVERGED_NANORINF), (curvature <= 0, DIVERGED_INDEFINITE_MAT))``
    reads as the list of checks it is; conditions may be traced (and batched).
    """
    code = jnp.asarray(otherwise, jnp.int32)
    for condition, reason in reversed(cases):
        code = jnp.where(condition, jnp.asarray(reason, jnp.int32), code)
    return code


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
    """The final reason code: a failure already recorded, else how the loop ended."""
    outcome = first_reason((converged & converged_atol, Reason.CONVERGED_ATOL),
                           (converged, Reason.CONVERGED_RTOL),
                           (k >= maxiter, Reason.DIVERGED_MAX_IT))
    return jnp.where(reason != Reason.ITERATING, reason, outcome).astype(jnp.int32)


__all__ = ["Reason", "SolverInfo", "Reductions"]
