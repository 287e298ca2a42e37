"""The randomized Nyström preconditioner (Frangella, Tropp & Udell, SIAM J. Matrix Anal. Appl. 44, 2023)
for A + μI with A positive semi-definite and of quickly decaying spectrum (Gram / QGT, sample Gram,
Gauss–Newton).

Build (once; `rank` = ℓ products with A, batched):

    Ω  ~ N(0, 1)^{n × ℓ},  Y = A Ω,  ν = ε ‖Y‖_F,  Y_ν = Y + ν Ω
    C Cᴴ = Ωᴴ Y_ν (Cholesky),  B = Y_ν C⁻ᴴ,  B = U Σ Vᴴ (thin SVD),  Λ̂ = max(Σ² − ν, 0)

so that A ≈ U Λ̂ Uᴴ (the Nyström approximation A Ω (Ωᴴ A Ω)⁺ Ωᴴ A, computed stably with the shift ν).
The preconditioner of A + μI is

    P⁻¹ v = (λ̂_ℓ + μ) U (Λ̂ + μ)⁻¹ Uᴴ v + (v − U Uᴴ v),

symmetric positive definite; the preconditioned matrix has the eigenvalues of A + μI beyond the ℓ
captured ones, scaled by 1/(λ̂_ℓ + μ), and ≈ 1 on the captured ones: its condition number is about
(λ_{ℓ+1} + μ)/μ instead of (λ_1 + μ)/μ.

Layouts. Replicated: Ω is the same on every rank (the same key), the small dense algebra is local,
and an application needs no message. Sharded: each rank holds its rows of Ω, Y and U; Ωᴴ Y, Yᴴ Y and
Ωᴴ Ω travel in one allreduce at build time (B's Gram matrix Bᴴ B = C⁻¹ Y_νᴴ Y_ν C⁻ᴴ gives Σ and V
without another), and an application needs one allreduce of ℓ numbers (Uᴴ v).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from .._runtime.mpi import Communicator, resolve_comm
from .._trees import join_complex, split_complex
from ..comm.allreduce import allreduce
from ..operators import LinearOperator, aslinearoperator, linearise, operator_class, static
from ..operators._partition import exchange_rows
from ._arguments import agree_options


DEFAULT_RANK = 100  # rank=None: the sketch size (at most the operator's size)


@operator_class
class NystromPreconditioner(LinearOperator):
    """P⁻¹ of :func:`nystrom` (module docstring), in the operator's layout; a constant of the solve.

    Attributes:
      basis: U, this rank's rows (sharded) or all of them (replicated), shape (n_r, ℓ), flat.
      weights: (λ̂_ℓ + μ)/(Λ̂ + μ) − 1, shape (ℓ,), replicated: P⁻¹ v = v + U (weights ⊙ Uᴴ v).
      eigenvalues: Λ̂, the Nyström approximation's eigenvalues, descending (replicated).

    Example:
      >>> import jax.numpy as jnp, numpy as np
      >>> import distlinalg as dl
      >>> A = jnp.diag(jnp.array([3.0, 2.0, 1.0] + [0.0] * 7))   # rank 3
      >>> M = dl.solvers.nystrom(A, rank=3)
      >>> np.round(np.asarray(M.eigenvalues), 3).tolist(), M.basis.shape
      ([3.0, 2.0, 1.0], (10, 3))
    """

    basis: Any
    weights: Any
    eigenvalues: Any
    structure: Any = static()
    layout: str = static()
    comm: Communicator = static()
    real_linear: bool = static(default=False)  # built on the (Re, Im) pairs of a real-linear A

    symmetric = True
    hermitian = True

    @property
    def in_structure(self) -> Any:
        return self.structure

    @property
    def out_structure(self) -> Any:
        return self.structure

    def _matvec(self, v: Any) -> Any:
        if self.real_linear:  # complex vectors of a real-linear A: the basis is of their (Re, Im) pairs
            return join_complex(self._apply(split_complex(v)), like=v)
        return self._apply(v)

    def _apply(self, v: Any) -> Any:
        U, weights = jax.lax.stop_gradient((self.basis, self.weights))
        flat, unravel = ravel_pytree(v)
        coefficients = jnp.conj(U).T @ flat.astype(U.dtype)                     # Uᴴ v
        if self.layout == "sharded" and self.comm.size > 1:
            coefficients = allreduce(coefficients, "sum", comm=self.comm)
        return unravel((flat + U @ (weights * coefficients)).astype(flat.dtype))


def nystrom(A: Any, rank: int | None = None, *, shift: Any = 0.0, key: Any = None, layout: str | None = None,
            comm: Any = None) -> NystromPreconditioner:
    """A randomized Nyström preconditioner for (A + shift·I), A positive semi-definite.

    Args:
      A: the operator (sharded or replicated): a distlinalg operator such as
        :func:`~distlinalg.operators.gram` / ``sample_gram`` /
        ``gauss_newton`` (which may hold their own ``diag_shift``: then
        leave ``shift`` at 0), a square array, or a callable with
        ``layout``/``comm``. Its ℓ products are made one after another
        inside one ``lax.map`` (a scan).
      rank: ℓ, the sketch size (1 ≤ ℓ ≤ the operator's size). Take it where
        A's eigenvalues fall below the shift; a few tens to a few hundred
        for SR systems. None: min(100, the operator's size).
      shift: μ ≥ 0 of the system A + μI that the preconditioner is for
        (replicated; may be traced).
      key: PRNG key of the sketch (default key 0; each rank's rows of Ω
        differ in the sharded layout).
      layout, comm: for an A that does not carry them.

    Returns:
      A :class:`NystromPreconditioner`, usable as ``M=`` in cg, minres (and
      gmres, bicgstab). Build: ℓ products with A (a scan), one allreduce
      of three ℓ × ℓ matrices (sharded; none replicated) and ℓ × ℓ dense
      algebra on every rank. Application: no message (replicated), one
      allreduce of ℓ numbers (sharded); memory n_r × ℓ per rank.

    AD: a constant of the solve (stop_gradient on its basis): a solve's
    derivatives are those of the solve without it.

    Errors (ValueError on every rank, before any message): rank < 1 or
    larger than the operator, a negative shift, ranks passing different
    ranks.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> import distlinalg as dl
      >>> Q = np.linalg.qr(np.random.default_rng(0).standard_normal((200, 200)))[0]
      >>> A = jnp.asarray((Q * 0.5 ** np.arange(200)) @ Q.T)      # a fast-decaying spectrum
      >>> b = jnp.ones(200)
      >>> M = dl.solvers.nystrom(A, rank=30, shift=1e-2)
      >>> _, plain = dl.cg(A + 1e-2 * jnp.eye(200), b, rtol=1e-4)
      >>> _, info = dl.cg(A + 1e-2 * jnp.eye(200), b, M=M, rtol=1e-4)
      >>> bool(info.converged), int(info.iterations) < int(plain.iterations) // 4
      (True, True)
    """
    if layout is None:
        layout = A.layout if isinstance(A, LinearOperator) else "replicated"
    comm = resolve_comm(A.comm if comm is None and isinstance(A, LinearOperator) else comm)
    operator = A if isinstance(A, LinearOperator) else aslinearoperator(A, layout=layout, comm=comm)
    structure = operator.in_structure
    if structure is None:
        raise ValueError("distlinalg.solvers.nystrom: A needs an input structure (a distlinalg operator, or an "
                         "array)")
    template = jax.tree_util.tree_unflatten(structure.treedef, [jnp.zeros(l.shape, l.dtype) for l in structure.leaves])
    sketched = operator
    if operator.real_linear:  # only real-linear on complex vectors: sketch the real operator on (Re, Im) pairs
        sketched = operator.real_pairs(template)
        template = split_complex(template)
    flat_template, unravel = ravel_pytree(template)
    local = flat_template.shape[0]
    total = local if layout == "replicated" or comm.size == 1 else int(exchange_rows(np.asarray([local]), comm).sum())
    if rank is None:
        rank = min(DEFAULT_RANK, total)
    _check_options(rank, shift, total, comm)
    dtype = flat_template.dtype
    real = jnp.finfo(dtype).dtype

    key = jax.random.PRNGKey(0) if key is None else key
    if layout == "sharded":
        key = jax.random.fold_in(key, comm.rank)
    omega = jax.random.normal(key, (local, rank), real).astype(dtype)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        omega = (omega + 1j * jax.random.normal(jax.random.fold_in(key, 1), (local, rank), real)).astype(dtype)
    matvec = linearise(jax.lax.stop_gradient(sketched)).matvec
    # A Ω, (n_r, ℓ): the ℓ products one after another (a scan). One vmapped batch was 7.5x slower
    # per product on XLA's CPU backend for the Gram operator of a 17k-parameter RBM (its batched
    # linearised model ran far below the flop rate of one product), and it held ℓ copies of the
    # model's intermediates at once.
    Y = jax.lax.map(lambda w: ravel_pytree(matvec(unravel(w)))[0], omega.T).T
    Y = jax.lax.stop_gradient(Y)
    grams = jnp.stack([jnp.conj(Y).T @ Y, jnp.conj(omega).T @ Y, jnp.conj(omega).T @ omega])
    if layout == "sharded" and comm.size > 1:
        grams = allreduce(grams, "sum", comm=comm)
    YY, OY, OO = grams[0], grams[1], grams[2]
    nu = jnp.sqrt(jnp.real(jnp.trace(YY))) * jnp.finfo(real).eps * 10              # ν = 10 ε ‖Y‖_F
    OY_nu = OY + nu * OO                                                            # Ωᴴ Y_ν
    OY_nu = (OY_nu + jnp.conj(OY_nu).T) / 2
    YY_nu = YY + nu * (OY + jnp.conj(OY).T) + nu ** 2 * OO                           # Y_νᴴ Y_ν
    C = jnp.linalg.cholesky(OY_nu)                                                  # Ωᴴ Y_ν = C Cᴴ
    Cinv_YY = jax.scipy.linalg.solve_triangular(C, YY_nu, lower=True)               # C⁻¹ Y_νᴴ Y_ν
    BB = jax.scipy.linalg.solve_triangular(C, jnp.conj(Cinv_YY).T, lower=True)      # C⁻¹ (…) C⁻ᴴ = Bᴴ B
    sigma2, V = jnp.linalg.eigh((BB + jnp.conj(BB).T) / 2)
    sigma2, V = sigma2[::-1], V[:, ::-1]                                            # descending
    sigma = jnp.sqrt(jnp.maximum(sigma2, 0))
    B = jax.scipy.linalg.solve_triangular(C, jnp.conj(Y + nu * omega).T, lower=True)  # C⁻¹ Y_νᴴ = Bᴴ
    inverse_sigma = jnp.where(sigma > 0, 1 / jnp.where(sigma > 0, sigma, 1), 0)
    U = (jnp.conj(B).T @ V) * inverse_sigma[None, :]                                # B V Σ⁻¹
    eigenvalues = jnp.maximum(sigma2 - nu, 0)
    mu = jnp.asarray(shift, real)
    weights = (eigenvalues[-1] + mu) / (eigenvalues + mu) - 1
    # Directions the sketch did not capture (σ = 0: a rank-deficient A) are left alone.
    weights = jnp.where(sigma > 0, weights, 0).astype(dtype)
    return NystromPreconditioner(basis=U, weights=weights, eigenvalues=eigenvalues, structure=structure,
                                 layout=layout, comm=comm, real_linear=bool(operator.real_linear))


def _check_options(rank: Any, shift: Any, total: int, comm: Communicator) -> None:
    problem = ""
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 1 <= rank <= total:
        problem = f"rank must be an int with 1 <= rank <= {total} (the operator's size), got {rank!r}"
    elif not isinstance(shift, jax.core.Tracer) and float(np.real(shift)) < 0:
        problem = f"shift must be >= 0, got {shift!r}"
    agree_options("distlinalg.solvers.nystrom", problem, f"rank={rank!r}", comm)
