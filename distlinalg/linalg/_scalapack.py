"""The ScaLAPACK engine of distlinalg.linalg: Intel MKL's ScaLAPACK inside jit and eagerly.

Layout (every entry point). The N x N matrix is held by rows: rank r holds rows
``[s_r, s_{r+1})`` as an array of shape ``(n_r, N)``, ``n_r = sizes[r]``; the split
may be uneven and a rank may hold no rows. Right-hand sides and solutions are
this rank's rows too, ``(n_r,)`` or ``(n_r, m)``. ``sizes`` is the static tuple
of every rank's row count (the same on every rank, ``sum(sizes) == N``).

Inside, the handler (csrc/scalapack.cc) moves the rows to ScaLAPACK's 2-D
block-cyclic layout on a BLACS grid of ``nprow x npcol == P`` processes (one
MPI_Alltoallv on a private duplicate of the communicator), calls ScaLAPACK and
moves the result back to the row split: memory per rank is O(N^2 / P), no rank
ever holds the whole matrix. The calls carry distlinalg's MPI effect, so they
are ordered with every other distlinalg operation in the program.

``info`` is an int32 scalar, the same on every rank: 0 success; > 0 ScaLAPACK's
failure (Cholesky: the order of the leading minor that is not positive
definite; LU: the first zero pivot, U(info, info) = 0; eigh: the eigensolver
did not converge); < 0 argument ``-info`` of the ScaLAPACK routine was bad.
Over the ranks the most negative INFO wins, else the largest. On failure the
solution, eigenvalues and eigenvectors are NaN (never uninitialised memory).

MKL is found at run time: the `mkl` wheel's libraries (``make scalapack`` or
``pip install mkl==2026.2.0``), or the directory ``DISTLINALG_MKL_LIB_DIR``.
The BLACS must match the MPI family: MKL's Intel MPI BLACS for MPICH (the same
ABI), its Open MPI BLACS for Open MPI. MKL runs sequentially by default (one
rank per core is distlinalg's layout); ``DISTLINALG_MKL_THREADING=gnu`` loads
the GNU OpenMP layer with as many threads as this rank has cores (unless
MKL_NUM_THREADS says otherwise). Read when MKL is first loaded.

Not differentiable (no JVP rules) and not batched (no vmap rule).
"""

from __future__ import annotations

import importlib.metadata
import math
import os
import threading
from typing import Any

import jax.numpy as jnp
import numpy as np

from .._runtime import mpi as _mpi
from .._runtime.jax_names import mlir
from .._runtime.mpi import Communicator, resolve_comm
from ..comm import _core

__all__ = ["available", "potrf_solve", "gesv", "heevd", "default_grid", "default_block", "MKL_REQUIREMENT"]

MKL_REQUIREMENT = "mkl==2026.2.0"
_INSTALL_HINT = f"install it with `make scalapack` or `pip install {MKL_REQUIREMENT}`"

# ---------------------------------------------------------------------------
# Loading


def _mkl_libraries() -> tuple[str | None, dict[str, str], str]:
    """(directory, {library stem: path}, '' or why there is none)."""
    directory = os.environ.get("DISTLINALG_MKL_LIB_DIR")
    found: dict[str, str] = {}
    if directory:
        if not os.path.isdir(directory):
            return None, {}, f"DISTLINALG_MKL_LIB_DIR={directory} is not a directory"
        for name in sorted(os.listdir(directory)):
            if name.startswith("libmkl_") and ".so" in name:
                found.setdefault(name.split(".so")[0], os.path.join(directory, name))
        return directory, found, ""
    try:
        dist = importlib.metadata.distribution("mkl")
    except importlib.metadata.PackageNotFoundError:
        return None, {}, "the `mkl` package is not installed"
    for f in dist.files or []:
        name = f.name
        if name.startswith("libmkl_") and ".so" in name:
            stem = name.split(".so")[0]
            path = str(dist.locate_file(f))
            # The versioned file (libmkl_core.so.3) over a development symlink.
            if stem not in found or len(path) > len(found[stem]):
                found[stem] = path
    if not found:
        return None, {}, f"the `mkl` package {dist.version} lists no libmkl_*.so files"
    return os.path.dirname(os.path.realpath(next(iter(found.values())))), found, ""


def _blacs_for_mpi() -> tuple[str | None, str]:
    """MKL's BLACS for the MPI family distlinalg was built against, or why none fits."""
    family = _mpi.BUILD_INFO["implementation"]
    if family == "MPICH":
        return "libmkl_blacs_intelmpi_lp64", ""  # Intel MPI's BLACS: the MPICH ABI
    if family == "Open MPI":
        return "libmkl_blacs_openmpi_lp64", ""
    return None, f"MKL has no BLACS for this MPI ({family}; MKL's are for MPICH/Intel MPI and Open MPI)"


def _threading_layer() -> tuple[str, str]:
    """(MKL threading library stem, description) from DISTLINALG_MKL_THREADING."""
    choice = os.environ.get("DISTLINALG_MKL_THREADING", "sequential").strip().lower()
    if choice == "gnu":
        if "MKL_NUM_THREADS" not in os.environ:
            # The cores distlinalg gave this rank (distlinalg/_runtime/cpu.py), not the node's.
            os.environ["MKL_NUM_THREADS"] = str(len(os.sched_getaffinity(0)))
        return "libmkl_gnu_thread", f"GNU OpenMP threading, {os.environ['MKL_NUM_THREADS']} threads"
    if choice != "sequential":
        raise ValueError(f"DISTLINALG_MKL_THREADING must be sequential or gnu, not {choice!r}")
    return "libmkl_sequential", "sequential"


_load_lock = threading.Lock()
_status: tuple[bool, str] | None = None


def available() -> tuple[bool, str]:
    """Whether the engine can run here: (loaded?, a sentence saying what was loaded from
    where, or why not). Loads MKL on the first call (this rank only: nothing collective).
    Never raises."""
    global _status
    with _load_lock:
        if _status is None:
            try:
                _status = _load()
            except Exception as e:  # noqa: BLE001  (an unexpected failure is an answer too)
                _status = (False, f"distlinalg: the ScaLAPACK engine could not be loaded ({e}); {_INSTALL_HINT}")
        return _status


def _load() -> tuple[bool, str]:
    directory, libs, why = _mkl_libraries()
    if directory is None:
        return False, f"distlinalg: no ScaLAPACK engine: {why}; {_INSTALL_HINT}."
    blacs, why = _blacs_for_mpi()
    if blacs is None:
        return False, f"distlinalg: no ScaLAPACK engine: {why}."
    threading_stem, threading_text = _threading_layer()
    # Dependency order: MKL's core, the threading and the lp64 interface layers reference
    # one another (opened lazily, they resolve once all are in), then the BLACS (which
    # needs MPI, made global by the loader) and ScaLAPACK.
    order = ["libmkl_core", threading_stem, "libmkl_intel_lp64", blacs, "libmkl_scalapack_lp64"]
    missing = [stem for stem in order if stem not in libs]
    if missing:
        return False, (f"distlinalg: no ScaLAPACK engine: {directory} lacks {', '.join(missing)}; "
                       f"{_INSTALL_HINT}.")
    error = _mpi._native.scalapack_load([libs[stem] for stem in order])
    if error:
        return False, f"distlinalg: the ScaLAPACK engine could not be loaded: {error}; {_INSTALL_HINT}."
    version = _mkl_version()
    return True, (f"MKL{version} ScaLAPACK ({os.path.basename(libs['libmkl_scalapack_lp64'])}) with "
                  f"{os.path.basename(libs[blacs])} for {_mpi.BUILD_INFO['implementation']}, "
                  f"{threading_text}, from {directory}")


def _mkl_version() -> str:
    try:
        return " " + importlib.metadata.version("mkl")
    except importlib.metadata.PackageNotFoundError:
        return ""


def handler_memory(reset_peak: bool = False) -> tuple[int, int]:
    """Bytes the ScaLAPACK handlers of this process hold themselves, beside the XLA buffers
    they read and write (XLA's ``memory_analysis`` cannot see them): ``(live, high_water)``.

    What they hold during a call: this rank's block-cyclic piece of A (and of B, or of Z for
    eigh), ScaLAPACK's workspaces, and the exchange buffers of one column panel of the
    redistribution (about 1/8 of the rank's share). ``reset_peak=True`` restarts the
    high-water mark from the live bytes after reading it (this rank only; nothing
    collective). For the benchmarks' memory accounting:

    >>> live, peak = handler_memory(reset_peak=True)  # doctest: +SKIP
    """
    live, peak = _mpi._native.scalapack_memory(reset_peak)
    return int(live), int(peak)


def _require() -> None:
    ok, message = available()
    if not ok:
        raise ImportError(message, name="mkl")


# ---------------------------------------------------------------------------
# Defaults

# Block 64: on 2 cores, 2 ranks, N = 2048 float64 (benchmarks/bench_scalapack_engine.py, a
# machine shared with other jobs), 32, 64, 128 and 256 were within the run-to-run noise of
# one another (heevd 2.9, 2.9, 2.6 s at 64/128/256 in the quietest run); 32 was slower.
_DEFAULT_BLOCK = 64


def default_grid(nprocs: int) -> tuple[int, int]:
    """The most square ``(nprow, npcol)`` with ``nprow * npcol == nprocs``, the longer side
    across the columns: on two ranks 1 x 2 was faster than 2 x 1 in each of three runs
    (N = 2048 Cholesky solve 0.11-0.29 s vs 0.29-0.46 s, heevd 4.5-5.9 s vs 5.9-6.6 s)."""
    nprow = int(math.isqrt(nprocs))
    while nprocs % nprow:
        nprow -= 1
    return nprow, nprocs // nprow


def default_block(n: int, grid: tuple[int, int]) -> int:
    """64, or less for small matrices so that every process of the grid holds a block."""
    return max(1, min(_DEFAULT_BLOCK, -(-n // max(grid))))


# ---------------------------------------------------------------------------
# Primitives

solve_p = _core.new_primitive("scalapack_solve", multiple_results=True)
eigh_p = _core.new_primitive("scalapack_eigh", multiple_results=True)


def _solve_shape(a, b, *, comm, sizes, kind, grid, block):
    return [_core.shaped(b.shape, b.dtype), _core.shaped((), np.int32)]


def _eigh_shape(a, *, comm, sizes, grid, block):
    real = np.finfo(a.dtype).dtype
    return [_core.shaped((a.shape[1],), real), _core.shaped(a.shape, a.dtype), _core.shaped((), np.int32)]


_core.def_abstract_eval(solve_p, _solve_shape)
_core.def_abstract_eval(eigh_p, _eigh_shape)


def _grid_attrs(comm: Communicator, sizes: tuple[int, ...], grid: tuple[int, int], block: int) -> dict[str, Any]:
    return {
        "comm": _core.comm_attr(comm),
        "sizes": np.asarray(sizes, dtype=np.int64),
        "nprow": np.int64(grid[0]),
        "npcol": np.int64(grid[1]),
        "nb": np.int64(block),
    }


_core.register_lowering(
    solve_p,
    "distlinalg_scalapack_solve",
    lambda *, comm, sizes, kind, grid, block: {**_grid_attrs(comm, sizes, grid, block), "kind": np.int32(kind)},
)
_core.register_lowering(
    eigh_p,
    "distlinalg_scalapack_eigh",
    lambda *, comm, sizes, grid, block: _grid_attrs(comm, sizes, grid, block),
)


def _host_only(ctx, *args, **params):
    raise NotImplementedError(
        "distlinalg's ScaLAPACK engine runs on the host: place the matrix on the CPU "
        "(jax.device_put(x, jax.devices('cpu')[0])) or use another engine on a GPU."
    )


if _mpi.BUILD_INFO["cuda"]:
    # register_lowering gave CUDA the same target, which has no CUDA handler.
    for _prim in (solve_p, eigh_p, _core._eager_twins[solve_p], _core._eager_twins[eigh_p]):
        mlir.register_lowering(_prim, _host_only, platform="cuda")


# ---------------------------------------------------------------------------
# Entry points


def _inexact(dtype: Any) -> Any:
    if jnp.issubdtype(dtype, jnp.inexact):
        return dtype
    return jnp.result_type(float)  # float64 with x64, else float32


def _static_args(name: str, a: Any, sizes: Any, comm: Communicator, block: Any, grid: Any) -> tuple:
    """Checks what every rank can check alike, then (sizes, grid, block)."""
    try:
        sizes = tuple(int(s) for s in sizes)
    except TypeError:
        raise TypeError(f"distlinalg.linalg {name}: sizes must be a tuple of row counts, got {sizes!r}") from None
    if len(sizes) != comm.size or any(s < 0 for s in sizes):
        raise ValueError(f"distlinalg.linalg {name}: sizes must hold {comm.size} non-negative row counts, got {sizes}")
    n = sum(sizes)
    if np.ndim(a) != 2 or np.shape(a)[1] != n:
        raise ValueError(f"distlinalg.linalg {name}: A must be this rank's rows, shape (n_r, N) with "
                         f"N = sum(sizes) = {n}, got shape {np.shape(a)}")
    if np.shape(a)[0] != sizes[comm.rank]:
        raise ValueError(f"distlinalg.linalg {name}: rank {comm.rank} holds {np.shape(a)[0]} rows, "
                         f"sizes says {sizes[comm.rank]}")
    grid = default_grid(comm.size) if grid is None else (int(grid[0]), int(grid[1]))
    if grid[0] < 1 or grid[1] < 1 or grid[0] * grid[1] != comm.size:
        raise ValueError(f"distlinalg.linalg {name}: grid {grid} must have nprow * npcol == {comm.size} ranks")
    block = default_block(n, grid) if block is None else int(block)
    if block < 1:
        raise ValueError(f"distlinalg.linalg {name}: block must be positive, got {block}")
    return sizes, grid, block


def _solve(name: str, kind: int, a_rows: Any, b_rows: Any, sizes: Any, comm: Any, block: Any, grid: Any):
    comm = resolve_comm(comm)
    _require()
    a, b = _core.as_array(a_rows), _core.as_array(b_rows)
    sizes, grid, block = _static_args(name, a, sizes, comm, block, grid)
    if b.ndim not in (1, 2) or b.shape[0] != a.shape[0]:
        raise ValueError(f"distlinalg.linalg {name}: b must be this rank's rows, shape ({a.shape[0]},) or "
                         f"({a.shape[0]}, m), got {b.shape}")
    dtype = _inexact(jnp.result_type(a, b))
    vector = b.ndim == 1
    b2 = b.astype(dtype)[:, None] if vector else b.astype(dtype)  # (a rank may hold 0 rows)
    x, info = _core.bind(solve_p, a.astype(dtype), b2, comm=comm, sizes=sizes, kind=kind, grid=grid, block=block)
    return (x.reshape(b.shape) if vector else x), info


def potrf_solve(a_rows: Any, b_rows: Any, sizes: tuple[int, ...], comm: Any, *, block: int | None = None,
                grid: tuple[int, int] | None = None) -> tuple[Any, Any]:
    """Solve A x = b for Hermitian positive definite A (ScaLAPACK p?potrf + p?potrs).

    Args:
      a_rows: this rank's rows of A, ``(n_r, N)``; only the lower triangle is read.
      b_rows: this rank's rows of b, ``(n_r,)`` or ``(n_r, m)``.
      sizes: every rank's row count (static; ``sum(sizes) == N``).
      comm: a communicator (None: distlinalg's default).
      block: ScaLAPACK's square block size (default: :func:`default_block`).
      grid: ``(nprow, npcol)`` with ``nprow * npcol == P`` (default: :func:`default_grid`).

    Returns:
      ``(x_rows, info)``: this rank's rows of x (the shape of `b_rows`, the common
      float/complex dtype) and the int32 ``info`` (module docstring), the same on every
      rank; x is NaN when ``info != 0``.
    """
    return _solve("potrf_solve", 0, a_rows, b_rows, sizes, comm, block, grid)


def gesv(a_rows: Any, b_rows: Any, sizes: tuple[int, ...], comm: Any, *, block: int | None = None,
         grid: tuple[int, int] | None = None) -> tuple[Any, Any]:
    """Solve A x = b by LU with partial pivoting (ScaLAPACK p?gesv).

    Arguments and results as :func:`potrf_solve`; ``info > 0``: A is singular
    (U(info, info) is exactly zero).
    """
    return _solve("gesv", 1, a_rows, b_rows, sizes, comm, block, grid)


def heevd(a_rows: Any, sizes: tuple[int, ...], comm: Any, *, block: int | None = None,
          grid: tuple[int, int] | None = None) -> tuple[Any, Any, Any]:
    """All eigenvalues and eigenvectors of Hermitian A (ScaLAPACK p?syevd / p?heevd,
    divide and conquer).

    Args:
      a_rows: this rank's rows of A, ``(n_r, N)``; only the lower triangle is read.
      sizes, comm, block, grid: as :func:`potrf_solve`.

    Returns:
      ``(w, v_rows, info)``: the eigenvalues, ``(N,)`` real, ascending, identical on
      every rank; this rank's rows of the eigenvectors, ``(n_r, N)`` (column k belongs
      to ``w[k]``); and ``info`` (module docstring). NaN when ``info != 0``.
    """
    comm = resolve_comm(comm)
    _require()
    a = _core.as_array(a_rows)
    sizes, grid, block = _static_args("heevd", a, sizes, comm, block, grid)
    a = a.astype(_inexact(a.dtype))
    w, v, info = _core.bind(eigh_p, a, comm=comm, sizes=sizes, grid=grid, block=block)
    return w, v, info
