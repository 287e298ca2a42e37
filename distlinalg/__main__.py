"""`python -m distlinalg`: environment report (run it under mpiexec too).

Prints, from rank 0, the versions and MPI facts a bug report needs, the
table of every change distlinalg makes to another library with its state in
this process (``distlinalg._runtime.patches``), then one line per rank
showing that every rank reached the same library.
"""

from __future__ import annotations

import platform
import sys


def environment_report() -> str:
    """The report as text (rank 0's view plus every rank's one-line summary)."""
    import jax
    import jaxlib
    import mpi4py
    import numpy as np
    from mpi4py import MPI

    from . import __version__
    from ._runtime import cpu as _cpu
    from ._runtime import cuda as _cuda
    from ._runtime import mpi as _mpi
    from ._runtime import patches

    comm = _mpi.DEFAULT_COMM
    levels = {
        MPI.THREAD_SINGLE: "SINGLE",
        MPI.THREAD_FUNNELED: "FUNNELED",
        MPI.THREAD_SERIALIZED: "SERIALIZED",
        MPI.THREAD_MULTIPLE: "MULTIPLE",
    }
    build = _mpi.BUILD_INFO
    runtime = MPI.Get_library_version().strip().splitlines()
    settings = _mpi._native.settings()
    d2d_possible, d2d_why = _cuda.device_to_device(_cuda.device_facts(_mpi._native, build))
    lines = [
        f"distlinalg:     {__version__}",
        f"python:         {sys.version.split()[0]} ({platform.platform()})",
        f"jax:            {jax.__version__}",
        f"jaxlib:         {jaxlib.__version__}",
        f"numpy:          {np.__version__}",
        f"mpi4py:         {mpi4py.__version__}",
        f"MPI at run time:  {runtime[0] if runtime else '?'}",
        f"MPI at build time: {build['implementation']} {build['header_version']} "
        f"(MPI standard {build['mpi_standard']})",
        f"MPI vendor (mpi4py): {MPI.get_vendor()[0]} {'.'.join(map(str, MPI.get_vendor()[1]))}",
        f"thread level:   {levels.get(_mpi.THREAD_LEVEL, _mpi.THREAD_LEVEL)}"
        + ("" if _mpi.THREAD_LEVEL == MPI.THREAD_MULTIPLE else " (handlers serialised by a lock)"),
        f"world size:     {comm.size}",
        f"jax devices:    {', '.join(str(d) for d in jax.devices())}",
        f"CUDA handlers:  {_cuda.STATE.get('handlers', '?')}",
        f"MPI CUDA-aware: {_cuda.STATE.get('mpi_cuda_aware', '?')}",
        f"GPU transport:  {_cuda.STATE.get('transport', '?')}",
        f"GPU staging:    {_cuda.STATE.get('staging_chunk', 'n/a')} per chunk (DISTLINALG_CUDA_STAGING_CHUNK)",
        f"GPU device:     {_cuda.STATE.get('device', '?')}",
        f"device-to-device messages: {'yes' if d2d_possible else 'no'} ({d2d_why})",
        f"CPU affinity:   {_cpu.STATE.get('affinity', '?')}",
        f"BLAS threads:   {_cpu.STATE.get('blas', '?')}",
        f"idle waits (DISTLINALG_IDLE_WAIT): {_cpu.STATE.get('idle wait', '?')}",
        f"XLA CPU YNN fusions: {distlinalg.YNN_FUSION}",
        f"cancellable waits (DISTLINALG_CANCELLABLE_WAITS): point-to-point yes; collectives "
        f"{'yes' if settings['cancellable_collectives'] else 'no (MPI blocking calls)'}",
        f"debug log (DISTLINALG_DEBUG): {settings['debug_log']}; "
        f"cross-rank check (DISTLINALG_CHECK): {_mpi.check_mode()}",
    ]
    lines += ["patches (distlinalg/_runtime/patches.py: what is replaced or set, and its state here):",
              patches.table_text()]
    host = platform.node()
    everyone = comm.comm.allgather(f"rank {comm.rank} of {comm.size} on {host}: {_cpu.STATE.get('affinity', '?')}")
    lines += ["ranks:"] + [f"  {line}" for line in everyone]
    return "\n".join(lines)


import distlinalg  # noqa: E402


def main() -> int:
    from ._runtime import mpi as _mpi

    report = environment_report()
    if _mpi.DEFAULT_COMM.rank == 0:
        print(report, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
