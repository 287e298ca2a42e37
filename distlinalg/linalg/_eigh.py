"""eigh of a Hermitian matrix held by rows: the engines, and jax's derivative rules computed by rows.

distlinalg's engine is the one-sided block Jacobi method (Hestenes) with a
parallel tournament of column blocks:

  * B = A + c I with c ≥ 0 from Gershgorin's lower bound, so B is positive
    semi-definite and its singular vectors are A's eigenvectors.
  * W = B V starts as B (V = I). Each rank holds two blocks of b columns of W
    and the same columns of V (the columns split evenly, padded with zero
    columns); rank r pairs its blocks [W_top W_bot], forms their Gram matrix
    G (2b × 2b), and rotates both blocks by G's eigenvectors Q (W ← W Q,
    V ← V Q), after which their 2b columns are orthogonal.
  * The blocks then move one place round the tournament (Brent & Luk's
    ordering: rank 0's top block stays, the others go round), so in the
    2P − 1 rounds of a sweep every pair of blocks meets once, and after a
    sweep every block is back where it started.
  * Sweeps repeat until the largest cosine between two columns seen in a
    sweep is below 16 √N·ε (one scalar max-allreduce per sweep, so every rank
    stops together), at most _MAX_SWEEPS. Convergence is quadratic
    once the pair rotations are kept near the identity (`near_identity`).
  * Then λ_j = ‖W_j‖ − c and v_j = V_j; the eigenvalues are gathered and
    sorted, and V's columns are sent to the rows layout (one alltoall).

It is BLAS-3 throughout and needs 2 N² / P of memory per rank, but costs
several times the flops of LAPACK's tridiagonal reduction; ScaLAPACK's
p?syevd is the engine of choice where it loads.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from ..comm.allreduce import allreduce
from ..comm.sendrecv import sendrecv
from ..operators._partition import Partition, allgather_blocks
from ._layout import RowSplit, columns_to_rows, ring_matmul, rows_to_columns

_MAX_SWEEPS = 40
# Reason codes (distlinalg.linalg.Reason)
_SUCCESS, _NOT_CONVERGED, _FAILED = 0, 3, 4


@dataclass(frozen=True)
class Config:
    split: RowSplit
    engine: str
    block_size: int | None
    grid: tuple[int, int] | None


def eigh(H_rows: jax.Array, split: RowSplit, engine: str, block_size: int | None, grid: tuple[int, int] | None = None):
    """(w replicated ascending, this rank's rows of V, a reason code) of the Hermitian H (held by rows)."""
    w, V, reason = _eigh(H_rows, Config(split, engine, block_size, grid))
    return w, V, jax.lax.stop_gradient(reason).astype(jnp.int32)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _eigh(H_rows: jax.Array, config: Config):
    if config.engine == "scalapack":
        from . import _scalapack

        w, V, info = _scalapack.heevd(H_rows, config.split.partition.sizes, config.split.comm,
                                      block=config.block_size, grid=config.grid)
        reason = jnp.where(info == 0, _SUCCESS, _FAILED)
    else:
        w, V, converged = jacobi(H_rows, config.split)
        reason = jnp.where(converged, _SUCCESS, _NOT_CONVERGED)
    return w, V, reason.astype(w.dtype)


@_eigh.defjvp
def _eigh_jvp(config: Config, primals, tangents):
    (H,), (dH,) = primals, tangents
    w, V, reason = _eigh(H, config)
    dw, dV = eigh_tangents(w, V, dH, config.split)
    return (w, V, reason), (dw, dV, jnp.zeros_like(reason))


def eigh_tangents(w: jax.Array, V: jax.Array, dH: jax.Array, split: RowSplit) -> tuple[jax.Array, jax.Array]:
    """jax's rules by rows: C = Vᴴ dH V, dw = Re diag C, dV = V (F ∘ C), F_ij = 1/(w_j − w_i) (0 on i = j).

    Three ring products and one alltoall; every matrix is held by rows (C's rows
    are this rank's eigen-indices, the same split as A's rows). Linear in dH, so
    reverse mode is its transpose (the ring's messages reversed).
    """
    mine = split.mine
    dHV = ring_matmul(dH.astype(V.dtype), V, split)  # rows of dH V
    Vh_rows = jnp.conj(rows_to_columns(V, split, split.partition)).T  # rows of Vᴴ: V's columns, conjugated
    C = ring_matmul(Vh_rows, dHV, split)  # this rank's rows of Vᴴ dH V
    local = jnp.arange(split.n_local)
    gaps = w[None, :] - w[mine][:, None]
    own = jnp.zeros_like(gaps).at[local, mine.start + local].set(1.0)  # this rank's diagonal entries
    # The diagonal by a masked sum, not by indexing: on a rank without rows an empty index
    # makes a constant, so its share of dw would be "known" there and tangent elsewhere, and
    # reverse mode would post dw's allgather at different places on different ranks.
    dw = split.gather(jnp.sum(jnp.real(C) * own, axis=1))
    F = (1.0 / (gaps + own) - own).astype(V.dtype)
    dV = ring_matmul(V, F * C, split)
    return dw.astype(w.dtype), dV


def _gershgorin_bounds(H_rows: jax.Array, split: RowSplit) -> tuple[jax.Array, jax.Array]:
    """(lowest, highest): every eigenvalue of H lies between them (Gershgorin's discs)."""
    local = jnp.arange(split.n_local)
    diagonal = jnp.real(H_rows[local, split.mine.start + local])
    radius = jnp.sum(jnp.abs(H_rows), axis=1) - jnp.abs(diagonal)
    lowest = jnp.min(diagonal - radius, initial=jnp.inf)
    highest = jnp.max(diagonal + radius, initial=-jnp.inf)
    both = allreduce(jnp.stack([-lowest, highest]), op="max", comm=split.comm)
    return -both[0], both[1]


def jacobi(H_rows: jax.Array, split: RowSplit) -> tuple[jax.Array, jax.Array, jax.Array]:
    """distlinalg's engine (module docstring): (w, this rank's rows of V, converged).

    The columns are padded to 2bP with columns μ e_j (μ above every eigenvalue of
    B): decoupled from B and with a singular value of their own, they stay in the
    padding's coordinates whatever the rotations do, and are the largest at the end.
    """
    n, size, rank = split.n, split.size, split.rank
    dtype, real = H_rows.dtype, jnp.finfo(H_rows.dtype).dtype
    b = max(1, -(-n // (2 * size)))
    padded = 2 * b * size
    columns = Partition.from_sizes([max(0, min(2 * b, n - q * 2 * b)) for q in range(size)])
    k = columns.size_of(rank)
    lowest, highest = _gershgorin_bounds(H_rows, split)
    shift = jnp.maximum(0.0, -lowest)
    marker = 2 * (highest + shift) + 1  # μ: above every eigenvalue of B = H + shift I
    local = jnp.arange(split.n_local)
    B_rows = H_rows.at[local, split.mine.start + local].add(shift.astype(dtype))
    first = rank * 2 * b  # this rank's first column (of the padded matrix)
    W = jnp.zeros((padded, 2 * b), dtype).at[:n, :k].set(rows_to_columns(B_rows, split, columns))
    pads = jnp.arange(k, 2 * b)
    W = W.at[first + pads, pads].set(marker.astype(dtype))
    V = jnp.zeros((padded, 2 * b), dtype).at[first + jnp.arange(2 * b), jnp.arange(2 * b)].set(1.0)
    tol = 16 * math.sqrt(n) * float(jnp.finfo(dtype).eps)  # the cosines' rounding floor is about √N·ε

    def rotate(W, V):
        """Orthogonalise the pair's 2b columns; returns the largest cosine seen before."""
        G = jnp.conj(W).T @ W
        norms = jnp.sqrt(jnp.real(jnp.diagonal(G)))
        cosines = jnp.abs(G) / (norms[:, None] * norms[None, :] + jnp.finfo(real).tiny)
        worst = jnp.max(cosines - jnp.eye(2 * b, dtype=real))
        _, Q = jnp.linalg.eigh(G)
        # A pair already orthogonal is left alone (threshold Jacobi): eigh's basis of a repeated
        # eigenvalue of G is arbitrary, and rotating by it would move a column that is not yet
        # orthogonal to another block into the partner block, out of the way of its next check,
        # sweep after sweep (seen: a matrix with a 56-fold eigenvalue "converged" to a wrong V).
        # It also makes the stopping test exact: a sweep that sees no cosine above tol rotated nothing.
        Q = jnp.where(worst < tol, jnp.eye(2 * b, dtype=dtype), near_identity(Q))
        return W @ Q, V @ Q, worst

    def near_identity(Q):
        """Q's columns reordered (and rephased) to be closest to the identity, when each column has a
        distinct largest entry. Eigenvalue order would swap columns between the blocks at every
        rotation; Jacobi then converges only linearly (block rotations must keep well-conditioned
        diagonal blocks, Drmač & Hari). Near convergence every column has a dominant entry."""
        dominant = jnp.argmax(jnp.abs(Q), axis=0)
        is_permutation = jnp.all(jnp.sort(dominant) == jnp.arange(Q.shape[0]))
        P = Q[:, jnp.argsort(dominant)]
        d = jnp.diagonal(P)
        P = P * (jnp.conj(d) / jnp.maximum(jnp.abs(d), jnp.finfo(real).tiny))[None, :]
        return jnp.where(is_permutation, P, Q)

    def move(top, bottom):
        """One place round the tournament (module docstring), W and V blocks travelling together."""
        right = sendrecv(bottom if rank == 0 else top, top, source=(rank - 1) % size, dest=(rank + 1) % size,
                         comm=split.comm)
        left = sendrecv(bottom, bottom, source=(rank + 1) % size, dest=(rank - 1) % size, comm=split.comm)
        new_top = top if rank == 0 else right
        new_bottom = top if rank == size - 1 else left
        return new_top, new_bottom

    def sweep(carry):
        W, V, count, _ = carry
        worst = jnp.zeros((), real)
        for _ in range(2 * size - 1):
            W, V, seen = rotate(W, V)
            worst = jnp.maximum(worst, seen)
            if size > 1:
                both = jnp.concatenate([W, V])  # the blocks' W and V columns travel together
                top, bottom = move(both[:, :b], both[:, b:])
                both = jnp.concatenate([top, bottom], axis=1)
                W, V = both[:padded], both[padded:]
        if size > 1:
            worst = allreduce(worst, op="max", comm=split.comm)
        return W, V, count + 1, worst

    def going(carry):
        _, _, count, worst = carry
        return (worst >= tol) & (count < _MAX_SWEEPS)

    start = (W, V, jnp.zeros((), jnp.int32), jnp.full((), jnp.inf, real))
    W, V, _, worst = jax.lax.while_loop(going, sweep, start)
    values = allgather_blocks(jnp.linalg.norm(W, axis=0), Partition.even(padded, size), split.comm)
    order = jnp.argsort(values)[:n]  # the padding's columns are the largest
    even = Partition.even(padded, size)
    V_rows = columns_to_rows(V[:n], split, even)  # n_r × 2bP
    return values[order] - shift, V_rows[:, order], worst < tol
