"""Metropolis–Hastings sampling of |ψ(σ)|² in JAX, many chains per rank.

Each rank runs its own ``n_chains`` chains (a batched array, one vectorised
proposal per move for all chains) inside ``lax.scan``/``fori_loop``, so a
whole sampling pass is one jitted call. Its samples are its chains' states
after every sweep (L moves) following ``n_discard`` thermalisation sweeps:
the samples of the run are sharded across ranks, n_chains·n_sweeps each.

Moves (both symmetric proposals, so the acceptance is min(1, |ψ'/ψ|²)):
  * "flip": one uniformly random spin is flipped (TFIM);
  * "exchange": a random spin i and a random spin j of opposite sign are
    flipped together, i.e. swapped. Every chain stays in its Sz sector, the
    chains start in Sz = 0 (Heisenberg). In Sz = 0 every spin has exactly
    L/2 opposite partners, so the proposal is symmetric.

Seeds: the state's key is folded with the rank at initialisation, so the
ranks' chains are independent; it is carried in the sampler state (and
checkpointed), so a resumed run continues the same random stream. The key
uses JAX's "unsafe_rbg" implementation (XLA's RngBitGenerator): threefry
took seconds to compile inside the sampling loop on a loaded 2-core
machine, for every new model; RBG's weaker split guarantees are harmless
for Metropolis proposals. Keys are stored as raw uint32 data.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


KEY_IMPL = "unsafe_rbg"


def make_key(seed: int) -> jax.Array:
    """Raw uint32 key data of the sampler's PRNG implementation."""
    return jax.random.key_data(jax.random.key(seed, impl=KEY_IMPL))


def _wrap(data: jax.Array) -> jax.Array:
    return jax.random.wrap_key_data(data, impl=KEY_IMPL)


class SamplerState(NamedTuple):
    """chains: (n_chains, L) float64 ±1; key: raw uint32 key data (see make_key)."""

    chains: jax.Array
    key: jax.Array


@dataclass(frozen=True)
class MetropolisSampler:
    """Metropolis sampler. ``n_sweeps`` samples per chain per call."""

    L: int
    move: str = "flip"
    n_chains: int = 16
    n_sweeps: int = 32
    n_discard: int = 4

    @property
    def n_local(self) -> int:
        """Samples per rank per call."""
        return self.n_chains * self.n_sweeps

    def init_state(self, seed: int, rank: int) -> SamplerState:
        """Fresh chains (random, or random Sz = 0 for exchange moves) for `rank`."""
        key = jax.random.fold_in(jax.random.key(seed, impl=KEY_IMPL), rank)
        key, sub = jax.random.split(key)
        if self.move == "exchange":
            if self.L % 2:
                raise ValueError("exchange moves start from Sz = 0 and need even L")
            base = jnp.concatenate([jnp.ones(self.L // 2), -jnp.ones(self.L // 2)])
            keys = jax.random.split(sub, self.n_chains)
            chains = jax.vmap(lambda k: jax.random.permutation(k, base))(keys)
        elif self.move == "flip":
            chains = jax.random.rademacher(sub, (self.n_chains, self.L)).astype(jnp.float64)
        else:
            raise ValueError(f"unknown move {self.move!r}")
        return SamplerState(chains.astype(jnp.float64), jax.random.key_data(key))

    def _propose(self, chains: jax.Array, site: jax.Array, scores: jax.Array | None) -> jax.Array:
        """Flip `site` (and, for exchange moves, the opposite spin with the
        largest random score) of every chain."""
        flip = jax.nn.one_hot(site, self.L, dtype=chains.dtype)
        if self.move == "exchange":
            picked = jnp.take_along_axis(chains, site[:, None], axis=1)
            masked = jnp.where(chains != picked, scores, -1.0)
            flip = flip + jax.nn.one_hot(jnp.argmax(masked, axis=1), self.L, dtype=chains.dtype)
        return chains * (1.0 - 2.0 * flip)

    def sample(self, log_psi: Callable[[Any, jax.Array], jax.Array], params: Any,
               state: SamplerState) -> tuple[jax.Array, SamplerState, jax.Array]:
        """(samples (n_sweeps·n_chains, L), new state, acceptance rate of this rank).

        Call inside jit. With a communicating (sharded) model every rank
        runs the same number of moves, so the collectives line up.
        """
        key, run_key = jax.random.split(_wrap(state.key))
        # All random numbers of the pass are drawn at once, outside the loops:
        # generating keys inside nested scans made XLA compile for seconds.
        sweeps = self.n_discard + self.n_sweeps
        c = state.chains.shape[0]
        k_site, k_acc, k_pair = jax.random.split(run_key, 3)
        sites = jax.random.randint(k_site, (sweeps, self.L, c), 0, self.L)
        log_u = jnp.log(jax.random.uniform(k_acc, (sweeps, self.L, c)))
        scores = (jax.random.uniform(k_pair, (sweeps, self.L, c, self.L)) if self.move == "exchange"
                  else jnp.zeros((sweeps, self.L, 0)))

        def move(carry, draws):
            chains, logp, accepted = carry
            site, lu, sc = draws
            proposal = self._propose(chains, site, sc)
            logp_new = log_psi(params, proposal)
            accept = lu < 2.0 * jnp.real(logp_new - logp)
            chains = jnp.where(accept[:, None], proposal, chains)
            logp = jnp.where(accept, logp_new, logp)
            return (chains, logp, accepted + jnp.sum(accept, dtype=jnp.int32)), None

        def sweep(carry, draws):
            carry, _ = jax.lax.scan(move, carry, draws)
            return carry, carry[0]

        draws = (sites, log_u, scores)
        head = jax.tree_util.tree_map(lambda d: d[: self.n_discard], draws)
        tail = jax.tree_util.tree_map(lambda d: d[self.n_discard:], draws)
        carry = (state.chains, log_psi(params, state.chains), jnp.zeros((), jnp.int32))
        carry, _ = jax.lax.scan(sweep, carry, head)
        carry = (carry[0], carry[1], jnp.zeros((), jnp.int32))
        carry, kept = jax.lax.scan(sweep, carry, tail)
        acceptance = carry[2] / (self.n_sweeps * self.L * c)
        return kept.reshape(-1, self.L), SamplerState(carry[0], jax.random.key_data(key)), acceptance
