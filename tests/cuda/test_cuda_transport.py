"""The CUDA handlers without a GPU: lowering, configuration, device selection,
and (under DISTLINALG_CUDA_EMULATION=1 with the stand-in driver
tests/cuda_driver_stub.c) the staging and CUDA-aware code paths themselves.

`make test` runs this file in the normal passes and again, with the comm
suites, in the emulation passes (host-staged and CUDA-aware).
"""

from __future__ import annotations

import ctypes
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import distlinalg as dl
from distlinalg._runtime import jax_names
from distlinalg._runtime import cuda as _cuda
from distlinalg._runtime import mpi as _mpi

from conftest import assert_matches_reference

BUILT = bool(_mpi.BUILD_INFO["cuda"])
EMULATED = _cuda.emulated()
needs_build = pytest.mark.skipif(not BUILT, reason="distlinalg built without the CUDA handlers")
needs_emulation = pytest.mark.skipif(
    not EMULATED, reason="runs under DISTLINALG_CUDA_EMULATION=1 (make test's emulation passes)"
)


def test_mpi_cuda_support_query_answers():
    support = _mpi._native.mpi_cuda_support()
    assert support["supported"] in (-1, 0, 1)
    assert support["method"]


@needs_build
def test_collectives_lower_for_cuda(handlers_on_one_rank):
    """Every comm primitive has a CUDA lowering to the same FFI target."""
    x = jnp.arange(6.0).reshape(3, 2)

    def program(v):
        v = dl.comm.allreduce(v)
        v = v + dl.comm.bcast(v, root=0)
        g = dl.comm.allgather(v)
        v = v + dl.comm.reduce_scatter(g, op="sum")
        return dl.comm.sendrecv(v, v, source=dl.rank(), dest=dl.rank())

    text = jax.jit(program).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    for target in ("distlinalg_allreduce", "distlinalg_bcast", "distlinalg_allgather",
                   "distlinalg_reduce_scatter", "distlinalg_sendrecv"):
        assert f'"{target}"' in text or f"@{target}" in text, target


@pytest.mark.skipif(BUILT, reason="this build has the CUDA handlers")
def test_cuda_lowering_without_handlers_explains():
    with pytest.raises(NotImplementedError, match="DISTLINALG_CUDA=on"):
        jax.jit(dl.comm.allreduce).trace(jnp.ones(3)).lower(lowering_platforms=("cuda",))


def test_transport_was_reported():
    assert _cuda.STATE["transport"]
    assert _cuda.STATE["mpi_cuda_aware"].split()[0] in ("yes", "no", "unknown")


class _RecordingNative:
    """Stands in for distlinalg._native in configure_transport."""

    def __init__(self, supported: int):
        self.supported = supported
        self.cuda_aware = None

    def mpi_cuda_support(self):
        return {"supported": self.supported, "method": "test"}

    def set_cuda_transport(self, cuda_aware):
        self.cuda_aware = cuda_aware

    def set_cuda_staging_chunk(self, nbytes):
        self.staging_chunk = nbytes


@pytest.mark.parametrize(
    "setting, supported, expected",
    [("auto", 1, "cuda-aware"), ("auto", 0, "host-staged"), ("auto", -1, "host-staged"),
     ("0", 1, "host-staged"), ("1", -1, "cuda-aware")],
)
def test_transport_choice(monkeypatch, setting, supported, expected):
    saved = dict(_cuda.STATE)
    monkeypatch.setenv("DISTLINALG_CUDA_AWARE", setting)
    native = _RecordingNative(supported)
    try:
        assert _cuda.configure_transport(native, {"cuda": True}) == expected
        assert native.cuda_aware == (expected == "cuda-aware")
    finally:
        _cuda.STATE.update(saved)


def test_forcing_cuda_aware_on_a_library_that_says_no_warns(monkeypatch):
    saved = dict(_cuda.STATE)
    monkeypatch.setenv("DISTLINALG_CUDA_AWARE", "1")
    try:
        with pytest.warns(RuntimeWarning, match="crashes a non-CUDA-aware MPI"):
            _cuda.configure_transport(_RecordingNative(0), {"cuda": True})
    finally:
        _cuda.STATE.update(saved)


def test_bad_transport_setting_is_an_error(monkeypatch):
    monkeypatch.setenv("DISTLINALG_CUDA_AWARE", "sometimes")
    with pytest.raises(ValueError, match="DISTLINALG_CUDA_AWARE"):
        _cuda.configure_transport(_RecordingNative(0), {"cuda": True})


@pytest.mark.parametrize("setting, nbytes", [(None, 64 << 20), ("8M", 8 << 20), ("4096", 4096), ("1 GiB", 1 << 30)])
def test_staging_chunk_setting(monkeypatch, setting, nbytes):
    saved = dict(_cuda.STATE)
    if setting is None:
        monkeypatch.delenv("DISTLINALG_CUDA_STAGING_CHUNK", raising=False)
    else:
        monkeypatch.setenv("DISTLINALG_CUDA_STAGING_CHUNK", setting)
    native = _RecordingNative(0)
    try:
        _cuda.configure_transport(native, {"cuda": True})
        assert native.staging_chunk == nbytes
    finally:
        _cuda.STATE.update(saved)


@pytest.mark.parametrize("setting", ["100", "1.5M", "lots", "64T"])
def test_bad_staging_chunk_setting_is_an_error(monkeypatch, setting):
    monkeypatch.setenv("DISTLINALG_CUDA_STAGING_CHUNK", setting)
    with pytest.raises(ValueError, match="DISTLINALG_CUDA_STAGING_CHUNK"):
        _cuda.configure_transport(_RecordingNative(0), {"cuda": True})


@pytest.fixture
def pretend_cuda_jax(monkeypatch, tmp_path):
    """select_device's view of a machine with JAX's CUDA plugin and N GPUs."""
    chosen = []
    monkeypatch.setattr(_cuda, "cuda_plugin_installed", lambda: True)
    monkeypatch.setattr(jax_names, "backends_started", lambda: False)
    monkeypatch.setattr(jax_names, "cuda_visible_devices", lambda: "all")
    monkeypatch.setattr(jax_names, "requested_platforms", lambda: "")
    monkeypatch.setattr(jax_names, "set_cuda_visible_devices", chosen.append)
    monkeypatch.setattr(_cuda, "visible_gpu_count", lambda: int(os.environ["DISTLINALG_STUB_GPUS"]))
    saved = dict(_cuda.STATE)
    yield chosen
    _cuda.STATE.update(saved)


@pytest.mark.parametrize("gpus", [1, 2, 4])
def test_each_rank_takes_its_node_local_gpu(pretend_cuda_jax, monkeypatch, comm, gpus, node):
    monkeypatch.setenv("DISTLINALG_STUB_GPUS", str(gpus))
    monkeypatch.delenv("DISTLINALG_GPU_DEVICE", raising=False)
    _cuda.select_device(node)
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    expected = local.Get_rank() % gpus
    local.Free()
    assert_matches_reference(int(pretend_cuda_jax[0]), np.array(comm.allgather(expected)), comm)


def test_gpu_device_override_and_opt_out(pretend_cuda_jax, monkeypatch, comm, node):
    monkeypatch.setenv("DISTLINALG_STUB_GPUS", "2")
    monkeypatch.setenv("DISTLINALG_GPU_DEVICE", "1")
    _cuda.select_device(node)
    monkeypatch.setenv("DISTLINALG_GPU_DEVICE", "none")
    assert "left to JAX" in _cuda.select_device(node)
    assert pretend_cuda_jax == ["1"]


@pytest.mark.parametrize("value", ["third", "-1", "5"])
def test_bad_gpu_device_setting_is_an_error(pretend_cuda_jax, monkeypatch, comm, value, node):
    monkeypatch.setenv("DISTLINALG_STUB_GPUS", "2")
    monkeypatch.setenv("DISTLINALG_GPU_DEVICE", value)
    with pytest.raises(ValueError, match="DISTLINALG_GPU_DEVICE"):
        _cuda.select_device(node)


@pytest.mark.parametrize("own_gpu", [True, False])
def test_memory_is_split_only_among_ranks_on_the_same_gpu(pretend_cuda_jax, monkeypatch, comm, node, own_gpu):
    # Slurm's --gpus-per-task: every rank sees one GPU, device 0, but a different one
    # (own_gpu), or all ranks of the node really are on one GPU.
    monkeypatch.setenv("DISTLINALG_STUB_GPUS", "1")
    monkeypatch.delenv("DISTLINALG_GPU_DEVICE", raising=False)
    for name in _cuda._ALLOCATOR_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(_cuda, "gpu_identity", lambda d: f"0000:{node.Get_rank() if own_gpu else 0:02x}:00.0")
    note = _cuda.select_device(node)
    sharing = node.Get_size() > 1 and not own_gpu
    fraction = os.environ.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)
    everyone = comm.allgather((pretend_cuda_jax, fraction, "shared by" in note))
    for chosen, frac, shared in everyone:
        assert chosen == ["0"]
        assert shared == sharing
        assert frac == (f"{0.75 / node.Get_size():.3f}" if sharing else None)


def test_a_bad_gpu_setting_on_one_rank_raises_on_every_rank_of_the_node(pretend_cuda_jax, monkeypatch, comm, node):
    monkeypatch.setenv("DISTLINALG_STUB_GPUS", "2")
    monkeypatch.setenv("DISTLINALG_GPU_DEVICE", "7" if node.Get_rank() == node.Get_size() - 1 else "0")
    with pytest.raises(ValueError, match="DISTLINALG_GPU_DEVICE=7"):
        _cuda.select_device(node)


def test_device_selection_leaves_a_started_backend_alone(pretend_cuda_jax, monkeypatch, comm, node):
    monkeypatch.setenv("DISTLINALG_STUB_GPUS", "2")
    monkeypatch.setattr(jax_names, "backends_started", lambda: True)
    assert "unchanged" in _cuda.select_device(node)
    assert pretend_cuda_jax == []


# ---------------------------------------------------------------------------
# Emulation: the CUDA handlers registered on the CPU, the stand-in driver.
def _stub_stats() -> dict[str, int]:
    names = ("to_host", "to_device", "on_device", "fills", "syncs", "pinned_allocs", "largest_pinned", "event_syncs")
    stats = (ctypes.c_longlong * len(names))()
    ctypes.CDLL(os.environ["DISTLINALG_LIBCUDA"]).distlinalg_stub_stats(stats)
    return dict(zip(names, stats))


def _stub_delta(fn):
    before = _stub_stats()
    jax.block_until_ready(fn())
    after = _stub_stats()
    return {k: after[k] - before[k] for k in after}


def _staged() -> bool:
    return _mpi._native.cuda_transport() == "host-staged"


@needs_emulation
def test_allreduce_moves_through_the_transport(comm, rank, size):
    x = jnp.arange(1000, dtype=jnp.float64) * (rank + 1)
    f = jax.jit(dl.comm.allreduce)
    f(x)  # compile outside the measurement
    delta = _stub_delta(lambda: f(x))
    if _staged():
        assert delta["to_host"] == x.nbytes and delta["to_device"] == x.nbytes
    else:
        assert delta["to_host"] == 0 and delta["to_device"] == 0
    assert delta["syncs"] >= 1  # XLA's stream is always waited for before MPI
    assert_matches_reference(f(x), lambda g: np.broadcast_to(
        np.arange(1000.0) * size * (size + 1) / 2, g.shape), comm)


@needs_emulation
def test_half_precision_is_staged_in_every_transport(comm, rank, size):
    x = jnp.full(8, rank + 1, jnp.float16)
    f = jax.jit(dl.comm.allreduce)
    f(x)
    delta = _stub_delta(lambda: f(x))
    assert delta["to_host"] == x.nbytes
    assert_matches_reference(np.asarray(f(x), np.float64), lambda g: np.full(g.shape, size * (size + 1) / 2), comm)


@needs_emulation
def test_device_side_copies_and_fills_in_cuda_aware_mode(comm, rank, size):
    """reduce zero-fills non-root outputs; recv starts from its template: on device."""
    x = jnp.arange(4.0) + rank
    f = jax.jit(lambda v: dl.comm.reduce(v, "sum", root=0))
    f(x)
    delta = _stub_delta(lambda: f(x))
    if not _staged() and rank != 0:
        assert delta["fills"] == 1
    else:
        assert delta["fills"] == 0
    expected_root = sum(np.arange(4.0) + r for r in range(size))
    assert_matches_reference(f(x), lambda g: np.stack([expected_root] + [np.zeros(4)] * (size - 1)), comm)


@needs_emulation
def test_donated_and_loop_carried_buffers(comm, rank, size):
    """XLA hands the operand back as the result (aliasing): one host copy, reduced in place."""
    f = jax.jit(dl.comm.allreduce, donate_argnums=0)
    out = f(jnp.arange(1000.0) + rank)
    expected = np.arange(1000.0) * size + size * (size - 1) / 2
    assert_matches_reference(out, lambda g: np.broadcast_to(expected, g.shape), comm)

    loop = jax.jit(lambda v: jax.lax.fori_loop(0, 3, lambda i, u: dl.comm.allreduce(u) / size, v))
    assert_matches_reference(loop(jnp.full(7, float(rank))), lambda g: np.full(g.shape, (size - 1) / 2), comm)


@pytest.fixture
def small_staging_chunk():
    """Host staging with 4 KiB chunks for one test (the default is 64 MiB)."""
    native = _mpi._native
    saved = native.cuda_staging_chunk()
    native.set_cuda_staging_chunk(4096)
    ctypes.CDLL(os.environ["DISTLINALG_LIBCUDA"]).distlinalg_stub_reset_largest_pinned()
    yield 4096
    native.set_cuda_staging_chunk(saved)


@needs_emulation
def test_large_buffers_are_staged_in_bounded_chunks(comm, rank, size, small_staging_chunk):
    """Buffers beyond the staging chunk go through two pinned chunk-sized blocks
    (pipelined on events) into pageable memory: every value arrives, and no
    pinned block larger than a chunk is allocated, whatever the buffer size."""
    chunk = small_staging_chunk
    n = 3 * chunk // 8 + 5  # float64: three chunks and a partial fourth
    x = jnp.arange(n, dtype=jnp.float64) + 1000.0 * rank
    right, left = (rank + 1) % size, (rank - 1) % size
    every = np.arange(n) + 1000.0 * np.arange(size)[:, None]  # x of every rank
    programs = {
        "allreduce": (jax.jit(dl.comm.allreduce), np.broadcast_to(every.sum(0), every.shape)),
        "allgather": (jax.jit(dl.comm.allgather), np.broadcast_to(every, (size, *every.shape))),
        "sendrecv": (jax.jit(lambda v: dl.comm.sendrecv(v, v * 0, source=left, dest=right)), np.roll(every, 1, 0)),
        "bcast": (jax.jit(lambda v: dl.comm.bcast(v, root=size - 1)), np.broadcast_to(every[-1], every.shape)),
        "in_place_loop": (
            jax.jit(lambda v: jax.lax.fori_loop(0, 2, lambda i, u: dl.comm.allreduce(u) / size, v)),
            np.broadcast_to(every.mean(0), every.shape),
        ),
    }
    for name, (f, reference) in programs.items():
        f(x)  # compile outside the measurement
        delta = _stub_delta(lambda: f(x))
        assert_matches_reference(f(x), reference, comm)
        if _staged():
            assert delta["to_host"] >= x.nbytes, name
            assert delta["event_syncs"] >= 2, name  # the chunks were waited for one by one
        else:
            assert delta["to_host"] == 0 and delta["event_syncs"] == 0, name
    assert _stub_stats()["largest_pinned"] <= chunk


# ---------------------------------------------------------------------------
# `python -m distlinalg`: whether device-to-device messages are possible (issue 56)
def _facts(**changes):
    base = _cuda.DeviceFacts(handlers_built=True, gpus=1, mpi_cuda_support=1, transport="cuda-aware",
                             mpi_family="Open MPI", ucx_version=(1, 22, 0))
    return base._replace(**changes)


@pytest.mark.parametrize(("changes", "possible", "why"), [
    ({}, True, "UCX 1.22.0, whose cuda_ipc exports"),
    ({"ucx_version": (1, 23, 1)}, True, "UCX 1.23.1"),
    ({"ucx_version": (1, 21, 9)}, False, "cuMemCreate, which this MPI's CUDA IPC cannot export (Open MPI, UCX 1.21.9"),
    ({"ucx_version": None}, False, "no UCX in this process"),
    ({"mpi_family": "MPICH", "ucx_version": None}, False, "(MPICH, no UCX"),
    ({"transport": "host-staged"}, False, "DISTLINALG_CUDA_AWARE=0"),
    ({"mpi_cuda_support": 0}, False, "reports no CUDA support"),
    ({"mpi_cuda_support": -1}, False, "cannot say whether it is CUDA-aware"),
    ({"gpus": 0}, False, "no GPU"),
    ({"handlers_built": False}, False, "no CUDA handlers"),
])
def test_device_to_device_decision(changes, possible, why):
    got, reason = _cuda.device_to_device(_facts(**changes))
    assert got is possible and why in reason, reason


def test_environment_report_says_whether_device_to_device_messages_are_possible():
    """Under the emulation the handlers are built and the (stand-in) GPU counts; the MPICH wheel
    reports no CUDA support, so the answer is no, with that reason; without it, no GPU."""
    from distlinalg.__main__ import environment_report

    report = environment_report()
    line = next(line for line in report.splitlines() if line.startswith("device-to-device messages:"))
    facts = _cuda.device_facts(_mpi._native, _mpi.BUILD_INFO)
    possible, why = _cuda.device_to_device(facts)
    assert line == f"device-to-device messages: {'yes' if possible else 'no'} ({why})"
    if EMULATED:
        assert facts.handlers_built and facts.gpus == 1
        if facts.mpi_cuda_support == 0:
            assert not possible and "reports no CUDA support" in why
    elif not jax.devices()[0].platform == "gpu":
        assert not possible
