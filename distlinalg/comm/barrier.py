"""barrier: no rank leaves before every rank of the communicator has entered.

No inputs or outputs, hence nothing to differentiate or batch: under grad,
jvp and vmap it is bound exactly once (JAX never routes an input-free
primitive through a transformation rule). The ordered MPI effect keeps it in
program order relative to every other distlinalg operation, in eager code,
under jit and inside control flow, and keeps it from being removed as dead
code although it returns nothing.
"""

from __future__ import annotations

from typing import Any

from .._runtime.mpi import resolve_comm
from . import _core

barrier_p = _core.new_primitive("barrier", multiple_results=True)
_core.def_abstract_eval(barrier_p, lambda *, comm: [])
_core.register_lowering(
    barrier_p,
    "distlinalg_barrier",
    lambda *, comm: {"comm": _core.comm_attr(comm)},
    token_only_result=True,
    local=lambda **_: [],
)


def barrier(*, comm: Any = None) -> None:
    """Block until every rank of `comm` has called it (MPI_Barrier).

    Args:
      comm: mpi4py intracommunicator (default distlinalg's private one).

    Returns:
      None. Inside jit the barrier runs where it stands in the program,
      between the operations before and after it.

    Example:
      >>> import jax
      >>> from distlinalg import comm
      >>> comm.barrier()                  # returns once every rank has called it
      >>> @jax.jit
      ... def step(x):
      ...     comm.barrier()              # between the operations before and after it
      ...     return comm.allreduce(x)
      >>> int(step(1)) == comm.size()
      True
    """
    _core.bind(barrier_p, comm=resolve_comm(comm))
