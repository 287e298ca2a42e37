"""Restricted Boltzmann machine wave functions, replicated or hidden-sharded.

    log ψ(σ) = Σ_i a_i σ_i + Σ_j log cosh(b_j + Σ_i W_ji σ_i)

Parameters are a dict {"a": (L,), "b": (M,), "W": (M, L)}, M = α·L hidden
units, float64 (real RBM) or complex128 (complex RBM, holomorphic in its
parameters). ``log_psi(params, x)`` maps configurations x of shape (n, L)
to (n,) values; it is pure JAX (jit/grad/vmap).

``ShardedRBM`` splits the parameters across ranks: rank r owns a block of
hidden units (rows of W and b) and a block of visible sites (entries of a).
Its ``log_psi`` communicates (allgather + reduce_scatter), so it is a
collective: every rank calls it together with the same n.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from distlinalg.comm import communicator
from distlinalg.comm import allgather, reduce_scatter

Params = dict[str, jax.Array]


def log_cosh(z: jax.Array) -> jax.Array:
    """log cosh z without overflow, real or complex.

    cosh is even, so flip z to Re z ≥ 0 first; then
    log cosh z = z + log1p(exp(−2z)) − log 2 and |exp(−2z)| ≤ 1. The
    flip is piecewise constant, so the function stays holomorphic away
    from Re z = 0 and its derivative is tanh z everywhere.
    """
    sign = jnp.where(jnp.real(z) < 0, -1.0, 1.0).astype(z.dtype)
    w = sign * z
    return w + jnp.log1p(jnp.exp(-2.0 * w)) - jnp.log(2.0).astype(z.dtype)


def _rbm_terms(a: jax.Array, b: jax.Array, W: jax.Array, x_visible: jax.Array, x: jax.Array) -> jax.Array:
    """Σ a·x_visible + Σ log cosh(W x + b) per row: the contribution of one
    block of visible sites (x_visible are those columns of x) and hidden units."""
    x = x.astype(W.dtype)
    theta = x @ W.T + b
    return x_visible.astype(a.dtype) @ a + jnp.sum(log_cosh(theta), axis=-1)


def init_params(key: jax.Array, L: int, alpha: int, dtype: Any = jnp.float64, scale: float = 0.01) -> Params:
    """Full RBM parameters, normal with std `scale` (real and imaginary
    parts each, for complex dtypes). Deterministic in `key`, so every rank
    draws the same replicated parameters."""
    M = alpha * L
    shapes = {"a": (L,), "b": (M,), "W": (M, L)}
    keys = dict(zip(shapes, jax.random.split(key, len(shapes))))
    out = {}
    for name, shape in shapes.items():
        if jnp.issubdtype(dtype, jnp.complexfloating):
            kr, ki = jax.random.split(keys[name])
            out[name] = (scale * (jax.random.normal(kr, shape) + 1j * jax.random.normal(ki, shape))).astype(dtype)
        else:
            out[name] = (scale * jax.random.normal(keys[name], shape)).astype(dtype)
    return out


@dataclass(frozen=True)
class RBM:
    """Replicated RBM: every rank holds all parameters."""

    L: int
    alpha: int = 1
    dtype: Any = jnp.float64

    sharded = False

    def init(self, key: jax.Array) -> Params:
        return init_params(key, self.L, self.alpha, self.dtype)

    def log_psi(self, params: Params, x: jax.Array) -> jax.Array:
        """(n, L) -> (n,); no communication."""
        return _rbm_terms(params["a"], params["b"], params["W"], x, x)


@dataclass(frozen=True, eq=False)
class ShardedRBM:
    """RBM whose parameters are split across the ranks of `comm`.

    Rank r owns hidden units ``hidden_slice(r)`` (rows of W, entries of b)
    and visible biases ``visible_slice(r)`` (np.array_split blocks, so any
    rank count ≤ min(L, M) works). To evaluate log ψ on its own n samples a
    rank needs every rank's hidden units: the samples are allgathered
    ((P, n, L)), each rank adds its block's contribution for all P·n
    samples, and a sum reduce_scatter returns to every rank the total for
    its own samples. AD (distlinalg convention): the VJP of this collective
    function gives each rank its parameter block's share of Σ over all
    ranks' samples, which is what the sharded Gram operator and force need.
    """

    L: int
    alpha: int = 1
    dtype: Any = jnp.float64
    comm: Any = None

    sharded = True

    def __post_init__(self) -> None:
        comm = communicator(self.comm)
        if comm.size > min(self.L, self.alpha * self.L):
            raise ValueError("ShardedRBM needs at least one visible site and one hidden unit per rank")
        object.__setattr__(self, "_comm", comm)

    @property
    def rank(self) -> int:
        return self._comm.rank

    @property
    def size(self) -> int:
        return self._comm.size

    def _bounds(self, n: int, r: int) -> slice:
        edges = np.cumsum([0] + [len(c) for c in np.array_split(np.arange(n), self.size)])
        return slice(int(edges[r]), int(edges[r + 1]))

    def hidden_slice(self, r: int) -> slice:
        return self._bounds(self.alpha * self.L, r)

    def visible_slice(self, r: int) -> slice:
        return self._bounds(self.L, r)

    def block(self, full: Params, r: int | None = None) -> Params:
        """Rank r's block of full parameters (default: this rank's)."""
        r = self.rank if r is None else r
        hs, vs = self.hidden_slice(r), self.visible_slice(r)
        return {"a": full["a"][vs], "b": full["b"][hs], "W": full["W"][hs]}

    def gather(self, block: Params) -> Params:
        """Full parameters from every rank's block (host side, on every rank)."""
        parts = self._comm.comm.allgather({k: np.asarray(v) for k, v in block.items()})
        return {k: jnp.asarray(np.concatenate([p[k] for p in parts])) for k in ("a", "b", "W")}

    def init(self, key: jax.Array) -> Params:
        """This rank's block of the same parameters RBM(...).init(key) draws."""
        return self.block(init_params(key, self.L, self.alpha, self.dtype))

    def log_psi(self, params: Params, x: jax.Array) -> jax.Array:
        """(n, L) local samples -> (n,); collective (n equal on every rank)."""
        n = x.shape[0]
        everyone = allgather(x, comm=self._comm).reshape(self.size * n, self.L)
        visible = everyone[:, self.visible_slice(self.rank)]
        part = _rbm_terms(params["a"], params["b"], params["W"], visible, everyone)
        return reduce_scatter(part.reshape(self.size, n), "sum", comm=self._comm)
