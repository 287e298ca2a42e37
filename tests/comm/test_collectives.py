"""Every collective against the single-process reference of the global program.

For each case the global program is written in jnp on the stacked inputs of
all ranks (shape (size, ...)); rank r's result must equal row r of it, and so
must rank r's JVP (every rank moving its own input) and VJP (every rank
seeding its own, rank-dependent cotangent), per docs/ad.md's convention.

This table is the one place where every collective's values, first and
second derivatives, vmap and dtypes are checked, so it also runs in the
other MPI family's pass and the CUDA emulation passes. The per-op files
(test_allreduce.py, test_reduce.py, ...) hold what is specific to one op;
point-to-point lives in test_p2p.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distlinalg import comm as C
from conftest import gather_global

REDUCE = {"sum": jnp.sum, "prod": jnp.prod, "min": jnp.min, "max": jnp.max}
OPS = list(REDUCE)
BLOCK = 5  # entries per reduced block: room for every planted zero/tie pattern (local_input)


@dataclass
class Case:
    name: str
    local: Callable[[Any, Any], Any]  # (x, comm) -> this rank's output
    reference: Callable[[Any, int], Any]  # (stacked inputs, size) -> stacked outputs
    in_shape: Callable[[int], tuple]


def _identity(op):
    return {"sum": 0.0, "prod": 1.0, "min": jnp.inf, "max": -jnp.inf}[op]


def cases(size: int) -> list[Case]:
    out = []
    for op in OPS:
        out.append(Case(f"allreduce-{op}", lambda x, c, op=op: C.allreduce(x, op, comm=c),
                        lambda G, P, op=op: jnp.broadcast_to(REDUCE[op](G, 0), G.shape), lambda P: (BLOCK,)))
        out.append(Case(f"reduce_scatter-{op}", lambda x, c, op=op: C.reduce_scatter(x, op, comm=c),
                        lambda G, P, op=op: jnp.stack([REDUCE[op](G[:, r], 0) for r in range(P)]),
                        lambda P: (P, BLOCK)))
        out.append(Case(f"scan-{op}", lambda x, c, op=op: C.scan(x, op, comm=c),
                        lambda G, P, op=op: jnp.stack([REDUCE[op](G[: r + 1], 0) for r in range(P)]),
                        lambda P: (BLOCK,)))
        out.append(Case(f"exscan-{op}", lambda x, c, op=op: C.exscan(x, op, comm=c),
                        lambda G, P, op=op: jnp.stack(
                            [jnp.full(G.shape[1:], _identity(op)) if r == 0 else REDUCE[op](G[:r], 0)
                             for r in range(P)]),
                        lambda P: (BLOCK,)))
        for root in sorted({0, size - 1}):
            out.append(Case(f"reduce-{op}-root{root}", lambda x, c, op=op, root=root: C.reduce(x, op, root=root, comm=c),
                            lambda G, P, op=op, root=root: jnp.stack(
                                [REDUCE[op](G, 0) if r == root else jnp.zeros(G.shape[1:]) for r in range(P)]),
                            lambda P: (BLOCK,)))
    for root in sorted({0, size - 1}):
        out += [
            Case(f"bcast-root{root}", lambda x, c, root=root: C.bcast(x, root=root, comm=c),
                 lambda G, P, root=root: jnp.broadcast_to(G[root], G.shape), lambda P: (2, 3)),
            Case(f"gather-root{root}", lambda x, c, root=root: C.gather(x, root=root, comm=c),
                 lambda G, P, root=root: jnp.stack([G if r == root else jnp.zeros_like(G) for r in range(P)]),
                 lambda P: (3,)),
            Case(f"scatter-root{root}", lambda x, c, root=root: C.scatter(x, root=root, comm=c),
                 lambda G, P, root=root: G[root], lambda P: (P, 2)),
        ]
    out += [
        Case("allgather", lambda x, c: C.allgather(x, comm=c),
             lambda G, P: jnp.broadcast_to(G, (P, *G.shape)), lambda P: (2, 2)),
        Case("alltoall", lambda x, c: C.alltoall(x, comm=c), lambda G, P: jnp.swapaxes(G, 0, 1), lambda P: (P, 2)),
        # Non-blocking: started, computation meanwhile, waited for.
        Case("iallreduce-sum", lambda x, c: _overlapped(C.iallreduce(x, comm=c), x),
             lambda G, P: jnp.broadcast_to(jnp.sum(G, 0), G.shape) + jnp.sin(G), lambda P: (BLOCK,)),
        Case("iallgather", lambda x, c: _overlapped(C.iallgather(x, comm=c), x),
             lambda G, P: jnp.broadcast_to(G, (P, *G.shape)) + jnp.sin(G)[:, None], lambda P: (2, 2)),
    ]
    return out


def _overlapped(request, x):
    """wait(request) + sin(x), sin computed while the request is under way."""
    meanwhile = jnp.sin(x)
    return C.wait(request) + meanwhile


def case_names():
    return [c.name for c in cases(3)] + [c.name for c in cases(2) if c.name not in {d.name for d in cases(3)}]


def get_case(name, size):
    found = [c for c in cases(size) if c.name == name]
    if not found:
        pytest.skip(f"{name} is not a case on {size} ranks")
    return found[0]


def local_input(case, rank, size, seed=0):
    """Entries in [0.5, 1.5], with the delicate points of the reductions'
    derivatives planted along the last axis (in every block of a (size, n) input).

    prod: entry 0 is zero on rank 0 only, entry 1 on ranks 0 and 1, entry 2
    on every rank, entry 3 on the last rank only.
    min/max: the extremum is tied on every rank (entry 0), on ranks 0 and 1
    only (1), on every rank but 0 (2), on rank 0 and the last rank with the
    ranks between not extreme (3); entry 4 is the extremum on rank 0 alone,
    the other ranks tied behind it.
    """
    rng = np.random.default_rng(1000 * seed + rank)
    x = rng.uniform(0.5, 1.5, size=case.in_shape(size))
    if "prod" in case.name:
        if rank == 0:
            x[..., 0] = 0.0
        if rank in (0, 1):
            x[..., 1] = 0.0
        x[..., 2] = 0.0
        if rank == size - 1:
            x[..., 3] = 0.0
    if "min" in case.name or "max" in case.name:
        extreme = 0.25 if "min" in case.name else 1.75
        x[..., 0] = extreme
        if rank in (0, 1):
            x[..., 1] = extreme
        if rank >= 1:
            x[..., 2] = extreme
        if rank in (0, size - 1):
            x[..., 3] = extreme
        x[..., 4] = extreme if rank == 0 else 1.0
    return x


def finite(y):
    """exscan's rank 0 holds the op's identity (±inf for min/max): keep losses finite."""
    return jnp.where(jnp.isfinite(y), y, jnp.zeros_like(y))


@pytest.mark.parametrize("name", case_names())
def test_values_and_derivatives(comm, rank, size, name):
    case = get_case(name, size)
    fn = lambda a: case.local(a, comm)  # noqa: E731
    x = jnp.asarray(local_input(case, rank, size))
    G = jnp.asarray(gather_global(x, comm))
    ref = case.reference(G, size)

    # Values, eagerly and under jit.
    np.testing.assert_allclose(fn(x), ref[rank], rtol=1e-13, err_msg="eager")
    np.testing.assert_allclose(jax.jit(fn)(x), ref[rank], rtol=1e-13, err_msg="jit")

    # JVP: every rank moves its own input along its own direction.
    xdot = jnp.asarray(local_input(case, rank + 7, size, seed=1))
    Gdot = jnp.asarray(gather_global(xdot, comm))
    _, tangent = jax.jvp(fn, (x,), (xdot,))
    _, ref_tangent = jax.jvp(lambda g: case.reference(g, size), (G,), (Gdot,))
    np.testing.assert_allclose(tangent, ref_tangent[rank], rtol=1e-11, atol=1e-12, err_msg="jvp")

    # VJP with a rank-dependent cotangent, eagerly and under jit (where the
    # JVP rule is linearized and transposed before lowering).
    ct = jnp.asarray(np.random.default_rng(50 + rank).standard_normal(ref.shape[1:]))
    CT = jnp.asarray(gather_global(ct, comm))
    _, ref_vjp = jax.vjp(lambda g: case.reference(g, size), G)
    expected = ref_vjp(CT)[0][rank]
    np.testing.assert_allclose(jax.vjp(fn, x)[1](ct)[0], expected, rtol=1e-11, atol=1e-12, err_msg="vjp")
    jitted = jax.jit(lambda a, c: jax.vjp(fn, a)[1](c)[0])(x, ct)
    np.testing.assert_allclose(jitted, expected, rtol=1e-11, atol=1e-12, err_msg="jit vjp")


@pytest.mark.parametrize("name", case_names())
def test_second_order(comm, rank, size, name):
    """Hessian-vector products (forward over reverse) of a rank-weighted loss."""
    case = get_case(name, size)
    x = jnp.asarray(local_input(case, rank, size))
    G = jnp.asarray(gather_global(x, comm))
    w = jnp.asarray(np.random.default_rng(70 + rank).standard_normal(case.reference(G, size).shape[1:]))
    W = jnp.asarray(gather_global(w, comm))
    v = jnp.asarray(local_input(case, rank, size, seed=3))
    V = jnp.asarray(gather_global(v, comm))

    def loss(a):
        return jnp.sum(w * jnp.sin(finite(case.local(a, comm))))

    def global_loss(g):
        return jnp.sum(W * jnp.sin(finite(case.reference(g, size))))

    _, hvp = jax.jvp(jax.grad(loss), (x,), (v,))
    _, ref_hvp = jax.jvp(jax.grad(global_loss), (G,), (V,))
    np.testing.assert_allclose(hvp, ref_hvp[rank], rtol=1e-10, atol=1e-11)


def _communicating_primitives(jaxpr):
    """The messages of a program: its communicating equations, a non-blocking
    operation's start and wait counted once."""
    return [e.primitive.name for e in jaxpr.jaxpr.eqns
            if e.primitive.name.startswith("distlinalg_") and e.primitive.name != "distlinalg_wait"]


@pytest.mark.parametrize("name", case_names())
@pytest.mark.parametrize("axis", [0, -1])
def test_vmap_matches_loop(comm, rank, size, name, axis):
    case = get_case(name, size)
    batch = [jnp.asarray(local_input(case, rank, size, seed=s)) for s in range(3)]
    xs = jnp.stack(batch, axis=axis)
    fn = lambda a: case.local(a, comm)  # noqa: E731
    out = jax.vmap(fn, in_axes=axis, out_axes=0)(xs)
    np.testing.assert_allclose(out, jnp.stack([fn(b) for b in batch]), rtol=1e-13)
    # One message carries the whole batch.
    assert len(_communicating_primitives(jax.make_jaxpr(jax.vmap(fn, in_axes=axis))(xs))) == 1
    w = jnp.asarray(np.random.default_rng(rank).standard_normal(np.shape(fn(batch[0]))))
    grad = jax.grad(lambda a: jnp.sum(w * fn(a)))
    grads = jax.jit(jax.vmap(grad, in_axes=axis, out_axes=0))(xs)
    np.testing.assert_allclose(grads, jnp.stack([grad(b) for b in batch]), rtol=1e-12, atol=1e-14)


DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "float16", "bfloat16", "float32", "float64", "complex64", "complex128"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_dtypes_every_op(comm, rank, size, dtype):
    dt = jnp.dtype(dtype)
    raw = (np.arange(2 * size) % 3 + rank + 1).reshape(size, 2)
    x = jnp.asarray(raw[0] % 2 == 0 if dt == jnp.bool_ else raw[0], dt)
    blocks = jnp.asarray(raw % 2 == 0 if dt == jnp.bool_ else raw, dt)
    as64 = lambda a: np.asarray(a).astype(np.complex128 if jnp.issubdtype(dt, jnp.complexfloating) else np.float64)  # noqa: E731
    G, B = gather_global(as64(x), comm), gather_global(as64(blocks), comm)
    op = "max" if dt == jnp.bool_ else "sum"
    red = np.max if dt == jnp.bool_ else np.sum
    tol = dict(rtol=1e-2) if dtype in ("float16", "bfloat16") else dict(rtol=1e-6)
    np.testing.assert_allclose(as64(C.allreduce(x, op, comm=comm)), red(G, 0), **tol)
    np.testing.assert_allclose(as64(C.reduce(x, op, root=0, comm=comm)), red(G, 0) if rank == 0 else 0 * G[0], **tol)
    np.testing.assert_allclose(as64(C.reduce_scatter(blocks, op, comm=comm)), red(B[:, rank], 0), **tol)
    np.testing.assert_allclose(as64(C.scan(x, op, comm=comm)), red(G[: rank + 1], 0), **tol)
    np.testing.assert_array_equal(as64(C.bcast(x, root=size - 1, comm=comm)), G[-1])
    np.testing.assert_array_equal(as64(C.allgather(x, comm=comm)), G)
    np.testing.assert_array_equal(as64(C.gather(x, comm=comm)), G if rank == 0 else 0 * G)
    np.testing.assert_array_equal(as64(C.scatter(blocks, root=0, comm=comm)), B[0][rank])
    np.testing.assert_array_equal(as64(C.alltoall(blocks, comm=comm)), B[:, rank])
    np.testing.assert_allclose(as64(C.wait(C.iallreduce(x, op, comm=comm))), red(G, 0), **tol)
    np.testing.assert_array_equal(as64(C.wait(C.iallgather(x, comm=comm))), G)
    for out in (C.allreduce(x, op, comm=comm), C.allgather(x, comm=comm), C.alltoall(blocks, comm=comm),
                C.wait(C.iallreduce(x, op, comm=comm)), C.wait(C.iallgather(x, comm=comm))):
        assert out.dtype == dt


def test_bcast_gradient_with_replicated_template(comm, rank, size):
    """The supported differentiable pattern: the same traced value on every rank."""
    w = jnp.asarray([1.0, 2.0]) * (1 + rank)  # replicated in spirit; rank's copy differs
    c = jnp.asarray([3.0, -1.0]) * (rank + 1)  # rank-dependent downstream use
    g = jax.grad(lambda w: jnp.sum(c * C.bcast(w, root=0, comm=comm) ** 2))(w)
    Cs = gather_global(c, comm)
    expected = 2 * Cs.sum(0) * np.asarray(w) if rank == 0 else np.zeros(2)
    np.testing.assert_allclose(g, expected, rtol=1e-13)


def test_tensor_parallel_layer(comm, rank, size):
    """Columns of W sharded; features allgathered; replicated loss."""
    rng = np.random.default_rng(0)
    W_full = rng.standard_normal((4, 2 * size))
    x = jnp.asarray(rng.standard_normal(4))
    W = jnp.asarray(W_full[:, 2 * rank : 2 * rank + 2])

    def loss(W, x):
        features = C.allgather(jnp.tanh(x @ W), comm=comm).reshape(-1)
        return jnp.sum(features**2)

    def global_loss(W_full, x):
        return jnp.sum(jnp.tanh(x @ W_full) ** 2)

    value = loss(W, x)
    np.testing.assert_allclose(value, global_loss(jnp.asarray(W_full), x), rtol=1e-13)
    gW, gx = jax.grad(loss, argnums=(0, 1))(W, x)
    rW, rx = jax.grad(global_loss, argnums=(0, 1))(jnp.asarray(W_full), x)
    # Seeded 1 on every rank: size times the gradient; the replicated x's
    # per-rank gradients are summed over ranks (docs/ad.md).
    np.testing.assert_allclose(gW, size * rW[:, 2 * rank : 2 * rank + 2], rtol=1e-12)
    np.testing.assert_allclose(C.allreduce(gx, comm=comm), size * rx, rtol=1e-12)


def test_bad_input_raises_on_every_rank(comm, rank, size):
    # The ops without a file of their own; the others' errors are in their files.
    with pytest.raises(ValueError, match="root=.* is not a rank"):
        C.bcast(jnp.ones(2), root=size, comm=comm)
    with pytest.raises(TypeError, match="static Python int"):
        C.gather(jnp.ones(2), root=jnp.int32(0), comm=comm)
    for op in (C.scatter, C.alltoall):
        with pytest.raises(ValueError, match=r"shape \(size, ...\)"):
            op(jnp.ones((size + 1, 2)), comm=comm)
        with pytest.raises(ValueError, match=r"shape \(size, ...\)"):
            op(jnp.ones(()), comm=comm)
    # Still in step.
    np.testing.assert_allclose(C.allreduce(jnp.ones(1), comm=comm), [size])


def test_barrier_keeps_its_place_between_collectives(comm, rank, size):
    """barrier (no data, so no table row): program order in the jaxpr, values jitted and eager."""

    def f(x):
        a = C.allreduce(x, comm=comm)
        C.barrier(comm=comm)
        b = C.allreduce(2 * x, "max", comm=comm)
        C.barrier(comm=comm)
        return a, b

    names = _communicating_primitives(jax.make_jaxpr(f)(jnp.ones(2)))
    assert names == ["distlinalg_allreduce", "distlinalg_barrier", "distlinalg_allreduce", "distlinalg_barrier"]
    x = jnp.full(2, rank + 1.0)
    for a, b in (jax.jit(f)(x), f(x)):
        np.testing.assert_allclose(a, np.full(2, size * (size + 1) / 2))
        np.testing.assert_allclose(b, np.full(2, 2.0 * size))


PYTREE_WRAPPERS = {
    "allreduce": lambda x, comm: C.allreduce(x, "max", comm=comm),
    "reduce": lambda x, comm: C.reduce(x, "max", root=0, comm=comm),
    "bcast": lambda x, comm: C.bcast(x, root=0, comm=comm),
    "gather": lambda x, comm: C.gather(x, root=0, comm=comm),
    "scatter": lambda x, comm: C.scatter(x, root=0, comm=comm),
    "allgather": lambda x, comm: C.allgather(x, comm=comm),
    "alltoall": lambda x, comm: C.alltoall(x, comm=comm),
    "reduce_scatter": lambda x, comm: C.reduce_scatter(x, "max", comm=comm),
    "tree_allreduce": lambda x, comm: C.tree_allreduce(x, "max", comm=comm),
}


@pytest.mark.parametrize("name", list(PYTREE_WRAPPERS))
def test_pytree_leaves_all_checked_before_the_first_message(comm, size, name, monkeypatch):
    """A pytree whose last leaf is invalid raises before any leaf is communicated.

    Otherwise a rank would post the first leaf's message and then raise, and a
    program that catches the error would be out of step with its peers. The
    bad leaf is complex under ``max`` for the reducing ops, and a leaf
    without the (size, ...) leading axis for the others (bcast, gather and
    allgather take any shape: their bad leaf has a dtype MPI cannot carry).
    """
    from distlinalg.comm import _core

    bound = []
    real_bind = _core.bind
    monkeypatch.setattr(_core, "bind", lambda prim, *a, **k: bound.append(prim) or real_bind(prim, *a, **k))
    good = jnp.ones((size, 2))
    reducing = name in ("allreduce", "reduce", "reduce_scatter", "tree_allreduce")
    blocks = name in ("scatter", "alltoall", "reduce_scatter")
    if reducing:
        bad, error = jnp.ones((size, 2), jnp.complex64), TypeError
    elif blocks:
        bad, error = jnp.ones((size + 1, 2)), ValueError
    else:
        bad, error = np.array(["not a number"] * 2, dtype=object), (TypeError, ValueError)
    for traced in (False, True):
        fn = (lambda t: PYTREE_WRAPPERS[name](t, comm)) if not traced else jax.jit(lambda t: PYTREE_WRAPPERS[name](t, comm))
        tree = {"a": good, "z": bad}
        if traced and bad.dtype == object:
            continue  # an object array is not a valid jit argument; the eager call covers it
        with pytest.raises(error):
            fn(tree)
        assert bound == [], f"{name}: {bound} bound before the bad leaf was checked"
    # Still in step.
    monkeypatch.undo()
    np.testing.assert_allclose(C.allreduce(jnp.ones(1), comm=comm), [size])


@pytest.mark.parametrize("op", OPS)
def test_tree_allreduce_one_message_per_dtype(comm, rank, size, op):
    """tree_allreduce: allreduce's values on every leaf, one message per dtype, allreduce's AD."""
    tree = {
        "w": jnp.arange(6.0).reshape(2, 3) + rank,
        "b": jnp.full(3, 2.0 - rank),
        "n": jnp.arange(4, dtype=jnp.int32) * (rank + 1),
        "empty": jnp.zeros((0, 2)),
    }
    out = C.tree_allreduce(tree, op, comm=comm)
    for key, leaf in tree.items():
        stacked = gather_global(leaf, comm)
        np.testing.assert_allclose(out[key], REDUCE[op](stacked, axis=0), rtol=1e-12, err_msg=key)
        assert out[key].dtype == leaf.dtype and out[key].shape == leaf.shape
    jaxpr = jax.make_jaxpr(lambda t: C.tree_allreduce(t, op, comm=comm))(tree)
    expected = 2 if size > 1 else 0  # float64 (w and b concatenated) and int32; nothing on one rank
    assert _communicating_primitives(jaxpr).count("distlinalg_allreduce") == expected
    if op == "sum":  # linear: the VJP of the whole program is the sum of every rank's cotangent
        seed = {"w": jnp.full((2, 3), rank + 1.0), "b": jnp.full(3, 1.0)}
        _, vjp = jax.vjp(lambda t: C.tree_allreduce(t, comm=comm), {"w": tree["w"], "b": tree["b"]})
        (ct,) = vjp(seed)
        np.testing.assert_allclose(ct["w"], np.full((2, 3), size * (size + 1) / 2))
        np.testing.assert_allclose(ct["b"], np.full(3, size))
