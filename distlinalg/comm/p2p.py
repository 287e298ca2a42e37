"""Point-to-point: send, recv and sendrecv.

Receive buffers are operands aliased to the result, so receiving from
``PROC_NULL`` returns the template unchanged (MPI leaves it untouched).

AD (design note):
  sendrecv: ẏ = sendrecv(ṡ, ṙ) along the same route; the transpose sends the
    cotangent back along the reversed route (source and dest swapped), and
    the template's cotangent is ȳ where the source is PROC_NULL, else zero.
    Forward and reverse mode are both exact.
  send / recv: the tangent of a sent value travels as its own message, and
    the transpose of a send is a receive of the partner's cotangent (and
    vice versa). Derivative messages carry flagged tags, so a tangent can
    never be taken for a primal value.

The one pattern to know: JAX differentiates a ``recv`` only if its template
carries a tangent. When the sent value depends on the differentiated
inputs, the receiving rank must pass a template that does too (for instance
``recv(x * 0, source)`` with x traced, or any array computed from the
differentiated inputs), otherwise the sender's tangent message is never
received: small messages are lost silently (never mistaken for data) and
large ones block. ``sendrecv`` has no such requirement, since both sides
carry data; prefer it for differentiable exchanges.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._mpi import (
    ADJOINT_TAG_FLAG,
    PROC_NULL,
    TANGENT_TAG_FLAG,
    Communicator,
    check_dtype,
    check_rank,
    check_tag,
    resolve_comm,
)
from . import _core
from ._core import ad, batching

# ---------------------------------------------------------------------------
# sendrecv
sendrecv_p = _core.new_primitive("sendrecv")
_core.def_abstract_eval(
    sendrecv_p, lambda s, r, *, comm, source, dest, sendtag, recvtag: _core.shaped(r.shape, r.dtype)
)
_core.register_lowering(
    sendrecv_p,
    "distlinalg_sendrecv",
    lambda *, comm, source, dest, sendtag, recvtag: {
        "comm": _core.comm_attr(comm),
        "source": np.int32(source),
        "dest": np.int32(dest),
        "sendtag": np.int32(sendtag),
        "recvtag": np.int32(recvtag),
    },
    aliases={1: 0},
)


def _sendrecv_jvp(primals, tangents, *, comm, source, dest, sendtag, recvtag):
    (s, r), (ts, tr) = primals, tangents
    y = sendrecv_p.bind(s, r, comm=comm, source=source, dest=dest, sendtag=sendtag, recvtag=recvtag)
    dy = sendrecv_p.bind(
        _core.instantiate(ts), _core.instantiate(tr), comm=comm, source=source, dest=dest,
        sendtag=sendtag | TANGENT_TAG_FLAG, recvtag=recvtag | TANGENT_TAG_FLAG,
    )
    return y, dy


def _aval(x: Any) -> Any:
    return x.aval if _core.is_undefined(x) else jax.typeof(x)


def _sendrecv_transpose(ct, s, r, *, comm, source, dest, sendtag, recvtag):
    ct = _core.instantiate(ct)
    send_aval = _aval(s)
    # Always communicate: the partner's transpose posts the matching call.
    back = sendrecv_p.bind(
        ct, jnp.zeros(send_aval.shape, send_aval.dtype), comm=comm, source=dest, dest=source,
        sendtag=recvtag | ADJOINT_TAG_FLAG, recvtag=sendtag | ADJOINT_TAG_FLAG,
    )
    ct_s = back if _core.is_undefined(s) else None
    ct_r = None
    if _core.is_undefined(r):
        ct_r = ct if source == PROC_NULL else jnp.zeros_like(ct)
    return ct_s, ct_r


def _sendrecv_batch(args, dims, **params):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not _core.not_mapped)
    s, r = (_core.moveaxis_or_broadcast(a, d, 0, size) for a, d in zip(args, dims))
    return sendrecv_p.bind(s, r, **params), 0


ad.primitive_jvps[sendrecv_p] = _sendrecv_jvp
ad.primitive_transposes[sendrecv_p] = _sendrecv_transpose
batching.primitive_batchers[sendrecv_p] = _sendrecv_batch

# ---------------------------------------------------------------------------
# send
send_p = _core.new_primitive("send", multiple_results=True)
_core.def_abstract_eval(send_p, lambda x, *, comm, dest, tag: [])
_core.register_lowering(
    send_p,
    "distlinalg_send",
    lambda *, comm, dest, tag: {"comm": _core.comm_attr(comm), "dest": np.int32(dest), "tag": np.int32(tag)},
    token_only_result=True,
)


def _send_jvp(primals, tangents, *, comm, dest, tag):
    (x,), (t,) = primals, tangents
    send_p.bind(x, comm=comm, dest=dest, tag=tag)
    send_p.bind(_core.instantiate(t), comm=comm, dest=dest, tag=tag | TANGENT_TAG_FLAG)
    return [], []


def _send_transpose(cts, x, *, comm, dest, tag):
    aval = _aval(x)
    # The cotangent of what we sent is what the receiver's transpose returns.
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
    aliases={0: 0},
)


def _recv_jvp(primals, tangents, *, comm, source, tag):
    (t,), (tt,) = primals, tangents
    y = recv_p.bind(t, comm=comm, source=source, tag=tag)
    dy = recv_p.bind(_core.instantiate(tt), comm=comm, source=source, tag=tag | TANGENT_TAG_FLAG)
    return y, dy


def _recv_transpose(ct, template, *, comm, source, tag):
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
def sendrecv(
    sendbuf: Any,
    recv_template: Any,
    source: int,
    dest: int,
    *,
    sendtag: int = 0,
    recvtag: int = 0,
    comm: Any = None,
) -> Any:
    """Send `sendbuf` to `dest` and receive from `source` in one deadlock-free step.

    Args:
      sendbuf: array or pytree to send (ignored when dest is PROC_NULL).
      recv_template: array or pytree (same structure as sendbuf) giving the
        shape and dtype of what arrives; returned unchanged when source is
        ``PROC_NULL``.
      source, dest: ranks (static ints) or ``distlinalg.comm.PROC_NULL``
        (``MPI.PROC_NULL``).
      sendtag, recvtag: tags in [0, 4095].
      comm: mpi4py intracommunicator (default distlinalg's).

    Returns:
      What `source` sent (shaped like recv_template).

    AD: forward and reverse mode. Tangents travel the same route; the
    transpose sends cotangents back along the reversed route; the template's
    cotangent is the output's where source is PROC_NULL.
    """
    comm = resolve_comm(comm)
    source = check_rank(source, comm, "source", "sendrecv", allow_proc_null=True)
    dest = check_rank(dest, comm, "dest", "sendrecv", allow_proc_null=True)
    sendtag = check_tag(sendtag, "sendtag", "sendrecv")
    recvtag = check_tag(recvtag, "recvtag", "sendrecv")
    if jax.tree_util.tree_structure(sendbuf) != jax.tree_util.tree_structure(recv_template):
        raise ValueError("distlinalg.sendrecv: sendbuf and recv_template must have the same pytree structure")

    def one(s, r):
        s, r = _core.as_array(s), _core.as_array(r)
        check_dtype(s.dtype, "sendrecv")
        check_dtype(r.dtype, "sendrecv")
        return _core.bind(sendrecv_p, s, r, comm=comm, source=source, dest=dest, sendtag=sendtag, recvtag=recvtag)

    return jax.tree_util.tree_map(one, sendbuf, recv_template)


def send(x: Any, dest: int, *, tag: int = 0, comm: Any = None) -> None:
    """Send `x` (array or pytree) to rank `dest` (or PROC_NULL: nothing).

    Blocking standard-mode send: it may wait for the matching `recv`, so
    order sends and receives so that no cycle forms (or use sendrecv).

    AD: the tangent is sent as a second message (see the module docstring
    for the matching recv's requirement); the transpose receives the
    cotangent back from `dest`.
    """
    comm = resolve_comm(comm)
    dest = check_rank(dest, comm, "dest", "send", allow_proc_null=True)
    tag = check_tag(tag, "tag", "send")
    for leaf in jax.tree_util.tree_leaves(x):
        leaf = _core.as_array(leaf)
        check_dtype(leaf.dtype, "send")
        _core.bind(send_p, leaf, comm=comm, dest=dest, tag=tag)


def recv(template: Any, source: int, *, tag: int = 0, comm: Any = None) -> Any:
    """Receive from rank `source` an array (or pytree) shaped like `template`.

    Args:
      template: gives shape and dtype; returned unchanged when source is
        ``PROC_NULL``. When differentiating a program whose matching send
        carries a tangent, the template must carry one too (compute it from
        the differentiated inputs): see the module docstring.
      source: a rank (static int) or PROC_NULL.
      tag: in [0, 4095].

    AD: the tangent arrives as a second message; the transpose sends the
    cotangent back to `source`.
    """
    comm = resolve_comm(comm)
    source = check_rank(source, comm, "source", "recv", allow_proc_null=True)
    tag = check_tag(tag, "tag", "recv")

    def one(t):
        t = _core.as_array(t)
        check_dtype(t.dtype, "recv")
        return _core.bind(recv_p, t, comm=comm, source=source, tag=tag)

    return _core.tree_apply(one, template)
