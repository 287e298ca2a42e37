"""Point-to-point exchange: sendrecv, and the protocol of differentiated messages.

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
* Every receive bound under a JVP or linearize trace is differentiated, even
  when its template (and, for sendrecv, its send buffer) carries no tangent:
  the template is given a zero tangent (``_core.ReceivingPrimitive``), in
  reverse mode a linear one, so the receive's transpose returns the
  cotangent to its source. So the receiving side of a differentiated
  message always takes part, whatever the user's template (issue 67:
  ``jnp.empty_like`` templates and lone send/recv pairs, as in mpi4jax's
  shallow-water example). Only a receive outside any differentiation whose
  source differentiates (different transformations on the two ranks) gets a
  message one element longer than its buffer: MPI truncates it
  (``MPI_ERR_TRUNCATE``), raised on that rank ("the message from rank ... is
  longer than the receive template").

With ``DISTLINALG_CHECK=1`` every message first exchanges its signature, so a
mismatch is reported on both ranks with the element counts; a flagged
receive accepts the shorter message of a source that does not differentiate.

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
that status (comm/sendrecv_status.py). The blocking ``send`` and ``recv`` are
in comm/send_recv.py; a differentiated send or recv is a flagged exchange of
this module with ``PROC_NULL`` on its other side.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from .._runtime.mpi import (
    ADJOINT_TAG_FLAG,
    PROC_NULL,
    TANGENT_TAG_FLAG,
    check_dtype,
    check_rank,
    check_tag,
    resolve_comm,
)
from . import _core
from ._core import ad, batching
from ._p2p_common import ANY_SOURCE, ANY_TAG, _aval, _batch_operands, _check_recvtag, _check_source
from .sendrecv_status import _status_exchanges

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
sendrecv_p = _core.new_primitive("sendrecv", templates=(1,))
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


flagged_sendrecv_p = _core.new_expanded_primitive(
    "sendrecv_flagged", _flagged_shapes, _flagged_exchange, templates=(1,)
)


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

