"""Every communication op against the single-process reference of the global program.

For each case the global program is written in jnp on the stacked inputs of
all ranks (shape (size, ...)); rank r's result must equal row r of it, and so
must rank r's JVP (every rank moving its own input) and VJP (every rank
seeding its own, rank-dependent cotangent), per docs/ad.md's convention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

from distlinalg import comm as C
from conftest import gather_global

REDUCE = {"sum": jnp.sum, "prod": jnp.prod, "min": jnp.min, "max": jnp.max}
OPS = list(REDUCE)


@dataclass
class Case:
    name: str
    local: Callable[[Any, Any], Any]  # (x, comm) -> this rank's output
    reference: Callable[[Any, int], Any]  # (stacked inputs, size) -> stacked outputs
    in_shape: Callable[[int], tuple]
    smooth: bool = True


def _identity(op, dtype=jnp.float64):
    return {"sum": 0.0, "prod": 1.0, "min": jnp.inf, "max": -jnp.inf}[op]


def cases(size: int) -> list[Case]:
    out = []
    for op in OPS:
        out.append(Case(f"allreduce-{op}", lambda x, c, op=op: C.allreduce(x, op, comm=c),
                        lambda G, P, op=op: jnp.broadcast_to(REDUCE[op](G, 0), G.shape), lambda P: (4,)))
        out.append(Case(f"reduce_scatter-{op}", lambda x, c, op=op: C.reduce_scatter(x, op, comm=c),
                        lambda G, P, op=op: jnp.stack([REDUCE[op](G[:, r], 0) for r in range(P)]),
                        lambda P: (P, 3)))
        out.append(Case(f"scan-{op}", lambda x, c, op=op: C.scan(x, op, comm=c),
                        lambda G, P, op=op: jnp.stack([REDUCE[op](G[: r + 1], 0) for r in range(P)]),
                        lambda P: (4,)))
        out.append(Case(f"exscan-{op}", lambda x, c, op=op: C.exscan(x, op, comm=c),
                        lambda G, P, op=op: jnp.stack(
                            [jnp.full(G.shape[1:], _identity(op)) if r == 0 else REDUCE[op](G[:r], 0)
                             for r in range(P)]),
                        lambda P: (4,)))
        for root in sorted({0, size - 1}):
            out.append(Case(f"reduce-{op}-root{root}", lambda x, c, op=op, root=root: C.reduce(x, op, root=root, comm=c),
                            lambda G, P, op=op, root=root: jnp.stack(
                                [REDUCE[op](G, 0) if r == root else jnp.zeros(G.shape[1:]) for r in range(P)]),
                            lambda P: (4,)))
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
        Case("sendrecv-ring",
             lambda x, c: C.sendrecv(x, x, (c.Get_rank() - 1) % c.Get_size(), (c.Get_rank() + 1) % c.Get_size(), comm=c),
             lambda G, P: jnp.roll(G, 1, axis=0), lambda P: (3,)),
        Case("sendrecv-chain-proc-null",
             # Non-periodic shift right: rank 0 receives from PROC_NULL and keeps
             # its template (2 * x), the last rank sends to PROC_NULL.
             lambda x, c: C.sendrecv(
                 x, 2 * x,
                 c.Get_rank() - 1 if c.Get_rank() > 0 else MPI.PROC_NULL,
                 c.Get_rank() + 1 if c.Get_rank() < c.Get_size() - 1 else MPI.PROC_NULL, comm=c),
             lambda G, P: jnp.concatenate([2 * G[:1], G[:-1]], axis=0), lambda P: (3,)),
    ]
    return out


def case_names():
    return [c.name for c in cases(3)] + [c.name for c in cases(2) if c.name not in {d.name for d in cases(3)}]


def get_case(name, size):
    found = [c for c in cases(size) if c.name == name]
    if not found:
        pytest.skip(f"{name} is not a case on {size} ranks")
    return found[0]


def local_input(case, rank, size, seed=0):
    rng = np.random.default_rng(1000 * seed + rank)
    x = rng.uniform(0.5, 1.5, size=case.in_shape(size))
    if "prod" in case.name:
        flat = x.reshape(-1)
        if rank == 0:
            flat[0] = 0.0  # one zero across ranks at index 0
        if rank in (0, 1):
            flat[1] = 0.0  # two zeros at index 1
    if "min" in case.name or "max" in case.name:
        x.reshape(-1)[2] = 0.25 if "min" in case.name else 1.75  # a tie on every rank
    return x


@pytest.mark.parametrize("name", case_names())
def test_values_and_derivatives(comm, rank, size, name):
    case = get_case(name, size)
    x = jnp.asarray(local_input(case, rank, size))
    G = jnp.asarray(gather_global(x, comm))
    ref = case.reference(G, size)

    # Values, eagerly and under jit.
    np.testing.assert_allclose(case.local(x, comm), ref[rank], rtol=1e-13, err_msg="eager")
    np.testing.assert_allclose(jax.jit(lambda a: case.local(a, comm))(x), ref[rank], rtol=1e-13, err_msg="jit")

    # JVP: every rank moves its own input along its own direction.
    xdot = jnp.asarray(local_input(case, rank + 7, size, seed=1))
    Gdot = jnp.asarray(gather_global(xdot, comm))
    _, tangent = jax.jvp(lambda a: case.local(a, comm), (x,), (xdot,))
    _, ref_tangent = jax.jvp(lambda g: case.reference(g, size), (G,), (Gdot,))
    np.testing.assert_allclose(tangent, ref_tangent[rank], rtol=1e-11, atol=1e-12, err_msg="jvp")

    # VJP with a rank-dependent cotangent.
    ct = jnp.asarray(np.random.default_rng(50 + rank).standard_normal(ref.shape[1:]))
    CT = jnp.asarray(gather_global(ct, comm))
    _, vjp = jax.vjp(lambda a: case.local(a, comm), x)
    _, ref_vjp = jax.vjp(lambda g: case.reference(g, size), G)
    np.testing.assert_allclose(vjp(ct)[0], ref_vjp(CT)[0][rank], rtol=1e-11, atol=1e-12, err_msg="vjp")


@pytest.mark.parametrize("name", [n for n in case_names() if "min" not in n and "max" not in n])
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
        return jnp.sum(w * jnp.sin(case.local(a, comm)))

    def global_loss(g):
        return jnp.sum(W * jnp.sin(case.reference(g, size)))

    _, hvp = jax.jvp(jax.grad(loss), (x,), (v,))
    _, ref_hvp = jax.jvp(jax.grad(global_loss), (G,), (V,))
    np.testing.assert_allclose(hvp, ref_hvp[rank], rtol=1e-10, atol=1e-11)


@pytest.mark.parametrize("name", case_names())
@pytest.mark.parametrize("axis", [0, -1])
def test_vmap_matches_loop(comm, rank, size, name, axis):
    case = get_case(name, size)
    batch = [jnp.asarray(local_input(case, rank, size, seed=s)) for s in range(3)]
    xs = jnp.stack(batch, axis=axis)
    fn = lambda a: case.local(a, comm)  # noqa: E731
    out = jax.vmap(fn, in_axes=axis, out_axes=0)(xs)
    np.testing.assert_allclose(out, jnp.stack([fn(b) for b in batch]), rtol=1e-13)
    if "min" in name or "max" in name:
        return
    w = jnp.asarray(np.random.default_rng(rank).standard_normal(np.shape(fn(batch[0]))))
    grad = jax.grad(lambda a: jnp.sum(w * fn(a)))
    grads = jax.jit(jax.vmap(grad, in_axes=axis, out_axes=0))(xs)
    np.testing.assert_allclose(grads, jnp.stack([grad(b) for b in batch]), rtol=1e-12)


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
    got = C.sendrecv(x, x, (rank - 1) % size, (rank + 1) % size, comm=comm)
    np.testing.assert_array_equal(as64(got), G[(rank - 1) % size])
    for out in (C.allreduce(x, op, comm=comm), C.allgather(x, comm=comm), C.alltoall(blocks, comm=comm)):
        assert out.dtype == dt


def test_pytrees(comm, rank, size):
    tree = {"a": jnp.full((2,), float(rank)), "b": [jnp.arange(3) + rank]}
    gathered = C.allgather(tree, comm=comm)
    np.testing.assert_array_equal(gathered["a"][:, 0], np.arange(size))
    np.testing.assert_array_equal(gathered["b"][0][:, 0], np.arange(size))
    total = C.reduce(tree, "sum", root=0, comm=comm)
    assert float(total["a"][0]) == (size * (size - 1) / 2 if rank == 0 else 0)
    shifted = C.sendrecv(tree, tree, (rank - 1) % size, (rank + 1) % size, comm=comm)
    assert float(shifted["a"][0]) == (rank - 1) % size


def test_bcast_gradient_with_replicated_template(comm, rank, size):
    """The supported differentiable pattern: the same traced value on every rank."""
    w = jnp.asarray([1.0, 2.0]) * (1 + rank)  # replicated in spirit; rank's copy differs
    c = jnp.asarray([3.0, -1.0]) * (rank + 1)  # rank-dependent downstream use
    g = jax.grad(lambda w: jnp.sum(c * C.bcast(w, root=0, comm=comm) ** 2))(w)
    Cs = gather_global(c, comm)
    expected = 2 * Cs.sum(0) * np.asarray(w) if rank == 0 else np.zeros(2)
    np.testing.assert_allclose(g, expected, rtol=1e-13)


def test_halo_exchange_in_fori_loop(comm, rank, size):
    """Jacobi smoothing of a 1-D field split across ranks, halos by sendrecv."""
    n_local, steps = 5, 4
    glob = np.sin(np.arange(n_local * size) * 0.7)
    x = jnp.asarray(glob[rank * n_local : (rank + 1) * n_local])
    left = rank - 1 if rank > 0 else MPI.PROC_NULL
    right = rank + 1 if rank < size - 1 else MPI.PROC_NULL

    def smooth(u):
        def step(_, u):
            zero = jnp.zeros(1)
            from_left = C.sendrecv(u[-1:], zero, left, right, comm=comm)  # my right edge goes right
            from_right = C.sendrecv(u[:1], zero, right, left, comm=comm)
            padded = jnp.concatenate([from_left, u, from_right])
            return 0.5 * u + 0.25 * (padded[:-2] + padded[2:])

        return jax.lax.fori_loop(0, steps, step, u)

    def reference(g):
        for _ in range(steps):
            p = jnp.concatenate([jnp.zeros(1), g, jnp.zeros(1)])
            g = 0.5 * g + 0.25 * (p[:-2] + p[2:])
        return g

    out = jax.jit(smooth)(x)
    np.testing.assert_allclose(out, reference(jnp.asarray(glob))[rank * n_local : (rank + 1) * n_local], rtol=1e-13)
    weights = jnp.asarray(np.cos(np.arange(n_local * size)))
    grad = jax.jit(jax.grad(lambda u: jnp.sum(weights[rank * n_local : (rank + 1) * n_local] * smooth(u))))(x)
    ref = jax.grad(lambda g: jnp.sum(weights * reference(g)))(jnp.asarray(glob))
    np.testing.assert_allclose(grad, ref[rank * n_local : (rank + 1) * n_local], rtol=1e-12, atol=1e-14)


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


def test_send_recv_values_and_gradients(comm, rank, size):
    if size < 2:
        # Nothing to pair with; PROC_NULL is a no-op that returns the template.
        t = jnp.ones(3)
        np.testing.assert_array_equal(C.recv(t, MPI.PROC_NULL, comm=comm), t)
        C.send(t, MPI.PROC_NULL, comm=comm)
        return
    x = jnp.asarray([1.0, 2.0, 3.0]) * (rank + 1)

    def program(x):
        # Rank 0 sends x to rank 1, which squares what it receives.
        if rank == 0:
            C.send(x, 1, tag=5, comm=comm)
            return jnp.zeros(())
        if rank == 1:
            got = C.recv(x * 0, 0, tag=5, comm=comm)  # template carries a tangent
            return jnp.sum(got**2)
        return jnp.zeros(())

    value = program(x)
    if rank == 1:
        np.testing.assert_allclose(value, np.sum(np.array([1.0, 2.0, 3.0]) ** 2))
    grad = jax.grad(program)(x)
    expected = 2 * np.array([1.0, 2.0, 3.0]) if rank == 0 else np.zeros(3)
    np.testing.assert_allclose(grad, expected, rtol=1e-13)
    _, tangent = jax.jvp(program, (x,), (jnp.ones(3),))
    np.testing.assert_allclose(tangent, 2 * 6.0 if rank == 1 else 0.0, rtol=1e-13)


def test_barrier_orders_and_runs_in_jit(comm, rank, size):
    C.barrier(comm=comm)
    f = jax.jit(lambda x: (C.barrier(comm=comm), C.allreduce(x, comm=comm))[1])
    np.testing.assert_allclose(f(jnp.ones(2)), np.full(2, size))
    jax.vmap(lambda x: (C.barrier(comm=comm), C.allreduce(x, comm=comm))[1])(jnp.ones((2, 2)))


def test_bad_input_raises_on_every_rank(comm, rank, size):
    with pytest.raises(ValueError, match="root=.* is not a rank"):
        C.bcast(jnp.ones(2), root=size, comm=comm)
    with pytest.raises(ValueError, match="root=-1"):
        C.reduce(jnp.ones(2), "sum", root=-1, comm=comm)
    with pytest.raises(TypeError, match="static Python int"):
        C.gather(jnp.ones(2), root=jnp.int32(0), comm=comm)
    with pytest.raises(ValueError, match="dest=.* is not a rank"):
        C.send(jnp.ones(2), size + 3, comm=comm)
    with pytest.raises(ValueError, match="source=.* is not a rank"):
        C.sendrecv(jnp.ones(2), jnp.ones(2), size, 0, comm=comm)
    with pytest.raises(ValueError, match="tag=5000 out of range"):
        C.recv(jnp.ones(2), 0, tag=5000, comm=comm)
    for op in (C.scatter, C.alltoall, C.reduce_scatter):
        with pytest.raises(ValueError, match=r"shape \(size, ...\)"):
            op(jnp.ones((size + 1, 2)), comm=comm)
        with pytest.raises(ValueError, match=r"shape \(size, ...\)"):
            op(jnp.ones(()), comm=comm)
    with pytest.raises(TypeError, match="not defined for bool"):
        C.reduce_scatter(jnp.ones((size, 2), bool), "prod", comm=comm)
    with pytest.raises(TypeError, match="complex"):
        C.scan(jnp.ones(2, jnp.complex128), "min", comm=comm)
    with pytest.raises(TypeError, match="mpi4py communicator"):
        C.allgather(jnp.ones(2), comm=object())
    with pytest.raises(ValueError, match="unknown reduction op"):
        C.reduce(jnp.ones(2), "mean", comm=comm)
    # Still in step.
    np.testing.assert_allclose(C.allreduce(jnp.ones(1), comm=comm), [size])


def test_transformations_linearize_linear_transpose_custom_jvp(comm, rank, size):
    x = jnp.asarray(np.random.default_rng(rank).standard_normal(3))
    G = jnp.asarray(gather_global(x, comm))

    # linearize + linear_transpose of allgather: the transpose is reduce_scatter.
    _, lin = jax.linearize(lambda a: C.allgather(a, comm=comm), x)
    (back,) = jax.linear_transpose(lin, x)(jnp.ones((size, 3)) * (rank + 1))
    np.testing.assert_allclose(back, np.full(3, size * (size + 1) / 2))

    @jax.custom_jvp
    def smooth_total(a):
        return C.allreduce(jnp.sin(a), comm=comm)

    @smooth_total.defjvp
    def _(primals, tangents):
        (a,), (t,) = primals, tangents
        return smooth_total(a), C.allreduce(jnp.cos(a) * t, comm=comm)

    g = jax.grad(lambda a: jnp.sum(smooth_total(a)))(x)
    np.testing.assert_allclose(g, size * np.cos(x), rtol=1e-13)
    np.testing.assert_allclose(jax.jit(smooth_total)(x), np.sin(G).sum(0), rtol=1e-13)
