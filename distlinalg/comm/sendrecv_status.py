"""Receives that report their status, and wildcards (MPI.ANY_SOURCE, MPI.ANY_TAG).

sendrecv_status_p(s, r, route) -> (y, status): one MPI_Sendrecv that also
returns int32[3] (source, tag, count) of its receive (count in elements of
r's dtype, -1 when it does not fit int32). A recv is the same with
dest=PROC_NULL and an empty s. `dynamic` (bit 1: source and recvtag, bit 2:
dest and sendtag) takes that half of the route from the int32[4] operand
`route` (source, recvtag, dest, sendtag) at run time instead of the static
parameters.

Derivatives of a wildcard receive: the tangent must come from the rank (and
tag) that the primal message came from, and in reverse mode the cotangent
must go back to it. Neither is known at trace time, but both are known once
the primal message arrived: its status. So the derivative messages of a
status exchange use a dynamic route built from that status (tangent: from
status.source with tag status.tag | TANGENT_TAG_FLAG; cotangent: back to it
with ADJOINT_TAG_FLAG added). The sender side is the ordinary send/sendrecv
protocol (comm/sendrecv.py), unchanged. The one thing that cannot be done is
transposing a wildcard receive that never ran: jax.linear_transpose of a
program whose receive has a wildcard (no forward pass, so no status); that
raises at trace time.

A receive with MPI.ANY_TAG can meet a derivative message meant for a later
receive of this rank (in reverse mode a rank already transposing sends its
cotangent to a rank still in its forward pass). MPI cannot exclude tags
from a wildcard, so the handler (csrc/p2p.cc, "early arrivals") takes such
a message out of MPI, keeps it, and hands it to the explicit receive of its
(comm, source, tag); a wildcard receive only ever returns user messages.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._runtime.mpi import ADJOINT_TAG_FLAG, PROC_NULL, TANGENT_TAG_FLAG
from . import _core
from ._core import ad, batching
from ._p2p_common import ANY_SOURCE, ANY_TAG, _aval, _batch_operands

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


sendrecv_status_p = _core.new_primitive("sendrecv_status", multiple_results=True, templates=(1,))
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
        buffer = r * 0  # as in sendrecv.py's _sendrecv_transpose: differentiable again (Hessians)
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
    "sendrecv_status_flagged", _flagged_status_shapes, _flagged_status_exchange, templates=(1,)
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
