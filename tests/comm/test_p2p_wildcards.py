"""Receives from MPI.ANY_SOURCE / with MPI.ANY_TAG and receive statuses: values, the status
(source, tag, count), JVP and gradients against the stacked global program (the derivative
follows the route the primal message took), vmap, pytrees, every-call checks and bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

from distlinalg._runtime.mpi import PROC_NULL, configure
from distlinalg.comm import ANY_SOURCE, ANY_TAG, Status, allreduce, recv, send, sendrecv
from conftest import assert_no_failures, failure_of, gather_global


def local_data(rank, shape=(3,), seed=0):
    return np.random.default_rng(1000 * seed + rank).standard_normal(shape)


def assert_in_step(comm):
    np.testing.assert_allclose(allreduce(jnp.ones(1), comm=comm), [comm.Get_size()])


def ints(status):
    return tuple(int(v) for v in status)


# ---------------------------------------------------------------------------
# Values and statuses
@pytest.mark.parametrize("jit", [False, True])
def test_ring_any_source_any_tag_status(comm, rank, size, jit):
    left, right = (rank - 1) % size, (rank + 1) % size
    x = jnp.asarray(local_data(rank, (2, 3)))

    def fn(a):
        return sendrecv(a, jnp.zeros_like(a), ANY_SOURCE, right, sendtag=10 + rank, recvtag=ANY_TAG,
                        comm=comm, return_status=True)

    y, st = (jax.jit(fn) if jit else fn)(x)
    assert isinstance(st, Status) and st.source.dtype == jnp.int32
    np.testing.assert_array_equal(y, gather_global(x, comm)[left])
    assert ints(st) == (left, 10 + left, 6)
    # Without return_status: just the array.
    y2 = (jax.jit(lambda a: sendrecv(a, a, ANY_SOURCE, right, comm=comm)) if jit else
          (lambda a: sendrecv(a, a, ANY_SOURCE, right, comm=comm)))(x)
    np.testing.assert_array_equal(y2, gather_global(x, comm)[left])
    assert_in_step(comm)


@pytest.mark.parametrize("jit", [False, True])
def test_many_to_one_in_arrival_order(comm, rank, size, jit):
    """Rank 0 takes one message from every other rank, whichever comes first."""
    x = jnp.arange(4.0) + 100 * rank
    one = lambda t: recv(t, ANY_SOURCE, tag=ANY_TAG, comm=comm, return_status=True)  # noqa: E731
    one = jax.jit(one) if jit else one
    if rank == 0:
        seen = []
        for _ in range(size - 1):
            y, st = one(jnp.zeros(4))
            source, tag, count = ints(st)
            np.testing.assert_array_equal(y, jnp.arange(4.0) + 100 * source)
            assert tag == 20 + source and count == 4
            seen.append(source)
        assert sorted(seen) == list(range(1, size))
    else:
        send(x, 0, tag=20 + rank, comm=comm)
    assert_in_step(comm)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "int8", "float64", "complex128", "bool"])
def test_status_count_of_a_shorter_message(comm, rank, size, dtype):
    """count is in elements of the template's dtype; the template's tail is kept."""
    left, right = (rank - 1) % size, (rank + 1) % size
    sent = jnp.ones(2, dtype)
    template = jnp.zeros(5, dtype)
    # The message (2 elements) is shorter than the receive buffer (5).
    y, st = sendrecv(sent, template, ANY_SOURCE, right, sendtag=3, recvtag=ANY_TAG, comm=comm,
                     return_status=True)
    assert ints(st) == (left, 3, 2)
    assert y.dtype == template.dtype
    np.testing.assert_array_equal(np.asarray(y.astype(jnp.complex128)), [1, 1, 0, 0, 0])
    assert_in_step(comm)


def test_status_of_explicit_and_proc_null_sources(comm, rank, size):
    left, right = (rank - 1) % size, (rank + 1) % size
    x = jnp.asarray(local_data(rank))
    y, st = jax.jit(lambda a: sendrecv(a, a * 0, left, right, sendtag=5, recvtag=5, comm=comm,
                                       return_status=True))(x)
    np.testing.assert_array_equal(y, gather_global(x, comm)[left])
    assert ints(st) == (left, 5, 3)
    # From PROC_NULL: the template, MPI's empty status (PROC_NULL, ANY_TAG, 0).
    template = jnp.arange(3.0)
    for tag in (0, ANY_TAG):
        y, st = recv(template, PROC_NULL, tag=tag, comm=comm, return_status=True)
        np.testing.assert_array_equal(y, template)
        assert ints(st) == (PROC_NULL, ANY_TAG, 0)
    assert_in_step(comm)


def test_pytree_comes_from_one_sender(comm, rank, size):
    """The first leaf's match decides where the other leaves come from."""
    tree = {"a": jnp.full(2, float(rank)), "b": jnp.full(3, rank, jnp.int32)}
    if rank == 0:
        for _ in range(size - 1):
            got, st = recv({"a": jnp.zeros(2), "b": jnp.zeros(3, jnp.int32)}, ANY_SOURCE, tag=ANY_TAG,
                           comm=comm, return_status=True)
            source = int(st.source)
            np.testing.assert_array_equal(got["a"], [source] * 2)
            np.testing.assert_array_equal(got["b"], [source] * 3)
            assert int(st.count) == 5  # over the leaves
    else:
        send(tree, 0, tag=rank, comm=comm)
    assert_in_step(comm)


def test_vmap_status_counts_one_lane(comm, rank, size):
    left, right = (rank - 1) % size, (rank + 1) % size
    xs = jnp.asarray(local_data(rank, (4, 3)))
    fn = lambda a: sendrecv(a, a * 0, ANY_SOURCE, right, recvtag=ANY_TAG, comm=comm, return_status=True)  # noqa: E731
    y, st = jax.jit(jax.vmap(fn))(xs)
    np.testing.assert_array_equal(y, gather_global(xs, comm)[left])
    # The status is not batched (one message carries the batch); vmap's
    # out_axes broadcast it to every lane.
    np.testing.assert_array_equal(st.source, [left] * 4)
    np.testing.assert_array_equal(st.count, [3] * 4)
    assert_in_step(comm)


# ---------------------------------------------------------------------------
# Derivatives: ring against the stacked global program
def ring_program(comm, rank, size, tagged):
    right = (rank + 1) % size

    def program(x):
        kwargs = dict(sendtag=30 + rank, recvtag=ANY_TAG) if tagged else {}
        return sendrecv(jnp.sin(x) * (rank + 1), x * 0, ANY_SOURCE, right, comm=comm, **kwargs) * (rank + 2)

    def reference(G):  # rank r gets (r+2) * (left+1) * sin(x_left)
        P = G.shape[0]
        scale = jnp.arange(1.0, P + 1)[:, None]
        return jnp.roll(jnp.sin(G) * scale, 1, axis=0) * (jnp.arange(P)[:, None] + 2.0)

    return program, reference


@pytest.mark.parametrize("tagged", [False, True])
@pytest.mark.parametrize("jit", [False, True])
def test_ring_derivatives_against_stacked_reference(comm, rank, size, tagged, jit):
    program, reference = ring_program(comm, rank, size, tagged)
    x = jnp.asarray(local_data(rank, (3,), seed=1))
    v = jnp.asarray(local_data(rank, (3,), seed=2))
    w = jnp.asarray(local_data(rank, (3,), seed=3))
    G, V, W = (jnp.asarray(gather_global(a, comm)) for a in (x, v, w))
    wrap = jax.jit if jit else (lambda f: f)
    np.testing.assert_allclose(wrap(program)(x), reference(G)[rank], rtol=1e-14)
    _, tangent = wrap(lambda x, v: jax.jvp(program, (x,), (v,)))(x, v)
    np.testing.assert_allclose(tangent, jax.jvp(reference, (G,), (V,))[1][rank], rtol=1e-13)
    grad = wrap(jax.grad(lambda x: jnp.sum(w * program(x))))(x)
    ref = jax.grad(lambda g: jnp.sum(W * reference(g)))(G)[rank]
    np.testing.assert_allclose(grad, ref, rtol=1e-13)
    # Second order: forward over reverse.
    hvp = wrap(lambda x, v: jax.jvp(jax.grad(lambda x: jnp.sum(w * program(x))), (x,), (v,))[1])(x, v)
    ref_hvp = jax.jvp(jax.grad(lambda g: jnp.sum(W * reference(g))), (G,), (V,))[1][rank]
    np.testing.assert_allclose(hvp, ref_hvp, rtol=1e-12, atol=1e-14)
    assert_in_step(comm)


def test_ring_vmap_of_jvp_and_grad(comm, rank, size):
    program, reference = ring_program(comm, rank, size, tagged=True)
    xs = jnp.asarray(local_data(rank, (4, 3), seed=4))
    vs = jnp.asarray(local_data(rank, (4, 3), seed=5))
    Gs, Vs = jnp.asarray(gather_global(xs, comm)), jnp.asarray(gather_global(vs, comm))
    tangents = jax.jit(jax.vmap(lambda x, v: jax.jvp(program, (x,), (v,))[1]))(xs, vs)
    ref = jax.vmap(lambda g, v: jax.jvp(reference, (g,), (v,))[1], in_axes=1, out_axes=1)(Gs, Vs)[rank]
    np.testing.assert_allclose(tangents, ref, rtol=1e-13)
    grads = jax.jit(jax.vmap(jax.grad(lambda x: jnp.sum(program(x)))))(xs)
    ref = jax.vmap(jax.grad(lambda g: jnp.sum(reference(g))), in_axes=1, out_axes=1)(Gs)[rank]
    np.testing.assert_allclose(grads, ref, rtol=1e-13)
    assert_in_step(comm)


# ---------------------------------------------------------------------------
# Derivatives when the arrival order decides the route: rank 0 takes every
# other rank's message in arrival order and weights the k-th arrival by c_k.
# The tangent of the k-th arrival must be its sender's, and the gradient of a
# sender is c_(its slot): both follow the realised route, read from the
# statuses (and shared with mpi4py to build the reference).
@pytest.mark.parametrize("jit", [False, True])
def test_many_to_one_tangents_follow_the_arrival(comm, rank, size, jit):
    x = jnp.asarray(local_data(rank, (2,), seed=6))
    v = jnp.asarray(local_data(rank, (2,), seed=7))
    c = jnp.arange(1.0, size)  # weight of the k-th arrival

    def program(x):
        if rank != 0:
            send(jnp.sin(x), 0, tag=rank, comm=comm)
            return jnp.zeros(()), jnp.zeros((0,), jnp.int32)
        total, sources = jnp.zeros(()), []
        for k in range(size - 1):
            y, st = recv(x * 0, ANY_SOURCE, tag=ANY_TAG, comm=comm, return_status=True)
            total = total + c[k] * jnp.sum(y)
            sources.append(st.source)
        return total, jnp.stack(sources) if sources else jnp.zeros((0,), jnp.int32)

    wrap = jax.jit if jit else (lambda f: f)
    (value, sources), (tangent, _) = wrap(lambda x, v: jax.jvp(program, (x,), (v,)))(x, v)
    order = comm.bcast([int(s) for s in np.asarray(sources)] if rank == 0 else None, root=0)
    G, V = gather_global(x, comm), gather_global(v, comm)
    if rank == 0:
        assert sorted(order) == list(range(1, size))
        np.testing.assert_allclose(value, sum(c[k] * np.sum(np.sin(G[s])) for k, s in enumerate(order)), rtol=1e-14)
        np.testing.assert_allclose(
            tangent, sum(c[k] * np.sum(np.cos(G[s]) * V[s]) for k, s in enumerate(order)), rtol=1e-13)
    assert_in_step(comm)


def test_many_to_one_grad_with_recorded_order(comm, rank, size):
    """The gradient against the reference built from the statuses of the same run."""
    x = jnp.asarray(local_data(rank, (2,), seed=8))
    c = jnp.arange(2.0, size + 1)

    def program(x):
        if rank != 0:
            send(jnp.sin(x) * x, 0, tag=rank, comm=comm)
            return jnp.zeros(()), jnp.zeros((0,), jnp.int32)
        total, sources = jnp.zeros(()), []
        for k in range(size - 1):
            y, st = recv(x * 0, ANY_SOURCE, tag=ANY_TAG, comm=comm, return_status=True)
            total = total + c[k] * jnp.sum(y)
            sources.append(st.source)
        return total, jnp.stack(sources) if sources else jnp.zeros((0,), jnp.int32)

    grad, sources = jax.jit(jax.grad(program, has_aux=True))(x)
    order = comm.bcast([int(s) for s in np.asarray(sources)] if rank == 0 else None, root=0)
    G = gather_global(x, comm)
    ref = np.zeros_like(G)
    for k, s in enumerate(order):
        ref[s] = c[k] * (np.cos(G[s]) * G[s] + np.sin(G[s]))
    np.testing.assert_allclose(grad, ref[rank], rtol=1e-13, atol=1e-15)
    assert_in_step(comm)


def test_linear_transpose_of_a_wildcard_receive_raises_on_every_rank(comm, rank, size):
    """No forward pass, no recorded route: a clear error at trace time, before any message."""
    x = jnp.ones(3)
    right = (rank + 1) % size
    with pytest.raises(ValueError, match="reverse route"):
        jax.linear_transpose(lambda t: recv(t, ANY_SOURCE, comm=comm), x)(x)
    with pytest.raises(ValueError, match="reverse route"):
        jax.linear_transpose(lambda t: sendrecv(t, t, right, right, recvtag=ANY_TAG, comm=comm), x)(x)
    assert_in_step(comm)


# ---------------------------------------------------------------------------
# Checks and bad input
def test_every_call_check_mode_with_wildcards(comm, rank, size):
    configure(check="every-call")
    try:
        left, right = (rank - 1) % size, (rank + 1) % size
        x = jnp.asarray(local_data(rank))
        y, st = sendrecv(x, x, ANY_SOURCE, right, recvtag=ANY_TAG, sendtag=rank, comm=comm, return_status=True)
        np.testing.assert_array_equal(y, gather_global(x, comm)[left])
        assert ints(st) == (left, left, 3)
        y = jax.jit(lambda a: sendrecv(a, a, ANY_SOURCE, right, comm=comm))(x)
        np.testing.assert_array_equal(y, gather_global(x, comm)[left])
        # A mismatch (the sender's dtype) is an error on both sides.
        if size > 1:
            if rank == 0:
                failure = failure_of(lambda: recv(jnp.zeros(3), ANY_SOURCE, comm=comm), "mismatch")
            elif rank == 1:
                failure = failure_of(lambda: send(jnp.zeros(3, jnp.int32), 0, comm=comm), "mismatch")
            else:
                failure = ""
            assert_no_failures(failure, comm)
    finally:
        configure(check="first-run")
    assert_in_step(comm)


def test_bad_wildcard_input_raises_on_every_rank(comm, rank, size):
    x = jnp.ones(2)
    with pytest.raises(ValueError, match=r"source=-5 is not a rank"):
        recv(x, -5, comm=comm)
    with pytest.raises(ValueError, match=r"dest=.* is not a rank"):
        send(x, ANY_SOURCE, comm=comm)
    with pytest.raises(ValueError, match=r"dest=.* is not a rank"):
        sendrecv(x, x, 0, ANY_SOURCE, comm=comm)
    with pytest.raises(ValueError, match=r"sendtag=-1 out of range"):
        sendrecv(x, x, ANY_SOURCE, 0, sendtag=ANY_TAG, comm=comm)
    with pytest.raises(ValueError, match=r"tag=-1 out of range"):
        send(x, 0, tag=ANY_TAG, comm=comm)
    with pytest.raises(ValueError, match=r"tag=-7 out of range"):
        recv(x, ANY_SOURCE, tag=-7, comm=comm)
    with pytest.raises(TypeError, match="static Python int"):
        jax.jit(lambda s: recv(x, s, comm=comm))(ANY_SOURCE)
    assert_in_step(comm)


def test_mpi_constants_are_exported():
    assert ANY_SOURCE == MPI.ANY_SOURCE and ANY_TAG == MPI.ANY_TAG
