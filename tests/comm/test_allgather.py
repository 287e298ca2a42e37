"""allgather beyond test_collectives.py's table (values, JVP/VJP, second order, vmap,
dtypes): edge shapes, pytrees, unused outputs, the transpose, the batched
layout, nested vmap, loops, bad input.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distlinalg.comm.allgather import allgather, allgather_p
from distlinalg.comm.allreduce import allreduce
from conftest import gather_global


def local_data(rank, shape=(2, 3), seed=0):
    return np.random.default_rng(1000 * seed + rank).standard_normal(shape)


@pytest.mark.parametrize("shape", [(), (1,), (4,), (2, 0), (3, 1, 2)])
@pytest.mark.parametrize("jit", [False, True])
def test_values_shapes_eager_and_jit(comm, rank, size, shape, jit):
    x = jnp.asarray(local_data(rank, shape))
    fn = lambda a: allgather(a, comm=comm)  # noqa: E731
    out = (jax.jit(fn) if jit else fn)(x)
    assert out.shape == (size, *shape)
    np.testing.assert_array_equal(out, gather_global(x, comm))


def test_default_comm_and_pytree(comm, rank, size):
    tree = {"a": jnp.full((2,), float(rank)), "b": (jnp.arange(3, dtype=jnp.int32) * (rank + 1), jnp.asarray(rank))}
    out = allgather(tree, comm=comm)
    np.testing.assert_array_equal(out["a"], np.repeat(np.arange(size, dtype=float)[:, None], 2, axis=1))
    np.testing.assert_array_equal(out["b"][0], np.arange(1, size + 1)[:, None] * np.arange(3))
    np.testing.assert_array_equal(out["b"][1], np.arange(size))
    assert out["b"][0].dtype == jnp.int32
    np.testing.assert_array_equal(allgather(jnp.asarray([rank])), np.arange(size)[:, None])


def test_output_unused_on_some_ranks(comm, rank, size):
    """Rank 0 ignores the result: its zero cotangent must still join the reduce_scatter."""
    x = jnp.arange(3.0) + rank

    def loss(a):
        g = allgather(a, comm=comm)
        return jnp.zeros(()) if rank == 0 else jnp.sum(g**2)

    expected = 2 * np.asarray(x) * (size - 1)
    np.testing.assert_allclose(jax.grad(loss)(x), expected, rtol=1e-14)
    np.testing.assert_allclose(jax.jit(jax.grad(loss))(x), expected, rtol=1e-14)


def test_linear_transpose_is_reduce_scatter(comm, rank, size):
    x = jnp.asarray(local_data(rank, (3,)))
    (back,) = jax.linear_transpose(lambda a: allgather(a, comm=comm), x)(jnp.ones((size, 3)) * (rank + 1))
    np.testing.assert_allclose(back, np.full(3, size * (size + 1) / 2))
    jaxpr = jax.make_jaxpr(jax.grad(lambda a: jnp.sum(allgather(a, comm=comm) ** 2)))(x)
    names = [e.primitive.name for e in jaxpr.jaxpr.eqns]
    assert "distlinalg_reduce_scatter" in names and names.count("distlinalg_allgather") >= 1


@pytest.mark.parametrize("axis", [0, -1])
def test_vmap_batch_sits_behind_the_rank_axis(comm, rank, size, axis):
    """The values under vmap are the table's; here the layout: the batched
    primitive keeps the rank axis first (out batch dim 1), and out_axes moves it."""
    batch = [jnp.asarray(local_data(rank, (2, 3), seed=s)) for s in range(4)]
    xs = jnp.stack(batch, axis=axis)
    fn = lambda a: allgather(a, comm=comm)  # noqa: E731
    eqns = jax.make_jaxpr(jax.vmap(fn, in_axes=axis))(xs).jaxpr.eqns
    gathered = [e for e in eqns if e.primitive is allgather_p]
    assert len(gathered) == 1 and gathered[0].outvars[0].aval.shape == (size, 4, 2, 3)
    loop = jnp.stack([fn(b) for b in batch], axis=-1)
    np.testing.assert_array_equal(jax.jit(jax.vmap(fn, in_axes=axis, out_axes=-1))(xs), loop)


def test_vmap_of_jvp_and_nested_vmap(comm, rank, size):
    x = jnp.asarray(local_data(rank, (3,)))
    ts = jnp.asarray(local_data(rank, (5, 3), seed=3))
    fn = lambda a: allgather(a, comm=comm)  # noqa: E731
    tangents = jax.vmap(lambda t: jax.jvp(fn, (x,), (t,))[1])(ts)
    np.testing.assert_allclose(tangents, jnp.stack([fn(t) for t in ts]), rtol=1e-14)
    xs = jnp.asarray(local_data(rank, (2, 3, 4), seed=4))
    nested = jax.vmap(jax.vmap(fn, in_axes=1), in_axes=0)(xs)
    np.testing.assert_array_equal(nested, jnp.stack([jnp.stack([fn(xs[i, :, j]) for j in range(4)]) for i in range(2)]))


def test_fori_loop_and_scan(comm, rank, size):
    """x_{k+1} = mean over ranks of AG(x_k) scaled by the rank: a contraction in loops."""
    x = jnp.asarray(local_data(rank, (3,)))
    G = jnp.asarray(gather_global(x, comm))
    scale = 0.5 + 0.1 * rank
    scales = 0.5 + 0.1 * jnp.arange(size)

    def step(v):
        return scale * jnp.tanh(allgather(v, comm=comm).sum(0) / size) + 0.1 * v

    def ref_step(g):
        return scales[:, None] * jnp.tanh(g.sum(0) / size)[None] + 0.1 * g

    @jax.jit
    def loops(v):
        a = jax.lax.fori_loop(0, 3, lambda i, u: step(u), v)
        b, hist = jax.lax.scan(lambda u, _: (step(u), allgather(u, comm=comm)), v, None, length=3)
        return a, b, hist

    a, b, hist = loops(x)
    ref = [G]
    for _ in range(3):
        ref.append(ref_step(ref[-1]))
    np.testing.assert_allclose(a, ref[3][rank], rtol=1e-13)
    np.testing.assert_allclose(b, ref[3][rank], rtol=1e-13)
    np.testing.assert_allclose(hist, jnp.stack(ref[:3]), rtol=1e-13)

    w = jnp.asarray(local_data(rank, (3,), seed=8))
    W = jnp.asarray(gather_global(w, comm))

    def loss(v):
        return jnp.sum(w * jax.lax.scan(lambda u, _: (step(u), None), v, None, length=3)[0])

    def ref_loss(g):
        for _ in range(3):
            g = ref_step(g)
        return jnp.sum(W * g)

    np.testing.assert_allclose(jax.jit(jax.grad(loss))(x), jax.grad(ref_loss)(G)[rank], rtol=1e-12)


def test_bad_input_raises_on_every_rank(comm, rank, size):
    with pytest.raises(TypeError, match="unsupported dtype"):
        allgather(jnp.ones(2, jnp.float8_e4m3fn), comm=comm)
    with pytest.raises(TypeError, match="mpi4py communicator"):
        allgather(jnp.ones(2), comm="world")
    with pytest.raises(TypeError, match="unsupported dtype"):
        jax.jit(lambda a: allgather({"ok": a, "bad": a.astype(jnp.float8_e5m2)}, comm=comm))(jnp.ones(2))
    # Still in step: every rank raised without communicating.
    np.testing.assert_allclose(allreduce(jnp.ones(1), comm=comm), [size])
