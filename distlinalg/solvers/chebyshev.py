"""Chebyshev polynomial preconditioning: x = q(A) b with no inner product per application.

q is the polynomial of the Chebyshev iteration of `degree` steps from x₀ = 0
for the interval [lo, hi] (Saad, *Iterative Methods for Sparse Linear
Systems*, 2nd ed., Algorithm 12.1): the residual polynomial
p(λ) = 1 − λ q(λ) is the scaled Chebyshev polynomial T_d((θ − λ)/δ) / T_d(θ/δ),
θ = (hi + lo)/2, δ = (hi − lo)/2, which is smallest in [lo, hi] among the
polynomials of degree d with p(0) = 1. For an eigenvalue λ of A in (0, hi],
0 < λ q(λ) < 2, so q(A) is positive definite for positive definite A as
long as hi bounds the spectrum from above: lo may be anywhere in (0, hi)
(eigenvalues below it are damped less, not wrongly). d − 1 matvecs per
application and no reduction: in the sharded layout its only messages are
A's own.

With a diagonal scaling D⁻¹ (multigrid's smoother), the polynomial is in
D⁻¹A and q(D⁻¹A) D⁻¹ is applied; it is symmetric when A is.

When the bounds are not given, :func:`chebyshev` estimates them with a few
Lanczos steps (the Ritz values of a Krylov space of dimension `steps`):
hi = 1.1 × the largest Ritz value (it approaches λ_max from below;
PETSc's KSPChebyshev uses the same factor), lo the larger of the smallest
Ritz value and hi/100 (LOWER_RATIO).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._runtime.mpi import Communicator, resolve_comm
from ..operators import LinearOperator, aslinearoperator, linearise, operator_class, static
from ._arguments import agree_options
from ._common import Reductions
from ._vectors import axpy, scale

Vector = Any

LANCZOS_STEPS = 12  # the Krylov dimension of the bound estimate
UPPER_SAFETY = 1.1  # hi = this × the largest Ritz value (a lower estimate of λ_max)
# lo = max(smallest Ritz value, hi / LOWER_RATIO). CG deals with the few eigenvalues below an
# interval well; a wide interval makes the polynomial weaker on all the others. On the 2-D
# Laplacian (n = 24 … 200, degree 4) CG took 28-111 iterations with hi/100, 40-144 with the
# smallest Ritz value, 70-120 with hi/1000, against 49-416 without the preconditioner.
LOWER_RATIO = 100.0


def chebyshev_polynomial(matvec: Callable[[Vector], Vector], b: Vector, lo: Any, hi: Any, degree: int,
                         inverse_diagonal: Vector | None = None) -> Vector:
    """q(S A) S b for the Chebyshev polynomial q of `degree` on [lo, hi] (S = D⁻¹, or I when None).

    `degree` − 1 matvecs, no reduction (module docstring). lo, hi: scalars
    (arrays or floats), 0 < lo < hi, bounds of the spectrum of S A.
    """
    def scaled(r: Vector) -> Vector:
        if inverse_diagonal is None:
            return r
        return jax.tree_util.tree_map(jnp.multiply, inverse_diagonal, r)

    theta, delta = (hi + lo) / 2, (hi - lo) / 2
    sigma = theta / delta
    rho = 1 / sigma
    r = b                                                           # r₀ = b − A·0
    d = scale(1 / theta, scaled(r))                                 # d₀ = S r₀ / θ
    x = d
    for _ in range(degree - 1):
        r = axpy(-1, matvec(d), r)                                  # r ← r − A d
        rho_next = 1 / (2 * sigma - rho)
        d = axpy(2 * rho_next / delta, scaled(r), scale(rho_next * rho, d))  # d ← ρ'ρ d + 2ρ'/δ S r
        x = axpy(1, d, x)                                           # x ← x + d
        rho = rho_next
    return x


def lanczos_bounds(matvec: Callable[[Vector], Vector], start: Vector, reductions: Reductions,
                   steps: int = LANCZOS_STEPS) -> tuple[Any, Any]:
    """(smallest, largest) Ritz value of A on the Krylov space of `start` (`steps` Lanczos steps,
    full reorthogonalisation), identical on every rank (every coefficient is an allreduced dot)."""
    real = jnp.finfo(jnp.result_type(*jax.tree_util.tree_leaves(start))).dtype
    norm = jnp.sqrt(jnp.real(reductions.dots([(start, start)])[0]))
    v = scale(1 / norm, start)
    basis, alphas, betas = [v], [], []
    for j in range(steps):
        w = matvec(basis[j])
        alpha = jnp.real(reductions.dots([(basis[j], w)])[0])
        # Classical Gram–Schmidt against the whole basis, twice, in two allreduces each.
        for _ in range(2):
            coefficients = reductions.dots([(q, w) for q in basis])
            for c, q in zip(coefficients, basis):
                w = axpy(-c, q, w)
        beta = jnp.sqrt(jnp.real(reductions.dots([(w, w)])[0]))
        alphas.append(alpha)
        if j + 1 < steps:
            betas.append(beta)
            # A breakdown (an invariant subspace: β ≈ 0) leaves zero vectors, whose Ritz values
            # are 0 and are masked out below.
            basis.append(scale(jnp.where(beta > 0, 1 / jnp.where(beta > 0, beta, 1), 0).astype(real), w))
    alphas_ = jnp.stack(alphas).astype(real)
    T = jnp.diag(alphas_)
    if betas:
        off = jnp.stack(betas).astype(real)
        T = T + jnp.diag(off, 1) + jnp.diag(off, -1)
    ritz = jnp.linalg.eigvalsh(T)
    scale_ = jnp.max(jnp.abs(ritz))
    meaningful = jnp.abs(ritz) > scale_ * jnp.finfo(real).eps * steps
    lo = jnp.min(jnp.where(meaningful, ritz, jnp.inf))
    return lo, jnp.max(ritz)


@operator_class
class ChebyshevPreconditioner(LinearOperator):
    """v ↦ q(A) v, the Chebyshev polynomial of :func:`chebyshev` (a constant of the solve under AD).

    Attributes:
      A: the operator (a child: its arrays are this preconditioner's).
      lo, hi: the interval (replicated scalars).
      degree: the polynomial's degree (degree − 1 products with A per application).

    Example:
      >>> import distlinalg as dl
      >>> from distlinalg.operators import laplacian_2d
      >>> M = dl.solvers.chebyshev(laplacian_2d(8), bounds=(0.5, 8.0))
      >>> M.degree, float(M.lo), float(M.hi)
      (4, 0.5, 8.0)
    """

    A: Any
    lo: Any
    hi: Any
    degree: int = static()

    @property
    def layout(self) -> str:
        return self.A.layout

    @property
    def comm(self) -> Communicator:
        return self.A.comm

    @property
    def in_structure(self) -> Any:
        return self.A.in_structure

    @property
    def out_structure(self) -> Any:
        return self.A.in_structure

    symmetric = True
    hermitian = True

    def _matvec(self, v: Any) -> Any:
        A = jax.lax.stop_gradient(self.A)
        lo, hi = jax.lax.stop_gradient((self.lo, self.hi))
        return chebyshev_polynomial(A.matvec, v, lo, hi, self.degree)


def chebyshev(A: Any, degree: int = 4, bounds: Any = None, *, key: Any = None, layout: str | None = None,
              comm: Any = None) -> ChebyshevPreconditioner:
    """A Chebyshev polynomial preconditioner: M = q(A), with no reduction per application.

    Args:
      A: a Hermitian positive definite operator (a distlinalg operator, a
        square array, or a callable with ``layout``/``comm``), sharded or
        replicated.
      degree: the polynomial's degree d ≥ 1 (d − 1 products with A per
        application; d = 1 is a scaling by 1/θ).
      bounds: (lo, hi), 0 < lo < hi, hi at least the largest eigenvalue of A
        (below it M is not positive definite). None: estimated with 12
        Lanczos steps from a random start (12 products with A and ~30 small
        allreduces, once): hi = 1.1 × the largest Ritz value, lo the
        larger of the smallest Ritz value and hi/100.
      key: the PRNG key of the estimate's start vector (default key 0; each
        rank's block of it differs in the sharded layout).
      layout, comm: for an A that does not carry them (default: A's, else
        replicated and distlinalg's communicator).

    Returns:
      A :class:`ChebyshevPreconditioner`, an operator in A's layout usable as
      ``M=`` in cg, minres, gmres, bicgstab and ``eigsh(method="lobpcg")``.
      Eager and inside jit (built inside a jitted function, the estimate is
      part of the program).

    AD: a constant of the solve (stop_gradient on A and the bounds): a
    solve's derivatives are those of the unpreconditioned solve.

    Errors (ValueError on every rank, before any message): degree < 1, or
    bounds with lo ≥ hi or lo ≤ 0; the ranks passing different degrees or
    bounds.

    Example:
      >>> import jax.numpy as jnp
      >>> import distlinalg as dl
      >>> from distlinalg.operators import laplacian_2d
      >>> A = laplacian_2d(16)
      >>> b = jnp.ones(A.input_structure.shape)
      >>> M = dl.solvers.chebyshev(A, degree=4, bounds=(0.1, 8.0))
      >>> x, info = dl.cg(A, b, M=M, rtol=1e-5)
      >>> _, plain = dl.cg(A, b, rtol=1e-5)
      >>> bool(info.converged), int(info.iterations) < int(plain.iterations)
      (True, True)
    """
    if layout is None:
        layout = A.layout if isinstance(A, LinearOperator) else "replicated"
    comm = resolve_comm(A.comm if comm is None and isinstance(A, LinearOperator) else comm)
    operator = A if isinstance(A, LinearOperator) else aslinearoperator(A, layout=layout, comm=comm)
    _check_options(degree, bounds, comm)
    if bounds is None:
        linear = linearise(operator)
        if operator.in_structure is None:
            raise ValueError("distlinalg.solvers.chebyshev: estimating the bounds needs A's input structure "
                             "(pass a distlinalg operator, or bounds=(lo, hi))")
        start = _start_vector(operator, key, layout, comm)
        lo, hi = lanczos_bounds(linear.matvec, start, Reductions(layout, comm))
        hi = UPPER_SAFETY * hi
        lo = jnp.clip(lo, hi / LOWER_RATIO, hi / 2)
    else:
        lo, hi = (jnp.asarray(float(bounds[0])), jnp.asarray(float(bounds[1])))
    return ChebyshevPreconditioner(A=operator, lo=lo, hi=hi, degree=int(degree))


def _start_vector(operator: LinearOperator, key: Any, layout: str, comm: Communicator) -> Vector:
    key = jax.random.PRNGKey(0) if key is None else key
    if layout == "sharded":
        key = jax.random.fold_in(key, comm.rank)
    leaves = operator.in_structure.leaves
    keys = jax.random.split(key, len(leaves))
    arrays = [jax.random.normal(k, leaf.shape, jnp.finfo(leaf.dtype).dtype).astype(leaf.dtype) + 1
              for k, leaf in zip(keys, leaves)]
    return jax.tree_util.tree_unflatten(operator.in_structure.treedef, arrays)


def _check_options(degree: Any, bounds: Any, comm: Communicator) -> None:
    """The same ValueError on every rank for options that are bad, or differ between ranks."""
    problem = ""
    if not isinstance(degree, (int, np.integer)) or isinstance(degree, bool) or degree < 1:
        problem = f"degree must be an int >= 1, got {degree!r}"
    elif bounds is not None:
        try:
            lo, hi = (float(bounds[0]), float(bounds[1]))
            if len(bounds) != 2:
                raise ValueError
        except (TypeError, ValueError, IndexError):
            problem = f"bounds must be None or a pair (lo, hi) of numbers, got {bounds!r}"
        else:
            if not (0 < lo < hi):
                problem = f"bounds must satisfy 0 < lo < hi, got lo={lo!r}, hi={hi!r}"
    agree_options("distlinalg.solvers.chebyshev", problem, f"degree={degree!r} bounds={bounds!r}", comm)
