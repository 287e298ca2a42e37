"""Fixtures every distributed test needs.

The suite runs under ``mpiexec -n N`` (see tests/run_mpi.py); every rank runs
every test in the same order. Tests marked ``serial`` run in one plain
process instead; tests marked ``max_ranks(n)`` only where the world has at
most n ranks.
"""

from __future__ import annotations

import re
from pathlib import Path

import jax

jax.config.update("jax_enable_x64", True)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from mpi4py import MPI  # noqa: E402

import distlinalg  # noqa: E402,F401  (initialises MPI and the handlers)

# The test tree mirrors the package (tests/comm/, tests/solvers/, ...); the harness and
# the shared references live here at its root, and a test finds files from these.
TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "max_ranks(n): run only when the world has at most n ranks: long runs whose checks do not "
        "depend on the rank count, spared the oversubscribed larger worlds",
    )


# What XLA compiled in this process, and what the run's persistent cache saved
# (tests/run_mpi.py shares one between the worlds of a run): printed at the end of
# each rank's log, to keep the suite's compile time in view.
_COMPILES = {"programs": 0, "seconds": 0.0, "trace": 0.0, "lower": 0.0, "cache hits": 0, "cache misses": 0}


def _count_compile(event, duration, **_):
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES["programs"] += 1
        _COMPILES["seconds"] += duration
    elif event == "/jax/core/compile/jaxpr_trace_duration":
        _COMPILES["trace"] += duration
    elif event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
        _COMPILES["lower"] += duration


def _count_cache(event, **_):
    if event == "/jax/compilation_cache/cache_hits":
        _COMPILES["cache hits"] += 1
    elif event == "/jax/compilation_cache/cache_misses":
        _COMPILES["cache misses"] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)
jax.monitoring.register_event_listener(_count_cache)


def pytest_terminal_summary(terminalreporter):
    c = _COMPILES
    # JAX's compile event spans a load from the persistent cache too: the programs XLA
    # compiled here are the programs less the hits.
    terminalreporter.write_line(
        f"XLA: {c['programs']} programs compiled or loaded in {c['seconds']:.0f} s (jit tracing {c['trace']:.0f} s, "
        f"lowering {c['lower']:.0f} s); persistent cache {c['cache hits']} hits, {c['cache misses']} misses")


def pytest_addoption(parser):
    parser.addoption("--all-cases", action="store_true",
                     help="run every parametrized case in every world (by default worlds of "
                          f"{COVERING_FROM_WORLD} or more ranks run a covering subset: conftest.covering_cases)")


# From 3 ranks on, a parametrized test runs a covering subset of its cases: every value of
# every parameter at least once (the first case, in collection order, that brings a value
# not yet seen), not their full product, which runs at 1 and 2 ranks (and in any world with
# --all-cases). What a third rank adds (a non-power-of-two count, a rank with two
# neighbours, a rank holding nothing) is met by every value; the full product at 3 ranks on
# CI's 2 cores is what it cannot afford (issue 55: CI time).
COVERING_FROM_WORLD = 3


def covering_cases(items):
    """The items to run: those without parameters, and of each test function's cases those
    that bring a (parameter, value) pair that no earlier case of the function brought."""
    seen_by_function: dict[tuple, set] = {}
    keep = []
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is None or not callspec.params:
            keep.append(item)
            continue
        function = (str(item.path), item.cls.__name__ if item.cls else "", item.originalname)
        seen = seen_by_function.setdefault(function, set())
        pairs = {(name, callspec.indices.get(name)) for name in callspec.params}
        if not pairs <= seen:
            seen |= pairs
            keep.append(item)
    return keep


@pytest.hookimpl(trylast=True)  # after -k/-m deselection, so the covering is of the cases that remain
def pytest_collection_modifyitems(config, items):
    # Decided from the world size and the collection alone, so every rank skips the same tests.
    world = MPI.COMM_WORLD.Get_size()
    runnable = []
    for item in items:
        marker = item.get_closest_marker("max_ranks")
        if marker is not None and world > marker.args[0]:
            item.add_marker(pytest.mark.skip(reason=f"runs on at most {marker.args[0]} ranks, this world has {world}"))
        else:
            runnable.append(item)
    if world >= COVERING_FROM_WORLD and not config.getoption("--all-cases"):
        kept = {id(item) for item in covering_cases(runnable)}
        for item in runnable:
            if id(item) not in kept:
                item.add_marker(pytest.mark.skip(
                    reason=f"its parameters' values are covered by other cases in this {world}-rank world "
                           "(the full product runs at 1 and 2 ranks; --all-cases runs it here)"))


# Every rank keeps every program it compiled (JAX's caches); over a whole file
# of tests that grows to ~1.5-3 GB per process. With 4 or more ranks on one
# small machine (make test-scale) that exhausts memory, so the larger worlds
# start every test file with empty caches. Decided from the world size alone,
# so every rank clears at the same point.
CLEAR_CACHES_FROM_WORLD = 4


@pytest.fixture(autouse=True, scope="module")
def _fresh_caches_per_file_in_large_worlds():
    yield
    if MPI.COMM_WORLD.Get_size() >= CLEAR_CACHES_FROM_WORLD:
        import gc

        jax.clear_caches()
        gc.collect()


@pytest.fixture
def comm():
    """A fresh communicator for one test (freed afterwards)."""
    c = MPI.COMM_WORLD.Dup()
    c.Set_errhandler(MPI.ERRORS_RETURN)
    yield c
    c.Free()


@pytest.fixture
def node(comm):
    """The ranks sharing this node (an MPI_COMM_TYPE_SHARED split of `comm`; freed afterwards)."""
    c = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    yield c
    c.Free()


@pytest.fixture
def rank(comm):
    return comm.Get_rank()


@pytest.fixture
def size(comm):
    return comm.Get_size()


def uneven_partition(total, size):
    """Blocks of sizes proportional to 1, 2 at 2 ranks (30/60 of 90) and to
    0, 1, 2, ... from 3 ranks on (0/30/60: rank 0 holds nothing): ranks whose
    local shapes differ compile different programs, which equal splits never
    show (a rank with no rows is the extreme case). The last rank takes the
    remainder."""
    from distlinalg.operators import Partition

    weights = [1] if size == 1 else ([1, 2] if size == 2 else list(range(size)))
    sizes = [total * w // sum(weights) for w in weights]
    sizes[-1] += total - sum(sizes)
    return Partition.from_sizes(sizes)


def gather_global(local, comm):
    """Stack every rank's array on a leading rank axis, on every rank (mpi4py)."""
    local = np.asarray(local)
    return np.stack(comm.allgather(local))


def assert_matches_reference(local, reference, comm, *, rtol=1e-12, atol=1e-12, err_msg=""):
    """Check a distributed result against a single-process reference.

    Args:
      local: this rank's result.
      reference: the expected results of all ranks, stacked on a leading rank
        axis (computed with numpy/jax on the gathered global data), or a
        callable taking the gathered local results and returning that stack.

    Every rank checks every rank's block, so a wrong value anywhere fails the
    test on every rank (no rank moves on to the next collective alone).
    """
    everyone = gather_global(local, comm)
    expected = reference(everyone) if callable(reference) else np.asarray(reference)
    np.testing.assert_allclose(everyone, expected, rtol=rtol, atol=atol, err_msg=err_msg)


def failure_of(fn, pattern):
    """"" when `fn()` raises an exception whose message matches `pattern`, else what went wrong.

    For tests where only some ranks expect an error: each rank records its
    outcome, then ``assert_no_failures`` compares them on every rank, so a
    rank that did not raise cannot leave the others waiting in a collective.
    """
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - the message is what the test checks
        return "" if re.search(pattern, str(error)) else f"raised {type(error).__name__}: {error}"
    return f"did not raise (expected an error matching {pattern!r})"


def assert_no_failures(failure, comm):
    """Fail on every rank if any rank's ``failure_of`` outcome is a failure."""
    everyone = comm.allgather(failure)
    problems = {rank: what for rank, what in enumerate(everyone) if what}
    assert not problems, f"per rank: {problems}"


@pytest.fixture
def check():
    return assert_matches_reference


@pytest.fixture
def handlers_on_one_rank():
    """One-rank communicators lower to the MPI handlers, as on several ranks
    (DISTLINALG_ONE_RANK_LOCAL=0), for tests of the handlers and lowerings
    themselves: by default a one-rank operation lowers to its local result,
    with no custom call. JAX's caches are cleared on both sides, so no program
    lowered one way is reused the other."""
    import jax

    from distlinalg.comm import _core

    jax.clear_caches()
    _core.ONE_RANK_LOCAL = False
    try:
        yield
    finally:
        _core.ONE_RANK_LOCAL = True
        jax.clear_caches()
