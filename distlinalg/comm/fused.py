"""tree_allreduce: a pytree reduced over ranks in one message per dtype.

Not a primitive of its own: a composition of ``allreduce_p`` (concatenate the
leaves of each dtype, one allreduce, split), so its AD and vmap rules are
allreduce's. Gradients of models and the replicated solves' right-hand sides
have many small leaves; one message per dtype pays MPI's latency once instead
of once per leaf.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .._runtime.mpi import check_dtype, resolve_comm, resolve_op
from . import _core
from .allreduce import allreduce_p


def tree_allreduce(tree: Any, op: Any = "sum", *, comm: Any = None) -> Any:
    """Reduce every leaf of `tree` elementwise over ranks, one message per dtype.

    The same values as ``allreduce(tree, op)`` (which sends one message per
    leaf): the leaves of each dtype are flattened, concatenated, reduced in
    one allreduce and split back. Messages go out in the order in which each
    dtype first appears among the leaves, which depends only on the tree's
    structure, so every rank posts the same calls. Empty leaves are returned
    as they are. On one rank nothing is sent.

    Args:
      tree: a pytree of arrays, the same structure, shapes and dtypes on every
        rank.
      op: ``"sum"`` (default), ``"prod"``, ``"min"``, ``"max"``, the bitwise and
        logical ops (``"band"`` ... ``"lxor"``) or the mpi4py objects
        ``MPI.SUM`` ... ``MPI.LXOR``, with allreduce's dtype rules.
      comm: an mpi4py intracommunicator; default: distlinalg's private
        duplicate of ``MPI.COMM_WORLD``.

    Returns:
      A pytree like `tree` (same shapes and dtypes), identical on every rank.

    AD and vmap: those of :func:`distlinalg.comm.allreduce` (forward and
    reverse mode for every op; a batched tree is reduced in one message per
    dtype as well).

    Example:
      >>> import jax.numpy as jnp
      >>> from distlinalg import comm
      >>> grads = {"w": jnp.ones((2, 2)), "b": jnp.ones(3)}
      >>> total = comm.tree_allreduce(grads)  # one float32 message for both leaves
      >>> bool((total["w"] == comm.size()).all() and (total["b"] == comm.size()).all())
      True
    """
    comm = resolve_comm(comm)
    op = resolve_op(op)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    leaves = [_core.as_array(leaf) for leaf in leaves]
    for leaf in leaves:  # every leaf checked before the first message
        check_dtype(leaf.dtype, "tree_allreduce", op)
    leaves = [_core.truth_values(leaf, op) for leaf in leaves]
    if comm.size == 1:
        return jax.tree_util.tree_unflatten(treedef, leaves)
    out = list(leaves)
    for members in _positions_by_dtype(leaves).values():
        out_of_group = _reduce_group([leaves[k] for k in members], comm, op)
        for k, reduced in zip(members, out_of_group):
            out[k] = reduced
    return jax.tree_util.tree_unflatten(treedef, out)


def mean_over_ranks(tree: Any, *, comm: Any) -> Any:
    """(1/P) Σ_r tree_r, leaf by leaf, in one message per dtype (the tree unchanged on one rank).

    What a replicated operator's transpose needs (docs/ad.md, "replicated
    operators"): the whole-program adjoint hands rank r its share of Aᵀ w,
    and the transpose every rank holds is the mean of the shares. AD and
    vmap: those of :func:`tree_allreduce`.
    """
    comm = resolve_comm(comm)
    if comm.size == 1:
        return tree
    return jax.tree_util.tree_map(lambda t: t / jnp.asarray(comm.size, t.dtype), tree_allreduce(tree, comm=comm))


def _positions_by_dtype(leaves: list[Any]) -> dict[Any, list[int]]:
    """Positions of the non-empty leaves, grouped by dtype in order of first appearance."""
    groups: dict[Any, list[int]] = {}
    for k, leaf in enumerate(leaves):
        if leaf.size:
            groups.setdefault(leaf.dtype, []).append(k)
    return groups


def _reduce_group(arrays: list[Any], comm: Any, op: Any) -> list[Any]:
    """Leaves of one dtype reduced in one allreduce (a single leaf is sent as it is)."""
    if len(arrays) == 1:
        return [_core.bind(allreduce_p, arrays[0], comm=comm, op=op)]
    total = _core.bind(allreduce_p, jnp.concatenate([jnp.ravel(a) for a in arrays]), comm=comm, op=op)
    pieces, start = [], 0
    for a in arrays:
        pieces.append(total[start : start + a.size].reshape(a.shape))
        start += a.size
    return pieces
