"""lineax's ``linear_solve_p`` declares the MPI effect of the solve it runs.

Every private use of lineax and equinox internals by distlinalg's ordering
lives here. Checked on lineax 0.1.1 with equinox 0.13.8 (jax 0.10.2) and
lineax 0.1.x with equinox 0.13.x on jax 0.12.

Why. lineax's ``linear_solve_p`` is an equinox "vprim": its abstract
evaluation returns shapes only (``prim.def_abstract_eval``), and its lowering
is ``mlir.lower_fun(impl)``, which re-traces the solver and emits it with the
token set of the ``linear_solve_p`` equation. From JAX's point of view the
whole solve was a pure function, so the solve's collectives got no MPI token
from the enclosing program. distlinalg used to lower them with a token of
their own (a "detached" region), which left them unordered with the
program's other collectives: on ranks whose local shapes differ, XLA
scheduled a solve and an independent norm in different orders and the
ranks' collectives paired up wrongly (issue 57: an abort in optimistix's
Dogleg at 2 ranks, 30/60 rows).

What is replaced. The abstract evaluation of ``linear_solve_p``, and of
equinox's batching primitive ``_vprim_p`` when it carries
``linear_solve_p``, becomes one that traces the solve (as lineax's own does,
with ``eval_shape``) and declares ``MPIEffect`` when the traced solve holds
a distlinalg call. JAX then threads the program's MPI token into the
equation, ``lower_fun`` passes it to the re-traced solve, and the solve's
collectives run in program order with every other collective. Solves
without distlinalg calls declare nothing, as before. lineax's rules (JVP,
transpose, batching) bind the primitive again and so get the same effect.

``install()`` is idempotent and is called by ``import distlinalg.lineax``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax

from .._runtime import patches
from ..comm._core import MPIEffect

__all__ = ["install", "installed"]

CHECKED_ON = {"lineax": "0.1.1", "equinox": "0.13.8"}  # and the lines of patches.CHECKED_VERSIONS

_MARKER = "_distlinalg_declares_mpi_effect"


def _struct(aval: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=getattr(aval, "weak_type", False))


def _traced(impl: Any, avals: Any, params: dict[str, Any]) -> tuple[list[Any], set[Any]]:
    """The result avals of ``impl(*avals, **params)`` and the MPI effects of its body."""
    closed = jax.make_jaxpr(functools.partial(impl, **params))(*[_struct(a) for a in avals])
    return list(closed.out_avals), {e for e in closed.effects if isinstance(e, MPIEffect)}


def install() -> None:
    """Make lineax's solve primitive (and its batched form) declare the MPI effect of its body."""
    import equinox.internal._primitive as eqx_primitive  # private
    import lineax._solve as lx_solve  # private

    solve_p = lx_solve.linear_solve_p
    vprim_p = getattr(eqx_primitive, "_vprim_p", None)
    impls = getattr(eqx_primitive, "_vprim_impl_registry", None)
    if impls is None or solve_p not in impls or vprim_p is None or vprim_p not in impls:
        raise ImportError(
            "distlinalg.lineax: this lineax/equinox has no vprim registry for linear_solve_p "
            f"(checked on {CHECKED_ON}); distlinalg cannot order collectives inside lineax's solve"
        )
    if getattr(solve_p, _MARKER, False):
        return
    patches.warn_outside_checked("lineax")
    patches.warn_outside_checked("equinox")
    solve_impl = impls[solve_p]  # the impl lineax lowers with (mlir.lower_fun)
    vprim_impl = impls[vprim_p]
    vprim_abstract_eval = vprim_p.abstract_eval  # (avals, effects) of the other vprims

    def solve_abstract_eval(*avals: Any, **params: Any) -> Any:
        return _traced(solve_impl, avals, params)

    def batched_abstract_eval(*avals: Any, **params: Any) -> Any:
        if params.get("prim") is not solve_p:
            return vprim_abstract_eval(*avals, **params)
        return _traced(vprim_impl, avals, params)

    solve_p.def_effectful_abstract_eval(solve_abstract_eval)
    vprim_p.def_effectful_abstract_eval(batched_abstract_eval)
    setattr(solve_p, _MARKER, True)
    patches.record("lineax-solve-effect", "applied")


def installed() -> bool:
    """Whether :func:`install` has run in this process."""
    try:
        import lineax._solve as lx_solve  # private
    except ImportError:
        return False
    return bool(getattr(lx_solve.linear_solve_p, _MARKER, False))
