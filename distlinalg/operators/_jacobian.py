"""The centred Jacobian of a model over every rank's samples, matrix-free.

What the parameter-space Gram operator S = Ōᴴ Ō / N (:mod:`.gram`), the
sample-space one T = Ō Ōᴴ / N (:mod:`.sample_gram`) and the natural gradient
share: the model linearised once, its modes, its centring and its chunking.

With per-sample outputs f_i(θ) of all N samples on all ranks, O is the
N × k × n Jacobian (k output channels, see the modes) and

    Ō = O − 1 μ,    μ = 1ᵀ O / N   (the mean row; Ō = O when not centring).

Rank r holds the rows of its own samples. ``jvp(u)`` gives this rank's rows
of Ō u; ``vjp(w)`` gives Ōᵀ w summed over *every* rank's samples (one fused
allreduce of a parameter-sized vector with replicated parameters; the
model's own collectives do the sum with sharded parameters).

Modes, with NetKet's names and meanings (``netket.jax.jacobian``):
  * "real": O = ∂ Re f / ∂θ̃ (k = 1): the imaginary part of a complex output
    is dropped (real wave functions with a sign).
  * "complex": O = ∂ (Re f, Im f) / ∂θ̃ (k = 2): any model.
  * "holomorphic": O = ∂ f / ∂θ complex (k = 1): complex parameters and a
    holomorphic model, as the caller declares.
θ̃ is θ for real parameters and (Re θ, Im θ) for complex ones in the first
two modes, so for real parameters S = Re(OᴴO)/N in "complex" mode whatever
the output. The default mode is NetKet's choice: "complex" for a complex
output, else "real".

Two pieces:

* :class:`ModelPoint`, the point the model is expanded at: declared data
  (children: params and this rank's samples; static: f, the mode, every
  rank's sample count, the chunking, the structures). Operators built on
  it are pytrees through it; rebuilding one from its children computes and
  communicates nothing.
* :class:`Jacobian`, the computation at a point in the current trace:
  ``point.jacobian()`` evaluates the model in every product (what an
  operator's own matvec does), ``point.linearise()`` linearises it (and
  takes the mean row) once, what :func:`distlinalg.operators.linearise`
  and the solvers use.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from .._runtime.mpi import Communicator, resolve_comm
from .._trees import Structure, flat_size, is_complex, join_complex, leaves, split_complex, tree_map
from ..comm import _core
from ..comm.allreduce import allreduce
from ..comm.fused import tree_allreduce
from ._base import LinearOperator, operator_class
from ._partition import exchange_sizes

MODES = ("real", "complex", "holomorphic")


# -- pytree algebra ------------------------------------------------------------
def channel_dot(rows: Any, v: Any) -> jax.Array:
    """(k,) products Σ_j rows[c, j] v_j (no conjugate) of k rows shaped like v."""
    parts = [jnp.sum((m * x[None]).reshape(m.shape[0], -1), axis=1) for m, x in zip(leaves(rows), leaves(v))]
    return sum(parts[1:], parts[0])


# -- validation ------------------------------------------------------------------
def check_model(f: Callable[..., Any], params: Any, samples: Any, mode: str | None, where: str):
    """Validate at trace time. Returns (mode, local sample count, whether f
    communicates, whether its output is complex)."""
    if mode is not None and mode not in MODES:
        raise ValueError(f"{where}: mode must be one of {MODES} or None (NetKet's default), got {mode!r}")
    sample_leaves = leaves(samples)
    if not sample_leaves or any(jnp.ndim(x) == 0 for x in sample_leaves):
        raise ValueError(f"{where}: samples must be arrays (or a pytree of arrays) with a leading sample axis")
    counts = {jnp.shape(x)[0] for x in sample_leaves}
    if len(counts) != 1:
        raise ValueError(f"{where}: every leaf of samples needs the same leading (sample) dimension, got {sorted(counts)}")
    (n_local,) = counts
    param_leaves = leaves(params)
    if not param_leaves:
        raise ValueError(f"{where}: params is empty")
    if any(not jnp.issubdtype(jnp.result_type(x), jnp.inexact) for x in param_leaves):
        raise TypeError(f"{where}: params must be floating or complex arrays")
    complex_params = [jnp.iscomplexobj(x) for x in param_leaves]
    if mode == "holomorphic" and not all(complex_params):
        raise TypeError(f"{where}: mode='holomorphic' needs complex parameters (every leaf); use mode='real' "
                        "or 'complex' for real or mixed parameters")
    closed = jax.make_jaxpr(f)(params, samples)
    out = closed.out_avals
    if len(out) != 1 or out[0].shape != (n_local,):
        shapes = [tuple(a.shape) for a in out]
        raise ValueError(f"{where}: f(params, samples) must return one value per local sample, shape ({n_local},); "
                         f"got {shapes[0] if len(shapes) == 1 else shapes}")
    complex_output = bool(jnp.issubdtype(out[0].dtype, jnp.complexfloating))
    if mode == "holomorphic" and not complex_output:
        raise TypeError(f"{where}: mode='holomorphic' needs a complex-valued model")
    if mode is None:
        mode = "complex" if complex_output else "real"
    communicates = any(isinstance(e, _core.MPIEffect) for e in closed.effects)
    return mode, int(n_local), communicates, complex_output


# -- chunks of samples -------------------------------------------------------------
def pad_samples(samples: Any, total: int) -> Any:
    """Pad the sample axis to `total` by repeating sample 0 (masked out later)."""

    def pad(x: Any) -> Any:
        extra = total - x.shape[0]
        if extra == 0:
            return x
        filler = jnp.broadcast_to(x[:1], (extra, *x.shape[1:])) if x.shape[0] else jnp.zeros((extra, *x.shape[1:]), x.dtype)
        return jnp.concatenate([x, filler])

    return tree_map(pad, samples)


# -- the point ---------------------------------------------------------------------
class UserFunction:
    """A user's function as static data: equal when it is the same object (or
    compares equal), hashed by its hash, or by its id when it has none (a
    callable object without __hash__: jit then recompiles for another
    instance instead of failing to hash the tree definition)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn

    def __eq__(self, other: Any) -> bool:
        if not isinstance(other, UserFunction):
            return False
        if self.fn is other.fn:
            return True
        try:
            return bool(self.fn == other.fn)
        except Exception:  # noqa: BLE001 (a user's __eq__ that cannot compare)
            return False

    def __hash__(self) -> int:
        try:
            return hash(self.fn)
        except TypeError:
            return id(self.fn)

    def __repr__(self) -> str:
        return f"UserFunction({self.fn!r})"


def point_class(cls: type) -> type:
    """A frozen, keyword-only dataclass registered as a pytree (fields with
    ``metadata={"static": True}`` are static): the declared data of a point."""
    cls = dataclasses.dataclass(frozen=True, eq=False, kw_only=True)(cls)
    return jax.tree_util.register_dataclass(cls)


def _static(**kwargs: Any) -> Any:
    return dataclasses.field(metadata={"static": True}, **kwargs)


@point_class
class ModelPoint:
    """f at params on this rank's samples, in the space of `mode`: the point the
    Jacobian-based operators (Gram, sample Gram, the natural gradient) expand at.

    A pytree: the children are ``params`` (replicated, or this rank's block)
    and ``samples`` (this rank's); everything else is static, decided once
    by :meth:`build` (the sample counts by one exchange between ranks) and
    compared by value, so two points of the same f (the same object),
    shapes, counts and options have equal tree definitions and jit reuses
    one compilation for both. Rebuilding one from its children computes
    nothing and never communicates.

    Attributes:
      state: arrays f reads but is not differentiated in (a model's batch
        statistics, NetKet's ``model_state``), a child; with a state, f is
        called as ``f(params, samples, state)``. None: ``f(params, samples)``.
      mode: "real", "complex" or "holomorphic".
      counts: every rank's sample count; ``n_local``, ``n_total``.
      split: whether θ̃ splits complex parameters into (Re, Im) pairs.
      channels: k, output channels per sample (2 in "complex" mode).
      dtype: dtype of the Jacobian's entries (real, or complex in "holomorphic").
      params_structure: the params' :class:`~distlinalg._trees.Structure`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from distlinalg import comm
      >>> from distlinalg.operators import ModelPoint
      >>> f = lambda w, x: jnp.tanh(x @ w)
      >>> x = jax.random.normal(jax.random.PRNGKey(comm.rank()), (4, 3))
      >>> point = ModelPoint.build(f, jnp.array([0.5, -0.3, 0.2]), x)
      >>> point.mode, point.n_total == 4 * comm.size(), point.linearise().jvp(jnp.ones(3)).shape
      ('real', True, (4, 1))
    """

    params: Any
    samples: Any
    state: Any = None
    function: UserFunction = _static()
    mode: str = _static()
    center: bool = _static(default=True)
    chunk: int | None = _static(default=None)
    n_chunks: int = _static(default=1)
    comm: Communicator = _static()
    sharded_params: bool = _static(default=False)
    communicates: bool = _static(default=False)
    counts: tuple[int, ...] = _static()
    split: bool = _static(default=False)
    dtype: Any = _static()
    params_structure: Structure = _static()

    @staticmethod
    def build(f: Callable[..., Any], params: Any, samples: Any, *, mode: str | None = None, center: bool = True,
              chunk_size: int | None = None, comm: Any = None, sharded_params: bool = False, state: Any = None,
              counts: Any = None, where: str = "distlinalg.operators") -> ModelPoint:
        """Check the model at trace time and exchange the sample counts (every
        rank calls it together); the arguments are those of :func:`~distlinalg.operators.gram`.

        ``state``: see the attribute (f is then ``f(params, samples, state)``).
        ``counts``: every rank's sample count where every rank already knows
        them (equal by construction, as in a NetKet state of
        :mod:`distlinalg.netket`): no exchange, so the point can be built
        inside a traced function. This rank's entry must be its own count.
        """
        comm = resolve_comm(comm)
        bound = f if state is None else (lambda p, x: f(p, x, state))
        mode, n_local, communicates, _ = check_model(bound, params, samples, mode, where)
        if counts is None:
            counts = exchange_sizes(n_local, comm)
        else:
            counts = np.asarray(counts, np.int64)
            if counts.shape != (comm.size,) or int(counts[comm.rank]) != n_local:
                raise ValueError(f"{where}: counts must hold every rank's sample count, this rank's being {n_local}; "
                                 f"got {counts.tolist()} for {comm.size} rank(s)")
        if int(counts.sum()) == 0:
            raise ValueError(f"{where}: no samples on any rank")
        chunk, n_chunks = None, 1
        if chunk_size is not None:
            if isinstance(chunk_size, bool) or int(chunk_size) != chunk_size or int(chunk_size) < 1:
                raise ValueError(f"{where}: chunk_size must be a positive int, got {chunk_size!r}")
            chunk = int(chunk_size)
            # A communicating model makes collective calls: every rank runs
            # the same number of equally sized chunks.
            longest = int(counts.max()) if communicates else n_local
            n_chunks = max(1, -(-longest // chunk))
        split = mode != "holomorphic" and is_complex(params)
        theta = split_complex(params) if split else params
        outputs = _outputs_in_mode(bound, mode, split)
        dtype = jnp.dtype(jax.eval_shape(outputs, theta, samples).dtype)
        return ModelPoint(params=params, samples=samples, state=state, function=UserFunction(f), mode=mode,
                          center=bool(center),
                          chunk=chunk, n_chunks=n_chunks, comm=comm, sharded_params=bool(sharded_params),
                          communicates=communicates, counts=tuple(int(c) for c in counts), split=split,
                          dtype=dtype, params_structure=Structure.of(params))

    @property
    def f(self) -> Callable[..., Any]:
        """(params, samples) ↦ outputs: the user's f, with the state bound when there is one."""
        fn = self.function.fn
        if self.state is None:
            return fn
        state = self.state
        return lambda params, samples: fn(params, samples, state)

    @property
    def n_local(self) -> int:
        return self.counts[self.comm.rank]

    @property
    def n_total(self) -> int:
        return int(sum(self.counts))

    @property
    def channels(self) -> int:
        return 2 if self.mode == "complex" else 1

    @property
    def sample_structure(self) -> jax.ShapeDtypeStruct:
        """A sample-space block: (n_r,) of the Jacobian's dtype, or (n_r, 2) real in "complex" mode."""
        if self.mode == "complex":
            return jax.ShapeDtypeStruct((self.n_local, 2), self.dtype)
        return jax.ShapeDtypeStruct((self.n_local,), self.dtype)

    def jacobian(self) -> Jacobian:
        """Ō at this point, evaluating the model in every product (no collective here)."""
        return Jacobian(self, linearised=False)

    def linearise(self, linearisation: Linearisation | None = None) -> Jacobian:
        """Ō at this point, the model linearised (and the mean row taken: one
        allreduce when centring) once, here; or restored from the
        ``Jacobian.linearisation`` of this point made in another trace
        (nothing evaluated, nothing communicated)."""
        return Jacobian(self, linearised=True, linearisation=linearisation)


@point_class
class Linearisation:
    """What ``point.linearise()`` computed, as data that can leave the trace it
    was made in (a jitted function's result, an argument of the next one):
    ``tangent_map``, jax.linearize's u ↦ O u on this rank's samples (None with
    chunks, whose products re-linearise chunk by chunk), and ``mean_row``, μ
    (None when not centring). ``point.linearise(linearisation)`` restores the
    Jacobian; the transpose is re-derived from the tangent map there.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from distlinalg import comm
      >>> from distlinalg.operators import ModelPoint
      >>> x = jax.random.normal(jax.random.PRNGKey(comm.rank()), (4, 3))
      >>> point = ModelPoint.build(lambda w, x: jnp.tanh(x @ w), jnp.ones(3), x)
      >>> made = jax.jit(lambda p: p.linearise().linearisation)(point)     # one program linearises
      >>> rows = jax.jit(lambda p, lin, u: p.linearise(lin).jvp(u))         # another reuses it
      >>> bool(jnp.allclose(rows(point, made, jnp.ones(3)), point.linearise().jvp(jnp.ones(3))))
      True
    """

    tangent_map: Any = None
    mean_row: Any = None


def _outputs_in_mode(f: Callable[..., Any], mode: str, split: bool) -> Callable[[Any, Any], jax.Array]:
    """(θ̃, samples) ↦ (n, k) outputs: Re f ("real"), (Re f, Im f) ("complex"), f ("holomorphic")."""

    def outputs(theta: Any, samples: Any) -> jax.Array:
        y = f(join_complex(theta) if split else theta, samples)
        if mode == "holomorphic":
            return y[:, None]
        if mode == "complex":
            return jnp.stack([jnp.real(y), jnp.imag(y)], axis=1)
        return jnp.real(y)[:, None]

    return outputs


class Jacobian:
    """The centred Jacobian Ō of a :class:`ModelPoint`, in the current trace.

    Not a pytree and not kept: made by ``point.jacobian()`` (the model
    evaluated in every product) or ``point.linearise()`` (linearised once,
    with the mean row), and used in the trace it was made in. ``jvp(u)``
    gives this rank's rows of Ō u, shape (n_local, k); ``vjp(w)`` and
    ``adjoint(w)`` give Ōᵀ w and Ōᴴ w summed over every rank's samples.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from distlinalg import comm
      >>> from distlinalg.operators import ModelPoint
      >>> x = jax.random.normal(jax.random.PRNGKey(comm.rank()), (4, 3))
      >>> J = ModelPoint.build(lambda w, x: x @ w, jnp.ones(3), x, center=False).linearise()
      >>> bool(jnp.allclose(J.jvp(jnp.ones(3))[:, 0], x.sum(axis=1)))   # O u, this rank's rows
      True
    """

    def __init__(self, point: ModelPoint, *, linearised: bool, linearisation: Linearisation | None = None):
        self.point = point
        self.params, self.samples = point.params, point.samples
        self.mode, self.center, self.comm = point.mode, point.center, point.comm
        self.sharded_params, self.communicates = point.sharded_params, point.communicates
        self.n_local, self.split, self.channels, self.dtype = point.n_local, point.split, point.channels, point.dtype
        self.counts = np.asarray(point.counts, np.int64)
        self.n_total = point.n_total
        self.outputs = _outputs_in_mode(point.f, point.mode, point.split)
        self._chunk, self._n_chunks = point.chunk, point.n_chunks
        if self._chunk is not None:
            padded = self._chunk * self._n_chunks
            self._batches = tree_map(lambda x: x.reshape(self._n_chunks, self._chunk, *x.shape[1:]),
                                     pad_samples(self.samples, padded))
            self._masks = (jnp.arange(padded) < self.n_local).reshape(self._n_chunks, self._chunk)
        self._linear = None
        self._mean = None
        self._linearised = linearised or linearisation is not None
        if linearisation is not None:
            if (linearisation.tangent_map is None) != (self._chunk is not None) or \
                    (linearisation.mean_row is None) == self.center:
                raise ValueError("distlinalg.operators: this linearisation was made at a point with other chunking "
                                 "or centring")
            if self._chunk is None:
                jvp = linearisation.tangent_map
                transpose_of = jax.linear_transpose(jvp, self.theta)
                self._linear = (jvp, lambda w: transpose_of(w)[0])
            self._mean = linearisation.mean_row
        elif linearised:
            if self._chunk is None:
                self._linear = self._linearise(self.samples)
            if self.center:
                self._mean = self._mean_row()

    @property
    def linearisation(self) -> Linearisation:
        """This Jacobian's linearisation as data (see :class:`Linearisation`),
        to restore it in another trace with ``point.linearise(linearisation)``."""
        if not self._linearised:
            raise ValueError("distlinalg.operators: a Jacobian made by point.jacobian() has no linearisation; "
                             "use point.linearise()")
        return Linearisation(tangent_map=None if self._linear is None else self._linear[0],
                             mean_row=self._mean if self.center else None)

    @property
    def params_structure(self) -> Any:
        """The params' structure, a pytree of ``jax.ShapeDtypeStruct``."""
        return self.point.params_structure.tree

    @property
    def theta(self) -> Any:
        return split_complex(self.params) if self.split else self.params

    def _linear_maps(self) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
        return self._linear if self._linear is not None else self._linearise(self.samples)

    @property
    def _jvp(self) -> Callable[[Any], Any]:
        return self._linear_maps()[0]

    @property
    def _transpose(self) -> Callable[[Any], Any]:
        return self._linear_maps()[1]

    @property
    def mean_row(self) -> Any:
        """μ = 1ᵀ O / N (k rows shaped like θ̃), zeros when not centring."""
        if not self.center:
            return tree_map(lambda a: jnp.zeros((self.channels, *a.shape), a.dtype), self.theta)
        return self._mean if self._mean is not None else self._mean_row()

    # -- the model in the space of the mode ----------------------------------------
    def to_space(self, v: Any) -> Any:
        """A vector shaped like params ↦ the same vector in θ̃."""
        return split_complex(v) if self.split else v

    def from_space(self, u: Any) -> Any:
        return join_complex(u) if self.split else u

    def _linearise(self, samples: Any) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
        """u ↦ O u on these samples (n, k) and its transpose w ↦ Oᵀ w."""
        _, jvp = jax.linearize(lambda t: self.outputs(t, samples), self.theta)
        transpose_of = jax.linear_transpose(jvp, self.theta)
        return jvp, lambda w: transpose_of(w)[0]

    def _ones_cotangents(self, mask: jax.Array | None, n: int) -> jax.Array:
        """(k, n, k): cotangent c seeds channel c of every (unmasked) sample."""
        eye = jnp.eye(self.channels, dtype=self.dtype)
        ones = jnp.ones((n,), self.dtype) if mask is None else mask.astype(self.dtype)
        return eye[:, None, :] * ones[None, :, None]

    def _mean_row(self) -> Any:
        """μ = 1ᵀ O / N over every rank's samples, k rows shaped like θ̃."""
        if self._chunk is None:
            local = jax.vmap(self._transpose)(self._ones_cotangents(None, self.n_local))
        else:
            def step(acc: Any, item: Any) -> Any:
                x, mask = item
                _, transpose = self._linearise(x)
                return tree_map(jnp.add, acc, jax.vmap(transpose)(self._ones_cotangents(mask, self._chunk))), None

            zero = tree_map(lambda a: jnp.zeros((self.channels, *a.shape), a.dtype), self.theta)
            local, _ = jax.lax.scan(step, zero, (self._batches, self._masks))
        return tree_map(lambda m: m / self.n_total, self._sum_over_ranks(local))

    def _sum_over_ranks(self, tree: Any) -> Any:
        """Σ over ranks of per-rank parameter-space pieces (replicated params);
        with sharded params the model's collectives have summed already."""
        return tree if self.sharded_params else tree_allreduce(tree, comm=self.comm)

    # -- Ō u and Ōᵀ w --------------------------------------------------------------
    def mean_dot(self, u: Any) -> jax.Array:
        """μ u per channel (k,), a global sum over parameter blocks when sharded."""
        local = channel_dot(self.mean_row, u)
        if self.sharded_params and self.comm.size > 1:
            return allreduce(local, "sum", comm=self.comm)
        return local

    def jvp(self, u: Any) -> jax.Array:
        """This rank's rows of Ō u, shape (n_local, k); u in θ̃."""
        if self._chunk is None:
            y = self._jvp(u)
        else:
            def step(_: Any, x: Any) -> Any:
                jvp, _t = self._linearise(x)
                return None, jvp(u)

            _, chunks = jax.lax.scan(step, None, self._batches)
            y = chunks.reshape(-1, self.channels)[: self.n_local]
        if self.center:
            y = y - self.mean_dot(u)[None, :]
        return y

    def vjp(self, w: jax.Array, *, centred_input: bool = False) -> Any:
        """Ōᵀ w = Oᵀ w − μᵀ (1ᵀ w) summed over every rank's samples; w (n_local, k).

        ``centred_input``: w sums to zero over all samples (w = Ō u), so the
        μ term vanishes and is skipped.
        """
        if self._chunk is None:
            local = self._transpose(w)
        else:
            padded = jnp.zeros((self._n_chunks * self._chunk, self.channels), w.dtype).at[: self.n_local].set(w)

            def step(acc: Any, item: Any) -> Any:
                x, wc = item
                _, transpose = self._linearise(x)
                return tree_map(jnp.add, acc, transpose(wc)), None

            local, _ = jax.lax.scan(step, tree_map(jnp.zeros_like, self.theta),
                                    (self._batches, padded.reshape(self._n_chunks, self._chunk, self.channels)))
        if not (self.center and not centred_input):
            return self._sum_over_ranks(local)
        if self.sharded_params:
            column_sums = jnp.sum(w, axis=0)
            if self.comm.size > 1:
                column_sums = allreduce(column_sums, "sum", comm=self.comm)
            return tree_map(lambda o, m: o - jnp.tensordot(column_sums, m, axes=1), local, self.mean_row)
        # Replicated: μ is the same on every rank, so the per-rank terms sum
        # to the global one inside the same allreduce.
        column_sums = jnp.sum(w, axis=0)
        return self._sum_over_ranks(tree_map(lambda o, m: o - jnp.tensordot(column_sums, m, axes=1), local, self.mean_row))

    def adjoint(self, w: jax.Array, *, centred_input: bool = False) -> Any:
        """Ōᴴ w (global sum over samples): conjugates only in "holomorphic" mode."""
        if self.mode == "holomorphic":
            return tree_map(jnp.conj, self.vjp(jnp.conj(w), centred_input=centred_input))
        return self.vjp(w, centred_input=centred_input)

    # -- explicit rows -----------------------------------------------------------
    def local_rows(self) -> jax.Array:
        """This rank's rows of Ō as a dense (n_local·k, n) matrix (flattened θ̃).

        For a model that does not communicate: each sample's k rows are the
        VJPs of the model on that sample alone (vmapped over the samples, in
        chunks of ``chunk_size``), so memory is the rows plus one chunk's
        intermediates.
        """
        if self.communicates:
            raise NotImplementedError("local_rows needs a model that does not communicate")
        n_flat = flat_size(self.theta)
        eye = jnp.eye(self.channels, dtype=self.dtype)

        def rows_of_sample(x: Any) -> jax.Array:
            _, transpose = self._linearise(tree_map(lambda a: a[None], x))
            return jax.vmap(lambda e: ravel_pytree(transpose(e[None]))[0])(eye)  # (k, n)

        if self._chunk is None:
            rows = jax.vmap(rows_of_sample)(self.samples)
        else:
            rows = jax.lax.map(jax.vmap(rows_of_sample), self._batches)
            rows = rows.reshape(-1, self.channels, n_flat)[: self.n_local]
        if self.center:
            if self._mean is None and not self.sharded_params:
                # The rows are here: their sum over every rank's samples (one
                # allreduce) is the mean row, without a pass of transposes.
                mean = self._sum_over_ranks(jnp.sum(rows, axis=0)) / self.n_total
            else:
                mean = jax.vmap(lambda m: ravel_pytree(m)[0])(self.mean_row)
            rows = rows - mean[None]
        return rows.reshape(self.n_local * self.channels, n_flat)

    def squared_row_sums(self) -> Any:
        """diag(ŌᴴŌ) = Σ_i Σ_c |Ō_ic|² over every rank's samples, shaped like θ̃."""
        theta = self.theta
        # Here, before any loop: the mean row is collective (ranks may run
        # different numbers of chunks), and one is enough.
        mean_row = self.mean_row
        if not self.communicates:
            def squares(x: Any, mask: jax.Array | None) -> Any:
                def rows_of(one: Any) -> Any:
                    one = tree_map(lambda a: a[None], one)
                    _, transpose = self._linearise(one)
                    return jax.vmap(lambda e: transpose(e[None]))(jnp.eye(self.channels, dtype=self.dtype))

                rows = jax.vmap(rows_of)(x)  # (b, k, *leaf)

                def square(r: Any, m: Any) -> Any:
                    s = jnp.abs(r - m[None]) ** 2
                    if mask is not None:
                        s = s * mask.reshape(-1, *([1] * (s.ndim - 1))).astype(s.dtype)
                    return jnp.sum(s, axis=(0, 1))

                return tree_map(square, rows, mean_row)

            if self._chunk is None:
                local = squares(self.samples, None)
            else:
                def step(acc: Any, item: Any) -> Any:
                    return tree_map(jnp.add, acc, squares(*item)), None

                zero = tree_map(lambda a: jnp.zeros(a.shape, jnp.real(a).dtype), theta)
                local, _ = jax.lax.scan(step, zero, (self._batches, self._masks))
            return self._sum_over_ranks(local)
        # A communicating model mixes ranks in its transpose: rank q's sample
        # i alone is seeded in turn, so every rank gets its block of the row
        # (q, i): P rounds of max n_r seeds each.
        transpose = self._linearise(self.samples)[1] if self._chunk is not None else self._transpose
        longest = int(self.counts.max())
        total = tree_map(lambda a: jnp.zeros(a.shape, jnp.real(a).dtype), theta)
        seeds = jnp.eye(max(longest, 1), self.n_local, dtype=self.dtype)
        for q in range(self.comm.size):
            active = jnp.asarray(self.comm.rank == q, self.dtype)
            for c in range(self.channels):
                def row(seed: jax.Array, c: int = c) -> Any:
                    return transpose(jnp.zeros((self.n_local, self.channels), self.dtype).at[:, c].set(seed * active))

                rows = self._sum_over_ranks(jax.vmap(row)(seeds[: self.counts[q]]))
                mean_c = tree_map(lambda m: m[c], mean_row)
                total = tree_map(lambda acc, r, m: acc + jnp.sum(jnp.abs(r - m[None]) ** 2, axis=0), total, rows, mean_c)
        return total


class ParameterSpace:
    """What the operators on their point's parameters share (the Gram operator
    S, the Hessian, the Gauss–Newton operator): input and output shaped like
    the point's parameters, in their layout (sharded when the parameters are
    rank-local blocks, else replicated). A mixin ahead of the operator base:
    the point (a :class:`ModelPoint` or a ``LossPoint``) is the operator's child."""

    point: Any

    @property
    def in_structure(self) -> Structure:
        return self.point.params_structure

    @property
    def out_structure(self) -> Structure:
        return self.point.params_structure

    @property
    def layout(self) -> str:
        return "sharded" if self.point.sharded_params else "replicated"


@operator_class
class ModelOperator(LinearOperator):
    """What the Gram operators share: their child :class:`ModelPoint`, its
    communicator, and symmetry (Hermitian; real symmetric outside "holomorphic" mode)."""

    point: ModelPoint

    hermitian = True

    @property
    def model(self) -> ModelPoint:
        """The point (earlier versions' name)."""
        return self.point

    @property
    def params(self) -> Any:
        """The parameters the model is expanded at (or their cotangent)."""
        return self.point.params

    @property
    def samples(self) -> Any:
        """This rank's samples (or their cotangent)."""
        return self.point.samples

    @property
    def comm(self) -> Communicator:
        return self.point.comm

    @property
    def symmetric(self) -> bool:
        return self.point.mode != "holomorphic"
