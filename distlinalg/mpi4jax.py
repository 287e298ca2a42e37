"""mpi4jax's public API on distlinalg's primitives.

``import distlinalg.mpi4jax as mpi4jax`` is the whole migration of a script
written for mpi4jax 0.9: the same functions with the same argument names,
order and defaults, the same return values (including what non-root ranks
get from ``gather``, ``reduce`` and ``bcast``), ``status=`` filling an
``mpi4py.MPI.Status`` eagerly and under ``jit``, and ``has_cuda_support()``.
What changes is what distlinalg adds: every operation is differentiable in
forward and reverse mode, at any order, under ``vmap``, with the transposes
of the whole SPMD program (docs/ad.md). For one operation that means a
different number than mpi4jax gives: the transpose of ``allreduce`` with
``MPI.SUM`` is an allreduce-sum of the cotangents, not the identity, so
``jax.grad`` of a replicated loss is P times the gradient of the one loss
(use ``distlinalg.ad.grad`` for that gradient). See docs/mpi4jax.md.

Each function here converts arguments and results; the operations and their
AD rules are those of :mod:`distlinalg.comm`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from ._runtime import jax_names
from . import comm as _comm
from ._runtime.mpi import BUILD_INFO, resolve_comm

# The mpi4jax release whose API this module follows; a version string that
# compares like it (``packaging.version.Version(__version__) >= "0.9"``).
MPI4JAX_API_VERSION = "0.9.1"
__version__ = MPI4JAX_API_VERSION + "+distlinalg"

__all__ = [
    "allgather",
    "allreduce",
    "alltoall",
    "barrier",
    "bcast",
    "gather",
    "recv",
    "reduce",
    "scan",
    "scatter",
    "send",
    "sendrecv",
    "has_cuda_support",
    "has_sycl_support",
]


class _NotSet:
    def __repr__(self) -> str:
        return "NOTSET"


_NOTSET = _NotSet()


def _no_token(token: Any, name: str) -> None:
    # mpi4jax >= 0.8 manages tokens itself and rejects an explicit one; so
    # does distlinalg (its ordered effect keeps program order).
    if token is not _NOTSET:
        raise RuntimeError(
            f"distlinalg.mpi4jax.{name}: explicit tokens are not supported (as in mpi4jax >= 0.8): "
            "communication is ordered automatically. Drop the token argument and the token result, "
            f"e.g. `y = {name}(x, ...)` instead of `y, token = {name}(x, ..., token=token)`."
        )


def _check_status(status: Any, name: str) -> None:
    if status is not None and not isinstance(status, MPI.Status):
        raise TypeError(
            f"distlinalg.mpi4jax.{name}: status must be an mpi4py.MPI.Status or None, "
            f"got {type(status).__name__}"
        )


def _fill(status: MPI.Status, itemsize: int, source: Any, tag: Any, count: Any) -> None:
    status.Set_source(int(source))
    status.Set_tag(int(tag))
    status.Set_error(MPI.SUCCESS)
    count = int(count)
    # MPI counts in bytes underneath; Get_count(datatype) then divides.
    status.Set_elements(MPI.BYTE, count * itemsize if count >= 0 else MPI.UNDEFINED)


def _write_status(status: MPI.Status | None, st: _comm.Status, itemsize: int) -> None:
    """Write a receive's status into the caller's mpi4py Status object.

    Eagerly at once; under a transformation by an ordered host callback, which
    runs when the compiled program runs (every time it runs), in program
    order with the other callbacks.
    """
    if status is None:
        return
    fields = (st.source, st.tag, st.count)
    if jax_names.at_top_level():
        _fill(status, itemsize, *fields)
        return
    jax.debug.callback(lambda *f: _fill(status, itemsize, *f), *fields, ordered=True)


def allreduce(x: Any, op: Any, *, comm: Any = None, token: Any = _NOTSET) -> Any:
    """Reduce `x` over all ranks with `op`; every rank gets the result.

    Args:
      x: array or scalar, same shape and dtype on every rank.
      op: ``MPI.SUM``, ``MPI.PROD``, ``MPI.MIN``, ``MPI.MAX``, ``MPI.BAND``,
        ``MPI.BOR``, ``MPI.BXOR``, ``MPI.LAND``, ``MPI.LOR``, ``MPI.LXOR`` (or their
        names); the bitwise and logical ones take integer and bool arrays.
      comm: mpi4py intracommunicator (default: distlinalg's duplicate of
        ``COMM_WORLD``).

    Returns:
      The reduction, shaped like `x`, on every rank.

    AD: every op, forward and reverse (mpi4jax: SUM only). The transpose of
    the SUM is an allreduce-sum of the cotangents (mpi4jax: the identity), so
    ``jax.grad(lambda x: allreduce(x, op=MPI.SUM).sum())`` is ``size`` on
    every element; ``distlinalg.ad.grad`` gives the gradient of the one
    replicated loss (docs/mpi4jax.md).

    Example:
      >>> import jax.numpy as jnp
      >>> from mpi4py import MPI
      >>> import distlinalg.mpi4jax as mpi4jax
      >>> rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
      >>> total = mpi4jax.allreduce(jnp.ones(3) * rank, op=MPI.SUM)   # sum(range(size)) each
      >>> total.tolist() == [size * (size - 1) / 2] * 3
      True
    """
    _no_token(token, "allreduce")
    return _comm.allreduce(x, op, comm=comm)


def allgather(x: Any, *, comm: Any = None, token: Any = _NOTSET) -> Any:
    """Gather `x` (shape s) from every rank onto every rank: shape ``(size, *s)``.

    AD: transpose is a reduce_scatter of the cotangents.

    Example:
      >>> import jax.numpy as jnp
      >>> from mpi4py import MPI
      >>> import distlinalg.mpi4jax as mpi4jax
      >>> rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
      >>> mpi4jax.allgather(jnp.asarray(rank)).tolist() == list(range(size))
      True
    """
    _no_token(token, "allgather")
    return _comm.allgather(x, comm=comm)


def alltoall(x: Any, *, comm: Any = None, token: Any = _NOTSET) -> Any:
    """Send block ``x[q]`` to rank q; block r of the result came from rank r.

    Args:
      x: array of shape ``(size, *s)``.

    Returns:
      Shape ``(size, *s)``. ValueError when the leading axis is not size.

    AD: self-adjoint (forward and reverse).

    Example:
      >>> import jax.numpy as jnp
      >>> from mpi4py import MPI
      >>> import distlinalg.mpi4jax as mpi4jax
      >>> rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
      >>> y = mpi4jax.alltoall(jnp.ones((size, 2)) * rank)
      >>> y[:, 0].tolist() == [float(q) for q in range(size)]     # block q came from rank q
      True
    """
    _no_token(token, "alltoall")
    n = resolve_comm(comm).size
    shape = np.shape(x)
    if len(shape) == 0 or shape[0] != n:
        raise ValueError(f"distlinalg.mpi4jax.alltoall: x must have shape (nproc, ...) with nproc={n}, got {shape}")
    return _comm.alltoall(x, comm=comm)


def barrier(*, comm: Any = None, token: Any = _NOTSET) -> None:
    """Wait until every rank of `comm` reaches the barrier (ordered with all communication).

    Example:
      >>> import distlinalg.mpi4jax as mpi4jax
      >>> mpi4jax.barrier()
    """
    _no_token(token, "barrier")
    _comm.barrier(comm=comm)


def bcast(x: Any, root: int, *, comm: Any = None, token: Any = _NOTSET) -> Any:
    """Broadcast root's `x`; on other ranks `x` gives only shape and dtype.

    Returns:
      Root's `x` on every rank (on root, `x`'s values).

    AD: forward broadcasts root's tangent; the transpose sums every rank's
    cotangent onto root. When differentiating, pass the differentiated
    value on every rank (docs/ad.md, templates).

    Example:
      >>> import jax.numpy as jnp
      >>> from mpi4py import MPI
      >>> import distlinalg.mpi4jax as mpi4jax
      >>> rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
      >>> mpi4jax.bcast(jnp.full(2, 10.0 + rank), root=0).tolist()
      [10.0, 10.0]
    """
    _no_token(token, "bcast")
    return _comm.bcast(x, root=root, comm=comm)


def gather(x: Any, root: int, *, comm: Any = None, token: Any = _NOTSET) -> Any:
    """Gather `x` (shape s) onto root: ``(size, *s)`` on root, `x` itself elsewhere.

    AD: the transpose scatters root's cotangent back; on the other ranks the
    output is `x`, so its cotangent goes to `x` directly.

    Example:
      >>> import jax.numpy as jnp
      >>> from mpi4py import MPI
      >>> import distlinalg.mpi4jax as mpi4jax
      >>> rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
      >>> g = mpi4jax.gather(jnp.full(2, float(rank)), root=0)   # root: g[r] is rank r's x
      >>> g.shape == ((size, 2) if rank == 0 else (2,))
      True
    """
    _no_token(token, "gather")
    c = resolve_comm(comm)
    res = _comm.gather(x, root=root, comm=c)
    # The collective runs on every rank; mpi4jax hands non-root ranks their input.
    return res if c.rank == root else x


def reduce(x: Any, op: Any, root: int, *, comm: Any = None, token: Any = _NOTSET) -> Any:
    """Reduce `x` over ranks onto root; other ranks get `x` itself.

    AD: as allreduce restricted to root's output (transpose of SUM:
    broadcast of root's cotangent); on the other ranks the output is `x`.

    Example:
      >>> import jax.numpy as jnp
      >>> from mpi4py import MPI
      >>> import distlinalg.mpi4jax as mpi4jax
      >>> rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
      >>> s = mpi4jax.reduce(jnp.ones(2), op=MPI.SUM, root=0)   # root: the sum; others: x
      >>> s.tolist() == ([float(size)] * 2 if rank == 0 else [1.0, 1.0])
      True
    """
    _no_token(token, "reduce")
    c = resolve_comm(comm)
    res = _comm.reduce(x, op, root=root, comm=c)
    return res if c.rank == root else x


def scan(x: Any, op: Any, *, comm: Any = None, token: Any = _NOTSET) -> Any:
    """Inclusive prefix reduction: rank r gets op(x_0, ..., x_r).

    AD: forward and reverse (the transpose of a SUM scan is a suffix sum).

    Example:
      >>> import jax.numpy as jnp
      >>> from mpi4py import MPI
      >>> import distlinalg.mpi4jax as mpi4jax
      >>> rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
      >>> mpi4jax.scan(jnp.ones(2), op=MPI.SUM).tolist() == [rank + 1.0] * 2
      True
    """
    _no_token(token, "scan")
    return _comm.scan(x, op, comm=comm)


def scatter(x: Any, root: int, *, comm: Any = None, token: Any = _NOTSET) -> Any:
    """Send row r of root's `x` (shape ``(size, *s)``) to rank r.

    Args:
      x: on root, shape ``(size, *s)``; on the other ranks shape s (a template
        whose values are ignored).

    Returns:
      Shape s. On root a leading axis other than size is a ValueError.

    AD: forward scatters root's tangent; the transpose gathers the
    cotangents onto root.

    Example:
      >>> import jax.numpy as jnp
      >>> from mpi4py import MPI
      >>> import distlinalg.mpi4jax as mpi4jax
      >>> rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
      >>> rows = jnp.arange(2.0 * size).reshape(size, 2)
      >>> mine = mpi4jax.scatter(rows if rank == 0 else rows[0], root=0)
      >>> mine.tolist() == rows[rank].tolist()
      True
    """
    _no_token(token, "scatter")
    c = resolve_comm(comm)
    if c.rank == root:
        shape = np.shape(x)
        if len(shape) == 0 or shape[0] != c.size:
            raise ValueError(
                f"distlinalg.mpi4jax.scatter: Scatter input must have shape (nproc, ...) on the root, "
                f"nproc={c.size}, got {shape}"
            )
        return _comm.scatter(x, root=root, comm=c)
    # distlinalg takes (size, *s) everywhere; the template is derived from x
    # so that it carries x's tangent (its values never leave this rank).
    x = jnp.asarray(x)
    return _comm.scatter(jnp.broadcast_to(x, (c.size, *x.shape)), root=root, comm=c)


def send(x: Any, dest: int, *, tag: int = 0, comm: Any = None, token: Any = _NOTSET) -> None:
    """Send `x` to rank `dest` (blocking standard-mode send).

    AD: the tangent follows as a second message; in reverse mode the
    cotangent comes back from `dest`. The receiving rank must differentiate
    its recv too (template computed from the differentiated inputs).

    Example:
      >>> import jax.numpy as jnp
      >>> from mpi4py import MPI
      >>> import distlinalg.mpi4jax as mpi4jax
      >>> rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
      >>> partner = rank + 1 if rank % 2 == 0 else rank - 1       # pairs (0, 1), (2, 3), ...
      >>> partner = partner if partner < size else MPI.PROC_NULL
      >>> got = None
      >>> if rank % 2 == 0:
      ...     mpi4jax.send(jnp.ones(3) * rank, dest=partner, tag=7)
      ... else:
      ...     got = mpi4jax.recv(jnp.zeros(3), source=partner, tag=7)
      >>> got is None or got.tolist() == [rank - 1.0] * 3
      True
    """
    _no_token(token, "send")
    _comm.send(x, dest, tag=tag, comm=comm)


def recv(
    x: Any,
    source: int = MPI.ANY_SOURCE,
    *,
    tag: int = MPI.ANY_TAG,
    comm: Any = None,
    status: MPI.Status | None = None,
    token: Any = _NOTSET,
) -> Any:
    """Receive an array shaped like `x` (returned as a new array; `x` is untouched).

    Args:
      x: template (shape and dtype).
      source: a rank, ``MPI.PROC_NULL`` or ``MPI.ANY_SOURCE`` (default).
      tag: a tag in [0, 4095] or ``MPI.ANY_TAG`` (default).
      comm: mpi4py intracommunicator.
      status: an ``mpi4py.MPI.Status`` to fill with the source, tag and count
        of the message (eagerly on return; under ``jit`` when the compiled
        program runs).

    AD: forward and reverse mode; with wildcards the tangent comes from, and
    the cotangent goes back to, the rank and tag that actually sent.

    Example:
      >>> import jax.numpy as jnp
      >>> from mpi4py import MPI
      >>> import distlinalg.mpi4jax as mpi4jax
      >>> rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
      >>> senders = []
      >>> if rank == 0:                                   # from any rank, any tag (the defaults)
      ...     for _ in range(size - 1):
      ...         st = MPI.Status()
      ...         y = mpi4jax.recv(jnp.zeros(3), status=st)
      ...         senders.append((st.Get_source(), st.Get_tag(), st.Get_count(MPI.FLOAT)))
      ... else:
      ...     mpi4jax.send(jnp.ones(3) * rank, dest=0, tag=rank)
      >>> sorted(senders) == ([(s, s, 3) for s in range(1, size)] if rank == 0 else [])
      True
    """
    _no_token(token, "recv")
    _check_status(status, "recv")
    if status is None:
        return _comm.recv(x, source, tag=tag, comm=comm)
    y, st = _comm.recv(x, source, tag=tag, comm=comm, return_status=True)
    _write_status(status, st, np.dtype(y.dtype).itemsize)
    return y


def sendrecv(
    sendbuf: Any,
    recvbuf: Any,
    source: int,
    dest: int,
    *,
    sendtag: int = 0,
    recvtag: int = MPI.ANY_TAG,
    comm: Any = None,
    status: MPI.Status | None = None,
    token: Any = _NOTSET,
) -> Any:
    """Send `sendbuf` to `dest` and receive an array shaped like `recvbuf` from `source`.

    Args:
      source: a rank, ``MPI.PROC_NULL`` or ``MPI.ANY_SOURCE``.
      dest: a rank or ``MPI.PROC_NULL``.
      sendtag: default 0; recvtag: default ``MPI.ANY_TAG``.
      status: an ``mpi4py.MPI.Status`` to fill (see :func:`recv`).

    Returns:
      The received array (`recvbuf` itself is untouched).

    AD: forward and reverse mode at any order (mpi4jax: reverse only,
    forward raises): tangents travel the same route, cotangents the reversed
    one.

    Example:
      >>> import jax.numpy as jnp
      >>> from mpi4py import MPI
      >>> import distlinalg.mpi4jax as mpi4jax
      >>> rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
      >>> x = jnp.full(2, float(rank))
      >>> st = MPI.Status()
      >>> left = mpi4jax.sendrecv(x, x, source=(rank - 1) % size, dest=(rank + 1) % size, status=st)
      >>> left.tolist() == [float((rank - 1) % size)] * 2, st.Get_source() == (rank - 1) % size
      (True, True)
    """
    _no_token(token, "sendrecv")
    _check_status(status, "sendrecv")
    if status is None:
        return _comm.sendrecv(sendbuf, recvbuf, source, dest, sendtag=sendtag, recvtag=recvtag, comm=comm)
    y, st = _comm.sendrecv(
        sendbuf, recvbuf, source, dest, sendtag=sendtag, recvtag=recvtag, comm=comm, return_status=True
    )
    _write_status(status, st, np.dtype(y.dtype).itemsize)
    return y


def has_cuda_support() -> bool:
    """Whether this build of distlinalg has its CUDA handlers (operations on GPU arrays).

    Example:
      >>> import distlinalg.mpi4jax as mpi4jax
      >>> isinstance(mpi4jax.has_cuda_support(), bool)   # True where the build found cuda.h
      True
    """
    return bool(BUILD_INFO["cuda"])


def has_sycl_support() -> bool:
    """Always False: distlinalg has no SYCL (Intel XPU) handlers.

    Example:
      >>> import distlinalg.mpi4jax as mpi4jax
      >>> mpi4jax.has_sycl_support()
      False
    """
    return False
