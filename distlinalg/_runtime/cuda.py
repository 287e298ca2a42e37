"""GPU support: the CUDA handlers, their MPI transport, and device selection.

Everything here runs once, at import, on every rank (``distlinalg._runtime.mpi``
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
from typing import Any, NamedTuple

import jax

from . import jax_names
from .env import switch

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
    return switch("DISTLINALG_CUDA_EMULATION", False)


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


# ---------------------------------------------------------------------------
# Device-to-device messages: possible here, and why not (``python -m distlinalg``).
#
# A CUDA-aware MPI moves a message between two GPUs of one node by CUDA IPC:
# the sender exports its buffer, the receiver maps it. XLA allocates device
# memory with the virtual memory API (``cuMemCreate``; the
# XLA_PYTHON_CLIENT_ALLOCATOR=platform setting no longer changes that, as
# seen on an H100 with jaxlib 0.11-0.12), and ``cuIpcGetMemHandle`` cannot
# export such memory: MPI libraries whose CUDA IPC uses it fall back or fail
# (issue 40). UCX from 1.22 on exports it by POSIX file descriptor
# (``cuda_ipc`` with ``pidfd_getfd``), so Open MPI over UCX >= 1.22 can.
UCX_EXPORTS_VMM = (1, 22)


class DeviceFacts(NamedTuple):
    """What decides whether device-to-device messages are possible (see `device_to_device`)."""

    handlers_built: bool
    gpus: int  # GPUs this rank uses (emulated ones count)
    mpi_cuda_support: int  # 1 yes, 0 no, -1 the library cannot say
    transport: str  # "cuda-aware" or "host-staged": what distlinalg chose
    mpi_family: str  # "Open MPI", "MPICH", or the library's first word
    ucx_version: tuple[int, int, int] | None  # the UCX loaded in this process, if any


def device_to_device(facts: DeviceFacts) -> tuple[bool, str]:
    """Whether MPI can move messages between GPUs of this node without host staging, and why.

    A pure function of `facts` (tested with made-up facts, and with the
    emulated CUDA handlers). Returns (possible, one line saying why).
    """
    if not facts.handlers_built:
        return False, "this distlinalg build has no CUDA handlers (rebuild with DISTLINALG_CUDA=on)"
    if facts.gpus < 1:
        return False, "JAX uses no GPU on this rank"
    if facts.mpi_cuda_support == 0:
        return False, ("the MPI library reports no CUDA support (messages are staged through host memory; "
                       "a CUDA-aware build of Open MPI with UCX >= 1.22 would be needed)")
    if facts.mpi_cuda_support == -1:
        return False, ("the MPI library cannot say whether it is CUDA-aware (DISTLINALG_CUDA_AWARE=1 hands it "
                       "device pointers anyway: at your own risk)")
    if facts.transport != "cuda-aware":
        return False, "the MPI library is CUDA-aware, but DISTLINALG_CUDA_AWARE=0 stages through host memory"
    if facts.mpi_family == "Open MPI" and facts.ucx_version is not None \
            and facts.ucx_version[:2] >= UCX_EXPORTS_VMM:
        version = ".".join(map(str, facts.ucx_version))
        return True, (f"Open MPI over UCX {version}, whose cuda_ipc exports XLA's cuMemCreate memory by file "
                      "descriptor")
    found = "no UCX in this process" if facts.ucx_version is None else \
        "UCX " + ".".join(map(str, facts.ucx_version))
    return False, (f"XLA allocates device memory with cuMemCreate, which this MPI's CUDA IPC cannot export "
                   f"({facts.mpi_family}, {found}; Open MPI over UCX >= 1.22 can): messages between ranks "
                   "on one node fall back to slower paths or fail; across nodes GPUDirect RDMA may still apply")


def _ucx_version() -> tuple[int, int, int] | None:
    """The version of the UCX library loaded in this process (by the MPI library), if any."""
    for name in ("libucp.so.0", "libucp.so"):
        try:
            lib = ctypes.CDLL(name, mode=getattr(os, "RTLD_NOLOAD", 0) | os.RTLD_LAZY)
        except OSError:
            continue
        major, minor, release = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()
        try:
            lib.ucp_get_version(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(release))
        except AttributeError:
            return None
        return major.value, minor.value, release.value
    return None


def device_facts(native: Any, build_info: dict[str, Any]) -> DeviceFacts:
    """This rank's `DeviceFacts`."""
    from mpi4py import MPI

    library = MPI.Get_library_version().strip()
    family = "Open MPI" if "Open MPI" in library else ("MPICH" if "MPICH" in library else library.split(" ")[0])
    if emulated():
        gpus = 1
    else:
        try:
            gpus = len(jax.devices("gpu"))
        except RuntimeError:
            gpus = 0
    transport = STATE.get("transport", "").split(" ")[0]
    return DeviceFacts(handlers_built=bool(build_info["cuda"]), gpus=gpus,
                       mpi_cuda_support=int(native.mpi_cuda_support()["supported"]), transport=transport,
                       mpi_family=family, ucx_version=_ucx_version())


# JAX's default: each process preallocates this fraction of its GPU's memory.
_JAX_DEFAULT_MEM_FRACTION = 0.75
_ALLOCATOR_VARIABLES = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                        "XLA_PYTHON_CLIENT_ALLOCATOR")


def gpu_identity(device: int) -> str | None:
    """The PCI bus id of CUDA device `device` as this process numbers it (None if the driver cannot say).

    Ranks that see their GPUs through different ``CUDA_VISIBLE_DEVICES`` (Slurm's
    ``--gpus-per-task``) all call their GPU device 0; the bus id tells whether
    two of them are the same GPU.
    """
    path = os.environ.get("DISTLINALG_LIBCUDA") or "libcuda.so.1"
    try:
        lib = ctypes.CDLL(path)
        handle = ctypes.c_int(0)
        if lib.cuInit(0) != 0 or lib.cuDeviceGet(ctypes.byref(handle), int(device)) != 0:
            return None
        bus_id = ctypes.create_string_buffer(64)
        if lib.cuDeviceGetPCIBusId(bus_id, len(bus_id), handle) != 0:
            return None
        return bus_id.value.decode() or None
    except (OSError, AttributeError):
        return None


def share_device_memory(sharers: int) -> str:
    """Split JAX's preallocation among the `sharers` ranks of this node on this rank's GPU.

    JAX preallocates 75% of a GPU's memory in every process, so a second rank
    on the same GPU fails its first allocation. When ranks share a GPU and
    the user set none of JAX's allocator variables, each rank gets
    75% / sharers via ``XLA_PYTHON_CLIENT_MEM_FRACTION`` (read when JAX's
    backend starts, which has not happened yet). Returns a note for ``STATE``.
    """
    if sharers <= 1:
        return ""
    if any(name in os.environ for name in _ALLOCATOR_VARIABLES):
        return "; shared with other ranks, JAX's allocator as set by the user"
    fraction = _JAX_DEFAULT_MEM_FRACTION / sharers
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{fraction:.3f}"
    return f"; shared by {sharers} ranks, each preallocating {fraction:.1%} (XLA_PYTHON_CLIENT_MEM_FRACTION)"


def _wants_cuda(platforms: str) -> bool:
    names = [p.strip() for p in platforms.split(",") if p.strip()]
    return not names or any(p in ("cuda", "gpu") for p in names)


def _choose_device(local_rank: int, local_size: int) -> tuple[str, int | None, int, bool]:
    """This rank's GPU, decided locally: (what was done, device or None, GPUs visible, explicit index?)."""
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
        return "left to JAX (DISTLINALG_GPU_DEVICE=none)", None, 0, False
    if not cuda_plugin_installed():
        return "no JAX CUDA plugin installed", None, 0, False
    if not _wants_cuda(jax_names.requested_platforms()):
        return f"not used (JAX_PLATFORMS={jax_names.requested_platforms()})", None, 0, False
    if jax_names.cuda_visible_devices() != "all":
        return f"as set by jax_cuda_visible_devices={jax_names.cuda_visible_devices()}", None, 0, False
    if jax_names.backends_started():
        return "unchanged: JAX's backend started before distlinalg was imported", None, 0, False
    count = visible_gpu_count()
    if count == 0:
        return "no GPU visible to the CUDA driver", None, 0, False
    if index is not None and index >= count:
        raise ValueError(f"DISTLINALG_GPU_DEVICE={index}, but this node shows {count} GPU(s)")
    device = local_rank % count if index is None else index
    why = f"node-local rank {local_rank} of {local_size}, {count} GPU(s)" if index is None else "DISTLINALG_GPU_DEVICE"
    return f"GPU {device} ({why})", device, count, index is not None


def select_device(node: Any) -> str:
    """Restrict JAX to this rank's GPU (see the module docstring); returns what was done.

    `node`: the ranks sharing this node (an ``MPI_COMM_TYPE_SHARED`` split,
    made once at import by ``distlinalg._runtime.mpi``); every one of them must call
    this. One allgather over `node` tells which ranks chose the same GPU (by
    PCI bus id, so ranks given different GPUs through ``CUDA_VISIBLE_DEVICES``
    do not count as sharing), and turns a bad setting on any rank of the
    node into the same ValueError on all of them.
    """
    local_rank, local_size = node.Get_rank(), node.Get_size()
    error = identity = device = None
    try:
        result, device, count, explicit = _choose_device(local_rank, local_size)
        if device is not None:
            identity = gpu_identity(device)
    except Exception as err:  # noqa: BLE001 - reported on every rank below, never on one alone
        error = str(err) if isinstance(err, ValueError) else f"{type(err).__name__}: {err}"
    everyone = node.allgather((error, device, identity))
    failed = [(r, e) for r, (e, _, _) in enumerate(everyone) if e is not None]
    if failed:
        if all(e == failed[0][1] for _, e in failed) and len(failed) == local_size:
            raise ValueError(failed[0][1])
        raise ValueError("; ".join(f"node-local rank {r}: {e}" for r, e in failed))
    if device is not None:
        jax_names.set_cuda_visible_devices(str(device))
        if identity is not None and all(i is not None for _, _, i in everyone):
            sharers = sum(i == identity for _, _, i in everyone)
        elif explicit:  # an explicit index: ranks naming the same index share it
            sharers = sum(d == device for _, d, _ in everyone)
        else:  # no bus ids: assume one set of GPUs per node, numbered alike on every rank
            sharers = len(range(device, local_size, count))
        result += share_device_memory(sharers)
    STATE["device"] = result
    return result
