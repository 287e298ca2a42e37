"""distlinalg inside lineax and optimistix: operators and Krylov solvers across ranks.

``lineax.linear_solve(op, b, solver=distlinalg.lineax.CG(rtol=..., atol=...))``
solves across ranks and returns lineax's ``Solution``, its ``result`` mapped
from distlinalg's reason (:func:`result_of`). What maps to what:

* :class:`DistributedOperator` wraps a distlinalg
  :class:`~distlinalg.operators.LinearOperator` (any layout) as a lineax
  operator: ``mv`` is the distributed matvec, ``transpose()`` distlinalg's
  ``.T`` (the matrix transpose also for replicated operators whose matvec
  communicates), tags from the operator's flags, ``as_matrix()`` the global
  matrix (replicated layout only).
* :class:`CG`, :class:`MINRES`, :class:`GMRES`, :class:`BiCGStab` run
  ``distlinalg.cg`` … on any lineax operator (a :class:`DistributedOperator`
  brings its layout; any other operator is taken in the solver's `layout`);
  :class:`NormalCG` solves least-squares problems min ‖A x − b‖ whose rows
  (residuals) are sharded and whose unknowns are replicated, the form of
  optimistix's Gauss–Newton step over sharded data.
* :class:`Ordered` runs any lineax solver (``lineax.CG``, ``lineax.GMRES``…)
  on an operator whose matvec calls distlinalg collectives, refusing sharded
  operators (lineax's own inner products would be this rank's alone).
* :func:`max_norm`, :func:`rms_norm`, :func:`two_norm`: optimistix norms over
  every rank's entries of sharded vectors, so every rank stops together.

* optimistix (when installed): :func:`least_squares` and the global
  least-squares solvers (:class:`GaussNewton`, :class:`LevenbergMarquardt`,
  :class:`IndirectLevenbergMarquardt`, :class:`Dogleg`, their searches and
  descents, :class:`ImplicitAdjoint`). ``optimistix.least_squares`` itself
  becomes distlinalg's only by :func:`install_least_squares`; without it,
  distlinalg's pieces inside optimistix's own ``least_squares`` raise.

Program order: lineax's ``linear_solve_p`` declares no effects of its own, so
JAX would lower its body without distlinalg's ordering token. Importing this
package makes it declare the MPI effect of the solve it runs
(``distlinalg/lineax/_effects.py``, row ``lineax-solve-effect`` of the patch table): the program's token flows through every
lineax solve, and the solve's collectives run in program order with every
other collective of the program on every rank, whatever each rank's local
shapes. See docs/lineax.md.

Importing this package imports lineax and equinox (``pip install
"distlinalg[lineax]"``); ``import distlinalg`` does not.
"""

from __future__ import annotations

from . import _effects
from ._linear import (
    CG,
    MINRES,
    BiCGStab,
    DistributedOperator,
    GMRES,
    NormalCG,
    Ordered,
    distributed_parts,
    layout_of,
    max_norm,
    operator,
    result_of,
    rms_norm,
    two_norm,
)
from ._linear import _KrylovSolver  # noqa: F401  (the solvers' common base, for isinstance checks)

# lineax's solve carries the program's MPI token (see above).
_effects.install()

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

try:
    import optimistix as _optimistix  # noqa: F401
except ImportError:  # lineax alone: the linear solvers above
    pass
else:
    from ._optimistix import (  # noqa: E402
        DampedNewtonDescent,
        Dogleg,
        DoglegDescent,
        GaussNewton,
        ImplicitAdjoint,
        IndirectDampedNewtonDescent,
        IndirectLevenbergMarquardt,
        LevenbergMarquardt,
        TrustRegion,
        damped_step,
        install_least_squares,
        least_squares,
    )

    __all__ += ["TrustRegion", "DampedNewtonDescent", "IndirectDampedNewtonDescent", "DoglegDescent",
                "GaussNewton", "LevenbergMarquardt", "IndirectLevenbergMarquardt", "Dogleg", "ImplicitAdjoint",
                "least_squares", "install_least_squares", "damped_step"]
