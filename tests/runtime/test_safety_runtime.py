"""The safety net (distlinalg/_runtime/safety.py): failing, stuck or interrupted ranks end the job.

Tests marked ``serial`` start their own mpiexec jobs (tests/scripts/safety_job.py)
from one plain process, each bounded by a timeout and killed with its whole
process group afterwards; the others run on every rank of the suite's world.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

from distlinalg._runtime import safety as _safety
from distlinalg._runtime.env import parse_flag
from distlinalg.comm import allreduce, configure
from conftest import REPO_ROOT
from run_mpi import find_mpiexec

JOB = REPO_ROOT / "tests" / "scripts" / "safety_job.py"
HYDRA = "MPICH" in MPI.Get_library_version()  # Ctrl-C forwarding is launcher-specific


# ---------------------------------------------------------------------------
# Settings (every rank)
@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, True), ("", True), (" ", True), ("1", True), ("yes", True), ("ON", True),
     ("0", False), ("false", False), (" off ", False), ("No", False)],
)
def test_flag_values(value, expected):
    assert parse_flag("X", value, True) is expected
    if value is None or not value.strip():
        assert parse_flag("X", value, False) is False


@pytest.mark.parametrize("value", ["2", "enabled", "-1", "o n"])
def test_bad_flag_values_are_errors(value):
    with pytest.raises(ValueError, match="DISTLINALG_SIGNALS=.* is not a switch"):
        parse_flag("DISTLINALG_SIGNALS", value, True)


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, None), ("", None), ("0", None), (0, None), (0.0, None), ("2.5", 2.5), (3, 3.0), (" 10 ", 10.0)],
)
def test_timeout_values(value, expected):
    assert _safety.parse_timeout(value) == expected


@pytest.mark.parametrize("value", ["soon", "-1", -0.5, "nan", float("inf"), True, [1]])
def test_bad_timeout_values_are_errors(value):
    with pytest.raises(ValueError, match="timeout"):
        _safety.parse_timeout(value)


def test_configure_timeout_switches_the_watchdog(comm):
    monitor = _safety._monitor
    stall = _safety.get_stall()
    assert _safety.get_timeout() is None  # off by default
    assert stall == _safety.parse_timeout(os.environ.get("DISTLINALG_STALL") or "30")  # on by default
    with pytest.raises(ValueError, match="timeout='never'"):
        configure(timeout="never")
    assert _safety.get_timeout() is None
    configure(timeout=30)
    try:
        assert _safety.get_timeout() == 30.0
        configure(debug_log=False)  # other settings leave it alone
        assert _safety.get_timeout() == 30.0
        # Calls shorter than the timeout go through untouched.
        for _ in range(3):
            np.testing.assert_allclose(allreduce(jnp.ones(2), comm=comm), np.full(2, comm.Get_size()))
        if monitor.multiple and monitor.size > 1:
            deadline = time.monotonic() + 5
            while monitor.request is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert monitor.request is not None, "the watchdog posts its receive for report requests"
    finally:
        configure(timeout=0)
    assert _safety.get_timeout() is None
    configure(stall=0)  # the stall report off too: nothing left to serve
    try:
        deadline = time.monotonic() + 5
        while monitor.request is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert monitor.request is None, "switching the watchdog and the stall report off cancels its receive"
        with pytest.raises(ValueError, match="stall"):
            configure(stall=-1)
    finally:
        configure(stall=stall or 0)
    assert _safety.get_stall() == stall
    comm.Barrier()  # every rank is back to its settings before the next test runs


def test_describe_call_names_op_arguments_and_communicator(comm):
    from distlinalg._runtime import mpi as _mpi

    call = {"op": "recv", "dtype": "float64", "count": 3, "root": 1, "comm": _mpi.DEFAULT_COMM.handle,
            "rank": 0, "seconds": 2.5, "seq": 7}
    text = _safety.describe_call(call)
    assert text.startswith("recv(dtype=float64, count=3, peer=1, comm=<distlinalg default")
    assert "call #7" in text and "2.5 s" in text
    barrier = dict(call, op="barrier", dtype="-", count=0, root=-1)
    assert _safety.describe_call(barrier).startswith("barrier(comm=<distlinalg default")
    assert "root=2" in _safety.describe_call(dict(call, op="bcast", root=2))


def test_excepthook_prefixes_the_rank_and_aborts(monkeypatch, capsys):
    codes = []
    monkeypatch.setattr(_safety, "_abort", codes.append)
    hook = _safety._ExceptHook(sys.__excepthook__, rank=3, size=4)
    try:
        raise ValueError("broken on purpose")
    except ValueError as err:
        hook(type(err), err, err.__traceback__)
    hook(KeyboardInterrupt, KeyboardInterrupt(), None)
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert all(line.startswith("[rank 3] ") for line in lines), err
    assert "[rank 3] ValueError: broken on purpose" in lines
    assert "test_excepthook_prefixes_the_rank_and_aborts" in err  # the traceback itself
    assert "uncaught ValueError on rank 3 of 4; ending the job (MPI_Abort(1))" in err
    assert codes == [1, 130]


def test_excepthook_keeps_a_custom_hook(monkeypatch, capsys):
    codes, seen = [], []
    monkeypatch.setattr(_safety, "_abort", codes.append)
    hook = _safety._ExceptHook(lambda *args: seen.append(args[0]), rank=0, size=2)
    hook(RuntimeError, RuntimeError("x"), None)
    assert seen == [RuntimeError] and codes == [1]
    assert "uncaught RuntimeError on rank 0" in capsys.readouterr().err


def test_stacks_of_other_threads_are_readable():
    release = threading.Event()
    worker = threading.Thread(target=release.wait, name="safety-test-waiter")
    worker.start()
    try:
        text = _safety.python_stacks()
    finally:
        release.set()
        worker.join()
    assert text.startswith("Thread MainThread")
    assert "safety-test-waiter" in text and "test_stacks_of_other_threads_are_readable" in text


# ---------------------------------------------------------------------------
# Whole jobs (one plain process starts them)
def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DISTLINALG_", "PYTEST_"))}
    env.update(extra)
    return env


class Job:
    """An mpiexec job of safety_job.py in its own process group, its output collected by a thread."""

    def __init__(self, mode: str, ranks: int, **env: str) -> None:
        cmd = find_mpiexec() + ["-n", str(ranks), sys.executable, str(JOB), mode]
        self.ranks = ranks
        self.lines: list[str] = []
        self.all_ready = threading.Event()
        self.start = time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=_env(**env), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            # Ranks' lines can interleave ("ready 1ready 0\n"): count the words.
            if len(set(re.findall(r"ready (\d+)", self.output))) >= self.ranks:
                self.all_ready.set()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_ready(self, timeout: float = 40) -> float:
        """When every rank has made its first collective call (time.monotonic)."""
        assert self.all_ready.wait(timeout), f"ranks not ready after {timeout} s:\n{self.output}"
        return time.monotonic()

    def wait(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"job still running after {timeout} s:\n{self.output}")
        self.reader.join(5)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@pytest.fixture
def job():
    jobs: list[Job] = []

    def start(mode: str, ranks: int, **env: str) -> Job:
        jobs.append(Job(mode, ranks, **env))
        return jobs[-1]

    yield start
    for j in jobs:
        j.kill()


@pytest.mark.serial
@pytest.mark.parametrize(("mode", "ranks"), [("threads", 2), ("threads-jit", 3)])
def test_two_threads_on_one_communicator_raise_instead_of_mixing_messages(job, mode, ranks):
    """Two threads call 50 allreduces each on one communicator (both eagerly, or one in jitted
    programs), each summing its own value. They used to get each other's messages (8 and 47
    wrong results of 50, silently); now a thread that enters while the other is inside raises
    a clear error, and the other's later calls raise too: at most the call each thread had in
    flight can have paired wrongly."""
    j = job(mode, ranks)
    j.wait_ready()
    code = j.wait(60)
    out = j.output
    assert code != 0, out
    # The rank that finished first ends the job: one that saw the overlap itself, or one whose
    # wait the refusal of another rank cancelled.
    assert ("another thread is inside a call" in out or "two threads used this communicator at once" in out) \
        and "comm.Dup()" in out, out
    wrong = [int(n) for n in re.findall(r"rank \d wrong (\d+)", out)]
    assert wrong and max(wrong) <= 2, out  # per rank, both threads


@pytest.mark.serial
@pytest.mark.parametrize(("mode", "ranks"), [("threads-loop", 2), ("threads-loop-stagger", 2),
                                             ("threads-loop", 3), ("threads-loop-stagger", 3)])
def test_two_threads_on_one_communicator_every_thread_comes_back(job, mode, ranks):
    """The probe's repro (issue 57): two threads per rank, each a jitted loop of 300 allreduces on
    one communicator. The rank that sees the threads overlap refuses its later calls; a thread of
    another rank used to wait for ever for partners that never came (the refusal was this
    rank's alone). Now the refusal reaches every rank (the responder), and a wait on such a
    communicator is cancelled: every thread on every rank comes back with the documented error
    within seconds. 'stagger': the other ranks run their threads one after the other, so they
    never see an overlap themselves. Run until two runs have seen the overlap (it is a race: a
    run whose threads happened to take turns on every rank raises nothing, as documented, and
    must still end), at most five runs."""
    overlapped = 0
    for _ in range(5):
        j = job(mode, ranks, DISTLINALG_STALL="0")
        j.wait_ready()
        j.wait(60)  # (its status: the first rank to leave ends the job, the others may be killed)
        out = j.output
        reports = re.findall(r"rank (\d) alive (\d) errors (\d) seconds ([\d.]+)", out)
        assert len(reports) == ranks, out
        for _, alive, _, seconds in reports:
            assert alive == "0" and float(seconds) < 10, out  # every thread back, within seconds
        errors = re.findall(r"rank \d thread error: (.*)", out)
        assert all(("two threads used this communicator at once" in e or "another thread is inside a call" in e)
                   and "comm.Dup()" in e for e in errors), out
        overlapped += bool(errors)
        if overlapped == 2:
            break
    assert overlapped == 2, out


@pytest.mark.serial
@pytest.mark.parametrize("ranks", [2, 3])
def test_uncaught_exception_ends_the_job(job, ranks):
    j = job("raise", ranks)
    ready = j.wait_ready()
    code = j.wait(10)
    out = j.output
    assert code == _safety.EXIT_ERROR, out
    assert time.monotonic() - ready < 10
    assert "[rank 1] ValueError: rank one fails on purpose" in out, out
    assert "[rank 1]   File " in out and "in fail_on_rank_one" in out  # the traceback, annotated
    assert f"uncaught ValueError on rank 1 of {ranks}; ending the job" in out


@pytest.mark.serial
def test_abort_on_error_off_leaves_the_hang_to_the_watchdog(job):
    # Rank 1 raises and exits normally (it then waits in MPI_Finalize); rank
    # 0 waits in its barrier until the watchdog ends the job, reporting rank
    # 1 as not answering. The end-of-program check would catch this sooner.
    j = job("raise", 2, DISTLINALG_ABORT_ON_ERROR="0", DISTLINALG_TIMEOUT="2", DISTLINALG_CHECK="0")
    ready = j.wait_ready()
    code = j.wait(20)
    out = j.output
    assert code == _safety.EXIT_TIMEOUT, out
    assert "ValueError: rank one fails on purpose" in out and "uncaught ValueError" not in out, out
    assert "[rank 0] distlinalg watchdog: barrier on rank 0 of 2 has been blocked" in out, out
    assert "[rank 0]   rank 1: did not answer" in out, out
    assert "entered barrier: 0; not in it: 1 (no answer)" in out, out
    assert time.monotonic() - ready < 15


@pytest.mark.serial
@pytest.mark.parametrize(
    ("mode", "ranks", "stuck", "function", "entered", "absent"),
    [
        ("recv", 3, 1, "receive_what_nobody_sends", "1", "0 (no call), 2 (no call)"),
        ("barrier", 2, 0, "barrier_without_the_last_rank", "0", "1 (no call)"),
    ],
)
def test_watchdog_reports_and_ends_a_hang(job, mode, ranks, stuck, function, entered, absent):
    # Signature checks off: this tests the watchdog alone.
    j = job(mode, ranks, DISTLINALG_TIMEOUT="2", DISTLINALG_CHECK="0")
    ready = j.wait_ready()
    code = j.wait(20)
    elapsed = time.monotonic() - ready
    out = j.output
    assert code == _safety.EXIT_TIMEOUT, out
    assert elapsed < 15, out
    tag = f"[rank {stuck}] "
    assert f"{tag}distlinalg watchdog: {mode} on rank {stuck} of {ranks} has been blocked" in out, out
    assert f"{tag}  in {mode}(" in out  # the call and its arguments
    for r in range(ranks):  # every rank printed its state and its Python stack
        assert f"state of rank {r}:" in out, (r, out)
        assert f"[rank {r}]   File \"{JOB}\"" in out and f"in {function}" in out, (r, out)
    assert f"{tag}distlinalg watchdog: which ranks are in {mode}" in out, out
    assert f"entered {mode}: {entered}; not in it: {absent}" in out, out
    assert f"MPI_Abort({_safety.EXIT_TIMEOUT})" in out


@pytest.mark.serial
@pytest.mark.parametrize(("mode", "ranks"), [("deadlock", 2), ("deadlock-jit", 3)])
def test_stall_is_reported_on_every_rank_and_the_job_goes_on(job, mode, ranks):
    """Both ranks receive first (the program's own deadlock), default check
    mode: within the stall period every rank prints a report beginning
    "distlinalg: stalled" (the call, its arguments, what each rank is doing),
    the job keeps waiting, and the watchdog ends it later (issue 43)."""
    # The watchdog's timeout leaves room for compiling the jitted exchange on
    # oversubscribed cores before the stall period starts.
    j = job(mode, ranks, DISTLINALG_STALL="2", DISTLINALG_TIMEOUT="20")
    ready = j.wait_ready()
    def reported(r):  # a header line of rank r's, at the start of a line as documented
        return re.search(rf"^distlinalg: stalled: .*state of rank {r}:$", j.output, re.M)

    def complete():  # every rank's report, and the table of the ranks that asked (printed after the answers)
        return all(reported(r) for r in range(ranks)) and "Still waiting" in j.output

    deadline = time.monotonic() + 17
    while time.monotonic() < deadline and not complete():
        time.sleep(0.2)
    out = j.output
    assert j.proc.poll() is None, out  # the stall report ends nothing
    for r in range(ranks):
        assert re.search(rf"^distlinalg: stalled: .*state of rank {r}:$", out, re.M), (r, out)
    for r in (0, 1):  # the two blocked ranks: their own report, with the call
        assert re.search(rf"^distlinalg: stalled: recv on rank {r} of {ranks} has been blocked", out, re.M), out
        assert f"[rank {r}]   in recv(dtype=float32, count=3, peer={1 - r}" in out, out
    assert "which ranks are in recv" in out and "Still waiting" in out, out
    assert "a cycle of receives, a deadlock of the program's own: rank 0 waits for 1, rank 1 waits for 0" in out, out
    assert out.count(f"distlinalg: stalled: recv on rank 0 of {ranks}") == 1, out  # once per call
    code = j.wait(40)
    assert code == _safety.EXIT_TIMEOUT, out
    assert time.monotonic() - ready > 19


@pytest.mark.serial
def test_stall_report_off(job):
    j = job("deadlock", 2, DISTLINALG_STALL="0", DISTLINALG_TIMEOUT="4")
    j.wait_ready()
    code = j.wait(30)
    assert code == _safety.EXIT_TIMEOUT and "distlinalg: stalled" not in j.output, j.output


@pytest.mark.serial
def test_watchdog_at_thread_level_serialized_reports_locally(job):
    j = job("recv", 2, DISTLINALG_TIMEOUT="1", DISTLINALG_CHECK="0", SAFETY_THREAD_LEVEL="serialized")
    ready = j.wait_ready()
    code = j.wait(20)
    out = j.output
    assert code == _safety.EXIT_TIMEOUT, out
    assert time.monotonic() - ready < 15
    assert "[rank 1] distlinalg watchdog: recv on rank 1 of 2 has been blocked" in out, out
    assert "thread level SERIALIZED" in out and "which ranks are in recv" in out, out
    assert "entered recv: 1; not in it: 0 (not asked)" in out, out


@pytest.mark.serial
@pytest.mark.parametrize(("mode", "ranks"), [("loop", 2), ("sleep", 3)])
def test_one_ctrl_c_ends_the_job(job, mode, ranks):
    """SIGINT to the launcher's process group (a terminal's Ctrl-C)."""
    j = job(mode, ranks)
    j.wait_ready()
    time.sleep(1.0)  # well inside the loop (or the sleep)
    sent = time.monotonic()
    os.killpg(j.proc.pid, signal.SIGINT)
    code = j.wait(10)
    elapsed = time.monotonic() - sent
    out = j.output
    assert code != 0, out
    assert elapsed < 3.0, (elapsed, out)
    if HYDRA:
        assert code == _safety.EXIT_INTERRUPT, out
        if mode == "loop":  # the main thread is inside XLA: the monitor thread ends the job
            # The report names the operation: the call the main thread is in, or, when the
            # report's moment falls between two calls of the loop, the last one seen.
            assert "KeyboardInterrupt on rank" in out and "allreduce(dtype=float32" in out, out
            assert "in long_allreduce_loop" in out  # the Python stack
        else:  # the main thread raises KeyboardInterrupt itself: the excepthook ends the job
            assert "uncaught KeyboardInterrupt on rank" in out, out


@pytest.mark.serial
@pytest.mark.parametrize(
    ("name", "value"),
    [("DISTLINALG_TIMEOUT", "soon"), ("DISTLINALG_ABORT_ON_ERROR", "maybe"), ("DISTLINALG_SIGNALS", "2")],
)
def test_bad_environment_values_fail_at_import(name, value):
    out = subprocess.run([sys.executable, "-c", "import distlinalg"], cwd=REPO_ROOT, env=_env(**{name: value}),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "ValueError" in out.stderr and f"{name}={value!r}" in out.stderr, out.stderr


@pytest.mark.serial
def test_bad_environment_value_fails_on_every_rank_without_hanging():
    cmd = find_mpiexec() + ["-n", "2", sys.executable, "-c", "import distlinalg"]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=_env(DISTLINALG_TIMEOUT="-3"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0
    assert out.count("ValueError: distlinalg: DISTLINALG_TIMEOUT='-3'") == 2, out


@pytest.mark.serial
@pytest.mark.parametrize("variable", ["DISTLINALG_DEBUG", "DISTLINALG_YNN_FUSION", "DISTLINALG_CUDA_EMULATION"])
def test_every_switch_reads_the_same_words(variable):
    """The switches outside the safety module follow _env.parse_flag: the six
    words in any case, and a ValueError naming the variable for a typo (any
    value but 0/false/no/off used to turn DISTLINALG_DEBUG on, and only "1"
    turned DISTLINALG_YNN_FUSION on)."""
    probe = ("import distlinalg, distlinalg._runtime.mpi as m, distlinalg._runtime.cuda as c\n"
             "print(m._native.settings()['debug_log'], c.emulated(), distlinalg.YNN_FUSION.startswith('kept'))")

    def run(value, code=probe):
        return subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=_env(**{variable: value}),
                              capture_output=True, text=True, timeout=120)

    column = ["DISTLINALG_DEBUG", "DISTLINALG_CUDA_EMULATION", "DISTLINALG_YNN_FUSION"].index(variable)
    for value, expected in ((" Yes", "True"), ("on", "True"), ("OFF", "False"), ("", "False")):
        out = run(value)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split()[column] == expected, (value, out.stdout)
    bad = run("flase", "import distlinalg")
    assert bad.returncode != 0 and f"ValueError: distlinalg: {variable}='flase' is not a switch" in bad.stderr, \
        bad.stderr
