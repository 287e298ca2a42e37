"""Restarted GMRES across ranks (Saad & Schultz 1986), left-preconditioned.

For a general nonsingular A and preconditioner M ≈ A⁻¹, each cycle builds
an orthonormal basis v₀ … v_j of the Krylov space of M A from the
preconditioned residual and takes the x that minimises ‖M(b − A x)‖ in it:

    r = b − A x,  z = M r,  β = ‖z‖,  v₀ = z/β,  s = β e₀
    for k = 0, 1, ..., restart − 1            (Arnoldi, classical Gram–Schmidt twice)
        w = M A v_k
        h = Vᴴ w,       w ← w − V h,   ‖w‖²     (reduction 1)
        h' = Vᴴ w,      w ← w − V h',  ‖w‖²     (reduction 2: reorthogonalisation)
        H[:, k] = h + h',  H[k+1, k] = ‖w‖,  v_{k+1} = w/‖w‖
        rotate H[:, k] by the previous Givens rotations, eliminate H[k+1, k]
        with a new one, rotate s: |s_{k+1}| = ‖M(b − A x_k)‖
        incremental: stop the cycle when |s_{k+1}| ≤ ptol; both: on breakdown
    x ← x + V y,  R y = s  (back substitution on the rotated H)
    r = b − A x,  z = M r,  ‖r‖², ‖z‖²           (reduction 3, once per cycle)
    stop when ‖r‖ ≤ max(rtol ‖b‖, atol)

The inner tolerance ptol on the preconditioned residual follows scipy's
(gh-8400): it starts at ‖M b‖ min(1, tol/‖b‖) and adapts after each cycle,
so that with the same arguments x matches scipy.sparse.linalg.gmres.

Communication, sharded layout: two allreduces per Arnoldi step (the inner
products with the whole basis and the squared norm travel together; the
norm after the second pass is ‖w'‖² − ‖h'‖², exact for an orthonormal
basis) and one per restart cycle. Replicated layout: the inner products are
local; one small allreduce per step makes the stopping quantities
identical on every rank.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from . import _arguments
from . import _common as C
from ._vectors import as_coefficient, local_vdot, scalar_dtype, scale, sub
from ._common import Reason, SolverInfo
from ._driver import krylov_solve
from ._eager import compiled_when_eager

METHODS = ("batched", "incremental")


@compiled_when_eager
def gmres(
    A: Any,
    b: Any,
    x0: Any = None,
    *,
    tol: float | None = None,
    rtol: float = 1e-5,
    atol: float = 0.0,
    restart: int = 20,
    maxiter: int | None = None,
    M: Any = None,
    solve_method: str = "batched",
    layout: str | None = None,
    comm: Any = None,
    history: int = 0,
    monitor: bool = False,
    verify_residual: bool = True,
) -> tuple[Any, SolverInfo]:
    """Solve A x = b for a general (nonsymmetric) A by restarted GMRES.

    A superset of ``jax.scipy.sparse.linalg.gmres`` (same positional
    arguments and keywords; ``tol`` is an alias of ``rtol``) that runs across
    MPI ranks and reports convergence.

    Args:
      A: a callable ``v -> A v``, a square array (replicated layout), an
        object with ``__matmul__``, or a distlinalg operator (see
        :func:`distlinalg.cg` for the layouts).
      b: right-hand side, a pytree of arrays (replicated: the whole vector,
        identical on every rank; sharded: this rank's block).
      x0: initial guess shaped like `b` (default zeros); not differentiated.
      rtol, atol: stop when ‖b − A x‖₂ ≤ max(rtol ‖b‖₂, atol) (the true,
        unpreconditioned residual, checked after every cycle).
      restart: dimension of the Krylov space built per cycle (≥ 1; in the
        replicated layout capped at the size of b).
      maxiter: the number of restart cycles, as in scipy and jax.scipy
        (default: 10 × the global size, agreed across ranks as for cg).
      M: left preconditioner ≈ A⁻¹ (any of A's forms); the reverse-mode
        (transposed) solve uses the same M.
      solve_method: ``"batched"`` builds the whole ``restart``-dimensional
        space each cycle (no inner stopping test: fewer decisions, the
        cheaper choice when steps are cheap); ``"incremental"`` stops a cycle
        as soon as the rotated residual estimate meets the inner tolerance.
        Both solve the small least-squares problem with Givens rotations.
      layout, comm, history, monitor, verify_residual: as for :func:`distlinalg.cg`;
        ``info.history[k]`` and the monitor show the left-preconditioned
        residual estimate ‖M(b − A x_k)‖ after k Arnoldi steps.

    Returns:
      ``(x, info)``: x shaped like b; ``info.iterations`` counts Arnoldi
      steps over all cycles, ``info.residual_norm`` is the true ‖b − A x‖ of
      the last cycle. Reasons: CONVERGED_RTOL/ATOL, DIVERGED_MAX_IT (maxiter
      cycles), DIVERGED_BREAKDOWN (the Krylov space is exhausted but the
      residual is above the tolerance: A or M singular), DIVERGED_NANORINF,
      DIVERGED_INCONSISTENT_RANKS (as for cg).

    AD: ``lax.custom_linear_solve`` with a transposed GMRES solve on Aᵀ (the
    transpose of the matvec; in the replicated layout averaged over ranks,
    so that it is the matrix transpose even when the matvec communicates).
    vmap over b runs the lanes in one loop.

    Example:
      >>> import jax.numpy as jnp
      >>> import distlinalg as dl
      >>> A = jnp.array([[3.0, 1.0, 0.0], [-1.0, 3.0, 1.0], [0.0, -1.0, 3.0]])  # nonsymmetric
      >>> b = jnp.array([1.0, 2.0, 3.0])
      >>> x, info = dl.gmres(lambda v: A @ v, b, rtol=1e-6, restart=2)
      >>> bool(info.converged), bool(jnp.allclose(A @ x, b, atol=1e-5))
      (True, True)
    """
    if solve_method not in METHODS:
        raise ValueError(f"invalid solve_method {solve_method}, must be either 'incremental' or 'batched'")
    if isinstance(restart, bool) or not isinstance(restart, int) or restart < 1:
        raise ValueError(f"distlinalg.gmres: restart must be an int >= 1, got {restart!r}")
    if _arguments.is_real_linear(A):
        return _arguments.solve_real_linear(
            gmres, A, b, x0, M, tol=tol, rtol=rtol, atol=atol, restart=restart, maxiter=maxiter,
            solve_method=solve_method, layout=layout, comm=comm, history=history, monitor=monitor,
            verify_residual=verify_residual,
        )
    p = _arguments.setup(A, b, x0, M, tol, rtol, atol, maxiter, layout, comm)
    if p.reductions.layout == "replicated":
        restart = max(1, min(restart, _arguments.global_size(p.b)))
    incremental = solve_method == "incremental"

    def iterate(run: C.Run):
        return _gmres(run, restart, incremental)

    # maxiter counts restart cycles; info.iterations, Arnoldi steps.
    return krylov_solve(iterate, p.matvec, p.b, p, history=history, monitor=monitor, hermitian=False,
                        verify_residual=verify_residual, cycles_of=lambda k: (k + restart - 1) // restart)


# ---------------------------------------------------------------------------
# The Krylov basis: a pytree whose leaves carry a leading axis of restart + 1.
def _new_basis(like: Any, size: int) -> Any:
    return jax.tree_util.tree_map(lambda leaf: jnp.zeros((size, *jnp.shape(leaf)), leaf.dtype), like)


def _basis_vector(V: Any, k: Any) -> Any:
    return jax.tree_util.tree_map(lambda leaf: leaf[k], V)


def _set_basis_vector(V: Any, k: Any, v: Any) -> Any:
    return jax.tree_util.tree_map(lambda leaf, x: leaf.at[k].set(x.astype(leaf.dtype)), V, v)


def _local_projections(V: Any, w: Any, dtype: Any) -> Any:
    """This rank's part of Vᴴ w (one entry per basis vector; unused vectors are 0)."""
    parts = [
        jnp.matmul(jnp.conj(leaf).reshape(leaf.shape[0], -1), jnp.ravel(x), precision=jax.lax.Precision.HIGHEST)
        for leaf, x in zip(jax.tree_util.tree_leaves(V), jax.tree_util.tree_leaves(w))
    ]
    parts = [p.astype(dtype) for p in parts]
    return sum(parts[1:], parts[0])


def _combination(V: Any, y: Any) -> Any:
    """Σ_j y_j v_j (y may be shorter than the basis: the first len(y) vectors)."""
    def leaf_combination(leaf: Any) -> Any:
        coefficients = as_coefficient(y, leaf)
        return jnp.tensordot(coefficients, leaf[: y.shape[0]], axes=(0, 0), precision=jax.lax.Precision.HIGHEST)

    return jax.tree_util.tree_map(leaf_combination, V)


def _project_out(red: C.Reductions, V: Any, w: Any, dtype: Any) -> tuple[Any, Any, Any]:
    """(w − V h, h, ‖w‖²) with h = Vᴴ w: one reduction for h and the norm."""
    local = jnp.concatenate([_local_projections(V, w, dtype),
                             jnp.real(local_vdot(w, w)).astype(dtype)[None]])
    total = red.sum(local)
    h, norm_sq = total[:-1], jnp.real(total[-1])
    return sub(w, _combination(V, h)), h, norm_sq


# ---------------------------------------------------------------------------
# Givens rotations of the Hessenberg columns.
def _givens(f: Any, g: Any) -> tuple[Any, Any, Any]:
    """(c, s, r) with c real, [c  s; −s̄  c] [f; g] = [r; 0] (LAPACK's lartg convention)."""
    real = jnp.real(jnp.zeros((), f.dtype)).dtype
    abs_f, abs_g = jnp.abs(f), jnp.abs(g)
    norm = jnp.hypot(abs_f, abs_g)
    safe_norm = jnp.where(norm > 0, norm, jnp.ones_like(norm))
    safe_abs_f = jnp.where(abs_f > 0, abs_f, jnp.ones_like(abs_f))
    phase = jnp.where(abs_f > 0, f / safe_abs_f.astype(f.dtype), jnp.ones_like(f))
    c = jnp.where(abs_f > 0, abs_f / safe_norm, jnp.zeros((), real))
    s = jnp.where(abs_f > 0, phase * jnp.conj(g) / safe_norm.astype(f.dtype),
                  jnp.conj(g) / jnp.where(abs_g > 0, abs_g, jnp.ones_like(abs_g)).astype(f.dtype))
    r = jnp.where(abs_f > 0, phase * norm.astype(f.dtype), abs_g.astype(f.dtype))
    # g = 0: nothing to eliminate (also covers f = g = 0).
    none = abs_g == 0
    c = jnp.where(none, jnp.ones((), real), c)
    s = jnp.where(none, jnp.zeros_like(s), s)
    r = jnp.where(none, f, r)
    return c.astype(f.dtype), s, r


def _apply_rotation(vector: Any, i: Any, c: Any, s: Any) -> Any:
    """Rotate entries (i, i+1) of `vector`."""
    a, b = vector[i], vector[i + 1]
    return vector.at[i].set(c * a + s * b).at[i + 1].set(-jnp.conj(s) * a + c * b)


def _triangularise_column(H: Any, rotations: Any, S: Any, k: Any) -> tuple[Any, Any, Any]:
    """Apply rotations 0..k−1 to column k of H (stored as row H[k]), eliminate
    H[k, k+1] with rotation k, rotate the right-hand side S. Fixed trip count
    (masked beyond k), so that it vmaps without a batched loop bound."""
    column = H[k]

    def previous(i: Any, col: Any) -> Any:
        rotated = _apply_rotation(col, i, rotations[i, 0], rotations[i, 1])
        return jnp.where(i < k, rotated, col)

    column = jax.lax.fori_loop(0, H.shape[0], previous, column)
    c, s, r = _givens(column[k], column[k + 1])
    column = column.at[k].set(r).at[k + 1].set(jnp.zeros_like(r))
    rotations = rotations.at[k].set(jnp.stack([c, s]))
    S = _apply_rotation(S, k, c, s)
    return H.at[k].set(column), rotations, S


def _back_substitute(H: Any, S: Any, steps: Any) -> Any:
    """y solving R y = S for the first `steps` entries (R upper triangular, R[i, j] = H[j, i]);
    a zero pivot gives y_i = 0 (a pseudo-solve of the singular case, as scipy's)."""
    m = H.shape[0]

    def row(t: Any, y: Any) -> Any:
        i = m - 1 - t
        rest = jnp.sum(H[:, i] * y) - H[i, i] * y[i]
        pivot = H[i, i]
        value = jnp.where(pivot != 0, (S[i] - rest) / jnp.where(pivot != 0, pivot, jnp.ones_like(pivot)),
                          jnp.zeros_like(pivot))
        return y.at[i].set(jnp.where(i < steps, value, jnp.zeros_like(value)))

    return jax.lax.fori_loop(0, m, row, jnp.zeros((m,), H.dtype))


class GmresState(NamedTuple):
    """Restarted GMRES between cycles."""

    x: Any
    r: Any        # b − A x
    z: Any        # M r
    zz: Any       # ⟨z, z⟩
    rr: Any       # ⟨r, r⟩, agreed across ranks
    ptol: Any     # the inner (Arnoldi) tolerance of the next cycle (scipy's control)
    factor: Any
    k: Any        # Arnoldi steps so far (info.iterations)
    cycles: Any   # restarts so far (bounded by maxiter, as in scipy)
    reason: Any
    history: Any


class ArnoldiState(NamedTuple):
    """One cycle's Arnoldi process after j steps."""

    V: Any          # the basis, leaves with a leading axis of restart + 1
    H: Any          # Hessenberg columns as rows, triangularised as they come
    rotations: Any  # (c, s) of the Givens rotations so far
    S: Any          # the rotated right-hand side β e₁
    j: Any
    presid: Any     # |S[j]|: the preconditioned residual estimate, agreed across ranks
    breakdown: Any  # an invariant subspace was found
    k: Any
    reason: Any
    history: Any


# ---------------------------------------------------------------------------
def _gmres(run: C.Run, restart: int, incremental: bool):
    matvec, precond, red, b, maxiter, monitor = run.matvec, run.precond, run.red, run.b, run.maxiter, run.monitor
    dtype = scalar_dtype(b)
    real = jnp.real(jnp.zeros((), dtype)).dtype
    eps = jnp.finfo(real).eps
    m = restart

    def residual(x):
        r = sub(b, matvec(x))
        return r, precond(r)

    r, z = residual(run.x0)
    mb = precond(b)
    bb, mbmb, rr, zz = (jnp.real(v) for v in red.dots([(b, b), (mb, mb), (r, r), (z, z)]))
    nonfinite = ~(jnp.isfinite(rr) & jnp.isfinite(zz) & jnp.isfinite(mbmb))
    failure = C.first_reason((run.start != Reason.ITERATING, run.start), (nonfinite, Reason.DIVERGED_NANORINF))
    agreed = red.agree(rr, failure, also=[bb, mbmb])
    rr = agreed.value
    b_norm, mb_norm = jnp.sqrt(agreed.also[0]), jnp.sqrt(agreed.also[1])
    failure = C.mark_inconsistent(agreed.failure, C.inconsistent(agreed, True, b_norm, squared=True))
    threshold, from_atol = C.stopping_threshold(b_norm, run.rtol, run.atol)
    # scipy's first inner tolerance: ‖M b‖ min(1, tol / ‖b‖) (0 for b = 0).
    ptol = jnp.where(b_norm > 0, mb_norm * jnp.minimum(1.0, threshold / jnp.where(b_norm > 0, b_norm, 1.0)), 0.0)
    hist = C.record(C.new_history(run.history, real), 0, jnp.sqrt(zz))
    C.monitor_print("gmres", red.comm, monitor, 0, jnp.sqrt(zz))

    state = GmresState(x=run.x0, r=r, z=z, zz=zz, rr=rr, ptol=ptol.astype(real), factor=jnp.ones((), real),
                       k=jnp.int32(0), cycles=jnp.int32(0), reason=failure, history=hist)

    def keep_going(s: GmresState):
        return (s.reason == Reason.ITERATING) & (s.cycles < maxiter) & ~(jnp.sqrt(s.rr) <= threshold)

    def cycle(s: GmresState) -> GmresState:
        beta = jnp.sqrt(s.zz)
        safe_beta = jnp.where(beta > 0, beta, jnp.ones_like(beta))
        V = _set_basis_vector(_new_basis(b, m + 1), 0, scale(1 / safe_beta, s.z))
        inner = ArnoldiState(V=V, H=jnp.zeros((m, m + 1), dtype), rotations=jnp.zeros((m, 2), dtype),
                             S=jnp.zeros((m + 1,), dtype).at[0].set(beta.astype(dtype)), j=jnp.int32(0),
                             presid=beta, breakdown=jnp.bool_(False), k=s.k, reason=s.reason, history=s.history)

        def arnoldi_going(t: ArnoldiState):
            going = (t.j < m) & ~t.breakdown & (t.reason == Reason.ITERATING)
            if incremental:
                going = going & ~(t.presid <= s.ptol)
            return going

        def arnoldi_step(t: ArnoldiState) -> ArnoldiState:
            j = t.j
            w = precond(matvec(_basis_vector(t.V, j)))
            w, h, ww = _project_out(red, t.V, w, dtype)
            w, h_again, ww_again = _project_out(red, t.V, w, dtype)
            h = h + h_again
            h_norm0 = jnp.sqrt(jnp.maximum(ww, 0))
            h_next = jnp.sqrt(jnp.maximum(ww_again - jnp.sum(jnp.abs(h_again) ** 2), 0))
            breakdown = h_next <= eps * h_norm0  # M A v_j lies in the basis: an invariant subspace
            h_next = jnp.where(breakdown, jnp.zeros_like(h_next), h_next)
            safe_next = jnp.where(breakdown, jnp.ones_like(h_next), h_next)
            v_next = scale(jnp.where(breakdown, 0.0, 1.0).astype(real) / safe_next, w)
            V = _set_basis_vector(t.V, j + 1, v_next)
            H = t.H.at[j].set(h.at[j + 1].set(h_next.astype(dtype)))
            H, rotations, S = _triangularise_column(H, t.rotations, t.S, j)
            presid = jnp.abs(S[j + 1]).astype(real)
            failure = jnp.where(jnp.isfinite(h_norm0) & jnp.isfinite(presid), Reason.ITERATING,
                                Reason.DIVERGED_NANORINF).astype(jnp.int32)
            # Replicated layout: the decisions (stop the cycle, breakdown, failure)
            # made identical on every rank; in the very first step also compare
            # the residual estimate and ‖M A v₀‖ across ranks.
            first = t.k == 0
            agreed = red.agree(presid, failure, also=[breakdown.astype(real)], probe=(h_norm0, h_norm0))
            presid = agreed.value
            failure = C.mark_inconsistent(agreed.failure, C.inconsistent(agreed, first, b_norm, squared=False))
            k = t.k + 1
            hist = C.record(t.history, k, presid)
            C.monitor_print("gmres", red.comm, monitor, k, presid)
            return ArnoldiState(V=V, H=H, rotations=rotations, S=S, j=j + 1, presid=presid,
                                breakdown=agreed.also[0] > 0, k=k, reason=failure, history=hist)

        t = jax.lax.while_loop(arnoldi_going, arnoldi_step, inner)
        y = _back_substitute(t.H, t.S, t.j)
        # A failed step must not move x: a zero update, no select over whole vectors.
        y = jnp.where(t.reason == Reason.ITERATING, y, jnp.zeros_like(y))
        x = jax.tree_util.tree_map(jnp.add, s.x, _combination(t.V, y))
        r, z = residual(x)
        rr, zz = (jnp.real(v) for v in red.dots([(r, r), (z, z)]))
        failure = jnp.where(jnp.isfinite(rr) & jnp.isfinite(zz), t.reason, Reason.DIVERGED_NANORINF)
        agreed = red.agree(rr, failure.astype(jnp.int32))
        rr, failure = agreed.value, agreed.failure
        r_norm = jnp.sqrt(rr)
        converged = r_norm <= threshold
        # The space was exhausted, yet the true residual is too large: A or M is singular.
        failure = jnp.where(t.breakdown & ~converged & (failure == Reason.ITERATING),
                            Reason.DIVERGED_BREAKDOWN, failure).astype(jnp.int32)
        # scipy's inner tolerance control: tighter after a cycle that met it, looser otherwise.
        factor = jnp.where(t.presid <= s.ptol, jnp.maximum(eps, 0.25 * s.factor),
                           jnp.minimum(1.0, 1.5 * s.factor)).astype(real)
        ptol = (t.presid * jnp.minimum(factor, threshold / jnp.where(r_norm > 0, r_norm, 1.0))).astype(real)
        return GmresState(x=x, r=r, z=z, zz=zz, rr=rr, ptol=ptol, factor=factor, k=t.k, cycles=s.cycles + 1,
                          reason=failure, history=t.history)

    s = jax.lax.while_loop(keep_going, cycle, state)
    r_norm = jnp.sqrt(s.rr)
    converged = (s.reason == Reason.ITERATING) & (r_norm <= threshold)
    reason = C.finish_reason(from_atol, converged, s.cycles, maxiter, s.reason)
    return s.x, SolverInfo(s.k, r_norm, converged, reason, s.history)
