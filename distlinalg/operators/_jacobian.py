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

The model is a pytree (children: params and this rank's samples; static:
f, the mode, every rank's sample count, the structures), and so are the
operators built on it (:class:`LinearisedOperator`): their linearisation is
derived from the children once per trace (:class:`TraceLocal`), never
stored as static data, and rebuilding them from their children computes
and communicates nothing.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree


from .. import _compat
from .._mpi import Communicator
from ..comm import _core
from ..comm.allreduce import allreduce
from ..comm.fused import tree_allreduce
from ._base import LinearOperator
from ._pairs import join_complex, split_complex
from ._partition import exchange_sizes

MODES = ("real", "complex", "holomorphic")


# -- pytree algebra ------------------------------------------------------------
def tree_map(fn: Callable[..., Any], *trees: Any) -> Any:
    return jax.tree_util.tree_map(fn, *trees)


def leaves(tree: Any) -> list[Any]:
    return jax.tree_util.tree_leaves(tree)


def channel_dot(rows: Any, v: Any) -> jax.Array:
    """(k,) products Σ_j rows[c, j] v_j (no conjugate) of k rows shaped like v."""
    parts = [jnp.sum((m * x[None]).reshape(m.shape[0], -1), axis=1) for m, x in zip(leaves(rows), leaves(v))]
    return sum(parts[1:], parts[0])


def _is_complex(tree: Any) -> bool:
    return any(jnp.iscomplexobj(x) for x in leaves(tree))


# -- validation ------------------------------------------------------------------
def default_mode(f: Callable[..., Any], params: Any, samples: Any) -> str:
    """NetKet's default: "complex" when f's output is complex, else "real"."""
    out = jax.eval_shape(f, params, samples)
    return "complex" if jnp.issubdtype(out.dtype, jnp.complexfloating) else "real"


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


# -- values derived from pytree children, kept per trace ------------------------------
class TraceLocal:
    """Values computed from an object's pytree children (a linearisation, a
    mean row), each kept with the trace it was computed in.

    Why per trace: an operator passed to a jitted function is rebuilt from
    traced children, and its linearisation must be computed in that trace,
    not stored as static data. Once computed, the traces nested in that one
    (the loops of a Krylov solver, lax.custom_linear_solve's matvec and
    solve) use it as a closed-over constant, so the model is evaluated once
    per program rather than once per iteration. A value computed eagerly is
    concrete and valid everywhere; one computed in a trace that is not an
    enclosing trace of the current one (an earlier jit, a sibling branch) is
    computed again. The value is a function of the children only, and the
    children of an object never change (tree_map and unflatten make new
    objects, with empty caches), so every copy is the same value.
    """

    __slots__ = ("_values",)

    def __init__(self) -> None:
        self._values: dict[str, tuple[Any, Any]] = {}

    def get(self, name: str, compute: Callable[[], Any]) -> Any:
        held = self._values.get(name)
        if held is not None:
            trace_ref, value = held
            if trace_ref is None or _compat.trace_reaches(trace_ref()):
                return value
        trace = _compat.current_trace()
        value = compute()
        self._values[name] = (None if _compat.is_eager_trace(trace) else weakref.ref(trace), value)
        return value


def tracing() -> bool:
    """Whether JAX is tracing (jit, grad, vmap, a loop body…) rather than running eagerly."""
    return not _compat.is_eager_trace(_compat.current_trace())


class LinearisedOperator(LinearOperator):
    """A LinearOperator whose matvec uses a linearisation of its children.

    The children are the whole of ``data`` (``matvec(data, v)``); the aux data
    is what :meth:`_static` returns (None by default), which must compare by
    value, and unflattening is :meth:`_rebuild`, which must neither compute
    on the children nor communicate. Subclasses say in :meth:`prepare` what
    to derive from the children (kept per trace, see :class:`TraceLocal`).
    """

    def prepare(self) -> None:
        """Compute what the matvec derives from the children in the current
        trace, unless done there or in an enclosing trace."""

    @property
    def matvec(self) -> Callable[[Any], Any]:
        """v ↦ A v (a function). Reading it inside a trace prepares the
        linearisation there first: a solver reads ``A.matvec`` before its
        loops, so the loops (and the solves of the derivatives, which reuse
        the matvec's program) close over one linearisation instead of
        redoing it in each iteration. Eagerly nothing is computed until the
        first product (which may communicate: every rank applies the
        operator together)."""
        if tracing():
            self.prepare()
        return self._apply

    def _apply(self, v: Any) -> Any:
        return self._matvec(self._data, v)

    def _static(self) -> Any:
        return None

    @classmethod
    def _rebuild(cls, static: Any, data: Any) -> "LinearisedOperator":
        return cls(*data)

    def _tree_flatten(self) -> tuple[tuple[Any, ...], Any]:
        return (self._data,), self._static()

    @classmethod
    def _tree_unflatten(cls, static: Any, children: tuple[Any, ...]) -> "LinearisedOperator":
        return cls._rebuild(static, children[0])


def hash_of(value: Any) -> int:
    """hash(value), or its id for an unhashable user function (a callable
    object without __hash__): its specs then compare equal only to
    themselves' copies and jit recompiles for another instance, instead of
    failing to hash the tree definition."""
    try:
        return hash(value)
    except TypeError:
        return id(value)


def _structure_of(tree: Any) -> tuple[Any, tuple[tuple[tuple[int, ...], Any], ...]]:
    """A hashable, value-comparable description of a pytree of arrays."""
    flat, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple((tuple(jnp.shape(x)), jnp.dtype(jnp.result_type(x))) for x in flat)


def _shape_structs(structure: tuple[Any, tuple]) -> Any:
    treedef, leaves_ = structure
    return jax.tree_util.tree_unflatten(treedef, [jax.ShapeDtypeStruct(s, d) for s, d in leaves_])


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The static part of a :class:`LinearisedModel` (its pytree aux data).

    Everything here is decided once, at construction (the sample counts by
    one exchange between ranks), and compares by value: two models of the
    same f (the same object), shapes, counts and options have equal specs,
    so jit reuses one compilation for both.
    """

    f: Callable[..., Any]
    mode: str
    center: bool
    chunk: int | None
    n_chunks: int
    comm: Communicator
    sharded_params: bool
    communicates: bool
    n_local: int
    counts: tuple[int, ...]
    split: bool
    channels: int
    dtype: Any
    params: tuple[Any, tuple]  # _structure_of(params)
    samples: tuple[Any, tuple]  # _structure_of(samples)

    def __hash__(self) -> int:
        return hash(tuple(hash_of(getattr(self, field.name)) for field in dataclasses.fields(self)))


class LinearisedModel:
    """f linearised at params on this rank's samples, in the space of `mode`.

    A pytree: the children are ``(params, samples)`` (as given: params
    replicated or this rank's block, samples this rank's); the aux data is a
    :class:`ModelSpec` (f, mode, counts of every rank, structures, options).
    The linearisation (and the mean row) are computed from the children on
    first use in a trace and kept for that trace and the traces nested in it
    (:class:`TraceLocal`); a model built by the constructor is linearised
    there, once. Unflattening computes nothing and never communicates.

    Attributes:
      mode: "real", "complex" or "holomorphic".
      theta: the parameters in the space the Jacobian is taken in (θ, or
        θ̃ = (Re θ, Im θ) for complex parameters in "real"/"complex" mode).
      channels: k, output channels per sample (2 in "complex" mode).
      dtype: dtype of the rows' entries (real, or complex in "holomorphic").
      n_local, counts, n_total: this rank's, every rank's and all samples.
      split: whether θ̃ splits complex parameters into real pairs.
      mean_row: μ, k rows shaped like theta (zeros when not centring).
    """

    def __init__(self, f: Callable[..., Any], params: Any, samples: Any, *, mode: str | None, center: bool,
                 chunk_size: int | None, comm: Communicator, sharded_params: bool, where: str):
        mode, n_local, communicates, complex_output = check_model(f, params, samples, mode, where)
        counts = exchange_sizes(n_local, comm)
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
        spec = ModelSpec(f=f, mode=mode, center=bool(center), chunk=chunk, n_chunks=n_chunks, comm=comm,
                         sharded_params=bool(sharded_params), communicates=communicates, n_local=n_local,
                         counts=tuple(int(c) for c in counts), split=mode != "holomorphic" and _is_complex(params),
                         channels=2 if mode == "complex" else 1, dtype=None,
                         params=_structure_of(params), samples=_structure_of(samples))
        self._assemble(spec, params, samples)
        dtype = jax.eval_shape(self.outputs, self.theta, samples).dtype
        self._assemble(dataclasses.replace(spec, dtype=jnp.dtype(dtype)), params, samples)
        # Linearised here, once: in the trace this is built in (or eagerly),
        # which every use of the model nested in it then shares.
        self.prepare()

    def _assemble(self, spec: ModelSpec, params: Any, samples: Any) -> None:
        self._spec = spec
        self.params, self.samples = params, samples
        self.mode, self.center, self.comm = spec.mode, spec.center, spec.comm
        self.sharded_params, self.communicates = spec.sharded_params, spec.communicates
        self.n_local, self.split, self.channels, self.dtype = spec.n_local, spec.split, spec.channels, spec.dtype
        self.counts = np.asarray(spec.counts, np.int64)
        self.n_total = int(self.counts.sum())
        self._f, self._chunk, self._n_chunks = spec.f, spec.chunk, spec.n_chunks
        self._derived = TraceLocal()

    # -- pytree -----------------------------------------------------------------------
    def _tree_flatten(self) -> tuple[tuple[Any, Any], ModelSpec]:
        return (self.params, self.samples), self._spec

    @classmethod
    def _tree_unflatten(cls, spec: ModelSpec, children: tuple[Any, Any]) -> "LinearisedModel":
        # No validation, no computation, no communication: jax unflattens
        # with tracers, cotangents and placeholder leaves alike.
        model = object.__new__(cls)
        model._assemble(spec, *children)
        return model

    @property
    def params_structure(self) -> Any:
        """The params' structure, a pytree of ``jax.ShapeDtypeStruct`` (static)."""
        return _shape_structs(self._spec.params)

    @property
    def theta(self) -> Any:
        return split_complex(self.params) if self.split else self.params

    # -- what is derived from the children (per trace) ---------------------------------
    def cached(self, name: str, compute: Callable[[], Any]) -> Any:
        """`compute()` (a function of the children), once per trace (see :class:`TraceLocal`)."""
        return self._derived.get(name, compute)

    def prepare(self) -> None:
        """Linearise (and take the mean row) in the current trace, unless already done
        in it or in an enclosing one. Communicates (the mean row) when centring."""
        if self._chunk is None:
            self._linear()
        else:
            self._chunks()
        if self.center:
            _ = self.mean_row

    def _linear(self) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
        return self.cached("linear", lambda: self._linearise(self.samples))

    def _chunks(self) -> tuple[Any, jax.Array]:
        def split_into_chunks() -> tuple[Any, jax.Array]:
            padded = self._chunk * self._n_chunks
            batches = tree_map(lambda x: x.reshape(self._n_chunks, self._chunk, *x.shape[1:]),
                               pad_samples(self.samples, padded))
            masks = (jnp.arange(padded) < self.n_local).reshape(self._n_chunks, self._chunk)
            return batches, masks

        return self.cached("chunks", split_into_chunks)

    @property
    def _jvp(self) -> Callable[[Any], Any]:
        return self._linear()[0]

    @property
    def _transpose(self) -> Callable[[Any], Any]:
        return self._linear()[1]

    @property
    def _batches(self) -> Any:
        return self._chunks()[0]

    @property
    def _masks(self) -> jax.Array:
        return self._chunks()[1]

    @property
    def mean_row(self) -> Any:
        """μ = 1ᵀ O / N (k rows shaped like θ̃), zeros when not centring."""
        if not self.center:
            return tree_map(lambda a: jnp.zeros((self.channels, *a.shape), a.dtype), self.theta)
        return self.cached("mean_row", self._mean_row)

    # -- the model in the space of the mode ----------------------------------------
    def outputs(self, theta: Any, samples: Any) -> jax.Array:
        """(n, k) outputs: Re f ("real"), (Re f, Im f) ("complex"), f ("holomorphic")."""
        y = self._f(join_complex(theta) if self.split else theta, samples)
        if self.mode == "holomorphic":
            return y[:, None]
        if self.mode == "complex":
            return jnp.stack([jnp.real(y), jnp.imag(y)], axis=1)
        return jnp.real(y)[:, None]

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
            rows = rows - jax.vmap(lambda m: ravel_pytree(m)[0])(self.mean_row)[None]
        return rows.reshape(self.n_local * self.channels, n_flat)

    def squared_row_sums(self) -> Any:
        """diag(ŌᴴŌ) = Σ_i Σ_c |Ō_ic|² over every rank's samples, shaped like θ̃."""
        theta = self.theta
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

                return tree_map(square, rows, self.mean_row)

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
                mean_c = tree_map(lambda m: m[c], self.mean_row)
                total = tree_map(lambda acc, r, m: acc + jnp.sum(jnp.abs(r - m[None]) ** 2, axis=0), total, rows, mean_c)
        return total


jax.tree_util.register_pytree_node(LinearisedModel, LinearisedModel._tree_flatten, LinearisedModel._tree_unflatten)


def flat_size(tree: Any) -> int:
    return int(sum(np.prod(jnp.shape(x), dtype=np.int64) for x in leaves(tree)))


class ModelOperator(LinearisedOperator):
    """A LinearisedOperator whose children are ``(model, diag_shift, ...)``: the
    Gram matrices in parameter space and in sample space."""

    @property
    def model(self) -> LinearisedModel:
        return self._data[0]

    @property
    def params(self) -> Any:
        """The parameters the model is linearised at (or their cotangent)."""
        return self.model.params

    @property
    def samples(self) -> Any:
        """This rank's samples (or their cotangent)."""
        return self.model.samples

    @property
    def diag_shift(self) -> Any:
        return self._data[1]
