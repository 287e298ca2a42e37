"""Where NetKet's own code meets a :class:`distlinalg.netket.MCState`.

NetKet 3.19+ has no MPI, and its SR paths compute from the samples of the
process they run in: ``nk.optimizer.SR`` calls its QGT constructor on the
state, the QGT constructors read ``vstate.samples``, and ``nk.driver.VMC_SR``
forms its matrices in ``compute_loss_and_update``. None of them offers a hook,
so :func:`install` (rows ``netket-*`` of ``distlinalg._runtime.patches.TABLE``) routes these entry points, for a distributed state only,
to the global computations of :mod:`._qgt` and :mod:`._vmc_sr` (every other
state takes NetKet's code unchanged):

* ``nk.optimizer.SR.lhs_constructor`` → the distributed QGT of the type the
  user named (as ``vstate.quantum_geometric_tensor(...)`` builds it);
* ``nk.optimizer.qgt.QGTJacobianDense``, ``QGTJacobianPyTree``, ``QGTOnTheFly``
  called on a distributed state (directly, through ``QGTAuto``, or through a
  partial made after this module was installed) → the distributed QGT;
* ``nk.driver.VMC_SR.compute_loss_and_update`` → :func:`._vmc_sr.compute_loss_and_update`
  on more than one rank (on one rank NetKet's own step is already the global one);
* every other driver built on a distributed state (TDVP, Infidelity_SR, a
  subclass that replaces ``compute_loss_and_update``) raises at construction,
  on every rank, naming what works.

What no hook reaches (a QGT partial made before distlinalg.netket.MCState was
first used, a user's own computation from ``vstate.samples``) is caught by
the state's check that its parameters stay identical on every rank.
"""

from __future__ import annotations

import functools
from typing import Any

_INSTALLED = False


def _is_distributed(vstate: Any) -> bool:
    return getattr(vstate, "_distlinalg_comm", None) is not None


def _route_qgt_constructor(wrapper: Any, kind: str) -> None:
    """Make NetKet's QGT constructor `wrapper` build the distributed QGT for a
    distributed state. NetKet's ``partial_from_kwargs`` wrapper calls (or binds
    into a partial) the function held in its closure; that function is replaced
    by one that dispatches on the state, so the name, the wrapper and every
    partial made from now on all dispatch."""
    from ._qgt import distributed_qgt

    original = wrapper.__wrapped__
    cells = [c for c in (wrapper.__closure__ or ()) if c.cell_contents is original]
    if len(cells) != 1:
        raise ImportError(f"distlinalg.netket: NetKet's {kind} is not built as this version of distlinalg expects "
                          "(netket==3.23.* is supported)")

    @functools.wraps(original)
    def dispatch(vstate: Any, *args: Any, **kwargs: Any) -> Any:
        if _is_distributed(vstate):
            if args:
                raise TypeError(f"{kind}: unexpected positional arguments {args!r}")
            return distributed_qgt(vstate, wrapper, **kwargs)
        return original(vstate, *args, **kwargs)

    dispatch._distlinalg_qgt_kind = kind
    cells[0].cell_contents = dispatch


def _route_preconditioner() -> None:
    import netket as nk

    from ._qgt import distributed_qgt

    base = nk.optimizer.SR.lhs_constructor

    @functools.wraps(base)
    def lhs_constructor(self: Any, vstate: Any, step: Any = None) -> Any:
        if not _is_distributed(vstate):
            return base(self, vstate, step)
        # NetKet's own schedule handling, then the QGT over all ranks' samples.
        shifts = {}
        for name in ("diag_shift", "diag_scale"):
            value = getattr(self, name)
            if callable(value):
                if step is None:
                    raise TypeError(f"If you use a scheduled `{name}`, you must call the preconditioner with an "
                                    "extra argument `step`.")
                value = value(step)
            shifts[name] = value
        return distributed_qgt(vstate, self.qgt_constructor, **shifts, **self.qgt_kwargs)

    nk.optimizer.SR.lhs_constructor = lhs_constructor


def _route_vmc_sr() -> None:
    import netket as nk

    from ._vmc_sr import compute_loss_and_update as distributed_step

    base = nk.driver.VMC_SR.compute_loss_and_update

    @functools.wraps(base)
    def compute_loss_and_update(self: Any) -> Any:
        # On one rank NetKet's own step is the global one (and keeps its lazy NTK).
        if _is_distributed(self.state) and self.state._distlinalg_comm.size > 1:
            return distributed_step(self)
        return base(self)

    compute_loss_and_update._distlinalg_routed = True
    nk.driver.VMC_SR.compute_loss_and_update = compute_loss_and_update


def _guard_drivers() -> None:
    """A driver on a distributed state must be one whose step is global."""
    import netket as nk
    from netket._src.driver.abstract_variational_driver import AbstractDriver

    base_init = AbstractDriver.__init__
    global_steps = (nk.driver.VMC.compute_loss_and_update, nk.driver.VMC_SR.compute_loss_and_update)

    @functools.wraps(base_init)
    def __init__(self: Any, variational_state: Any, *args: Any, **kwargs: Any) -> None:
        if _is_distributed(variational_state):
            step = getattr(type(self), "compute_loss_and_update", None)
            if step not in global_steps:
                raise NotImplementedError(
                    f"distlinalg.netket: {type(self).__name__} on a distlinalg.netket.MCState would compute from "
                    "this rank's samples only (its step is not distributed). Supported: nk.driver.VMC (with any "
                    "optimiser, nk.optimizer.SR or distlinalg.netket.SR) and nk.driver.VMC_SR, or a subclass "
                    "that keeps their compute_loss_and_update")
        base_init(self, variational_state, *args, **kwargs)

    AbstractDriver.__init__ = __init__


def install() -> None:
    """Route NetKet's SR entry points for distributed states (once per process)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from netket.optimizer import qgt as nk_qgt

    from .._runtime import patches

    patches.warn_outside_checked("netket")
    for kind in ("QGTJacobianDense", "QGTJacobianPyTree", "QGTOnTheFly"):
        _route_qgt_constructor(getattr(nk_qgt, kind), kind)
    patches.record("netket-qgt-constructors", "applied")
    _route_preconditioner()
    patches.record("netket-sr-lhs", "applied")
    _route_vmc_sr()
    patches.record("netket-vmc-sr-step", "applied")
    _guard_drivers()
    patches.record("netket-driver-guard", "applied")
    _INSTALLED = True
