"""Safety net of an MPI job: a failing, stuck or interrupted rank ends the whole job.

Under ``mpiexec -n P python script.py`` a rank that dies leaves the others
waiting forever in their next collective, and a rank that waits forever
leaves everyone waiting with it. `install` (called when distlinalg is
imported) sets up three remedies:

* **Uncaught exceptions** (``DISTLINALG_ABORT_ON_ERROR``, on by default when
  the world has more than one rank): ``sys.excepthook`` prints the traceback
  with the rank on every line, then ``MPI_Abort`` ends the job (exit status 1,
  130 for KeyboardInterrupt), as ``python -m mpi4py script.py`` does.
* **Stall report** (``DISTLINALG_STALL=seconds``, default 30, ``0`` off, or
  ``distlinalg.comm.configure(stall=...)``): a distlinalg MPI call in
  progress longer than that prints, once per call, a report whose first line
  begins with ``distlinalg: stalled``: the call and its arguments, this
  rank's Python stack, and what every other rank is doing (each prints its
  own state and stack too). The job goes on waiting (a slow partner is not
  an error); the watchdog below ends it. A deadlock of the program's own
  (both ranks receive first) is named within the stall period.
* **Watchdog** (``DISTLINALG_TIMEOUT=seconds`` or
  ``distlinalg.comm.configure(timeout=...)``, off by default): a distlinalg
  MPI call in progress longer than that makes every rank print its current
  call and Python stacks, the rank that noticed prints which ranks are in
  that operation and which are not, and the job ends (status 124).
* **Ctrl-C** (``DISTLINALG_SIGNALS``, on by default): Python runs signal
  handlers only between bytecodes, so a SIGINT arriving while the main thread
  is inside XLA or an MPI call would wait for it to return, which for a stuck
  collective is never. If the main thread does not take the KeyboardInterrupt
  within a second, the rank prints where it was and ends the job (status 130).

The watchdog and the Ctrl-C handling share one daemon thread, which sleeps in
``select()`` on a socket that is also Python's signal wakeup fd; it polls
(every 0.2 s) only while the watchdog is on or a SIGINT is pending.

Not covered: ``sys.exit(n)`` on one rank (Python gives no hook that sees the
exit status; replacing ``sys.exit`` would misfire when SystemExit is caught):
the exiting rank waits in ``MPI_Finalize``, so turn the watchdog on to end
such a job, or use ``python -m mpi4py`` or ``MPI.COMM_WORLD.Abort(n)``.
Exceptions in threads other than the main thread end only that thread, as in
plain Python (``threading.excepthook`` is left alone): the program may well
recover from them.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from types import TracebackType
from typing import Any, Callable

from mpi4py import MPI

from . import mpi as _mpi
from .env import switch

ABORT_ENV = "DISTLINALG_ABORT_ON_ERROR"
TIMEOUT_ENV = "DISTLINALG_TIMEOUT"
SIGNALS_ENV = "DISTLINALG_SIGNALS"
STALL_ENV = "DISTLINALG_STALL"
DEFAULT_STALL_S = 30.0

EXIT_ERROR = 1
EXIT_TIMEOUT = 124  # as coreutils' timeout(1)
EXIT_INTERRUPT = 128 + signal.SIGINT

POLL_S = 0.2  # watchdog poll period (shorter for timeouts under a second)
STALL_POLL_S = 1.0  # poll period when only the stall report is on (it reports to the second)
SIGINT_GRACE_S = 1.0  # time the main thread gets to raise KeyboardInterrupt itself
ABORT_DELAY_S = 0.25  # between the last report and MPI_Abort
REPLY_GRACE_S = 2.0  # time the reporting rank waits for the other ranks' answers
RESPONDER_FALLBACK_S = 10.0  # a rank that answered aborts itself if the job is still alive then

_TAG_REQUEST = 1  # on the private communicator: "report your state to me"
_TAG_REPLY = 2
_MAX_MESSAGE = 16384
_P2P_OPS = ("send", "recv", "sendrecv")

# ---------------------------------------------------------------------------
# Settings (on/off switches are read by distlinalg/_runtime/env.py, as in the other modules)
def parse_timeout(value: Any, name: str = "timeout") -> float | None:
    """A watchdog timeout in seconds: None, 0 or "" mean off, else a finite number > 0."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return None
        try:
            seconds = float(text)
        except ValueError:
            raise ValueError(f"distlinalg: {name}={value!r} is not a number of seconds") from None
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"distlinalg: {name} must be a number of seconds or None, got {value!r}")
    else:
        seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"distlinalg: {name}={value!r} must be a finite number of seconds >= 0 (0: off)")
    return seconds or None


# ---------------------------------------------------------------------------
# Output helpers
def _write(text: str) -> None:
    """One write of `text` to stderr, flushed (so ranks' reports interleave by blocks, not lines)."""
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - a closed or broken sys.stderr must not stop an abort
        try:
            os.write(2, text.encode(errors="replace"))
        except OSError:
            pass


def _prefix(text: str, tag: str) -> str:
    return "".join(f"{tag}{line}\n" for line in text.rstrip("\n").split("\n"))


def python_stacks(skip: int | None = None) -> str:
    """The Python stacks of this process's threads, main thread first (callable from any thread)."""
    frames = sys._current_frames()
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    order = sorted(frames, key=lambda ident: ident != main)
    parts = []
    for ident in order:
        if ident == skip:
            continue
        stack = "".join(traceback.format_stack(frames[ident]))
        parts.append(f"Thread {names.get(ident, ident)!s} (most recent call last):\n{stack}")
    if main not in frames:
        parts.insert(0, "Main thread: no Python frame (interpreter exiting, or in native code)\n")
    return "".join(parts)


def _comm_label(handle: int) -> str:
    known = _mpi.known_communicator(handle)
    if handle == _mpi.DEFAULT_COMM.handle:
        name = "distlinalg default"
    elif handle == _mpi.handle_of(MPI.COMM_WORLD):
        name = "COMM_WORLD"
    else:
        name = f"{handle & 0xFFFFFFFF:#x}" if -(1 << 31) <= handle < 0 else f"{handle:#x}"
    return f"{name}, size {known.size}" if known is not None else name


def describe_call(call: dict[str, Any]) -> str:
    """One line for a record of `_mpi.calls_in_progress()`."""
    args = [] if call.get("dtype") in (None, "-") else [f"dtype={call['dtype']}", f"count={call.get('count')}"]
    root = int(call.get("root", -1))
    if root >= 0:
        args.append(f"{'peer' if call.get('op') in _P2P_OPS else 'root'}={root}")
    args.append(f"comm=<{_comm_label(int(call.get('comm', 0)))}>, rank {call.get('rank')} in it")
    return f"{call.get('op')}({', '.join(args)}), call #{call.get('seq')}, for {float(call.get('seconds', 0)):.1f} s"


# ---------------------------------------------------------------------------
# A. Uncaught exceptions
class _ExceptHook:
    """sys.excepthook: the previous hook's report, annotated with the rank, then MPI_Abort."""

    def __init__(self, previous: Callable[..., Any], rank: int, size: int) -> None:
        self.previous = previous
        self.rank = rank
        self.size = size
        self.pid = os.getpid()

    def __call__(self, kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if os.getpid() != self.pid:  # a forked child is no MPI process: it must not abort the job
            self.previous(kind, value, tb)
            return
        tag = f"[rank {self.rank}] "
        try:
            if self.previous is sys.__excepthook__:
                text = "".join(traceback.format_exception(kind, value, tb))
                _write(_prefix(text, tag))
            else:  # someone else's formatting: keep it, mark where it starts
                _write(f"{tag}uncaught {kind.__name__} on rank {self.rank}:\n")
                self.previous(kind, value, tb)
        finally:
            # The interactive interpreter calls the hook for every error and
            # carries on; so does anything else that runs with the prompt.
            if not (sys.flags.interactive or hasattr(sys, "ps1")):
                code = EXIT_INTERRUPT if issubclass(kind, KeyboardInterrupt) else EXIT_ERROR
                _write(
                    f"{tag}distlinalg: uncaught {kind.__name__} on rank {self.rank} of {self.size}; "
                    f"ending the job (MPI_Abort({code})). {ABORT_ENV}=0 turns this off.\n"
                )
                _abort(code)


def _abort(code: int, *, mpi: bool = True) -> None:
    """End the whole job now: MPI_Abort (unless `mpi` is False), else a plain exit."""
    try:
        sys.stdout.flush()  # what the program printed so far is not lost with the process
    except Exception:  # noqa: BLE001
        pass
    # MPI_Abort makes the launcher kill every process at once; Hydra was
    # seen to drop the aborting rank's last lines. Give it time to forward them.
    time.sleep(ABORT_DELAY_S)
    try:
        if mpi and MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.COMM_WORLD.Abort(code)
    finally:
        os._exit(code)


# ---------------------------------------------------------------------------
# B + C. The monitor thread: watchdog and Ctrl-C
class _Monitor:
    """State shared by the main thread (settings) and the monitor thread."""

    def __init__(self, world_rank: int, world_size: int, signals: bool) -> None:
        self.rank = world_rank
        self.size = world_size
        self.multiple = _mpi.THREAD_LEVEL >= MPI.THREAD_MULTIPLE
        # Made collectively on every rank at import: the watchdog's queries
        # never match user or distlinalg traffic. Cheap even when unused.
        self.comm = MPI.COMM_WORLD.Dup()
        self.comm.Set_name("distlinalg-watchdog")
        # A program that calls MPI.Finalize() itself: MPI_Finalize first
        # deletes MPI_COMM_SELF's attributes, which runs shutdown() before
        # anything is torn down. (At interpreter exit, the atexit hook does.)
        self.keyval = MPI.Comm.Create_keyval(delete_fn=lambda *_: self.shutdown())
        MPI.COMM_SELF.Set_attr(self.keyval, None)
        self.closed = False
        self.pid = os.getpid()
        self.timeout: float | None = None
        self.stall: float | None = None
        self.stalls_reported: set[tuple] = set()  # calls this rank reported as stalled
        self.stalls_answered: set[tuple] = set()  # other ranks' stalled calls it printed its state for
        self.lock = threading.Lock()
        self.stopping = False  # atexit ran: no more MPI from the thread
        self.mpi_lock = threading.Lock()  # held by whoever uses self.comm
        self.thread: threading.Thread | None = None
        self.wake_r, self.wake_w = socket.socketpair()
        for s in (self.wake_r, self.wake_w):
            s.setblocking(False)
        self.wakeup_fd_set = signals and self._set_wakeup_fd()
        # Monitor-thread state.
        self.request: Any = None  # standing Irecv for report requests
        self.request_buf = bytearray(_MAX_MESSAGE)
        self.sends: list[Any] = []  # Isends kept alive until the job ends
        self.responded_at: float | None = None
        self.printed_local = False
        self.sigint_at: float | None = None
        self.sigint_mark: Any = None
        # The distlinalg calls seen in progress during the grace period, by call number: a loop
        # of short calls spends part of its time between them, so one look at the end can miss
        # the operation the program is in.
        self.sigint_calls: dict[Any, dict[str, Any]] = {}

    # -- set-up, from the main thread -------------------------------------
    def _set_wakeup_fd(self) -> bool:
        try:
            old = signal.set_wakeup_fd(self.wake_w.fileno(), warn_on_full_buffer=False)
        except (ValueError, OSError):  # not the main thread of the main interpreter
            return False
        if old != -1:  # someone (asyncio, the application) owns it: leave theirs
            signal.set_wakeup_fd(old)
            return False
        return True

    def set_timeout(self, seconds: float | None) -> None:
        self._set(timeout=seconds)

    def set_stall(self, seconds: float | None) -> None:
        self._set(stall=seconds)

    def _set(self, **settings: float | None) -> None:
        if os.getpid() != self.pid:
            return  # a forked child: no monitor thread, no MPI
        with self.lock:
            for name, value in settings.items():
                setattr(self, name, value)
            active = self.timeout or self.stall
        if self.thread is None and (active or self.wakeup_fd_set):
            self.thread = threading.Thread(target=self._run, name="distlinalg-monitor", daemon=True)
            self.thread.start()
        self._wake()

    def after_fork_in_child(self) -> None:
        """The child of os.fork() has no monitor thread; its signals must not wake the parent's."""
        if not self.wakeup_fd_set:
            return
        try:
            old = signal.set_wakeup_fd(-1)
            if old not in (-1, self.wake_w.fileno()):
                signal.set_wakeup_fd(old)  # someone else's since: leave it
        except ValueError:  # forked from a thread other than the main one
            pass

    def _wake(self) -> None:
        try:
            self.wake_w.send(b"\0")  # 0 is no signal number: "settings changed"
        except OSError:
            pass

    def shutdown(self) -> None:
        """At exit, before mpi4py's MPI_Finalize: end the thread's MPI use, free the communicator.

        The thread itself lives on (without MPI) so that Ctrl-C still works
        while the rest of the exit, MPI_Finalize included, waits for other ranks.
        """
        if os.getpid() != self.pid:
            return  # atexit in a forked child: the communicator is the parent's
        with self.lock:
            self.stopping = True
        # A report in progress ends in MPI_Abort; do not wait for it forever.
        if not self.mpi_lock.acquire(timeout=REPLY_GRACE_S + 1.0):
            return
        try:
            if not self.closed and not MPI.Is_finalized():
                self.closed = True
                self._cancel_request()
                self.comm.Free()
        finally:
            self.mpi_lock.release()

    # -- the monitor thread ----------------------------------------------------
    def _run(self) -> None:
        if hasattr(signal, "pthread_sigmask"):
            # Let the kernel deliver SIGINT to another thread, ideally the
            # main one, whose blocking system calls it then interrupts.
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        while True:
            timeout, stall = self._active_settings()
            period = None  # idle: sleep until a signal or a settings change
            if timeout or self.sigint_at is not None:
                period = min(POLL_S, max(0.02, (timeout or POLL_S) / 4))
            elif stall:
                period = min(STALL_POLL_S, max(0.02, stall / 4))
            ready, _, _ = select.select([self.wake_r], [], [], period)
            if ready:
                self._read_wake_bytes()
            if self.sigint_at is not None:
                self._check_interrupt()
            self._watch(*self._active_settings())  # the settings may have changed while asleep

    def _active_settings(self) -> tuple[float | None, float | None]:
        with self.lock:
            return (None, None) if self.stopping else (self.timeout, self.stall)

    def _read_wake_bytes(self) -> None:
        try:
            data = self.wake_r.recv(256)
        except OSError:
            return
        # Python's C-level handler writes the signal number; act only if the
        # Python-level handler is the default one (a handler of the
        # application's own decides for itself what Ctrl-C means).
        if signal.SIGINT in data and self.sigint_at is None:
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                self.sigint_at = time.monotonic()
                self.sigint_mark = _main_thread_mark()
                self.sigint_calls = {}

    def _check_interrupt(self) -> None:
        assert self.sigint_at is not None
        if _main_thread_mark() != self.sigint_mark:
            # The main thread ran bytecode since the signal, so the
            # interrupt reached Python: KeyboardInterrupt is raised (and ends
            # the job through the excepthook) or caught by the program.
            self.sigint_at = None
            return
        calls = _mpi.calls_in_progress()
        for call in calls:
            self.sigint_calls[call.get("seq")] = call
        if time.monotonic() - self.sigint_at < SIGINT_GRACE_S:
            return
        if calls:
            where = "; ".join(describe_call(c) for c in calls)
        elif self.sigint_calls:
            seen = self.sigint_calls[max(self.sigint_calls, key=lambda k: -1 if k is None else int(k))]
            where = (f"a JAX computation, between its distlinalg calls ({len(self.sigint_calls)} seen since "
                     f"the signal; the last: {describe_call(seen)})")
        else:
            where = "a JAX computation or other native code"
        _write(_prefix(
            f"KeyboardInterrupt on rank {self.rank} of {self.size} while in {where}\n"
            f"(the main thread could not raise it for {SIGINT_GRACE_S:.0f} s); ending the job "
            f"({SIGNALS_ENV}=0 turns this off).\n" + python_stacks(skip=threading.get_ident()),
            f"[rank {self.rank}] ",
        ))
        _abort(EXIT_INTERRUPT, mpi=self.size > 1)

    def _watch(self, timeout: float | None, stall: float | None = None) -> None:
        if not timeout and not stall and self.request is None:
            return  # the idle case: nothing to do, no lock taken
        with self.mpi_lock:
            with self.lock:
                stopping = self.stopping
            if stopping:
                return  # shutdown() cleans up
            if not timeout and not stall:
                self._cancel_request()
                return
            self._watch_locked(timeout, stall)

    def _watch_locked(self, timeout: float | None, stall: float | None = None) -> None:
        if self.multiple and self.size > 1:
            if self.request is None:
                self.request = self.comm.Irecv(self.request_buf, source=MPI.ANY_SOURCE, tag=_TAG_REQUEST)
            self._serve_requests(reporting=False)
        if self.responded_at is not None:
            if time.monotonic() - self.responded_at > REPLY_GRACE_S + RESPONDER_FALLBACK_S:
                _write(f"[rank {self.rank}] distlinalg watchdog: the reporting rank did not end the job; "
                       "ending it from here.\n")
                _abort(EXIT_TIMEOUT)
            return  # another rank is reporting: do not start a second report
        calls = _mpi.calls_in_progress()
        stuck = [c for c in calls if timeout and float(c.get("seconds", 0.0)) > timeout]
        if stuck:
            self._report(max(stuck, key=lambda c: c["seconds"]), timeout)
            return
        stalled = [c for c in calls if stall and float(c.get("seconds", 0.0)) > stall
                   and _call_key(c) not in self.stalls_reported]
        if stalled:
            self._report_stall(max(stalled, key=lambda c: c["seconds"]), stall)

    def _cancel_request(self) -> None:
        if self.request is None:
            return
        self.request.Cancel()
        self.request.Wait()
        self.request = None

    # -- cross-rank report ----------------------------------------------------
    def _state(self) -> dict[str, Any]:
        """What this rank tells the reporting rank."""
        main = sys._current_frames().get(threading.main_thread().ident)
        where = ""
        if main is not None:
            summary = _innermost_user_frame(traceback.extract_stack(main))
            where = f"{summary.filename}:{summary.lineno} in {summary.name}"
        calls = _mpi.calls_in_progress()
        return {
            "rank": self.rank,
            "ops": [c.get("op") for c in calls],
            "peers": [int(c.get("root", -1)) for c in calls],
            "calls": [describe_call(c) for c in calls],  # described here: comm names are local
            "started": _mpi.calls_started(),
            "main": where,
        }

    def _print_local(self, header: str) -> None:
        if self.printed_local:
            return
        self.printed_local = True
        self._print_state(header)

    def _print_state(self, header: str, *, tag_header: bool = True) -> None:
        """`header`, this rank's calls in progress and its Python stacks, on stderr.

        Every line is tagged ``[rank N]``; the header too unless `tag_header` is
        False (the stall reports' headers begin with ``distlinalg: stalled``, as
        documented, so ``grep '^distlinalg: stalled'`` finds them; they name
        the rank themselves)."""
        calls = _mpi.calls_in_progress()
        lines = [f"  in {describe_call(c)}" for c in calls] or ["  not in a distlinalg MPI call"]
        started = _mpi.calls_started()
        if started is not None:
            lines.append(f"  distlinalg MPI calls started by this rank: {started}")
        text = "\n".join(lines) + "\n" + python_stacks(skip=threading.get_ident())
        tag = f"[rank {self.rank}] "
        _write((tag if tag_header else "") + header + "\n" + _prefix(text, tag))

    def _serve_requests(self, *, reporting: bool) -> bool:
        """Answer pending report requests; True when a lower rank is reporting (we yield)."""
        yield_to_lower = False
        status = MPI.Status()
        while self.request is not None and self.request.Test(status):
            source = status.Get_source()
            try:
                asker = json.loads(bytes(self.request_buf[: status.Get_count(MPI.BYTE)]))
            except ValueError:
                asker = {}
            if asker.get("kind") == "stall":
                # Another rank's stall report: print this rank's state once per
                # stalled call, and do not end anything.
                key = (source, asker.get("call"))
                own_stall = any(_call_key(c) in self.stalls_reported for c in _mpi.calls_in_progress())
                if key not in self.stalls_answered and not own_stall:  # (its own report has its state)
                    self.stalls_answered.add(key)
                    self._print_state(
                        f"distlinalg: stalled: rank {source} has been blocked for {asker.get('seconds', '?')} s "
                        f"in {asker.get('call', 'a call')}; state of rank {self.rank}:", tag_header=False)
                self.sends.append(self.comm.Isend(self._encode(self._state()), dest=source, tag=_TAG_REPLY))
                self.request = self.comm.Irecv(self.request_buf, source=MPI.ANY_SOURCE, tag=_TAG_REQUEST)
                continue
            if not reporting and self.responded_at is None:
                self.responded_at = time.monotonic()
            self._print_local(
                f"distlinalg watchdog: rank {source} timed out ({asker.get('timeout', '?')} s) in "
                f"{asker.get('call', 'a call')}; state of rank {self.rank}:"
            )
            self.sends.append(self.comm.Isend(self._encode(self._state()), dest=source, tag=_TAG_REPLY))
            if reporting and source < self.rank:
                yield_to_lower = True
            self.request = self.comm.Irecv(self.request_buf, source=MPI.ANY_SOURCE, tag=_TAG_REQUEST)
        return yield_to_lower

    @staticmethod
    def _encode(obj: dict[str, Any]) -> bytes:
        data = json.dumps(obj).encode()
        if len(data) > _MAX_MESSAGE:  # many calls in flight: keep the first ones
            obj = dict(obj, calls=obj["calls"][:8], ops=obj["ops"][:8])
            data = json.dumps(obj).encode()[:_MAX_MESSAGE]
        return data

    def _report(self, call: dict[str, Any], timeout: float) -> None:
        """This rank timed out: local report, ask the others, print who is where, abort."""
        op = str(call.get("op"))
        self._print_local(
            f"distlinalg watchdog: {op} on rank {self.rank} of {self.size} has been blocked for "
            f"{float(call['seconds']):.1f} s (timeout {timeout:g} s, {TIMEOUT_ENV}); state of rank {self.rank}:"
        )
        states: dict[int, dict[str, Any] | None] = {self.rank: self._state()}
        if self.multiple and self.size > 1:
            if self._gather_states(states, call, timeout):
                self.responded_at = time.monotonic()
                return  # a lower rank reports the same hang: it prints the table and aborts
        _write(self._table(op, states, asked=self.multiple))
        _abort(EXIT_TIMEOUT)

    def _report_stall(self, call: dict[str, Any], stall: float) -> None:
        """A call of this rank has been blocked longer than the stall period:
        say so once, with every rank's state, and go on waiting."""
        self.stalls_reported.add(_call_key(call))
        op = str(call.get("op"))
        seconds = float(call["seconds"])
        self._print_state(
            f"distlinalg: stalled: {op} on rank {self.rank} of {self.size} has been blocked for {seconds:.1f} s "
            f"({STALL_ENV}={stall:g}; the job goes on waiting, {TIMEOUT_ENV} ends it); state of rank {self.rank}:",
            tag_header=False,
        )
        states: dict[int, dict[str, Any] | None] = {self.rank: self._state()}
        if self.multiple and self.size > 1:
            self._gather_states(states, call, stall, kind="stall", seconds=round(seconds, 1))
        _write(self._table(op, states, asked=self.multiple, stalled=True))

    def _gather_states(self, states: dict[int, dict[str, Any] | None], call: dict[str, Any], timeout: float,
                       *, kind: str = "timeout", seconds: float | None = None) -> bool:
        ask = self._encode({"call": describe_call(call), "timeout": timeout, "kind": kind, "seconds": seconds})
        buffers = {r: bytearray(_MAX_MESSAGE) for r in range(self.size) if r != self.rank}
        replies = {r: self.comm.Irecv(buf, source=r, tag=_TAG_REPLY) for r, buf in buffers.items()}
        self.sends += [self.comm.Isend(ask, dest=r, tag=_TAG_REQUEST) for r in buffers]
        deadline = time.monotonic() + REPLY_GRACE_S
        status = MPI.Status()
        while replies and time.monotonic() < deadline:
            for r, req in list(replies.items()):
                if req.Test(status):
                    del replies[r]
                    try:
                        states[r] = json.loads(bytes(buffers[r][: status.Get_count(MPI.BYTE)]))
                    except ValueError:
                        states[r] = None
            if self._serve_requests(reporting=True) and kind == "timeout":
                return True
            time.sleep(0.02)
        for r in replies:
            states[r] = None
        return False

    def _table(self, op: str, states: dict[int, dict[str, Any] | None], *, asked: bool, stalled: bool = False) -> str:
        entered, missing = [], []
        if stalled:
            lines = [f"distlinalg: stalled: which ranks are in {op} (rank {self.rank} is blocked in it):"]
        else:
            lines = [f"distlinalg watchdog: which ranks are in {op} (rank {self.rank} timed out in it):"]
        if not asked and self.size > 1:
            lines.append("  (MPI runs at thread level SERIALIZED, so the watchdog cannot ask the other "
                         "ranks while this one is inside MPI; their own watchdogs report their calls)")
        for r in range(self.size):
            state = states.get(r)
            if state is None:
                if asked:
                    lines.append(f"  rank {r}: did not answer within {REPLY_GRACE_S:g} s (exited, exiting, "
                                 "hung outside Python, or its watchdog is off)")
                missing.append(f"{r} ({'no answer' if asked else 'not asked'})")
                continue
            calls, ops = state.get("calls") or [], state.get("ops") or []
            started = state.get("started")
            count = f"; calls started: {started}" if started is not None else ""
            where = f"; main thread at {state['main']}" if state.get("main") else ""
            if calls:
                lines.append(f"  rank {r}: in " + "; ".join(calls) + count)
            else:
                lines.append(f"  rank {r}: not in a distlinalg MPI call{count}{where}")
            if op in ops:
                entered.append(str(r))
            else:
                missing.append(f"{r} ({ops[0] if ops else 'no call'})")
        lines.append(f"  entered {op}: {', '.join(entered) or 'none'}; not in it: {', '.join(missing) or 'none'}")
        cycle = _receive_cycle(states)
        if cycle:
            chain = ", ".join(f"rank {r} waits for {cycle[(i + 1) % len(cycle)]}" for i, r in enumerate(cycle))
            lines.append(f"  a cycle of receives, a deadlock of the program's own: {chain}")
        if stalled:
            lines.append(f"Still waiting ({TIMEOUT_ENV} ends the job; {STALL_ENV}=0 turns this report off).")
        else:
            lines.append(f"Ending the job (MPI_Abort({EXIT_TIMEOUT})).")
        return _prefix("\n".join(lines), f"[rank {self.rank}] ")


def _receive_cycle(states: dict[int, dict[str, Any] | None]) -> list[int]:
    """Ranks that each wait in a receive from the next, around a cycle (the
    program's own deadlock), or [] (from the ranks' reported calls)."""
    waits_for: dict[int, int] = {}
    for rank, state in states.items():
        if not state:
            continue
        for op, peer in zip(state.get("ops") or [], state.get("peers") or []):
            if op == "recv" and peer >= 0:
                waits_for[rank] = peer
                break
    for start in sorted(waits_for):
        path, rank = [], start
        while rank in waits_for and rank not in path:
            path.append(rank)
            rank = waits_for[rank]
        if rank == start:
            return path
    return []


def _call_key(call: dict[str, Any]) -> tuple:
    """One call in progress (its sequence number is this rank's count of calls)."""
    return (call.get("seq"), call.get("op"), call.get("comm"))


_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep
    for m in (sys.modules.get(name) for name in ("jax", "jaxlib", __package__ or "distlinalg"))
    if m is not None and getattr(m, "__file__", None)
)


def _innermost_user_frame(stack: traceback.StackSummary) -> traceback.FrameSummary:
    """The innermost frame outside JAX and distlinalg (the program's own code), else the innermost."""
    for summary in reversed(stack):
        if not summary.filename.startswith(_LIBRARY_DIRS) and not summary.filename.startswith("<"):
            return summary
    return stack[-1]


def _main_thread_mark() -> tuple[int, int] | None:
    """Identifies where the main thread's Python code is; unchanged while it sits in one C call."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    return None if frame is None else (id(frame), frame.f_lasti)


# ---------------------------------------------------------------------------
# Installation
_monitor: _Monitor | None = None


def install() -> None:
    """Install the exception hook, the monitor thread and the exit hook (once, at import).

    Reads and validates ``DISTLINALG_ABORT_ON_ERROR``, ``DISTLINALG_TIMEOUT``
    and ``DISTLINALG_SIGNALS`` first, so a bad value is a ValueError on every
    rank before anything collective happens.
    """
    global _monitor
    if _monitor is not None:
        return
    abort = switch(ABORT_ENV, True)
    timeout = parse_timeout(os.environ.get(TIMEOUT_ENV), TIMEOUT_ENV)
    stall_text = os.environ.get(STALL_ENV, "")
    stall = parse_timeout(stall_text, STALL_ENV) if stall_text.strip() else DEFAULT_STALL_S
    signals = switch(SIGNALS_ENV, True)
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    if abort and size > 1:
        sys.excepthook = _ExceptHook(sys.excepthook, rank, size)
    signals = signals and threading.current_thread() is threading.main_thread()
    _monitor = _Monitor(rank, size, signals)
    # Registered after mpi4py's finalizer, so it runs before it (atexit is LIFO).
    atexit.register(_monitor.shutdown)
    os.register_at_fork(after_in_child=_monitor.after_fork_in_child)
    set_timeout(timeout)
    if _mpi.tracks_calls():  # (an old build cannot see calls in progress)
        _monitor.set_stall(stall)
    # configure(timeout=..., stall=...) reaches these settings through _mpi,
    # which does not import this module.
    _mpi.register_monitor_settings(_mpi.MonitorSettings(parse_timeout, set_timeout, set_stall))


def set_timeout(seconds: Any) -> None:
    """Set the watchdog timeout of this process (None or 0: off); see `parse_timeout`.

    Every rank should set the same value: a rank whose watchdog is off does
    not answer the reporting rank's query.
    """
    value = parse_timeout(seconds)
    if value and not _mpi.tracks_calls():
        warnings.warn(
            "distlinalg: this build of the native extension does not track calls in progress, so "
            "the watchdog cannot run; rebuild distlinalg (`make setup`).",
            RuntimeWarning,
            stacklevel=2,
        )
        value = None
    if _monitor is None:
        raise RuntimeError("distlinalg._runtime.safety.install() has not run")
    _monitor.set_timeout(value)


def set_stall(seconds: Any) -> None:
    """Set the stall-report period of this process (None or 0: off); see `parse_timeout`."""
    value = parse_timeout(seconds, "stall")
    if _monitor is None:
        raise RuntimeError("distlinalg._runtime.safety.install() has not run")
    if value and not _mpi.tracks_calls():
        value = None
    _monitor.set_stall(value)


def get_stall() -> float | None:
    """The stall-report period in seconds, None when off."""
    return None if _monitor is None else _monitor.stall


def get_timeout() -> float | None:
    """The watchdog timeout in seconds, None when off."""
    return None if _monitor is None else _monitor.timeout
