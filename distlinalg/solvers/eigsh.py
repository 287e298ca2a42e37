"""A few eigenpairs of a Hermitian operator across ranks: thick-restart Lanczos, differentiable.

``eigsh`` runs Lanczos with full reorthogonalisation and thick restarts
(Wu & Simon; in the Krylov–Schur form of Stewart): a basis V of ncv + 1
vectors in the operator's layout, the projected matrix H = Vᴴ A V (small,
identical on every rank), and at each restart the wanted Ritz vectors kept
as the start of the next basis. Per Lanczos step: one matvec and three
allreduces (sharded layout): the projections Vᴴ w, their second pass
(classical Gram–Schmidt twice) and ‖w‖. The replicated layout computes the
same quantities locally and agrees on the stop once per restart cycle.

A single start vector has one component in each eigenspace, so it finds one
copy of a multiple eigenvalue. After convergence, probes from fresh start
vectors search A deflated by the found vectors for a more wanted eigenvalue
(another copy) and swap it in, until none is found (at most k probes, each a
Lanczos run for one pair).

Derivatives (custom JVP, so reverse mode by transposition):

* eigenvalues by Hellmann–Feynman: λ̇ᵢ = xᵢᴴ Ȧ xᵢ;
* eigenvectors: ẋᵢ = Σ_{j≠i, j computed} xⱼ (xⱼᴴ Ȧ xᵢ)/(λᵢ − λⱼ) + y, with
  y the solution in the complement of the computed eigenvectors of
  P (A − λᵢ) P y = −P Ȧ xᵢ (P the projector onto that complement), by
  MINRES: no dense algebra in the size of A. The gauge: xᵢᴴ ẋᵢ = 0.

Degenerate eigenvalues among the computed ones have eigenvectors that are
not differentiable (the derivative divides by λᵢ − λⱼ = 0): their
eigenvector tangents are not finite; eigenvalue tangents are finite only
where the eigenvalue is simple (docs/eigensolvers.md).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._mpi import Communicator, resolve_comm
from ..comm.allreduce import allreduce
from ..operators._base import LinearOperator
from . import _arguments
from ._common import Reductions
from .minres import minres

WHICH = ("SA", "LA", "SM", "LM")


class EigshInfo(NamedTuple):
    """How an :func:`eigsh` ended, identical on every rank.

    Attributes:
      iterations: Lanczos steps taken (matvecs of the iteration; the final
        residual check adds k).
      restarts: restart cycles begun.
      residual_norms: ‖A xᵢ − λᵢ xᵢ‖ of the returned pairs, shape (k,),
        computed from the returned vectors (k extra matvecs).
      converged: whether every wanted pair met the tolerance.
      reason: ``CONVERGED`` (1) or ``MAX_RESTARTS`` (-3), in the style of the
        solvers' :class:`~distlinalg.solvers.Reason`.

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


CONVERGED, MAX_RESTARTS = 1, -3


def eigsh(
    A: Any,
    k: int = 1,
    *,
    which: str = "SA",
    v0: Any = None,
    tol: float | None = None,
    maxiter: int | None = None,
    ncv: int | None = None,
    method: str = "lanczos",
    M: Any = None,
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
        ``"SM"`` / ``"LM"`` (smallest / largest magnitude).
      v0: start vector in A's layout (default: a fixed pseudo-random vector;
        required for a callable A without an ``input_structure``, to give
        the shape).
      tol: relative accuracy: a pair is converged when ‖A x − θ x‖ ≤
        max(tol·abs(θ), 64 ε ‖A‖), ‖A‖ estimated by the largest Ritz value
        (default tol: the dtype's ε, as scipy's eigsh).
      maxiter: restart cycles (static; default max(100, 10·n/ncv)).
      ncv: basis size (static; default min(n, max(2k + 1, 20))).
      method: ``"lanczos"``, the one method so far (LOBPCG with a
        preconditioner is planned: issue 45).
      M: not supported by the Lanczos method (a preconditioner is LOBPCG's).
      layout, comm: as for :func:`distlinalg.solvers.cg`.

    Returns:
      ``(w, V, info)``: ``w`` the eigenvalues, shape (k,), real, ascending for
      "SA"/"SM" and descending for "LA"/"LM" (by magnitude for the "M" kinds),
      identical on every rank; ``V`` the eigenvectors with a leading axis of k
      in A's layout (sharded: ``V[i]`` is this rank's rows of eigenvector i),
      orthonormal over all ranks; ``info`` an :class:`EigshInfo`.

    AD: forward and reverse mode with respect to anything A depends on (its
    arrays, what a matvec closes over) and v0 (zero derivative): module
    docstring. Eigenvector derivatives need the computed eigenvalues to be
    distinct; eigenvectors are defined up to a phase, so use
    phase-invariant functions of them.

    Example:
      >>> import jax.numpy as jnp
      >>> import numpy as np
      >>> from distlinalg.solvers import eigsh
      >>> A = jnp.asarray(np.diag(np.arange(1.0, 31.0)))     # replicated, eigenvalues 1..30
      >>> w, V, info = eigsh(A, k=3)
      >>> np.round(np.asarray(w), 4).tolist(), bool(info.converged), V.shape
      ([1.0, 2.0, 3.0], True, (3, 30))
    """
    if method != "lanczos":
        raise ValueError(f"distlinalg.eigsh: method must be 'lanczos', got {method!r}")
    if M is not None:
        raise ValueError("distlinalg.eigsh: the Lanczos method takes no preconditioner M")
    if layout is None:
        layout = A.layout if isinstance(A, LinearOperator) else "replicated"
    if comm is None and isinstance(A, LinearOperator):
        comm = A.comm
    comm = resolve_comm(comm)

    def build() -> tuple[Any, ...]:
        checked_layout = _arguments.check_layout(layout)
        if which not in WHICH:
            raise ValueError(f"distlinalg.eigsh: which must be one of {WHICH}, got {which!r}")
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"distlinalg.eigsh: k must be a positive int, got {k!r}")
        template = _template(A, v0)
        local = _arguments.global_size(template)
        n = local if checked_layout == "replicated" or comm.size == 1 else int(comm.comm.allreduce(local))
        if k >= n:
            raise ValueError(f"distlinalg.eigsh: k must be smaller than the operator's size {n}, got k={k}")
        basis = min(n, max(2 * k + 1, 20)) if ncv is None else int(ncv)
        if not k < basis <= n:
            raise ValueError(f"distlinalg.eigsh: ncv must satisfy k < ncv <= n = {n}, got {ncv}")
        cycles = max(100, 10 * n // basis) if maxiter is None else int(maxiter)
        if cycles < 1:
            raise ValueError(f"distlinalg.eigsh: maxiter must be a positive int, got {maxiter}")
        op = _arguments.solver_operator(A, checked_layout, comm, template, "A")
        return checked_layout, template, basis, cycles, op

    checked_layout, template, basis, cycles, op = _arguments.collectively(build, comm)
    dtype = jnp.result_type(*jax.tree_util.tree_leaves(template))
    if not jnp.issubdtype(dtype, jnp.inexact):
        dtype = jnp.result_type(float)
    start = _start_vector(template, v0, dtype, comm, checked_layout)
    eps = float(jnp.finfo(dtype).eps)
    relative = eps if tol is None or tol == 0 else float(tol)
    params = _Params(k, which, basis, cycles, relative, checked_layout, comm)
    matvec, consts = jax.closure_convert(op.matvec, start)
    w, X, info = _eigsh(params, matvec, start, *consts)
    return w, X, info


class _Params(NamedTuple):
    """The static part of a solve (hashable: custom_jvp's non-differentiated argument)."""

    k: int
    which: str
    ncv: int
    cycles: int
    tol: float
    layout: str
    comm: Communicator


def _template(A: Any, v0: Any) -> Any:
    """A vector shaped like A's input on this rank."""
    if v0 is not None:
        return _arguments.as_arrays(v0)
    structure = getattr(A, "input_structure", None)
    if structure is not None:
        return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), structure)
    if isinstance(A, (np.ndarray, jax.Array)) and jnp.ndim(A) == 2:
        return jnp.zeros(A.shape[1], A.dtype)
    shape = getattr(A, "shape", None)
    if shape is not None and len(shape) == 2:
        return jnp.zeros(shape[1], getattr(A, "dtype", float))
    raise ValueError("distlinalg.eigsh: pass v0 (the operator does not say the shape of its vectors)")


def _start_vector(template: Any, v0: Any, dtype: Any, comm: Communicator, layout: str, salt: Any = 0) -> Any:
    """v0, or a fixed pseudo-random vector (this rank's rows of one global vector when sharded;
    `salt` (possibly traced, identical on every rank) gives further ones)."""
    if v0 is not None:
        return jax.tree_util.tree_map(lambda leaf: jnp.asarray(leaf, dtype), template)
    key = jax.random.fold_in(jax.random.PRNGKey(2026), salt)
    if layout == "sharded":
        key = jax.random.fold_in(key, comm.rank)
    leaves, treedef = jax.tree_util.tree_flatten(template)
    keys = jax.random.split(key, len(leaves))
    real = jnp.finfo(dtype).dtype
    made = []
    for sub, leaf in zip(keys, leaves):
        re, im = jax.random.split(sub)
        value = jax.random.uniform(re, jnp.shape(leaf), real, -1.0, 1.0)
        if jnp.issubdtype(dtype, jnp.complexfloating):
            value = value + 1j * jax.random.uniform(im, jnp.shape(leaf), real, -1.0, 1.0)
        made.append(value.astype(dtype))
    return jax.tree_util.tree_unflatten(treedef, made)


# ---------------------------------------------------------------------------
# Vectors of the basis: a pytree whose leaves have a leading axis (the basis index).
def _basis_dots(red: Reductions, V: Any, w: Any) -> Any:
    """Vᴴ w over all ranks: (rows of V,)."""
    parts = [jnp.einsum("j...,...->j", jnp.conj(Vl), wl).reshape(Vl.shape[0])
             for Vl, wl in zip(jax.tree_util.tree_leaves(V), jax.tree_util.tree_leaves(w))]
    return red.sum(sum(parts))


def _combine(coefficients: Any, V: Any) -> Any:
    """Σ_j c_j V_j (coefficients (rows,)) or, for a matrix (rows, q), the q combinations."""
    return jax.tree_util.tree_map(lambda Vl: jnp.tensordot(coefficients.astype(Vl.dtype), Vl, axes=([0], [0])), V)


def _norm(red: Reductions, w: Any) -> Any:
    """‖w‖ over all ranks."""
    return jnp.sqrt(jnp.real(red.dots([(w, w)])[0]))


def _ordering(theta: Any, which: str) -> Any:
    """Indices of the Ritz values, most wanted first."""
    return jnp.argsort(_wanted_key(theta, which), stable=True)


# ---------------------------------------------------------------------------
# The iteration
@partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _eigsh(params: _Params, matvec: Callable[..., Any], start: Any, *consts: Any) -> tuple[Any, Any, EigshInfo]:
    return _lanczos(params, lambda v: matvec(v, *consts), start)


def _lanczos(params: _Params, mv: Callable[[Any], Any], start: Any) -> tuple[Any, Any, EigshInfo]:
    """The k wanted eigenpairs: Krylov–Schur, then probes for missed copies of multiple eigenvalues.

    A single start vector has one component in each eigenspace, so Lanczos in
    exact arithmetic sees one copy of a multiple eigenvalue (with full
    reorthogonalisation, rounding does not bring the others in either). So
    after convergence, the most wanted eigenpair of A deflated by the found
    vectors (P A P + σ X Xᴴ, σ less wanted than the k-th value) is computed
    from a fresh start vector; if it is more wanted than the k-th, it takes
    its place and the search repeats (at most k times).
    """
    k, which = params.k, params.which
    red = Reductions(params.layout, params.comm)
    real = jnp.finfo(jnp.result_type(*jax.tree_util.tree_leaves(start))).dtype
    w, X, restarts, steps, count, scale = _krylov_schur(params, mv, start)

    def deflated(X: Any, sigma: Any) -> Callable[[Any], Any]:
        """v ↦ P A P v + σ X Xᴴ v, P = I − X Xᴴ: two allreduces besides A's (sharded)."""
        def apply(v: Any) -> Any:
            c = _basis_dots(red, X, v)                                   # Xᴴ v
            outside = jax.tree_util.tree_map(jnp.subtract, v, _combine(c, X))
            av = mv(outside)
            av = jax.tree_util.tree_map(jnp.subtract, av, _combine(_basis_dots(red, X, av), X))
            return jax.tree_util.tree_map(jnp.add, av, _combine(sigma * c, X))
        return apply

    def probing(state: tuple[Any, ...]) -> Any:
        return state[6] & (state[5] < k)

    def probe(state: tuple[Any, ...]) -> tuple[Any, ...]:
        w, X, restarts, steps, count, probes, _ = state
        last = w[k - 1]
        spread = jnp.maximum(jnp.maximum(scale, jnp.abs(last)), 1)
        sigma = {"SA": last + spread, "LA": last - spread, "SM": jnp.abs(last) + spread,
                 "LM": jnp.zeros_like(last)}[which]
        fresh = _start_vector(start, None, _start_dtype(start), params.comm, params.layout, salt=probes + 1)
        mu, y, r, s, c, _ = _krylov_schur(params._replace(k=1), deflated(X, sigma), fresh)
        slack = 64 * jnp.finfo(real).eps * scale + params.tol * jnp.abs(last)
        found = _wanted_key(mu[0], which) < _wanted_key(last, which) - slack
        if params.layout == "replicated":  # one decision on every rank
            found = allreduce(found.astype(jnp.int32), "min", comm=params.comm) > 0
        w = jnp.where(found, w.at[k - 1].set(mu[0]), w)
        X = jax.tree_util.tree_map(lambda Xl, yl: jnp.where(found, Xl.at[k - 1].set(yl[0]), Xl), X, y)
        order = _ordering(w, which)
        X = jax.tree_util.tree_map(lambda Xl: Xl[order], X)
        count = jnp.where(found & (c < 1), count - 1, count)  # the new pair's own convergence
        return w[order], X, restarts + r, steps + s, count, probes + 1, found

    state = (w, X, restarts, steps, count, jnp.int32(0), jnp.bool_(True))
    w, X, restarts, steps, count, _, _ = jax.lax.while_loop(probing, probe, state)
    X, w, residual_norms = _residuals(red, mv, X, w.astype(real), k)
    order = _ordering(w, which)
    w, residual_norms = w[order], residual_norms[order]
    X = jax.tree_util.tree_map(lambda Xl: Xl[order], X)
    converged = count >= k
    info = EigshInfo(steps, restarts, residual_norms, converged,
                     jnp.where(converged, CONVERGED, MAX_RESTARTS).astype(jnp.int32))
    return w, X, info


def _start_dtype(start: Any) -> Any:
    """The dtype of the vectors (of `start`'s leaves)."""
    return jnp.result_type(*jax.tree_util.tree_leaves(start))


def _wanted_key(theta: Any, which: str) -> Any:
    """Smaller is more wanted."""
    return {"SA": theta, "LA": -theta, "SM": jnp.abs(theta), "LM": -jnp.abs(theta)}[which]


def _krylov_schur(params: _Params, mv: Callable[[Any], Any], start: Any) -> tuple[Any, ...]:
    """Thick-restart Lanczos (Krylov–Schur form) on `mv`: (θ (k,), X (k, ...), restarts,
    steps, converged count, ‖A‖ estimate), the k wanted Ritz pairs in wanted order."""
    k, m, which = params.k, params.ncv, params.which
    red = Reductions(params.layout, params.comm)
    leaves = jax.tree_util.tree_leaves(start)
    dtype = jnp.result_type(*leaves)
    real = jnp.finfo(dtype).dtype
    keep = k + (m - k) // 2  # Ritz vectors kept at a restart (thick restart)

    V = jax.tree_util.tree_map(lambda leaf: jnp.zeros((m + 1, *leaf.shape), dtype), start)
    first = jax.tree_util.tree_map(lambda leaf: leaf / _norm(red, start).astype(dtype), start)
    V = jax.tree_util.tree_map(lambda Vl, fl: Vl.at[0].set(fl), V, first)
    H = jnp.zeros((m + 1, m), dtype)

    def orthogonalise(V: Any, w: Any, j: Any) -> tuple[Any, Any, Any]:
        """w − V Vᴴ w against basis vectors 0..j, twice (CGS2): (w, Vᴴ w, ‖w‖)."""
        mask = (jnp.arange(m + 1) <= j).astype(dtype)
        h = _basis_dots(red, V, w) * mask                              # h = Vᴴ w
        w = jax.tree_util.tree_map(jnp.subtract, w, _combine(h, V))
        h2 = _basis_dots(red, V, w) * mask                             # the second pass
        w = jax.tree_util.tree_map(jnp.subtract, w, _combine(h2, V))
        return w, h + h2, _norm(red, w)                                # β = ‖w‖

    def expand(j: Any, carry: tuple[Any, Any]) -> tuple[Any, Any]:
        """Step j: w = A v_j orthogonalised against the basis, v_{j+1} = w/β."""
        V, H = carry
        w, h, beta = orthogonalise(V, mv(jax.tree_util.tree_map(lambda Vl: Vl[j], V)), j)   # w = A v_j
        # An invariant subspace (β ≈ 0, identical on every rank): continue from a fresh
        # direction orthogonal to the basis, with no coupling (H[j+1, j] = 0).
        breakdown = beta <= 100 * jnp.finfo(real).eps * jnp.linalg.norm(h)
        w, beta = jax.lax.cond(breakdown, lambda: fresh_direction(V, j), lambda: (w, beta))
        V = jax.tree_util.tree_map(lambda Vl, wl: Vl.at[j + 1].set(wl / beta.astype(dtype)), V, w)
        coupling = jnp.where(breakdown, 0, beta).astype(dtype)
        H = H.at[:, j].set(h).at[j + 1, j].set(coupling)
        return V, H

    def fresh_direction(V: Any, j: Any) -> tuple[Any, Any]:
        random = _start_vector(start, None, dtype, params.comm, params.layout, salt=j + 1)
        w, _, beta = orthogonalise(V, random, j)
        return w, beta

    def ritz(H: Any) -> tuple[Any, Any, Any, Any]:
        """Ritz values (wanted first), their vectors in the basis, residual norms, ‖H‖."""
        T = H[:m, :m]
        T = (T + jnp.conj(T.T)) / 2
        theta, S = jnp.linalg.eigh(T)
        order = _ordering(theta, which)
        theta, S = theta[order], S[:, order]
        residuals = jnp.abs(H[m, :m] @ S)                              # ‖A V S − V S Θ‖ per pair
        return theta, S, residuals, jnp.max(jnp.abs(theta))

    def converged_count(theta: Any, residuals: Any, scale: Any) -> Any:
        # tol·|θ|, but never below what rounding allows: a residual of about ε‖A‖
        # (‖A‖ estimated by the largest Ritz value).
        floor = 64 * jnp.finfo(real).eps * scale
        ok = residuals[:k] <= jnp.maximum(params.tol * jnp.abs(theta[:k]), floor)
        return jnp.sum(ok, dtype=jnp.int32)

    def cycle(state: tuple[Any, ...]) -> tuple[Any, ...]:
        V, H, begin, restarts, steps, _ = state
        V, H = jax.lax.fori_loop(begin, m, expand, (V, H))
        theta, S, residuals, scale = ritz(H)
        count = converged_count(theta, residuals, scale)
        # Every rank stops together: the fewest converged pairs of any rank.
        count = allreduce(count, "min", comm=params.comm) if params.layout == "replicated" else count
        # Restart: the `keep` wanted Ritz vectors, then the residual direction.
        kept = _combine(S[:, :keep], jax.tree_util.tree_map(lambda Vl: Vl[:m], V))   # (keep, ...)
        V = jax.tree_util.tree_map(lambda Vl, Kl: jnp.zeros_like(Vl).at[:keep].set(Kl).at[keep].set(Vl[m]), V, kept)
        Hn = jnp.zeros_like(H).at[jnp.arange(keep), jnp.arange(keep)].set(theta[:keep].astype(dtype))
        Hn = Hn.at[keep, :keep].set(H[m, :m] @ S[:, :keep])
        return V, Hn, jnp.int32(keep), restarts + 1, (steps + (m - begin)).astype(jnp.int32), count.astype(jnp.int32)

    def keep_going(state: tuple[Any, ...]) -> Any:
        *_, restarts, _, count = state
        return (count < k) & (restarts < params.cycles)

    state = (V, H, jnp.int32(0), jnp.int32(0), jnp.int32(0), jnp.int32(0))
    V, H, _, restarts, steps, count = jax.lax.while_loop(keep_going, cycle, state)
    # After the last cycle V[:k] holds the wanted Ritz vectors and diag(H) their values.
    theta = jnp.real(jnp.diagonal(H)[:k]).astype(real)
    X = jax.tree_util.tree_map(lambda Vl: Vl[:k], V)
    return theta, X, restarts, steps, count, jnp.max(jnp.abs(jnp.diagonal(H)[:keep])).astype(real)


def _residuals(red: Reductions, mv: Callable[[Any], Any], X: Any, theta: Any, k: int) -> tuple[Any, Any, Any]:
    """(X, Rayleigh quotients, ‖A xᵢ − θᵢ xᵢ‖) from k matvecs."""
    quotients, norms = [], []
    for i in range(k):
        x = jax.tree_util.tree_map(lambda Xl: Xl[i], X)
        ax = mv(x)
        q = jnp.real(red.dots([(x, ax)])[0])
        r = jax.tree_util.tree_map(lambda a, b: a - q.astype(b.dtype) * b, ax, x)
        quotients.append(q)
        norms.append(_norm(red, r))
    return X, jnp.stack(quotients).astype(theta.dtype), jnp.stack(norms).astype(theta.dtype)


# ---------------------------------------------------------------------------
# Derivatives
@_eigsh.defjvp
def _eigsh_jvp(params: _Params, matvec: Callable[..., Any], primals: tuple, tangents: tuple) -> tuple:
    start, *consts = primals
    _, *consts_dot = tangents
    w, X, info = _eigsh(params, matvec, start, *consts)
    red = Reductions(params.layout, params.comm)
    mv = lambda v: matvec(v, *consts)  # noqa: E731
    k = params.k
    xs = [jax.tree_util.tree_map(lambda Xl: Xl[i], X) for i in range(k)]

    def a_dot(x: Any) -> Any:
        """Ȧ x: the tangent of A's matvec along the tangents of what A depends on."""
        return jax.jvp(lambda *c: matvec(x, *c), tuple(consts),
                       tuple(jax.tree_util.tree_map(_instantiate, consts_dot, consts)))[1]

    adx = [a_dot(x) for x in xs]
    # [i, j] = xⱼᴴ Ȧ xᵢ, in one allreduce.
    coupling = jnp.stack(red.dots([(xj, ai) for ai in adx for xj in xs])).reshape(k, k)
    w_dot = jnp.real(jnp.diagonal(coupling)).astype(w.dtype)                             # Hellmann–Feynman

    def project_out(v: Any) -> Any:
        """(I − X Xᴴ) v: the complement of the computed eigenvectors (one allreduce)."""
        return jax.tree_util.tree_map(jnp.subtract, v, _combine(_basis_dots(red, X, v), X))

    tangents_out = []
    for i in range(k):
        # Within span(X): Σ_{j≠i} xⱼ (xⱼᴴ Ȧ xᵢ)/(λᵢ − λⱼ).
        inside = jax.tree_util.tree_map(jnp.zeros_like, xs[i])
        for j in range(k):
            if j != i:
                c = coupling[i, j] / (w[i] - w[j])
                inside = jax.tree_util.tree_map(lambda a, b: a + c.astype(a.dtype) * b, inside, xs[j])
        # In the complement: P (A − λᵢ) P y = −P Ȧ xᵢ, by MINRES.
        rhs = jax.tree_util.tree_map(jnp.negative, project_out(adx[i]))
        y = _complement_solve(params, mv, project_out, w[i], rhs)
        tangents_out.append(jax.tree_util.tree_map(jnp.add, inside, y))
    X_dot = jax.tree_util.tree_map(lambda *parts: jnp.stack(parts), *tangents_out)
    info_dot = jax.tree_util.tree_map(_zero_tangent, info)
    return (w, X, info), (w_dot, X_dot, info_dot)


def _complement_solve(params: _Params, mv: Callable[[Any], Any], project_out: Callable[[Any], Any],
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
        y, _ = minres(lambda v: project_out(mv(project_out(v))), b, shift=shift, rtol=rtol,
                      layout=params.layout, comm=params.comm)
        return project_out(y)

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
