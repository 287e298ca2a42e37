"""Thick-restart Lanczos (Wu & Simon) in the Krylov–Schur form of Stewart, across ranks.

A basis V of ncv + 1 vectors in the operator's layout, the projected matrix
H = Vᴴ A V (small, identical on every rank), and at each restart the wanted
Ritz vectors kept as the start of the next basis. Per Lanczos step: one
matvec and three allreduces (sharded layout): the projections Vᴴ w, their
second pass (classical Gram–Schmidt twice) and ‖w‖. The replicated layout
computes the same quantities locally and agrees on the stop once per cycle.

A single start vector has one component in each eigenspace, so it finds one
copy of a multiple eigenvalue. After convergence, probes from fresh start
vectors search A deflated by the found vectors for a more wanted eigenvalue
(another copy) and swap it in, until none is found (at most k probes, each a
Lanczos run for one pair).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ..comm.allreduce import allreduce
from ._common import Reductions
from ._eigen import Found, Params, basis_dots, combine, norm, ordering, start_vector, vector_dtype, wanted_key


def lanczos(params: Params, mv: Callable[[Any], Any], start: Any) -> Found:
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
    real = jnp.finfo(vector_dtype(start)).dtype
    w, X, restarts, steps, count, scale = krylov_schur(params, mv, start)

    def deflated(X: Any, sigma: Any) -> Callable[[Any], Any]:
        """v ↦ P A P v + σ X Xᴴ v, P = I − X Xᴴ: two allreduces besides A's (sharded)."""
        def apply(v: Any) -> Any:
            c = basis_dots(red, X, v)                                   # Xᴴ v
            outside = jax.tree_util.tree_map(jnp.subtract, v, combine(c, X))
            av = mv(outside)
            av = jax.tree_util.tree_map(jnp.subtract, av, combine(basis_dots(red, X, av), X))
            return jax.tree_util.tree_map(jnp.add, av, combine(sigma * c, X))
        return apply

    def probing(state: tuple[Any, ...]) -> Any:
        return state[6] & (state[5] < k)

    def probe(state: tuple[Any, ...]) -> tuple[Any, ...]:
        w, X, restarts, steps, count, probes, _ = state
        last = w[k - 1]
        spread = jnp.maximum(jnp.maximum(scale, jnp.abs(last)), 1)
        sigma = {"SA": last + spread, "LA": last - spread, "SM": jnp.abs(last) + spread,
                 "LM": jnp.zeros_like(last)}[which]
        fresh = start_vector(start, None, vector_dtype(start), params.comm, params.layout, salt=probes + 1)
        mu, y, r, s, c, _ = krylov_schur(params._replace(k=1), deflated(X, sigma), fresh)
        slack = 64 * jnp.finfo(real).eps * scale + params.tol * jnp.abs(last)
        found = wanted_key(mu[0], which) < wanted_key(last, which) - slack
        if params.layout == "replicated":  # one decision on every rank
            found = allreduce(found.astype(jnp.int32), "min", comm=params.comm) > 0
        w = jnp.where(found, w.at[k - 1].set(mu[0]), w)
        X = jax.tree_util.tree_map(lambda Xl, yl: jnp.where(found, Xl.at[k - 1].set(yl[0]), Xl), X, y)
        order = ordering(w, which)
        X = jax.tree_util.tree_map(lambda Xl: Xl[order], X)
        count = jnp.where(found & (c < 1), count - 1, count)  # the new pair's own convergence
        return w[order], X, restarts + r, steps + s, count, probes + 1, found

    # Probes only after convergence: an unconverged run has nothing to complete, and its
    # restart budget (maxiter) is spent.
    state = (w, X, restarts, steps, count, jnp.int32(0), count >= k)
    w, X, restarts, steps, count, _, _ = jax.lax.while_loop(probing, probe, state)
    return Found(w, X, steps, restarts, steps, count)


def krylov_schur(params: Params, mv: Callable[[Any], Any], start: Any) -> tuple[Any, ...]:
    """Thick-restart Lanczos (Krylov–Schur form) on `mv`: (θ (k,), X (k, ...), restarts,
    steps, converged count, ‖A‖ estimate), the k wanted Ritz pairs in wanted order."""
    k, m, which = params.k, params.ncv, params.which
    red = Reductions(params.layout, params.comm)
    leaves = jax.tree_util.tree_leaves(start)
    dtype = jnp.result_type(*leaves)
    real = jnp.finfo(dtype).dtype
    keep = k + (m - k) // 2  # Ritz vectors kept at a restart (thick restart)

    V = jax.tree_util.tree_map(lambda leaf: jnp.zeros((m + 1, *leaf.shape), dtype), start)
    first = jax.tree_util.tree_map(lambda leaf: leaf / norm(red, start).astype(dtype), start)
    V = jax.tree_util.tree_map(lambda Vl, fl: Vl.at[0].set(fl), V, first)
    H = jnp.zeros((m + 1, m), dtype)

    def orthogonalise(V: Any, w: Any, j: Any) -> tuple[Any, Any, Any]:
        """w − V Vᴴ w against basis vectors 0..j, twice (CGS2): (w, Vᴴ w, ‖w‖)."""
        mask = (jnp.arange(m + 1) <= j).astype(dtype)
        h = basis_dots(red, V, w) * mask                              # h = Vᴴ w
        w = jax.tree_util.tree_map(jnp.subtract, w, combine(h, V))
        h2 = basis_dots(red, V, w) * mask                             # the second pass
        w = jax.tree_util.tree_map(jnp.subtract, w, combine(h2, V))
        return w, h + h2, norm(red, w)                                # β = ‖w‖

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
        random = start_vector(start, None, dtype, params.comm, params.layout, salt=j + 1)
        w, _, beta = orthogonalise(V, random, j)
        return w, beta

    def ritz(H: Any) -> tuple[Any, Any, Any, Any]:
        """Ritz values (wanted first), their vectors in the basis, residual norms, ‖H‖."""
        T = H[:m, :m]
        T = (T + jnp.conj(T.T)) / 2
        theta, S = jnp.linalg.eigh(T)
        order = ordering(theta, which)
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
        kept = combine(S[:, :keep], jax.tree_util.tree_map(lambda Vl: Vl[:m], V))   # (keep, ...)
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
