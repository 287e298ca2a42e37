"""Spin-chain Hamiltonians and their local energies, in JAX.

Configurations are arrays of spins σ_i ∈ {-1.0, +1.0} (float64, so they feed
``W @ σ`` directly and travel through the MPI primitives), shape (n, L), on a
periodic chain (site L is site 0). Basis convention shared with
``exact.py`` and the tests: σ_i = +1 is the Z eigenvalue +1.

Local energy: E_loc(σ) = Σ_σ' H_σσ' ψ(σ')/ψ(σ). Each Hamiltonian lists, for
every sample, a fixed number m of "connected" configurations σ' with their
matrix elements (entries that do not exist carry element 0 and σ' = σ, so
the array shapes are static and ratios stay finite).

The couplings are passed as JAX values at call time (not baked into the
Hamiltonian), so ``jax.grad`` of an energy with respect to h or J works;
that is what the meta-gradient uses.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp

LogPsi = Callable[[Any, jax.Array], jax.Array]


def _bond_energy(samples: jax.Array) -> jax.Array:
    """Σ_i σ_i σ_{i+1} per sample (periodic), shape (n,)."""
    return jnp.sum(samples * jnp.roll(samples, -1, axis=-1), axis=-1)


@dataclass(frozen=True)
class Hamiltonian:
    """A periodic chain Hamiltonian.

    Attributes:
      name: "tfim" or "heisenberg".
      L: number of sites.
      defaults: default couplings, e.g. {"h": 1.0, "J": 1.0}.
      marshall: Heisenberg only: the Hamiltonian is rotated by the Marshall
        sign U = (-1)^(number of up spins on odd sites), which turns the
        +2J exchange elements into -2J (stoquastic, positive ground state),
        so a real RBM can represent it. Needs even L. Energies unchanged.
    """

    name: str
    L: int
    defaults: Mapping[str, float] = field(default_factory=dict)
    marshall: bool = True

    def couplings(self, **overrides: float) -> dict[str, jax.Array]:
        """The couplings as float64 JAX scalars (traceable arguments)."""
        values = {**self.defaults, **overrides}
        return {k: jnp.asarray(v, jnp.float64) for k, v in values.items()}

    def connected(self, samples: jax.Array, couplings: Mapping[str, Any]) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(diagonal (n,), connected configurations (n, m, L), elements (n, m))."""
        J = couplings["J"]
        diag = J * _bond_energy(samples)
        L = samples.shape[-1]
        if self.name == "tfim":
            # σ' = σ with spin i flipped, element -h, for every i (m = L).
            flips = 1.0 - 2.0 * jnp.eye(L, dtype=samples.dtype)
            conn = samples[:, None, :] * flips[None]
            mels = jnp.broadcast_to(-couplings["h"], conn.shape[:2]).astype(samples.dtype)
            return diag, conn, mels
        if self.name == "heisenberg":
            # XX + YY on bond (i, i+1) swaps an antiparallel pair with
            # element 2J (-2J after the Marshall rotation); m = L bonds.
            right = jnp.roll(samples, -1, axis=-1)
            antiparallel = samples != right  # (n, L): bond i
            pair = jnp.eye(L, dtype=samples.dtype) + jnp.roll(jnp.eye(L, dtype=samples.dtype), 1, axis=1)
            flips = 1.0 - 2.0 * pair  # row i flips sites i and i+1
            flipped = samples[:, None, :] * flips[None]
            conn = jnp.where(antiparallel[..., None], flipped, samples[:, None, :])
            sign = -1.0 if self.marshall else 1.0
            mels = jnp.where(antiparallel, sign * 2.0 * J, 0.0).astype(samples.dtype)
            return diag, conn, mels
        raise ValueError(f"unknown Hamiltonian {self.name!r}")

    def local_energy(self, log_psi: LogPsi, params: Any, samples: jax.Array,
                     couplings: Mapping[str, Any]) -> jax.Array:
        """E_loc per sample, shape (n,), complex if log ψ is complex.

        ``log_psi(params, x)`` is evaluated once on all n·m connected
        configurations in one batch (a communicating, sharded-parameter
        model therefore issues the same collectives on every rank).
        AD: differentiable in params and couplings.
        """
        diag, conn, mels = self.connected(samples, couplings)
        n, m, L = conn.shape
        log_here = log_psi(params, samples)
        log_conn = log_psi(params, conn.reshape(n * m, L)).reshape(n, m)
        ratios = jnp.exp(log_conn - log_here[:, None])
        return diag + jnp.sum(mels * ratios, axis=1)


def tfim(L: int, h: float = 1.0, J: float = 1.0) -> Hamiltonian:
    """H = -h Σ X_i + J Σ Z_i Z_{i+1} (periodic)."""
    return Hamiltonian("tfim", L, {"h": h, "J": J})


def heisenberg(L: int, J: float = 1.0, marshall: bool = True) -> Hamiltonian:
    """H = J Σ (X_i X_{i+1} + Y_i Y_{i+1} + Z_i Z_{i+1}) (Pauli, periodic)."""
    if marshall and L % 2:
        raise ValueError("the Marshall sign rule needs an even (bipartite) periodic chain")
    return Hamiltonian("heisenberg", L, {"J": J}, marshall=marshall)
