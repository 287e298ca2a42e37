"""optimistix's least-squares solvers on residuals sharded over ranks.

The set-up: every rank evaluates its own residuals r_k(y) (its share of the
data) at parameters y that every rank holds; the problem is
min_y ½ Σ_k ‖r_k(y)‖². optimistix's Gauss–Newton step is a linear least
squares solve, which ``dlx.NormalCG`` makes global. Its damped solvers also
decide from the residuals themselves, and those quantities must be global
too, or the ranks take different branches:

* the trust region (all three) accepts or rejects a step from
  ½‖r‖², ½‖r(y + δ)‖² and the predicted ½‖J δ + r‖²: three sums over
  residuals (:class:`TrustRegion`, one allreduce of the three);
* Levenberg–Marquardt's damped step solves (JᵀJ + λ I) δ = Jᵀ r: with the
  residual and the damping rows stacked in one operator, NormalCG would sum
  the damping rows over ranks (λ counted P times); here the normal equations
  are solved directly, JᵀJ summed over ranks and λ I once
  (:func:`damped_step`);
* the indirect variant finds λ by a Newton iteration on ‖δ(λ)‖, which
  differentiates the damped solve with respect to λ: distlinalg's CG is
  differentiable, NormalCG inside lineax is not;
* Dogleg's Cauchy point uses the gradient Jᵀ r and ‖J g‖², both sums over
  ranks (:class:`DoglegDescent`).

Quantities in parameter space (the Newton step, its norm, the trust radius)
are computed from replicated values and are replicated.

Derivatives of the solution (optimistix's implicit function theorem) need
the optimality condition Σ_k J_kᵀ r_k = 0 of every rank's residuals, not
this rank's: :class:`ImplicitAdjoint`. :func:`least_squares` (which
``optimistix.least_squares`` becomes only by :func:`install_least_squares`) picks it, and turns
optimistix's own damped solvers given a distlinalg linear solver into the
classes here, so the paths users write work unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import lineax as lx
import optimistix as optx

from .. import solvers as _solvers
from ..solvers import _arguments
from .._runtime.mpi import resolve_comm
from ..comm.allreduce import allreduce
from ..comm.fused import tree_allreduce
from ..operators import LinearOperator
from . import _linear as dlx

__all__ = [
    "TrustRegion",
    "DampedNewtonDescent",
    "IndirectDampedNewtonDescent",
    "DoglegDescent",
    "GaussNewton",
    "LevenbergMarquardt",
    "IndirectLevenbergMarquardt",
    "Dogleg",
    "ImplicitAdjoint",
    "least_squares",
    "install_least_squares",
    "damped_step",
]


def _sum_squares(tree: Any) -> Any:
    """Σ |x_i|² over this rank's entries of `tree`."""
    leaves = [jnp.sum(jnp.abs(x) ** 2) for x in jax.tree_util.tree_leaves(tree)]
    return sum(leaves[1:], leaves[0]) if leaves else jnp.zeros(())


def _tree_add(a: Any, b: Any) -> Any:
    return jax.tree_util.tree_map(jnp.add, a, b)


def _tree_scale(alpha: Any, tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda x: (alpha * x).astype(x.dtype), tree)


def _negate(tree: Any) -> Any:
    return jax.tree_util.tree_map(jnp.negative, tree)


# ---------------------------------------------------------------------------
# Residual-space quantities over every rank
def global_gradient(jac: lx.AbstractLinearOperator, residual: Any) -> Any:
    """g = Σ_k J_kᵀ r_k: the gradient of ½ Σ_k ‖r_k‖², identical on every rank."""
    (local,) = jax.linear_transpose(jac.mv, jac.in_structure())(jax.tree_util.tree_map(jnp.conj, residual))
    return tree_allreduce(local)


def _normal_matvec(data: tuple, v: Any) -> Any:
    """(Σ_k J_kᵀ J_k + λ I) v: one parameter-sized allreduce."""
    jac, lm_param = data
    (jtjv,) = jax.linear_transpose(jac.mv, jac.in_structure())(jac.mv(v))
    return _tree_add(tree_allreduce(jtjv), _tree_scale(lm_param, v))


def damped_step(lm_param: Any, f_info: Any, linear_solver: Any) -> tuple[Any, Any]:
    """δ = (Σ_k J_kᵀ J_k + λ I)⁻¹ Σ_k J_kᵀ r_k, by distlinalg's CG (replicated).

    Args:
      lm_param: λ ≥ 0, a replicated scalar (traced; differentiable).
      f_info: optimistix's ``FunctionInfo.ResidualJac`` of this rank's residuals.
      linear_solver: a ``distlinalg.lineax.NormalCG``; its ``rtol``, ``atol``
        and ``max_steps`` are those of this CG.

    Returns:
      (δ, optimistix ``RESULTS``), both identical on every rank.

    AD: through ``lax.custom_linear_solve`` (distlinalg's CG), in λ and in
    the Jacobian's arrays, forward and reverse.

    Example:
      Rows of J and r on every rank (here the same two rows on each of P ranks,
      so JᵀJ = P·I and Jᵀr = P·(1, 2)):

      >>> import jax.numpy as jnp
      >>> import lineax as lx
      >>> import optimistix as optx
      >>> import distlinalg.lineax as dlx
      >>> from distlinalg import comm
      >>> info = optx.FunctionInfo.ResidualJac(jnp.array([1.0, 2.0]), lx.MatrixLinearOperator(jnp.eye(2)))
      >>> delta, result = dlx.damped_step(1.0, info, dlx.NormalCG(rtol=1e-12, atol=0.0))
      >>> P = comm.size()
      >>> bool(jnp.allclose(delta, P / (P + 1.0) * jnp.array([1.0, 2.0])))   # (P I + 1·I)⁻¹ P (1, 2)
      True
    """
    jac = f_info.jac
    normal = LinearOperator(_normal_matvec, data=(jac, lm_param), input_structure=jac.in_structure(),
                            layout="replicated", symmetric=True, hermitian=True, comm=resolve_comm(None))
    rhs = global_gradient(jac, f_info.residual)
    with _arguments.inside_library_internals():  # (inside optimistix's cached traces)
        delta, info = _solvers.cg(normal, rhs, rtol=linear_solver.rtol, atol=linear_solver.atol,
                                  maxiter=linear_solver.max_steps)
    return delta, optx.RESULTS.promote(dlx.result_of(info.reason))


def _lm_param(step_size: Any) -> Any:
    """λ = 1 / step size (the largest float for a vanishing step), as optimistix does."""
    finfo = jnp.finfo(step_size.dtype)
    positive = step_size > finfo.eps
    return jnp.where(positive, 1 / jnp.where(positive, step_size, 1), finfo.max)


def _check_normal_cg(linear_solver: Any, where: str) -> None:
    if not isinstance(linear_solver, dlx.NormalCG):
        raise ValueError(
            f"distlinalg.lineax.{where}: linear_solver must be distlinalg.lineax.NormalCG (the damped step "
            f"is a least-squares solve over every rank's residuals), got {type(linear_solver).__name__}")


# ---------------------------------------------------------------------------
# The search
class TrustRegion(optx.ClassicalTrustRegion):
    """optimistix's classical trust region, with its accept/reject decision
    taken from every rank's residuals.

    The three sums the decision compares, ‖r(y)‖², ‖r(y + δ)‖² and
    ‖J δ + r(y)‖², are reduced over ranks in one allreduce, so every rank
    accepts or rejects the same step and updates the same radius. Same
    parameters as ``optimistix.ClassicalTrustRegion``.

    Example:
      >>> import distlinalg.lineax as dlx
      >>> search = dlx.TrustRegion(high_cutoff=0.99, low_cutoff=0.01)
    """

    def step(self, first_step, y, y_eval, f_info, f_eval_info, state):
        if not isinstance(f_info, optx.FunctionInfo.ResidualJac):
            raise ValueError("distlinalg.lineax.TrustRegion: for least-squares solvers (residuals over ranks)")
        y_diff = jax.tree_util.tree_map(jnp.subtract, y_eval, y)
        linearised = _tree_add(f_info.jac.mv(y_diff), f_info.residual)
        rr, rr_eval, model = tree_allreduce((_sum_squares(f_info.residual), _sum_squares(f_eval_info.residual),
                                             _sum_squares(linearised)))
        predicted_reduction = 0.5 * (model - rr)          # the Gauss–Newton model's decrease
        actual_reduction = 0.5 * (rr_eval - rr)           # ½‖r(y+δ)‖² − ½‖r(y)‖² (negative: better)
        # (Both are decreases, so the ratio tests are written as products.)
        accept = (actual_reduction <= self.low_cutoff * predicted_reduction) | first_step
        good = (actual_reduction < self.high_cutoff * predicted_reduction) & (predicted_reduction < 0)
        good = good & jnp.invert(first_step)
        factor = jnp.where(accept, jnp.where(good, self.high_constant, 1), self.low_constant)
        new_step_size = factor * state.step_size
        return new_step_size, accept, optx.RESULTS.successful, type(state)(step_size=new_step_size)


# ---------------------------------------------------------------------------
# Descents
class DampedNewtonDescent(optx.DampedNewtonDescent):
    """Levenberg–Marquardt's damped step over every rank's residuals:
    (Σ_k J_kᵀ J_k + λ I) δ = Σ_k J_kᵀ r_k with λ = 1 / step size
    (:func:`damped_step`). `linear_solver`: a ``distlinalg.lineax.NormalCG``.

    Example:
      A solver of one's own, from optimistix's parts made global:

      >>> import optimistix as optx
      >>> import distlinalg.lineax as dlx
      >>> descent = dlx.DampedNewtonDescent(linear_solver=dlx.NormalCG(rtol=1e-10, atol=0.0))
      >>> isinstance(descent, optx.DampedNewtonDescent)
      True
    """

    def step(self, step_size, state):
        _check_normal_cg(self.linear_solver, "DampedNewtonDescent")
        delta, result = damped_step(_lm_param(step_size), state.f_info, self.linear_solver)
        return _negate(delta), result


class IndirectDampedNewtonDescent(optx.IndirectDampedNewtonDescent):
    """The trust-region form of Levenberg–Marquardt over every rank's
    residuals: λ is found by a root find on ‖δ(λ)‖ = radius, differentiating
    distlinalg's CG with respect to λ (identical on every rank).
    `linear_solver`: a ``distlinalg.lineax.NormalCG``.

    Example:
      >>> import distlinalg.lineax as dlx
      >>> descent = dlx.IndirectDampedNewtonDescent(linear_solver=dlx.NormalCG(rtol=1e-10, atol=0.0))
      >>> float(descent.lambda_0)
      1.0
    """

    def step(self, step_size, state):
        _check_normal_cg(self.linear_solver, "IndirectDampedNewtonDescent")
        radius = state.newton_norm * step_size  # step size 1: the Newton step's length

        def excess_length(lm_param, _):
            delta, _ = damped_step(lm_param, state.f_info, self.linear_solver)
            return self.trust_region_norm(delta) - radius

        def fit_damping():
            lm_param = optx.root_find(excess_length, self.root_finder, jnp.asarray(self.lambda_0),
                                      options=dict(lower=1e-5), max_steps=32, throw=False).value
            return damped_step(lm_param, state.f_info, self.linear_solver)

        def take_newton():
            return state.newton, state.result

        fit = (state.result == optx.RESULTS.successful) & (step_size < 1)
        delta, result = jax.lax.cond(fit, fit_damping, take_newton)
        return _negate(delta), result


class DoglegDescent(optx.DoglegDescent):
    """optimistix's dogleg with its Cauchy point from every rank's residuals:
    g = Σ_k J_kᵀ r_k and ‖J g‖² = Σ_k ‖J_k g‖². `linear_solver`: a
    ``distlinalg.lineax.NormalCG`` (the Newton step).

    Example:
      >>> import distlinalg.lineax as dlx
      >>> descent = dlx.DoglegDescent(linear_solver=dlx.NormalCG(rtol=1e-10, atol=0.0))
      >>> descent.trust_region_norm.__name__    # optimistix's 2-norm: parameters are replicated
      'two_norm'
    """

    def query(self, y, f_info, state):
        if not isinstance(f_info, optx.FunctionInfo.ResidualJac):
            raise ValueError("distlinalg.lineax.DoglegDescent: for least-squares solvers (residuals over ranks)")
        _check_normal_cg(self.linear_solver, "DoglegDescent")
        grad = global_gradient(f_info.jac, f_info.residual)
        curvature = allreduce(_sum_squares(f_info.jac.mv(grad)))        # gᵀ JᵀJ g
        positive = curvature > jnp.finfo(curvature.dtype).eps
        scaling = jnp.where(positive, _sum_squares(grad) / jnp.where(positive, curvature, 1), 0.0)
        newton_solution, result = _newton_step(f_info, self.linear_solver)
        cauchy = _tree_scale(-scaling, grad)                             # the steepest-descent minimiser
        return type(state)(newton=_negate(newton_solution), cauchy=cauchy,
                           newton_norm=self.trust_region_norm(newton_solution),
                           cauchy_norm=self.trust_region_norm(cauchy), result=result)


def _newton_step(f_info: Any, linear_solver: Any) -> tuple[Any, Any]:
    """The Gauss–Newton step J⁺ r (NormalCG: over every rank's residuals)."""
    solution = lx.linear_solve(f_info.jac, f_info.residual, linear_solver, throw=False)
    return solution.value, optx.RESULTS.promote(solution.result)


# ---------------------------------------------------------------------------
# Solvers
def _quiet(**_: Any) -> None:
    pass


def _verbose(verbose: Any) -> Callable[..., None]:
    if verbose is True:
        raise ValueError("distlinalg.lineax: verbose=True prints this rank's share of the loss; pass a callable "
                         "(its values are optimistix's, this rank's residual sums among them)")
    return verbose or _quiet


def _default_linear_solver() -> Any:
    return dlx.NormalCG(rtol=1e-6, atol=0.0)


def _set_fields(solver: Any, rtol: float, atol: float, norm: Callable | None, linear_solver: Any, verbose: Any,
                descent: Callable[[Any], Any]) -> None:
    """The fields of a damped solver of this module (called from its __init__):
    the global trust region, and the descent `descent(linear_solver)`."""
    linear_solver = linear_solver or _default_linear_solver()
    _check_normal_cg(linear_solver, type(solver).__name__)
    solver.rtol, solver.atol = rtol, atol
    solver.norm = norm or dlx.max_norm
    solver.descent = descent(linear_solver)
    solver.search = TrustRegion()
    solver.verbose = _verbose(verbose)


class GaussNewton(optx.GaussNewton):
    """``optimistix.GaussNewton`` over every rank's residuals: defaults
    ``norm=distlinalg.lineax.max_norm`` and ``linear_solver=NormalCG(rtol=1e-6)``.

    Example:
      >>> import jax.numpy as jnp
      >>> import optimistix as optx
      >>> import distlinalg.lineax as dlx
      >>> from distlinalg import comm
      >>> t = jnp.array([0.0, 1.0]) + 2 * comm.rank()          # this rank's points of y = 1 + t/2
      >>> fit = dlx.least_squares(lambda p, t: p[0] + p[1] * t - (1 + 0.5 * t), dlx.GaussNewton(1e-6, 1e-6),
      ...                         jnp.zeros(2), args=t)
      >>> bool(jnp.allclose(fit.value, jnp.array([1.0, 0.5]), atol=1e-4))
      True
    """

    def __init__(self, rtol: float, atol: float, norm: Callable = None, linear_solver: Any = None,
                 verbose: Any = False):
        super().__init__(rtol, atol, norm=norm or dlx.max_norm,
                         linear_solver=linear_solver or _default_linear_solver(), verbose=False)
        self.verbose = _verbose(verbose)


class LevenbergMarquardt(optx.LevenbergMarquardt):
    """``optimistix.LevenbergMarquardt`` over every rank's residuals.

    Every rank holds the parameters y and its own residuals; the solve
    minimises ½ Σ_k ‖r_k(y)‖². The trust region (:class:`TrustRegion`) and
    the damped step (:class:`DampedNewtonDescent`) are global, so every rank
    takes the same steps and stops together.

    Args:
      rtol, atol: optimistix's termination tolerances.
      norm: of residual and parameter changes; default
        ``distlinalg.lineax.max_norm`` (over every rank's entries).
      linear_solver: a ``distlinalg.lineax.NormalCG`` (default rtol 1e-6: reachable in
        float32; pass a tighter one for float64 fits).
      verbose: False, or a callable (optimistix's ``verbose``; the loss it
        is given is this rank's share).

    Use with ``optimistix.least_squares``; derivatives of the solution go
    through :class:`ImplicitAdjoint`, which ``optimistix.least_squares``
    picks for this solver (see :func:`least_squares`).

    Example:
      >>> import jax.numpy as jnp
      >>> import optimistix as optx
      >>> import distlinalg.lineax as dlx
      >>> from distlinalg import comm
      >>> t = jnp.linspace(0.0, 1.0, 4) + comm.rank()           # this rank's points
      >>> def residuals(p, t):
      ...     return p[0] * jnp.exp(p[1] * t) - 2.0 * jnp.exp(-0.5 * t)
      >>> fit = dlx.least_squares(residuals, dlx.LevenbergMarquardt(1e-6, 1e-6), jnp.array([1.0, 0.0]),
      ...                         args=t, max_steps=100)
      >>> bool(jnp.allclose(fit.value, jnp.array([2.0, -0.5]), atol=1e-4))   # the same on every rank
      True
    """

    def __init__(self, rtol: float, atol: float, norm: Callable = None, linear_solver: Any = None,
                 verbose: Any = False):
        _set_fields(self, rtol, atol, norm, linear_solver, verbose,
                    lambda solver: DampedNewtonDescent(linear_solver=solver))


class IndirectLevenbergMarquardt(optx.IndirectLevenbergMarquardt):
    """``optimistix.IndirectLevenbergMarquardt`` over every rank's residuals
    (:class:`IndirectDampedNewtonDescent`, :class:`TrustRegion`). Arguments
    as :class:`LevenbergMarquardt`, plus optimistix's `lambda_0` and
    `root_finder`.

    Example:
      >>> import jax.numpy as jnp
      >>> import optimistix as optx
      >>> import distlinalg.lineax as dlx
      >>> from distlinalg import comm
      >>> t = jnp.linspace(0.0, 1.0, 4) + comm.rank()
      >>> fit = dlx.least_squares(lambda p, t: p[0] * jnp.exp(p[1] * t) - 2.0 * jnp.exp(-0.5 * t),
      ...                         dlx.IndirectLevenbergMarquardt(1e-6, 1e-6), jnp.array([1.0, 0.0]),
      ...                         args=t, max_steps=100)
      >>> bool(jnp.allclose(fit.value, jnp.array([2.0, -0.5]), atol=1e-4))
      True
    """

    def __init__(self, rtol: float, atol: float, norm: Callable = None, lambda_0: float = 1.0,
                 linear_solver: Any = None, root_finder: Any = None, verbose: Any = False):
        _set_fields(self, rtol, atol, norm, linear_solver, verbose,
                    lambda solver: IndirectDampedNewtonDescent(
                        lambda_0=lambda_0, linear_solver=solver,
                        root_finder=root_finder or optx.Newton(rtol=1e-2, atol=1e-2)))


class Dogleg(optx.Dogleg):
    """``optimistix.Dogleg`` over every rank's residuals (:class:`DoglegDescent`,
    :class:`TrustRegion`). Arguments as :class:`LevenbergMarquardt`.

    Example:
      >>> import jax.numpy as jnp
      >>> import optimistix as optx
      >>> import distlinalg.lineax as dlx
      >>> from distlinalg import comm
      >>> t = jnp.linspace(0.0, 1.0, 4) + comm.rank()
      >>> fit = dlx.least_squares(lambda p, t: p[0] * jnp.exp(p[1] * t) - 2.0 * jnp.exp(-0.5 * t),
      ...                         dlx.Dogleg(1e-6, 1e-6), jnp.array([1.0, 0.0]), args=t, max_steps=100)
      >>> bool(jnp.allclose(fit.value, jnp.array([2.0, -0.5]), atol=1e-4))
      True
    """

    def __init__(self, rtol: float, atol: float, norm: Callable = None, linear_solver: Any = None,
                 verbose: Any = False):
        _set_fields(self, rtol, atol, norm, linear_solver, verbose,
                    lambda solver: DoglegDescent(linear_solver=solver))


_DISTRIBUTED_SOLVERS = (GaussNewton, LevenbergMarquardt, IndirectLevenbergMarquardt, Dogleg)


# ---------------------------------------------------------------------------
# Derivatives of the solution
def _global_optimality(optimum: Any, _: Any, inputs: Any) -> Any:
    """Σ_k J_kᵀ r_k(y*): the optimality condition of every rank's residuals
    (optimistix's own is this rank's gradient alone)."""
    residual_fn, _, _, args, *_ = inputs

    def half_squares(y: Any) -> Any:
        residual, _ = residual_fn(y, args)
        return 0.5 * _sum_squares(residual)

    return tree_allreduce(jax.grad(half_squares)(optimum))


class ImplicitAdjoint(optx.ImplicitAdjoint):
    """optimistix's implicit-function-theorem adjoint for residuals over ranks.

    dy*/dθ = −H⁻¹ ∂g/∂θ with g = Σ_k J_kᵀ r_k, the gradient of every rank's
    residuals (replicated), and H its Jacobian in y: the linear solve is on
    a replicated operator whose matvec communicates (default
    ``linear_solver``: ``distlinalg.lineax.CG``, H being symmetric; lineax's
    LU works too, at O(n³) on every rank). Forward and reverse mode; for
    reverse mode of a replicated loss use ``distlinalg.ad.grad`` (docs/ad.md).

    Example:
      >>> import distlinalg.lineax as dlx
      >>> adjoint = dlx.ImplicitAdjoint()      # optimistix.least_squares(..., adjoint=adjoint)
    """

    def __init__(self, linear_solver: Any = None):
        self.linear_solver = linear_solver or dlx.MINRES(rtol=1e-12, atol=0.0)

    def apply(self, primal_fn, rewrite_fn, inputs, tags):
        return super().apply(primal_fn, _global_optimality, inputs, tags)


# ---------------------------------------------------------------------------
# optimistix.least_squares for distributed solvers
def _is_distributed_linear_solver(solver: Any) -> bool:
    return isinstance(solver, (dlx.NormalCG, dlx._KrylovSolver, dlx.Ordered))


def _is_distributed(solver: Any) -> bool:
    """A solver over ranks: one of the classes here, or one of optimistix's
    whose linear solver or norm is distlinalg's."""
    if isinstance(solver, _DISTRIBUTED_SOLVERS):
        return True
    descent = getattr(solver, "descent", None)
    return (_is_distributed_linear_solver(getattr(descent, "linear_solver", None))
            or getattr(solver, "norm", None) in (dlx.max_norm, dlx.two_norm, dlx.rms_norm))


def _global_counterpart(solver: Any) -> Any:
    """The class of this module for one of optimistix's own solvers given a
    distlinalg linear solver or norm (the same parameters), or the solver
    itself when it already decides globally; raises for one that cannot."""
    if isinstance(solver, _DISTRIBUTED_SOLVERS):
        return solver
    linear_solver = getattr(solver.descent, "linear_solver", None)
    kind = type(solver)
    common = dict(rtol=solver.rtol, atol=solver.atol, norm=solver.norm)
    if not isinstance(linear_solver, dlx.NormalCG):
        raise ValueError(
            f"distlinalg.lineax: optimistix.{kind.__name__} over ranks needs linear_solver="
            "distlinalg.lineax.NormalCG (a least-squares solve over every rank's residuals), "
            f"got {type(linear_solver).__name__}")
    if kind is optx.GaussNewton:
        return solver  # its only global decisions are the norm's and NormalCG's solve
    if kind is optx.LevenbergMarquardt:
        return LevenbergMarquardt(linear_solver=linear_solver, **common)
    if kind is optx.IndirectLevenbergMarquardt:
        return IndirectLevenbergMarquardt(lambda_0=solver.descent.lambda_0, linear_solver=linear_solver,
                                          root_finder=solver.descent.root_finder, **common)
    if kind is optx.Dogleg:
        return Dogleg(linear_solver=linear_solver, **common)
    raise ValueError(
        f"distlinalg.lineax: {kind.__name__} with distlinalg's linear solver or norm: its decisions would be "
        "taken from this rank's residuals. Use distlinalg.lineax.GaussNewton, LevenbergMarquardt, "
        "IndirectLevenbergMarquardt or Dogleg, or build yours from TrustRegion and the descents there")


# optimistix's own function (also when this module is imported again).
_optx_least_squares = getattr(optx.least_squares, "optimistix_least_squares", optx.least_squares)


def least_squares(fn: Any, solver: Any, y0: Any, args: Any = None, options: Any = None, **kwargs: Any) -> Any:
    """``optimistix.least_squares`` for residuals sharded over ranks.

    For a solver over ranks (the classes of ``distlinalg.lineax``, or
    optimistix's own given a distlinalg linear solver or norm):

    * optimistix's ``LevenbergMarquardt``, ``IndirectLevenbergMarquardt``
      and ``Dogleg`` with ``linear_solver=dlx.NormalCG(...)`` run as
      ``dlx.LevenbergMarquardt`` … with the same parameters; other
      compositions raise (on every rank, before anything runs);
    * ``adjoint=optimistix.ImplicitAdjoint(...)`` (the default) becomes
      :class:`ImplicitAdjoint` with the same linear solver (lineax's
      ``AutoLinearSolver`` default: distlinalg's MINRES), so the
      derivatives are those of every rank's residuals.

    Any other solver is optimistix's call, unchanged. ``optimistix.least_squares``
    becomes this function only by :func:`install_least_squares`; without it,
    distlinalg's pieces inside optimistix's own ``least_squares`` raise.

    Example:
      >>> import jax.numpy as jnp
      >>> import optimistix as optx
      >>> import distlinalg.lineax as dlx
      >>> from distlinalg import comm
      >>> t = jnp.linspace(0.0, 1.0, 4) + comm.rank()
      >>> solver = optx.LevenbergMarquardt(1e-6, 1e-6, norm=dlx.max_norm,
      ...                                 linear_solver=dlx.NormalCG(rtol=1e-6, atol=0.0))
      >>> fit = dlx.least_squares(lambda p, t: p[0] * jnp.exp(p[1] * t) - 2.0 * jnp.exp(-0.5 * t),
      ...                         solver, jnp.array([1.0, 0.0]), args=t, max_steps=100)
      >>> bool(jnp.allclose(fit.value, jnp.array([2.0, -0.5]), atol=1e-4))
      True
    """
    if isinstance(solver, optx.AbstractMinimiser) and _is_distributed(solver):
        raise ValueError(
            f"distlinalg.lineax: optimistix.least_squares with the minimiser {type(solver).__name__} minimises "
            "½‖r‖² of this rank's residuals. Use distlinalg.lineax.GaussNewton, LevenbergMarquardt, "
            "IndirectLevenbergMarquardt or Dogleg, or optimistix.minimise on a loss reduced over ranks")
    if isinstance(solver, optx.AbstractLeastSquaresSolver) and _is_distributed(solver):
        solver = _global_counterpart(solver)
        adjoint = kwargs.get("adjoint", optx.ImplicitAdjoint())
        if type(adjoint) is optx.ImplicitAdjoint:
            linear_solver = adjoint.linear_solver
            if isinstance(linear_solver, lx.AutoLinearSolver):
                linear_solver = None
            kwargs["adjoint"] = ImplicitAdjoint(linear_solver)
    return _optx_least_squares(fn, solver, y0, args, options, **kwargs)


least_squares.optimistix_least_squares = _optx_least_squares
dlx.ROUTING_CODES.add(least_squares.__code__)


def install_least_squares() -> None:
    """Make ``optimistix.least_squares`` distlinalg's :func:`least_squares`, for this process.

    Importing ``distlinalg.lineax`` changes nothing in optimistix; this call
    does (row ``optimistix-least-squares`` of the patch table, ``python -m
    distlinalg``), for scripts that call ``optimistix.least_squares`` with
    distlinalg's solvers and norms. Idempotent. Code that bound the function
    itself earlier (``from optimistix import least_squares``) keeps
    optimistix's, and, given distlinalg's pieces, raises at trace time.

    Example:
      >>> import jax.numpy as jnp
      >>> import optimistix as optx
      >>> import distlinalg.lineax as dlx
      >>> from distlinalg import comm
      >>> dlx.install_least_squares()
      >>> t = jnp.linspace(0.0, 1.0, 4) + comm.rank()
      >>> fit = dlx.least_squares(lambda p, t: p[0] + p[1] * t - (1 + 0.5 * t), dlx.GaussNewton(1e-6, 1e-6),
      ...                         jnp.zeros(2), args=t)
      >>> bool(jnp.allclose(fit.value, jnp.array([1.0, 0.5]), atol=1e-4))
      True
    """
    import optimistix._least_squares as module

    from .._runtime import patches

    patches.warn_outside_checked("optimistix")
    optx.least_squares = least_squares
    module.least_squares = least_squares
    patches.record("optimistix-least-squares", "applied")
