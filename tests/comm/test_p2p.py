"""Point-to-point: sendrecv, send, recv — values, AD against the stacked global program, vmap,
control flow, the derivative-message protocol's edge cases, and bad input."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import distlinalg
from distlinalg._runtime.mpi import PROC_NULL, TANGENT_TAG_FLAG, configure, resolve_comm
from distlinalg.comm.allreduce import allreduce
from distlinalg.comm.p2p import recv, send, sendrecv
from conftest import assert_no_failures, failure_of, gather_global

DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "float16", "bfloat16", "float32", "float64", "complex64", "complex128"]


def local_data(rank, shape=(3,), seed=0):
    return np.random.default_rng(1000 * seed + rank).standard_normal(shape)


def chain_neighbours(rank, size):
    """Non-periodic chain: (left, right), PROC_NULL past the ends."""
    left = rank - 1 if rank > 0 else PROC_NULL
    right = rank + 1 if rank < size - 1 else PROC_NULL
    return left, right


def assert_in_step(comm):
    """A final collective: every rank is still at the same point of the program."""
    np.testing.assert_allclose(allreduce(jnp.ones(1), comm=comm), [comm.Get_size()])


# ---------------------------------------------------------------------------
# Values
@pytest.mark.parametrize("jit", [False, True])
def test_ring_shift(comm, rank, size, jit):
    x = jnp.asarray(local_data(rank, (2, 3)))
    fn = lambda a: sendrecv(a, jnp.zeros_like(a), (rank - 1) % size, (rank + 1) % size, comm=comm)  # noqa: E731
    out = (jax.jit(fn) if jit else fn)(x)
    G = gather_global(x, comm)
    np.testing.assert_array_equal(out, G[(rank - 1) % size])
    # Backwards round the ring, other tags.
    back = sendrecv(x, x, (rank + 1) % size, (rank - 1) % size, sendtag=7, recvtag=7, comm=comm)
    np.testing.assert_array_equal(back, G[(rank + 1) % size])


@pytest.mark.parametrize("dtype", DTYPES)
def test_ring_shift_dtypes(comm, rank, size, dtype):
    raw = np.arange(4) + 3 * rank
    x = jnp.asarray(raw % 2 == 0 if dtype == "bool" else raw, dtype)
    out = sendrecv(x, x, (rank - 1) % size, (rank + 1) % size, comm=comm)
    assert out.dtype == x.dtype
    G = gather_global(np.asarray(x, np.float64 if dtype in ("bfloat16", "float16") else None), comm)
    np.testing.assert_array_equal(np.asarray(out, G.dtype), G[(rank - 1) % size])
    # send/recv round the ring: even ranks send first, odd ranks receive first (no cycle).
    if size > 1:
        if rank % 2 == 0:
            send(x, (rank + 1) % size, comm=comm)
            got = recv(x, (rank - 1) % size, comm=comm)
        else:
            got = recv(x, (rank - 1) % size, comm=comm)
            send(x, (rank + 1) % size, comm=comm)
        np.testing.assert_array_equal(np.asarray(got, G.dtype), G[(rank - 1) % size])
        assert got.dtype == x.dtype


def test_proc_null_chain(comm, rank, size):
    left, right = chain_neighbours(rank, size)
    x = jnp.asarray(local_data(rank))
    template = jnp.full(3, -5.0)
    G = gather_global(x, comm)
    for fn in (lambda a: sendrecv(a, template, left, right, comm=comm),
               jax.jit(lambda a: sendrecv(a, template, left, right, comm=comm))):
        out = fn(x)
        np.testing.assert_array_equal(out, template if rank == 0 else G[rank - 1])
    # Both ends PROC_NULL: nothing moves, the template comes back.
    np.testing.assert_array_equal(sendrecv(x, template, PROC_NULL, PROC_NULL, comm=comm), template)
    np.testing.assert_array_equal(recv(template, MPI.PROC_NULL, comm=comm), template)
    assert send(x, PROC_NULL, comm=comm) is None
    assert_in_step(comm)


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.complex128, jnp.float16, jnp.int32])
def test_shorter_message_keeps_the_template_tail_with_a_status(comm, rank, size, dtype):
    """With return_status=True a message shorter than the template fills its head, the rest
    keeps the template's values, and the status counts what arrived."""
    left, right = chain_neighbours(rank, size)
    x = jnp.asarray(np.arange(3) + 10 * rank).astype(dtype)
    template = jnp.asarray(-1 - np.arange(5)).astype(dtype)
    expected = np.asarray(template).copy()
    if left != PROC_NULL:
        expected[:3] = np.arange(3) + 10 * left
    count = 0 if left == PROC_NULL else 3
    failures = []
    for fn in (lambda a, t: sendrecv(a, t, left, right, comm=comm, return_status=True),
               jax.jit(lambda a, t: sendrecv(a, t, left, right, comm=comm, return_status=True))):
        got, status = fn(x, template)
        if not np.array_equal(np.asarray(got), expected) or int(status.count) != count:
            failures.append(f"sendrecv gave {got} ({int(status.count)}), expected {expected} ({count})")
    # recv: the chain again, in send/recv pairs (even ranks send first).
    if rank % 2 == 0:
        send(x, right, tag=4, comm=comm)
        got, status = recv(template, left, tag=4, comm=comm, return_status=True)
    else:
        got, status = jax.jit(lambda t: recv(t, left, tag=4, comm=comm, return_status=True))(template)
        send(x, right, tag=4, comm=comm)
    if not np.array_equal(np.asarray(got), expected) or int(status.count) != count:
        failures.append(f"recv gave {got} ({int(status.count)}), expected {expected} ({count})")
    assert_no_failures("; ".join(failures), comm)


@pytest.mark.parametrize("case", ["sendrecv", "sendrecv-jit", "recv", "recv-jit", "recv-any-source", "vmap",
                                  "pytree"])
def test_message_of_another_size_is_an_error_on_the_receiving_rank(comm, rank, size, case):
    """A plain receive whose message has another element count than its template (a shorter
    one would leave the template's tail in the result, a longer one is truncated) raises on
    the receiving rank with both sizes; the sending rank of a one-way message goes on."""
    if size == 1:
        pytest.skip("needs two ranks")
    partner = {0: 1, 1: 0}.get(rank)
    n = 3 if rank == 0 else 4  # rank 0's messages are shorter than rank 1's templates
    # What each rank of the pair reads: rank 1 a short message, rank 0 a long one.
    sizes = {"vmap": (4, 6)}.get(case, (3, 4))
    short = f"has {sizes[0]} elements of float64, the receive template {sizes[1]}"
    long = f"longer than the receive template of {sizes[0]} elements of float64"
    expected = {0: long, 1: short}.get(rank)
    if case == "sendrecv":
        call = lambda: sendrecv(jnp.ones(n), jnp.zeros(n), partner, partner, comm=comm)  # noqa: E731
    elif case == "sendrecv-jit":
        call = lambda: jax.jit(lambda a, b: sendrecv(a, b, partner, partner, comm=comm))(  # noqa: E731
            jnp.ones(n), jnp.zeros(n))
    elif case == "vmap":  # the batch is part of the message: 2 lanes of 2 against 3
        lanes = 2 if rank == 0 else 3
        call = lambda: jax.vmap(lambda a: sendrecv(a, a * 0, partner, partner, comm=comm))(  # noqa: E731
            jnp.ones((lanes, 2)))
    elif case == "pytree":  # the second leaf differs
        call = lambda: sendrecv({"a": jnp.ones(2), "b": jnp.ones(n)},  # noqa: E731
                                {"a": jnp.zeros(2), "b": jnp.zeros(n)}, partner, partner, comm=comm)
    else:  # one way: rank 0 sends 3 elements, rank 1 receives into 4; rank 0 goes on
        receive = {"recv": lambda t: recv(t, 0, comm=comm),
                   "recv-jit": jax.jit(lambda t: recv(t, 0, comm=comm)),
                   "recv-any-source": lambda t: recv(t, MPI.ANY_SOURCE, comm=comm)}[case]
        call = (lambda: send(jnp.ones(3), 1, comm=comm)) if rank == 0 else lambda: receive(jnp.zeros(4))
        expected = short if rank == 1 else None
    if partner is None:  # ranks beyond the pair exchange nothing
        failure = ""
    elif expected is None:
        call()
        failure = ""
    else:
        failure = failure_of(lambda: jax.block_until_ready(call()), re.escape(expected))
    assert_no_failures(failure, comm)
    assert_in_step(comm)


def test_send_recv_pair(comm, rank, size):
    if size < 2:
        np.testing.assert_array_equal(recv(jnp.ones(2), PROC_NULL, comm=comm), np.ones(2))
        pytest.skip("needs 2 ranks for a pair")
    payload = {"a": jnp.arange(4.0), "b": (jnp.arange(6, dtype=jnp.int32).reshape(2, 3),)}
    send_returned_none, received = None, None
    if rank == 0:
        send_returned_none = send(payload, 1, tag=3, comm=comm) is None
        jax.jit(lambda p: send(p, 1, tag=9, comm=comm))(jax.tree.map(lambda v: v + 1, payload))
    elif rank == 1:
        template = jax.tree.map(jnp.zeros_like, payload)
        got = recv(template, 0, tag=3, comm=comm)
        got2 = jax.jit(lambda t: recv(t, 0, tag=9, comm=comm))(template)
        received = [np.asarray(a) for a in jax.tree.leaves(got) + jax.tree.leaves(got2)]
    # Both ends' results are checked on every rank, so a failure fails every rank alike.
    assert comm.bcast(send_returned_none, root=0)
    sent = [np.asarray(v) for v in jax.tree.leaves(payload)]
    for a, b in zip(comm.bcast(received, root=1), sent + [v + 1 for v in sent], strict=True):
        np.testing.assert_array_equal(a, b)
        assert a.dtype == b.dtype


def test_sendrecv_pytree_and_mixed_shapes(comm, rank, size):
    tree = {"u": jnp.full((2,), float(rank)), "v": [jnp.arange(3) + rank]}
    templ = {"u": jnp.zeros(2), "v": [jnp.zeros(3, jnp.int64)]}
    out = sendrecv(tree, templ, (rank - 1) % size, (rank + 1) % size, comm=comm)
    np.testing.assert_array_equal(out["u"], np.full(2, (rank - 1) % size))
    np.testing.assert_array_equal(out["v"][0], np.arange(3) + (rank - 1) % size)
    # Send and receive shapes may differ (what arrives is described by the template).
    got = sendrecv(jnp.ones(5) * rank, jnp.zeros(5), (rank + 1) % size, (rank - 1) % size, comm=comm)
    np.testing.assert_array_equal(got, np.ones(5) * ((rank + 1) % size))


# ---------------------------------------------------------------------------
# AD of sendrecv against the stacked global program
def ring(x, comm, rank, size):
    return sendrecv(x, jnp.zeros_like(x), (rank - 1) % size, (rank + 1) % size, comm=comm)


def ring_reference(G):
    return jnp.roll(G, 1, axis=0)


def chain(x, comm, rank, size):
    left, right = chain_neighbours(rank, size)
    return sendrecv(jnp.sin(x), 2 * x, left, right, comm=comm)  # rank 0 keeps its template 2x


def chain_reference(G):
    return jnp.concatenate([2 * G[:1], jnp.sin(G[:-1])], axis=0)


def backward_chain(x, comm, rank, size):
    left, right = chain_neighbours(rank, size)
    return sendrecv(x**2, x + 1, right, left, sendtag=4, recvtag=4, comm=comm)


def backward_chain_reference(G):
    return jnp.concatenate([G[1:] ** 2, G[-1:] + 1], axis=0)


CASES = {"ring": (ring, ring_reference), "chain": (chain, chain_reference),
         "backward-chain": (backward_chain, backward_chain_reference)}


@pytest.mark.parametrize("name", list(CASES))
def test_sendrecv_derivatives_against_stacked_reference(comm, rank, size, name):
    local, reference = CASES[name]
    fn = lambda a: local(a, comm, rank, size)  # noqa: E731
    x = jnp.asarray(local_data(rank))
    G = jnp.asarray(gather_global(x, comm))
    np.testing.assert_allclose(fn(x), reference(G)[rank], rtol=1e-14)

    xdot = jnp.asarray(local_data(rank, seed=1))
    _, tangent = jax.jvp(fn, (x,), (xdot,))
    _, ref_tangent = jax.jvp(reference, (G,), (jnp.asarray(gather_global(xdot, comm)),))
    np.testing.assert_allclose(tangent, ref_tangent[rank], rtol=1e-13, atol=1e-15)
    _, tangent_jit = jax.jit(lambda a, t: jax.jvp(fn, (a,), (t,)))(x, xdot)
    np.testing.assert_allclose(tangent_jit, ref_tangent[rank], rtol=1e-13, atol=1e-15)

    ct = jnp.asarray(local_data(rank, seed=2))
    _, vjp = jax.vjp(fn, x)
    _, ref_vjp = jax.vjp(reference, G)
    expected = ref_vjp(jnp.asarray(gather_global(ct, comm)))[0][rank]
    np.testing.assert_allclose(vjp(ct)[0], expected, rtol=1e-13, atol=1e-15)
    grad = jax.jit(jax.grad(lambda a: jnp.sum(ct * fn(a))))(x)
    np.testing.assert_allclose(grad, expected, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("name", list(CASES))
def test_sendrecv_second_order(comm, rank, size, name):
    """Hessian-vector products (forward over reverse) and jax.hessian."""
    local, reference = CASES[name]
    x = jnp.asarray(local_data(rank))
    G = jnp.asarray(gather_global(x, comm))
    w = jnp.asarray(local_data(rank, seed=3))
    W = jnp.asarray(gather_global(w, comm))
    v = jnp.asarray(local_data(rank, seed=4))

    loss = lambda a: jnp.sum(w * jnp.sin(local(a, comm, rank, size)))  # noqa: E731
    global_loss = lambda g: jnp.sum(W * jnp.sin(reference(g)))  # noqa: E731
    _, hvp = jax.jvp(jax.grad(loss), (x,), (v,))
    _, ref_hvp = jax.jvp(jax.grad(global_loss), (G,), (jnp.asarray(gather_global(v, comm)),))
    np.testing.assert_allclose(hvp, ref_hvp[rank], rtol=1e-12, atol=1e-14)
    # Reverse over reverse as well.
    g2 = jax.grad(lambda a: jnp.sum(v * jax.grad(loss)(a)))(x)
    ref_g2 = jax.grad(lambda g: jnp.sum(jnp.asarray(gather_global(v, comm)) * jax.grad(global_loss)(g)))(G)
    np.testing.assert_allclose(g2, ref_g2[rank], rtol=1e-12, atol=1e-14)


def test_halo_exchange_in_fori_loop(comm, rank, size):
    """Jacobi smoothing of a 1-D field split across ranks, halos by sendrecv, vs the global stencil."""
    n_local, steps = 4, 5
    glob = np.cos(np.arange(n_local * size) * 0.9) + 0.1 * np.arange(n_local * size)
    mine = slice(rank * n_local, (rank + 1) * n_local)
    x = jnp.asarray(glob[mine])
    left, right = chain_neighbours(rank, size)
    boundary = 0.5  # Dirichlet value outside the global domain

    def smooth(u):
        def step(_, u):
            edge = jnp.full(1, boundary)
            from_left = sendrecv(u[-1:], edge, left, right, sendtag=1, recvtag=1, comm=comm)
            from_right = sendrecv(u[:1], edge, right, left, sendtag=2, recvtag=2, comm=comm)
            padded = jnp.concatenate([from_left, u, from_right])
            return 0.5 * u + 0.25 * (padded[:-2] + padded[2:]) + 0.1 * jnp.sin(u)

        return jax.lax.fori_loop(0, steps, step, u)

    def reference(g):
        for _ in range(steps):
            p = jnp.concatenate([jnp.full(1, boundary), g, jnp.full(1, boundary)])
            g = 0.5 * g + 0.25 * (p[:-2] + p[2:]) + 0.1 * jnp.sin(g)
        return g

    out = jax.jit(smooth)(x)
    np.testing.assert_allclose(out, reference(jnp.asarray(glob))[mine], rtol=1e-13)

    weights = jnp.asarray(np.sin(np.arange(n_local * size) + 1.0))
    grad = jax.jit(jax.grad(lambda u: jnp.sum(weights[mine] * smooth(u))))(x)
    ref = jax.grad(lambda g: jnp.sum(weights * reference(g)))(jnp.asarray(glob))
    np.testing.assert_allclose(grad, ref[mine], rtol=1e-12, atol=1e-14)

    v = jnp.asarray(local_data(rank, (n_local,), seed=5))
    _, tangent = jax.jit(lambda u, t: jax.jvp(smooth, (u,), (t,)))(x, v)
    _, ref_tangent = jax.jvp(reference, (jnp.asarray(glob),), (jnp.asarray(gather_global(v, comm)).reshape(-1),))
    np.testing.assert_allclose(tangent, ref_tangent[mine], rtol=1e-12, atol=1e-14)

    # The same in lax.scan, differentiated through the loop.
    def smooth_scan(u):
        def body(u, _):
            e = jnp.full(1, boundary)
            pad = jnp.concatenate([sendrecv(u[-1:], e, left, right, comm=comm), u,
                                   sendrecv(u[:1], e, right, left, comm=comm)])
            return 0.5 * u + 0.25 * (pad[:-2] + pad[2:]) + 0.1 * jnp.sin(u), None

        return jax.lax.scan(body, u, None, length=steps)[0]

    grad_scan = jax.grad(lambda u: jnp.sum(weights[mine] * smooth_scan(u)))(x)
    np.testing.assert_allclose(grad_scan, ref[mine], rtol=1e-12, atol=1e-14)
    # Rematerialised (every rank recomputes its exchanges in the backward pass).
    grad_remat = jax.jit(jax.grad(lambda u: jnp.sum(weights[mine] * jax.checkpoint(smooth)(u))))(x)
    np.testing.assert_allclose(grad_remat, ref[mine], rtol=1e-12, atol=1e-14)


def test_template_cotangent_where_source_is_proc_null(comm, rank, size):
    """y = template on the rank receiving from PROC_NULL: its cotangent goes to the template."""
    left, right = chain_neighbours(rank, size)
    x = jnp.asarray(local_data(rank))
    t = jnp.asarray(local_data(rank, seed=6))
    fn = lambda a, b: sendrecv(a, b, left, right, comm=comm)  # noqa: E731
    ct = jnp.asarray(local_data(rank, seed=7))
    _, vjp = jax.vjp(fn, x, t)
    gx, gt = vjp(ct)
    CT = gather_global(ct, comm)
    np.testing.assert_allclose(gt, ct if rank == 0 else np.zeros(3))
    np.testing.assert_allclose(gx, CT[rank + 1] if rank < size - 1 else np.zeros(3))


# ---------------------------------------------------------------------------
# send / recv AD
def pair_program(comm, rank, template_fn):
    """Rank 0 sends sin(x) to rank 1 (tag 5), which returns the sum of squares of what arrives."""

    def program(x):
        if rank == 0:
            send(jnp.sin(x), 1, tag=5, comm=comm)
            return 3.0 * jnp.sum(x)  # rank 0's own output
        if rank == 1:
            got = recv(template_fn(x), 0, tag=5, comm=comm)
            return jnp.sum(got**2 * x)
        return jnp.sum(x)

    def reference(G):  # the stacked global program: rank r's output
        outs = [3.0 * jnp.sum(G[0]), jnp.sum(jnp.sin(G[0]) ** 2 * G[1])]
        outs += [jnp.sum(G[r]) for r in range(2, G.shape[0])]
        return jnp.stack(outs)

    return program, reference


@pytest.mark.parametrize("template", ["x*0", "zeros_like+0x", "jnp.zeros_like(x)*x"])
def test_send_recv_derivatives_supported_pattern(comm, rank, size, template):
    if size < 2:
        pytest.skip("needs a pair of ranks")
    template_fn = {"x*0": lambda x: x * 0, "zeros_like+0x": lambda x: jnp.zeros_like(x) + 0 * x,
                   "jnp.zeros_like(x)*x": lambda x: jnp.zeros_like(x) * x}[template]
    program, reference = pair_program(comm, rank, template_fn)
    x = jnp.asarray(local_data(rank))
    G = jnp.asarray(gather_global(x, comm))
    np.testing.assert_allclose(program(x), reference(G)[rank], rtol=1e-14)

    xdot = jnp.asarray(local_data(rank, seed=1))
    Gdot = jnp.asarray(gather_global(xdot, comm))
    _, ref_tangent = jax.jvp(reference, (G,), (Gdot,))
    for jvp in (lambda a, t: jax.jvp(program, (a,), (t,)), jax.jit(lambda a, t: jax.jvp(program, (a,), (t,)))):
        _, tangent = jvp(x, xdot)
        np.testing.assert_allclose(tangent, ref_tangent[rank], rtol=1e-13)

    seed = float(rank + 2)  # rank-dependent cotangent of rank r's output
    seeds = jnp.asarray(gather_global(np.asarray(seed), comm))
    ref_grad = jax.grad(lambda g: jnp.sum(seeds * reference(g)))(G)[rank]
    for grad in (jax.grad(lambda a: seed * program(a)), jax.jit(jax.grad(lambda a: seed * program(a)))):
        np.testing.assert_allclose(grad(x), ref_grad, rtol=1e-13)
    assert_in_step(comm)


def test_send_recv_linearize_and_linear_transpose(comm, rank, size):
    if size < 2:
        pytest.skip("needs a pair of ranks")
    program, reference = pair_program(comm, rank, lambda x: x * 0)
    x = jnp.asarray(local_data(rank))
    G = jnp.asarray(gather_global(x, comm))
    _, lin = jax.linearize(program, x)
    _, ref_lin = jax.linearize(reference, G)
    v = jnp.asarray(local_data(rank, seed=3))
    np.testing.assert_allclose(lin(v), ref_lin(jnp.asarray(gather_global(v, comm)))[rank], rtol=1e-13)
    (back,) = jax.linear_transpose(lin, x)(jnp.asarray(rank + 0.5))
    seeds = jnp.asarray(gather_global(np.asarray(rank + 0.5), comm))
    (ref_back,) = jax.linear_transpose(ref_lin, G)(seeds)
    np.testing.assert_allclose(back, ref_back[rank], rtol=1e-13)


def test_send_recv_second_order(comm, rank, size):
    if size < 2:
        pytest.skip("needs a pair of ranks")
    program, reference = pair_program(comm, rank, lambda x: x * 0)
    x = jnp.asarray(local_data(rank))
    G = jnp.asarray(gather_global(x, comm))
    v = jnp.asarray(local_data(rank, seed=8))
    V = jnp.asarray(gather_global(v, comm))
    _, hvp = jax.jvp(jax.grad(program), (x,), (v,))
    _, ref_hvp = jax.jvp(jax.grad(lambda g: jnp.sum(reference(g))), (G,), (V,))
    np.testing.assert_allclose(hvp, ref_hvp[rank], rtol=1e-12, atol=1e-14)
    # Reverse over reverse, and the full Hessian (forward over reverse, jitted).
    g2 = jax.grad(lambda a: jnp.sum(v * jax.grad(program)(a)))(x)
    np.testing.assert_allclose(g2, ref_hvp[rank], rtol=1e-12, atol=1e-14)
    hess = jax.jit(jax.hessian(program))(x)
    ref_hess = jax.hessian(lambda g: jnp.sum(reference(g)))(G)
    # jax.hessian moves every rank's input along the same basis direction at
    # once, so rank r sees the sum over s of the blocks H[r, :, s, :].
    np.testing.assert_allclose(hess, ref_hess[rank].sum(axis=1), rtol=1e-12, atol=1e-14)


def test_differentiated_recv_from_constant_sender(comm, rank, size):
    """The sender's value does not depend on the inputs: zero tangent, nothing left unmatched."""
    if size < 2:
        pytest.skip("needs a pair of ranks")
    const = jnp.arange(3.0) + 1

    def program(x):
        if rank == 0:
            send(const, 1, tag=2, comm=comm)  # constant: its send is not differentiated
            return jnp.sum(x**2)
        if rank == 1:
            return jnp.sum(recv(x * 0, 0, tag=2, comm=comm) * x)
        return jnp.sum(x)

    x = jnp.asarray(local_data(rank))
    expected_grad = {0: 2 * x, 1: const}.get(rank, jnp.ones(3))
    np.testing.assert_allclose(jax.grad(program)(x), expected_grad, rtol=1e-14)
    np.testing.assert_allclose(jax.jit(jax.grad(program))(x), expected_grad, rtol=1e-14)
    xdot = jnp.asarray(local_data(rank, seed=1))
    _, tangent = jax.jvp(program, (x,), (xdot,))
    np.testing.assert_allclose(tangent, jnp.sum(expected_grad * xdot), rtol=1e-13)
    assert_in_step(comm)


def test_sendrecv_partner_with_constant_buffers(comm, rank, size):
    """Chain where rank 0 exchanges only constants (not differentiated): exact derivatives."""
    left, right = chain_neighbours(rank, size)
    c = jnp.asarray([1.0, -2.0, 0.5])

    def fn(x):
        if rank == 0:
            return sendrecv(c, c, left, right, comm=comm)  # no tangent on this rank at all
        return sendrecv(x**2, x, left, right, comm=comm)

    def reference(G):  # rank 0 keeps its template c, rank 1 receives c, rank r>1 x_{r-1}**2
        return jnp.stack([c] + [c if r == 1 else G[r - 1] ** 2 for r in range(1, G.shape[0])])

    x = jnp.asarray(local_data(rank))
    G = jnp.asarray(gather_global(x, comm))
    np.testing.assert_allclose(fn(x), reference(G)[rank])
    xdot = jnp.asarray(local_data(rank, seed=1))
    _, tangent = jax.jvp(fn, (x,), (xdot,))
    _, ref_tangent = jax.jvp(reference, (G,), (jnp.asarray(gather_global(xdot, comm)),))
    np.testing.assert_allclose(tangent, ref_tangent[rank], rtol=1e-13, atol=1e-15)
    ct = jnp.asarray(local_data(rank, seed=2))
    ref_grad = jax.vjp(reference, G)[1](jnp.asarray(gather_global(ct, comm)))[0][rank]
    np.testing.assert_allclose(jax.grad(lambda a: jnp.sum(ct * fn(a)))(x), ref_grad, rtol=1e-13, atol=1e-15)
    assert_in_step(comm)


def constant_template_program(comm, rank, steps=1):
    """Rank 0 sends its second-to-last entry to rank 1, which receives it into a template that
    carries no tangent (``jnp.empty_like``, as mpi4jax's shallow-water example), `steps` times
    in a loop; every rank returns the sum of cubes. The stacked global program is `reference`."""

    def step(x):
        if rank == 0:
            send(x[-2], 1, tag=6, comm=comm)
            return jnp.sin(x)
        if rank == 1:
            got = recv(jnp.empty_like(x[0]), 0, tag=6, comm=comm)
            return jnp.sin(x.at[0].set(got))
        return jnp.sin(x)

    def program(x, remat=False):
        body = jax.checkpoint(step) if remat else step
        x = body(x) if steps == 1 else jax.lax.fori_loop(0, steps, lambda i, x: body(x), x)
        return jnp.sum(x**3)

    def reference(G):
        for _ in range(steps):
            G = jnp.sin(G.at[1, 0].set(G[0, -2]))
        return jnp.sum(G**3, axis=1)

    return program, reference


@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("checked", [False, True])
def test_constant_template_receives_the_tangent(comm, rank, size, steps, checked):
    """The sender differentiates, the receiver's template is a constant (issue 67).

    The receive is differentiated all the same (comm/_core.ReceivingPrimitive): forward
    mode, reverse mode (jit, a loop, remat) and a Hessian-vector product equal the stacked
    single-process program's, with and without the every-call signature check."""
    if size < 2:
        pytest.skip("needs a pair of ranks")
    program, reference = constant_template_program(comm, rank, steps)
    x = jnp.asarray(local_data(rank))
    G = jnp.asarray(gather_global(x, comm))
    xdot = jnp.asarray(local_data(rank, seed=1))
    Gdot = jnp.asarray(gather_global(xdot, comm))
    _, ref_tangent = jax.jvp(reference, (G,), (Gdot,))
    seed = float(rank + 2)
    seeds = jnp.asarray(gather_global(np.asarray(seed), comm))
    ref_loss = lambda g: jnp.sum(seeds * reference(g))  # noqa: E731
    ref_grad = jax.grad(ref_loss)(G)[rank]
    ref_hvp = jax.jvp(jax.grad(ref_loss), (G,), (Gdot,))[1][rank]
    was_checking = distlinalg._native.settings()["check_signatures"]
    configure(check_signatures=checked)
    try:
        np.testing.assert_allclose(program(x), reference(G)[rank], rtol=1e-14)
        _, tangent = jax.jvp(program, (x,), (xdot,))
        np.testing.assert_allclose(tangent, ref_tangent[rank], rtol=1e-13, atol=1e-15)
        for remat in (False, True):
            loss = lambda a: seed * program(a, remat)  # noqa: E731,B023
            for grad in (jax.grad(loss), jax.jit(jax.grad(loss))):
                np.testing.assert_allclose(grad(x), ref_grad, rtol=1e-13, atol=1e-15)
        hvp = jax.jvp(jax.grad(lambda a: seed * program(a)), (x,), (xdot,))[1]
        np.testing.assert_allclose(hvp, ref_hvp, rtol=1e-12, atol=1e-14)
    finally:
        configure(check_signatures=was_checking)
    assert_in_step(comm)


def test_eager_protocol_messages_complete_at_the_call(comm, rank, size, monkeypatch):
    """The composite primitives of differentiated messages run to completion
    when called eagerly, as every eager operation does (issue 40).

    On an asynchronous backend (GPUs) an unfinished call returns before its
    handler has run: the checked mode's mismatch error of the flagged primal
    message then surfaced only after this rank had posted the tangent message,
    which its partner, having raised, never took (rank 0 of the test above hung).
    On the CPU a program runs at the call, so what is checked here is that the
    eager path waits for the results, whatever the backend."""
    from distlinalg.comm import _core, p2p

    finished = []
    run_eager = _core.run_eager

    def watched(program, args, comm=None):
        outs = run_eager(program, args, comm)
        finished.append(all(out.is_ready() for out in outs))
        return outs

    monkeypatch.setattr(_core, "run_eager", watched)
    x = jnp.asarray(local_data(rank))
    right, left = chain_neighbours(rank, size)
    y, delivered = p2p.flagged_sendrecv_p.bind(
        x, x * 0, comm=resolve_comm(comm), source=left, dest=right, sendtag=3, recvtag=3, depth=1
    )
    assert finished == [True]
    expected = np.zeros(3) if left == PROC_NULL else local_data(left)
    np.testing.assert_allclose(y, expected)
    assert bool(delivered[0]) == (left != PROC_NULL)


# ---------------------------------------------------------------------------
# vmap
@pytest.mark.parametrize("axis", [0, 1])
def test_vmap_sendrecv(comm, rank, size, axis):
    batch = [jnp.asarray(local_data(rank, (3,), seed=s)) for s in range(4)]
    xs = jnp.stack(batch, axis=axis)
    fn = lambda a: chain(a, comm, rank, size)  # noqa: E731
    out = jax.vmap(fn, in_axes=axis, out_axes=axis)(xs)
    np.testing.assert_allclose(out, jnp.stack([fn(b) for b in batch], axis=axis), rtol=1e-14)
    # Unbatched send buffer, batched template (and vice versa).
    left, right = chain_neighbours(rank, size)
    got = jax.vmap(lambda t: sendrecv(jnp.ones(3) * rank, t, left, right, comm=comm), in_axes=axis)(xs)
    expected = [b if rank == 0 else jnp.ones(3) * (rank - 1) for b in batch]
    np.testing.assert_allclose(got, jnp.stack(expected), rtol=1e-14)
    # vmap of grad and of jvp, jitted.
    w = jnp.asarray(local_data(rank, seed=9))
    grad = jax.grad(lambda a: jnp.sum(w * jnp.cos(fn(a))))
    grads = jax.jit(jax.vmap(grad, in_axes=axis))(xs)
    np.testing.assert_allclose(grads, jnp.stack([grad(b) for b in batch]), rtol=1e-13)
    jvp = lambda a: jax.jvp(fn, (a,), (jnp.ones(3),))[1]  # noqa: E731
    np.testing.assert_allclose(jax.vmap(jvp, in_axes=axis)(xs), jnp.stack([jvp(b) for b in batch]), rtol=1e-13)


def test_vmap_send_recv(comm, rank, size):
    if size < 2:
        pytest.skip("needs a pair of ranks")
    batch = [jnp.asarray(local_data(rank, (2,), seed=s)) for s in range(3)]
    xs = jnp.stack(batch, axis=1)  # batch on axis 1
    program, reference = pair_program(comm, rank, lambda x: x * 0)
    out = jax.vmap(program, in_axes=1)(xs)
    np.testing.assert_allclose(out, jnp.stack([program(b) for b in batch]), rtol=1e-14)
    grads = jax.vmap(jax.grad(program), in_axes=1)(xs)
    np.testing.assert_allclose(grads, jnp.stack([jax.grad(program)(b) for b in batch]), rtol=1e-13)
    assert_in_step(comm)


# ---------------------------------------------------------------------------
# Bad input
def test_bad_input_raises_on_every_rank(comm, rank, size):
    x = jnp.ones(2)
    with pytest.raises(ValueError, match=r"dest=.* is not a rank"):
        send(x, size, comm=comm)
    with pytest.raises(ValueError, match=r"dest=-3 is not a rank"):
        send(x, -3, comm=comm)
    with pytest.raises(ValueError, match=r"source=.* is not a rank"):
        recv(x, size + 1, comm=comm)
    with pytest.raises(ValueError, match=r"source=.* is not a rank"):
        sendrecv(x, x, size, 0, comm=comm)
    with pytest.raises(ValueError, match=r"dest=.* is not a rank"):
        sendrecv(x, x, 0, size, comm=comm)
    with pytest.raises(TypeError, match="static Python int"):
        send(x, jnp.int32(0), comm=comm)
    with pytest.raises(TypeError, match="static Python int"):
        recv(x, True, comm=comm)
    with pytest.raises(TypeError, match="static Python int"):
        jax.jit(lambda s: sendrecv(x, x, s, 0, comm=comm))(0)
    with pytest.raises(ValueError, match="tag=4096 out of range"):
        send(x, 0, tag=4096, comm=comm)
    # (tag=-1 is MPI.ANY_TAG in MPICH and Open MPI: a valid wildcard receive.)
    with pytest.raises(ValueError, match="tag=-5 out of range"):
        recv(x, 0, tag=-5, comm=comm)
    with pytest.raises(ValueError, match="sendtag=5000 out of range"):
        sendrecv(x, x, 0, 0, sendtag=5000, comm=comm)
    with pytest.raises(ValueError, match="recvtag=.* out of range"):
        sendrecv(x, x, 0, 0, recvtag=TANGENT_TAG_FLAG, comm=comm)
    with pytest.raises(TypeError, match="must be a Python int"):
        send(x, 0, tag=1.5, comm=comm)
    with pytest.raises(ValueError, match="same pytree structure"):
        sendrecv({"a": x}, [x], 0, 0, comm=comm)
    with pytest.raises(TypeError, match="unsupported dtype"):
        sendrecv(x, jnp.ones(2, jnp.float8_e4m3fn), 0, 0, comm=comm)
    with pytest.raises(TypeError, match="unsupported dtype"):
        send([x, jnp.ones(2, jnp.float8_e4m3fn)], 0, comm=comm)  # nothing is sent, not even x
    with pytest.raises(TypeError, match="unsupported dtype"):
        recv(jnp.ones(2, jnp.float8_e4m3fn), 0, comm=comm)
    with pytest.raises(TypeError, match="mpi4py communicator"):
        send(x, 0, comm="world")
    assert_in_step(comm)
