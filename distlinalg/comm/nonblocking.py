"""Non-blocking collectives: iallreduce and iallgather, and wait (which also
completes comm/nonblocking_p2p.py's isend and irecv).

``request = iallreduce(x)`` starts the reduction and returns at once;
``wait(request)`` returns its result. What runs between the two (the
matvec of a pipelined solver, the interior of a stencil) runs while the
message is under way, as far as the MPI library progresses it (see
"Progress" below). Start and wait are two ordered primitives: the program
order is the communication order on every rank, under jit, grad, vmap,
scan and while_loop, with no dependency wiring.

Requests and their checks
-------------------------
A request is a pytree holding one zero-byte *marker* per leaf (an array of
shape ``(*result_shape, 0)``: it carries the result's shape and the data
dependence from start to wait, and no data). The buffers MPI works on
belong to the request, in the extension (csrc/nonblocking.cc): XLA may reuse
its own buffers as soon as a start returns.

* Inside a traced function (jit, grad, vmap, a loop body), a request must be
  waited for in the same traced function it was started in. A start whose
  wait was not traced is an error when the program is lowered (before it
  runs, on every rank), naming the operation.
* Eagerly, a request lives until ``wait``. Requests still pending when the
  interpreter exits are waited for then (with a ``RuntimeWarning`` naming
  them), before MPI is finalised, so no message is left half-way.
* Waiting for a request twice is an error (at run time, on every rank that
  does it).

AD (docs/ad.md, the adjoint of the whole SPMD program)
------------------------------------------------------
Start and wait are linear in their array operand (for ``op="sum"``). The
tangent of a start is a second start of the same operation on the tangent,
waited for by the tangent of the wait; the transpose of a wait *starts* the
adjoint operation on the cotangent, and the transpose of the start waits for
it, so in reverse mode the adjoint message travels while the reverse pass
computes what lay between start and wait:

  iallreduce(sum)   ẏ = AR(ẋ);  x̄ = AR(ȳ)           (started at the wait's
  iallgather        ẏ = AG(ẋ);  x̄ = RS_sum(ȳ)        transpose, waited at
  (ireduce_scatter  the adjoint of iallgather; x̄ = AG(ȳ))  the start's)

Forward and reverse mode, every order. iallreduce with op max/min/prod:
its derivative needs the result, so a differentiated start computes the
reduction and its tangent at once with allreduce's rules, and the requests
carry them to the wait (that message does not overlap).
vmap: one message carries the whole batch (as for the blocking operations).

Progress
--------
MPI progresses a non-blocking collective only inside MPI calls unless the
library runs a progress thread (MPICH: ``MPIR_CVAR_ASYNC_PROGRESS=1``,
which needs ``MPI_THREAD_MULTIPLE``). Without one, the data moves at the
wait; the result is the same either way.
"""

from __future__ import annotations

import atexit
import itertools
import traceback
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._runtime import jax_names
from .._runtime.mpi import Communicator, ReduceOp, check_dtype, resolve_comm, resolve_op
from . import _core
from ._core import ad, batching

# ---------------------------------------------------------------------------
# Request keys. A key names one start/wait pair of a program; the extension
# keeps the request under its number between the two calls. Keys of traced
# calls are fresh tuples ("traced", n); derivative pairs extend them ("t" the
# tangent pair, "T" the adjoint pair), so a rule finds its partner's key
# without passing anything at run time. Eager calls take keys ("eager", n)
# from a free list, so their compiled programs are reused. A key's number is
# computed from the key (nothing is kept per key but the set of keys whose
# wait was traced, which a start's lowering checks).
_fresh_keys = itertools.count(1)
_waits_traced: set[tuple] = set()
_free_eager_keys: list[tuple] = []
_eager_pending: dict[tuple, str] = {}  # key -> where it was started
_MAX_DERIVATIVE_DEPTH = 16  # "t"/"T" extensions of one key (orders of differentiation)


def _key_number(key: tuple) -> np.int64:
    """The request number of `key`: distinct keys get distinct numbers.

    (kind, n, *suffixes) -> (2n + [kind is eager]) · 3^16 + the suffixes as
    base-3 digits (t = 1, T = 2; no digit is 0, so no two suffix sequences
    share a value).
    """
    kind, n, *suffixes = key
    if len(suffixes) > _MAX_DERIVATIVE_DEPTH:
        raise NotImplementedError(
            f"distlinalg: more than {_MAX_DERIVATIVE_DEPTH} nested derivatives of one non-blocking operation"
        )
    code = 0
    for suffix in suffixes:
        code = 3 * code + (1 if suffix == "t" else 2)
    return np.int64((2 * n + (kind == "eager")) * 3**_MAX_DERIVATIVE_DEPTH + code)


def _tangent_key(key: tuple) -> tuple:
    return (*key, "t")


def _adjoint_key(key: tuple) -> tuple:
    return (*key, "T")


def _check_waited(start: str) -> Any:
    """The lowering hook of `start`'s primitive: a traced start lowers only if its wait was traced too."""

    def check(ctx: Any, *, key: tuple, **params: Any) -> None:
        if key not in _waits_traced:
            raise ValueError(
                f"distlinalg: a non-blocking operation ({start}) is started and never "
                "waited for in the same traced function: call distlinalg.comm.wait(request) before the "
                "function returns (a request cannot be returned from jit or carried out of a loop body)"
            )

    return check


# ---------------------------------------------------------------------------
# The start primitives: x -> a marker shaped (*result_shape, d).
#
# d = 0 (a zero-byte marker) on communicators of several ranks: the result
# travels inside the extension, from the start's request to the wait. On a
# one-rank communicator d = 1 and the marker *is* the result: the start
# lowers to it and the wait to marker[..., 0], with no custom call (see
# comm._core.register_lowering's `local`). Markers change shape only by
# reshapes in the AD rules below, which move the data along on one rank.
def marker_depth(comm: Communicator) -> int:
    """The length of a collective request marker's last axis: 1 when it carries the result."""
    return 1 if comm.size == 1 and _core.elide_one_rank() else 0


def _new_start(name: str, result_shape, attrs, local_result) -> Any:
    prim = _core.new_primitive(name)
    _core.def_abstract_eval(
        prim,
        lambda x, *, comm, key, **params: _core.shaped((*result_shape(x.shape, comm), marker_depth(comm)), x.dtype),
    )
    _core.register_lowering(
        prim,
        f"distlinalg_{name}",
        lambda *, comm, key, **params: {"comm": _core.comm_attr(comm), **attrs(**params), "request": _key_number(key)},
        on_lower=_check_waited(name),
        local=lambda x, **_: [local_result(x)[..., None]],
    )
    return prim


iallreduce_p = _new_start(
    "iallreduce", lambda shape, comm: shape, lambda *, op: {"op": np.int32(op)}, lambda x: x
)
iallgather_p = _new_start("iallgather", lambda shape, comm: (comm.size, *shape), lambda: {}, lambda x: x[None])
ireduce_scatter_p = _new_start(
    "ireduce_scatter", lambda shape, comm: shape[1:], lambda *, op: {"op": np.int32(op)}, lambda x: x[0]
)

_STARTS = {"iallreduce": iallreduce_p, "iallgather": iallgather_p, "ireduce_scatter": ireduce_scatter_p}
# The operation whose start transposes the wait of each (the adjoint map).
_ADJOINT = {"iallreduce": "iallreduce", "iallgather": "ireduce_scatter", "ireduce_scatter": "iallgather"}


def _sum_params(start: str) -> dict[str, Any]:
    return {} if start == "iallgather" else {"op": ReduceOp.SUM}


def _bind_start(start: str, x: Any, *, comm: Communicator, key: tuple, **params: Any) -> Any:
    return _core.bind(_STARTS[start], x, comm=comm, key=key, **params)


# ---------------------------------------------------------------------------
# wait: marker -> the result of the start it completes.
# (A send's wait returns nothing: a zero-element result.) `route`: the
# (peer, tag) of a point-to-point request, which its AD rules need; None for
# a collective.
wait_p = _core.new_primitive("wait")
_core.def_abstract_eval(
    wait_p,
    lambda marker, *, comm, key, start, route: _core.shaped(
        marker.shape[:-1] if start != "isend" else (0,), marker.dtype
    ),
)
_core.register_lowering(
    wait_p,
    "distlinalg_wait",
    lambda *, comm, key, start, route: {"request": _key_number(key)},
    # One rank: a collective's marker holds its result (marker_depth).
    local=lambda marker, **_: [marker[..., 0]],
    local_if=lambda marker, *, start, **_: start in _STARTS and marker.shape[-1] == 1,
)


def _bind_wait(marker: Any, *, comm: Communicator, key: tuple, start: str, route: Any = None) -> Any:
    if not jax_names.at_top_level():
        _waits_traced.add(key)
    return _core.bind(wait_p, marker, comm=comm, key=key, start=start, route=route)


def _bind_wait_discard(marker: Any, *, comm: Communicator, key: tuple, start: str = "isend",
                       route: Any = None) -> Any:
    """The wait of a send (comm.nonblocking_p2p): completes it, returns a zero-element array."""
    return _bind_wait(marker, comm=comm, key=key, start=start, route=route)


# Point-to-point requests (comm/nonblocking_p2p.py) register their wait and
# the JVP and transpose of their wait here, by start name.
_P2P_WAITERS: dict[str, Any] = {}
_P2P_JVP: dict[str, Any] = {}
_P2P_TRANSPOSE: dict[str, Any] = {}


# --- AD ---------------------------------------------------------------------
def _start_jvp(start: str):
    def jvp(primals, tangents, *, comm, key, **params):
        (x,), (t,) = primals, tangents
        op = params.get("op", ReduceOp.SUM)
        if op != ReduceOp.SUM and start == "iallreduce":
            return _nonlinear_iallreduce_jvp(x, t, comm=comm, key=key, op=op)
        if op != ReduceOp.SUM:
            raise NotImplementedError(
                f"distlinalg.{start} with op={ReduceOp(op).name.lower()} is not differentiable; use the blocking "
                f"distlinalg.comm.{start[1:]}"
            )
        marker = _bind_start(start, x, comm=comm, key=key, **params)
        marker_t = _bind_start(start, _core.instantiate(t), comm=comm, key=_tangent_key(key), **params)
        return marker, marker_t

    return jvp


def _nonlinear_iallreduce_jvp(x: Any, t: Any, *, comm: Communicator, key: tuple, op: ReduceOp) -> tuple:
    """The JVP of an iallreduce with prod, min or max.

    Its tangent needs the result (product of the others, which ranks attain
    the extremum), so the reduction and its tangent are computed here, by
    the blocking allreduce and its JVP rule; the wait then hands them on.
    Both are replicated, so the requests carry them exactly: y as the max
    over ranks of identical values (bitwise y), ẏ as the sum of ẏ / P (a
    linear map, so the tangent transposes). Under differentiation this
    message does not overlap with the work between start and wait.
    """
    from .allreduce import _allreduce_jvp as allreduce_jvp

    if op.is_bitwise_or_logical or not jnp.issubdtype(x.dtype, jnp.inexact):
        marker = _bind_start("iallreduce", x, comm=comm, key=key, op=op)  # integer results: no tangent
        return marker, ad.Zero.from_primal_value(marker)
    y, y_dot = allreduce_jvp((x,), (t,), comm=comm, op=op)
    marker = _bind_start("iallreduce", y, comm=comm, key=key, op=ReduceOp.MAX)
    share = y_dot / jnp.asarray(comm.size, y_dot.dtype)
    marker_t = _bind_start("iallreduce", share, comm=comm, key=_tangent_key(key), op=ReduceOp.SUM)
    return marker, marker_t


def _start_transpose(start: str):
    def transpose(ct, x, *, comm, key, **params):
        # The wait's transpose started the adjoint operation under the
        # adjoint key; its marker arrives here as the cotangent.
        adjoint = _ADJOINT[start]
        # (The adjoint's marker is reshaped to x's shape: it holds no data,
        # or on one rank the adjoint's result, which has x's elements.)
        marker = jnp.reshape(_core.instantiate(ct), (*x.aval.shape, marker_depth(comm)))
        return (_bind_wait(marker, comm=comm, key=_adjoint_key(key), start=adjoint),)

    return transpose


def _wait_jvp(primals, tangents, *, comm, key, start, route):
    if start in _P2P_JVP:
        return _P2P_JVP[start](primals, tangents, comm=comm, key=key, start=start, route=route)
    (marker,), (marker_t,) = primals, tangents
    y = _bind_wait(marker, comm=comm, key=key, start=start)
    y_t = _bind_wait(_core.instantiate(marker_t), comm=comm, key=_tangent_key(key), start=start)
    return y, y_t


def _wait_transpose(ct, marker, *, comm, key, start, route):
    if start in _P2P_TRANSPOSE:
        return _P2P_TRANSPOSE[start](ct, marker, comm=comm, key=key, start=start, route=route)
    adjoint = _ADJOINT[start]
    ct = _core.instantiate(ct)  # every rank posts the adjoint message, zero or not
    adjoint_marker = _bind_start(adjoint, ct, comm=comm, key=_adjoint_key(key), **_sum_params(adjoint))
    # The cotangent of this wait's marker: the marker's shape (no data, or
    # on one rank the adjoint's result, with the marker's elements).
    return (jnp.reshape(adjoint_marker, marker.aval.shape),)


# --- vmap -------------------------------------------------------------------
def _start_batch(start: str):
    def batch(args, dims, *, comm, key, **params):
        (x,), (d,) = args, dims
        prim = _STARTS[start]
        if start == "ireduce_scatter":
            # (size, B, *s): the batch behind the rank axis; the result is (B, *s).
            return prim.bind(jnp.moveaxis(x, d, 1), comm=comm, key=key, **params), 0
        marker = prim.bind(jnp.moveaxis(x, d, 0), comm=comm, key=key, **params)
        # iallgather: every rank's (B, *s) batch is one row of (size, B, *s).
        return marker, (1 if start == "iallgather" else 0)

    return batch


def _wait_batch(args, dims, *, comm, key, start, route):
    (marker,), (d,) = args, dims
    if d == marker.ndim - 1:  # the marker's depth axis stays last
        marker, d = jnp.moveaxis(marker, d, 0), 0
    out = wait_p.bind(marker, comm=comm, key=key, start=start, route=route)
    return out, (jax_names.not_mapped if start == "isend" else d)


for _name, _prim in _STARTS.items():
    ad.primitive_jvps[_prim] = _start_jvp(_name)
    ad.primitive_transposes[_prim] = _start_transpose(_name)
    batching.primitive_batchers[_prim] = _start_batch(_name)
ad.primitive_jvps[wait_p] = _wait_jvp
ad.primitive_transposes[wait_p] = _wait_transpose
batching.primitive_batchers[wait_p] = _wait_batch


# ---------------------------------------------------------------------------
@jax.tree_util.register_pytree_node_class
class Request:
    """A non-blocking operation under way; pass it to :func:`wait`.

    A pytree whose leaves are markers (one per leaf of the operand), so it
    passes through ``jax.vmap`` and loop bodies like any value. On several
    ranks a marker is zero-byte, shaped ``(*result, 0)``: the data travels
    in MPI. On a one-rank communicator a collective's marker is the result
    itself, shaped ``(*result, 1)``, and nothing is sent.

    Example:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> from distlinalg import comm
      >>> request = comm.iallreduce({"a": jnp.ones(2), "b": jnp.zeros((3, 2))})
      >>> isinstance(request, comm.Request)
      True
      >>> [leaf.shape[:-1] for leaf in jax.tree_util.tree_leaves(request)]   # (*result, 0 or 1)
      [(2,), (3, 2)]
      >>> out = comm.wait(request)
      >>> out["a"].tolist() == [comm.size()] * 2, out["b"].shape
      (True, (3, 2))
    """

    def __init__(self, markers: tuple, start: str, keys: tuple, treedef: Any, comm: Communicator,
                 route: tuple[int, int] | None = None):
        self.markers, self.start, self.keys, self.treedef, self.comm = markers, start, keys, treedef, comm
        self.route = route  # (peer, tag) of a point-to-point request

    def tree_flatten(self):
        return self.markers, (self.start, self.keys, self.treedef, self.comm, self.route)

    @classmethod
    def tree_unflatten(cls, aux, markers):
        return cls(tuple(markers), *aux)

    def __repr__(self) -> str:
        return f"Request({self.start}, {len(self.markers)} leaves)"


def _new_keys(count: int) -> tuple:
    if not jax_names.at_top_level():
        return tuple(("traced", next(_fresh_keys)) for _ in range(count))
    keys = []
    for _ in range(count):
        keys.append(_free_eager_keys.pop() if _free_eager_keys else ("eager", next(_fresh_keys)))
    return tuple(keys)


def _start_all(start: str, x: Any, comm: Communicator, **params: Any) -> Request:
    leaves, treedef = jax.tree_util.tree_flatten(x)
    leaves = [_core.as_array(leaf) for leaf in leaves]
    for leaf in leaves:  # every leaf checked before anything is posted
        check_dtype(leaf.dtype, start, params.get("op"))
    leaves = [_core.truth_values(leaf, params.get("op")) for leaf in leaves]
    keys = _new_keys(len(leaves))
    markers = tuple(_bind_start(start, leaf, comm=comm, key=k, **params) for leaf, k in zip(leaves, keys))
    _note_eager_start(start, keys)
    return Request(markers, start, keys, treedef, comm)


def _note_eager_start(start: str, keys: tuple) -> None:
    """Eager requests are remembered until waited for (completed at exit otherwise)."""
    if jax_names.at_top_level():
        where = "".join(traceback.format_list(traceback.extract_stack(limit=5)[:-3])).strip()
        for k in keys:
            _eager_pending[k] = f"{start} started at {where}"


def _note_eager_waited(keys: tuple) -> None:
    for key in keys:
        if _eager_pending.pop(key, None) is not None:
            _free_eager_keys.append(key)


def iallreduce(x: Any, op: Any = "sum", *, comm: Any = None) -> Request:
    """Start the reduction of `x` over all ranks; :func:`wait` returns it.

    Args:
      x: array or pytree of arrays, the same shapes and dtypes on every rank.
      op: "sum" (default), "prod", "max", "min", the bitwise and logical ops
        ("band" ... "lxor"), or an MPI.Op of those, with allreduce's dtype rules.
      comm: communicator (default distlinalg's).

    Returns:
      A :class:`Request`; ``wait(request)`` is ``allreduce(x, op)``: the
      same shapes, identical on every rank.

    AD: forward and reverse mode. For op="sum" the adjoint is an
    iallreduce of the cotangent, started where the wait is transposed and
    waited for where the start is. For "prod", "min" and "max" the tangent
    needs the result: a differentiated start computes the reduction and its
    tangent at once (allreduce's rules) and the wait hands them on, so that
    message does not overlap. Integer ops have no derivative.
    vmap: one message for the batch. Every rank must start and wait in the
    same order as its peers (as for every collective).

    Example:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> from distlinalg import comm
      >>> @jax.jit
      ... def step(r, A, p):
      ...     request = comm.iallreduce(jnp.vdot(r, r))   # starts the reduction
      ...     w = A @ p                                    # may run meanwhile
      ...     return comm.wait(request), w                 # Σ_ranks r·r
      >>> rr, w = step(jnp.ones(4), 2 * jnp.eye(4), jnp.ones(4))
      >>> int(rr) == 4 * comm.size(), w.tolist()
      (True, [2.0, 2.0, 2.0, 2.0])
    """
    comm = resolve_comm(comm)
    return _start_all("iallreduce", x, comm, op=resolve_op(op))


def iallgather(x: Any, *, comm: Any = None) -> Request:
    """Start gathering every rank's `x`; :func:`wait` returns the stack.

    Args:
      x: array or pytree of arrays of shape s, the same on every rank.
      comm: communicator (default distlinalg's).

    Returns:
      A :class:`Request`; ``wait(request)`` is ``allgather(x)``: shape
      ``(size, *s)``, row r from rank r, identical on every rank.

    AD: forward and reverse mode (the adjoint is a sum reduce-scatter of
    the cotangent, started where the wait is transposed). vmap: the batch
    lands behind the rank axis, as for ``allgather``.

    Example:
      >>> import jax.numpy as jnp
      >>> from distlinalg import comm
      >>> request = comm.iallgather(jnp.array([comm.rank(), -comm.rank()]))
      >>> interior = jnp.ones(3) * 2                  # computed while the message travels
      >>> comm.wait(request).tolist() == [[r, -r] for r in range(comm.size())]
      True
    """
    comm = resolve_comm(comm)
    return _start_all("iallgather", x, comm)


def wait(request: Request) -> Any:
    """The result of a non-blocking operation, once it is complete.

    Args:
      request: what :func:`iallreduce`, :func:`iallgather`, ``isend`` or
        ``irecv`` returned.

    Returns:
      The operation's result (a pytree shaped like its operand's tree): the
      reduction, the stack, the received message; None for an isend.

    Waiting blocks until this rank's part of the operation is done. Inside a
    traced function, wait in the same function that started the request.
    Waiting twice for one request is an error.

    Example:
      >>> import jax.numpy as jnp
      >>> from distlinalg import comm
      >>> request = comm.iallreduce(jnp.ones(2))
      >>> comm.wait(request).tolist() == [comm.size()] * 2
      True
    """
    if not isinstance(request, Request):
        raise TypeError(
            "distlinalg.comm.wait: expected a Request (from iallreduce, iallgather, isend or irecv), "
            f"got {type(request).__name__}"
        )
    if request.start in _P2P_WAITERS:
        return _P2P_WAITERS[request.start](request)
    if jax_names.at_top_level() and marker_depth(request.comm) == 1:
        # One rank: the markers hold the result and the extension keeps no
        # request, so its check that a request is waited for once is made here.
        for key in request.keys:
            if key not in _eager_pending:
                raise RuntimeError(f"distlinalg: {request.start}: request {int(_key_number(key))} was not "
                                   "started (or was waited for already)")
    results = [
        _bind_wait(marker, comm=request.comm, key=key, start=request.start)
        for marker, key in zip(request.markers, request.keys)
    ]
    _note_eager_waited(request.keys)
    return jax.tree_util.tree_unflatten(request.treedef, results)


def _wait_for_pending_at_exit() -> None:
    """Eager requests never waited for: completed before MPI is finalised."""
    if not _eager_pending:
        return
    warnings.warn(
        "distlinalg: waiting at exit for non-blocking operations that were never waited for:\n"
        + "\n".join(_eager_pending.values()),
        RuntimeWarning,
        stacklevel=1,
    )
    for key, what in list(_eager_pending.items()):
        start = what.split(" ", 1)[0]
        # The marker's shape is not known here; the extension checks only the
        # byte count of the result, which a zero-byte wait skips.
        try:
            _native_wait_discard(key)
        except Exception as error:  # noqa: BLE001 (exit path: report, do not raise)
            warnings.warn(f"distlinalg: {start}: {error}", RuntimeWarning, stacklevel=1)
    _eager_pending.clear()


def _native_wait_discard(key: tuple) -> None:
    from .._runtime import mpi as _mpi

    _mpi._native.wait_discard(int(_key_number(key)))


atexit.register(_wait_for_pending_at_exit)


__all__ = ["Request", "iallgather", "iallreduce", "wait", "iallreduce_p", "iallgather_p", "wait_p"]
