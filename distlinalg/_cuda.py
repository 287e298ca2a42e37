"""GPU support: the CUDA handlers, their MPI transport, and device selection.

Everything here runs once, at import, on every rank (``distlinalg._mpi``
calls it after MPI is initialised).

Transport (how a CUDA handler hands data to MPI):
  ``host-staged`` (default) copies operands device-to-host on XLA's stream,
  waits for it, runs MPI on pinned host buffers and copies results back;
  ``cuda-aware`` waits for XLA's stream and gives MPI the device pointers.
  ``DISTLINALG_CUDA_AWARE``: ``auto`` (default: cuda-aware when the MPI
  library says it supports CUDA, via ``MPIX_Query_cuda_support`` or
  ``MPIX_GPU_query_support``), ``1`` (force, e.g. for an MPI that is
  CUDA-aware but cannot say so), ``0`` (always stage). Calls on float16 /
  bfloat16 are staged in every mode: their reductions are user-defined MPI
  ops that would otherwise be called on device memory.

Device selection: with several GPUs per node, every rank would otherwise
start on GPU 0. Before JAX's backend starts, distlinalg restricts each rank
to GPU ``node_local_rank % gpus_per_node`` (node-local rank from an
``MPI_COMM_TYPE_SHARED`` split), like ``jax.distributed.initialize`` does.
``DISTLINALG_GPU_DEVICE``: ``local-rank`` (default), ``none`` (leave JAX's
choice), or a device index for this rank. A ``jax_cuda_visible_devices``
already set by the user is left alone. When more ranks than GPUs share a
node, the ranks on one GPU split JAX's preallocation between them (see
``share_device_memory``) unless the user configured JAX's allocator.

Host staging holds a buffer of up to ``DISTLINALG_CUDA_STAGING_CHUNK`` bytes
(default ``64M``; suffixes K, M, G) in pinned memory, recycled between
calls; a larger buffer is copied in chunks of that size through two pinned
blocks into pageable host memory that is released when the call ends, so
the pinned memory of a call stays bounded (a few chunks) whatever its size.

``DISTLINALG_LIBCUDA`` names the CUDA driver library (default
``libcuda.so.1``).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import warnings
from typing import Any

import jax

from . import _compat

_PLUGIN_MODULES = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")

# What was decided, for ``python -m distlinalg``.
STATE: dict[str, str] = {}


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default).strip().lower() or default


def emulated() -> bool:
    """DISTLINALG_CUDA_EMULATION=1: the CUDA code path registered on the CPU.

    For tests only: the handlers then stage through the CUDA driver named by
    DISTLINALG_LIBCUDA, which must be a stand-in that works on host memory
    (tests/cuda_driver_stub.c).
    """
    return _env("DISTLINALG_CUDA_EMULATION", "0") in ("1", "yes", "true", "on")


def cpu_variant(build_info: dict[str, Any]) -> str:
    """Which handlers the CPU targets get: "cpu", or "cuda_emulated" in tests."""
    if not emulated():
        return "cpu"
    if not build_info["cuda"]:
        raise RuntimeError(
            "DISTLINALG_CUDA_EMULATION=1 needs a build with the CUDA handlers "
            "(cuda.h was not found when distlinalg was built; rebuild with DISTLINALG_CUDA=on)."
        )
    return "cuda_emulated"


def register_handlers(native: Any, build_info: dict[str, Any]) -> None:
    """Register the CUDA handlers with XLA (a no-op registration on CPU-only jaxlib)."""
    if not build_info["cuda"]:
        STATE["handlers"] = "not built (no cuda.h at build time; rebuild with DISTLINALG_CUDA=on)"
        return
    for name, capsule in native.registrations("cuda").items():
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
    STATE["handlers"] = "built"


def configure_transport(native: Any, build_info: dict[str, Any]) -> str:
    """Choose host staging or device pointers; returns the transport's name."""
    support = native.mpi_cuda_support()
    said = {1: "yes", 0: "no", -1: "unknown"}[support["supported"]]
    STATE["mpi_cuda_aware"] = f"{said} ({support['method']})"
    choice = _env("DISTLINALG_CUDA_AWARE", "auto")
    if choice in ("1", "on", "yes", "true"):
        cuda_aware = True
        if support["supported"] == 0:
            warnings.warn(
                "DISTLINALG_CUDA_AWARE=1 but the MPI library reports no CUDA support: MPI "
                "will be given device pointers anyway, which crashes a non-CUDA-aware MPI.",
                RuntimeWarning,
                stacklevel=3,
            )
        how = "forced by DISTLINALG_CUDA_AWARE=1"
    elif choice in ("0", "off", "no", "false"):
        cuda_aware, how = False, "DISTLINALG_CUDA_AWARE=0"
    elif choice == "auto":
        cuda_aware = support["supported"] == 1
        how = "detected" if cuda_aware else "default: the MPI library did not report CUDA support"
    else:
        raise ValueError(f"DISTLINALG_CUDA_AWARE must be auto, 1 or 0, not {os.environ['DISTLINALG_CUDA_AWARE']!r}")
    transport = "cuda-aware" if cuda_aware else "host-staged"
    chunk = staging_chunk_bytes()
    if build_info["cuda"]:
        native.set_cuda_transport(cuda_aware)
        native.set_cuda_staging_chunk(chunk)
        STATE["transport"] = f"{transport} ({how})"
        STATE["staging_chunk"] = f"{chunk} bytes"
    else:
        STATE["transport"] = "none (CUDA handlers not built)"
    return transport


_SIZE_SUFFIXES = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def staging_chunk_bytes() -> int:
    """DISTLINALG_CUDA_STAGING_CHUNK in bytes (default 64 MiB, at least 1 KiB)."""
    match = re.fullmatch(r"(\d+)\s*([kmg]?)(?:i?b)?", _env("DISTLINALG_CUDA_STAGING_CHUNK", "64m"))
    if match is None or int(match[1]) * _SIZE_SUFFIXES[match[2]] < 1024:
        raise ValueError(
            "DISTLINALG_CUDA_STAGING_CHUNK must be a size of at least 1K (bytes, or with a K, M or G "
            f"suffix), not {os.environ['DISTLINALG_CUDA_STAGING_CHUNK']!r}"
        )
    return int(match[1]) * _SIZE_SUFFIXES[match[2]]


def cuda_plugin_installed() -> bool:
    for name in _PLUGIN_MODULES:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except (ImportError, ValueError):
            continue
    return False


def visible_gpu_count() -> int:
    """GPUs the CUDA driver shows this process (0 without a usable driver)."""
    path = os.environ.get("DISTLINALG_LIBCUDA") or "libcuda.so.1"
    try:
        lib = ctypes.CDLL(path)
        if lib.cuInit(0) != 0:
            return 0
        count = ctypes.c_int(0)
        if lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return 0
        return count.value
    except (OSError, AttributeError):
        return 0


# JAX's default: each process preallocates this fraction of its GPU's memory.
_JAX_DEFAULT_MEM_FRACTION = 0.75
_ALLOCATOR_VARIABLES = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                        "XLA_PYTHON_CLIENT_ALLOCATOR")


def share_device_memory(local_size: int, count: int, device: int, index: int | None) -> str:
    """Split JAX's preallocation among the ranks of this node that share `device`.

    JAX preallocates 75% of a GPU's memory in every process, so a second rank
    on the same GPU fails its first allocation. When node-local ranks share a
    GPU (more ranks than GPUs, device chosen by local rank) and the user set
    none of JAX's allocator variables, each rank gets 75% / (ranks on its
    GPU) via ``XLA_PYTHON_CLIENT_MEM_FRACTION`` (read when JAX's backend
    starts, which has not happened yet). Returns a note for ``STATE``.
    """
    if index is not None or local_size <= count:
        return ""
    if any(name in os.environ for name in _ALLOCATOR_VARIABLES):
        return "; shared with other ranks, JAX's allocator as set by the user"
    sharers = len(range(device, local_size, count))
    fraction = _JAX_DEFAULT_MEM_FRACTION / sharers
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{fraction:.3f}"
    return f"; shared by {sharers} ranks, each preallocating {fraction:.1%} (XLA_PYTHON_CLIENT_MEM_FRACTION)"


def _wants_cuda(platforms: str) -> bool:
    names = [p.strip() for p in platforms.split(",") if p.strip()]
    return not names or any(p in ("cuda", "gpu") for p in names)


def select_device(node: Any) -> str:
    """Restrict JAX to this rank's GPU (see the module docstring); returns what was done.

    `node`: the ranks sharing this node (an ``MPI_COMM_TYPE_SHARED`` split,
    made once at import by ``distlinalg._mpi``). Nothing here communicates.
    """
    local_rank, local_size = node.Get_rank(), node.Get_size()
    choice = _env("DISTLINALG_GPU_DEVICE", "local-rank")
    index = None
    if choice not in ("local-rank", "none", "off", "all"):
        try:
            index = int(choice)
        except ValueError:
            raise ValueError(
                f"DISTLINALG_GPU_DEVICE must be local-rank, none or a device index, not {choice!r}"
            ) from None
        if index < 0:
            raise ValueError(f"DISTLINALG_GPU_DEVICE must be a non-negative device index, not {index}")
    if choice in ("none", "off", "all"):
        result = "left to JAX (DISTLINALG_GPU_DEVICE=none)"
    elif not cuda_plugin_installed():
        result = "no JAX CUDA plugin installed"
    elif not _wants_cuda(_compat.requested_platforms()):
        result = f"not used (JAX_PLATFORMS={_compat.requested_platforms()})"
    elif _compat.cuda_visible_devices() != "all":
        result = f"as set by jax_cuda_visible_devices={_compat.cuda_visible_devices()}"
    elif _compat.backends_started():
        result = "unchanged: JAX's backend started before distlinalg was imported"
    else:
        count = visible_gpu_count()
        if count == 0:
            result = "no GPU visible to the CUDA driver"
        elif index is not None and index >= count:
            raise ValueError(f"DISTLINALG_GPU_DEVICE={index}, but this node shows {count} GPU(s)")
        else:
            device = local_rank % count if index is None else index
            why = (
                f"node-local rank {local_rank} of {local_size}, {count} GPU(s)"
                if index is None
                else "DISTLINALG_GPU_DEVICE"
            )
            _compat.set_cuda_visible_devices(str(device))
            result = f"GPU {device} ({why})" + share_device_memory(local_size, count, device, index)
    STATE["device"] = result
    return result
