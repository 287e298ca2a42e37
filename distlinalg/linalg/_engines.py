"""Which engine runs a factorisation: ScaLAPACK (from the `mkl` wheel) or distlinalg's own.

ScaLAPACK is the field's engine and runs where it loads (`make scalapack`, or
`pip install` the ``[scalapack]`` extra); distlinalg's own blocked algorithms
on its collectives run everywhere else (and on request, ``engine="distlinalg"``).
Both sit under the same derivative rules (`distlinalg.linalg`'s own).
"""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def scalapack_status() -> tuple[bool, str]:
    """(loaded, why / from where): the same question asked once per process."""
    try:
        from . import _scalapack
    except ImportError as error:  # the engine's module itself is missing or broken
        return False, f"distlinalg's ScaLAPACK engine could not be imported ({error})"
    try:
        return _scalapack.available()
    except Exception as error:  # noqa: BLE001 - a report, never a crash
        return False, f"ScaLAPACK could not be loaded ({type(error).__name__}: {error})"
