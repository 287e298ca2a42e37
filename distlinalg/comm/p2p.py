"""Point-to-point: send, recv and sendrecv.

A receive's result is its template overwritten by the message, so receiving
from ``PROC_NULL`` returns the template unchanged (MPI leaves it untouched),
and sending to ``PROC_NULL`` sends nothing. The template's buffer is the
result's where XLA can give it up (the receive then happens in place).

AD (docs/ad.md, "The convention"): a message is a linear map of the global
state, y_dest = x_source. Its tangent travels along the same route, its
cotangent along the reversed one:

  sendrecv  ẏ = sendrecv(ṡ) with the same source/dest; transpose: ȳ goes back
            from dest to source (tags swapped), and the template's cotangent
            is ȳ where source is PROC_NULL (the output *is* the template),
            zero otherwise.
  send      its tangent is sent as a second message; transpose: receive the
            cotangent back from dest.
  recv      its tangent is a second message from source; transpose: send the
            cotangent back to source.
Forward and reverse mode, every order, vmap of both (one message carries the
whole batch).

Why the protocol below exists
-----------------------------
JAX differentiates an operation only when one of its inputs carries a
tangent. A ``recv`` whose template is a constant is therefore never
differentiated even when the matching ``send`` is (and the same for a
``sendrecv`` whose send buffer and template are both constant on one rank),
so one rank would post a derivative message that its partner never takes:
a silently wrong derivative in forward mode, a rank blocked forever in
reverse mode. Neither rank can tell at trace time. So every message whose
sender differentiates says so itself:

* A differentiated exchange first sends its *primal* message with one extra
  trailing element per level of differentiation set to 1 (same tag, same
  dtype), receiving into a buffer with those slots preset to 0. Afterwards
  the receiver knows, as a runtime value, whether its source will post a
  tangent (and, in reverse mode, wait for a cotangent).
* The tangent exchange receives from the source only if that flag is set
  (a ``lax.cond`` on it, not on a batched value, so vmap keeps it a branch);
  otherwise the tangent is zero — exact, since the source's value does not
  depend on the differentiated inputs. In reverse mode the same branch
  decides whether the cotangent is sent back, so no message is left
  unmatched and no rank waits for one that never comes.
* A receiver that does *not* differentiate, but whose source does, receives a
  message one element longer than its buffer: MPI truncates it
  (``MPI_ERR_TRUNCATE``), raised as a Python exception on that rank ("the
  message from rank ... is longer than the receive template"). That is the one unsupported pattern; it fails loudly instead of
  hanging or returning a wrong derivative. (Its partner may then block until
  the job is torn down, as after any error on one MPI rank.)

The rule for users: when the sent value depends on the differentiated inputs,
the receiving side's template must too — e.g. ``recv(x * 0, source)`` or
``recv(jnp.zeros_like(x) + 0 * x, ...)`` with x a differentiated argument;
``jnp.zeros_like(x)`` alone is a constant. ``sendrecv`` needs nothing special
when the sent buffers carry tangents on every rank (the usual halo exchange).
With ``DISTLINALG_CHECK=1`` every message first exchanges its signature, so a
mismatch (including the unsupported pattern) is reported on both ranks with
the element counts; in that mode a differentiated receive whose sender does
not differentiate is reported too (the counts differ by the flag), although
without the check it is handled exactly.

Primal-only exchanges (no differentiation) are plain MPI calls: no flag, no
copy. Derivative messages use flagged tags (user tags are 0..4095).

Sizes: a receive's message must have its template's element count; the
handler reads the count from the MPI status (free) and raises on the
receiving rank otherwise (`_fills`). The flagged primal message may also
lack its flags (a source that does not differentiate). So a differentiated
exchange whose sender's message is short by exactly the flags' count looks
like that case and is not caught by the count: the default first-run check
does not see it either; ``DISTLINALG_CHECK=1`` does.

Wildcards and statuses: ``recv``/``sendrecv`` accept ``MPI.ANY_SOURCE`` and
``MPI.ANY_TAG`` and can return the receive's :class:`Status`; they go through
``sendrecv_status_p``, whose derivative messages follow the route recorded in
that status (see the section below).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from .._mpi import (
    ADJOINT_TAG_FLAG,
    PROC_NULL,
    TANGENT_TAG_FLAG,
    USER_TAG_LIMIT,
    check_dtype,
    check_rank,
    check_tag,
    resolve_comm,
)
from . import _core
from ._core import ad, batching

# ---------------------------------------------------------------------------
# One-rank communicators (comm._core.register_lowering's `local`): an exchange
# with itself, or with PROC_NULL on both sides, is computed without MPI. A
# message to itself that the same call does not receive (a send to 0 while
# receiving from PROC_NULL, tags that differ, another dtype, a longer
# message) is left to MPI, which reports or matches it as it would on any
# communicator.
def _receives_own_message(s, r, *, source, dest, sendtag, recvtag, may_lack=0, **_) -> bool:
    return (
        dest == 0
        and source in (0, MPI.ANY_SOURCE)
        and recvtag in (sendtag, MPI.ANY_TAG)
        and s.dtype == r.dtype
        and _fills(math.prod(s.shape), math.prod(r.shape), may_lack)  # else the handler reports it
    )


def _fills(count: int, room: int, may_lack: int) -> bool:
    """Whether a message of `count` elements may be received into a template of `room`.

    `may_lack`: 0, exactly `room` (a user's receive); k > 0, also `room − k`
    (the flagged primal message of a differentiated exchange, whose source
    may not differentiate and then sends no flags); −1, any count up to
    `room` (a receive that returns its status, which says how many came).
    The handlers apply the same rule (csrc/p2p.cc, CheckMessageFills).
    """
    return count == room or (may_lack > 0 and count == room - may_lack) or (may_lack < 0 and count <= room)


def _exchanges_locally(s, r, *, source, dest, **params) -> bool:
    both_null = source == PROC_NULL and dest == PROC_NULL
    return both_null or _receives_own_message(s, r, source=source, dest=dest, **params)


def _local_exchange(s, r, *, dest, **_):
    """What an exchange on one rank receives: its own message over the template's head."""
    if dest == PROC_NULL:
        return [r]
    n = math.prod(s.shape)
    received = jnp.concatenate([jnp.ravel(s), jnp.ravel(r)[n:]]) if n < math.prod(r.shape) else jnp.ravel(s)
    return [received.reshape(r.shape)]


# ---------------------------------------------------------------------------
# sendrecv: the plain exchange (one MPI_Sendrecv)
#   may_lack: how many elements the message may lack (`fills`): 0 for a
#     user's exchange (the handler reports a shorter or longer message on
#     the receiving rank); the flags' count for the flagged exchange of a
#     differentiated message, whose source may send none.
sendrecv_p = _core.new_primitive("sendrecv")
_core.def_abstract_eval(
    sendrecv_p, lambda s, r, *, comm, source, dest, sendtag, recvtag, may_lack: _core.shaped(r.shape, r.dtype)
)
_core.register_lowering(
    sendrecv_p,
    "distlinalg_sendrecv",
    lambda *, comm, source, dest, sendtag, recvtag, may_lack: {
        "comm": _core.comm_attr(comm),
        "source": np.int32(source),
        "dest": np.int32(dest),
        "sendtag": np.int32(sendtag),
        "recvtag": np.int32(recvtag),
        "may_lack": np.int32(may_lack),
    },
    # The template is aliased to the result: a template that dies here (a
    # loop's receive buffer, `y = sendrecv(x, y)`) is received into in place,
    # as MPI would, instead of into a fresh buffer that XLA then copies back
    # into the loop carry (2x at 16 MiB). A template that lives on costs XLA
    # one copy of it; the handler skips its own copy when the buffers match.
    aliases={1: 0},
    local=_local_exchange,
    local_if=_exchanges_locally,
)


def _aval(x: Any) -> Any:
    return x.aval if _core.is_undefined(x) else jax.typeof(x)


def _sendrecv_jvp(primals, tangents, *, may_lack, **params):
    (s, r), (ts, tr) = primals, tangents
    y, delivered = flagged_sendrecv_p.bind(s, r, depth=1, **params)
    return y, _tangent_exchange(ts, tr, delivered[0], **params)


def _sendrecv_transpose(ct, s, r, *, comm, source, dest, sendtag, recvtag, may_lack):
    ct = _core.instantiate(ct)
    send_aval = _aval(s)
    buffer = jnp.zeros(send_aval.shape, send_aval.dtype)
    if dest != PROC_NULL and not _core.is_undefined(r) and _aval(r).shape == send_aval.shape \
            and _aval(r).dtype == send_aval.dtype:
        # A residual template shaped like what was sent (send's tangent
        # message passes its primal): derive the buffer of the returning
        # cotangent from it. Differentiating this transpose again (Hessians)
        # then differentiates this receive whenever the sent value depends
        # on the inputs, matching the partner, whose returned cotangent
        # depends on them too. A receive into a constant buffer could not
        # take the tangent the partner sends. The values are overwritten.
        buffer = r * 0
    # Always communicate: the partner's transpose posts the matching call.
    back = sendrecv_p.bind(
        ct, buffer, comm=comm, source=dest, dest=source,
        sendtag=recvtag | ADJOINT_TAG_FLAG, recvtag=sendtag | ADJOINT_TAG_FLAG, may_lack=0,
    )
    ct_s = back if _core.is_undefined(s) else None
    ct_r = None
    if _core.is_undefined(r):
        ct_r = ct if source == PROC_NULL else jnp.zeros_like(ct)
    return ct_s, ct_r


def _batch_operands(args, dims):
    """Both buffers batched at axis 0 (one message carries the whole batch)."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not _core.not_mapped)
    return [_core.moveaxis_or_broadcast(a, d, 0, size) for a, d in zip(args, dims)]


def _sendrecv_batch(args, dims, **params):
    s, r = _batch_operands(args, dims)
    return sendrecv_p.bind(s, r, **params), 0


ad.primitive_jvps[sendrecv_p] = _sendrecv_jvp
ad.primitive_transposes[sendrecv_p] = _sendrecv_transpose
batching.primitive_batchers[sendrecv_p] = _sendrecv_batch

# ---------------------------------------------------------------------------
# The flagged primal exchange of a differentiated message (module docstring):
# sends [s.ravel(), 1 * depth], receives [r.ravel(), flags]; returns the
# received value and flags: bool[depth], flags[k] set when the source
# differentiates this message at nesting level k and posts its tangent.
def _flagged_shapes(s, r, *, depth, **_):
    return [_core.shaped(r.shape, r.dtype), _core.shaped((depth,), np.bool_)]


def _flagged_exchange(s, r, *, comm, source, dest, sendtag, recvtag, depth):
    params = dict(comm=comm, source=source, dest=dest, sendtag=sendtag, recvtag=recvtag)
    flags = jnp.ones((depth,), s.dtype)
    sent = flags if dest == PROC_NULL else jnp.concatenate([jnp.ravel(s), flags])
    if source == PROC_NULL:
        sendrecv_p.bind(sent, jnp.zeros((depth,), r.dtype), may_lack=0, **params)
        return [r, jnp.zeros((depth,), np.bool_)]
    n = math.prod(r.shape)
    # A source that does not differentiate sends no flags.
    got = sendrecv_p.bind(sent, jnp.concatenate([jnp.ravel(r), jnp.zeros((depth,), r.dtype)]), may_lack=depth,
                          **params)
    return [got[:n].reshape(r.shape), got[n:] != 0]


flagged_sendrecv_p = _core.new_expanded_primitive("sendrecv_flagged", _flagged_shapes, _flagged_exchange)


def _flagged_jvp(primals, tangents, *, depth, **params):
    (s, r), (ts, tr) = primals, tangents
    # The new (outer) level of differentiation takes the next flag slot.
    y, delivered = flagged_sendrecv_p.bind(s, r, depth=depth + 1, **params)
    dy = _tangent_exchange(ts, tr, delivered[depth], **params)
    return (y, delivered[:depth]), (dy, np.zeros((depth,), jax.dtypes.float0))


def _flagged_batch(args, dims, **params):
    s, r = _batch_operands(args, dims)
    return flagged_sendrecv_p.bind(s, r, **params), [0, _core.not_mapped]


ad.primitive_jvps[flagged_sendrecv_p] = _flagged_jvp
batching.primitive_batchers[flagged_sendrecv_p] = _flagged_batch


def _tangent_exchange(ts, tr, delivered, *, comm, source, dest, sendtag, recvtag):
    """The tangent message of a differentiated exchange.

    Sends ṡ to dest unconditionally (this rank flagged its primal message);
    receives from source only when the source flagged its own. Both tangents
    are operands of the exchange even when one is an instantiated zero: an
    exchange on constants only would be evaluated in the forward pass of
    reverse mode instead of being transposed.
    """
    ts, tr = _core.instantiate(ts), _core.instantiate(tr)
    params = dict(comm=comm, dest=dest, sendtag=sendtag | TANGENT_TAG_FLAG, recvtag=recvtag | TANGENT_TAG_FLAG,
                  may_lack=0)
    if source == PROC_NULL:
        return sendrecv_p.bind(ts, tr, source=PROC_NULL, **params)  # the template's own tangent

    def received(ts, tr):
        return sendrecv_p.bind(ts, tr, source=source, **params)

    if _core.elide_one_rank() and comm.size == 1 and _receives_own_message(ts, tr, source=source, **params):
        # One rank: the source is this very call, which differentiates (it is
        # here), so its flag is set; the branch that would send a tangent no
        # call receives is left out (it would keep a custom call in the program).
        return received(ts, tr)

    def source_constant(ts, tr):
        sendrecv_p.bind(ts, tr, source=PROC_NULL, **params)
        return jnp.zeros(tr.shape, tr.dtype)

    return jax.lax.cond(delivered, received, source_constant, ts, tr)


# ---------------------------------------------------------------------------
# send
send_p = _core.new_primitive("send", multiple_results=True)
_core.def_abstract_eval(send_p, lambda x, *, comm, dest, tag: [])
_core.register_lowering(
    send_p,
    "distlinalg_send",
    lambda *, comm, dest, tag: {"comm": _core.comm_attr(comm), "dest": np.int32(dest), "tag": np.int32(tag)},
    token_only_result=True,
    # One rank: a send to PROC_NULL sends nothing; one to itself needs MPI's matching.
    local=lambda x, **_: [],
    local_if=lambda x, *, dest, **_: dest == PROC_NULL,
)


def _send_jvp(primals, tangents, *, comm, dest, tag):
    (x,), (t,) = primals, tangents
    # A send is an exchange that receives from PROC_NULL: the flagged primal
    # message, then the tangent (transposed: the cotangent comes back).
    if dest == PROC_NULL:
        return [], []  # nothing is sent, nothing depends on x
    flagged_sendrecv_p.bind(
        x, jnp.zeros((0,), x.dtype), comm=comm, source=PROC_NULL, dest=dest, sendtag=tag, recvtag=tag, depth=1
    )
    # The template x comes back unused (source PROC_NULL); it is there for
    # the transpose, which receives the cotangent into a buffer derived from it.
    sendrecv_p.bind(
        _core.instantiate(t), x, comm=comm, source=PROC_NULL, dest=dest,
        sendtag=tag | TANGENT_TAG_FLAG, recvtag=tag | TANGENT_TAG_FLAG, may_lack=0,
    )
    return [], []


def _send_transpose(cts, x, *, comm, dest, tag):
    # Only reached by jax.linear_transpose of a program that is linear in
    # what it sends (differentiation goes through sendrecv_p instead).
    aval = _aval(x)
    back = recv_p.bind(jnp.zeros(aval.shape, aval.dtype), comm=comm, source=dest, tag=tag | ADJOINT_TAG_FLAG)
    return (back if _core.is_undefined(x) else None,)


def _send_batch(args, dims, **params):
    send_p.bind(args[0], **params)
    return [], []


ad.primitive_jvps[send_p] = _send_jvp
ad.primitive_transposes[send_p] = _send_transpose
batching.primitive_batchers[send_p] = _send_batch

# ---------------------------------------------------------------------------
# recv
recv_p = _core.new_primitive("recv")
_core.def_abstract_eval(recv_p, lambda t, *, comm, source, tag: _core.shaped(t.shape, t.dtype))
_core.register_lowering(
    recv_p,
    "distlinalg_recv",
    lambda *, comm, source, tag: {"comm": _core.comm_attr(comm), "source": np.int32(source), "tag": np.int32(tag)},
    # Aliased, as for sendrecv.
    aliases={0: 0},
    local=lambda t, **_: [t],
    local_if=lambda t, *, source, **_: source == PROC_NULL,
)


def _recv_jvp(primals, tangents, *, comm, source, tag):
    (t,), (tt,) = primals, tangents
    if source == PROC_NULL:
        return recv_p.bind(t, comm=comm, source=source, tag=tag), tt  # y is the template
    params = dict(comm=comm, source=source, dest=PROC_NULL, sendtag=tag, recvtag=tag)
    nothing = jnp.zeros((0,), t.dtype)
    y, delivered = flagged_sendrecv_p.bind(nothing, t, depth=1, **params)
    return y, _tangent_exchange(nothing, tt, delivered[0], **params)


def _recv_transpose(ct, template, *, comm, source, tag):
    # Only reached by jax.linear_transpose (see _send_transpose).
    ct = _core.instantiate(ct)
    send_p.bind(ct, comm=comm, dest=source, tag=tag | ADJOINT_TAG_FLAG)
    if not _core.is_undefined(template):
        return (None,)
    return (ct if source == PROC_NULL else jnp.zeros_like(ct),)


def _recv_batch(args, dims, **params):
    return recv_p.bind(args[0], **params), dims[0]


ad.primitive_jvps[recv_p] = _recv_jvp
ad.primitive_transposes[recv_p] = _recv_transpose
batching.primitive_batchers[recv_p] = _recv_batch


# ---------------------------------------------------------------------------
# Receives that report their status, and wildcards (MPI.ANY_SOURCE,
# MPI.ANY_TAG).
#
# sendrecv_status_p(s, r, route) -> (y, status): one MPI_Sendrecv that also
# returns int32[3] (source, tag, count) of its receive (count in elements of
# r's dtype, -1 when it does not fit int32). A recv is the same with
# dest=PROC_NULL and an empty s. `dynamic` (bit 1: source and recvtag, bit 2:
# dest and sendtag) takes that half of the route from the int32[4] operand
# `route` (source, recvtag, dest, sendtag) at run time instead of the static
# parameters.
#
# Derivatives of a wildcard receive: the tangent must come from the rank (and
# tag) that the primal message came from, and in reverse mode the cotangent
# must go back to it. Neither is known at trace time, but both are known once
# the primal message arrived: its status. So the derivative messages of a
# status exchange use a dynamic route built from that status (tangent: from
# status.source with tag status.tag | TANGENT_TAG_FLAG; cotangent: back to it
# with ADJOINT_TAG_FLAG added). The sender side is the ordinary send/sendrecv
# protocol above, unchanged. The one thing that cannot be done is
# transposing a wildcard receive that never ran: jax.linear_transpose of a
# program whose receive has a wildcard (no forward pass, so no status); that
# raises at trace time.
#
# A receive with MPI.ANY_TAG can meet a derivative message meant for a later
# receive of this rank (in reverse mode a rank already transposing sends its
# cotangent to a rank still in its forward pass). MPI cannot exclude tags
# from a wildcard, so the handler (csrc/p2p.cc, "early arrivals") takes such
# a message out of MPI, keeps it, and hands it to the explicit receive of its
# (comm, source, tag); a wildcard receive only ever returns user messages.
ANY_SOURCE = MPI.ANY_SOURCE
ANY_TAG = MPI.ANY_TAG
_RECV_DYNAMIC, _SEND_DYNAMIC = 1, 2


class Status(NamedTuple):
    """What a receive got: int32 scalar arrays (traced under ``jit``).

    Attributes:
      source: the rank the message came from (``PROC_NULL`` for a receive
        from ``PROC_NULL``).
      tag: its tag (``MPI.ANY_TAG`` for a receive from ``PROC_NULL``).
      count: the number of elements received, in the template's dtype (over
        all leaves of a pytree); 0 from ``PROC_NULL``; -1 beyond 2**31 - 1.
        A message may be shorter than the template, whose tail then keeps the
        template's values.

    Example:
      >>> import jax.numpy as jnp
      >>> from distlinalg import comm
      >>> x = jnp.zeros(4)
      >>> y, st = comm.recv(x, comm.PROC_NULL, return_status=True)
      >>> int(st.source) == comm.PROC_NULL, int(st.tag) == comm.ANY_TAG, int(st.count)
      (True, True, 0)
    """

    source: Any
    tag: Any
    count: Any


sendrecv_status_p = _core.new_primitive("sendrecv_status", multiple_results=True)
_core.def_abstract_eval(
    sendrecv_status_p,
    lambda s, r, route, **_: [_core.shaped(r.shape, r.dtype), _core.shaped((3,), np.int32)],
)
_core.register_lowering(
    sendrecv_status_p,
    "distlinalg_sendrecv_status",
    lambda *, comm, source, dest, sendtag, recvtag, dynamic, may_lack: {
        "comm": _core.comm_attr(comm),
        "source": np.int32(source),
        "dest": np.int32(dest),
        "sendtag": np.int32(sendtag),
        "recvtag": np.int32(recvtag),
        "dynamic": np.int32(dynamic),
        # As sendrecv_p's; −1 when the caller gets the status (any shorter
        # message is valid and counted).
        "may_lack": np.int32(may_lack),
    },
)


def _static_route() -> Any:
    return jnp.zeros((4,), np.int32)


def _route_from_status(status: Any, route: Any, dynamic: int, flag: int) -> tuple[Any, int]:
    """Route of the derivative message of an exchange whose receive got `status`.

    The receiving half comes from the status (the rank and tag that actually
    sent), the sending half from the exchange's own route when it was
    dynamic; `flag` is added to both tags.
    """
    recv_half = jnp.stack([status[0], status[1] | flag])
    send_half = route[2:] | jnp.array([0, flag], np.int32)
    return jnp.concatenate([recv_half, send_half]), _RECV_DYNAMIC | (dynamic & _SEND_DYNAMIC)


def _status_jvp(primals, tangents, *, comm, source, dest, sendtag, recvtag, dynamic, may_lack):
    (s, r, route), (ts, tr, _) = primals, tangents
    params = dict(comm=comm, source=source, dest=dest, sendtag=sendtag, recvtag=recvtag, dynamic=dynamic)
    y, delivered, status = flagged_status_p.bind(s, r, route, depth=1, any_shorter=may_lack < 0, **params)
    dy = _status_tangent_exchange(ts, tr, route, delivered[0], status, **params)
    return (y, status), (dy, np.zeros((3,), jax.dtypes.float0))


def _status_tangent_exchange(ts, tr, route, delivered, status, *, comm, source, dest, sendtag, recvtag, dynamic):
    """`_tangent_exchange` of a status exchange: the tangent follows the primal's realised route."""
    ts, tr = _core.instantiate(ts), _core.instantiate(tr)
    tangent_route, tangent_dynamic = _route_from_status(status, route, dynamic, TANGENT_TAG_FLAG)
    params = dict(comm=comm, dest=dest, sendtag=sendtag | TANGENT_TAG_FLAG, may_lack=0)
    if source == PROC_NULL and not dynamic & _RECV_DYNAMIC:
        return sendrecv_status_p.bind(
            ts, tr, tangent_route, source=PROC_NULL, recvtag=0, dynamic=dynamic & _SEND_DYNAMIC, **params
        )[0]

    def received(ts, tr, tangent_route):
        return sendrecv_status_p.bind(
            ts, tr, tangent_route, source=PROC_NULL, recvtag=0, dynamic=tangent_dynamic, **params
        )[0]

    def source_constant(ts, tr, tangent_route):
        sendrecv_status_p.bind(
            ts, tr, tangent_route, source=PROC_NULL, recvtag=0, dynamic=dynamic & _SEND_DYNAMIC, **params
        )
        return jnp.zeros(tr.shape, tr.dtype)

    return jax.lax.cond(delivered, received, source_constant, ts, tr, tangent_route)


def _status_transpose(cts, s, r, route, *, comm, source, dest, sendtag, recvtag, dynamic, may_lack):
    ct = _core.instantiate(cts[0])
    if _core.is_undefined(route):
        raise TypeError("distlinalg.sendrecv: the route of an exchange is not differentiable")
    if (source == ANY_SOURCE or (recvtag == ANY_TAG and source != PROC_NULL)) and not dynamic & _RECV_DYNAMIC:
        raise ValueError(
            "distlinalg.recv/sendrecv: cannot transpose a receive from MPI.ANY_SOURCE or with "
            "MPI.ANY_TAG that has not run: the reverse route (which rank and tag the cotangent goes "
            "back to) must be known. Under jax.grad/vjp it is known from the forward pass; under "
            "jax.linear_transpose pass an explicit source and tag."
        )
    send_aval = _aval(s)
    buffer = jnp.zeros(send_aval.shape, send_aval.dtype)
    if _aval(r).shape == send_aval.shape and _aval(r).dtype == send_aval.dtype and not _core.is_undefined(r):
        buffer = r * 0  # as in _sendrecv_transpose: differentiable again (Hessians)
    # Reversed route: receive from where this exchange sent, send to where it
    # received from; halves taken from `route` stay dynamic.
    back_route = jnp.concatenate([route[2:], route[:2]]) | jnp.array([0, ADJOINT_TAG_FLAG] * 2, np.int32)
    back_dynamic = (_RECV_DYNAMIC if dynamic & _SEND_DYNAMIC else 0) | (_SEND_DYNAMIC if dynamic & _RECV_DYNAMIC else 0)
    back, _ = sendrecv_status_p.bind(
        ct, buffer, back_route, comm=comm, source=dest, dest=source,
        # (recvtag is ANY_TAG only when source is PROC_NULL: nothing is sent back.)
        sendtag=max(recvtag, 0) | ADJOINT_TAG_FLAG, recvtag=sendtag | ADJOINT_TAG_FLAG, dynamic=back_dynamic,
        may_lack=0,
    )
    ct_s = back if _core.is_undefined(s) else None
    ct_r = None
    if _core.is_undefined(r):
        ct_r = ct if source == PROC_NULL and not dynamic & _RECV_DYNAMIC else jnp.zeros_like(ct)
    return ct_s, ct_r, None


def _unbatched_route(route_dim) -> None:
    if route_dim is not _core.not_mapped:
        raise NotImplementedError(
            "distlinalg.sendrecv: a route that differs between vmapped lanes (one message carries the "
            "whole batch, so it has one route)"
        )


def _count_per_lane(status, size):
    # One message carries the batch: the count of one lane is its share.
    return status.at[2].set(jnp.where(status[2] >= 0, status[2] // size, status[2]))


def _status_batch(args, dims, **params):
    _unbatched_route(dims[2])
    s, r = _batch_operands(args[:2], dims[:2])
    y, status = sendrecv_status_p.bind(s, r, args[2], **params)
    return [y, _count_per_lane(status, r.shape[0])], [0, _core.not_mapped]


ad.primitive_jvps[sendrecv_status_p] = _status_jvp
ad.primitive_transposes[sendrecv_status_p] = _status_transpose
batching.primitive_batchers[sendrecv_status_p] = _status_batch


# The flagged primal exchange of a differentiated status exchange (as
# flagged_sendrecv_p, plus the status, whose count leaves out the flags).
def _flagged_status_shapes(s, r, route, *, depth, **_):
    return [_core.shaped(r.shape, r.dtype), _core.shaped((depth,), np.bool_), _core.shaped((3,), np.int32)]


def _flagged_status_exchange(s, r, route, *, depth, any_shorter, **params):
    flags = jnp.ones((depth,), s.dtype)
    sent = flags if params["dest"] == PROC_NULL and not params["dynamic"] & _SEND_DYNAMIC \
        else jnp.concatenate([jnp.ravel(s), flags])
    if params["source"] == PROC_NULL and not params["dynamic"] & _RECV_DYNAMIC:
        _, status = sendrecv_status_p.bind(sent, jnp.zeros((depth,), r.dtype), route, may_lack=0, **params)
        return [r, jnp.zeros((depth,), np.bool_), status]
    n = math.prod(r.shape)
    # A source that does not differentiate sends no flags.
    got, status = sendrecv_status_p.bind(
        sent, jnp.concatenate([jnp.ravel(r), jnp.zeros((depth,), r.dtype)]), route,
        may_lack=-1 if any_shorter else depth, **params
    )
    delivered = got[n:] != 0
    count = jnp.where(status[2] >= 0, status[2] - jnp.sum(delivered, dtype=np.int32), status[2])
    return [got[:n].reshape(r.shape), delivered, status.at[2].set(count)]


flagged_status_p = _core.new_expanded_primitive(
    "sendrecv_status_flagged", _flagged_status_shapes, _flagged_status_exchange
)


def _flagged_status_jvp(primals, tangents, *, depth, any_shorter, **params):
    (s, r, route), (ts, tr, _) = primals, tangents
    y, delivered, status = flagged_status_p.bind(s, r, route, depth=depth + 1, any_shorter=any_shorter, **params)
    dy = _status_tangent_exchange(ts, tr, route, delivered[depth], status, **params)
    zeros = np.zeros((depth,), jax.dtypes.float0), np.zeros((3,), jax.dtypes.float0)
    return (y, delivered[:depth], status), (dy, *zeros)


def _flagged_status_batch(args, dims, **params):
    _unbatched_route(dims[2])
    s, r = _batch_operands(args[:2], dims[:2])
    y, delivered, status = flagged_status_p.bind(s, r, args[2], **params)
    return [y, delivered, _count_per_lane(status, r.shape[0])], [0, _core.not_mapped, _core.not_mapped]


ad.primitive_jvps[flagged_status_p] = _flagged_status_jvp
batching.primitive_batchers[flagged_status_p] = _flagged_status_batch


def _check_source(source, comm, opname):
    if type(source) is int and 0 <= source < comm.size:  # the common case, first (eager calls)
        return source
    if isinstance(source, (int, np.integer)) and not isinstance(source, (bool, np.bool_)) \
            and int(source) == ANY_SOURCE:
        return ANY_SOURCE
    return check_rank(source, comm, "source", opname, allow_proc_null=True)


def _check_recvtag(tag, what, opname):
    if type(tag) is int and 0 <= tag < USER_TAG_LIMIT:  # the common case, first (eager calls)
        return tag
    if isinstance(tag, (int, np.integer)) and not isinstance(tag, (bool, np.bool_)) and int(tag) == ANY_TAG:
        return ANY_TAG
    return check_tag(tag, what, opname)


def _status_exchanges(sends, templates, *, comm, source, dest, sendtag, recvtag, exact):
    """Leaf-wise exchanges that report a status; one (source, tag) for all leaves.

    The first leaf's receive may use wildcards; the later leaves receive from
    the rank and tag it matched (dynamic route), so a pytree never mixes
    messages of two senders. `exact`: each message must fill its template
    (the caller gets no status); else a shorter one is valid and counted.
    """
    out, statuses = [], []
    route, dynamic, src, rtag = _static_route(), 0, source, recvtag
    for s, r in zip(sends, templates):
        y, status = _core.bind(
            sendrecv_status_p, s, r, route,
            comm=comm, source=src, dest=dest, sendtag=sendtag, recvtag=rtag, dynamic=dynamic,
            may_lack=0 if exact else -1,
        )
        if not statuses and (source == ANY_SOURCE or recvtag == ANY_TAG):
            route = jnp.concatenate([status[:2], jnp.zeros((2,), np.int32)])
            dynamic, src, rtag = _RECV_DYNAMIC, PROC_NULL, 0
        out.append(y)
        statuses.append(status)
    if not statuses:
        zero = jnp.zeros((), np.int32)
        return out, Status(zero + PROC_NULL, zero + ANY_TAG, zero)
    counts = jnp.stack([st[2] for st in statuses])
    count = jnp.where(jnp.all(counts >= 0), jnp.sum(counts), -1).astype(np.int32)
    return out, Status(statuses[0][0], statuses[0][1], count)


# ---------------------------------------------------------------------------
def sendrecv(
    sendbuf: Any,
    recv_template: Any,
    source: int,
    dest: int,
    *,
    sendtag: int = 0,
    recvtag: int = 0,
    comm: Any = None,
    return_status: bool = False,
) -> Any:
    """Send `sendbuf` to `dest` and receive from `source` in one deadlock-free step.

    Args:
      sendbuf: array or pytree to send (not sent when dest is PROC_NULL).
      recv_template: array or pytree with the structure of sendbuf, giving the
        shape and dtype of what arrives (leaf by leaf); returned unchanged
        when source is ``PROC_NULL``. Its values are otherwise ignored.
      source: a rank (static int), ``PROC_NULL`` (``MPI.PROC_NULL``, also
        ``distlinalg.comm.PROC_NULL``, e.g. the ends of a non-periodic chain)
        or ``ANY_SOURCE`` (``MPI.ANY_SOURCE``: the first matching message
        from any rank).
      dest: a rank or ``PROC_NULL``.
      sendtag: in [0, 4095].
      recvtag: in [0, 4095], or ``ANY_TAG`` (``MPI.ANY_TAG``).
      comm: mpi4py intracommunicator (default distlinalg's).
      return_status: also return a :class:`Status` (source, tag, count as
        int32 scalar arrays, traced under ``jit``).

    Returns:
      What arrived (shaped like recv_template), or recv_template when source
      is PROC_NULL; with ``return_status=True`` the pair ``(received, status)``.
      Each leaf's message must have the template's element count (a vmapped
      exchange counts the whole batch): a shorter or longer message raises
      on the receiving rank, with both counts. With ``return_status=True`` a
      shorter message is valid: it fills the template's head, the rest keeps
      the template's values, and ``status.count`` says how many arrived.
      A pytree arrives from one sender: with wildcards, its first leaf's
      message decides the source and tag of the others.

    AD: forward and reverse mode, any order. Tangents travel the same route;
    the transpose sends cotangents back along the reversed route (source and
    dest, sendtag and recvtag swapped); the template's cotangent is the
    output's where source is PROC_NULL, zero otherwise. A rank whose buffers
    are constants while its partners differentiate is handled as described
    in the module docstring. With ``ANY_SOURCE``/``ANY_TAG`` the tangent is
    received from the rank and tag that the primal message actually came
    from, and the cotangent goes back to it (the route recorded in the
    status); ``jax.linear_transpose`` of a wildcard receive, which has no
    forward pass to record it, raises. vmap: one message carries the batch
    (every rank must batch the exchange the same way); the status is
    unbatched and counts the elements of one lane.

    Example:
      >>> import jax.numpy as jnp
      >>> from distlinalg import comm
      >>> r, n = comm.rank(), comm.size()
      >>> right, left = (r + 1) % n, (r - 1) % n
      >>> x = jnp.full(2, float(r))
      >>> y = comm.sendrecv(x, x, source=left, dest=right)      # periodic shift to the right
      >>> bool((y == left).all())
      True
      >>> y, st = comm.sendrecv(x, x, source=comm.ANY_SOURCE, dest=right, return_status=True)
      >>> int(st.source) == left, int(st.count)
      (True, 2)
      >>> up = left if r > 0 else comm.PROC_NULL                # a chain: its ends talk to PROC_NULL
      >>> down = right if r < n - 1 else comm.PROC_NULL
      >>> y = comm.sendrecv(x, jnp.full(2, -1.0), source=up, dest=down)
      >>> bool((y == (r - 1 if r > 0 else -1.0)).all())         # rank 0 keeps its template
      True
    """
    comm = resolve_comm(comm)
    source = _check_source(source, comm, "sendrecv")
    dest = check_rank(dest, comm, "dest", "sendrecv", allow_proc_null=True)
    sendtag = check_tag(sendtag, "sendtag", "sendrecv")
    recvtag = _check_recvtag(recvtag, "recvtag", "sendrecv")
    if (isinstance(sendbuf, jax.Array) and isinstance(recv_template, jax.Array) and not return_status
            and source != ANY_SOURCE and recvtag != ANY_TAG):
        # One array each way (the common eager halo exchange): no pytree walks.
        check_dtype(sendbuf.dtype, "sendrecv")
        check_dtype(recv_template.dtype, "sendrecv")
        return _core.bind(sendrecv_p, sendbuf, recv_template, comm=comm, source=source, dest=dest,
                          sendtag=sendtag, recvtag=recvtag, may_lack=0)
    send_tree = jax.tree_util.tree_structure(sendbuf)
    recv_tree = jax.tree_util.tree_structure(recv_template)
    if send_tree != recv_tree:
        raise ValueError(
            "distlinalg.sendrecv: sendbuf and recv_template must have the same pytree structure, "
            f"got {send_tree} and {recv_tree}"
        )

    sends = [_core.as_array(leaf) for leaf in jax.tree_util.tree_leaves(sendbuf)]
    templates = [_core.as_array(leaf) for leaf in jax.tree_util.tree_leaves(recv_template)]
    for leaf in (*sends, *templates):  # every check before the first message
        check_dtype(leaf.dtype, "sendrecv")
    if return_status or source == ANY_SOURCE or recvtag == ANY_TAG:
        out, status = _status_exchanges(
            sends, templates, comm=comm, source=source, dest=dest, sendtag=sendtag, recvtag=recvtag,
            exact=not return_status,
        )
        received = jax.tree_util.tree_unflatten(recv_tree, out)
        return (received, status) if return_status else received
    out = [
        _core.bind(sendrecv_p, s, r, comm=comm, source=source, dest=dest, sendtag=sendtag, recvtag=recvtag,
                   may_lack=0)
        for s, r in zip(sends, templates)
    ]
    return jax.tree_util.tree_unflatten(recv_tree, out)


def send(x: Any, dest: int, *, tag: int = 0, comm: Any = None) -> None:
    """Send `x` (array or pytree, one message per leaf) to rank `dest`.

    Blocking standard-mode send: it may wait until `dest` receives, so order
    sends and receives so that no cycle of waiting ranks forms (or use
    :func:`sendrecv`). Sending to ``PROC_NULL`` does nothing.

    Args:
      x: array or pytree.
      dest: a rank (static int) or ``PROC_NULL``.
      tag: in [0, 4095]; the receiver must use the same tag.
      comm: mpi4py intracommunicator (default distlinalg's).

    Returns:
      None.

    AD: when `x` carries a tangent, the primal message is flagged and the
    tangent follows as a second message; in reverse mode the cotangent comes
    back from `dest`. The receiving rank must differentiate its ``recv`` too
    (its template must depend on the differentiated inputs); otherwise its
    receive fails: the message is longer than its template (module docstring).

    Example:
      >>> import jax.numpy as jnp
      >>> from distlinalg import comm
      >>> r, n = comm.rank(), comm.size()
      >>> partner = r + 1 if r % 2 == 0 else r - 1               # pairs (0, 1), (2, 3), ...
      >>> partner = partner if partner < n else comm.PROC_NULL   # a rank left over sends nowhere
      >>> got = None
      >>> if r % 2 == 0:
      ...     comm.send(jnp.arange(3.0) * (r + 1), dest=partner, tag=7)
      ... else:
      ...     got = comm.recv(jnp.zeros(3), source=partner, tag=7)
      >>> got is None or got.tolist() == (jnp.arange(3.0) * r).tolist()
      True
    """
    comm = resolve_comm(comm)
    dest = check_rank(dest, comm, "dest", "send", allow_proc_null=True)
    tag = check_tag(tag, "tag", "send")
    leaves = [_core.as_array(leaf) for leaf in jax.tree_util.tree_leaves(x)]
    for leaf in leaves:
        check_dtype(leaf.dtype, "send")
    for leaf in leaves:
        _core.bind(send_p, leaf, comm=comm, dest=dest, tag=tag)


def recv(
    template: Any, source: int, *, tag: int = 0, comm: Any = None, return_status: bool = False
) -> Any:
    """Receive from rank `source` an array (or pytree) shaped like `template`.

    Args:
      template: array or pytree giving shape and dtype (one message per
        leaf, in the sender's leaf order); returned unchanged when source is
        ``PROC_NULL``, otherwise its values are ignored.
      source: a rank (static int), ``PROC_NULL`` or ``ANY_SOURCE``
        (``MPI.ANY_SOURCE``: the first matching message from any rank).
      tag: in [0, 4095], the sender's tag, or ``ANY_TAG`` (``MPI.ANY_TAG``).
      comm: mpi4py intracommunicator (default distlinalg's).
      return_status: also return a :class:`Status` (source, tag, count as
        int32 scalar arrays, traced under ``jit``).

    Returns:
      What arrived, shaped like template; with ``return_status=True`` the
      pair ``(received, status)``. The message must have the template's
      element count, as for :func:`sendrecv` (shorter ones only with
      ``return_status=True``). A pytree arrives from one sender: with
      wildcards, its first leaf's message decides the source and tag of the
      others.

    AD: the recv is differentiated when its template carries a tangent. When
    the matching send's value depends on the differentiated inputs, pass a
    template that does too, e.g. ``recv(x * 0, source)`` with x a
    differentiated argument: the tangent then arrives as a second message and
    in reverse mode the cotangent goes back to `source`. With a constant
    template this receive fails (the message is longer than the template)
    instead of returning a wrong derivative. A differentiated recv whose sender does not
    differentiate gets a zero tangent (exact). From PROC_NULL the result is
    the template, with the template's tangent and cotangent. With
    ``ANY_SOURCE``/``ANY_TAG`` the tangent comes from the rank and tag the
    primal message came from and the cotangent goes back there (the route
    recorded in the status); ``jax.linear_transpose`` of a wildcard receive
    (no forward pass) raises. vmap: one message carries the batch; the
    status counts the elements of one lane.

    Example:
      >>> import jax.numpy as jnp
      >>> from distlinalg import comm
      >>> template = jnp.full(3, -1.0)
      >>> comm.recv(template, comm.PROC_NULL).tolist()       # nothing arrives: the template
      [-1.0, -1.0, -1.0]
      >>> r, n = comm.rank(), comm.size()
      >>> senders = []
      >>> if r == 0:                                          # rank 0 hears from every other rank
      ...     for _ in range(n - 1):                          # in arrival order
      ...         y, st = comm.recv(jnp.zeros(3), comm.ANY_SOURCE, tag=comm.ANY_TAG, return_status=True)
      ...         senders.append((int(st.source), int(st.tag), int(st.count)))
      ... else:
      ...     comm.send(jnp.ones(3) * r, dest=0, tag=r)
      >>> sorted(senders) == ([(s, s, 3) for s in range(1, n)] if r == 0 else [])
      True
    """
    comm = resolve_comm(comm)
    source = _check_source(source, comm, "recv")
    tag = _check_recvtag(tag, "tag", "recv")
    leaves, tree = jax.tree_util.tree_flatten(template)
    leaves = [_core.as_array(leaf) for leaf in leaves]
    for leaf in leaves:
        check_dtype(leaf.dtype, "recv")
    if return_status or source == ANY_SOURCE or tag == ANY_TAG:
        # A receive with a status is an exchange that sends nothing.
        out, status = _status_exchanges(
            [jnp.zeros((0,), leaf.dtype) for leaf in leaves], leaves,
            comm=comm, source=source, dest=PROC_NULL, sendtag=0, recvtag=tag, exact=not return_status,
        )
        received = jax.tree_util.tree_unflatten(tree, out)
        return (received, status) if return_status else received
    out = [_core.bind(recv_p, leaf, comm=comm, source=source, tag=tag) for leaf in leaves]
    return jax.tree_util.tree_unflatten(tree, out)
