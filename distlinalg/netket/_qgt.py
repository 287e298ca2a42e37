"""NetKet's quantum geometric tensors over the samples of every rank.

NetKet builds its QGT from the samples of the process it runs in. With
:class:`distlinalg.netket.MCState` each rank holds only its own chains, so the
same code would give every rank a different S. This module builds each of
NetKet's QGT types from all ranks' samples, with NetKet's own classes and
interface (``@``, ``solve(solve_fun, y, x0=...)``, ``to_dense()``,
``to_real_part()``/``to_imag_part()``), so that ``nk.optimizer.SR`` and any code
calling ``vstate.quantum_geometric_tensor(...)`` runs unchanged:

* ``QGTJacobianDense`` / ``QGTJacobianPyTree``: this rank's rows of the
  centred Jacobian  Ō = (O − 1 μ) / √N,  μ = Σ_all O_k / N  (one
  parameter-sized allreduce at construction; with ``diag_scale`` the column
  norms of all N rows, a second one). A product is  S v = Σ_ranks Ō_rᴴ (Ō_r v)
  + λ v: one parameter-sized allreduce; ``to_dense()`` sums each rank's
  n × n block Ō_rᴴ Ō_r (the Jacobian is never gathered).
* ``QGTOnTheFly``: S v = conj(Oᵀ conj(w − w̄)) + λ v with w = O v / N (NetKet's
  formula, a JVP and a VJP of this rank's samples). The mean w̄ over all N
  samples enters through two parameter vectors computed once, m₁ = Σ_all Oᵀ 1
  and m_i = Σ_all Oᵀ i (the transpose is real-linear in its cotangent), so a
  product is one JVP, one VJP and one parameter-sized allreduce.

The subclasses keep NetKet's solve paths (the real-dense format of the
Jacobian types, the pytree format of the on-the-fly type), so a solver runs
exactly the iteration NetKet runs on the gathered samples; every product is
an allreduce, so the solver's iterates, and the update, are identical on
every rank. On a one-rank communicator NetKet's own QGT is built (it is then
the global one).
"""

from __future__ import annotations

import functools
import math
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
from netket.utils import HashablePartial

from ..comm.fused import tree_allreduce

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
    """This rank's rows of (O − 1 μ)/√N over all N samples, and with `rescale` the
    column scale √(Σ_all |Ō|² + offset) they are divided by (Becca–Sorella)."""
    jac = nkjax.jacobian(apply_fun, params, samples, model_state, mode=mode, chunk_size=chunk_size, dense=dense,
                         center=False)
    n_total = samples.shape[0] * comm.size  # every rank holds the same number of samples
    mean = tmap(lambda s: s / n_total, sum_over_ranks(tmap(lambda x: jnp.sum(x, axis=0), jac), comm))
    sqrt_n = math.sqrt(n_total)
    jac = tmap(lambda x, m: (x - m[None]) / sqrt_n, jac, mean)
    if not rescale:
        return jac, None
    sample_axes = 2 if mode == "complex" else 1  # (sample, Re/Im channel) for complex outputs
    squares = tmap(lambda x: jnp.sum((x * jnp.conj(x)).real, axis=tuple(range(sample_axes))), jac)
    scale = tmap(lambda s: (s + offset) ** 0.5, sum_over_ranks(squares, comm))
    return tmap(lambda x, s: x / s, jac, scale), scale


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


def _chunks(samples: jax.Array, chunk_size: int) -> tuple[jax.Array, jax.Array]:
    """(n_chunks, chunk_size, ...) samples padded with copies of the first, and their masks."""
    n = samples.shape[0]
    n_chunks = -(-n // chunk_size)
    padded = jnp.concatenate([samples, jnp.broadcast_to(samples[:1], (n_chunks * chunk_size - n, *samples.shape[1:]))])
    mask = (jnp.arange(n_chunks * chunk_size) < n).reshape(n_chunks, chunk_size)
    return padded.reshape(n_chunks, chunk_size, *samples.shape[1:]), mask


def _chunked_jvp(forward: Any, params: Any, samples: jax.Array, v: Any, chunk_size: int) -> jax.Array:
    """O v on this rank's samples, (n_local,), `chunk_size` samples at a time."""
    batches, _ = _chunks(samples, chunk_size)
    _, out = jax.lax.scan(lambda _, x: (None, jax.jvp(lambda p: forward(p, x), (params,), (v,))[1]), None, batches)
    return out.reshape(-1)[: samples.shape[0]]


def _local_vjp(forward: Any, params: Any, samples: jax.Array, w: jax.Array, chunk_size: int | None) -> Any:
    """Oᵀ w = Σ_k (∂f_k/∂θ)ᵀ w_k on this rank's samples (real-linear in w)."""
    if chunk_size is None:
        return jax.vjp(lambda p: forward(p, samples), params)[1](w)[0]
    batches, mask = _chunks(samples, chunk_size)
    padded = jnp.zeros(mask.size, w.dtype).at[: w.shape[0]].set(w).reshape(mask.shape)

    def step(acc: Any, item: Any) -> Any:
        x, wc = item
        return tmap(jnp.add, acc, jax.vjp(lambda p: forward(p, x), params)[1](wc)[0]), None

    total, _ = jax.lax.scan(step, tmap(jnp.zeros_like, params), (batches, padded))
    return total


def onthefly_product(apply_fun: Any, comm: Any, n_total: int, chunk_size: int | None, linear: Any, params: Any,
                     model_state: Any, samples: jax.Array, mean_one: Any, mean_i: Any, v: Any, diag_shift: Any) -> Any:
    """(S + λ) v over all ranks' samples, S as NetKet's on-the-fly QGT defines it:

        w = O v / N,   S v = conj(Oᵀ conj(w − w̄)),   w̄ = Σ_all w_k / N.

    Oᵀ conj(w̄ 1) = Re(conj w̄) m₁ + Im(conj w̄) m_i (summed over all samples, with
    m₁ = Σ_all Oᵀ 1, m_i = Σ_all Oᵀ i), and w̄ is the sum of the ranks' shares
    Σ_local w_k / N, so each rank subtracts its share's term before the one allreduce.
    """
    if linear is not None:  # linearised once, at construction (no chunks): O v and Oᵀ w reuse it
        w = linear(v) / n_total
        (local,) = jax.linear_transpose(linear, v)(jnp.conj(w))
    else:  # chunks: the model is evaluated again chunk by chunk, as NetKet's chunked product does
        forward = functools.partial(_apply_with_state, apply_fun, model_state)
        w = _chunked_jvp(forward, params, samples, v, chunk_size) / n_total
        local = _local_vjp(forward, params, samples, jnp.conj(w), chunk_size)
    share = jnp.conj(jnp.sum(w)) / n_total  # this rank's part of conj(w̄)
    local = tmap(lambda o, a: o - jnp.real(share) * a, local, mean_one)
    if mean_i is not None:
        local = tmap(lambda o, b: o - jnp.imag(share) * b, local, mean_i)
    product = tmap(jnp.conj, sum_over_ranks(local, comm))
    return tmap(lambda p, x: p + diag_shift * x, product, v)


@functools.partial(jax.jit, static_argnames=("apply_fun", "comm", "chunk_size", "complex_output"))
def onthefly_means(apply_fun: Any, params: Any, model_state: Any, samples: jax.Array, *, comm: Any,
                   chunk_size: int | None, complex_output: bool) -> tuple[Any, Any]:
    """m₁ = Σ_all Oᵀ 1 and (complex outputs) m_i = Σ_all Oᵀ i, one allreduce."""
    forward = functools.partial(_apply_with_state, apply_fun, model_state)
    dtype = jax.eval_shape(forward, params, samples[:1]).dtype
    ones = jnp.ones(samples.shape[0], dtype)
    pieces = [_local_vjp(forward, params, samples, ones, chunk_size)]
    if complex_output:
        pieces.append(_local_vjp(forward, params, samples, 1j * ones, chunk_size))
    pieces = sum_over_ranks(pieces, comm)
    return pieces[0], (pieces[1] if complex_output else None)


@functools.partial(jax.jit, static_argnums=0)
def linearised(apply_fun: Any, params: Any, model_state: Any, samples: jax.Array) -> Any:
    """v ↦ O v on this rank's samples, linearised once (a pytree, as NetKet keeps it)."""
    return jax.linearize(functools.partial(_apply_with_state, apply_fun, model_state, samples=samples), params)[1]


def _apply_with_state(apply_fun: Any, model_state: Any, params: Any, samples: jax.Array) -> jax.Array:
    return apply_fun({"params": params, **model_state}, samples)


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
        mode = "holomorphic"
    elif not nkjax.tree_leaf_iscomplex(params):
        mode = "real"
    else:
        if holomorphic is None:
            warnings.warn(nk.errors.HolomorphicUndeclaredWarning(), UserWarning, stacklevel=3)
        mode = "complex"
    nkjax.jacobian_default_mode(vstate._apply_fun, params, model_state, samples, holomorphic=holomorphic)
    comm = vstate._distlinalg_comm
    output = jax.eval_shape(functools.partial(_apply_with_state, vstate._apply_fun, model_state), params, samples[:1])
    complex_output = bool(jnp.iscomplexobj(output))
    mean_one, mean_i = onthefly_means(vstate._apply_fun, params, model_state, samples, comm=comm,
                                      chunk_size=chunk_size, complex_output=complex_output)
    n_total = samples.shape[0] * comm.size
    linear = None if chunk_size is not None else linearised(vstate._apply_fun, params, model_state, samples)
    product = jax.tree_util.Partial(HashablePartial(onthefly_product, vstate._apply_fun, comm, n_total, chunk_size),
                                    linear, params, model_state, samples, mean_one, mean_i)
    return DistributedQGTOnTheFlyT(_mat_vec=product, _params=params, _chunking=chunk_size is not None, _mode=mode,
                                   comm=comm, **kwargs)


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
