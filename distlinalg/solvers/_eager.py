"""Eager solves as one cached compiled program.

Called outside ``jax.jit``, a solver would run op by op: JAX traces its
``while_loop`` and ``custom_linear_solve`` afresh on every call, because
the loop body closes over the operator, and compiles them again (slow even
for a handful of unknowns, slower than jax.scipy's cg run the same way).
`compiled_when_eager` runs such a call as a jitted solve instead, and every
call computes what the operator computes *now*, as jax.scipy's solvers do
op by op. Two keys:

- **By the operator's static data**, where that data fixes the computation:
  distlinalg's own operators (``laplacian_2d``, ``dense_rows``,
  ``aslinearoperator``, …), whose static parts are values and distlinalg's
  module-level functions. Arrays (b, x0 and the arrays inside A and M: a
  distlinalg operator is a pytree whose children are its arrays) are
  arguments of the program, so a new right-hand side or new matrix entries
  of the same shapes reuse it without tracing (the fastest path).
- **By the program a call traces to**, for everything else: a user's
  matvec, preconditioner, object with ``__matmul__``, model function or
  callback may read a global, an attribute or a captured Python number that
  changes between calls, so the key cannot be the function. The solve is
  traced on every call (still far cheaper than running op by op) and keyed
  by the text of its jaxpr; the arrays it captured are arguments. A changed
  number changes the text (a new program), a changed array only the
  arguments, and a function written afresh with the same code repeats the
  key.

A key's first call runs op by op (a key that never repeats must not pay for
a compilation, which costs more than an op-by-op run); the second compiles.
The ranks agree on the path (one int32 allreduce per eager call). The last
`PROGRAMS` keys are kept (each holds its functions and compilations); a
call whose key cannot be hashed, or whose program holds values its text
does not show (arrays captured inside a nested ``jax.jit``), runs op by op.
Inside any trace (jit, grad, vmap) the solver is called directly. What each
path costs: benchmarks/README.md, section "Eager solves".
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import types
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr

from .._runtime import jax_names
from .._runtime.mpi import Communicator, resolve_comm
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

    def solve_from_leaves(treedef: Any, static: tuple[Any, ...], options: tuple[tuple[str, Any], ...],
                          arrays: list[Any]) -> Any:
        supply = iter(arrays)
        leaves = [next(supply) if leaf is _ARRAY else leaf for leaf in static]
        A, b, x0, M = jax.tree_util.tree_unflatten(treedef, leaves)
        return solver(A, b, x0, M=M, **dict(options))

    def new_program(traced: Any) -> Callable[..., Any]:
        if traced is None:
            # The key's parts are static arguments, not closed over: a retrace
            # (new shapes) then uses this call's objects, not those of the call
            # that compiled (a communicator equal by handle may be a new one).
            return jax.jit(solve_from_leaves, static_argnums=(0, 1, 2))
        # The program of the first call with this text; later calls pass their own
        # captured arrays (consts) and arguments. Same text, same computation.
        closed, out_tree = traced
        jaxpr = closed.jaxpr

        @jax.jit
        def run(consts: list[Any], arrays: list[Any]) -> list[Any]:
            return jax.core.eval_jaxpr(jaxpr, consts, *arrays)

        return lambda consts, arrays: jax.tree_util.tree_unflatten(out_tree, run(consts, arrays))

    @functools.wraps(solver)
    def dispatch(A: Any, b: Any, x0: Any = None, *, M: Any = None, **options: Any) -> Any:
        if not jax_names.at_top_level():
            return solver(A, b, x0, M=M, **options)
        if options.get("comm") is not None:  # (mpi4py communicators are not hashable)
            comm = options["comm"] = resolve_comm(options["comm"])
        else:  # where the solver takes it from
            comm = resolve_comm(A.comm if isinstance(A, LinearOperator) else None)
        leaves, treedef = jax.tree_util.tree_flatten((A, b, x0, M))
        static = tuple(_ARRAY if _is_array(leaf) else leaf for leaf in leaves)
        arrays = [leaf for leaf in leaves if _is_array(leaf)]
        option_items = tuple(sorted(options.items()))
        # Which key: agreed first (the traced key's trace may communicate),
        # together with the state of the static key where every rank has one.
        key: tuple[Any, ...] | None = (treedef, static, option_items)
        by_static = _fixes_the_computation(key)
        state = _state_of(programs, key) if by_static else UNSEEN
        agreed = _agreed_state(1 + state if by_static else 0, comm)
        traced = None
        if agreed > 0:
            state = agreed - 1
        else:
            # What the user's functions compute now is in the program they trace to.
            closed, out_shape = jax.make_jaxpr(
                functools.partial(solve_from_leaves, treedef, static, option_items), return_shape=True
            )(arrays)
            traced = (closed, jax.tree_util.tree_structure(out_shape))
            key = None if _holds_hidden_values(closed.jaxpr) else ("traced", str(closed.jaxpr))
            state = _agreed_state(_state_of(programs, key), comm)
        if state == UNSEEN:
            # A key's first call runs op by op: a key that never repeats (an
            # operator made afresh with new static data for every call) must
            # not pay for a compilation, which costs more than an op-by-op run.
            if key is not None and _hashable(key) and key not in programs:
                programs[key] = None
                if len(programs) > PROGRAMS:
                    programs.popitem(last=False)
            return solver(A, b, x0, M=M, **options)
        if state == SEEN:
            # Compiled afresh on every rank (also where one is cached), so
            # that every rank runs a program's first execution together: its
            # cross-rank signature checks run then (csrc/checks.h).
            programs[key] = new_program(traced)
        programs.move_to_end(key)
        if traced is None:
            return programs[key](*key, arrays)
        return programs[key](traced[0].consts, arrays)

    dispatch.programs = programs  # (tests read which path a key took)
    return dispatch


# Static data that is a value: it fixes what the program computes.
_VALUE_TYPES = (type(None), bool, int, float, complex, str, bytes, type, np.dtype, np.generic, np.ndarray,
                jax.ShapeDtypeStruct, Communicator)
_CONTAINERS = (tuple, list, dict, type(None), collections.OrderedDict, collections.defaultdict)
_MAX_DEPTH = 32


def _fixes_the_computation(static: Any, depth: int = 0) -> bool:
    """Whether `static` (the non-array part of a solve's arguments) fixes what the solve computes.

    True for values, containers of them, pytree definitions whose node data
    are such, distlinalg's own objects made of such, and distlinalg's
    module-level functions and JAX's (no closure: they read only their
    arguments and module constants). A user's function or object may read
    state that changes between calls, so anything else is False.
    """
    if depth > _MAX_DEPTH:
        return False
    deeper = functools.partial(_fixes_the_computation, depth=depth + 1)
    if isinstance(static, _VALUE_TYPES) or static is _ARRAY:
        return True
    if isinstance(static, (tuple, list, frozenset)):
        return all(deeper(item) for item in static)
    if isinstance(static, dict):
        return all(deeper(item) for item in static.values())
    if isinstance(static, jax.tree_util.PyTreeDef):
        # A node's type counts too: a user's pytree class (a subclass of
        # LinearOperator, an equinox module) runs its own methods on its leaves.
        node = static.node_data()
        if node is not None and not (node[0] in _CONTAINERS or _is_library_type(node[0])):
            return False
        return (node is None or deeper(node[1])) and all(deeper(child) for child in static.children())
    if callable(static) and not isinstance(static, type) and _is_library_function(static):
        return True
    if isinstance(static, functools.partial):
        return deeper(static.func) and deeper(static.args) and deeper(static.keywords)
    if isinstance(static, types.MethodType):
        return deeper(static.__func__) and deeper(static.__self__)
    if not _is_library_type(type(static)):
        return False
    if dataclasses.is_dataclass(static):
        return all(deeper(getattr(static, f.name)) for f in dataclasses.fields(static))
    names = [n for cls in type(static).__mro__ for n in getattr(cls, "__slots__", ())]
    if hasattr(static, "__dict__"):
        names += list(vars(static))
    return all(deeper(getattr(static, n)) for n in names if hasattr(static, n))


def _is_library_type(cls: type) -> bool:
    return (getattr(cls, "__module__", None) or "").startswith(("distlinalg.", "jax."))


def _is_library_function(fn: Any) -> bool:
    """A module-level function of distlinalg or JAX (``jnp.diagonal`` is a jitted one)."""
    module = getattr(fn, "__module__", None) or ""
    qualname = getattr(fn, "__qualname__", None) or ""
    if not (module.startswith(("distlinalg.", "jax.")) or module == "jax") or not qualname or "<" in qualname:
        return False  # ("<lambda>", "<locals>")
    return getattr(fn, "__closure__", None) is None


def _holds_hidden_values(jaxpr: Jaxpr) -> bool:
    """Whether a nested jaxpr carries constants of its own: their values are not in the
    text (only their types), so equal texts would not mean equal programs."""
    for eqn in jaxpr.eqns:
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                if isinstance(sub, ClosedJaxpr):
                    if sub.consts or _holds_hidden_values(sub.jaxpr):
                        return True
                elif isinstance(sub, Jaxpr) and _holds_hidden_values(sub):
                    return True
    return False


def _hashable(key: Any) -> bool:
    try:
        hash(key)
    except TypeError:
        return False
    return True


def _state_of(programs: OrderedDict, key: tuple[Any, ...] | None) -> int:
    """What this rank holds for `key`: UNSEEN (also for None or a key that cannot be hashed,
    which runs op by op, always), SEEN or COMPILED."""
    if key is None or not _hashable(key) or key not in programs:
        return UNSEEN
    return SEEN if programs[key] is None else COMPILED


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
