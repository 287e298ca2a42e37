"""scan / exscan: inclusive and exclusive prefix reductions over ranks.

Values: rank r gets op(x_0, ..., x_r) (scan) or op(x_0, ..., x_{r-1})
(exscan). MPI leaves rank 0's exscan output undefined; here it is the op's
identity: 0 (sum), 1 (prod), the dtype's largest value for min (+inf for
floats, True for bool) and its lowest for max (-inf, False). One primitive,
``scan_p``, with a static ``exclusive`` parameter (MPI_Scan / MPI_Exscan).

AD (docs/ad.md, "The convention: the adjoint of the whole SPMD program"):
  sum   linear. ẏ = SCAN(ẋ). Transpose: the suffix sum x̄_s = Σ_{r≥s} ȳ_r
        (exscan: Σ_{r>s} ȳ_r, so rank 0's identity output takes no
        cotangent). Computed exactly by recursive doubling in the reversed
        rank order, never as AR(ȳ) − EXSCAN(ȳ), which cancels
        catastrophically when the suffix is small against the total.
  prod  ẏ_r = Σ_{s≤r} (Π_{t≤r, t≠s} x_t) ẋ_s: the prefix product of the dual
        numbers (x, ẋ) — (p, d)∘(q, e) = (pq, dq + pe) — by recursive
        doubling. No division, so exact with zeros anywhere.
  min/max ẏ_r = Σ_{s≤r, x_s=y_r} ẋ_s / #{s≤r : x_s=y_r}: ties share the
        tangent equally, the convention of jnp.min/jnp.max (and of allreduce),
        i.e. exactly jax.jvp of the stacked global program written with
        jnp.max(g[:r+1], axis=0). (lax.cummax splits ties by its own
        association tree and differs for three or more ties.) Doubling over
        (m, count, d), combining by (m, c, d)∘(m', c', d') = (min(m, m'),
        c[m=min] + c'[m'=min], d[m=min] + d'[m'=min]).
The nonlinear JVPs are linear in ẋ through sendrecv (whose transpose is the
reversed exchange), so reverse mode and higher orders follow.

Why recursive doubling (Hillis–Steele) over point-to-point exchanges and not
an allgather: ⌈log2 P⌉ rounds of one message per state component, each of
the size of x, so memory and traffic per rank stay O(|x|) (O(|x| log P) in
total) instead of the O(P·|x|) of gathering every rank's rows; and unlike a
scan on a rank-reversed communicator it creates no communicator (a
collective call that every rank would have to make at the same point, hard
to guarantee under jit caches). The messages use the reserved tag
``SCAN_TAG`` (beyond the user range 0..4095, clear of derivative flags) on
the operation's communicator. vmap keeps the batch dimension (one message
carries the batch).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .._runtime.mpi import PROC_NULL, Communicator, ReduceOp, check_dtype, resolve_comm, resolve_op
from . import _core
from ._core import ad, batching
from .sendrecv import sendrecv_p

# Tag of the rules' internal messages: above the user tags (0..4095) and the
# derivative flags (0x1000, 0x2000), which may still be OR-ed into it when the
# rules themselves are differentiated; below the signature-check tags.
SCAN_TAG = 0x4000

scan_p = _core.new_primitive("scan")
_core.def_abstract_eval(scan_p, lambda x, *, comm, op, exclusive: _core.shaped(x.shape, x.dtype))
_core.register_lowering(
    scan_p,
    "distlinalg_scan",
    lambda *, comm, op, exclusive: {
        "comm": _core.comm_attr(comm),
        "op": np.int32(op),
        "exclusive": bool(exclusive),
    },
    # One rank: the inclusive prefix is x; the exclusive one is the handler's
    # zeros (the identity is added by _scan_value, as on rank 0 of any size).
    local=lambda x, *, exclusive, **_: [jnp.zeros_like(x) if exclusive else x],
)


def identity_of(op: ReduceOp, dtype: Any) -> Any:
    """The neutral element of op for dtype (rank 0's exscan result)."""
    dtype = np.dtype(dtype)
    if op in (ReduceOp.SUM, ReduceOp.BOR, ReduceOp.BXOR, ReduceOp.LOR, ReduceOp.LXOR):
        return np.zeros((), dtype)
    if op == ReduceOp.LAND:
        return np.ones((), dtype)
    if op == ReduceOp.BAND:  # every bit set
        return np.array(True) if dtype == np.bool_ else np.array(-1).astype(dtype)
    if op == ReduceOp.PROD:
        return np.ones((), dtype)
    if dtype == np.bool_:
        return np.array(op == ReduceOp.MIN)
    if jnp.issubdtype(dtype, jnp.floating):
        return np.array(np.inf if op == ReduceOp.MIN else -np.inf, dtype)
    info = jnp.iinfo(dtype)
    return np.array(info.max if op == ReduceOp.MIN else info.min, dtype)


def _scan_value(x: Any, comm: Communicator, op: ReduceOp, exclusive: bool) -> Any:
    y = _core.bind(scan_p, x, comm=comm, op=op, exclusive=exclusive)
    if exclusive and comm.rank == 0:
        # The handler zeroes rank 0's exscan output; the identity is added
        # (not substituted) so the result stays a function of the collective's
        # output and its derivative flows through the same rule on every rank.
        y = y + identity_of(op, y.dtype)
    return y


# ---------------------------------------------------------------------------
# Recursive doubling over ranks (used by the derivative rules)
def _exchange(arrays: Sequence[Any], identities: Sequence[Any], comm: Communicator, source: int, dest: int):
    """Send each array to dest, receive its counterpart from source (identity from PROC_NULL)."""
    return tuple(
        sendrecv_p.bind(
            a, jnp.full(a.shape, e, a.dtype), comm=comm, source=source, dest=dest, sendtag=SCAN_TAG, recvtag=SCAN_TAG,
            may_lack=0,
        )
        for a, e in zip(arrays, identities)
    )


def _partner(rank: int, size: int) -> int:
    return rank if 0 <= rank < size else PROC_NULL


def _shift(states, identities, comm: Communicator, *, reverse: bool):
    """Every rank's states move one rank up (down when reverse); the end rank gets identities."""
    r, p = comm.rank, comm.size
    up, down = _partner(r + 1, p), _partner(r - 1, p)
    source, dest = (up, down) if reverse else (down, up)
    return _exchange(states, identities, comm, source, dest)


def _doubling(states, combine: Callable, identities, comm: Communicator, *, reverse: bool):
    """Inclusive prefix (suffix when reverse) of per-rank states under an associative combine.

    combine(earlier, later) takes the states of a lower rank range first.
    After round k (distance 2^k) rank r holds the combination over ranks
    r-2^{k+1}+1 .. r. Every rank combines in every round — with the received
    identity where it has no partner, kept out by a select — so all ranks
    perform the same operations and, under vmap, send equally batched
    messages.
    """
    r, p = comm.rank, comm.size
    k = 1
    while k < p:
        if reverse:
            source, dest = _partner(r + k, p), _partner(r - k, p)
        else:
            source, dest = _partner(r - k, p), _partner(r + k, p)
        got = _exchange(states, identities, comm, source, dest)
        combined = combine(states, got) if reverse else combine(got, states)
        alone = source == PROC_NULL
        states = tuple(jnp.where(alone, s, c) for s, c in zip(states, combined))
        k *= 2
    return states


def _combine_dual_product(a, b):
    (pa, da), (pb, db) = a, b
    return pa * pb, da * pb + pa * db


def _combine_extremum(op: ReduceOp):
    pick = jnp.minimum if op == ReduceOp.MIN else jnp.maximum

    def combine(a, b):
        (ma, ca, da), (mb, cb, db) = a, b
        m = pick(ma, mb)
        wa, wb = ma == m, mb == m
        zero_c, zero_d = jnp.zeros_like(ca), jnp.zeros_like(da)
        return (
            m,
            jnp.where(wa, ca, zero_c) + jnp.where(wb, cb, zero_c),
            jnp.where(wa, da, zero_d) + jnp.where(wb, db, zero_d),
        )

    return combine


def _prefix(states, combine, identities, comm, *, exclusive: bool, reverse: bool = False):
    if exclusive:
        states = _shift(states, identities, comm, reverse=reverse)
    return _doubling(states, combine, identities, comm, reverse=reverse)


def _add(a, b):
    return tuple(x + y for x, y in zip(a, b))


# ---------------------------------------------------------------------------
def _scan_jvp(primals, tangents, *, comm: Communicator, op: ReduceOp, exclusive: bool):
    # The rule returns what the primitive returns (rank 0's exscan: the
    # handler's zeros); the public wrapper adds the identity to both the
    # plain and the differentiated call, once.
    (x,), (t,) = primals, tangents
    y = scan_p.bind(x, comm=comm, op=op, exclusive=exclusive)
    if op.is_bitwise_or_logical:  # integer and bool results: nothing to differentiate
        return y, ad.Zero.from_primal_value(y)
    t = _core.instantiate(t)
    if op == ReduceOp.SUM:
        return y, scan_p.bind(t, comm=comm, op=op, exclusive=exclusive)
    if op == ReduceOp.PROD:
        ident = (identity_of(op, x.dtype), np.zeros((), t.dtype))
        _, dy = _prefix((x, t), _combine_dual_product, ident, comm, exclusive=exclusive)
        return y, dy
    ident = (identity_of(op, x.dtype), np.zeros((), np.int32), np.zeros((), t.dtype))
    _, count, d = _prefix(
        (x, jnp.ones(x.shape, np.int32), t), _combine_extremum(op), ident, comm, exclusive=exclusive
    )
    # count == 0 only on rank 0 of an exscan, whose output is a constant.
    dy = jnp.where(count > 0, d / jnp.maximum(count, 1).astype(d.dtype), jnp.zeros_like(d))
    return y, dy


def _scan_transpose(ct, x, *, comm: Communicator, op: ReduceOp, exclusive: bool):
    if op != ReduceOp.SUM:
        raise NotImplementedError(f"scan with op {op.name.lower()} is not linear")
    ct = _core.instantiate(ct)
    (suffix,) = _prefix((ct,), _add, (np.zeros((), ct.dtype),), comm, exclusive=exclusive, reverse=True)
    return (suffix,)


def _scan_batch(args, dims, *, comm: Communicator, op: ReduceOp, exclusive: bool):
    (x,), (d,) = args, dims
    return scan_p.bind(x, comm=comm, op=op, exclusive=exclusive), d


ad.primitive_jvps[scan_p] = _scan_jvp
ad.primitive_transposes[scan_p] = _scan_transpose
batching.primitive_batchers[scan_p] = _scan_batch


def _api(x: Any, op: Any, comm: Any, exclusive: bool) -> Any:
    name = "exscan" if exclusive else "scan"
    comm = resolve_comm(comm)
    op = resolve_op(op)
    leaves, tree = jax.tree_util.tree_flatten(x)
    leaves = [_core.as_array(a) for a in leaves]
    for a in leaves:  # every check before the first collective
        check_dtype(a.dtype, name, op)
    out = [_scan_value(_core.truth_values(a, op), comm, op, exclusive) for a in leaves]
    return jax.tree_util.tree_unflatten(tree, out)


def scan(x: Any, op: Any = "sum", *, comm: Any = None) -> Any:
    """Inclusive prefix reduction over ranks: rank r gets op(x_0, ..., x_r).

    Args:
      x: array or pytree of arrays, the same shapes and dtypes on every rank.
        The reduction is elementwise (rank r's entry i combines entry i of
        ranks 0..r).
      op: ``"sum"``, ``"prod"``, ``"min"``, ``"max"``, the bitwise and logical ops
        (``"band"`` ... ``"lxor"``) or ``MPI.SUM`` ... ``MPI.LXOR``, with
        allreduce's dtype rules.
      comm: mpi4py intracommunicator (default distlinalg's).

    Returns:
      The prefix reduction, with the shape and dtype of x (rank 0 gets x_0).

    AD: forward and reverse mode, every op, any order. sum is linear (the
    transpose is the exact suffix sum of the cotangents over ranks s..P-1);
    prod is zero-safe; min/max share the tangent equally among ties, as
    ``jnp.max(stack[:r+1], axis=0)``. The derivative rules communicate by
    recursive doubling over sendrecv (``O(|x| log P)`` per rank, no gather).
    vmap: one message carries the batch.

    Example:
      >>> import jax.numpy as jnp
      >>> from distlinalg import comm
      >>> bool((comm.scan(jnp.ones(2)) == comm.rank() + 1).all())      # 1 + ... + 1, r + 1 times
      True
      >>> int(comm.scan(jnp.asarray(comm.rank()), "max")) == comm.rank()
      True
    """
    return _api(x, op, comm, exclusive=False)


def exscan(x: Any, op: Any = "sum", *, comm: Any = None) -> Any:
    """Exclusive prefix reduction over ranks: rank r gets op(x_0, ..., x_{r-1}).

    Arguments and dtypes as :func:`scan`. Rank 0 gets the op's identity,
    which MPI leaves undefined: 0 for sum, 1 for prod, for min the dtype's
    largest value (+inf for floats, True for bool), for max its lowest
    (-inf, False).

    AD as :func:`scan`: rank 0's output is a constant (zero tangent, its
    cotangent is dropped); the transpose of the sum is the exclusive suffix
    sum x̄_s = Σ_{r>s} ȳ_r.

    Example:
      >>> import jax.numpy as jnp
      >>> from distlinalg import comm
      >>> bool((comm.exscan(jnp.ones(2)) == comm.rank()).all())   # rank 0: the identity 0
      True
      >>> m = comm.exscan(jnp.asarray(float(comm.rank())), "max")  # rank 0: -inf
      >>> float(m) == (comm.rank() - 1 if comm.rank() > 0 else float("-inf"))
      True
    """
    return _api(x, op, comm, exclusive=True)
