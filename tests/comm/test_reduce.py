"""reduce beyond test_collectives.py's table (values, JVP/VJP, second order and vmap of
every op at the first and last root): every root against mpi4py, op spellings,
pytrees, every op in every dtype, complex AD, the middle root's second order,
discarded results, a middle batch axis, loops, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

from distlinalg.comm.allreduce import allreduce
from distlinalg.comm.reduce import reduce, reduce_p
from conftest import assert_matches_reference, gather_global

OPS = ["sum", "prod", "min", "max"]
NP_REDUCE = {"sum": np.sum, "prod": np.prod, "min": np.min, "max": np.max}
JNP_REDUCE = {"sum": jnp.sum, "prod": jnp.prod, "min": jnp.min, "max": jnp.max}


def assert_everywhere(actual, expected, comm, **tol):
    """Compare every rank's result with its expected value on every rank.

    A mismatch on one rank then fails the test on all of them, so no rank
    moves on to the next collective alone.
    """
    np.testing.assert_allclose(gather_global(actual, comm), gather_global(expected, comm), **tol)


def local_data(rank, shape=(3, 4), seed=0):
    return np.random.default_rng(1000 * seed + rank).uniform(0.5, 1.5, shape)


def ad_data(op, rank, seed=0):
    """Inputs that exercise the delicate cases of each op's derivative.

    prod: index 0 is zero on rank 0 only (its weight is the product of the
    others), index 1 on ranks 0 and 1 (every weight vanishes). min/max:
    index 2 ties on every rank, index 3 ties on ranks 0 and 1 only.
    """
    x = local_data(rank, (5,), seed)
    if op == "prod":
        if rank == 0:
            x[0] = 0.0
        if rank in (0, 1):
            x[1] = 0.0
    if op in ("min", "max"):
        x[2] = 0.25 if op == "min" else 1.75
        if rank in (0, 1):
            x[3] = 0.3 if op == "min" else 1.7
    return jnp.asarray(x)


def stacked_reduce(G, op, root):
    """The global program: row `root` holds the reduction, other rows zeros."""
    y = JNP_REDUCE[op](G, axis=0)
    return jnp.stack([y if r == root else jnp.zeros_like(y) for r in range(G.shape[0])])


@pytest.mark.parametrize("op", OPS)
def test_values_every_root(comm, rank, size, op):
    """Every root (the table takes the first and last, eagerly and jitted), against numpy and mpi4py."""
    x = local_data(rank)
    G = gather_global(x, comm)
    for root in range(size):
        expected = NP_REDUCE[op](G, axis=0) if rank == root else np.zeros_like(x)
        out = reduce(x, op, root=root, comm=comm)
        assert out.shape == x.shape and out.dtype == x.dtype
        assert_everywhere(out, expected, comm, rtol=1e-13, err_msg=f"root={root}")
        # mpi4py's own reduce agrees on root.
        theirs = np.zeros_like(x)
        comm.Reduce(x, theirs, op={"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}[op], root=root)
        assert_everywhere(out, theirs, comm, rtol=1e-13)


def test_op_spellings_root_types_and_default_comm(comm, rank, size):
    x = local_data(rank, (4,))
    G = gather_global(x, comm)
    root = size - 1
    for spelling in (MPI.MAX, "MAX", "max"):
        out = reduce(x, spelling, root=np.int64(root), comm=comm)
        assert_everywhere(out, G.max(0) if rank == root else 0 * x, comm, rtol=0)
    default = reduce(x, "sum")  # distlinalg's own communicator, root 0
    assert_everywhere(default, G.sum(0) if rank == 0 else 0 * x, comm, rtol=1e-13)


def test_pytree(comm, rank, size):
    tree = {"a": jnp.full((2,), float(rank + 1)), "b": (jnp.arange(3, dtype=jnp.int32) + rank,)}
    for root in range(size):
        out = reduce(tree, "max", root=root, comm=comm)
        on_root = rank == root
        assert_everywhere(out["a"], np.full(2, size if on_root else 0.0), comm, rtol=0, atol=0)
        assert_everywhere(out["b"][0], np.arange(3) + size - 1 if on_root else np.zeros(3), comm, rtol=0, atol=0)
        assert out["b"][0].dtype == jnp.int32


DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "float16", "bfloat16", "float32", "float64", "complex64", "complex128"]


@pytest.mark.parametrize("dtype", DTYPES + ["bool"])
def test_dtypes(comm, rank, size, dtype):
    dt = jnp.dtype(dtype)
    is_complex = jnp.issubdtype(dt, jnp.complexfloating)
    raw = np.arange(4) % 3 + rank + 1  # small positive values: int8 sums stay in range to 8 ranks
    # Products grow with the world: only the first three ranks contribute factors other
    # than 1, so that int8 products stay in range (at most 3·4·5) at any rank count.
    raw_prod = raw if rank < 3 else np.ones_like(raw)
    if dt == jnp.bool_:
        inputs = {op: jnp.asarray(raw % 2 == 0) for op in ["min", "max"]}
    else:
        ops = ["sum", "prod"] if is_complex else OPS
        inputs = {op: jnp.asarray((r := raw_prod if op == "prod" else raw) + (1j * r if is_complex else 0), dt)
                  for op in ops}
    wide = np.complex128 if is_complex else np.float64
    tol = dict(rtol=1e-2) if dtype in ("float16", "bfloat16") else dict(rtol=1e-6)
    root = size - 1
    for op, x in inputs.items():
        G = gather_global(np.asarray(x).astype(wide), comm)
        out = reduce(x, op, root=root, comm=comm)
        assert out.dtype == dt and out.shape == x.shape
        expected = NP_REDUCE[op](G, axis=0) if rank == root else np.zeros(4, wide)
        assert_everywhere(np.asarray(out).astype(wide), expected, comm, err_msg=op, **tol)


@pytest.mark.parametrize("op", ["sum", "prod"])
def test_complex_derivatives(comm, rank, size, op):
    rng = np.random.default_rng(rank)
    x = jnp.asarray(rng.standard_normal(3) + 1j * rng.standard_normal(3))
    xdot = jnp.asarray(rng.standard_normal(3) + 1j * rng.standard_normal(3))
    ct = jnp.asarray(rng.standard_normal(3) - 2j * rng.standard_normal(3))
    G, Gdot, CT = (jnp.asarray(gather_global(v, comm)) for v in (x, xdot, ct))
    root = size - 1
    ref = lambda g: stacked_reduce(g, op, root)  # noqa: E731
    local = lambda a: reduce(a, op, root=root, comm=comm)  # noqa: E731
    _, tangent = jax.jvp(local, (x,), (xdot,))
    assert_everywhere(tangent, jax.jvp(ref, (G,), (Gdot,))[1][rank], comm, rtol=1e-12)
    (grad,) = jax.vjp(local, x)[1](ct)
    assert_everywhere(grad, jax.vjp(ref, G)[1](CT)[0][rank], comm, rtol=1e-12)


@pytest.mark.parametrize("op", OPS)
def test_derivatives_at_the_middle_root(comm, rank, size, op):
    """Gradient and Hessian-vector product (forward over reverse), jitted, of a
    rank-weighted loss at the middle root: the table covers the first and last."""
    x = ad_data(op, rank)
    v = jnp.asarray(local_data(rank, (5,), seed=3))
    w = jnp.asarray(np.random.default_rng(90 + rank).standard_normal(5))
    G, V, W = (jnp.asarray(gather_global(a, comm)) for a in (x, v, w))
    root = size // 2

    def loss(a):
        return jnp.sum(w * jnp.sin(reduce(a, op, root=root, comm=comm)))

    def global_loss(g):
        return jnp.sum(W * jnp.sin(stacked_reduce(g, op, root)))

    grad, hvp = jax.jit(lambda a, t: jax.jvp(jax.grad(loss), (a,), (t,)))(x, v)
    ref_grad, ref_hvp = jax.jvp(jax.grad(global_loss), (G,), (V,))
    assert_everywhere(grad, ref_grad[rank], comm, rtol=1e-12, atol=1e-14)
    assert_everywhere(hvp, ref_hvp[rank], comm, rtol=1e-10, atol=1e-12)


def test_nonroot_discards_result(comm, rank, size):
    """Ranks that ignore their (zero) output still take part in the adjoint."""
    x = jnp.asarray(local_data(rank, (3,)))
    root = size - 1

    def loss(a):
        y = reduce(a**2, "sum", root=root, comm=comm)
        return jnp.sum(y) if rank == root else jnp.float64(0.0)

    for g in (jax.grad(loss)(x), jax.jit(jax.grad(loss))(x)):
        # d/dx_s of the root's loss sum_s |x_s|^2: every rank gets 2 x_s.
        assert_everywhere(g, 2 * x, comm, rtol=1e-14)


def test_replicated_loss_gradient(comm, rank, size):
    """Loss computed on root only; x sharded: the gradient is exact everywhere."""
    import distlinalg.ad as dad

    x = jnp.asarray(local_data(rank, (3,)))
    G = jnp.asarray(gather_global(x, comm))

    def loss(a):
        # Root holds the total; an allreduce makes the loss replicated.
        return allreduce(jnp.sum(jnp.cos(reduce(a, "sum", root=0, comm=comm))), comm=comm)

    g = dad.grad(loss, sharded=0, comm=comm)(x)
    ref = jax.grad(lambda g: jnp.sum(jnp.cos(g.sum(0))))(G)
    assert_everywhere(g, ref[rank], comm, rtol=1e-13)


def test_vmap_over_a_middle_axis(comm, rank, size):
    """The table batches the outer and last axes; here axis 1 of a (1, 3, 5) stack, every op."""
    root = size - 1
    for op in OPS:
        batch = [ad_data(op, rank, seed=s).reshape(1, 5) for s in range(3)]
        xs = jnp.stack(batch, axis=1)
        fn = lambda a: reduce(a, op, root=root, comm=comm)  # noqa: E731
        loop = jnp.stack([fn(b) for b in batch])
        assert_everywhere(jax.vmap(fn, in_axes=1)(xs), loop, comm, rtol=0, err_msg=op)
        assert_everywhere(jax.jit(jax.vmap(fn, in_axes=1, out_axes=1))(xs), jnp.moveaxis(loop, 0, 1), comm, rtol=0,
                          err_msg=op)
        # One message for the whole batch.
        jaxpr = jax.make_jaxpr(jax.vmap(fn, in_axes=1))(xs)
        assert sum(e.primitive is reduce_p for e in jaxpr.jaxpr.eqns) == 1
        # vmap of the gradient of a rank-weighted loss.
        w = jnp.asarray(np.random.default_rng(rank).standard_normal((1, 5)))
        grad = jax.grad(lambda a: jnp.sum(w * fn(a)))
        grads = jax.jit(jax.vmap(grad, in_axes=1))(xs)
        assert_everywhere(grads, jnp.stack([grad(b) for b in batch]), comm, rtol=1e-13, atol=1e-15, err_msg=op)


def test_loops(comm, rank, size):
    """Inside fori_loop and scan, differentiated through the loop."""
    x = jnp.asarray(local_data(rank, (3,)))
    G = jnp.asarray(gather_global(x, comm))
    root = size - 1
    steps = 3

    def body(_, v):  # each step: reduce to root, a nonlinearity, plus the local data
        return jnp.sin(reduce(v, "sum", root=root, comm=comm)) + x

    def local(a):
        return jax.lax.fori_loop(0, steps, body, a)

    def scanned(a):
        return jax.lax.scan(lambda v, _: (body(0, v), None), a, None, length=steps)[0]

    def reference(g):
        for _ in range(steps):
            g = jnp.sin(stacked_reduce(g, "sum", root)) + G
        return g

    expected = reference(G)
    assert_everywhere(jax.jit(local)(x), expected[rank], comm, rtol=1e-13)
    assert_everywhere(jax.jit(scanned)(x), expected[rank], comm, rtol=1e-13)
    w = jnp.asarray(np.random.default_rng(rank + 5).standard_normal(3))
    W = jnp.asarray(gather_global(w, comm))
    # x enters both as the loop's start and as the added data.
    grad = jax.jit(jax.grad(lambda a: jnp.sum(w * jax.lax.fori_loop(
        0, steps, lambda _, v: jnp.sin(reduce(v, "sum", root=root, comm=comm)) + a, a))))(x)

    def ref_loss(g):
        h = g
        for _ in range(steps):
            h = jnp.sin(stacked_reduce(h, "sum", root)) + g
        return jnp.sum(W * h)

    assert_everywhere(grad, jax.grad(ref_loss)(G)[rank], comm, rtol=1e-12)


def test_bad_input(comm, rank, size):
    x = jnp.ones(2)
    with pytest.raises(ValueError, match="unknown reduction op"):
        reduce(x, "mean", comm=comm)
    with pytest.raises(ValueError, match="unsupported mpi4py op"):
        reduce(x, MPI.MAXLOC, comm=comm)
    with pytest.raises(TypeError, match="op must be"):
        reduce(x, 3, comm=comm)
    with pytest.raises(TypeError):
        reduce(x, comm=comm)  # op is required
    with pytest.raises(TypeError, match="not defined for bool"):
        reduce(jnp.ones(2, bool), "sum", comm=comm)
    with pytest.raises(TypeError, match="not defined for bool"):
        reduce(jnp.ones(2, bool), "prod", comm=comm)
    for op in ("min", "max"):
        with pytest.raises(TypeError, match="complex"):
            reduce(jnp.ones(2, jnp.complex64), op, comm=comm)
    with pytest.raises(TypeError, match="unsupported dtype"):
        reduce(jnp.ones(2, jnp.float8_e4m3fn), "sum", comm=comm)
    with pytest.raises(ValueError, match=f"root={size} is not a rank"):
        reduce(x, "sum", root=size, comm=comm)
    with pytest.raises(ValueError, match="root=-1"):
        reduce(x, "sum", root=-1, comm=comm)
    with pytest.raises(ValueError, match="is not a rank"):
        reduce(x, "sum", root=MPI.PROC_NULL, comm=comm)
    with pytest.raises(TypeError, match="static Python int"):
        reduce(x, "sum", root=jnp.int32(0), comm=comm)
    with pytest.raises(TypeError, match="static Python int"):
        reduce(x, "sum", root=True, comm=comm)
    with pytest.raises(TypeError, match="mpi4py communicator"):
        reduce(x, "sum", comm="world")
    with pytest.raises(TypeError, match="static Python int"):
        jax.jit(lambda a, r: reduce(a, "sum", root=r, comm=comm))(x, 0)
    # Every rank raised before communicating: still in step.
    assert_matches_reference(reduce(jnp.ones(1), "sum", root=0, comm=comm),
                             np.array([[size]] + [[0]] * (size - 1)), comm)
