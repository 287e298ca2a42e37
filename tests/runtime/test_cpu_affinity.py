"""CPU placement at import (distlinalg/_runtime/cpu.py): node-local ranks get disjoint CPU blocks."""

from __future__ import annotations

import os
import threading

import pytest
from mpi4py import MPI

from distlinalg._runtime import jax_names
from distlinalg._runtime import cpu as _cpu


def node_split(comm):
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        return local.Get_rank(), local.Get_size(), local.allgather(sorted(os.sched_getaffinity(0)))
    finally:
        local.Free()


@pytest.mark.parametrize("n_cpus, ranks", [(1, 1), (2, 2), (7, 3), (8, 3), (16, 4), (5, 5)])
def test_shares_are_contiguous_disjoint_and_balanced(n_cpus, ranks):
    cpus = [3 * c + 1 for c in range(n_cpus)]  # ids need not start at 0 nor be dense
    shares = [_cpu.share_of(cpus[::-1], r, ranks) for r in range(ranks)]
    assert sum(shares, []) == cpus  # in order, each CPU exactly once
    sizes = [len(s) for s in shares]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_more_ranks_than_cpus_is_refused():
    with pytest.raises(ValueError, match="cannot share 2 CPUs among 3 ranks"):
        _cpu.share_of([0, 1], 0, 3)


def test_cpu_ranges_are_printed_compactly():
    assert _cpu._ranges([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert _cpu._ranges([4]) == "4"


def test_import_time_placement_is_consistent(comm):
    """Whatever the launcher did, the ranks of a node agree, and pinned shares are disjoint."""
    state = _cpu.STATE["affinity"]
    local_rank, local_size, everyone = node_split(comm)
    verdicts = comm.allgather(state.split(" (")[0] if state.startswith("left alone") else "pinned")
    assert len(set(verdicts)) == 1, verdicts
    if state.startswith("CPUs"):
        assert local_size > 1
        assert state.startswith(f"CPUs {_cpu._ranges(everyone[local_rank])} ")
        flat = sum(everyone, [])
        assert len(flat) == len(set(flat))  # disjoint
        sizes = [len(s) for s in everyone]
        assert max(sizes) - min(sizes) <= 1
    elif local_size == 1:
        assert "one rank on this node" in state


@pytest.fixture
def pretend_node(monkeypatch):
    """partition_cores on a pretend node: CPU sets chosen by the test, moves recorded."""
    moves = []
    monkeypatch.setattr(jax_names, "backends_started", lambda: False)
    monkeypatch.setattr(_cpu, "_restrict_all_threads", moves.append)
    # BLAS limits recorded as ("blas", threads) among the moves, not applied to this process.
    monkeypatch.setattr(_cpu, "limit_blas_threads", lambda n: moves.append(("blas", n)) or f"{n} thread(s)")
    monkeypatch.delenv("DISTLINALG_CPU_AFFINITY", raising=False)
    monkeypatch.delenv("DISTLINALG_IDLE_WAIT", raising=False)
    monkeypatch.setattr(_cpu, "IDLE_SLEEP", _cpu.IDLE_SLEEP)  # partition_cores chooses it anew
    saved = dict(_cpu.STATE)

    def pretend(cpus_of_rank):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(cpus_of_rank(MPI.COMM_WORLD.Get_rank())))
        return moves

    yield pretend
    _cpu.STATE.clear()
    _cpu.STATE.update(saved)


def test_unbound_ranks_get_their_block(pretend_node, comm, node):
    moves = pretend_node(lambda rank: range(8, 16))
    result = _cpu.partition_cores(node)
    local_rank, local_size, _ = node_split(comm)
    if local_size == 1:
        assert "one rank on this node" in result and moves == []
        return
    expected = _cpu.share_of(list(range(8, 16)), local_rank, local_size)
    assert moves == [("blas", 8 // local_size), expected]
    assert result.startswith(f"CPUs {_cpu._ranges(expected)} (node-local rank {local_rank} of {local_size}")
    # The blocks of all ranks on the node cover its CPUs once, in rank order.
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    blocks = local.allgather(moves[1])
    local.Free()
    assert sum(blocks, []) == list(range(8, 16))


def test_bound_or_oversubscribed_or_started_nodes_are_left_alone(pretend_node, comm, node, monkeypatch):
    _, local_size, _ = node_split(comm)
    moves = pretend_node(lambda rank: [rank])  # as if the launcher bound each rank to a core
    bound = _cpu.partition_cores(node)
    moves = pretend_node(lambda rank: [0])  # every rank on one CPU
    oversubscribed = _cpu.partition_cores(node)
    pretend_node(lambda rank: range(4))
    monkeypatch.setattr(jax_names, "backends_started", lambda: True)
    started = _cpu.partition_cores(node)
    # Bound ranks keep their pools; an oversubscribed node and a started backend (NetKet
    # imported first) still get one BLAS thread per rank's share of the cores.
    if local_size == 1:
        assert moves == []
        assert all("one rank on this node" in r for r in (bound, oversubscribed, started))
        return
    assert moves == [("blas", 1), ("blas", 4 // local_size)]
    assert "launcher bound the ranks: CPUs" in bound
    assert "oversubscribed" in oversubscribed
    assert "backend started" in started


def test_opt_out_and_bad_setting(pretend_node, comm, node, monkeypatch):
    moves = pretend_node(lambda rank: range(8))
    monkeypatch.setenv("DISTLINALG_CPU_AFFINITY", "none")
    assert "DISTLINALG_CPU_AFFINITY=none" in _cpu.partition_cores(node)
    assert _cpu.STATE["blas"] == "left alone"
    monkeypatch.setenv("DISTLINALG_CPU_AFFINITY", "spread")
    # Raised after the node split, on every rank alike.
    with pytest.raises(ValueError, match="DISTLINALG_CPU_AFFINITY must be auto or none, not 'spread'"):
        _cpu.partition_cores(node)
    assert moves == []


def test_every_thread_is_moved():
    """Threads started before the move (BLAS pools, MPI) are moved too, not only the caller."""
    original = sorted(os.sched_getaffinity(0))
    started, release = threading.Event(), threading.Event()
    seen = {}

    def worker():
        seen["tid"] = threading.get_native_id()
        started.set()
        release.wait(30)

    thread = threading.Thread(target=worker)
    thread.start()
    started.wait(30)
    try:
        _cpu._restrict_all_threads(original[:1])
        assert os.sched_getaffinity(seen["tid"]) == set(original[:1])
        assert os.sched_getaffinity(0) == set(original[:1])
    finally:
        _cpu._restrict_all_threads(original)
        release.set()
        thread.join()
    assert os.sched_getaffinity(0) == set(original)


@pytest.mark.serial
def test_loaded_and_later_openblas_pools_are_limited():
    """limit_blas_threads in a fresh process: SciPy's OpenBLAS, already loaded, gets the
    count through its setter; OPENBLAS_NUM_THREADS is set for libraries loaded later; a
    value the user set is kept."""
    import subprocess
    import sys

    code = (
        "import ctypes, os, scipy.linalg\n"
        "from distlinalg._runtime import cpu as _cpu\n"
        "os.environ.pop('OPENBLAS_NUM_THREADS', None)\n"
        "print(_cpu.limit_blas_threads(1))\n"
        "paths = {l.split()[-1] for l in open('/proc/self/maps') if 'openblas' in l and '.so' in l}\n"
        "counts = []\n"
        "for p in sorted(paths):\n"
        "    lib = ctypes.CDLL(p)\n"
        "    for name in ('scipy_openblas_get_num_threads', 'scipy_openblas_get_num_threads64_',\n"
        "                 'openblas_get_num_threads'):\n"
        "        if hasattr(lib, name):\n"
        "            counts.append(getattr(lib, name)())\n"
        "            break\n"
        "print(counts, os.environ['OPENBLAS_NUM_THREADS'])\n"
        "os.environ['OPENBLAS_NUM_THREADS'] = '3'\n"
        "print(_cpu.limit_blas_threads(1))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENBLAS_", "PMI_", "OMPI_", "HYDRA_"))}
    env["DISTLINALG_CPU_AFFINITY"] = "none"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    first, counts, kept = proc.stdout.strip().splitlines()[-3:]
    assert first.startswith("1 OpenBLAS thread(s) per rank") and "loaded now" in first
    loaded, variable = counts.rsplit(" ", 1)
    assert variable == "1" and loaded != "[]" and set(eval(loaded)) == {1}, counts  # noqa: S307
    assert kept == "left alone (OPENBLAS_NUM_THREADS=3)"


@pytest.mark.parametrize("choice, everyone, local_size, sleeps, says", [
    ("auto", [[0, 1]] * 3, 3, True, "sleep (3 ranks share 2 CPU(s)"),
    ("auto", [[0], [0], [1]], 3, True, "sleep (3 ranks share 2 CPU(s)"),  # bound, but onto too few
    ("auto", [[0, 1]] * 2, 2, False, "yield (a core per rank)"),
    ("auto", [[0], [1], [2]], 3, False, "yield (a core per rank)"),
    ("auto", [[], []], 2, False, "yield (this OS does not report"),
    ("sleep", [[0, 1, 2, 3]], 1, True, "sleep (DISTLINALG_IDLE_WAIT=sleep)"),
    (" YIELD ", [[0]] * 4, 4, False, "yield (DISTLINALG_IDLE_WAIT=yield)"),
])
def test_idle_waits_sleep_where_ranks_outnumber_cpus(choice, everyone, local_size, sleeps, says, monkeypatch):
    monkeypatch.setattr(_cpu, "IDLE_SLEEP", None)
    assert _cpu.idle_wait(choice, everyone, local_size).startswith(says)
    assert _cpu.IDLE_SLEEP is sleeps


def test_bad_idle_wait_setting_is_refused(monkeypatch):
    monkeypatch.setattr(_cpu, "IDLE_SLEEP", False)
    with pytest.raises(ValueError, match="DISTLINALG_IDLE_WAIT must be auto, sleep or yield, not 'spin'"):
        _cpu.idle_wait("spin", [[0]], 1)


def test_the_handlers_wait_as_chosen_at_import(comm):
    """The choice reached the handlers, and the node's ranks made the same one."""
    from distlinalg._runtime import mpi as _mpi

    assert _mpi._native.settings()["idle_sleep"] is _cpu.IDLE_SLEEP
    _, local_size, everyone = node_split(comm)
    cpus = set().union(*map(set, everyone))
    if os.environ.get("DISTLINALG_IDLE_WAIT", "auto") == "auto":
        assert _cpu.IDLE_SLEEP is (len(cpus) < local_size)
    assert len(set(comm.allgather(_cpu.STATE["idle wait"].split(" (")[0]))) == 1
