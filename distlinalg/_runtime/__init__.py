"""distlinalg's ground floor: what it sets up in the process before any array moves.

* ``env``: the ``DISTLINALG_*`` switches, read one way (docs/cluster.md lists them all).
* ``jax_names``: read-only uses of JAX names outside its public surface.
* ``patches``: the table of every change made to another library (JAX, XLA,
  OpenBLAS, NetKet, lineax, optimistix), with the versions it was checked on,
  and the JAX rows' code.
* ``xla_flags``: the XLA flags set before JAX's backend starts.
* ``mpi``: MPI's initialisation, the native handlers, communicators and argument checks.
* ``cpu`` / ``cuda``: each rank's share of a node's cores / its GPU.
* ``safety``: a failing, stuck or interrupted rank ends the whole job.

:func:`start` is the one start-up, in its one order; ``import distlinalg``
calls it, and nothing else in the package changes the process at import.
"""

from __future__ import annotations

import warnings

_STARTED: str | None = None


def start() -> str:
    """Set the process up for distlinalg, once; returns what became of XLA's YNN fusions.

    The order matters:

    1. XLA's flags (``xla_flags``), before anything starts JAX's CPU backend,
       which reads ``XLA_FLAGS`` once;
    2. the JAX patches (``patches.apply_jax_patches``), before any program
       with an MPI call is traced or compiled; a JAX outside the checked
       versions warns here;
    3. MPI (``mpi``): initialised, the handlers registered with XLA, each
       rank's cores and GPU chosen (before the backend starts, which sizes
       its thread pool and picks its devices then);
    4. the safety net (``safety.install``), which needs MPI.
    """
    global _STARTED
    if _STARTED is not None:
        return _STARTED
    from . import patches, xla_flags

    ynn = xla_flags.disable_ynn_fusion()
    if ynn.startswith("left on"):
        warnings.warn(
            "distlinalg was imported after JAX's CPU backend started and could not switch XLA's YNN "
            "reduce fusions off; with jaxlib 0.10.2 they can give wrong results (e.g. jnp.sum((X @ W) ** 2, 1), "
            "jitted solves with x0=None). Import distlinalg before running JAX computations, or set "
            "XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT yourself.",
            RuntimeWarning,
            stacklevel=3,
        )
    patches.apply_jax_patches()
    from . import mpi  # noqa: F401  (initialises MPI and registers the FFI handlers)
    from . import safety

    safety.install()
    _STARTED = ynn
    return ynn
