"""comm.overlap: values, derivatives in both modes and vmap against the stacked
single-process reference, and the compiled schedule (the work between the
start and the wait, forward and backward)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import distlinalg as dl
from distlinalg import comm as C
from distlinalg.comm.overlap import fence
from conftest import gather_global


def work(m):
    """Matrix products: work XLA would otherwise place anywhere."""
    for _ in range(3):
        m = jnp.tanh(m @ m)
    return m


def schedule(fun, *args):
    """The compiled entry computation's order of distlinalg calls and matrix products."""
    text = jax.jit(fun).lower(*args).compile().as_text()
    entry = text[text.index("ENTRY"):]
    order = []
    for line in entry.splitlines()[1:]:
        target = re.search(r'custom_call_target="distlinalg_(\w+)"', line)
        if target:
            order.append(target.group(1))
        elif re.search(r"= \S+ dot\(", line) or ("__ynn_fusion" in line and "dot_general" in line):
            order.append("dot")  # XLA's dot, or YNN's matmul (distlinalg keeps YNN's individual dots)
    return order


def between(order, first, last):
    """The entries strictly between the first `first` and the first `last` after it."""
    i = order.index(first)
    return order[i + 1 : order.index(last, i)]


def test_overlap_values(comm, rank, size):
    x = jnp.arange(5.0) + rank
    m = jnp.eye(4) * (rank + 1.0)
    G = gather_global(x, comm)
    for run in (lambda f: f, jax.jit):
        total, out = run(lambda x, m: C.overlap(C.iallreduce(x, comm=comm), work, m))(x, m)
        np.testing.assert_allclose(total, G.sum(0), rtol=1e-13)
        np.testing.assert_allclose(out, work(m), rtol=1e-13)


def test_overlap_of_several_requests_ring(comm, rank, size):
    """isend right, irecv from the left and an iallgather at once; the results in request order."""
    right, left = (rank + 1) % size, (rank - 1) % size
    a = jnp.arange(3.0) * (rank + 1)

    def f(a):
        requests = [C.irecv(a, left, comm=comm), C.isend(a, right, comm=comm), C.iallgather(a, comm=comm)]
        (received, sent, gathered), out = C.overlap(requests, jnp.sin, a)
        assert sent is None
        return received, gathered, out

    received, gathered, out = jax.jit(f)(a)
    G = gather_global(a, comm)
    np.testing.assert_allclose(received, G[left])
    np.testing.assert_allclose(gathered, G)
    np.testing.assert_allclose(out, np.sin(a))


def test_ring_gradient_is_two_with_overlap(comm, rank, size):
    """mpi4torch's ring, the computation between start and wait pinned: d/da Σ_ranks Σ(a + b) = 2."""
    right, left = (rank + 1) % size, (rank - 1) % size

    def loss(a):
        (b, _), doubled = C.overlap([C.irecv(a, left, comm=comm), C.isend(a, right, comm=comm)], lambda a: 2 * a, a)
        return C.allreduce(jnp.sum(a + b + 0 * doubled), comm=comm)

    a = jnp.arange(4.0) + rank
    g = jax.jit(dl.ad.grad(loss, sharded=0, comm=comm))(a)
    np.testing.assert_allclose(g, 2.0)


def test_overlap_derivatives_both_modes_and_vmap(comm, rank, size):
    """L = Σ_r Σ_i s_i sin(x_{r,i}) with s = Σ_r x_r reduced while sin runs."""
    rng = np.random.default_rng(3)
    X, T = rng.standard_normal((size, 4)), rng.standard_normal((size, 4))
    x, t = jnp.asarray(X[rank]), jnp.asarray(T[rank])

    def loss(x):
        s, out = C.overlap(C.iallreduce(x, comm=comm), jnp.sin, x)
        return C.allreduce(jnp.sum(s * out), comm=comm)

    def reference(G):
        return jnp.sum(G.sum(0) * jnp.sin(G))

    value, slope = jax.jit(lambda x, t: jax.jvp(loss, (x,), (t,)))(x, t)
    expected_value, expected_slope = jax.jvp(reference, (jnp.asarray(X),), (jnp.asarray(T),))
    np.testing.assert_allclose(value, expected_value, rtol=1e-13)
    np.testing.assert_allclose(slope, expected_slope, rtol=1e-13)
    g = jax.jit(dl.ad.grad(loss, sharded=0, comm=comm))(x)
    np.testing.assert_allclose(g, jax.grad(reference)(jnp.asarray(X))[rank], rtol=1e-13)
    batch = jnp.stack([x, 2 * x])
    values = jax.jit(jax.vmap(loss))(batch)
    np.testing.assert_allclose(values, [reference(jnp.asarray(X)), reference(2 * jnp.asarray(X))], rtol=1e-13)


def test_work_is_scheduled_between_start_and_wait(comm, handlers_on_one_rank):
    """Without the fences XLA runs the wait among the products (jax 0.10, CPU); with them
    the products lie between the start and the wait, forward, in the JVP and in reverse."""
    x, m = jnp.ones(64), jnp.eye(32) * 0.5

    def f(x, m):
        y, out = C.overlap(C.iallreduce(x, comm=comm), work, m)
        return jnp.sum(y**2) + jnp.sum(out**2)

    forward = schedule(f, x, m)
    assert between(forward, "iallreduce", "wait").count("dot") == 3, forward
    tangent = schedule(lambda x, m, t, u: jax.jvp(f, (x, m), (t, u))[1], x, m, x, m)
    assert between(tangent, "iallreduce", "wait").count("dot") == 9, tangent
    reverse = schedule(jax.grad(f, argnums=(0, 1)), x, m)
    second = reverse.index("iallreduce", reverse.index("wait"))  # the adjoint reduction
    assert reverse[:second].count("dot") == 3 and between(reverse[second - 1:], "iallreduce", "wait").count("dot") == 6, \
        reverse


def test_pipelined_cg_matvec_runs_while_its_reduction_travels(comm, handlers_on_one_rank):
    """The loop body of cg(method="pipelined") on the 2-D Laplacian: the stencil
    (a fusion that subtracts the neighbours) between the iallreduce and its wait,
    the body's last wait (the halo's waits come before it)."""
    A = dl.operators.laplacian_2d(16, comm=comm)
    b = jnp.ones(A.input_structure.shape)
    text = jax.jit(lambda A, b: dl.cg(A, b, method="pipelined", comm=comm)[0]).lower(A, b).compile().as_text()
    bodies = [c for c in re.split(r"\n(?=\S)", text) if "distlinalg_iallreduce" in c and "distlinalg_wait" in c]
    assert len(bodies) == 1
    order = []
    for line in bodies[0].splitlines():
        target = re.search(r'custom_call_target="distlinalg_(\w+)"', line)
        fusion = re.match(r"\s+%(\S*subtract\S*) = .* fusion\(", line)
        if target or fusion:
            order.append(target.group(1) if target else "stencil")
    last_wait = len(order) - 1 - order[::-1].index("wait")
    assert order.index("iallreduce") < order.index("stencil") < last_wait, order


def test_overlap_rejects_what_is_not_a_request(comm):
    with pytest.raises(TypeError, match="expected a Request"):
        C.overlap(jnp.ones(3), jnp.sin, jnp.ones(3))
    request = C.iallreduce(jnp.ones(2), comm=comm)
    with pytest.raises(TypeError, match="expected a Request"):
        C.overlap([request, "request"], jnp.sin, jnp.ones(3))
    np.testing.assert_allclose(C.wait(request), C.size(comm=comm))  # nothing was waited for


def test_overlap_without_requests_and_eager_fence(comm):
    assert C.overlap([], jnp.sin, jnp.zeros(2))[0] == []
    x = jnp.arange(3.0)
    assert fence(x) is x  # eagerly a no-op
    np.testing.assert_array_equal(jax.jit(fence)(x), x)
