"""NetKet's quantum geometric tensors over the samples of every rank.

NetKet builds its QGT from the samples of the process it runs in. With
:class:`distlinalg.netket.MCState` each rank holds only its own chains, so the
same code would give every rank a different S. This module builds each of
NetKet's QGT types from all ranks' samples, with NetKet's own classes and
interface (``@``, ``solve(solve_fun, y, x0=...)``, ``to_dense()``,
``to_real_part()``/``to_imag_part()``), so that ``nk.optimizer.SR`` and any code
calling ``vstate.quantum_geometric_tensor(...)`` runs unchanged:

Both compute with the operators' Jacobian at NetKet's model (:mod:`._model`):

* ``QGTJacobianDense`` / ``QGTJacobianPyTree``: this rank's rows of the
  centred Jacobian  Ō = (O − 1 μ) / √N,  μ = Σ_all O_k / N  (the Jacobian's
  ``local_rows``, in its chunks; one parameter-sized allreduce for μ; with
  ``diag_scale`` the column norms of all N rows, a second one). A product is
  S v = Σ_ranks Ō_rᴴ (Ō_r v) + λ v: one parameter-sized allreduce;
  ``to_dense()`` sums each rank's n × n block Ō_rᴴ Ō_r (the Jacobian is never
  gathered).
* ``QGTOnTheFly``: S v = Ōᴴ Ō v / N + λ v, the operators' Gram product
  (:func:`distlinalg.operators.gram`'s): one JVP, one VJP and one
  parameter-sized allreduce. The model is linearised once per QGT (the
  mean row: one allreduce), and with ``chunk_size`` re-linearised chunk by
  chunk in every product, as NetKet's chunked product does.

The subclasses keep NetKet's solve paths (the real-dense format of the
Jacobian types, the pytree format of the on-the-fly type), so a solver runs
exactly the iteration NetKet runs on the gathered samples; every product is
an allreduce, so the solver's iterates, and the update, are identical on
every rank. On a one-rank communicator NetKet's own QGT is built (it is then
the global one).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import netket as nk
from jax.flatten_util import ravel_pytree
import netket.jax as nkjax
from flax import struct
from netket.optimizer.qgt.qgt_jacobian_dense import QGTJacobianDenseT, convert_tree_to_dense_format
from netket.optimizer.qgt.qgt_jacobian_pytree import QGTJacobianPyTreeT
from netket.optimizer.qgt.qgt_onthefly import QGTOnTheFlyT
from netket.optimizer.qgt.common import check_valid_vector_type

from ..comm.fused import tree_allreduce
from ..operators import Linearisation, ModelPoint
from ..operators.gram import gram_apply
from ._model import complex_output, dense_rows, from_model_space, model_point, rows_as_tree, to_model_space

__all__ = ["DistributedQGTJacobianDenseT", "DistributedQGTJacobianPyTreeT", "DistributedQGTOnTheFlyT",
           "distributed_qgt", "QGT_KINDS"]

tmap = jax.tree_util.tree_map

# The ways NetKet lets a user name a QGT type, and what we build for each.
QGT_KINDS = ("QGTAuto", "QGTJacobianDense", "QGTJacobianPyTree", "QGTOnTheFly")


def sum_over_ranks(tree: Any, comm: Any) -> Any:
    """Σ over ranks of per-rank pieces (nothing to do on one rank)."""
    return tree if comm.size == 1 else tree_allreduce(tree, comm=comm)


def flat_samples(vstate: Any) -> jax.Array:
    """This rank's samples as (n_local, N_sites) (NetKet keeps them per chain)."""
    samples = vstate.samples
    return samples.reshape(-1, samples.shape[-1])


# -- the Jacobian types -----------------------------------------------------------------------
def dense_rows_product(O: jax.Array, v: jax.Array, imag: bool) -> jax.Array:
    """This rank's Ō_rᴴ Ō_r v (dense rows, (n, [2,] P)); in "imag" mode the
    product of the imaginary part of the QGT (channels swapped, one negated)."""
    if not imag:
        w = O @ v
        return jnp.tensordot(jnp.conj(w), O, axes=w.ndim).conj()
    swapped = jnp.flip(O, axis=1).reshape(-1, O.shape[-1])
    signed = (jnp.array([1, -1]).reshape(1, 2, 1) * O).reshape(-1, O.shape[-1])
    w = swapped @ v
    return jnp.tensordot(jnp.conj(w), signed, axes=1).conj()


def dense_rows_gram(O: jax.Array, imag: bool) -> jax.Array:
    """This rank's block Ō_rᴴ Ō_r (P × P) of S (of its imaginary part in "imag" mode)."""
    if not imag:
        rows = O.reshape(-1, O.shape[-1])
        return jnp.conj(rows).T @ rows
    swapped = jnp.flip(O, axis=1).reshape(-1, O.shape[-1])
    signed = (jnp.array([1, -1]).reshape(1, 2, 1) * O).reshape(-1, O.shape[-1])
    return signed.T @ swapped


def pytree_rows_apply(O: Any, v: Any) -> jax.Array:
    """Ō_r v for a pytree Jacobian (one leaf per parameter leaf)."""
    return jax.tree_util.tree_reduce(jnp.add, tmap(lambda o, x: jnp.tensordot(o, x, axes=x.ndim), O, v))


def pytree_rows_product(O: Any, v: Any, imag: bool) -> Any:
    """This rank's Ō_rᴴ Ō_r v for a pytree Jacobian (or the imaginary part's)."""
    if imag:
        swapped = tmap(lambda o: jnp.flip(o, axis=1), O)
        signed = tmap(lambda o: o * jnp.array([1, -1]).reshape((1, 2) + (1,) * (o.ndim - 2)), O)
        w = jnp.conj(pytree_rows_apply(swapped, v))
        out = tmap(lambda o: jnp.tensordot(w, o, axes=w.ndim).conj(), signed)
    else:
        w = jnp.conj(pytree_rows_apply(O, v))
        out = tmap(lambda o: jnp.tensordot(w, o, axes=w.ndim).conj(), O)
    return nkjax.tree_cast(out, v)


@struct.dataclass
class DistributedQGTJacobianDenseT(QGTJacobianDenseT):
    """NetKet's ``QGTJacobianDenseT`` over every rank's samples.

    ``O`` holds this rank's rows of the globally centred Jacobian / √N (N all
    samples of all ranks); products and ``to_dense()`` sum over ranks. Built
    by ``vstate.quantum_geometric_tensor(nk.optimizer.qgt.QGTJacobianDense)``
    on a :class:`distlinalg.netket.MCState`.
    """

    comm: Any = struct.field(pytree_node=False, default=None)

    @jax.jit
    def __matmul__(self, vec: Any) -> Any:
        if not hasattr(vec, "ndim") and not self._in_solve:
            check_valid_vector_type(self._params_structure, vec)
        vec, reassemble = convert_tree_to_dense_format(vec, self.mode, disable=self._in_solve)
        if self.scale is not None:
            vec = vec * self.scale
        product = sum_over_ranks(dense_rows_product(self.O, vec, self.mode == "imag"), self.comm)
        result = product + self.diag_shift * vec
        if self.scale is not None:
            result = result * self.scale
        return reassemble(result)

    @jax.jit
    def to_dense(self) -> jax.Array:
        """S + shift as a dense matrix, summed over ranks' n × n blocks (replicated)."""
        O = self.O if self.scale is None else self.O * self.scale
        diagonal = jnp.eye(O.shape[-1]) if self.scale is None else jnp.diag(self.scale**2)
        return sum_over_ranks(dense_rows_gram(O, self.mode == "imag"), self.comm) + self.diag_shift * diagonal

    def __repr__(self) -> str:
        return (f"distlinalg.netket QGTJacobianDense(diag_shift={self.diag_shift}, mode={self.mode}, "
                f"ranks={self.comm.size})")


@struct.dataclass
class DistributedQGTJacobianPyTreeT(QGTJacobianPyTreeT):
    """NetKet's ``QGTJacobianPyTreeT`` over every rank's samples (see
    :class:`DistributedQGTJacobianDenseT`)."""

    comm: Any = struct.field(pytree_node=False, default=None)

    @jax.jit
    def __matmul__(self, vec: Any) -> Any:
        flat = hasattr(vec, "ndim")
        if flat:
            vec = ravel_pytree(self._params_structure)[1](vec)
        check_valid_vector_type(self._params_structure, vec)
        reassemble = None
        if self.mode != "holomorphic" and not self._in_solve:
            vec, reassemble = nkjax.tree_to_real(vec)
        if self.scale is not None:
            vec = tmap(jnp.multiply, vec, self.scale)
        product = sum_over_ranks(pytree_rows_product(self.O, vec, self.mode == "imag"), self.comm)
        result = tmap(lambda p, x: p + self.diag_shift * x, product, vec)
        if self.scale is not None:
            result = tmap(jnp.multiply, result, self.scale)
        if reassemble is not None:
            result = reassemble(result)
        return ravel_pytree(result)[0] if flat else result

    @jax.jit
    def to_dense(self) -> jax.Array:
        """S + shift as a dense matrix, summed over ranks' n × n blocks (replicated)."""
        O = self.O
        if self.mode in ("complex", "imag"):
            O = tmap(lambda x: x.reshape(-1, *x.shape[2:]), O)
        rows = jax.vmap(lambda row: ravel_pytree(row)[0])(O)
        diagonal = jnp.eye(rows.shape[-1])
        if self.scale is not None:
            scale = ravel_pytree(self.scale)[0]
            rows, diagonal = rows * scale[None, :], jnp.diag(scale**2)
        if self.mode == "imag":
            rows = rows.reshape(rows.shape[0] // 2, 2, -1)
        block = dense_rows_gram(rows, self.mode == "imag")
        return sum_over_ranks(block, self.comm) + self.diag_shift * diagonal

    def __repr__(self) -> str:
        return (f"distlinalg.netket QGTJacobianPyTree(diag_shift={self.diag_shift}, mode={self.mode}, "
                f"ranks={self.comm.size})")


@functools.partial(jax.jit, static_argnames=("apply_fun", "mode", "dense", "chunk_size", "comm", "rescale"))
def centred_jacobian(apply_fun: Any, params: Any, model_state: Any, samples: jax.Array, offset: Any, *, mode: str,
                     dense: bool, chunk_size: int | None, comm: Any, rescale: bool) -> tuple[Any, Any]:
    """This rank's rows of (O − 1 μ)/√N over all N samples (the operators' Jacobian, in
    NetKet's layout: dense, or a pytree), and with `rescale` the column scale
    √(Σ_all |Ō|² + offset) they are divided by (Becca–Sorella)."""
    jacobian = model_point(apply_fun, params, model_state, samples, mode=mode, comm=comm,
                           chunk_size=chunk_size).jacobian()
    rows = dense_rows(jacobian)
    scale = None
    if rescale:
        squares = jnp.sum((rows * jnp.conj(rows)).real, axis=tuple(range(rows.ndim - 1)))
        scale = (sum_over_ranks(squares, comm) + offset) ** 0.5
        rows = rows / scale
    if dense:
        return rows, scale
    return rows_as_tree(rows, jacobian), (None if scale is None else rows_as_tree(scale, jacobian))


def shift_and_offset(diag_shift: Any, diag_scale: Any) -> tuple[Any, Any]:
    """NetKet's regularisation S + ε₁ diag S + ε₂ as (shift, offset): with a
    diagonal scale the rescaled S gets the shift ε₁ and its columns the offset ε₂/ε₁."""
    diag_shift = 0.0 if diag_shift is None else diag_shift
    if isinstance(diag_scale, jax.Array) or (diag_scale is not None and diag_scale != 0.0):
        return diag_scale, diag_shift / diag_scale
    return diag_shift, None


def jacobian_qgt(vstate: Any, *, dense: bool, mode: str | None = None, holomorphic: bool | None = None,
                 diag_shift: Any = 0.0, diag_scale: Any = None, chunk_size: int | None = None, **kwargs: Any) -> Any:
    """``QGTJacobianDense`` (dense=True) or ``QGTJacobianPyTree`` of a
    distributed state, with NetKet's arguments."""
    if mode is not None and holomorphic is not None:
        raise ValueError("Cannot specify both `mode` and `holomorphic`.")
    samples = flat_samples(vstate)
    if chunk_size is None:
        chunk_size = getattr(vstate, "chunk_size", None)
    if mode is None:
        mode = nkjax.jacobian_default_mode(vstate._apply_fun, vstate.parameters, vstate.model_state, samples,
                                           holomorphic=holomorphic)
    shift, offset = shift_and_offset(diag_shift, diag_scale)
    O, scale = centred_jacobian(vstate._apply_fun, vstate.parameters, vstate.model_state, samples,
                                0.0 if offset is None else offset, mode="complex" if mode == "imag" else mode,
                                dense=dense, chunk_size=chunk_size, comm=vstate._distlinalg_comm,
                                rescale=offset is not None)
    structure = tmap(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), vstate.parameters)
    cls = DistributedQGTJacobianDenseT if dense else DistributedQGTJacobianPyTreeT
    return cls(O=O, scale=scale, mode=mode, _params_structure=structure, diag_shift=shift,
               comm=vstate._distlinalg_comm, **kwargs)


# -- the on-the-fly type -----------------------------------------------------------------------
@struct.dataclass
class DistributedQGTOnTheFlyT(QGTOnTheFlyT):
    """NetKet's ``QGTOnTheFlyT`` whose product covers every rank's samples:
    ``_mat_vec`` is :func:`onthefly_product` (one JVP, one VJP, one
    parameter-sized allreduce); NetKet's solve and ``to_dense`` use it as is."""

    comm: Any = struct.field(pytree_node=False, default=None)

    def __repr__(self) -> str:
        return f"distlinalg.netket QGTOnTheFly(diag_shift={self.diag_shift}, ranks={self.comm.size})"


def onthefly_product(point: ModelPoint, linearisation: Linearisation, v: Any, diag_shift: Any) -> Any:
    """(S + λ) v over all ranks' samples: the operators' Gram product ŌᴴŌ v / N + λ v at
    NetKet's model (v shaped like the parameters; NetKet's S in its mode)."""
    jacobian = point.linearise(linearisation)
    u = to_model_space(v, point.mode)
    return from_model_space(gram_apply(jacobian, u, diag_shift, None), v, point.mode)


@functools.partial(jax.jit, static_argnames=("apply_fun", "mode", "chunk_size", "comm"))
def onthefly_linearisation(apply_fun: Any, params: Any, model_state: Any, samples: jax.Array, *, mode: str,
                           chunk_size: int | None, comm: Any) -> tuple[ModelPoint, Linearisation]:
    """The point and its linearisation, once per QGT (the mean row: one allreduce; without
    chunks the model linearised on this rank's samples, kept for every product)."""
    point = model_point(apply_fun, params, model_state, samples, mode=mode, comm=comm, chunk_size=chunk_size)
    return point, point.linearise().linearisation


def onthefly_qgt(vstate: Any, *, chunk_size: int | None = None, holomorphic: bool | None = None,
                 **kwargs: Any) -> DistributedQGTOnTheFlyT:
    """``QGTOnTheFly`` of a distributed state, with NetKet's arguments and checks."""
    if kwargs.pop("diag_scale", None) is not None:
        raise NotImplementedError("`diag_scale` is not supported by QGTOnTheFly (as in NetKet): use "
                                  "QGTJacobianDense or QGTJacobianPyTree")
    params, model_state, samples = vstate.parameters, vstate.model_state, flat_samples(vstate)
    if chunk_size is None:
        chunk_size = getattr(vstate, "chunk_size", None)
    if chunk_size is not None and chunk_size >= samples.shape[0]:
        chunk_size = None
    if holomorphic:
        if nkjax.tree_leaf_isreal(params):
            raise nk.errors.IllegalHolomorphicDeclarationForRealParametersError()
        nk_mode = "holomorphic"
    elif not nkjax.tree_leaf_iscomplex(params):
        nk_mode = "real"
    else:
        if holomorphic is None:
            warnings.warn(nk.errors.HolomorphicUndeclaredWarning(), UserWarning, stacklevel=3)
        nk_mode = "complex"
    nkjax.jacobian_default_mode(vstate._apply_fun, params, model_state, samples, holomorphic=holomorphic)
    comm = vstate._distlinalg_comm
    # NetKet's on-the-fly S differentiates the complex log ψ itself, whatever its mode's name:
    # with real parameters it is Re(OᴴŌ) of both parts of a complex output (the Jacobian's
    # "complex" mode).
    mode = nk_mode
    if nk_mode != "holomorphic":
        mode = "complex" if complex_output(vstate._apply_fun, params, model_state, samples) else "real"
    point, linearisation = onthefly_linearisation(vstate._apply_fun, params, model_state, samples,
                                                  mode=mode, chunk_size=chunk_size, comm=comm)
    product = jax.tree_util.Partial(onthefly_product, point, linearisation)
    return DistributedQGTOnTheFlyT(_mat_vec=product, _params=params, _chunking=chunk_size is not None,
                                   _mode=nk_mode, comm=comm, **kwargs)


# -- which constructor the user named -------------------------------------------------------------
def _kind_of(constructor: Any) -> tuple[str | None, dict]:
    """("QGTJacobianDense" ..., keyword arguments bound in a partial) or (None, {})."""
    from netket.optimizer import qgt as nk_qgt

    bound: dict = {}
    while isinstance(constructor, functools.partial):
        if constructor.args:
            return None, {}
        bound = {**constructor.keywords, **bound}
        constructor = constructor.func
    if isinstance(constructor, nk_qgt.QGTAuto):
        return "QGTAuto", bound
    for name in QGT_KINDS[1:]:
        known = getattr(nk_qgt, name)
        if constructor is known or constructor is getattr(known, "__wrapped__", None) or \
                getattr(constructor, "_distlinalg_qgt_kind", None) == name:
            return name, bound
    return None, {}


def distributed_qgt(vstate: Any, constructor: Any = None, **kwargs: Any) -> Any:
    """The QGT `constructor` names (one of NetKet's types, a partial of one, a
    ``QGTAuto``, or None for ``QGTAuto()``), built over every rank's samples."""
    from netket.optimizer.qgt.default import default_qgt_matrix

    if constructor is None:
        constructor = nk.optimizer.qgt.QGTAuto()
    kind, bound = _kind_of(constructor)
    if kind is None:
        raise NotImplementedError(
            f"distlinalg.netket.MCState: the QGT constructor {constructor!r} is not one of NetKet's "
            f"{', '.join(QGT_KINDS)} (or a partial of one); built on this state it would use this rank's samples "
            "only. Use one of NetKet's QGT types, or distlinalg.netket.SR")
    kwargs = {**bound, **kwargs}
    if kind == "QGTAuto":
        # NetKet's own choice; it depends only on replicated data (parameters, solver).
        chosen = default_qgt_matrix(vstate, solver=constructor._solver, **{**constructor._kwargs, **kwargs})
        kind, bound = _kind_of(chosen)
        if kind is None or kind == "QGTAuto":
            raise NotImplementedError(f"distlinalg.netket.MCState: QGTAuto chose {chosen!r}, which is not distributed")
        kwargs = {**bound, **kwargs}
    if vstate._distlinalg_comm.size == 1:
        # One rank holds every sample: NetKet's own QGT is the global one (its original
        # constructor, not the routed name, which would come back here).
        return getattr(nk.optimizer.qgt, kind).__wrapped__(vstate, **kwargs)
    if kind == "QGTOnTheFly":
        return onthefly_qgt(vstate, **kwargs)
    return jacobian_qgt(vstate, dense=kind == "QGTJacobianDense", **kwargs)
