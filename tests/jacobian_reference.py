"""Dense single-process references for the Gram operators and the natural
gradient, from jax.jacfwd of the model on the gathered samples (shared by
test_gram.py and test_natural_gradient.py).

Rows follow NetKet's modes: "real" ∂Re f/∂θ̃, "complex" (∂Re f, ∂Im f)/∂θ̃
interleaved per sample (2N rows), "holomorphic" ∂f/∂θ (complex); θ̃ is
(Re θ, Im θ) for complex parameters outside "holomorphic" mode.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree


VISIBLE, HIDDEN = 4, 3


# -- small models shared by the tests ---------------------------------------------------
def params_of(dtype, seed=1):
    rng = np.random.default_rng(seed)

    def draw(*shape):
        x = 0.3 * rng.standard_normal(shape)
        if np.issubdtype(dtype, np.complexfloating):
            x = x + 0.3j * rng.standard_normal(shape)
        return jnp.asarray(x, dtype)

    return {"W": draw(HIDDEN, VISIBLE), "b": draw(HIDDEN), "a": draw(VISIBLE)}


def rbm(p, x):
    """log ψ of a restricted Boltzmann machine (holomorphic in p)."""
    return x @ p["a"] + jnp.sum(jnp.log(jnp.cosh(x @ p["W"].T + p["b"])), axis=-1)


def rbm_with_phase(p, x):
    """Real parameters, complex output."""
    return rbm(p, x) + 1j * jnp.sum(jnp.sin(x @ p["W"].T), axis=-1)


def non_holomorphic(p, x):
    """Complex parameters through conj: only the "complex" mode is right."""
    return rbm(p, x) + 0.5 * x @ jnp.conj(p["a"]) * 1j


# -- references ---------------------------------------------------------------------------
def splits(params, mode):
    return mode != "holomorphic" and any(jnp.iscomplexobj(x) for x in jax.tree_util.tree_leaves(params))


def theta_of(params, mode):
    """(θ̃ as a flat vector, θ̃ ↦ params)."""
    flat, unravel = ravel_pytree(params)
    if not splits(params, mode):
        return np.asarray(flat), unravel
    n = flat.size
    return np.concatenate([np.real(flat), np.imag(flat)]), lambda t: unravel(t[:n] + 1j * t[n:])


def jacobian_rows(f, params, X, mode, center):
    """(R, θ̃): the (centred) Jacobian rows, (N·k, n), sample-major."""
    theta, to_params = theta_of(params, mode)
    X = jnp.asarray(X)
    if mode == "holomorphic":
        J = np.asarray(jax.jit(jax.jacfwd(lambda t: f(to_params(t), X), holomorphic=True))(jnp.asarray(theta)))
        rows = J[:, None, :]
    else:
        g = lambda t: f(to_params(t), X)  # noqa: E731
        Jr = np.asarray(jax.jit(jax.jacfwd(lambda t: jnp.real(g(t))))(jnp.asarray(theta)))
        if mode == "real":
            rows = Jr[:, None, :]
        else:
            Ji = np.asarray(jax.jit(jax.jacfwd(lambda t: jnp.imag(g(t))))(jnp.asarray(theta)))
            rows = np.stack([Jr, Ji], axis=1)
    if center:
        rows = rows - rows.mean(axis=0, keepdims=True)
    return rows.reshape(-1, rows.shape[-1]), theta


def residual_vector(e, mode, center):
    """ē in the rows' layout: Re e ("real"), (Re e, Im e) interleaved, or e."""
    e = np.asarray(e)
    if center:
        e = e - e.mean()
    if mode == "real":
        return np.real(e)
    if mode == "complex":
        return np.stack([np.real(e), np.imag(e)], axis=1).reshape(-1)
    return e.astype(complex)


def natural_gradient_reference(f, params, X, e, mode, center, diag_shift):
    """δ = (S + λ)⁻¹ F with S = RᴴR/N, F = Rᴴ ē/N, as a flat θ̃ vector and as params."""
    R, theta = jacobian_rows(f, params, X, mode, center)
    N = np.shape(X)[0]
    S = R.conj().T @ R / N
    F = R.conj().T @ residual_vector(e, mode, center) / N
    delta = np.linalg.solve(S + diag_shift * np.eye(S.shape[0]), F)
    _, to_params = theta_of(params, mode)
    return delta, to_params(jnp.asarray(delta))
