"""Exact gradients of replicated losses.

The reasoning in full: docs/ad.md, "Why jax.grad of a replicated loss gives P
times the gradient".

Under distlinalg's convention the transpose of a communication primitive is
the adjoint of the whole SPMD program: reverse mode seeds every rank's output
copy with its own cotangent and returns x̄_s = Σ_r (∂y_r/∂x_s)ᵀ ȳ_r. Two
consequences for a loss L that every rank computes identically:

* seeding every rank with 1 differentiates Σ_r L_r = P·L, so `jax.grad`
  alone is P times too large (for data that enters through a collective);
* a replicated parameter w is really P copies w_r, one per rank, and rank r's
  cotangent holds only the paths through its own copy. The gradient of the
  one parameter is the sum of the copies' gradients: the adjoint of the
  implicit broadcast w ↦ (w, ..., w).

So: seed 1/P (any seeds summing to 1 would do), then allreduce the
gradients of the replicated arguments. Sharded (rank-local) arguments are
distinct inputs of the global function; their local cotangents are already
their blocks of the global gradient. Terms every rank computes redundantly
(a regulariser R(w)) come out right too: each rank contributes R'(w)/P.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._runtime.mpi import resolve_comm
from ..comm.fused import tree_allreduce

_NAME = "distlinalg.ad"


def _argnums_tuple(argnums: Any) -> tuple[int, ...]:
    nums = (argnums,) if _is_int(argnums) else tuple(argnums)
    if not nums:
        raise ValueError(f"{_NAME}: argnums is empty")
    for i in nums:
        if not _is_int(i):
            raise TypeError(f"{_NAME}: argnums must be ints, got {i!r}")
    return tuple(int(i) for i in nums)


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _sharded_spec(sharded: Any) -> dict[int, Any]:
    """`sharded` -> {argnum: bool pytree prefix of that argument}."""
    if isinstance(sharded, Mapping):
        spec = dict(sharded)
    elif _is_int(sharded):
        spec = {sharded: True}
    elif isinstance(sharded, (bool, np.bool_)):
        raise TypeError(
            f"{_NAME}: sharded names argument positions (sharded=1, sharded=(0, 2) or "
            f"sharded={{0: {{'w': False, 'emb': True}}}}), got the bool {sharded!r}"
        )
    else:
        spec = {}
        for i in sharded:
            if i in spec:
                raise ValueError(f"{_NAME}: sharded lists argument {i} twice")
            spec[i] = True
    for i in spec:
        if not _is_int(i):
            raise TypeError(f"{_NAME}: sharded keys must be argument positions (ints), got {i!r}")
    return {int(i): flags for i, flags in spec.items()}


def _normalise(i: int, nargs: int, what: str) -> int:
    if not -nargs <= i < nargs:
        raise TypeError(
            f"{_NAME}: {what}={i} needs at least {i + 1 if i >= 0 else -i} positional "
            f"arguments, but the function was called with {nargs}"
        )
    return i % nargs


def _leaf_mask(flags: Any, grad_tree: Any, argnum: int) -> list[bool]:
    """One bool per leaf of `grad_tree`: True where the leaf is sharded."""

    def expand(flag: Any, subtree: Any) -> Any:
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(
                f"{_NAME}: the leaves of sharded[{argnum}] must be True/False, got {flag!r}"
            )
        return jax.tree_util.tree_map(lambda _: bool(flag), subtree)

    try:
        mask = jax.tree_util.tree_map(expand, flags, grad_tree)
    except (ValueError, KeyError) as err:
        raise ValueError(
            f"{_NAME}: sharded[{argnum}] must be a bool or a pytree prefix of argument "
            f"{argnum} with bool leaves; argument structure "
            f"{jax.tree_util.tree_structure(grad_tree)}, sharded[{argnum}] = {flags!r}"
        ) from err
    return jax.tree_util.tree_leaves(mask)


def value_and_grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    *,
    sharded: int | Sequence[int] | Mapping[int, Any] = (),
    has_aux: bool = False,
    comm: Any = None,
) -> Callable[..., Any]:
    """Value and exact gradient of a replicated scalar loss, on every rank.

    Every rank calls the returned function together, with the same argument
    structure (see docs/ad.md: all ranks differentiate the same program).

    Args:
      fun: the loss. Every rank returns the same real scalar L, typically
        computed from rank-local data with allreduces; terms computed
        redundantly on every rank (a regulariser R(w)) are fine. Optionally
        returns ``(L, aux)``. (If the ranks' values differ, the result is the
        gradient of their mean, (1/P) Σ_r L_r.)
      argnums: which positional arguments to differentiate, an int or a
        sequence of ints (negative counts from the end), as in ``jax.grad``.
        Their leaves must be floating or complex.
      sharded: which differentiated arguments are *sharded*: rank-local
        pieces of a distributed argument (this rank's rows of the data, its
        block of a distributed vector). Everything else in `argnums` is
        *replicated*: one logical value held identically by every rank (model
        parameters). Either

        * an int or a sequence of ints: those positional arguments (each
          must be in `argnums`) are sharded as a whole; or
        * a mapping ``{argnum: flags}``, where `flags` is a bool or a pytree
          prefix of that argument with bool leaves, True marking sharded
          subtrees: ``sharded={0: {"w": False, "table": True}}`` for a
          parameter dict whose ``"table"`` is split over ranks.

        Default: every differentiated argument is replicated.
      has_aux: `fun` returns ``(L, aux)``; aux is returned as computed on this
        rank, not differentiated.
      comm: the communicator over which the loss is replicated (default:
        distlinalg's duplicate of ``MPI.COMM_WORLD``).

    Returns:
      A function with `fun`'s signature returning ``(L, grads)``
      (``((L, aux), grads)`` with has_aux). L is the loss as this rank computed
      it. ``grads`` has the structure of ``jax.value_and_grad``'s (a single
      gradient for an int `argnums`, a tuple otherwise):

      * replicated arguments (leaves): dL/dw, the full gradient, identical on
        every rank (one allreduce per dtype sums the ranks' contributions);
      * sharded arguments (leaves): this rank's block of the global gradient
        dL/dx_r, no communication.

      The function is jittable, vmappable and differentiable (its
      communication is made of distlinalg primitives), e.g. for
      Hessian-vector products.

    Raises:
      TypeError / ValueError on every rank for bad argnums or sharded, a loss
      that is not a real scalar, or integer arguments.

    Example:
      A least-squares loss over every rank's rows of the data, replicated by an allreduce:

      >>> import jax.numpy as jnp
      >>> from distlinalg import ad, comm
      >>> n, r = comm.size(), comm.rank()
      >>> X = jnp.ones((2, 3)) * (r + 1)                  # this rank's two rows
      >>> def loss(w, X):
      ...     return comm.allreduce(jnp.sum((X @ w) ** 2))  # the same value on every rank
      >>> L, g = ad.value_and_grad(loss)(jnp.ones(3), X)
      >>> float(L) == 18.0 * sum((q + 1) ** 2 for q in range(n))
      True
      >>> bool(jnp.allclose(g, 12.0 * sum((q + 1) ** 2 for q in range(n))))   # 2 Σ_q X_qᵀ X_q w
      True
      >>> L, gX = ad.value_and_grad(loss, argnums=1, sharded=1)(jnp.ones(3), X)
      >>> bool(jnp.allclose(gX, 6.0 * (r + 1)))          # this rank's block of dL/dX
      True
    """
    nums = _argnums_tuple(argnums)
    if len(set(nums)) != len(nums):
        raise ValueError(f"{_NAME}: argnums {nums} repeats an argument")
    spec = _sharded_spec(sharded)
    if all(i >= 0 for i in (*nums, *spec)):
        stray = sorted(set(spec) - set(nums))
        if stray:
            raise ValueError(f"{_NAME}: sharded={stray} are not among argnums={nums}")
    communicator = resolve_comm(comm)
    size = communicator.size

    @functools.wraps(fun)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        nargs = len(args)
        positions = [_normalise(i, nargs, "argnums") for i in nums]
        if len(set(positions)) != len(positions):
            raise ValueError(f"{_NAME}: argnums {nums} name the same argument twice")
        flags_of: dict[int, Any] = {}
        for i, flags in spec.items():
            position = _normalise(i, nargs, "sharded")
            if position not in positions:
                raise ValueError(f"{_NAME}: sharded argument {i} is not among argnums={nums}")
            flags_of[position] = flags
        for position in positions:
            for leaf in jax.tree_util.tree_leaves(args[position]):
                dtype = jnp.result_type(leaf)
                if not jnp.issubdtype(dtype, jnp.inexact):
                    raise TypeError(
                        f"{_NAME}: differentiated arguments must be floating or complex; "
                        f"argument {position} has a leaf of dtype {dtype}"
                    )

        def of_differentiated(*diff: Any) -> Any:
            full = list(args)
            for position, value in zip(positions, diff):
                full[position] = value
            out = fun(*full, **kwargs)
            if has_aux:
                if not (isinstance(out, (tuple, list)) and len(out) == 2):
                    raise TypeError(f"{_NAME}: with has_aux=True the loss must return a pair (loss, aux)")
                loss, aux = out
            else:
                loss, aux = out, None
            loss = jnp.asarray(loss)
            if loss.shape != ():
                raise TypeError(f"{_NAME}: the loss must be a scalar, got shape {loss.shape}")
            if not jnp.issubdtype(loss.dtype, jnp.floating):
                raise TypeError(f"{_NAME}: the loss must be real floating, got dtype {loss.dtype}")
            return loss, aux

        loss, pullback, aux = jax.vjp(of_differentiated, *(args[p] for p in positions), has_aux=True)
        # 1/P on every rank: reverse mode then differentiates (1/P) Σ_r L_r = L.
        grads = list(pullback(jnp.ones_like(loss) / size))

        if size > 1:
            flat: list[Any] = []
            treedefs = []
            for k, position in enumerate(positions):
                leaves, treedef = jax.tree_util.tree_flatten(grads[k])
                mask = _leaf_mask(flags_of.get(position, False), grads[k], position)
                flat.append((leaves, mask))
                treedefs.append(treedef)
            replicated = [leaf for leaves, mask in flat for leaf, s in zip(leaves, mask) if not s]
            reduced = iter(tree_allreduce(replicated, comm=communicator))
            grads = [
                jax.tree_util.tree_unflatten(
                    treedef, [leaf if s else next(reduced) for leaf, s in zip(leaves, mask)]
                )
                for (leaves, mask), treedef in zip(flat, treedefs)
            ]
        else:
            # Still validate `sharded` on one rank, so a bad spec fails the same way everywhere.
            for k, position in enumerate(positions):
                _leaf_mask(flags_of.get(position, False), grads[k], position)

        grads_out = grads[0] if _is_int(argnums) else tuple(grads)
        return ((loss, aux) if has_aux else loss), grads_out

    return wrapped


def grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    *,
    sharded: int | Sequence[int] | Mapping[int, Any] = (),
    has_aux: bool = False,
    comm: Any = None,
) -> Callable[..., Any]:
    """Exact gradient of a replicated scalar loss; see :func:`value_and_grad`.

    Returns a function returning ``grads`` (``(grads, aux)`` with has_aux):
    full gradients, identical on every rank, for replicated arguments; this
    rank's block of the global gradient for sharded ones.

    Example:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> from distlinalg import ad, comm
      >>> def loss(w, x):
      ...     return comm.allreduce(jnp.vdot(w, x))       # Σ_r ⟨w, x_r⟩, replicated
      >>> x = jnp.arange(3.0) + comm.rank()               # this rank's data
      >>> g = ad.grad(loss)(jnp.ones(3), x)               # Σ_r x_r, on every rank
      >>> bool(jnp.allclose(g, comm.allreduce(x)))
      True
      >>> g2 = jax.jit(ad.grad(loss))(jnp.ones(3), x)     # jittable
      >>> bool(jnp.allclose(g2, g))
      True
    """
    value_and_grad_fun = value_and_grad(fun, argnums, sharded=sharded, has_aux=has_aux, comm=comm)

    @functools.wraps(fun)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        value, grads = value_and_grad_fun(*args, **kwargs)
        return (grads, value[1]) if has_aux else grads

    return wrapped
