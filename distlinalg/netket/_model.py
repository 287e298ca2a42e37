"""A NetKet state's model as a point of :mod:`distlinalg.operators`.

Every QGT, SR and NTK path of this adapter computes with the operators'
:class:`~distlinalg.operators.Jacobian` at a :class:`~distlinalg.operators.ModelPoint`
built here: one distributed Jacobian (its centring over all ranks' samples,
its chunks, its products), not a second one in the adapter.

The point is expanded in NetKet's layout, so that the matrices and vectors
handed to NetKet's solvers are the ones NetKet builds on the gathered samples:

* "real" and "complex" modes differentiate with respect to the real parameters
  of ``netket.jax.tree_to_real`` (the real parts of every leaf, then the
  imaginary parts of the complex leaves); a dense row is that tree ravelled.
* "holomorphic" differentiates with respect to the complex parameters.
* In "complex" mode each sample has two rows, (Re, Im), adjacent.

The model state (NetKet's ``model_state``) is the point's ``state``: read by
the model, not differentiated. A :class:`distlinalg.netket.MCState` holds as
many samples on every rank, so the counts are known without an exchange and
a point can be built inside a jitted step.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import netket.jax as nkjax
import numpy as np
from jax.flatten_util import ravel_pytree

from ..operators import Jacobian, ModelPoint

__all__ = ["NetKetModel", "model_point", "to_model_space", "from_model_space", "dense_rows", "rows_as_tree"]

_WHERE = "distlinalg.netket"


@dataclasses.dataclass(frozen=True)
class NetKetModel:
    """(θ, samples, model_state) ↦ log ψ of NetKet's ``apply_fun``, θ in the mode's
    layout (``rebuild`` turns NetKet's real parameters back into its parameters;
    None in "holomorphic" mode). Static data: equal for the same ``apply_fun``."""

    apply_fun: Any
    rebuild: Any = None

    def __call__(self, theta: Any, samples: jax.Array, model_state: Any) -> jax.Array:
        params = theta if self.rebuild is None else self.rebuild(theta)
        return self.apply_fun({"params": params, **model_state}, samples)


def model_point(apply_fun: Any, params: Any, model_state: Any, samples: jax.Array, *, mode: str, comm: Any,
                chunk_size: int | None = None, center: bool = True) -> ModelPoint:
    """The point of NetKet's model at `params` on this rank's `samples` (n, sites):
    every rank holds n samples. Builds nothing collective; may be called inside jit."""
    if mode == "holomorphic":
        theta, model = params, NetKetModel(apply_fun)
    else:
        theta, rebuild = nkjax.tree_to_real(params)
        model = NetKetModel(apply_fun, rebuild)
    counts = np.full(comm.size, samples.shape[0], np.int64)
    return ModelPoint.build(model, theta, samples, state=model_state, mode=mode, center=center,
                            chunk_size=chunk_size, comm=comm, counts=counts, where=_WHERE)


def to_model_space(v: Any, mode: str) -> Any:
    """A vector shaped like the parameters ↦ the same vector in the point's layout."""
    return v if mode == "holomorphic" else nkjax.tree_to_real(v)[0]


def from_model_space(u: Any, like: Any, mode: str) -> Any:
    """A vector in the point's layout ↦ shaped (and typed) like the parameters `like`."""
    if mode != "holomorphic":
        u = nkjax.tree_to_real(like)[1](u)
    return nkjax.tree_cast(u, like)


def dense_rows(jacobian: Jacobian) -> jax.Array:
    """This rank's rows of Ō / √N in NetKet's dense layout: (n, P), or (n, 2, P) in "complex" mode."""
    rows = jacobian.local_rows() / math.sqrt(jacobian.n_total)
    if jacobian.mode == "complex":
        return rows.reshape(jacobian.n_local, 2, rows.shape[-1])
    return rows


def rows_as_tree(rows: jax.Array, jacobian: Jacobian) -> Any:
    """Dense rows (n, [2,] P) as NetKet's pytree Jacobian: one leaf (n, [2,] *leaf) per parameter leaf."""
    unravel = ravel_pytree(jacobian.theta)[1]
    lead = rows.shape[:-1]
    tree = jax.vmap(unravel)(rows.reshape(-1, rows.shape[-1]))
    return jax.tree_util.tree_map(lambda x: x.reshape(*lead, *x.shape[1:]), tree)


def complex_output(apply_fun: Any, params: Any, model_state: Any, samples: jax.Array) -> bool:
    """Whether the model's output is complex."""
    out = jax.eval_shape(lambda p, x: apply_fun({"params": p, **model_state}, x), params, samples[:1])
    return bool(jnp.iscomplexobj(out))
