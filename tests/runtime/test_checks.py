"""Mismatched calls across ranks: errors on every rank by default, never a hang.

The default check mode ("first-run") compares every eager call and the first
execution of each compiled call site across ranks; "every-call" compares
every call and the call order. A rank whose check waits on a rank that is
blocked elsewhere (a compiled call already checked, the end of its program)
gets an error naming what every rank is doing. Jobs that must end are
launched as separate mpiexec jobs (tests/scripts/checks_job.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distlinalg._runtime import mpi as _mpi
from distlinalg.comm import allgather, allreduce, barrier, bcast, configure, reduce

from conftest import REPO_ROOT, assert_no_failures, failure_of

JOB = REPO_ROOT / "tests" / "scripts" / "checks_job.py"
MISMATCH = "mismatched communication across ranks"


@pytest.fixture
def every_call():
    configure(check="every-call")
    yield
    configure(check="first-run")


def test_default_mode_is_first_run():
    if "DISTLINALG_CHECK" not in os.environ:
        assert _mpi.check_mode() == "first-run"


def test_bad_check_mode_is_an_error():
    with pytest.raises(ValueError, match="not a check mode"):
        configure(check="sometimes")


# The mismatches below raise on every rank, after which the ranks are in step.
def _mismatches(rank, size):
    last = rank == size - 1
    return {
        "shape": lambda c: allreduce(jnp.ones(3 + last), comm=c),
        "same count, other shape": lambda c: allreduce(jnp.ones((2, 3) if last else (3, 2)), comm=c),
        "dtype": lambda c: allreduce(jnp.ones(3, jnp.float32 if last else jnp.float64), comm=c),
        "reduction op": lambda c: allreduce(jnp.ones(3), "max" if last else "sum", comm=c),
        "root": lambda c: bcast(jnp.ones(3), root=int(last), comm=c),
        "reduce root": lambda c: reduce(jnp.ones(3), "sum", root=int(last), comm=c),
        "barrier against a collective": lambda c: barrier(comm=c) if last else allreduce(jnp.ones(1), comm=c),
        "different operations": lambda c: allgather(jnp.ones(2), comm=c) if last else allreduce(jnp.ones(2), comm=c),
    }


@pytest.mark.parametrize("case", list(_mismatches(0, 2)))
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "jit"])
def test_mismatch_is_an_error_on_every_rank(comm, rank, size, case, compiled):
    if size == 1:
        pytest.skip("a mismatch needs two ranks")
    call = _mismatches(rank, size)[case]
    if compiled:
        fn = jax.jit(lambda: call(comm))
    else:
        fn = lambda: call(comm)  # noqa: E731
    failure = failure_of(lambda: jax.block_until_ready(fn()), MISMATCH)
    assert_no_failures(failure, comm)
    # Still in step: the next collective agrees.
    np.testing.assert_allclose(allreduce(jnp.ones(1), comm=comm), [size])


def test_error_names_every_rank_and_the_one_that_differs(comm, rank, size):
    if size == 1:
        pytest.skip("needs two ranks")
    last = rank == size - 1
    with pytest.raises(Exception, match=MISMATCH) as info:
        allreduce(jnp.ones(4 if last else 3), comm=comm).block_until_ready()
    message = str(info.value)
    for r in range(size - 1):
        assert f"rank {r}: allreduce(float64[3], op=sum)\n" in message, message
    assert re.search(rf"rank {size - 1}: allreduce\(float64\[4\], op=sum\)\s+<-- differs", message), message


def test_rank_dependent_cond_in_first_run(comm, rank, size):
    """A collective in one branch of a rank-dependent cond meets the next call's check."""
    if size == 1:
        pytest.skip("needs two ranks")

    @jax.jit
    def step(x, flag):
        x = jax.lax.cond(flag, lambda v: allreduce(v, comm=comm), lambda v: v, x)
        return allreduce(x, "max", comm=comm)

    failure = failure_of(lambda: step(jnp.ones(2), rank == 0).block_until_ready(), MISMATCH)
    assert_no_failures(failure, comm)


def test_program_compiled_anew_on_some_ranks_only(comm, rank, size):
    """Local shapes that change on some ranks only (the last batch of an uneven split):
    those ranks compile the program anew while the others reuse theirs, and no rank checks
    a call that another rank does not (which would wait for it in vain)."""
    f = jax.jit(lambda x: allreduce(jnp.sum(x), comm=comm) + bcast(x[:1] * 0 + jnp.sum(x), root=0, comm=comm))
    def batch_length(step, r):  # rank 0's length repeats; the others' change at the last step
        return 3 + r if step < 2 else 3 + 2 * r

    for step in range(3):
        out = f(jnp.ones(batch_length(step, rank)))
        total = sum(batch_length(step, r) for r in range(size))
        np.testing.assert_allclose(out, [total + batch_length(step, 0)])


def test_mismatch_in_a_program_compiled_for_new_shapes_is_caught(comm, rank, size):
    """A call site checked once is checked again for a new signature (new shapes on every rank)."""
    if size == 1:
        pytest.skip("a mismatch needs two ranks")
    f = jax.jit(lambda x: allreduce(x, comm=comm))
    np.testing.assert_allclose(f(jnp.ones(3)), np.full(3, size))
    last = rank == size - 1
    failure = failure_of(lambda: f(jnp.ones(4 + last)).block_until_ready(), MISMATCH)
    assert_no_failures(failure, comm)
    np.testing.assert_allclose(f(jnp.ones(2)), np.full(2, size))


def test_every_call_mode_compares_call_order(comm, rank, size, every_call):
    if size == 1:
        np.testing.assert_allclose(allreduce(jnp.ones(2), comm=comm), np.ones(2))
        return
    f = jax.jit(lambda x: allreduce(x, comm=comm))
    f(jnp.ones(2)).block_until_ready()  # first run: checked in every mode
    # Steady state: the same shapes, but one rank calls with another dtype.
    failure = failure_of(lambda: f(jnp.ones(2, jnp.float32 if rank else jnp.float64)).block_until_ready(), MISMATCH)
    assert_no_failures(failure, comm)


def test_valid_programs_pass_in_every_mode(comm, size):
    f = jax.jit(lambda x: jax.lax.fori_loop(0, 5, lambda i, v: allreduce(v, comm=comm) / size, x))
    for mode in ("off", "every-call", "first-run"):
        configure(check=mode)
        np.testing.assert_allclose(f(jnp.ones(3)), np.ones(3))
        np.testing.assert_allclose(allreduce(jnp.ones(3), comm=comm), np.full(3, size))


class _FailedTokenBuffer:
    """What an asynchronous backend (GPU) leaves as the effect token of a program that failed."""

    def block_until_ready(self):
        raise jax.errors.JaxRuntimeError("INVALID_ARGUMENT: distlinalg: an earlier program failed")


def test_programs_run_after_a_failed_program_left_an_error_in_the_effect_token(comm, size):
    """On a GPU, a mismatch caught by one program must not fail every later program.

    The CPU backend raises a handler's error synchronously, so the token JAX hands
    from program to program never holds one; a GPU's asynchronous execution
    leaves it in the failed program's output token. That state is set up here
    (JAX's token for the MPI effect holds an error), then programs with the
    effect run and agree.
    """
    from distlinalg._runtime import jax_names
    from distlinalg.comm._core import mpi_effect

    f = jax.jit(lambda x: allreduce(x, comm=comm))
    g = jax.jit(lambda x: jax.lax.fori_loop(0, 3, lambda i, v: allreduce(v, comm=comm) / size, x))
    for program, expected in ((f, size), (g, 1.0)):
        jax_names.effect_tokens()[mpi_effect] = jax_names.token(_FailedTokenBuffer())
        np.testing.assert_allclose(program(jnp.ones(3)), np.full(3, expected))
        np.testing.assert_allclose(program(jnp.ones(3)), np.full(3, expected))


def test_program_without_results_raises_its_error_at_the_call(comm, size, monkeypatch):
    """On a GPU, a jitted program with no results (a barrier) that fails leaves its
    error only in its effect token; the call must raise it (every rank of a mismatch
    raises), drop the failed token, and leave programs with results asynchronous.

    Set up on the CPU: the program's output token for the MPI effect holds an error.
    """
    from distlinalg._runtime import jax_names
    from distlinalg.comm._core import mpi_effect

    token_set = jax_names._dispatch.RuntimeTokenSet
    hand_on = token_set.set_token_result

    def failing(self, eff, token):
        hand_on(self, eff, jax_names.token(_FailedTokenBuffer()) if eff == mpi_effect else token)

    without_results = jax.jit(lambda: barrier(comm=comm))
    with_results = jax.jit(lambda x: allreduce(x, comm=comm))
    without_results(), with_results(jnp.ones(2))  # compiled, and run as usual
    monkeypatch.setattr(token_set, "set_token_result", failing)
    with pytest.raises(jax.errors.JaxRuntimeError, match="an earlier program failed"):
        without_results()
    assert mpi_effect not in jax_names.effect_tokens()
    # A program with results returns; its error would come with them.
    np.testing.assert_allclose(with_results(jnp.ones(2)), np.full(2, size))
    assert isinstance(jax_names.effect_tokens()[mpi_effect]._buf, _FailedTokenBuffer)
    monkeypatch.undo()
    np.testing.assert_allclose(with_results(jnp.ones(2)), np.full(2, size))  # the next dispatch recovers
    without_results()


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64])
@pytest.mark.parametrize("op", ["max", "min"])
def test_nan_propagates_in_min_max_for_every_float_dtype(comm, rank, size, dtype, op):
    x = np.array([1.0, 2.0, 3.0])
    x[rank % 3] = np.nan  # each rank a NaN somewhere; rank 0's in entry 0
    got = np.asarray(allreduce(jnp.asarray(x, dtype), op, comm=comm), np.float64)
    assert np.isnan(got[0])
    expected_nan = {r % 3 for r in range(size)}
    for i in range(3):
        assert np.isnan(got[i]) == (i in expected_nan), (i, got)


def test_threads_with_communicators_of_their_own_run_at_once(comm, size):
    """Two threads, each on its own duplicate of the communicator, eager and jitted: correct
    sums and no deadlock (a process-wide lock on eager calls used to deadlock them)."""
    import threading

    comms = [comm.Dup(), comm.Dup()]
    results, errors = {}, []

    def worker(k):
        try:
            step = jax.jit(lambda x: allreduce(x, comm=comms[k]))
            results[k] = [float(allreduce(jnp.full(1, k + 1.0), comm=comms[k])[0]) for _ in range(10)]
            results[k] += [float(step(jnp.full(1, k + 1.0))[0]) for _ in range(10)]
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(f"{type(error).__name__}: {error}")

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    alive = [t.is_alive() for t in threads]
    assert not any(alive) and not errors, (alive, errors)
    assert results == {k: [(k + 1.0) * size] * 20 for k in (0, 1)}
    for c in comms:
        c.Free()


def test_second_thread_on_one_communicator_is_refused(comm, rank, size):
    """A thread calling an operation on a communicator that another thread is inside raises
    (MPI forbids it, and the two threads' messages would pair up differently on other ranks);
    every later call on that communicator raises too, on every rank that saw it."""
    import threading

    from distlinalg.comm import _core

    dup = comm.Dup()
    handle = _mpi.resolve_comm(dup)
    caught = []

    def second():
        try:
            allreduce(jnp.ones(2), comm=dup)
        except Exception as error:  # noqa: BLE001 - the message is what is checked
            caught.append(str(error))

    key = _core._enter(handle)  # this thread is inside a call on `dup`
    try:
        thread = threading.Thread(target=second)
        thread.start()
        thread.join(30)
    finally:
        _core._leave(key)
    if size == 1:  # one rank: computed locally, nothing can pair up wrongly
        assert caught == []
        np.testing.assert_allclose(allreduce(jnp.ones(2), comm=dup), np.ones(2))
    else:
        assert len(caught) == 1 and "another thread is inside a call on the same communicator" in caught[0], caught
        assert "comm.Dup()" in caught[0]
        later = failure_of(lambda: allreduce(jnp.ones(2), comm=dup), "two threads used this communicator at once")
        assert_no_failures(later, comm)
    np.testing.assert_allclose(allreduce(jnp.ones(1), comm=comm), [size])  # other communicators are unaffected
    dup.Free()
    # The refusal ends with the communicator: MPI hands the freed handle to the next Dup (MPICH
    # does at once), and that new communicator works.
    again = comm.Dup()
    try:
        np.testing.assert_allclose(allreduce(jnp.ones(2), comm=again), [size] * 2)
        assert jax.jit(lambda x: allreduce(x, comm=again))(jnp.ones(3)).tolist() == [size] * 3
    finally:
        again.Free()


# ---------------------------------------------------------------------------
# Whole jobs: a rank blocked where the others can never meet it.
def _launch(mode: str, ranks: int, timeout: float = 60.0, **env):
    mpiexec = Path(sys.executable).parent / "mpiexec"
    cmd = [str(mpiexec), "-n", str(ranks), sys.executable, str(JOB), mode]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=dict(os.environ, **env))
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        return None, out, time.monotonic() - start
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    return proc.returncode, out, time.monotonic() - start


JOBS = {
    # rank 1 calls a compiled program with a new shape; rank 0 reruns one already checked
    "new-shape-on-one-rank": "is inside allreduce(float32[3], op=sum) (not checked",
    # rank 1 makes one more eager call after rank 0 has finished its program
    "extra-call": "the end of its program",
    # a rank-dependent trip count of a while loop with a collective inside
    "while-trip-count": "mismatched communication",
}


@pytest.mark.serial
@pytest.mark.parametrize("mode", list(JOBS))
@pytest.mark.parametrize("ranks", [2, 3])
def test_job_with_a_rank_blocked_elsewhere_ends_with_the_message(mode, ranks):
    rc, out, seconds = _launch(mode, ranks)
    assert rc is not None, f"the job hung:\n{out}"
    assert rc != 0, out
    assert JOBS[mode] in out, out
    assert seconds < 40, (seconds, out)


@pytest.mark.serial
@pytest.mark.parametrize("mode", ["late-rank", "unread-result"])
def test_valid_endings_are_not_mismatches(mode):
    """Ranks reaching the end at different times, or with collectives still
    queued, finish cleanly (3 ranks: two wait in the exit check together)."""
    rc, out, seconds = _launch(mode, 3)
    assert rc == 0, out
    assert MISMATCH not in out, out
    assert out.count("finished") == 3, out
