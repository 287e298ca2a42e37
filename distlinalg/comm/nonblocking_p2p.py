"""Non-blocking point-to-point: isend, irecv (and ``wait`` from comm.nonblocking).

``wait(isend(x, dest))`` returns None once the message has left this rank's
hands (MPI_Isend/MPI_Wait); ``wait(irecv(template, source))`` returns the
message, shaped like the template (MPI_Irecv/MPI_Wait). Starts and waits
are ordered primitives: the program order is the communication order, under
jit, grad, vmap, scan and while_loop, with no dependency wiring. Requests
follow comm.nonblocking's rules (waited for in the traced function that
started them; eager requests pending at exit are cancelled, with a warning).

Messages match as in MPI: by (source, tag) in the order they are started.
A receive checks what arrived: a message of another element count is an
error at the wait, naming the route (no cross-rank signature check runs).
``source=PROC_NULL`` receives nothing and returns the template;
``dest=PROC_NULL`` sends nothing. Wildcards (ANY_SOURCE, ANY_TAG) are not
accepted (use ``recv``). Messages are limited to 2³¹ − 2 elements.

AD (docs/ad.md: a message is the linear map y_dest = x_source)
--------------------------------------------------------------
First order, forward and reverse mode. The tangent of a message travels the
same route as a second message (tag | TANGENT), the cotangent the reversed
route (tag | ADJOINT), started where the wait is transposed and waited for
where the start is, so in reverse mode it travels while the reverse pass
computes what lay between start and wait.

JAX differentiates an operation only when an input carries a tangent, so a
receive into a constant template is not differentiated even when its sender
is. As in comm.p2p, a differentiated isend says so in its message: one extra
element, all bytes set (the *flag*); a differentiated irecv posts room for
it, preset to zero:

* receiver differentiates, sender does too: the flag is set, the tangent
  message (posted at the irecv's start) is received at the wait;
* receiver differentiates, sender does not: the message is one element
  shorter, the flag stays zero, the posted tangent receive is cancelled and
  the tangent is zero (exact: the sent value does not depend on the inputs);
* receiver does not differentiate, sender does: the message is one element
  longer than the buffer, an MPI truncation error at the receiver's wait.
  Give the receive a template that depends on the differentiated inputs,
  e.g. ``irecv(x, source)`` (the template's values are overwritten) or
  ``irecv(x * 0, source)``.

In reverse mode the receiver returns the cotangent only where the flag was
set, and the sender always waits for it. Second-order derivatives (Hessians)
through isend/irecv raise NotImplementedError: use ``sendrecv``/``send``/
``recv``. vmap: one message carries the whole batch; both sides must map
alike.

``jax.linear_transpose`` of a program with isend/irecv (no JVP, so no flag)
transposes every message: each receiver sends its cotangent back, each
sender receives it. Under ``vmap`` a sender cannot tell whether that
cotangent is batched; transpose the unbatched program, or differentiate
(``jax.vjp`` carries the batch in its residuals). sparse_rows' ``.T`` uses
the blocking exchange for this reason.

The cotangents of two in-flight exchanges with the same route and tag match
in the order their waits are transposed: wait for such requests in the same
order on both ranks (as a program that waits in start order does).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._runtime.mpi import ADJOINT_TAG_FLAG, PROC_NULL, TANGENT_TAG_FLAG, check_dtype, check_rank, check_tag, resolve_comm
from . import _core
from . import nonblocking as nb
from .._runtime.jax_names import not_mapped
from ._core import ad, batching


def _one() -> Any:
    return np.int32(1)


# ---------------------------------------------------------------------------
# Starts: (buffer, active) -> a zero-byte marker shaped (*buffer.shape, 0).
# `active` (int32 scalar) = 0 posts nothing; `flagged` adds the flag slot.
def _new_p2p_start(name: str, peer_attribute: str) -> Any:
    prim = _core.new_primitive(name)
    _core.def_abstract_eval(prim, lambda x, active, **params: _core.shaped((*x.shape, 0), x.dtype))
    _core.register_lowering(
        prim,
        f"distlinalg_{name}",
        lambda *, comm, peer, tag, flagged, key: {
            "comm": _core.comm_attr(comm),
            peer_attribute: np.int32(peer),
            "tag": np.int32(tag),
            "flagged": np.int32(flagged),
            "request": nb._key_number(key),
        },
        on_lower=nb._check_waited(name),
    )
    return prim


isend_p = _new_p2p_start("isend", "dest")
irecv_p = _new_p2p_start("irecv", "source")

# Waits of point-to-point requests (the plain one is comm.nonblocking's wait_p):
#   wait_flag_p: a flagged receive -> (message, flag as int32)
#   wait_if_p:   (marker, active) -> the message where active != 0, else the
#                request is cancelled and the template returned
wait_flag_p = _core.new_primitive("wait_flag", multiple_results=True)
_core.def_abstract_eval(
    wait_flag_p,
    lambda marker, *, comm, key, start, peer, tag: [
        _core.shaped(marker.shape[:-1], marker.dtype),
        _core.shaped((), np.int32),
    ],
)
_core.register_lowering(wait_flag_p, "distlinalg_wait_flag", lambda **params: {"request": nb._key_number(params["key"])})

wait_if_p = _core.new_primitive("wait_if")
_core.def_abstract_eval(
    wait_if_p,
    lambda marker, active, *, comm, key, start, peer, tag: _core.shaped(
        marker.shape[:-1] if start == "irecv" else (0,), marker.dtype
    ),
)
_core.register_lowering(wait_if_p, "distlinalg_wait_if", lambda **params: {"request": nb._key_number(params["key"])})


def _start(prim: Any, x: Any, active: Any, *, comm, peer, tag, key, flagged=False) -> Any:
    return _core.bind(prim, x, active, comm=comm, peer=peer, tag=tag, flagged=flagged, key=key)


def _note_wait(key: tuple) -> None:
    if not nb.jax_names.at_top_level():
        nb._waits_traced.add(key)


def _wait_plain(marker: Any, *, comm, key, start, route) -> Any:
    _note_wait(key)
    return _core.bind(nb.wait_p, marker, comm=comm, key=key, start=start, route=route)


def _wait_flag(marker: Any, *, comm, key, start, peer, tag) -> Any:
    _note_wait(key)
    return _core.bind(wait_flag_p, marker, comm=comm, key=key, start=start, peer=peer, tag=tag)


def _wait_if(marker: Any, active: Any, *, comm, key, start, peer, tag) -> Any:
    _note_wait(key)
    return _core.bind(wait_if_p, marker, active, comm=comm, key=key, start=start, peer=peer, tag=tag)


# --- AD ---------------------------------------------------------------------
def _first_order_only(name: str, flagged: bool, key: tuple) -> None:
    if flagged or key[-1] in ("t", "T"):
        raise NotImplementedError(
            f"distlinalg.{name}: second-order derivatives through non-blocking point-to-point "
            "messages are not supported; use distlinalg.comm.sendrecv / send / recv there"
        )


def _isend_jvp(primals, tangents, *, comm, peer, tag, flagged, key):
    (x, active), (t, _) = primals, tangents
    _first_order_only("isend", flagged, key)
    # The message says that a tangent follows (the flag), and the tangent goes now.
    marker = _start(isend_p, x, active, comm=comm, peer=peer, tag=tag, key=key, flagged=True)
    marker_t = _start(isend_p, _core.instantiate(t), active, comm=comm, peer=peer, tag=tag | TANGENT_TAG_FLAG,
                      key=nb._tangent_key(key))
    return marker, marker_t


def _irecv_jvp(primals, tangents, *, comm, peer, tag, flagged, key):
    (template, active), (t, _) = primals, tangents
    _first_order_only("irecv", flagged, key)
    marker = _start(irecv_p, template, active, comm=comm, peer=peer, tag=tag, key=key, flagged=True)
    # The tangent receive is posted now, in start order (so it matches its
    # sender's tangent message), and cancelled at the wait if the flag says
    # none comes. Its template, 0·ṫ: the message overwrites the template.
    marker_t = _start(irecv_p, 0 * _core.instantiate(t), active, comm=comm, peer=peer,
                      tag=tag | TANGENT_TAG_FLAG, key=nb._tangent_key(key))
    return marker, marker_t


def _batched_like(value: Any, marker: Any) -> Any:
    """The int32 `value`, batched like the zero-byte `marker` (under vmap, one copy per lane).

    The transposes of the derivative waits build their adjoint messages from
    this residual, so the messages carry the batch exactly as the primal ones
    do, even where a cotangent does not depend on the batch.
    """
    return value + jnp.sum(marker).astype(jnp.int32)  # the sum of no elements: 0


def _p2p_wait_jvp(primals, tangents, *, comm, key, start, route):
    """The JVP of wait_p for a point-to-point request (only reached when its start was differentiated)."""
    (marker,), (marker_t,) = primals, tangents
    _first_order_only(f"wait({start})", route is None, key)  # an adjoint message's wait has no route
    peer, tag = route
    key_t = nb._tangent_key(key)
    marker_t = _core.instantiate(marker_t)
    if start == "isend":
        out = _wait_plain(marker, comm=comm, key=key, start=start, route=route)
        out_t = _wait_if(marker_t, _batched_like(np.int32(1), marker), comm=comm, key=key_t, start=start, peer=peer,
                         tag=tag)
        return out, out_t
    y, flag = _wait_flag(marker, comm=comm, key=key, start=start, peer=peer, tag=tag)
    y_t = _wait_if(marker_t, _batched_like(flag, marker), comm=comm, key=key_t, start=start, peer=peer, tag=tag)
    return y, y_t


def _wait_if_transpose(ct, marker, active, *, comm, key, start, peer, tag):
    """Starts the adjoint message; the start's transpose waits for it."""
    adjoint_key = nb._adjoint_key(key)
    aval = marker.aval
    shape = aval.shape[:-1]
    if start == "isend":
        # The cotangent comes back from dest (every rank that receives a flagged
        # message returns it). Its buffer is batched like `active`.
        template = jnp.zeros(shape, aval.dtype) + (0 * active).astype(aval.dtype)
        back = _start(irecv_p, template, _one(), comm=comm, peer=peer, tag=tag | ADJOINT_TAG_FLAG, key=adjoint_key)
    else:
        # Sent back to source only where its flag said it differentiates.
        ct = _core.instantiate(ct) + (0 * active).astype(aval.dtype)
        back = _start(isend_p, ct, active, comm=comm, peer=peer, tag=tag | ADJOINT_TAG_FLAG, key=adjoint_key)
    return jnp.reshape(back, aval.shape), None


def _p2p_wait_transpose(ct, marker, *, comm, key, start, route):
    """The transpose of the plain wait of a message that was not differentiated but is linear.

    ``jax.linear_transpose`` (and a solver's transposed operator) transposes
    a program traced without JVP: no flag travels, and every rank transposes
    the same program, so each receiver sends its cotangent back and each
    sender receives it.
    """
    _first_order_only(f"wait({start})", route is None, key)
    peer, tag = route
    marker_ct, _ = _wait_if_transpose(ct, marker, _one(), comm=comm, key=key, start=start, peer=peer, tag=tag)
    return (marker_ct,)


def _isend_transpose(ct, x, active, *, comm, peer, tag, flagged, key):
    adjoint_key = nb._adjoint_key(key)
    marker = jnp.reshape(_core.instantiate(ct), (*x.aval.shape, 0))
    x_bar = _wait_plain(marker, comm=comm, key=adjoint_key, start="irecv", route=None)
    return x_bar, None


def _irecv_transpose(ct, template, active, *, comm, peer, tag, flagged, key):
    adjoint_key = nb._adjoint_key(key)
    aval = template.aval
    marker = jnp.reshape(_core.instantiate(ct), (*aval.shape, 0))
    # Completes the returning cotangent's send (a no-op where none was posted).
    nb._bind_wait_discard(marker, comm=comm, key=adjoint_key)
    # The message overwrote the template: no cotangent flows to it.
    return jnp.zeros(aval.shape, aval.dtype), None


# --- vmap -------------------------------------------------------------------
def _start_batch(prim):
    def batch(args, dims, **params):
        (x, active), (d, da) = args, dims
        if da is not not_mapped:
            active = jnp.take(active, 0, axis=da)  # equal in every lane by construction
        x = jnp.moveaxis(x, d, 0) if d is not not_mapped else x
        marker = prim.bind(x, active, **params)
        return marker, (0 if d is not not_mapped else not_mapped)

    return batch


def _wait_flag_batch(args, dims, **params):
    (marker,), (d,) = args, dims
    if d is not not_mapped and d != 0:
        marker, d = jnp.moveaxis(marker, d, 0), 0
    y, flag = wait_flag_p.bind(marker, **params)
    return [y, flag], [d, not_mapped]


def _wait_if_batch(args, dims, **params):
    (marker, active), (d, da) = args, dims
    if da is not not_mapped:
        active = jnp.take(active, 0, axis=da)
    if d is not not_mapped and d != 0:
        marker, d = jnp.moveaxis(marker, d, 0), 0
    out = wait_if_p.bind(marker, active, **params)
    if params["start"] == "isend":
        return out, not_mapped
    return out, d


ad.primitive_jvps[isend_p] = _isend_jvp
ad.primitive_jvps[irecv_p] = _irecv_jvp
ad.primitive_transposes[isend_p] = _isend_transpose
ad.primitive_transposes[irecv_p] = _irecv_transpose
ad.primitive_transposes[wait_if_p] = _wait_if_transpose
batching.primitive_batchers[isend_p] = _start_batch(isend_p)
batching.primitive_batchers[irecv_p] = _start_batch(irecv_p)
batching.primitive_batchers[wait_flag_p] = _wait_flag_batch
batching.primitive_batchers[wait_if_p] = _wait_if_batch


# ---------------------------------------------------------------------------
def _start_all(name: str, prim: Any, tree: Any, peer: int, tag: int, comm: Any) -> nb.Request:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    leaves = [_core.as_array(leaf) for leaf in leaves]
    for leaf in leaves:  # every leaf checked before anything is posted
        check_dtype(leaf.dtype, name, None)
    keys = nb._new_keys(len(leaves))
    markers = []
    for leaf, key in zip(leaves, keys):
        markers.append(_start(prim, leaf, _one(), comm=comm, peer=peer, tag=tag, key=key))
    nb._note_eager_start(name, keys)
    return nb.Request(tuple(markers), name, keys, treedef, comm, route=(peer, tag))


def isend(x: Any, dest: int, *, tag: int = 0, comm: Any = None) -> nb.Request:
    """Start sending `x` to rank `dest`; ``wait(request)`` completes it.

    Args:
      x: array or pytree of arrays (any shape; a pytree goes as one message
        per leaf, in leaf order).
      dest: destination rank (a Python int), or ``PROC_NULL`` (nothing sent).
      tag: message tag, 0..4095.
      comm: communicator (default distlinalg's).

    Returns:
      A :class:`~distlinalg.comm.Request`; ``wait(request)`` returns None.
      The request owns a copy of `x`: changing or donating `x` after the start
      does not change the message.

    AD: first order, forward and reverse mode (module docstring: the tangent
    follows the message, the cotangent comes back from `dest`). vmap: the
    batch goes as one message.

    Example:
      mpi4torch's ring: each rank sends ``a`` to the right and adds what it receives from
      the left; the gradient is 2 everywhere, with no dependency wiring.

      >>> import jax
      >>> import jax.numpy as jnp
      >>> from distlinalg import comm
      >>> right, left = (comm.rank() + 1) % comm.size(), (comm.rank() - 1) % comm.size()
      >>> def ring(a):
      ...     sent = comm.isend(a, right)
      ...     b = comm.wait(comm.irecv(a, left))    # template a: shape, dtype and AD
      ...     comm.wait(sent)
      ...     return jnp.sum(a + b)
      >>> jax.jit(jax.grad(ring))(jnp.ones(3)).tolist()
      [2.0, 2.0, 2.0]
    """
    comm = resolve_comm(comm)
    dest = check_rank(dest, comm, "dest", "isend", allow_proc_null=True)
    tag = check_tag(tag, "tag", "isend")
    return _start_all("isend", isend_p, x, dest, tag, comm)


def irecv(template: Any, source: int, *, tag: int = 0, comm: Any = None) -> nb.Request:
    """Start receiving a message shaped like `template` from rank `source`.

    Args:
      template: array or pytree of arrays: the shapes and dtypes of the
        message (one message per leaf, in leaf order, as isend sends them).
        Its values are returned where nothing arrives (``source=PROC_NULL``).
      source: sending rank (a Python int), or ``PROC_NULL``.
      tag: message tag, 0..4095.
      comm: communicator (default distlinalg's).

    Returns:
      A :class:`~distlinalg.comm.Request`; ``wait(request)`` returns the
      message, shaped like `template`. A message of another element count is
      an error at the wait.

    AD: first order, forward and reverse mode. The receive is differentiated
    when `template` depends on the differentiated inputs (JAX's rule); if its
    sender differentiates, it must be (module docstring). vmap: as isend.

    Example:
      A halo exchange down a chain of ranks, with work in between:

      >>> import jax.numpy as jnp
      >>> from distlinalg import comm
      >>> r, n = comm.rank(), comm.size()
      >>> up = r - 1 if r > 0 else comm.PROC_NULL
      >>> down = r + 1 if r < n - 1 else comm.PROC_NULL
      >>> request = comm.irecv(jnp.zeros(4), source=up)     # the last row of the block above
      >>> sent = comm.isend(jnp.full(4, float(r)), dest=down)
      >>> interior = 2 * jnp.ones(4)                        # computed meanwhile
      >>> halo = comm.wait(request)
      >>> comm.wait(sent)
      >>> halo.tolist() == [float(r - 1) if r > 0 else 0.0] * 4   # rank 0: the template
      True
    """
    comm = resolve_comm(comm)
    source = check_rank(source, comm, "source", "irecv", allow_proc_null=True)
    tag = check_tag(tag, "tag", "irecv")
    if source == PROC_NULL:
        # Nothing arrives: the request holds the template itself.
        leaves, treedef = jax.tree_util.tree_flatten(template)
        return nb.Request(tuple(_core.as_array(leaf) for leaf in leaves), "irecv_null", (), treedef, comm)
    return _start_all("irecv", irecv_p, template, source, tag, comm)


def _wait_request(request: nb.Request) -> Any:
    """comm.nonblocking.wait for point-to-point requests."""
    if request.start == "irecv_null":
        return jax.tree_util.tree_unflatten(request.treedef, list(request.markers))
    results = []
    for marker, key in zip(request.markers, request.keys):
        if request.start == "isend":
            nb._bind_wait_discard(marker, comm=request.comm, key=key, start="isend", route=request.route)
        else:
            results.append(_wait_plain(marker, comm=request.comm, key=key, start="irecv", route=request.route))
    nb._note_eager_waited(request.keys)
    if request.start == "isend":
        return None
    return jax.tree_util.tree_unflatten(request.treedef, results)


nb._P2P_WAITERS.update({"isend": _wait_request, "irecv": _wait_request, "irecv_null": _wait_request})
nb._P2P_JVP.update({"isend": _p2p_wait_jvp, "irecv": _p2p_wait_jvp})
nb._P2P_TRANSPOSE.update({"isend": _p2p_wait_transpose, "irecv": _p2p_wait_transpose})

__all__ = ["irecv", "isend", "irecv_p", "isend_p", "wait_flag_p", "wait_if_p"]
