"""CPU placement at import (distlinalg/_cpu.py): node-local ranks get disjoint CPU blocks."""

from __future__ import annotations

import os
import threading

import pytest
from mpi4py import MPI

from distlinalg import _compat, _cpu


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
    monkeypatch.setattr(_compat, "backends_started", lambda: False)
    monkeypatch.setattr(_cpu, "_restrict_all_threads", moves.append)
    monkeypatch.delenv("DISTLINALG_CPU_AFFINITY", raising=False)
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
    assert moves == [expected]
    assert result.startswith(f"CPUs {_cpu._ranges(expected)} (node-local rank {local_rank} of {local_size}")
    # The blocks of all ranks on the node cover its CPUs once, in rank order.
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    blocks = local.allgather(moves[0])
    local.Free()
    assert sum(blocks, []) == list(range(8, 16))


def test_bound_or_oversubscribed_or_started_nodes_are_left_alone(pretend_node, comm, node, monkeypatch):
    _, local_size, _ = node_split(comm)
    moves = pretend_node(lambda rank: [rank])  # as if the launcher bound each rank to a core
    bound = _cpu.partition_cores(node)
    moves = pretend_node(lambda rank: [0])  # every rank on one CPU
    oversubscribed = _cpu.partition_cores(node)
    pretend_node(lambda rank: range(4))
    monkeypatch.setattr(_compat, "backends_started", lambda: True)
    started = _cpu.partition_cores(node)
    assert moves == []
    if local_size == 1:
        assert all("one rank on this node" in r for r in (bound, oversubscribed, started))
    else:
        assert "launcher bound the ranks: CPUs" in bound
        assert "oversubscribed" in oversubscribed
        assert "backend started" in started


def test_opt_out_and_bad_setting(pretend_node, comm, node, monkeypatch):
    moves = pretend_node(lambda rank: range(8))
    monkeypatch.setenv("DISTLINALG_CPU_AFFINITY", "none")
    assert "DISTLINALG_CPU_AFFINITY=none" in _cpu.partition_cores(node)
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
