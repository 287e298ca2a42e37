"""distlinalg.mpi4jax: mpi4jax 0.9's API (signatures, defaults, return values, what non-root ranks
get, status=, tokens) against single-process references, and its gradients in forward and reverse
mode against the stacked global program (distlinalg's transposes, not mpi4jax's identity)."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import distlinalg.ad as dad
import distlinalg.mpi4jax as m4j
from conftest import gather_global

# mpi4jax 0.9.1's public signatures: (positional-or-keyword, keyword-only), with defaults.
# `token` is accepted (and rejected when given) as in mpi4jax >= 0.8.
NOTSET = object()
SIGNATURES = {
    "allgather": ((("x", NOTSET),), (("comm", None), ("token", NOTSET))),
    "allreduce": ((("x", NOTSET), ("op", NOTSET)), (("comm", None), ("token", NOTSET))),
    "alltoall": ((("x", NOTSET),), (("comm", None), ("token", NOTSET))),
    "barrier": ((), (("comm", None), ("token", NOTSET))),
    "bcast": ((("x", NOTSET), ("root", NOTSET)), (("comm", None), ("token", NOTSET))),
    "gather": ((("x", NOTSET), ("root", NOTSET)), (("comm", None), ("token", NOTSET))),
    "recv": ((("x", NOTSET), ("source", MPI.ANY_SOURCE)),
             (("tag", MPI.ANY_TAG), ("comm", None), ("status", None), ("token", NOTSET))),
    "reduce": ((("x", NOTSET), ("op", NOTSET), ("root", NOTSET)), (("comm", None), ("token", NOTSET))),
    "scan": ((("x", NOTSET), ("op", NOTSET)), (("comm", None), ("token", NOTSET))),
    "scatter": ((("x", NOTSET), ("root", NOTSET)), (("comm", None), ("token", NOTSET))),
    "send": ((("x", NOTSET), ("dest", NOTSET)), (("tag", 0), ("comm", None), ("token", NOTSET))),
    "sendrecv": ((("sendbuf", NOTSET), ("recvbuf", NOTSET), ("source", NOTSET), ("dest", NOTSET)),
                 (("sendtag", 0), ("recvtag", MPI.ANY_TAG), ("comm", None), ("status", None), ("token", NOTSET))),
    "has_cuda_support": ((), ()),
    "has_sycl_support": ((), ()),
}


def local_data(rank, shape=(3,), seed=0):
    return np.random.default_rng(1000 * seed + rank).standard_normal(shape)


@pytest.mark.serial
def test_public_api_matches_mpi4jax():
    assert sorted(m4j.__all__) == sorted(SIGNATURES)
    for name, (positional, keyword) in SIGNATURES.items():
        params = inspect.signature(getattr(m4j, name)).parameters.values()
        pos = [(p.name, p.default) for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
        kw = [(p.name, p.default) for p in params if p.kind is p.KEYWORD_ONLY]
        assert [n for n, _ in pos] == [n for n, _ in positional], name
        assert [n for n, _ in kw] == [n for n, _ in keyword], name
        for (n, got), (_, want) in zip(pos + kw, positional + keyword):
            if want is NOTSET:
                continue
            assert got == want, (name, n, got, want)
        assert getattr(m4j, name).__doc__, name
    assert isinstance(m4j.has_cuda_support(), bool) and m4j.has_sycl_support() is False
    assert m4j.__version__.startswith("0.9.1")


@pytest.mark.parametrize("jit", [False, True])
def test_collectives_values(comm, rank, size, jit):
    wrap = jax.jit if jit else (lambda f: f)
    x = jnp.asarray(local_data(rank, (2, 3)))
    G = gather_global(x, comm)
    np.testing.assert_allclose(wrap(lambda a: m4j.allreduce(a, op=MPI.SUM, comm=comm))(x), G.sum(0), rtol=1e-14)
    np.testing.assert_allclose(wrap(lambda a: m4j.allreduce(a, MPI.MAX, comm=comm))(x), G.max(0))
    np.testing.assert_array_equal(wrap(lambda a: m4j.allgather(a, comm=comm))(x), G)
    np.testing.assert_allclose(wrap(lambda a: m4j.scan(a, op=MPI.SUM, comm=comm))(x), G[: rank + 1].sum(0), rtol=1e-14)
    blocks = jnp.asarray(local_data(rank, (size, 2), seed=1))
    B = gather_global(blocks, comm)
    np.testing.assert_array_equal(wrap(lambda a: m4j.alltoall(a, comm=comm))(blocks), B[:, rank])
    root = size - 1
    # bcast: root's x everywhere; non-root x is a template.
    np.testing.assert_array_equal(wrap(lambda a: m4j.bcast(a, root, comm=comm))(x), G[root])
    # gather / reduce: the result on root, the input itself elsewhere (mpi4jax's convention).
    g = wrap(lambda a: m4j.gather(a, root, comm=comm))(x)
    np.testing.assert_array_equal(g, G if rank == root else x)
    r = wrap(lambda a: m4j.reduce(a, MPI.SUM, root, comm=comm))(x)
    np.testing.assert_allclose(r, G.sum(0) if rank == root else x, rtol=1e-14)
    # scatter: (size, *s) on root, a template of shape s elsewhere.
    src = jnp.asarray(local_data(root, (size, 4), seed=2))
    mine = wrap(lambda a: m4j.scatter(a, root, comm=comm))(src if rank == root else jnp.zeros(4))
    np.testing.assert_array_equal(mine, gather_global(src, comm)[root][rank])
    # Python scalars, as mpi4jax's tests pass them.
    np.testing.assert_array_equal(m4j.allgather(rank, comm=comm), np.arange(size))
    m4j.barrier(comm=comm)


def test_point_to_point_defaults_and_status(comm, rank, size):
    """recv's defaults are ANY_SOURCE and ANY_TAG, sendrecv's recvtag ANY_TAG; status= is filled."""
    left, right = (rank - 1) % size, (rank + 1) % size
    x = jnp.asarray(local_data(rank, (3, 2)))
    G = gather_global(x, comm)
    for jit in (False, True):
        st = MPI.Status()
        fn = lambda a: m4j.sendrecv(a, a, left, right, sendtag=rank + 1, comm=comm, status=st)  # noqa: E731
        y = (jax.jit(fn) if jit else fn)(x)
        jax.block_until_ready(y)
        jax.effects_barrier()  # the status is written by a host callback under jit
        np.testing.assert_array_equal(y, G[left])
        assert (st.Get_source(), st.Get_tag(), st.Get_count(MPI.DOUBLE)) == (left, left + 1, 6)
    if size > 1:
        if rank == 0:
            got = {}
            for _ in range(size - 1):
                st = MPI.Status()
                y = jax.jit(lambda a: m4j.recv(a, comm=comm, status=st))(jnp.zeros((3, 2)))
                jax.effects_barrier()
                got[st.Get_source()] = (np.asarray(y), st.Get_tag())
            for s in range(1, size):
                np.testing.assert_array_equal(got[s][0], G[s])
                assert got[s][1] == 50 + s
        else:
            m4j.send(x, 0, tag=50 + rank, comm=comm)
    with pytest.raises(TypeError, match="MPI.Status"):
        m4j.recv(x, left, status="not a status", comm=comm)
    np.testing.assert_allclose(m4j.allreduce(jnp.ones(1), MPI.SUM, comm=comm), [size])


def test_tokens_and_bad_input_raise_on_every_rank(comm, rank, size):
    x = jnp.ones(2)
    for call in (lambda: m4j.allreduce(x, MPI.SUM, token=object(), comm=comm),
                 lambda: m4j.barrier(token=None, comm=comm),
                 lambda: m4j.send(x, 0, token=1, comm=comm)):
        with pytest.raises(RuntimeError, match="explicit tokens"):
            call()
    with pytest.raises(ValueError, match=r"must have shape \(nproc, \.\.\.\)"):
        m4j.alltoall(jnp.ones(size + 1), comm=comm)
    if rank == 0:  # only the root checks its leading axis (other ranks pass a template)
        with pytest.raises(ValueError, match="Scatter input must have shape"):
            m4j.scatter(jnp.ones(size + 1), 0, comm=comm)
    with pytest.raises(ValueError, match="is not a rank"):
        m4j.bcast(x, size, comm=comm)
    np.testing.assert_allclose(m4j.allreduce(jnp.ones(1), MPI.SUM, comm=comm), [size])


# ---------------------------------------------------------------------------
# Gradients: the stacked global program is the reference.
def program_and_reference(comm, rank, size):
    left, right = (rank - 1) % size, (rank + 1) % size
    root = 0

    def program(x):  # x: (size, 2) on every rank; rank r's scalar output
        s = m4j.allreduce(jnp.sin(x[0]), MPI.SUM, comm=comm)
        h = m4j.sendrecv(x[1] ** 2, x[1] * 0, left, right, comm=comm)
        b = m4j.bcast(x[0] * 3, root, comm=comm)
        g = m4j.gather(x[1] * x[0], root, comm=comm)
        sc = m4j.scatter(x * 2 if rank == root else x[0], root, comm=comm)
        return (rank + 1) * jnp.sum(s * h) + jnp.sum(b ** 2) + jnp.sum(jnp.cos(g)) + jnp.sum(sc * x[0])

    def reference(G):  # G: (P, size, 2) -> outputs of every rank
        P = G.shape[0]
        s = jnp.sum(jnp.sin(G[:, 0]), axis=0)
        outs = []
        for r in range(P):
            h = G[(r - 1) % P, 1] ** 2
            b = G[root, 0] * 3
            g = G[:, 1] * G[:, 0] if r == root else G[r, 1] * G[r, 0]
            sc = (G[root] * 2)[r]
            outs.append((r + 1) * jnp.sum(s * h) + jnp.sum(b ** 2) + jnp.sum(jnp.cos(g)) + jnp.sum(sc * G[r, 0]))
        return jnp.stack(outs)

    return program, reference


@pytest.mark.parametrize("jit", [False, True])
def test_gradients_forward_and_reverse_against_the_global_program(comm, rank, size, jit):
    program, reference = program_and_reference(comm, rank, size)
    x = jnp.asarray(local_data(rank, (size, 2), seed=3))
    v = jnp.asarray(local_data(rank, (size, 2), seed=4))
    G, V = jnp.asarray(gather_global(x, comm)), jnp.asarray(gather_global(v, comm))
    wrap = jax.jit if jit else (lambda f: f)
    np.testing.assert_allclose(wrap(program)(x), reference(G)[rank], rtol=1e-13)
    _, tangent = wrap(lambda x, v: jax.jvp(program, (x,), (v,)))(x, v)
    np.testing.assert_allclose(tangent, jax.jvp(reference, (G,), (V,))[1][rank], rtol=1e-12)
    # jax.grad seeds 1 on every rank: the gradient of the sum of all ranks' outputs.
    grad = wrap(jax.grad(program))(x)
    np.testing.assert_allclose(grad, jax.grad(lambda g: jnp.sum(reference(g)))(G)[rank], rtol=1e-12)


def test_allreduce_transpose_is_the_sum_and_ad_grad_is_the_replicated_gradient(comm, rank, size):
    """The one number that differs from mpi4jax, and the helper that gives the familiar gradient."""
    x = jnp.asarray(local_data(rank, (3,), seed=5))
    loss = lambda x: m4j.allreduce(x, MPI.SUM, comm=comm).sum()  # noqa: E731
    # Global program: every rank outputs sum_r sum(x_r); seeding 1 on every
    # rank differentiates P copies of it (mpi4jax's identity transpose: 1).
    np.testing.assert_allclose(jax.grad(loss)(x), np.full(3, float(size)))
    (t,) = jax.linear_transpose(lambda a: m4j.allreduce(a, MPI.SUM, comm=comm), x)(jnp.ones(3))
    np.testing.assert_allclose(t, np.full(3, float(size)))
    # The gradient of the one replicated loss with respect to this rank's block.
    np.testing.assert_allclose(dad.grad(loss, sharded=0, comm=comm)(x), np.ones(3))


def test_mpi4jax_matvec_transpose_with_ad_helpers(comm, rank, size):
    """mpi4jax's distributed matvec y = A x (columns split): distlinalg's transpose is P A^T y for a
    replicated y, and A^T y is the gradient of the replicated loss <y, A x>."""
    m, n_local = 4, 3
    A_local = jnp.asarray(local_data(rank, (m, n_local), seed=6))
    x_local = jnp.asarray(local_data(rank, (n_local,), seed=7))
    y = jnp.asarray(local_data(0, (m,), seed=8))  # replicated
    A = np.concatenate(comm.allgather(np.asarray(A_local)), axis=1)
    mv = lambda x: m4j.allreduce(A_local @ x, MPI.SUM, comm=comm)  # noqa: E731
    np.testing.assert_allclose(mv(x_local), A @ np.concatenate(comm.allgather(np.asarray(x_local))), rtol=1e-13)
    (t,) = jax.linear_transpose(mv, x_local)(y)
    ATy_local = (A.T @ y)[rank * n_local:(rank + 1) * n_local]
    np.testing.assert_allclose(t, size * ATy_local, rtol=1e-13)
    g = dad.grad(lambda x: jnp.dot(y, mv(x)), sharded=0, comm=comm)(x_local)
    np.testing.assert_allclose(g, ATy_local, rtol=1e-13)
