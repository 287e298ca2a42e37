"""The natural-gradient (stochastic reconfiguration) update over all ranks' samples.

    δ = (S + λ I)⁻¹ F,     S = Ōᴴ Ō / N,     F = Ōᴴ ē / N,

with Ō the centred Jacobian of the per-sample outputs (log ψ) and ē the
centred residuals (local energies) of all N samples on all ranks, in one of
NetKet's modes (:class:`distlinalg.operators.ModelPoint`). Two equivalent
solves (push-through identity (ŌᴴŌ/N + λ)⁻¹ Ōᴴ = Ōᴴ (ŌŌᴴ/N + λ)⁻¹):

  * parameter space (SR):       (S + λ) δ = F                 n × n
  * sample space (MinSR, SRt):  (T + λ) x = ē,  δ = Ōᴴ x / N    N·k × N·k,
    T = Ō Ōᴴ / N,

each rank holding its own samples' rows; the Jacobian is never gathered.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jax.scipy.linalg
from jax.flatten_util import ravel_pytree

from .._runtime.mpi import resolve_comm
from ..comm.allreduce import allreduce
from .._trees import stack_complex, tree_map, unstack_complex
from ..operators import GramOperator, Jacobian, ModelPoint, Partition, SampleGramOperator, linearise
from ._arguments import collectively
from ._common import Reason, SolverInfo
from .cg import cg
from .minres import minres

__all__ = ["natural_gradient", "SPACES", "SOLVERS"]

SPACES = ("auto", "parameters", "samples")
SOLVERS = ("cg", "minres", "cholesky")
_NAME = "distlinalg.natural_gradient"


# -- the pieces, as in the formulas above ---------------------------------------------
def residual_rows(model: ModelPoint, residuals: jax.Array) -> jax.Array:
    """e as (n_r, k) rows of the mode: Re e ("real"), (Re e, Im e) ("complex"), e."""
    e = jnp.asarray(residuals)
    if model.mode == "holomorphic":
        return e.astype(model.dtype)[:, None]
    if model.mode == "complex":
        return jnp.stack([jnp.real(e), jnp.imag(e)], axis=1).astype(model.dtype)
    return jnp.real(e).astype(model.dtype)[:, None]


def centred(model: ModelPoint, rows: jax.Array) -> jax.Array:
    """ē = e − mean over every rank's samples (per channel)."""
    total = jnp.sum(rows, axis=0)
    if model.comm.size > 1:
        total = allreduce(total, "sum", comm=model.comm)
    return rows - total[None, :] / model.n_total


def force(model: Jacobian, e: jax.Array, centred_input: bool) -> Any:
    """F = Ōᴴ ē / N, in the mode's parameter space."""
    return tree_map(lambda g: g / model.n_total, model.adjoint(e, centred_input=centred_input))


def choose_space(point: ModelPoint, space: str) -> str:
    """"auto": the smaller of the two systems (N·k against n), the same on every rank."""
    if space != "auto":
        return space
    n_params = point.params_structure.size * (2 if point.split else 1)  # entries of θ̃
    if point.sharded_params:
        n_params = Partition.of_local_sizes(n_params, point.comm).total
    return "samples" if point.n_total * point.channels < n_params else "parameters"


def _dense_solve(matrix: jax.Array, rhs: jax.Array) -> tuple[jax.Array, SolverInfo]:
    """Cholesky solve of a small Hermitian positive definite system (replicated)."""
    factor = jax.scipy.linalg.cho_factor(matrix, lower=True)
    x = jax.scipy.linalg.cho_solve(factor, rhs)
    residual = jnp.linalg.norm(rhs - matrix @ x)
    ok = jnp.all(jnp.isfinite(x))
    info = SolverInfo(
        iterations=jnp.asarray(0, jnp.int32),
        residual_norm=residual,
        converged=ok,
        reason=jnp.where(ok, Reason.CONVERGED_ATOL, Reason.DIVERGED_INDEFINITE_MAT).astype(jnp.int32),
    )
    return x, info


def _krylov(solver: Any, operator: Any, rhs: Any, rtol: Any, atol: Any, maxiter: Any, preconditioner: Any = None):
    if callable(solver):
        return solver(operator, rhs)
    method = cg if solver == "cg" else minres
    return method(operator, rhs, rtol=rtol, atol=atol, maxiter=maxiter, M=_preconditioner(preconditioner, operator))


def _preconditioner(preconditioner: Any, operator: Any) -> Any:
    """M for the Krylov solve of `operator` (S + λ or T + λ, the shift inside): None, "nystrom"
    (nystrom's default sketch: rank 100, or the whole system where it is smaller), or a callable of the operator."""
    if preconditioner is None:
        return None
    if callable(preconditioner):
        return preconditioner(operator)
    from .nystrom import nystrom  # noqa: PLC0415 - beside its one use

    return nystrom(operator)


def parameter_space_update(point, e, *, diag_shift, solver, rtol, atol, maxiter, centred_input, preconditioner=None):
    """(S + λ) δ = F, δ shaped like params; the model linearised once for both."""
    S = linearise(GramOperator(point=point, diag_shift=diag_shift))
    model = S.linearisation
    F = model.from_space(force(model, e, centred_input))
    if solver != "cholesky":
        return _krylov(solver, S, F, rtol, atol, maxiter, preconditioner)
    if model.sharded_params:
        raise ValueError(f"{_NAME}: solver='cholesky' needs replicated parameters")
    if model.communicates:  # no per-sample rows: S column by column
        flat, unravel = ravel_pytree(F)
        if model.split:  # S acts on [Re δ; Im δ]
            pair, info = _dense_solve(S.to_dense(), stack_complex(flat))
            return unravel(unstack_complex(pair)), info
        x, info = _dense_solve(S.to_dense(), flat)
        return unravel(x), info
    x, info = _dense_solve(dense_gram(model, diag_shift), ravel_pytree(model.to_space(F))[0])
    _, unravel_theta = ravel_pytree(model.theta)
    return model.from_space(unravel_theta(x)), info


def dense_gram(model: Jacobian, diag_shift: Any) -> jax.Array:
    """S + λ I as a dense n × n matrix in the mode's parameter space: Σ over
    ranks of R_rᴴ R_r / N from this rank's Jacobian rows (one n²-sized allreduce)."""
    rows = model.local_rows()
    S = jnp.conj(rows).T @ rows
    if model.comm.size > 1:
        S = allreduce(S, "sum", comm=model.comm)
    return S / model.n_total + diag_shift * jnp.eye(S.shape[0], dtype=S.dtype)


def sample_space_update(point, e, *, diag_shift, solver, rtol, atol, maxiter, preconditioner=None):
    """(T + λ) x = ē over the samples (sharded), then δ = Ōᴴ x / N; the model linearised once."""
    T = linearise(SampleGramOperator(point=point, diag_shift=diag_shift))
    model = T.linearisation
    rhs = jnp.reshape(e, point.sample_structure.shape)
    if solver != "cholesky":
        x, info = _krylov(solver, T, rhs, rtol, atol, maxiter, preconditioner)
    else:
        flat_rhs = jnp.reshape(rhs, (-1,))
        whole = Partition.of_local_sizes(flat_rhs.shape[0], point.comm).allgather(flat_rhs, point.comm)
        dense = SampleGramOperator(point=point, diag_shift=diag_shift).to_dense(gather=True)
        solution, info = _dense_solve(dense, whole)
        offset = int(model.counts[: model.comm.rank].sum()) * model.channels
        x = jnp.reshape(solution[offset : offset + flat_rhs.shape[0]], rhs.shape)
    rows = jnp.reshape(x, (model.n_local, model.channels))
    return model.from_space(force(model, rows, centred_input=False)), info


def natural_gradient(
    f: Callable[[Any, Any], Any],
    params: Any,
    samples: Any,
    residuals: Any,
    *,
    diag_shift: Any,
    space: str = "auto",
    mode: str | None = None,
    solver: str | Callable[..., Any] = "cg",
    rtol: float | None = None,
    atol: float = 0.0,
    maxiter: int | None = None,
    center: bool = True,
    chunk_size: int | None = None,
    comm: Any = None,
    sharded_params: bool = False,
    preconditioner: Any = None,
) -> tuple[Any, SolverInfo]:
    """The natural-gradient (SR) update δ = (S + λ I)⁻¹ F over every rank's samples.

    S = Ōᴴ Ō / N and F = Ōᴴ ē / N, with Ō the (centred) Jacobian of
    ``f(params, samples)`` and ē the (centred) residuals over all N samples of
    all ranks. In NetKet's terms, with ``residuals`` the local energies, the
    energy gradient is 2·Re F (real parameters) or 2·F (complex), so NetKet's
    SR update is 2δ.

    Args:
      f: ``f(params, samples) -> (n_r,)``, e.g. log ψ(σ_i), real or complex.
      params: pytree; replicated (identical on every rank) or this rank's
        block with ``sharded_params=True`` (then f communicates).
      samples: pytree with a leading axis of this rank's n_r samples (counts
        may differ between ranks).
      residuals: (n_r,) real or complex, e.g. the local energies E_loc(σ_i).
      diag_shift: λ > 0 (may be traced; differentiable).
      space: "parameters" (SR: CG/MINRES on :func:`operators.gram`, n × n),
        "samples" (MinSR/SRt: on :func:`operators.sample_gram`, N·k × N·k),
        or "auto": the smaller system. Both give the same δ.
      mode: "real" (Re f only; Re of the residuals), "complex" (Re f and Im
        f; for real params S = Re(ŌᴴŌ)/N, F = Re(Ōᴴē)/N), "holomorphic"
        (complex S and F); complex params are (Re θ, Im θ) pairs outside
        "holomorphic". Default None: NetKet's choice ("complex" for a complex
        output, else "real").
      solver: "cg", "minres", "cholesky" (dense, for small systems: in
        parameter space S from each rank's Jacobian rows and one n × n
        allreduce; in sample space T's rows from a ring of Jacobian-row
        pieces, gathered to N·k × N·k), or a callable
        ``solver(operator, rhs) -> (x, info)`` such as
        ``functools.partial(distlinalg.cg, M=...)``.
      rtol, atol, maxiter: the Krylov solve's stopping rule (rtol default
        1e-10 in float64, 1e-5 in float32; maxiter the solver's default).
      center: centre Ō and the residuals (subtract their means over all
        samples); False uses them as given.
      chunk_size: evaluate the model on at most this many local samples at a
        time (bounds memory).
      comm: communicator (default distlinalg's).
      sharded_params: params are this rank's block (vectors in parameter
        space are sharded; the update is this rank's block).
      preconditioner: of the "cg"/"minres" solve: None, "nystrom" (a
        randomized Nyström preconditioner of rank 100, or of the system's
        size where it is smaller: :func:`distlinalg.solvers.nystrom`, built
        from 100 products of the system, once per update), or a callable
        ``operator -> M`` (e.g. ``lambda S: dl.solvers.nystrom(S, rank=300)``;
        the operator holds λ). A constant of the solve under AD.

    Returns:
      ``(update, info)``: δ shaped like params, identical on every rank
      (replicated params; this rank's block when sharded), and the solver's
      :class:`SolverInfo` (identical on every rank).

    AD: differentiable with respect to params, samples' contents, residuals
    and diag_shift (the Krylov solves through ``lax.custom_linear_solve``),
    e.g. meta-gradients of a loss of the updated parameters.

    Example:
      A model with three parameters and four samples per rank, checked
      against the dense single-process formula on every rank's samples:

      >>> import jax, jax.numpy as jnp
      >>> import distlinalg as dl
      >>> from distlinalg import comm
      >>> def log_psi(params, s):
      ...     return jnp.tanh(s @ params["w"])
      >>> params = {"w": jnp.array([0.1, -0.2, 0.3])}
      >>> samples = jax.random.normal(jax.random.PRNGKey(comm.rank()), (4, 3))  # this rank's
      >>> e_loc = samples[:, 0] ** 2                                            # their residuals
      >>> delta, info = dl.natural_gradient(log_psi, params, samples, e_loc, diag_shift=1e-2)
      >>> bool(info.converged), delta["w"].shape
      (True, (3,))
      >>> all_samples = comm.allgather(samples).reshape(-1, 3)
      >>> O = jax.jacobian(lambda w: log_psi({"w": w}, all_samples))(params["w"])
      >>> O, e = O - O.mean(0), comm.allgather(e_loc).reshape(-1)
      >>> e, N = e - e.mean(), e.shape[0]
      >>> reference = jnp.linalg.solve(O.T @ O / N + 1e-2 * jnp.eye(3), O.T @ e / N)
      >>> bool(jnp.allclose(delta["w"], reference, rtol=1e-3, atol=1e-5))
      True
    """
    comm = resolve_comm(comm)
    if space not in SPACES:
        raise ValueError(f"{_NAME}: space must be one of {SPACES}, got {space!r}")
    if not (callable(solver) or solver in SOLVERS):
        raise ValueError(f"{_NAME}: solver must be one of {SOLVERS} or a callable, got {solver!r}")
    if preconditioner is not None and not (callable(preconditioner) or preconditioner == "nystrom"):
        raise ValueError(f"{_NAME}: preconditioner must be None, 'nystrom' or a callable operator -> M, "
                         f"got {preconditioner!r}")
    if preconditioner is not None and (callable(solver) or solver == "cholesky"):
        raise ValueError(f"{_NAME}: a preconditioner is for solver='cg' or 'minres' (a callable solver takes "
                         "its own M; 'cholesky' needs none)")
    model = ModelPoint.build(f, params, samples, mode=mode, center=center, chunk_size=chunk_size, comm=comm,
                             sharded_params=sharded_params, where=_NAME)

    def rows_of_residuals() -> jax.Array:
        shape = jnp.shape(residuals)
        if shape != (model.n_local,):
            raise ValueError(f"{_NAME}: residuals must have one value per local sample, shape ({model.n_local},); "
                             f"got {shape}")
        if not jnp.issubdtype(jnp.result_type(residuals), jnp.number):
            raise ValueError(f"{_NAME}: residuals must be numbers, got {jnp.result_type(residuals)}")
        return residual_rows(model, residuals)

    e = collectively(rows_of_residuals, comm)
    if center:
        e = centred(model, e)
    if rtol is None:
        rtol = 1e-10 if jnp.finfo(model.dtype).bits == 64 else 1e-5
    chosen = choose_space(model, space)
    if chosen == "parameters":
        return parameter_space_update(model, e, diag_shift=diag_shift, solver=solver, rtol=rtol, atol=atol,
                                      maxiter=maxiter, centred_input=center, preconditioner=preconditioner)
    return sample_space_update(model, e, diag_shift=diag_shift, solver=solver, rtol=rtol, atol=atol, maxiter=maxiter,
                               preconditioner=preconditioner)
