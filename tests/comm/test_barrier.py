"""barrier: synchronises eagerly and under jit, binds once under vmap/grad, and is never
dropped as dead code. (Its place in program order is checked in test_collectives.py,
which every MPI pass runs.)"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distlinalg.comm.allreduce import allreduce
from distlinalg.comm.barrier import barrier, barrier_p

DELAY = 0.4  # seconds rank 0 waits before entering the barrier


def _barrier_count(jaxpr):
    return sum(1 for eqn in jaxpr.jaxpr.eqns if eqn.primitive is barrier_p)


@pytest.mark.parametrize("jit", [False, True])
def test_barrier_waits_for_the_slowest_rank(comm, rank, jit):
    f = jax.jit(lambda: barrier(comm=comm)) if jit else (lambda: barrier(comm=comm))
    f()  # compile (and synchronise) once before timing
    if rank == 0:
        time.sleep(DELAY)
    start = time.perf_counter()
    assert f() is None
    waited = time.perf_counter() - start
    # Judged on the gathered times, so a rank that was let through early
    # fails the test on every rank instead of leaving the others behind.
    others_waited = comm.allgather(waited)[1:]
    assert all(w > 0.5 * DELAY for w in others_waited), others_waited  # held until rank 0 arrived


def test_barrier_is_not_dead_code_and_binds_once_under_transformations(comm, rank, size):
    def f(x):
        barrier(comm=comm)
        return jnp.sum(jnp.sin(x))

    x = jnp.arange(3.0)
    assert _barrier_count(jax.make_jaxpr(f)(x)) == 1
    assert _barrier_count(jax.make_jaxpr(jax.vmap(f))(jnp.ones((4, 3)))) == 1
    assert _barrier_count(jax.make_jaxpr(jax.grad(f))(x)) == 1
    assert _barrier_count(jax.make_jaxpr(lambda v: jax.jvp(f, (v,), (v,)))(x)) == 1
    # Its result is unused, yet the compiled program keeps the call (one rank:
    # there is nobody to wait for, and the barrier lowers to nothing).
    hlo = jax.jit(f).lower(x).as_text()
    assert ("distlinalg_barrier" in hlo) == (size > 1)
    np.testing.assert_allclose(jax.jit(jax.vmap(jax.grad(f)))(jnp.ones((2, 3))), np.cos(np.ones((2, 3))))
    np.testing.assert_allclose(jax.grad(f)(x), np.cos(x))


def test_barrier_in_control_flow(comm, rank, size):
    def body(i, v):
        barrier(comm=comm)
        return allreduce(v, comm=comm) / size

    out = jax.jit(lambda v: jax.lax.fori_loop(0, 3, body, v))(jnp.full(2, float(rank)))
    np.testing.assert_allclose(out, np.full(2, (size - 1) / 2))
    out = jax.jit(lambda v: jax.lax.cond(v[0] >= 0, lambda u: (barrier(comm=comm), u + 1)[1], lambda u: u, v))(
        jnp.zeros(2))
    np.testing.assert_allclose(out, np.ones(2))


def test_default_communicator_and_bad_comm(comm, size):
    barrier()
    with pytest.raises(TypeError, match="mpi4py communicator"):
        barrier(comm="world")
    with pytest.raises(TypeError):
        barrier(comm)  # keyword-only
    barrier(comm=comm)
    np.testing.assert_allclose(allreduce(jnp.ones(1), comm=comm), [size])
