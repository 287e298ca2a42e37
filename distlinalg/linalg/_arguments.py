"""Argument checks of distlinalg.linalg, agreed by every rank before the first message.

Each rank checks its own arguments (inside `collectively`, so an error on one
rank is raised on every rank), then the ranks exchange one small row of
integers at trace time (n_r, N, right-hand-side columns, dtype, whether the
ScaLAPACK engine loaded) and derive the same verdict from the same table: a
matrix whose rows do not add up to a square, different N or different
right-hand-side widths on different ranks raise the same ValueError on every
rank, naming the ranks. Only then does any message of the factorisation go out.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._runtime.mpi import Communicator, resolve_comm
from ..operators._partition import Partition, exchange_rows
from ..solvers._arguments import collectively
from ._layout import RowSplit

ENGINES = ("auto", "scalapack", "distlinalg")
_DTYPES = (jnp.float32, jnp.float64, jnp.complex64, jnp.complex128)


def _dtype_code(dtype: Any) -> int:
    return [np.dtype(d) for d in _DTYPES].index(np.dtype(dtype))


def check(what: str, A_rows: Any, b: Any = None, *, comm: Any = None, engine: str = "auto",
          block_size: Any = None, scalapack_loaded: bool = False, options: tuple = ()
          ) -> tuple[RowSplit, Any, Any, str]:
    """(the split, A, b in one floating dtype, the engine every rank runs), or a ValueError on every rank.

    `options`: whatever else steers the factorisation (the grid, assume_a), as ints; with the
    engine and the block size they must be the same on every rank (they set the schedule and
    the message sizes), and the ranks compare them in the same exchange."""
    comm = resolve_comm(comm)

    def local() -> tuple[Any, Any]:
        if engine not in ENGINES:
            raise ValueError(f"{what}: engine must be one of {ENGINES}, not {engine!r}")
        if block_size is not None and (not isinstance(block_size, (int, np.integer)) or block_size < 1):
            raise ValueError(f"{what}: block_size must be a positive int or None, not {block_size!r}")
        if engine == "scalapack" and not scalapack_loaded:
            raise ValueError(f"{what}: engine='scalapack' was asked for but {_scalapack_loaded_reason()}")
        a = jnp.asarray(A_rows)
        if a.ndim != 2:
            raise ValueError(f"{what}: A_rows must be this rank's rows of the matrix, shape (n_r, N); got {a.shape}")
        if b is None:
            dtype = jnp.result_type(a.dtype, jnp.float32)
            return a.astype(dtype), None
        v = jnp.asarray(b)
        if v.ndim not in (1, 2) or v.shape[0] != a.shape[0]:
            raise ValueError(f"{what}: b must be this rank's rows of the right-hand side, shape (n_r,) or (n_r, m) "
                             f"with n_r = {a.shape[0]} (the rows of A_rows); got {v.shape}")
        dtype = jnp.result_type(a.dtype, v.dtype, jnp.float32)
        return a.astype(dtype), v.astype(dtype)

    a, v = collectively(local, comm)
    width = -1 if v is None else (1 if v.ndim == 1 else v.shape[1]) * 10 + v.ndim
    steering = [ENGINES.index(engine), -1 if block_size is None else int(block_size), *[int(o) for o in options]]
    row = np.asarray([a.shape[0], a.shape[1], width, _dtype_code(a.dtype), int(bool(scalapack_loaded)), *steering])
    table = exchange_rows(row, comm)
    _verdict(what, table, comm)
    if (table[:, 5:] != table[0, 5:]).any():
        raise ValueError(f"{what}: the ranks passed different engine, block_size, grid or assume_a (they set the "
                         f"schedule of messages, so every rank must pass the same): "
                         + ", ".join(f"rank {q}: {table[q, 5:].tolist()}" for q in range(comm.size)))
    split = RowSplit(Partition.from_sizes(table[:, 0]), comm)
    everywhere = bool(table[:, 4].all())
    chosen = engine
    if engine == "auto":
        # ScaLAPACK runs on the host: on a GPU backend distlinalg's engine keeps the matrix there.
        on_host = jax.default_backend() == "cpu"
        chosen = "scalapack" if everywhere and comm.size > 1 and on_host else "distlinalg"
    elif engine == "scalapack" and not everywhere:
        raise ValueError(f"{what}: engine='scalapack' loaded on some ranks only "
                         f"(ranks without it: {np.flatnonzero(table[:, 4] == 0).tolist()})")
    return split, a, v, chosen


def _scalapack_loaded_reason() -> str:
    from . import _engines

    return _engines.scalapack_status()[1]


def _verdict(what: str, table: np.ndarray, comm: Communicator) -> None:
    """The same ValueError on every rank when the ranks' shapes do not make one square system."""
    rows, cols, widths, dtypes = table[:, 0], table[:, 1], table[:, 2], table[:, 3]
    lines = [f"rank {r}: A_rows {int(rows[r])} x {int(cols[r])}" for r in range(comm.size)]
    if len(set(cols.tolist())) > 1:
        raise ValueError(f"{what}: the ranks hold rows of different lengths N (every rank must hold rows of the same "
                         f"N x N matrix):\n  " + "\n  ".join(lines))
    if int(rows.sum()) != int(cols[0]):
        raise ValueError(f"{what}: the rows of A do not add up to a square matrix: {int(rows.sum())} rows in all, "
                         f"of length {int(cols[0])}:\n  " + "\n  ".join(lines))
    if len(set(widths.tolist())) > 1:
        raise ValueError(f"{what}: the ranks passed right-hand sides of different shapes (b must be (n_r,) on every "
                         f"rank, or (n_r, m) with the same m): " + ", ".join(
                             f"rank {r}: {'(n_r,)' if w % 10 == 1 else f'(n_r, {w // 10})'}"
                             for r, w in enumerate(widths.tolist())))
    if len(set(dtypes.tolist())) > 1:
        raise ValueError(f"{what}: the ranks passed different dtypes: " + ", ".join(
            f"rank {r}: {np.dtype(_DTYPES[d]).name}" for r, d in enumerate(dtypes.tolist())))


def default_block(split: RowSplit, block_size: Any) -> int:
    """Rows per elimination step: about 8 steps per rank, between 32 and 512 rows."""
    if block_size is not None:
        return int(block_size)
    return int(min(512, max(32, -(-split.n // (8 * split.size)))))
