"""distlinalg.lineax's operators, Krylov solvers and norms (the package docstring says what maps to what)."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Any, Callable, Iterator

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx

from .._runtime import jax_names
from .. import solvers as _solvers
from .._runtime.mpi import resolve_comm
from ..solvers import _arguments
from ..comm._core import lowering_without_mpi_token
from ..comm.allreduce import allreduce
from ..comm.fused import tree_allreduce
from ..operators import LinearOperator, aslinearoperator
from ..solvers import Reason

__all__ = [
    "DistributedOperator",
    "operator",
    "CG",
    "MINRES",
    "GMRES",
    "BiCGStab",
    "NormalCG",
    "Ordered",
    "result_of",
    "layout_of",
    "distributed_parts",
    "max_norm",
    "rms_norm",
    "two_norm",
]


# ---------------------------------------------------------------------------
# The operator
def _symmetric(op: LinearOperator) -> bool:
    """Symmetric in lineax's sense (Aᵀ = A, unconjugated)."""
    complex_input = any(jnp.issubdtype(s.dtype, jnp.complexfloating)
                        for s in jax.tree_util.tree_leaves(op.input_structure))
    return op.symmetric or (op.hermitian and not op.real_linear and not complex_input)


class DistributedOperator(lx.AbstractLinearOperator):
    """A distlinalg operator as a lineax operator.

    Args:
      operator: a :class:`distlinalg.operators.LinearOperator` (or anything
        :func:`~distlinalg.operators.aslinearoperator` accepts), in either
        layout; vectors are this rank's pieces (whole vectors when
        replicated, this rank's block when sharded).
      tags: extra lineax tags, e.g. ``lineax.positive_semidefinite_tag``
        (which ``lineax.CG`` requires). ``lineax.symmetric_tag`` is added
        when the operator is symmetric (or real and Hermitian).

    Pytree: an equinox module whose child is the distlinalg operator (a
    pytree whose children are its arrays), so it crosses ``jit`` and
    lineax's primitive like any lineax operator.

    AD: lineax differentiates a solve through ``mv`` and ``transpose()``:
    the matvec's collectives have exact transpose rules, and
    ``transpose()`` is distlinalg's ``.T`` (the matrix transpose on every
    rank, also in the replicated layout).

    Example:
      >>> import jax.numpy as jnp
      >>> import lineax as lx
      >>> import distlinalg.lineax as dlx
      >>> from distlinalg import comm, operators
      >>> lap = operators.laplacian_2d(4)            # 16 unknowns; grid rows split over the ranks
      >>> A = dlx.DistributedOperator(lap, lx.positive_semidefinite_tag)
      >>> A.layout, lx.is_symmetric(A)
      ('sharded', True)
      >>> b = jnp.ones(lap.input_structure.shape)     # this rank's block of b
      >>> sol = lx.linear_solve(A, b, solver=dlx.CG(rtol=1e-6, atol=0.0))
      >>> bool(dlx.two_norm(A.mv(sol.value) - b) < 1e-4 * dlx.two_norm(b))   # norms over every rank
      True
      >>> B = dlx.operator(jnp.array([[1.0, 2.0], [3.0, 4.0]]))   # a replicated matrix
      >>> B.transpose().as_matrix().tolist()
      [[1.0, 3.0], [2.0, 4.0]]
    """

    operator: LinearOperator
    tags: frozenset = eqx.field(static=True)

    def __init__(self, operator: Any, tags: Any = ()):
        op = aslinearoperator(operator)
        if op.input_structure is None:
            raise ValueError("distlinalg.lineax: the operator needs input_structure (lineax asks for it)")
        _check_no_hidden_tracers(op)
        self.operator = op
        tags = frozenset(tags) if isinstance(tags, (tuple, list, set, frozenset)) else frozenset([tags])
        if _symmetric(op):
            tags = tags | {lx.symmetric_tag}
        self.tags = tags

    @property
    def layout(self) -> str:
        return self.operator.layout

    def mv(self, vector: Any) -> Any:
        """A v (this rank's piece of it).

        Raises ValueError when one of lineax's own solvers (lineax.CG, GMRES,
        Normal, …) applies a sharded operator: their inner products would be
        this rank's alone (use :class:`CG`, :class:`MINRES`, … instead).
        """
        if lowering_without_mpi_token() and self.layout == "sharded" and not _in_distlinalg_solve():
            raise ValueError(_LINEAX_SOLVER_ON_SHARDED)
        return self.operator.matvec(vector)

    def as_matrix(self) -> jax.Array:
        """The global matrix (replicated layout; identical on every rank)."""
        op = self.operator
        if op.layout != "replicated" or op.real_linear:
            raise NotImplementedError(
                "distlinalg.lineax: as_matrix needs a replicated, complex-linear operator (a sharded "
                "operator has no matrix on one rank); use distlinalg.lineax.CG/MINRES/GMRES/BiCGStab")
        return op.to_dense()

    def transpose(self) -> "DistributedOperator":
        """Aᵀ: distlinalg's ``.T`` (see :attr:`LinearOperator.T`)."""
        if lx.symmetric_tag in self.tags:
            return self
        return DistributedOperator(self.operator.T, lx.transpose_tags(self.tags))

    def in_structure(self) -> Any:
        return self.operator.input_structure

    def out_structure(self) -> Any:
        return self.operator.output_structure


_LINEAX_SOLVER_ON_SHARDED = (
    "distlinalg.lineax: one of lineax's own solvers is applying a sharded DistributedOperator; its inner "
    "products and norms would be this rank's alone (a wrong answer). Use distlinalg.lineax.CG, MINRES, GMRES, "
    "BiCGStab or NormalCG, whose reductions run over every rank")

# Set while a distlinalg solver traces its solve (inside lineax's primitive):
# the operators it applies are reduced over every rank by that solver.
_solve_state = threading.local()


def _in_distlinalg_solve() -> bool:
    return getattr(_solve_state, "depth", 0) > 0


@contextlib.contextmanager
def _distlinalg_solve() -> Iterator[None]:
    _solve_state.depth = getattr(_solve_state, "depth", 0) + 1
    try:
        with _arguments.inside_library_internals():
            yield
    finally:
        _solve_state.depth -= 1


def _check_no_hidden_tracers(op: LinearOperator) -> None:
    """lineax moves operators through its primitive as pytrees: a traced value
    the matvec closes over (instead of holding it as a child) would be used
    outside its trace. Caught here, at trace time, on every rank alike.
    (Children that are not arrays, e.g. the functions inside a lineax
    operator carried as data, stay where they are.)"""
    arrays, rest = eqx.partition(op, eqx.is_array)
    example = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), op.input_structure)
    consts = jax.make_jaxpr(lambda a, v: eqx.combine(a, rest).matvec(v))(arrays, example).consts
    if any(isinstance(c, jax.core.Tracer) for c in consts):
        raise ValueError(
            f"distlinalg.lineax: the matvec of {op.name} closes over a traced value; give the operator its "
            "arrays as children (LinearOperator(matvec, data=...), matvec(data, v)) so that lineax can trace them")


def operator(A: Any, *tags: Any) -> DistributedOperator:
    """``DistributedOperator(A, tags)``: a distlinalg operator for lineax.

    Example:
      >>> import jax.numpy as jnp
      >>> import lineax as lx
      >>> import distlinalg.lineax as dlx
      >>> from distlinalg import comm, operators
      >>> A = dlx.operator(operators.laplacian_2d(4), lx.positive_semidefinite_tag)
      >>> isinstance(A, dlx.DistributedOperator), lx.is_positive_semidefinite(A)
      (True, True)
    """
    return DistributedOperator(A, frozenset(tags))


def _conjugate(op: DistributedOperator) -> DistributedOperator:
    inner = op.operator
    if not any(jnp.issubdtype(s.dtype, jnp.complexfloating) for s in jax.tree_util.tree_leaves(inner.input_structure)):
        return op
    return DistributedOperator(inner.conj(), op.tags)


def _flat_diagonal(op: DistributedOperator) -> jax.Array:
    return jax.flatten_util.ravel_pytree(op.operator.diagonal())[0]


def _register() -> None:
    """Answer lineax's per-type questions (singledispatch) for DistributedOperator."""
    import jax.flatten_util  # noqa: F401  (used by _flat_diagonal)

    lx.linearise.register(DistributedOperator)(lambda op: op)
    lx.materialise.register(DistributedOperator)(lambda op: op)
    lx.diagonal.register(DistributedOperator)(_flat_diagonal)
    lx.conj.register(DistributedOperator)(_conjugate)
    lx.is_symmetric.register(DistributedOperator)(lambda op: lx.symmetric_tag in op.tags)
    lx.is_positive_semidefinite.register(DistributedOperator)(
        lambda op: lx.positive_semidefinite_tag in op.tags)
    lx.is_negative_semidefinite.register(DistributedOperator)(
        lambda op: lx.negative_semidefinite_tag in op.tags)
    for question in (lx.is_diagonal, lx.is_tridiagonal, lx.has_unit_diagonal, lx.is_lower_triangular,
                     lx.is_upper_triangular):
        question.register(DistributedOperator)(lambda op: False)

    def no_tridiagonal(op: DistributedOperator) -> Any:
        raise NotImplementedError("distlinalg.lineax: DistributedOperator has no tridiagonal form")

    lx.tridiagonal.register(DistributedOperator)(no_tridiagonal)


_register()


def distributed_parts(op: Any) -> list[DistributedOperator]:
    """The :class:`DistributedOperator` s inside a lineax operator (itself, or
    those a wrapper such as ``TaggedLinearOperator``, ``AddLinearOperator``,
    ``ComposedLinearOperator`` … holds), in tree order.

    Example:
      >>> import lineax as lx
      >>> import distlinalg.lineax as dlx
      >>> from distlinalg import operators
      >>> A = dlx.operator(operators.laplacian_2d(4))
      >>> parts = dlx.distributed_parts(lx.AddLinearOperator(A, A))
      >>> len(parts), parts[0] is A
      (2, True)
    """
    return [leaf for leaf in jax.tree_util.tree_leaves(op, is_leaf=lambda x: isinstance(x, DistributedOperator))
            if isinstance(leaf, DistributedOperator)]


def layout_of(op: Any, default: str = "replicated") -> tuple[str, Any]:
    """(layout, communicator) of a lineax operator: those of the
    :class:`DistributedOperator` s it holds, `default` and distlinalg's
    communicator when it holds none.

    Raises ValueError (at trace time, on every rank: it depends only on the
    operator's structure) when the parts disagree: a sum or product of
    operators in different layouts, or on different communicators, has no
    layout of its own.

    Example:
      >>> import lineax as lx
      >>> import distlinalg.lineax as dlx
      >>> from distlinalg import operators
      >>> A = lx.TaggedLinearOperator(dlx.operator(operators.laplacian_2d(4)), lx.positive_semidefinite_tag)
      >>> dlx.layout_of(A)[0]                       # the wrapper keeps the sharded layout
      'sharded'
    """
    parts = distributed_parts(op)
    if not parts:
        return default, resolve_comm(None)
    layouts = {part.layout for part in parts}
    comms = {part.operator.comm for part in parts}
    if len(layouts) > 1:
        raise ValueError(
            f"distlinalg.lineax: {type(op).__name__} combines DistributedOperators of different layouts "
            f"({', '.join(sorted(layouts))}); a vector cannot be both this rank's block and the whole vector. "
            "Convert one of them (distlinalg.operators) before combining")
    if len(comms) > 1:
        raise ValueError(f"distlinalg.lineax: {type(op).__name__} combines DistributedOperators on different "
                         "communicators")
    return layouts.pop(), comms.pop()


def _lineax_matvec(op: Any, vector: Any) -> Any:
    return op.mv(vector)


def _as_distlinalg(op: Any, layout: str) -> LinearOperator:
    """A distlinalg operator for a lineax one: a DistributedOperator's own;
    any other lineax operator (lineax's Matrix, Function, Jacobian, Tagged,
    Add, Composed, … around DistributedOperators or not) carried as the
    operator's data, so its arrays are children that every AD mode traces,
    in the layout and communicator of the DistributedOperators it holds
    (`layout` and distlinalg's communicator when it holds none). The
    transpose is distlinalg's (``LinearOperator.T``): exact also for a
    replicated matvec that communicates."""
    if isinstance(op, DistributedOperator):
        return op.operator
    layout, comm = layout_of(op, layout)
    symmetric = bool(lx.is_symmetric(op))
    real = not any(jnp.issubdtype(s.dtype, jnp.complexfloating) for s in jax.tree_util.tree_leaves(op.in_structure()))
    # lineax's semidefinite tags mean Hermitian semidefinite; symmetric is Hermitian when real.
    hermitian = bool(lx.is_positive_semidefinite(op) or lx.is_negative_semidefinite(op)) or (symmetric and real)
    return LinearOperator(_lineax_matvec, data=op, input_structure=op.in_structure(),
                          output_structure=op.out_structure(), layout=layout, symmetric=symmetric,
                          hermitian=hermitian, comm=comm, name=f"lineax.{type(op).__name__}")


# ---------------------------------------------------------------------------
# Results
def result_of(reason: Any) -> lx.RESULTS:
    """lineax's ``RESULTS`` for a distlinalg :class:`~distlinalg.solvers.Reason` code.

    ``CONVERGED_*`` → ``successful``; ``DIVERGED_MAX_IT`` →
    ``max_steps_reached``; ``DIVERGED_NANORINF`` and the indefinite-matrix
    and indefinite-preconditioner reasons → ``singular`` (lineax turns it
    into ``nonfinite_input`` when b is not finite); ``DIVERGED_BREAKDOWN``,
    ``DIVERGED_INCONSISTENT_RANKS``, ``DIVERGED_ACCURACY_LOST`` and anything
    else → ``breakdown``. The
    exact reason is in ``solution.stats["reason"]``. Traceable.

    Example:
      >>> import lineax as lx
      >>> import distlinalg.lineax as dlx
      >>> from distlinalg.solvers import Reason
      >>> bool(dlx.result_of(int(Reason.CONVERGED_RTOL)) == lx.RESULTS.successful)
      True
      >>> bool(dlx.result_of(int(Reason.DIVERGED_MAX_IT)) == lx.RESULTS.max_steps_reached)
      True
    """
    reason = jnp.asarray(reason)
    R = lx.RESULTS
    singular = ((reason == Reason.DIVERGED_NANORINF) | (reason == Reason.DIVERGED_INDEFINITE_MAT)
                | (reason == Reason.DIVERGED_INDEFINITE_PC))
    out = R.where(reason == Reason.DIVERGED_MAX_IT, R.max_steps_reached, R.breakdown)
    out = R.where(singular, R.singular, out)
    return R.where(reason > 0, R.successful, out)


# ---------------------------------------------------------------------------
# Solvers
class _KrylovSolver(lx.AbstractLinearSolver):
    """What distlinalg's Krylov solvers share as lineax solvers.

    ``options``: ``"y0"`` (initial guess), ``"preconditioner"`` (a lineax
    operator or a callable applied as M ≈ A⁻¹).
    """

    rtol: float
    atol: float
    max_steps: int | None = None
    layout: str = eqx.field(static=True, default="replicated")
    verify_residual: bool = eqx.field(static=True, default=True)

    def _solve(self, A: LinearOperator, b: Any, x0: Any, M: Any) -> Any:
        raise NotImplementedError

    def init(self, operator: Any, options: dict[str, Any]) -> Any:
        if operator.in_structure() is None or jax.tree_util.tree_structure(operator.in_structure()) != \
                jax.tree_util.tree_structure(operator.out_structure()):
            raise ValueError(f"distlinalg.lineax.{type(self).__name__}: the operator must be square "
                             "(use NormalCG for least squares)")
        layout_of(operator, self.layout)  # parts in different layouts raise here, at trace time
        return operator

    def compute(self, state: Any, vector: Any, options: dict[str, Any]) -> tuple[Any, lx.RESULTS, dict]:
        x0 = options.get("y0")
        precond = options.get("preconditioner")

        def solve(operator: Any, vector: Any, x0: Any, precond: Any) -> Any:
            A = _as_distlinalg(operator, self.layout)
            M = None if precond is None else (precond.mv if isinstance(precond, lx.AbstractLinearOperator)
                                              else precond)
            with _distlinalg_solve():
                x, info = self._solve(A, vector, x0, M)
            return x, info.reason, info.iterations, info.residual_norm

        x, reason, iterations, residual_norm = solve(state, vector, x0, precond)
        stats = {"num_steps": iterations, "residual_norm": residual_norm, "reason": reason}
        if self.max_steps is not None:
            stats["max_steps"] = self.max_steps
        return x, result_of(reason), stats

    def transpose(self, state: Any, options: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        # distlinalg's transpose: the matrix transpose on every rank, also
        # for a replicated operator whose matvec communicates (lineax's own
        # would be each rank's share of the adjoint there).
        op = state if isinstance(state, DistributedOperator) else DistributedOperator(
            _as_distlinalg(state, self.layout))
        out = {k: v for k, v in options.items() if k != "y0"}
        if "preconditioner" in out and isinstance(out["preconditioner"], lx.AbstractLinearOperator):
            out["preconditioner"] = out["preconditioner"].transpose()
        return op.transpose(), out

    def conj(self, state: Any, options: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        out = {k: v for k, v in options.items() if k != "y0"}
        if "preconditioner" in out and isinstance(out["preconditioner"], lx.AbstractLinearOperator):
            out["preconditioner"] = lx.conj(out["preconditioner"])
        return lx.conj(state), out

    def assume_full_rank(self) -> bool:
        return True


class CG(_KrylovSolver):
    """``distlinalg.cg`` as a lineax solver (Hermitian positive definite A).

    Args:
      rtol, atol: stop when ‖r‖ ≤ max(rtol ‖b‖, atol) (global norms).
      max_steps: iteration limit (None: distlinalg's default).
      layout: layout of a plain lineax operator ("replicated" or "sharded");
        a :class:`DistributedOperator` brings its own.
      method: ``"standard"``, ``"single_reduction"`` or ``"pipelined"`` (see
        :func:`distlinalg.solvers.cg`).
      verify_residual: check a converged claim against the true residual
        (default; see :func:`distlinalg.solvers.cg`).

    Shapes: b and the solution are this rank's pieces (layout). The
    solution's ``stats`` hold ``num_steps``, ``residual_norm`` and
    ``reason`` (distlinalg's code); ``result`` is :func:`result_of` it.
    AD: lineax's rules (forward and reverse mode through ``linear_solve``,
    with the transposed solve on distlinalg's transpose).

    Example:
      A replicated operator whose matvec communicates: rank r holds a share of S.

      >>> import jax.numpy as jnp
      >>> import lineax as lx
      >>> import distlinalg.lineax as dlx
      >>> from distlinalg import comm, operators
      >>> S = jnp.array([[4.0, 1.0], [1.0, 3.0]])
      >>> share = S / comm.size()
      >>> op = operators.LinearOperator(lambda v: comm.allreduce(share @ v), input_structure=jnp.zeros(2),
      ...                               symmetric=True, hermitian=True)
      >>> b = jnp.array([1.0, 2.0])
      >>> sol = lx.linear_solve(dlx.operator(op, lx.positive_semidefinite_tag), b,
      ...                       solver=dlx.CG(rtol=1e-6, atol=0.0))
      >>> bool(jnp.allclose(S @ sol.value, b, atol=1e-4)), bool(sol.result == lx.RESULTS.successful)
      (True, True)
      >>> int(sol.stats["num_steps"]) <= 2           # identical on every rank
      True
    """

    method: str = eqx.field(static=True, default="standard")

    def _solve(self, A: LinearOperator, b: Any, x0: Any, M: Any) -> Any:
        return _solvers.cg(A, b, x0, rtol=self.rtol, atol=self.atol, maxiter=self.max_steps, M=M,
                           method=self.method, verify_residual=self.verify_residual)


class MINRES(_KrylovSolver):
    """``distlinalg.minres`` as a lineax solver (Hermitian, possibly
    indefinite A; solves (A − shift I) x = b). Arguments as :class:`CG`.

    Example:
      >>> import jax.numpy as jnp
      >>> import lineax as lx
      >>> import distlinalg.lineax as dlx
      >>> from distlinalg import comm, operators
      >>> M = jnp.array([[2.0, 1.0], [1.0, -1.0]])          # symmetric, indefinite
      >>> op = operators.LinearOperator(lambda M, v: M @ v, data=M, input_structure=jnp.zeros(2),
      ...                               symmetric=True, hermitian=True)
      >>> sol = lx.linear_solve(dlx.operator(op), jnp.array([1.0, 0.0]), solver=dlx.MINRES(rtol=1e-6, atol=0.0))
      >>> bool(jnp.allclose(M @ sol.value, jnp.array([1.0, 0.0]), atol=1e-4))
      True
    """

    shift: float = 0.0

    def __check_init__(self) -> None:
        if jax_names.carries_tangent(self.shift):
            # lineax's linear_solve treats its solver as constant (and raises
            # "Unexpected tangent" for a differentiated one).
            raise ValueError(
                "distlinalg.lineax.MINRES: the shift is being differentiated, and lineax's linear_solve does not "
                "differentiate its solver's fields. Put the shift in the operator instead "
                "(lx.AddLinearOperator(A, -shift * lx.IdentityLinearOperator(...)), or distlinalg's "
                "A - shift * I), or call distlinalg.minres(A, b, shift=shift), which differentiates it")

    def _solve(self, A: LinearOperator, b: Any, x0: Any, M: Any) -> Any:
        return _solvers.minres(A, b, x0, shift=self.shift, rtol=self.rtol, atol=self.atol,
                               maxiter=self.max_steps, M=M, verify_residual=self.verify_residual)


class GMRES(_KrylovSolver):
    """``distlinalg.gmres`` as a lineax solver (general square A); `restart`
    is the Krylov dimension per cycle. Arguments as :class:`CG`.

    Example:
      >>> import jax.numpy as jnp
      >>> import lineax as lx
      >>> import distlinalg.lineax as dlx
      >>> from distlinalg import comm, operators
      >>> M = jnp.array([[3.0, 1.0], [0.0, 2.0]])           # nonsymmetric
      >>> sol = lx.linear_solve(dlx.operator(M), jnp.array([1.0, 1.0]),
      ...                       solver=dlx.GMRES(rtol=1e-6, atol=0.0, restart=2))
      >>> bool(jnp.allclose(M @ sol.value, 1.0, atol=1e-4))
      True
    """

    restart: int = eqx.field(static=True, default=20)

    def _solve(self, A: LinearOperator, b: Any, x0: Any, M: Any) -> Any:
        import distlinalg

        return distlinalg.gmres(A, b, x0, rtol=self.rtol, atol=self.atol, restart=self.restart,
                                maxiter=self.max_steps, M=M, verify_residual=self.verify_residual)


class BiCGStab(_KrylovSolver):
    """``distlinalg.bicgstab`` as a lineax solver (general square A).
    Arguments as :class:`CG`.

    Example:
      >>> import jax.numpy as jnp
      >>> import lineax as lx
      >>> import distlinalg.lineax as dlx
      >>> from distlinalg import comm, operators
      >>> M = jnp.array([[3.0, 1.0], [0.0, 2.0]])           # nonsymmetric
      >>> sol = lx.linear_solve(dlx.operator(M), jnp.array([1.0, 1.0]), solver=dlx.BiCGStab(rtol=1e-6, atol=0.0))
      >>> bool(jnp.allclose(M @ sol.value, 1.0, atol=1e-4))
      True
    """

    def _solve(self, A: LinearOperator, b: Any, x0: Any, M: Any) -> Any:
        import distlinalg

        return distlinalg.bicgstab(A, b, x0, rtol=self.rtol, atol=self.atol, maxiter=self.max_steps, M=M,
                                   verify_residual=self.verify_residual)


class NormalCG(lx.AbstractLinearSolver):
    """Least squares min ‖A x − b‖₂ over every rank's rows, by CG on AᵀA x = Aᵀb.

    For the Jacobian of residuals of sharded data (optimistix's
    Gauss–Newton step): A maps unknowns in `input_layout` (default
    replicated: parameters every rank holds) to residuals in
    `output_layout` (default sharded: this rank's data). Aᵀ is the
    distributed transpose: the whole-program adjoint of ``A.mv`` summed over
    ranks for replicated unknowns (and divided by the number of ranks for
    replicated residuals). AᵀA is then solved by ``distlinalg.cg`` in
    `input_layout` (one allreduce per matvec with replicated unknowns).

    Args:
      rtol, atol: on the normal equations' residual ‖Aᵀ(b − A x)‖.
      max_steps: iteration limit (None: distlinalg's default).
      input_layout, output_layout: "replicated" or "sharded".

    Not differentiable through lineax's least-squares rules (raises);
    optimistix differentiates its fixed point, not the inner solves.

    Example:
      A straight line y = a + b t fitted to every rank's points; the unknowns (a, b) are
      replicated, the rows (residuals) sharded:

      >>> import jax.numpy as jnp
      >>> import lineax as lx
      >>> import distlinalg.lineax as dlx
      >>> from distlinalg import comm, operators
      >>> t = jnp.array([0.0, 1.0]) + 2 * comm.rank()          # this rank's points
      >>> J = jnp.stack([jnp.ones(2), t], axis=1)                # its rows of the design matrix
      >>> sol = lx.linear_solve(lx.MatrixLinearOperator(J), 1.0 + 0.5 * t,
      ...                       solver=dlx.NormalCG(rtol=1e-6, atol=0.0))
      >>> bool(jnp.allclose(sol.value, jnp.array([1.0, 0.5]), atol=1e-3))   # the same on every rank
      True
    """

    rtol: float
    atol: float
    max_steps: int | None = None
    input_layout: str = eqx.field(static=True, default="replicated")
    output_layout: str = eqx.field(static=True, default="sharded")

    def init(self, operator: Any, options: dict[str, Any]) -> Any:
        check_least_squares_route("distlinalg.lineax.NormalCG")
        return operator

    def compute(self, state: Any, vector: Any, options: dict[str, Any]) -> tuple[Any, lx.RESULTS, dict]:
        def solve(operator: Any, vector: Any) -> Any:
            transpose = _distributed_transpose(operator, self.input_layout, self.output_layout)
            normal = LinearOperator(lambda v: transpose(operator.mv(v)), input_structure=operator.in_structure(),
                                    layout=self.input_layout, symmetric=True, hermitian=True,
                                    comm=layout_of(operator)[1])
            with _distlinalg_solve():
                x, info = _solvers.cg(normal, transpose(vector), rtol=self.rtol, atol=self.atol,
                                      maxiter=self.max_steps)
            return x, info.reason, info.iterations, info.residual_norm

        x, reason, iterations, residual_norm = solve(state, vector)
        stats = {"num_steps": iterations, "residual_norm": residual_norm, "reason": reason}
        return x, result_of(reason), stats

    def transpose(self, state: Any, options: dict[str, Any]) -> Any:
        raise NotImplementedError("distlinalg.lineax.NormalCG: gradients through least-squares solves are "
                                  "not supported")

    def conj(self, state: Any, options: dict[str, Any]) -> Any:
        return lx.conj(state), options

    def assume_full_rank(self) -> bool:
        return True


def _distributed_transpose(op: Any, input_layout: str, output_layout: str) -> Callable[[Any], Any]:
    """w ↦ Aᵀ w for a lineax operator with the given layouts (see NormalCG)."""
    if isinstance(op, DistributedOperator):
        return op.operator.transpose_matvec
    transpose_of = jax.linear_transpose(op.mv, op.in_structure())
    comm = layout_of(op)[1]

    def apply(w: Any) -> Any:
        if output_layout == "replicated" and comm.size > 1:
            w = jax.tree_util.tree_map(lambda x: x / comm.size, w)
        (x,) = transpose_of(w)
        if input_layout == "replicated" and comm.size > 1:
            x = tree_allreduce(x, comm=comm)
        return x

    return apply


class Ordered(lx.AbstractLinearSolver):
    """Any lineax solver, refused on sharded operators: for lineax's own
    solvers (``lineax.CG``, ``lineax.GMRES``, …) on an operator whose
    matvec calls distlinalg collectives but is not a
    :class:`DistributedOperator` (e.g. a ``lineax.FunctionLinearOperator``).

    Since ``import distlinalg.lineax`` makes lineax's solve carry the
    program's MPI token (docs/lineax.md), such a solve also works without
    this wrapper; what the wrapper adds is the check that the operator is
    not sharded: lineax's own solvers use local inner products, which would
    be this rank's alone.

    Example:
      lineax's own CG on a plain lineax operator whose matvec calls a collective:

      >>> import jax.numpy as jnp
      >>> import lineax as lx
      >>> import distlinalg.lineax as dlx
      >>> from distlinalg import comm, operators
      >>> import jax
      >>> S = jnp.array([[4.0, 1.0], [1.0, 3.0]])
      >>> share = S / comm.size()
      >>> op = lx.FunctionLinearOperator(lambda v: comm.allreduce(share @ v),
      ...                                jax.ShapeDtypeStruct((2,), jnp.float32), lx.positive_semidefinite_tag)
      >>> b = jnp.array([1.0, 2.0])
      >>> sol = lx.linear_solve(op, b, solver=dlx.Ordered(lx.CG(rtol=1e-6, atol=1e-6)))
      >>> bool(jnp.allclose(S @ sol.value, b, atol=1e-4))
      True
    """

    solver: lx.AbstractLinearSolver

    def init(self, operator: Any, options: dict[str, Any]) -> Any:
        if layout_of(operator)[0] == "sharded":
            raise ValueError(_LINEAX_SOLVER_ON_SHARDED)
        return self.solver.init(operator, options)

    def compute(self, state: Any, vector: Any, options: dict[str, Any]) -> Any:
        return self.solver.compute(state, vector, options)

    def transpose(self, state: Any, options: dict[str, Any]) -> Any:
        return self.solver.transpose(state, options)

    def conj(self, state: Any, options: dict[str, Any]) -> Any:
        return self.solver.conj(state, options)

    def assume_full_rank(self) -> bool:
        return self.solver.assume_full_rank()


# ---------------------------------------------------------------------------
# optimistix.least_squares without distlinalg's routing
#
# optimistix's least_squares given distlinalg's pieces (a NormalCG, a norm over ranks, the
# global solvers) runs, but takes rank-local decisions or derivatives: optimistix's own
# damped solvers count the damping rows on every rank, its ImplicitAdjoint uses this rank's
# optimality condition. distlinalg.lineax.least_squares routes them; optimistix.least_squares
# becomes it only by an explicit install_least_squares(). Until then, a distlinalg piece
# traced inside optimistix's least_squares (and not inside distlinalg's) raises, on every
# rank alike (the ranks trace the same program), instead of computing quietly from one
# rank's residuals.
ROUTING_CODES: set[Any] = set()  # the code of distlinalg.lineax.least_squares (lineax/_optimistix.py)
_OPTIMISTIX_LEAST_SQUARES = os.path.join("optimistix", "_least_squares.py")


def check_least_squares_route(piece: str) -> None:
    """Raise if this trace is inside ``optimistix.least_squares`` but not distlinalg's."""
    frame = sys._getframe(1)
    inside_optimistix = False
    while frame is not None:
        code = frame.f_code
        if code in ROUTING_CODES:
            return
        if code.co_name == "least_squares" and code.co_filename.endswith(_OPTIMISTIX_LEAST_SQUARES):
            inside_optimistix = True
        frame = frame.f_back
    if inside_optimistix:
        raise ValueError(
            f"distlinalg.lineax: {piece} inside optimistix.least_squares, which would take its decisions and "
            "derivatives from this rank's residuals. Call distlinalg.lineax.least_squares(...) with the same "
            "arguments, or distlinalg.lineax.install_least_squares() once to make optimistix.least_squares it")


# ---------------------------------------------------------------------------
# optimistix norms over every rank's entries
def max_norm(tree: Any) -> Any:
    """max ``|x_i|`` over every rank's entries (replicated values count once:
    the maximum is the same). For optimistix's ``norm=`` with sharded
    residuals, so every rank takes the same termination decision.

    Example:
      >>> import jax.numpy as jnp
      >>> import distlinalg.lineax as dlx
      >>> from distlinalg import comm
      >>> x = {"a": jnp.array([1.0, -2.0 - comm.rank()]), "b": jnp.zeros(3)}   # this rank's entries
      >>> float(dlx.max_norm(x)) == 1.0 + comm.size()
      True
    """
    check_least_squares_route("distlinalg.lineax.max_norm")
    leaves = [jnp.max(jnp.abs(x), initial=0.0) for x in jax.tree_util.tree_leaves(tree)]
    local = jnp.max(jnp.stack(leaves)) if leaves else jnp.zeros(())
    return allreduce(local, "max")


def two_norm(tree: Any) -> Any:
    """‖x‖₂ over every rank's entries of a *sharded* vector (one allreduce).

    Example:
      >>> import jax.numpy as jnp
      >>> import distlinalg.lineax as dlx
      >>> from distlinalg import comm
      >>> bool(jnp.isclose(dlx.two_norm(jnp.ones(4)), 2 * comm.size() ** 0.5))   # √(4 P)
      True
    """
    check_least_squares_route("distlinalg.lineax.two_norm")
    leaves = [jnp.sum(jnp.abs(x) ** 2) for x in jax.tree_util.tree_leaves(tree)]
    return jnp.sqrt(allreduce(sum(leaves[1:], leaves[0]) if leaves else jnp.zeros(()), "sum"))


def rms_norm(tree: Any) -> Any:
    """Root mean square over every rank's entries of a *sharded* vector.

    Example:
      >>> import jax.numpy as jnp
      >>> import distlinalg.lineax as dlx
      >>> float(dlx.rms_norm(jnp.full(3, 2.0)))
      2.0
    """
    check_least_squares_route("distlinalg.lineax.rms_norm")
    leaves = jax.tree_util.tree_leaves(tree)
    count = allreduce(jnp.asarray(float(sum(x.size for x in leaves))), "sum")
    squares = sum(jnp.sum(jnp.abs(x) ** 2) for x in leaves) if leaves else jnp.zeros(())
    return jnp.sqrt(allreduce(squares, "sum") / count)
