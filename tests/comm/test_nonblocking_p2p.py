"""isend / irecv / wait: values, derivatives in both modes against the stacked
single-process reference, vmap, loops, PROC_NULL, pytrees, and the errors of
mismatched messages. The ring is mpi4torch's Isend–Recv–Wait example."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distlinalg import comm as C
from distlinalg.comm import PROC_NULL, irecv, isend, wait
from conftest import assert_no_failures, failure_of, gather_global


def neighbours(rank, size):
    return (rank + 1) % size, (rank - 1) % size


def ring(a, rank, size, comm, *, sends_first=True):
    """Each rank sends `a` to its right and returns what its left sent."""
    right, left = neighbours(rank, size)
    sent = isend(a, right, comm=comm)
    received = irecv(a, left, comm=comm)  # the template: shape, dtype, and differentiated with a
    if sends_first:
        wait(sent)
        return wait(received)
    b = wait(received)
    wait(sent)
    return b


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_ring_values(comm, rank, size, jit):
    a = jnp.arange(5.0) + 10 * rank
    fn = (lambda v: ring(v, rank, size, comm)) if not jit else jax.jit(lambda v: ring(v, rank, size, comm))
    A = gather_global(a, comm)
    np.testing.assert_array_equal(fn(a), np.roll(A, 1, axis=0)[rank])


@pytest.mark.parametrize("sends_first", [True, False])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_ring_gradient_is_two(comm, rank, size, jit, sends_first):
    """mpi4torch's ring, written the natural way: d/da of Σ_ranks Σ(a + b) = 2 (no dependency wiring)."""
    def loss(a):
        return jnp.sum(a + ring(a, rank, size, comm, sends_first=sends_first))

    grad = jax.grad(loss)
    g = (jax.jit(grad) if jit else grad)(jnp.arange(4.0) * (rank + 1))
    np.testing.assert_array_equal(g, np.full(4, 2.0))


def _shifted_loss(rank, size, comm):
    """L_r = Σ c_r·b_r + Σ d_r·a_r², b_r = sin(a_{r-1}) received from the left; and its stacked reference."""
    c = jnp.asarray(np.random.default_rng(rank).standard_normal(3))
    d = 0.5 + rank
    C_all = jnp.asarray(gather_global(c, comm))
    d_all = jnp.arange(size) + 0.5

    def local(a):
        right, left = neighbours(rank, size)
        sent = isend(jnp.sin(a), right, comm=comm)
        b = wait(irecv(a, left, comm=comm))
        wait(sent)
        return jnp.sum(c * b) + d * jnp.sum(a**2)

    def stacked(A):
        B = jnp.roll(jnp.sin(A), 1, axis=0)
        return jnp.sum(C_all * B) + jnp.sum(d_all[:, None] * A**2)

    return local, stacked


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_grad_and_jvp_against_the_stacked_reference(comm, rank, size, jit):
    local, stacked = _shifted_loss(rank, size, comm)
    a = jnp.asarray(np.random.default_rng(10 + rank).standard_normal(3))
    A = jnp.asarray(gather_global(a, comm))
    wrap = jax.jit if jit else (lambda f: f)
    # Reverse mode: jax.grad seeds every rank's L_r, i.e. differentiates Σ_r L_r.
    np.testing.assert_allclose(wrap(jax.grad(local))(a), jax.grad(stacked)(A)[rank], rtol=1e-12)
    # Forward mode: every rank's tangent at once; the tangent of Σ_r L_r is their sum.
    t = jnp.asarray(np.random.default_rng(20 + rank).standard_normal(3))
    T = jnp.asarray(gather_global(t, comm))
    _, tangent = wrap(lambda a, t: jax.jvp(local, (a,), (t,)))(a, t)
    _, reference = jax.jvp(stacked, (A,), (T,))
    np.testing.assert_allclose(C.allreduce(tangent, comm=comm), reference, rtol=1e-12)


def test_receiver_differentiates_sender_does_not(comm, rank, size):
    """The message carries no flag: the posted tangent receive is cancelled, the tangent is 0."""
    right, left = neighbours(rank, size)
    const = jnp.full(3, float(rank))

    def f(a):
        sent = isend(const, right, comm=comm)  # does not depend on a
        b = wait(irecv(a, left, comm=comm))
        wait(sent)
        return jnp.sum(b * a)

    a = jnp.arange(3.0) + 1
    # d/da Σ(b·a) with b constant = b = the left rank's const
    np.testing.assert_array_equal(jax.grad(f)(a), np.full(3, float(left)))
    np.testing.assert_array_equal(jax.jit(jax.grad(f))(a), np.full(3, float(left)))
    _, tangent = jax.jvp(f, (a,), (jnp.ones(3),))
    np.testing.assert_allclose(tangent, 3.0 * left)


def test_vmap_and_vmap_of_grad(comm, rank, size):
    local, stacked = _shifted_loss(rank, size, comm)
    batch = jnp.asarray(np.random.default_rng(30 + rank).standard_normal((2, 3)))
    Batch = jnp.asarray(gather_global(batch, comm))  # (size, 2, 3)
    values = jax.vmap(lambda a: ring(a, rank, size, comm))(batch)
    np.testing.assert_array_equal(values, np.roll(np.asarray(Batch), 1, axis=0)[rank])
    grads = jax.jit(jax.vmap(jax.grad(local)))(batch)
    for lane in range(2):
        np.testing.assert_allclose(grads[lane], jax.grad(stacked)(Batch[:, lane])[rank], rtol=1e-12)
    # grad of a vmapped loss: the batch as one message, differentiated
    total = jax.grad(lambda b: jnp.sum(jax.vmap(local)(b)))(batch)
    for lane in range(2):
        np.testing.assert_allclose(total[lane], jax.grad(stacked)(Batch[:, lane])[rank], rtol=1e-12)


def test_in_loops_with_grad(comm, rank, size):
    """A ring shift per iteration of fori_loop and scan: after k steps b_r = a_{r-k}."""
    def shifted(a, steps):
        return jax.lax.fori_loop(0, steps, lambda i, v: ring(v, rank, size, comm) * 1.5, a)

    def scanned(a):
        out, _ = jax.lax.scan(lambda v, _: (ring(v, rank, size, comm) * 1.5, None), a, None, length=3)
        return out

    a = jnp.arange(3.0) + rank
    A = np.asarray(gather_global(a, comm))
    expected = 1.5**3 * np.roll(A, 3, axis=0)[rank]
    np.testing.assert_allclose(jax.jit(shifted, static_argnums=1)(a, 3), expected)
    np.testing.assert_allclose(jax.jit(scanned)(a), expected)
    # Σ_r Σ out_r = 1.5³ Σ_r Σ a_r: the gradient is 1.5³ everywhere.
    np.testing.assert_allclose(jax.jit(jax.grad(lambda v: jnp.sum(scanned(v))))(a), np.full(3, 1.5**3))


def test_proc_null_and_pytrees(comm, rank, size):
    tree = {"x": jnp.arange(3.0) + rank, "y": (jnp.ones((2,), jnp.float32) * rank,)}
    right, left = neighbours(rank, size)
    out = jax.jit(lambda t: (lambda s: (wait(irecv(t, left, comm=comm)), wait(s))[0])(isend(t, right, comm=comm)))(tree)
    np.testing.assert_array_equal(out["x"], np.arange(3.0) + left)
    np.testing.assert_array_equal(out["y"][0], np.full(2, float(left), np.float32))
    # PROC_NULL: nothing sent, nothing received (the template comes back, and its cotangent with it).
    assert wait(isend(tree, PROC_NULL, comm=comm)) is None
    same = wait(irecv(tree, PROC_NULL, comm=comm))
    np.testing.assert_array_equal(same["x"], tree["x"])
    g = jax.grad(lambda v: jnp.sum(wait(irecv(v, PROC_NULL, comm=comm)) ** 2))(tree["x"])
    np.testing.assert_allclose(g, 2 * tree["x"])


def test_a_message_of_another_size_is_an_error_at_the_wait(comm, rank, size):
    """Every rank sends 3 elements and expects 4 (a ring): every rank's wait raises, naming the route."""
    right, left = neighbours(rank, size)

    def run():
        sent = isend(jnp.ones(3), right, comm=comm)
        received = irecv(jnp.zeros(4), left, comm=comm)
        wait(sent)
        return jax.block_until_ready(wait(received))

    failure = failure_of(run, rf"irecv from rank {left} \(tag 0\) expected 4 elements of float64 and received 3")
    assert_no_failures(failure, comm)
    # Still in step.
    np.testing.assert_array_equal(ring(jnp.ones(2), rank, size, comm), np.ones(2))


def test_second_order_is_not_supported(comm, rank, size):
    def f(a):
        return jnp.sum(ring(a, rank, size, comm) ** 3)

    with pytest.raises(NotImplementedError, match="second-order derivatives"):
        jax.hessian(f)(jnp.ones(2))


def test_bad_arguments_raise_at_trace_time(comm, size):
    with pytest.raises(ValueError):
        isend(jnp.ones(2), size, comm=comm)
    with pytest.raises(ValueError):
        irecv(jnp.ones(2), C.ANY_SOURCE, comm=comm)
    with pytest.raises(ValueError):
        isend(jnp.ones(2), 0, tag=-3, comm=comm)
    with pytest.raises(ValueError, match="never waited for"):
        jax.jit(lambda v: isend(v, 0, comm=comm) and v).lower(jnp.ones(2))
