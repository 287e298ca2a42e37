"""Eager solves as one cached compiled program.

Called outside ``jax.jit``, a solver would run op by op: JAX traces its
``while_loop`` and ``custom_linear_solve`` afresh on every call, because
the loop body closes over the operator, and compiles them again (about
0.1 s per call even for 16 unknowns, more than jax.scipy's cg takes the
same way). `compiled_when_eager` runs such a call as a jitted solve
instead, cached on what the program depends on:

- arrays (b, x0 and the arrays inside A and M: a distlinalg operator is a
  pytree whose children are its arrays) are arguments of the program, so a
  new right-hand side or new matrix entries of the same shapes reuse it;
- everything else (a matvec function, the options, the communicator) is
  part of the cache key, compared by equality (functions by identity).

A key's first call runs op by op (a matvec made afresh for every call never
repeats its key, and compiling costs about twice one op-by-op run); the
second compiles. The ranks agree on the path (one int32 allreduce per eager
call). The last `PROGRAMS` keys are kept (each holds its functions and
compilations); a call whose key cannot be hashed runs op by op. Inside any
trace (jit, grad, vmap) the solver is called directly.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _compat
from .._mpi import Communicator, resolve_comm
from ..comm.allreduce import allreduce
from ..operators import LinearOperator

PROGRAMS = 32


def _is_array(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


# What a rank holds for a key; the ranks agree on the least (`_agreed_state`).
UNSEEN, SEEN, COMPILED = 0, 1, 2


def compiled_when_eager(solver: Callable[..., Any]) -> Callable[..., Any]:
    """`solver(A, b, x0=None, *, M=None, **options)`, run as a cached jit when called eagerly."""
    # key -> None (seen) or the compiled solve (COMPILED); the last PROGRAMS keys.
    programs: OrderedDict[tuple[Any, ...], Callable[..., Any] | None] = OrderedDict()

    def new_program() -> Callable[..., Any]:
        # The key's parts are static arguments, not closed over: a retrace
        # (new shapes) then uses this call's objects, not those of the call
        # that compiled (a communicator equal by handle may be a new one).
        def solve(treedef: Any, static: tuple[Any, ...], options: tuple[tuple[str, Any], ...],
                  arrays: list[Any]) -> Any:
            supply = iter(arrays)
            leaves = [next(supply) if leaf is _ARRAY else leaf for leaf in static]
            A, b, x0, M = jax.tree_util.tree_unflatten(treedef, leaves)
            return solver(A, b, x0, M=M, **dict(options))

        return jax.jit(solve, static_argnums=(0, 1, 2))

    @functools.wraps(solver)
    def dispatch(A: Any, b: Any, x0: Any = None, *, M: Any = None, **options: Any) -> Any:
        if not _compat.at_top_level():
            return solver(A, b, x0, M=M, **options)
        if options.get("comm") is not None:  # (mpi4py communicators are not hashable)
            comm = options["comm"] = resolve_comm(options["comm"])
        else:  # where the solver takes it from
            comm = resolve_comm(A.comm if isinstance(A, LinearOperator) else None)
        leaves, treedef = jax.tree_util.tree_flatten((A, b, x0, M))
        static = tuple(_ARRAY if _is_array(leaf) else leaf for leaf in leaves)
        key: tuple[Any, ...] | None = (treedef, static, tuple(sorted(options.items())))
        try:
            state = UNSEEN if key not in programs else SEEN if programs[key] is None else COMPILED
        except TypeError:  # something in the key cannot be hashed: op by op, always
            key, state = None, UNSEEN
        state = _agreed_state(state, comm)
        if state == UNSEEN:
            # A key's first call runs op by op: a matvec written afresh for
            # every call (``lambda v: A @ v`` in a loop) never repeats its key,
            # and compiling the whole solve costs ~2x one op-by-op run.
            if key is not None:
                programs[key] = None
                if len(programs) > PROGRAMS:
                    programs.popitem(last=False)
            return solver(A, b, x0, M=M, **options)
        if state == SEEN:
            # Compiled afresh on every rank (also where one is cached), so
            # that every rank runs a program's first execution together: its
            # cross-rank signature checks run then (csrc/checks.h).
            programs[key] = new_program()
        programs.move_to_end(key)
        return programs[key](*key, [leaf for leaf in leaves if _is_array(leaf)])

    return dispatch


def _agreed_state(state: int, comm: Communicator) -> int:
    """The least state over the ranks: the path every rank then takes.

    Keys hold rank-local objects (the matvec function), so a key can repeat on
    one rank and not on another; the op-by-op and compiled paths check their
    messages differently, so every rank must take the same one.
    """
    if comm.size == 1:
        return state
    return int(allreduce(jnp.asarray(state, jnp.int32), "min", comm=comm))


class _ArrayPlaceholder:
    """Where an array leaf goes in the cache key (its shape and dtype are jit's to compare)."""

    def __repr__(self) -> str:
        return "<array>"


_ARRAY = _ArrayPlaceholder()
