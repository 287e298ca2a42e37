"""Blocking point-to-point: send and recv (one family: each is the other's transpose).

A receive's result is its template overwritten by the message, so receiving
from ``PROC_NULL`` returns the template unchanged, and sending to
``PROC_NULL`` sends nothing. AD: send's tangent is sent as a second message
(transpose: receive the cotangent back from dest); recv's tangent is a
second message from source (transpose: send the cotangent back to source).
Differentiated messages follow the flag protocol of comm/sendrecv.py (its
module docstring): a send or recv that is differentiated is a flagged
exchange there, with ``PROC_NULL`` on its other side. Receives that report a
status or use wildcards go through comm/sendrecv_status.py.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

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
from ._p2p_common import ANY_SOURCE, ANY_TAG, _aval, _check_recvtag, _check_source
from .sendrecv import _tangent_exchange, flagged_sendrecv_p, sendrecv_p
from .sendrecv_status import _status_exchanges

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
recv_p = _core.new_primitive("recv", templates=(0,))
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
    back from `dest`. The receiving rank's ``recv`` takes it whatever its
    template (comm/sendrecv.py's module docstring).

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

    AD: under ``jvp``/``grad``/``linearize`` the recv is always differentiated,
    whatever its template (``jnp.empty_like(x)`` works): the tangent arrives as
    a second message when the sender differentiates, and in reverse mode the
    cotangent goes back to `source`; a recv whose sender does not
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
