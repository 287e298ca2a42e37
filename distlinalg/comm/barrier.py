"""barrier: no rank leaves before every rank has entered.

No inputs or outputs, hence no derivative; the ordered effect keeps it in
program order relative to every other operation (also under jit, vmap,
grad: a transformation never duplicates or drops it).
"""

from __future__ import annotations

from typing import Any

from .._mpi import resolve_comm
from . import _core

barrier_p = _core.new_primitive("barrier", multiple_results=True)
_core.def_abstract_eval(barrier_p, lambda *, comm: [])
_core.register_lowering(
    barrier_p, "distlinalg_barrier", lambda *, comm: {"comm": _core.comm_attr(comm)}, token_only_result=True
)


def barrier(*, comm: Any = None) -> None:
    """Block until every rank of `comm` (default distlinalg's) has called it."""
    _core.bind(barrier_p, comm=resolve_comm(comm))
