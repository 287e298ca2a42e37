"""The Jacobian Gram operator (quantum geometric tensor, Fisher matrix) of a
model evaluated on samples sharded across ranks.

With per-sample outputs f_k(θ) on all N samples of all ranks and their
Jacobian J (N × n_params), the operator is

    S v = (1/N) J_cᴴ J_c v + λ v + ε diag(S) v,    J_c = J − 1 μᵀ,  μ = Jᵀ 1 / N,

(λ = diag_shift, ε = diag_scale, centering optional). Matrix-free: J v is a
JVP and Jᴴ w a VJP of the model linearized once at construction. Centering
costs nothing per matvec: J_cᴴ J_c v = Jᴴ (J v − 1 μᵀv) because the centred
vector sums to zero over all samples. With replicated parameters every rank
holds its own samples' contribution to Jᴴ w, so a matvec is one allreduce of
a parameter-sized vector. With sharded parameters (f communicates inside)
the VJP through f's collectives already sums over every rank's samples.

Modes, for complex models log ψ (as in NetKet):
  "real": real θ, S = Re(J_cᴴ J_c)/N: the outputs' real and imaginary parts
    are two real channels;
  "holomorphic": complex θ and holomorphic f: the complex S above;
  "complex": complex θ, any f: θ = θ_r + iθ_i as 2·n real parameters with
    the "real" S; the operator is then only real-linear on complex vectors
    (``real_linear``), which the solvers handle by working on (Re, Im) pairs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._mpi import Communicator, resolve_comm
from ..comm import _core
from ..comm.allreduce import allreduce
from ._base import LinearOperator, sum_over_ranks as _fused_sum
from ._partition import exchange_sizes

MODES = ("real", "holomorphic", "complex")
_NAME = "distlinalg.operators.gram"


# -- pytree algebra -----------------------------------------------------------
def _map(fn: Callable[..., Any], *trees: Any) -> Any:
    return jax.tree_util.tree_map(fn, *trees)


def _leaves(tree: Any) -> list[Any]:
    return jax.tree_util.tree_leaves(tree)


def _channel_dot(channels: Any, v: Any) -> jax.Array:
    """(k,) bilinear products Σ μ_c · v (no conjugate) of each channel c of `channels`."""
    parts = [jnp.sum((m * v[None]).reshape(m.shape[0], -1), axis=1) for m, v in zip(_leaves(channels), _leaves(v))]
    return sum(parts[1:], parts[0])


def _is_complex_tree(tree: Any) -> bool:
    return any(jnp.iscomplexobj(x) for x in _leaves(tree))


# -- the model in its parameter space ------------------------------------------
class _Space:
    """Where the operator computes: θ (real, or complex for "holomorphic") and
    the map g(θ, x) -> (n, k) outputs with k real or complex channels."""

    def __init__(self, f: Callable[..., Any], params: Any, mode: str):
        self.mode = mode
        if mode == "complex":
            self.theta = (_map(jnp.real, params), _map(jnp.imag, params))

            def model(theta: Any, x: Any) -> Any:
                return f(_map(lambda r, i: r + 1j * i, *theta), x)

        else:
            self.theta = params
            model = f
        self._model = model

    def outputs(self, theta: Any, x: Any) -> jax.Array:
        y = self._model(theta, x)
        if self.mode == "holomorphic":
            return y[:, None]
        if jnp.iscomplexobj(y):
            return jnp.stack([jnp.real(y), jnp.imag(y)], axis=1)
        return y[:, None]

    def to_space(self, v: Any) -> Any:
        return (_map(jnp.real, v), _map(jnp.imag, v)) if self.mode == "complex" else v

    def from_space(self, u: Any) -> Any:
        return _map(lambda r, i: r + 1j * i, *u) if self.mode == "complex" else u


def _check_inputs(f: Callable[..., Any], params: Any, samples: Any, mode: str) -> tuple[int, bool, bool]:
    """Validate at trace time; returns (local sample count, whether f
    communicates, whether its outputs are complex)."""
    if mode not in MODES:
        raise ValueError(f"{_NAME}: mode must be one of {MODES}, got {mode!r}")
    leaves = _leaves(samples)
    if not leaves or any(jnp.ndim(x) == 0 for x in leaves):
        raise ValueError(f"{_NAME}: samples must be arrays (or a pytree of arrays) with a leading sample axis")
    counts = {jnp.shape(x)[0] for x in leaves}
    if len(counts) != 1:
        raise ValueError(f"{_NAME}: every leaf of samples needs the same leading (sample) dimension, got {sorted(counts)}")
    (n_local,) = counts
    param_leaves = _leaves(params)
    if not param_leaves:
        raise ValueError(f"{_NAME}: params is empty")
    if any(not jnp.issubdtype(jnp.result_type(x), jnp.inexact) for x in param_leaves):
        raise TypeError(f"{_NAME}: params must be floating or complex arrays")
    complex_params = [jnp.iscomplexobj(x) for x in param_leaves]
    if mode == "real" and any(complex_params):
        raise TypeError(f"{_NAME}: mode='real' needs real parameters; use mode='holomorphic' for a holomorphic "
                        "model of complex parameters, or mode='complex' for any model of complex parameters")
    if mode in ("holomorphic", "complex") and not all(complex_params):
        raise TypeError(f"{_NAME}: mode={mode!r} needs complex parameters (every leaf); use mode='real' for real ones")
    closed = jax.make_jaxpr(f)(params, samples)
    out = closed.out_avals
    if len(out) != 1 or out[0].shape != (n_local,):
        shapes = [tuple(a.shape) for a in out]
        raise ValueError(f"{_NAME}: f(params, samples) must return one value per local sample, shape ({n_local},); "
                         f"got {shapes[0] if len(shapes) == 1 else shapes}")
    if mode == "holomorphic" and not jnp.issubdtype(out[0].dtype, jnp.complexfloating):
        raise TypeError(f"{_NAME}: mode='holomorphic' needs a complex-valued model")
    communicates = any(isinstance(e, _core.MPIEffect) for e in closed.effects)
    return int(n_local), communicates, bool(jnp.issubdtype(out[0].dtype, jnp.complexfloating))


def _pad_samples(samples: Any, total: int) -> Any:
    """Pad the sample axis to `total` by repeating sample 0 (masked out later)."""

    def pad(x: Any) -> Any:
        extra = total - x.shape[0]
        if extra == 0:
            return x
        filler = jnp.broadcast_to(x[:1], (extra, *x.shape[1:])) if x.shape[0] else jnp.zeros((extra, *x.shape[1:]), x.dtype)
        return jnp.concatenate([x, filler])

    return _map(pad, samples)


def _chunked(samples: Any, chunk: int, n_chunks: int) -> Any:
    return _map(lambda x: x.reshape(n_chunks, chunk, *x.shape[1:]), _pad_samples(samples, chunk * n_chunks))


class GramOperator(LinearOperator):
    """S = J_cᴴ J_c / N + diag_shift·I + diag_scale·diag(S); see :func:`gram`."""


def gram(
    f: Callable[[Any, Any], Any],
    params: Any,
    samples: Any,
    *,
    center: bool = True,
    diag_shift: Any = 0.0,
    diag_scale: Any = None,
    mode: str = "real",
    chunk_size: int | None = None,
    comm: Any = None,
    sharded_params: bool = False,
    equal_samples: bool = False,
) -> GramOperator:
    """The Jacobian Gram operator (QGT / Fisher / SR matrix) of a sharded model.

    Args:
      f: ``f(params, samples) -> (n_r,)``: one output per local sample (e.g.
        log ψ(σ_k)), real or complex. With replicated params it must not
        communicate in a way that mixes samples; with sharded params it
        computes with its parameter block and distlinalg collectives.
      params: pytree of floating/complex arrays: replicated (identical on
        every rank) or, with ``sharded_params=True``, this rank's block.
      samples: pytree of arrays with a leading axis of this rank's n_r
        samples; counts may differ between ranks (N = Σ n_r).
      center: subtract the mean Jacobian row over all N samples.
      diag_shift: λ (may be traced; the operator is differentiable in it).
      diag_scale: ε, adds ε·diag(S) (Becca–Sorella regularisation); the
        diagonal costs a per-sample Jacobian pass and one allreduce, once.
      mode: "real", "holomorphic" or "complex" (see the module docstring).
      chunk_size: evaluate the model on at most this many local samples at
        a time. Bounds memory; the model is then re-linearized per chunk in
        every matvec (without chunks it is linearized once, here).
      comm: communicator (default distlinalg's).
      sharded_params: params are this rank's block; the operator's layout is
        "sharded" (vectors are parameter blocks).
      equal_samples: declare every rank's sample count equal: a mismatch is
        a ValueError on every rank.

    Returns:
      A LinearOperator on pytrees shaped like params ("replicated" or
      "sharded" layout), Hermitian (real symmetric in "real" mode,
      real-linear in "complex" mode), with ``diagonal()`` (of S + shifts;
      in "complex" mode the real and imaginary parts' diagonals packed as
      d_r + i·d_i) and ``to_dense()``. One allreduce of a parameter-sized
      vector per matvec (replicated); with sharded params plus one k-vector
      allreduce (k ≤ 2) for the centering.

    AD: the matvec is differentiable with respect to params, samples and the
    shifts (built inside the traced function), so ``jax.grad`` through
    ``distlinalg.cg(gram(...), F)`` gives exact meta-gradients.
    """
    comm = resolve_comm(comm)
    n_local, communicates, complex_outputs = _check_inputs(f, params, samples, mode)
    counts = exchange_sizes(n_local, comm)
    n_total = int(counts.sum())
    if equal_samples and np.any(counts != counts[0]):
        raise ValueError(f"{_NAME}: equal_samples=True but the ranks hold {counts.tolist()} samples")
    if n_total == 0:
        raise ValueError(f"{_NAME}: no samples on any rank")
    space = _Space(f, params, mode)
    theta = space.theta
    replicated = not sharded_params

    def sum_over_ranks(tree: Any) -> Any:
        return _fused_sum(tree, comm) if replicated else tree

    def adjoint(transpose: Callable[[Any], Any], w: jax.Array) -> Any:
        """Jᴴ w from the unconjugated transpose Jᵀ (conjugates cancel for real θ)."""
        if mode == "holomorphic":
            return _map(jnp.conj, transpose(jnp.conj(w)))
        return transpose(w)

    # Ranks must make the same collective calls: a model that communicates
    # runs the same number of equally sized chunks everywhere.
    if chunk_size is not None:
        if int(chunk_size) < 1:
            raise ValueError(f"{_NAME}: chunk_size must be a positive int, got {chunk_size!r}")
        chunk = int(chunk_size)
        longest = int(counts.max()) if communicates else n_local
        n_chunks = max(1, -(-longest // chunk))
    # Output channels: the complex output itself (holomorphic), or its real
    # and imaginary parts as two real outputs per sample.
    channels = 2 if complex_outputs and mode != "holomorphic" else 1
    out_dtype = jax.eval_shape(space.outputs, theta, samples).dtype

    # -- linearization and the mean Jacobian row μ -------------------------
    def channel_cotangents(n: int, mask: Any = None) -> jax.Array:
        """(k, n, k) one-hot channel cotangents (masked rows zero)."""
        eye = jnp.eye(channels, dtype=out_dtype)
        ones = jnp.ones((n,), out_dtype) if mask is None else mask.astype(out_dtype)
        return eye[:, None, :] * ones[None, :, None]

    if chunk_size is None:
        _, jvp = jax.linearize(lambda t: space.outputs(t, samples), theta)
        transpose_of = jax.linear_transpose(jvp, theta)
        transpose = lambda w: transpose_of(w)[0]  # noqa: E731
        if center:
            mu_local = jax.vmap(transpose)(channel_cotangents(n_local))
    else:
        batches = _chunked(samples, chunk, n_chunks)
        masks = (jnp.arange(n_chunks * chunk) < n_local).reshape(n_chunks, chunk)

        def chunk_transpose(x: Any) -> Callable[[Any], Any]:
            _, jvp_c = jax.linearize(lambda t: space.outputs(t, x), theta)
            return jvp_c, jax.linear_transpose(jvp_c, theta)

        if center:

            def mu_step(acc: Any, item: Any) -> Any:
                x, mask = item
                _, t_c = chunk_transpose(x)
                part = jax.vmap(lambda w: t_c(w)[0])(channel_cotangents(chunk, mask))
                return _map(jnp.add, acc, part), None

            zero = _map(lambda a: jnp.zeros((channels, *a.shape), a.dtype), theta)
            mu_local, _ = jax.lax.scan(mu_step, zero, (batches, masks))
    if center:
        mu = _map(lambda m: m / n_total, sum_over_ranks(mu_local))

    def mean_part(v: Any) -> jax.Array:
        """μᵀ v per channel (a global sum when the parameters are sharded)."""
        local = _channel_dot(mu, v)
        return allreduce(local, "sum", comm=comm) if sharded_params and comm.size > 1 else local

    # -- S v without the shifts ------------------------------------------------
    def gram_product(v: Any) -> Any:
        offset = mean_part(v) if center else None
        if chunk_size is None:
            w = jvp(v)
            if center:
                w = w - offset[None, :]
            local = adjoint(transpose, w)
        else:

            def step(acc: Any, item: Any) -> Any:
                x, mask = item
                jvp_c, t_c = chunk_transpose(x)
                w = jvp_c(v)
                if center:
                    w = w - offset[None, :]
                w = w * mask[:, None].astype(w.dtype)
                part = adjoint(lambda c: t_c(c)[0], w)
                return _map(jnp.add, acc, part), None

            local, _ = jax.lax.scan(step, _map(jnp.zeros_like, v), (batches, masks))
        return _map(lambda u: u / n_total, sum_over_ranks(local))

    # -- diag(J_cᴴ J_c)/N ---------------------------------------------------------
    def gram_diagonal() -> Any:
        center_rows = mu if center else _map(lambda a: jnp.zeros((channels, *a.shape), a.dtype), theta)

        def squares(rows: Any) -> Any:
            """Σ over a batch of Jacobian rows (b, k, *leaf) of |row − μ|²."""
            return _map(lambda r, m: jnp.sum(jnp.abs(r - m[None]) ** 2, axis=(0, 1)), rows, center_rows)

        if not communicates:
            # Per-sample Jacobians: the rows of this rank's samples.
            def rows_of(x: Any) -> Any:
                one = _map(lambda a: a[None], x)
                _, jvp_1 = jax.linearize(lambda t: space.outputs(t, one), theta)
                t_1 = jax.linear_transpose(jvp_1, theta)
                return jax.vmap(lambda e: t_1(e[None])[0])(jnp.eye(channels, dtype=out_dtype))

            if chunk_size is None:
                local = squares(jax.vmap(rows_of)(samples))
            else:

                def step(acc: Any, item: Any) -> Any:
                    x, mask = item
                    rows = jax.vmap(rows_of)(x)
                    rows = _map(lambda r, m: jnp.where(mask.reshape(-1, *([1] * (r.ndim - 1))), r, m[None]),
                                rows, center_rows)
                    return _map(jnp.add, acc, squares(rows)), None

                zero = _map(lambda a: jnp.zeros(a.shape, jnp.real(a).dtype), theta)
                local, _ = jax.lax.scan(step, zero, (batches, masks))
            return _map(lambda d: d / n_total, sum_over_ranks(local))
        # A communicating model mixes ranks in its transpose: rank q's sample
        # k alone is seeded in turn, so every rank gets its block of that
        # sample's row (q, k) -- P rounds of max n_r seeds each.
        longest = int(counts.max())
        full_transpose = transpose if chunk_size is None else None
        if full_transpose is None:
            _, jvp_full = jax.linearize(lambda t: space.outputs(t, samples), theta)
            t_full = jax.linear_transpose(jvp_full, theta)
            full_transpose = lambda w: t_full(w)[0]  # noqa: E731
        total = _map(lambda a: jnp.zeros(a.shape, jnp.real(a).dtype), theta)
        seeds = jnp.eye(max(longest, 1), n_local, dtype=out_dtype)  # row k seeds local sample k
        for q in range(comm.size):
            active = jnp.asarray(comm.rank == q, out_dtype)
            for c in range(channels):
                def row(seed: jax.Array, c: int = c) -> Any:
                    cot = jnp.zeros((n_local, channels), out_dtype).at[:, c].set(seed * active)
                    return full_transpose(cot)

                # Replicated: the row is the sum of every rank's copy's part.
                rows = sum_over_ranks(jax.vmap(row)(seeds[: counts[q]]))
                mu_c = _map(lambda m: m[c], center_rows)
                total = _map(lambda acc, r, m: acc + jnp.sum(jnp.abs(r - m[None]) ** 2, axis=0), total, rows, mu_c)
        return _map(lambda d: d / n_total, total)

    scale_diagonal = None
    if diag_scale is not None:
        scale_diagonal = gram_diagonal()

    def matvec(v: Any) -> Any:
        u = space.to_space(v)
        out = gram_product(u)
        out = _map(lambda o, x: o + diag_shift * x, out, u)
        if scale_diagonal is not None:
            out = _map(lambda o, d, x: o + diag_scale * d * x, out, scale_diagonal, u)
        return space.from_space(out)

    def diagonal() -> Any:
        d = scale_diagonal if scale_diagonal is not None else gram_diagonal()
        factor = 1 + (0 if diag_scale is None else diag_scale)
        d = _map(lambda x: factor * x + diag_shift, d)
        return space.from_space(d)

    return GramOperator(
        matvec,
        input_structure=params,
        layout="sharded" if sharded_params else "replicated",
        symmetric=mode != "holomorphic",
        hermitian=True,
        real_linear=mode == "complex",
        diagonal=diagonal,
        comm=comm,
        name="GramOperator",
    )
