"""A few eigenpairs of a Hermitian operator across ranks: Lanczos or LOBPCG, differentiable.

Two methods, on the operators the solvers take (either layout):

* ``"lanczos"`` (default): thick-restart Lanczos in Krylov–Schur form
  (``_lanczos``): one matvec and three allreduces per step (sharded layout).
* ``"lobpcg"``: LOBPCG with an optional preconditioner M (``_lobpcg``): one
  block matvec (k vectors, batched), one block preconditioner application and
  three allreduces per iteration (sharded layout).
* shift-invert (``sigma=σ``): Lanczos on (A − σI)⁻¹, each product an inner
  MINRES solve of (A − σI) y = v (preconditioned by M, e.g. multigrid), for
  the eigenvalues nearest σ. Lanczos converges on the eigenvalues that are
  largest in magnitude, 1/(λ − σ): those nearest σ, well separated there
  however clustered λ is near the end of the spectrum.

Derivatives (custom JVP, so reverse mode by transposition), the same for
both methods since they depend only on the eigenpairs:

* eigenvalues by Hellmann–Feynman: λ̇ᵢ = xᵢᴴ Ȧ xᵢ;
* eigenvectors: ẋᵢ = Σ_{j≠i, j computed} xⱼ (xⱼᴴ Ȧ xᵢ)/(λᵢ − λⱼ) + y, with
  y the solution in the complement of the computed eigenvectors of
  P (A − λᵢ) P y = −P Ȧ xᵢ (P the projector onto that complement), by
  MINRES: no dense algebra in the size of A. The gauge: xᵢᴴ ẋᵢ = 0.

Where a derivative does not exist the tangent is NaN (docs/eigensolvers.md):
eigenvector tangents of eigenvalues that coincide within the computed
accuracy (the sum divides by λᵢ − λⱼ = 0), eigenvector tangents whose
complement system MINRES cannot solve (another copy of λᵢ outside the
computed set), and every tangent of an eigensolve that did not converge. An
eager differentiation of an unconverged eigensolve raises a ValueError on
every rank instead.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._runtime.mpi import resolve_comm
from ..operators import LinearOperator, Partition, linearise
from . import _arguments
from ._common import Reason, Reductions
from ._eigen import (CONVERGED, MAX_ITERATIONS, WHICH, Found, Params, combine, grams, ordering, residuals, row,
                     start_vector, template as vector_template)
from ._lanczos import lanczos
from ._lobpcg import lobpcg
from .minres import minres

METHODS = ("lanczos", "lobpcg")


class EigshInfo(NamedTuple):
    """How an :func:`eigsh` ended, identical on every rank.

    Attributes:
      iterations: Lanczos steps (one matvec each), or LOBPCG iterations (one
        block matvec of k vectors each).
      restarts: Lanczos restart cycles begun (LOBPCG: 0).
      residual_norms: ‖A xᵢ − λᵢ xᵢ‖ of the returned pairs, shape (k,),
        computed from the returned vectors (k extra matvecs).
      converged: whether every wanted pair met the tolerance.
      reason: ``CONVERGED`` (1) or ``MAX_ITERATIONS`` (-3: the restart or
        iteration limit), in the style of the solvers'
        :class:`~distlinalg.solvers.Reason`.
      matvecs: applications of A to a vector, the final residual check
        included.

    Example:
      >>> import jax.numpy as jnp
      >>> from distlinalg.solvers import eigsh
      >>> w, V, info = eigsh(jnp.diag(jnp.arange(1.0, 41.0)), k=2, maxiter=1)
      >>> int(info.restarts) >= 1, info.residual_norms.shape, int(info.reason) in (1, -3)
      (True, (2,), True)
    """

    iterations: Any
    restarts: Any
    residual_norms: Any
    converged: Any
    reason: Any
    matvecs: Any



def eigsh(
    A: Any,
    k: int = 1,
    *,
    which: str | None = None,
    v0: Any = None,
    tol: float | None = None,
    maxiter: int | None = None,
    ncv: int | None = None,
    method: str = "lanczos",
    M: Any = None,
    sigma: float | None = None,
    layout: str | None = None,
    comm: Any = None,
) -> tuple[Any, Any, EigshInfo]:
    """The k eigenvalues of Hermitian `A` at one end of its spectrum, and their eigenvectors.

    Args:
      A: Hermitian operator: a distlinalg operator (its layout and
        communicator are used), a callable ``v -> A v``, a dense replicated
        matrix, or an object with ``__matmul__``; real or complex.
      k: how many eigenpairs (static), 1 ≤ k < n.
      which: ``"SA"`` (smallest algebraic, default), ``"LA"`` (largest),
        ``"SM"`` / ``"LM"`` (smallest / largest magnitude; Lanczos only).
        With ``sigma``: ``"LM"`` (the default there), as in scipy: the
        largest 1/(λ − σ) in magnitude, i.e. the eigenvalues nearest σ.
      v0: start vector in A's layout (default: a fixed pseudo-random vector;
        required for a callable A without an ``input_structure``, to give
        the shape). LOBPCG starts from v0 and k − 1 pseudo-random vectors.
      tol: relative accuracy: a pair is converged when ‖A x − θ x‖ ≤
        max(tol·abs(θ), 64 ε ‖A‖), ‖A‖ estimated by the largest Ritz value
        seen (default tol: the dtype's ε, as scipy's eigsh).
      maxiter: Lanczos: restart cycles (default max(100, 10·n/ncv));
        LOBPCG: iterations (default 1000). Static.
      ncv: Lanczos basis size (static; default min(n, max(2k + 1, 20))).
      method: ``"lanczos"`` (thick-restart Lanczos) or ``"lobpcg"``
        (LOBPCG, block size k, with the preconditioner M).
      M: LOBPCG's preconditioner, an approximation of A⁻¹ (Hermitian
        positive definite) in A's layout: an operator, a callable, a dense
        replicated matrix, as for :func:`~distlinalg.solvers.cg`; with
        ``sigma``, the preconditioner of the inner MINRES solves (Hermitian
        positive definite, approximating (A − σI)⁻¹ in magnitude, e.g.
        :func:`~distlinalg.solvers.multigrid` of A for σ near the bottom of
        the spectrum). Plain Lanczos takes none.
      sigma: shift-invert mode (a Python number, static): the k eigenvalues
        nearest σ, by Lanczos on (A − σI)⁻¹, each product an inner MINRES
        solve to rtol max(tol/100, 1000 ε). Returned nearest first; method
        must be "lanczos". σ must not be an eigenvalue.
      layout, comm: as for :func:`distlinalg.solvers.cg`.

    Returns:
      ``(w, V, info)``: ``w`` the eigenvalues, shape (k,), real, ascending for
      "SA"/"SM" and descending for "LA"/"LM" (by magnitude for the "M" kinds),
      identical on every rank (with ``sigma``: by distance from σ, nearest
      first); ``V`` the eigenvectors with a leading axis of k
      in A's layout (sharded: ``V[i]`` is this rank's rows of eigenvector i),
      orthonormal over all ranks; ``info`` an :class:`EigshInfo`.

    Cost per step (sharded layout): Lanczos one matvec and three allreduces;
    LOBPCG one block matvec and preconditioner application (k vectors,
    batched by ``jax.vmap``: A and M must support vmap, as distlinalg's
    operators do) and three allreduces.

    AD: forward and reverse mode with respect to anything A depends on (its
    arrays, what a matvec closes over); v0 and M get zero derivatives. See
    the module docstring; a derivative that does not exist (eigenvectors of
    coinciding eigenvalues, an unconverged eigensolve) is NaN, and eager
    differentiation of an unconverged eigensolve raises. Eigenvectors are
    defined up to a phase: differentiate phase-invariant functions of them.
    The derivative rule treats the k vectors as one batch (``jax.vmap`` of
    Ȧ and of the complement MINRES solves), so A must support vmap there.

    Example:
      >>> import jax.numpy as jnp
      >>> import numpy as np
      >>> from distlinalg.solvers import eigsh
      >>> A = jnp.asarray(np.diag(np.arange(1.0, 31.0)))     # replicated, eigenvalues 1..30
      >>> w, V, info = eigsh(A, k=3)
      >>> np.round(np.asarray(w), 4).tolist(), bool(info.converged), V.shape
      ([1.0, 2.0, 3.0], True, (3, 30))
      >>> w, V, info = eigsh(A, k=2, which="LA", method="lobpcg", M=jnp.diag(1 / jnp.diag(A)))
      >>> np.round(np.asarray(w), 4).tolist(), bool(info.converged)
      ([30.0, 29.0], True)
      >>> w, V, info = eigsh(A, k=3, sigma=10.2)               # the three nearest 10.2
      >>> np.round(np.asarray(w), 4).tolist(), bool(info.converged)
      ([10.0, 11.0, 9.0], True)
    """
    if which is None:
        which = "SA" if sigma is None else "LM"
    if layout is None:
        layout = A.layout if isinstance(A, LinearOperator) else "replicated"
    if comm is None and isinstance(A, LinearOperator):
        comm = A.comm
    comm = resolve_comm(comm)

    def build() -> tuple[Any, ...]:
        checked_layout = _arguments.check_layout(layout)
        if method not in METHODS:
            raise ValueError(f"distlinalg.eigsh: method must be one of {METHODS}, got {method!r}")
        if which not in WHICH:
            raise ValueError(f"distlinalg.eigsh: which must be one of {WHICH}, got {which!r}")
        if sigma is not None:
            if isinstance(sigma, bool) or not isinstance(sigma, (int, float, np.integer, np.floating)) \
                    or not np.isfinite(sigma):
                raise ValueError(f"distlinalg.eigsh: sigma must be a finite real number (static), got {sigma!r}")
            if method != "lanczos":
                raise ValueError("distlinalg.eigsh: shift-invert (sigma) runs Lanczos on (A − σI)⁻¹; "
                                 f"method must be 'lanczos', got {method!r}")
            if which != "LM":
                raise ValueError(f"distlinalg.eigsh: with sigma, which must be 'LM' (the eigenvalues nearest "
                                 f"sigma, as in scipy), got {which!r}")
        elif method == "lanczos" and M is not None:
            raise ValueError("distlinalg.eigsh: the Lanczos method takes no preconditioner M (use method='lobpcg', "
                             "or sigma= for shift-invert, whose inner solves M preconditions)")
        if method == "lobpcg" and which not in ("SA", "LA"):
            raise ValueError(f"distlinalg.eigsh: LOBPCG finds the algebraic ends of the spectrum, which='SA' or "
                             f"'LA', got {which!r} (use method='lanczos')")
        if method == "lobpcg" and ncv is not None:
            raise ValueError("distlinalg.eigsh: ncv is the Lanczos basis size; LOBPCG's basis is 3k vectors")
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"distlinalg.eigsh: k must be a positive int, got {k!r}")
        for name, value in (("ncv", ncv), ("maxiter", maxiter)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer))):
                raise ValueError(f"distlinalg.eigsh: {name} must be an int or None, got {value!r}")
        template = vector_template(A, v0)
        op = _arguments.solver_operator(A, checked_layout, comm, template, "A")
        precond = None if M is None else _arguments.solver_operator(M, checked_layout, comm, template, "M")
        return checked_layout, template, op, precond

    # This rank's arguments are checked first, and any rank's error raised on
    # every rank, before anything else communicates (`collectively`); then,
    # with the global size n (a trace-time exchange), the checks involving n,
    # raised on every rank the same way; then the parameters that steer the
    # iteration are agreed on.
    checked_layout, template, op, precond = _arguments.collectively(build, comm)
    local = _arguments.global_size(template)
    n = local if checked_layout == "replicated" or comm.size == 1 else Partition.of_local_sizes(local, comm).total

    def sized() -> tuple[int, int]:
        if k >= n:
            raise ValueError(f"distlinalg.eigsh: k must be smaller than the operator's size {n}, got k={k}")
        basis = min(n, max(2 * k + 1, 20)) if ncv is None else int(ncv)
        if not k < basis <= n:
            raise ValueError(f"distlinalg.eigsh: ncv must satisfy k < ncv <= n = {n}, got {ncv}")
        cycles = int(maxiter) if maxiter is not None else (max(100, 10 * n // basis) if method == "lanczos"
                                                           else 1000)
        if cycles < 1:
            raise ValueError(f"distlinalg.eigsh: maxiter must be a positive int, got {maxiter}")
        return basis, cycles

    basis, cycles = _arguments.collectively(sized, comm)
    dtype = jnp.result_type(*jax.tree_util.tree_leaves(template))
    if not jnp.issubdtype(dtype, jnp.inexact):
        dtype = jnp.result_type(float)
    eps = float(jnp.finfo(dtype).eps)
    relative = eps if tol is None or tol == 0 else float(tol)
    shift = None if sigma is None else float(sigma)
    _agree(f"k={k} which={which} method={method} sigma={shift!r} ncv={basis} maxiter={cycles} tol={relative!r} n={n} "
           f"layout={checked_layout} dtype={jnp.dtype(dtype).name}", comm)
    start = start_vector(template, v0, dtype, comm, checked_layout)
    # Linearised once, here (a model operator's model is evaluated once per eigensolve).
    matvec, consts = jax.closure_convert(linearise(op).matvec, start)
    preconditioner, precond_consts = ((None, []) if precond is None
                                      else jax.closure_convert(linearise(precond).matvec, start))
    params = Params(k, which, basis, cycles, relative, checked_layout, comm, method, len(consts), shift)
    return _eigsh(params, matvec, preconditioner, start, *consts, *precond_consts)


def _agree(signature: str, comm: Any) -> None:
    """The static parameters that steer the iteration (k, which, the method, ncv, maxiter, tol,
    n, ...) identical on every rank, or a ValueError on every rank: the loops' trip counts
    and the stopping test depend on them (one small allgather, at trace time)."""
    if comm.size == 1:
        return
    signatures = _arguments._exchange_messages(signature, comm)
    if any(other != signatures[0] for other in signatures):
        differing = "; ".join(f"rank {r}: {other}" for r, other in enumerate(signatures))
        raise ValueError(f"distlinalg.eigsh: the ranks were given different parameters ({differing}); "
                         "every rank must call eigsh with the same k, which, method, ncv, maxiter and tol")


# ---------------------------------------------------------------------------
# The iteration: the method's Ritz pairs, checked and ordered.
@partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2))
def _eigsh(params: Params, matvec: Callable[..., Any], preconditioner: Callable[..., Any] | None,
           start: Any, *consts: Any) -> tuple[Any, Any, EigshInfo]:
    a_consts, m_consts = consts[:params.operator_consts], consts[params.operator_consts:]
    mv = lambda v: matvec(v, *a_consts)  # noqa: E731
    precond = None if preconditioner is None else (lambda v: preconditioner(v, *m_consts))
    if params.method == "lobpcg":
        found = lobpcg(params, mv, precond, start)
    elif params.sigma is not None:
        found = lanczos(params, _shift_inverted(params, mv, precond), start)
    else:
        found = lanczos(params, mv, start)
    return _checked(params, mv, found)


def _shift_inverted(params: Params, mv: Callable[[Any], Any], precond: Callable[[Any], Any] | None
                    ) -> Callable[[Any], Any]:
    """v ↦ (A − σI)⁻¹ v by MINRES (preconditioned by M), to rtol max(tol/100, 1000 ε).

    Lanczos reads these products as an exact operator: the inner tolerance
    bounds the accuracy of what it finds, so it is two orders below the
    eigensolve's. The eigenvalues and residuals returned are A's own
    (``_checked``: Rayleigh quotients and ‖A x − λ x‖).
    """
    def apply(v: Any) -> Any:
        dtype = jnp.result_type(*jax.tree_util.tree_leaves(v))
        rtol = max(params.tol / 100, 1000 * float(jnp.finfo(dtype).eps))
        y, _ = minres(mv, v, shift=params.sigma, M=precond, rtol=rtol, maxiter=10_000, layout=params.layout,
                      comm=params.comm)
        return y
    return apply


def _checked(params: Params, mv: Callable[[Any], Any], found: Found) -> tuple[Any, Any, EigshInfo]:
    """(w, X, info): the Rayleigh quotients and true residual norms of the found vectors
    (k matvecs), in the order `which` asks for."""
    red = Reductions(params.layout, params.comm)
    real = found.theta.dtype
    quotients, residual_norms = residuals(red, mv, found.X, params.k)
    w, residual_norms = quotients.astype(real), residual_norms.astype(real)
    order = (ordering(w, params.which) if params.sigma is None
             else jnp.argsort(jnp.abs(w - params.sigma), stable=True))  # nearest σ first
    X = jax.tree_util.tree_map(lambda Xl: Xl[order], found.X)
    converged = found.converged >= params.k
    info = EigshInfo(found.iterations, found.restarts, residual_norms[order], converged,
                     jnp.where(converged, CONVERGED, MAX_ITERATIONS).astype(jnp.int32),
                     (found.matvecs + params.k).astype(jnp.int32))
    return w[order], X, info


# ---------------------------------------------------------------------------
# Derivatives
@_eigsh.defjvp
def _eigsh_jvp(params: Params, matvec: Callable[..., Any], preconditioner: Callable[..., Any] | None,
               primals: tuple, tangents: tuple) -> tuple:
    start, *consts = primals
    _, *consts_dot = tangents
    w, X, info = _eigsh(params, matvec, preconditioner, start, *consts)
    _refuse_eagerly_if_unconverged(info)
    # Only A's constants move A; M's (a preconditioner) change how, not what, is found.
    a_consts = consts[:params.operator_consts]
    a_consts_dot = consts_dot[:params.operator_consts]
    red = Reductions(params.layout, params.comm)
    mv = lambda v: matvec(v, *a_consts)  # noqa: E731
    k = params.k

    def a_dot(x: Any) -> Any:
        """Ȧ x: the tangent of A's matvec along the tangents of what A depends on."""
        return jax.jvp(lambda *c: matvec(x, *c), tuple(a_consts),
                       tuple(jax.tree_util.tree_map(_instantiate, a_consts_dot, a_consts)))[1]

    # The k vectors at once (vmap): one program for all of them, one message per collective.
    AdX = jax.vmap(a_dot)(X)                                                        # Ȧ xᵢ, a block
    coupling = grams(red, [(X, AdX)])[0].T                                          # [i, j] = xⱼᴴ Ȧ xᵢ
    # No derivative of an unconverged eigensolve: NaN (identical on every rank). A factor,
    # not a term: a tangent must stay linear for the transposition to carry it.
    defined = jnp.where(info.converged, 1, jnp.nan).astype(w.dtype)
    w_dot = jnp.real(jnp.diagonal(coupling)).astype(w.dtype) * defined                  # Hellmann–Feynman

    def project_out(V: Any) -> Any:
        """(I − X Xᴴ) V for a block V: the complement of the computed eigenvectors (one allreduce)."""
        return jax.tree_util.tree_map(jnp.subtract, V, combine(grams(red, [(X, V)])[0], X))

    # Within span(X): Σ_{j≠i} xⱼ (xⱼᴴ Ȧ xᵢ)/(λᵢ − λⱼ). Eigenvalues closer than the computed
    # accuracy are one eigenvalue as far as the eigenvectors' derivative is concerned: it
    # does not exist there (NaN).
    accuracy = info.residual_norms[:, None] + info.residual_norms[None, :] \
        + 64 * jnp.finfo(w.dtype).eps * jnp.max(jnp.abs(w))
    gaps = w[:, None] - w[None, :]
    inverse_gaps = jnp.where(jnp.abs(gaps) > accuracy, 1 / jnp.where(gaps == 0, 1, gaps), jnp.nan)
    inverse_gaps = jnp.where(jnp.eye(k, dtype=bool), 0, inverse_gaps)
    inside = combine((coupling * inverse_gaps.astype(coupling.dtype)).T, X)         # row i: Σ_j c_ij xⱼ
    # In the complement: P (A − λᵢ) P yᵢ = −P Ȧ xᵢ, by MINRES, the k systems batched.
    rhs = jax.tree_util.tree_map(jnp.negative, project_out(AdX))
    single = lambda V: jax.tree_util.tree_map(lambda leaf: leaf[None], V)  # noqa: E731
    Y = jax.vmap(lambda b, shift: _complement_solve(params, mv, lambda v: row(project_out(single(v)), 0),
                                                    shift, b))(rhs, w)
    X_dot = jax.tree_util.tree_map(lambda a, b: (a + b) * defined.astype(a.dtype), inside, Y)
    info_dot = jax.tree_util.tree_map(_zero_tangent, info)
    return (w, X, info), (w_dot, X_dot, info_dot)


def _refuse_eagerly_if_unconverged(info: EigshInfo) -> None:
    """Eager differentiation (concrete values, identical on every rank): an unconverged
    eigensolve has no eigenpair derivative, so say so on every rank. Under a trace the
    tangents are NaN instead."""
    if isinstance(info.converged, jax.core.Tracer) or bool(info.converged):
        return
    raise ValueError(
        "distlinalg.eigsh: cannot differentiate an eigensolve that did not converge (residual norms "
        f"{np.asarray(info.residual_norms).tolist()} after {int(info.iterations)} iterations): its vectors are "
        "not eigenvectors, so the eigenpair derivatives do not apply. Raise maxiter (or tol).")


def _complement_solve(params: Params, mv: Callable[[Any], Any], project_out: Callable[[Any], Any],
                      shift: Any, rhs: Any) -> Any:
    """y in the complement of the computed eigenvectors with P (A − shift) P y = rhs.

    A linear function of `rhs` for JAX (custom_linear_solve): the MINRES
    inside uses rhs nonlinearly too (its norm, the replicated layout's
    agreement on it), which a transposition could not see through.
    Hermitian, so the transposed solve is the (conjugated) same solve.
    """
    rtol = max(params.tol, 1000 * float(jnp.finfo(jnp.result_type(shift)).eps))

    def operator(v: Any) -> Any:
        shifted = jax.tree_util.tree_map(lambda a, b: a - shift.astype(a.dtype) * b, mv(project_out(v)), project_out(v))
        return project_out(shifted)

    def solve(_matvec: Any, b: Any) -> Any:
        y, solved = minres(lambda v: project_out(mv(project_out(v))), b, shift=shift, rtol=rtol,
                           layout=params.layout, comm=params.comm)
        # A singular, inconsistent system (another copy of λᵢ outside the computed
        # pairs, coupled by Ȧ) has no solution: the derivative does not exist (NaN).
        # Lost accuracy at the end is still a solution, to the precision there is.
        failed = (solved.reason < 0) & (solved.reason != Reason.DIVERGED_ACCURACY_LOST)
        return jax.tree_util.tree_map(lambda leaf: jnp.where(failed, jnp.nan, leaf), project_out(y))

    def transpose_solve(_vecmat: Any, ct: Any) -> Any:
        conj = lambda t: jax.tree_util.tree_map(jnp.conj, t)  # noqa: E731
        return conj(solve(None, conj(ct)))

    return jax.lax.custom_linear_solve(operator, rhs, solve, transpose_solve=transpose_solve)


def _instantiate(tangent: Any, primal: Any) -> Any:
    if type(tangent) is jax.custom_derivatives.SymbolicZero or tangent is None:
        return jnp.zeros_like(primal)
    return tangent


def _zero_tangent(value: Any) -> Any:
    value = jnp.asarray(value)
    if jnp.issubdtype(value.dtype, jnp.inexact):
        return jnp.zeros_like(value)
    return np.zeros(value.shape, jax.dtypes.float0)


__all__ = ["eigsh", "EigshInfo"]
