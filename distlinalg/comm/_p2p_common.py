"""What the point-to-point modules share: wildcards, their argument checks, two rule helpers.

Used by comm/sendrecv.py, comm/sendrecv_status.py and comm/send_recv.py.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from mpi4py import MPI

from .._runtime.mpi import USER_TAG_LIMIT, check_rank, check_tag
from . import _core

ANY_SOURCE = MPI.ANY_SOURCE
ANY_TAG = MPI.ANY_TAG


def _aval(x: Any) -> Any:
    return x.aval if _core.is_undefined(x) else jax.typeof(x)


def _batch_operands(args, dims):
    """Both buffers batched at axis 0 (one message carries the whole batch)."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not _core.not_mapped)
    return [_core.moveaxis_or_broadcast(a, d, 0, size) for a, d in zip(args, dims)]


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
