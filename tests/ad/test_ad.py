"""distlinalg.ad: exact gradients of replicated losses, distributed check_grads."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import distlinalg.ad as dad
from distlinalg.comm.allgather import allgather
from distlinalg.comm.allreduce import allreduce
from distlinalg.comm.alltoall import alltoall
from distlinalg.comm.bcast import bcast
from distlinalg.comm.gather import gather
from distlinalg.comm.p2p import sendrecv
from distlinalg.comm.reduce import reduce
from distlinalg.comm.reduce_scatter import reduce_scatter
from distlinalg.comm.scan import exscan, scan
from distlinalg.comm.scatter import scatter
from conftest import assert_matches_reference, gather_global

LAMBDA = 0.3
ROWS, COLS = 5, 3


def problem(rank):
    rng = np.random.default_rng(40 + rank)
    return jnp.asarray(rng.standard_normal((ROWS, COLS))), jnp.asarray(rng.standard_normal(ROWS))


def global_data(comm):
    A, b = problem(comm.Get_rank())
    return jnp.asarray(np.concatenate(comm.allgather(np.asarray(A)))), jnp.asarray(
        np.concatenate(comm.allgather(np.asarray(b)))
    )


def my_rows(rank):
    return slice(ROWS * rank, ROWS * (rank + 1))


def least_squares(comm):
    """Sum of squares over every rank's rows (allreduce) + a regulariser that
    every rank computes redundantly; and its single-process reference."""

    def loss(w, A, b):
        return allreduce(jnp.sum((A @ w - b) ** 2), comm=comm) + LAMBDA * jnp.sum(w**2)

    def reference(w, A, b):
        return jnp.sum((A @ w - b) ** 2) + LAMBDA * jnp.sum(w**2)

    return loss, reference


def in_step(comm):
    """A collective after a test's last check: every rank got here."""
    assert float(allreduce(jnp.ones(()), comm=comm)) == comm.Get_size()


# ---------------------------------------------------------------------------
# grad / value_and_grad
@pytest.mark.parametrize("jit", [False, True])
def test_least_squares_replicated_params(comm, rank, size, jit):
    A, b = problem(rank)
    A_all, b_all = global_data(comm)
    w = jnp.asarray([0.5, -1.0, 2.0])
    loss, reference = least_squares(comm)
    wrap = jax.jit if jit else (lambda f: f)

    value, g = wrap(dad.value_and_grad(loss, comm=comm))(w, A, b)
    np.testing.assert_allclose(value, reference(w, A_all, b_all), rtol=1e-13)
    np.testing.assert_allclose(value, loss(w, A, b), rtol=1e-14)  # the loss as computed here
    np.testing.assert_allclose(g, jax.grad(reference)(w, A_all, b_all), rtol=1e-12)
    np.testing.assert_allclose(wrap(dad.grad(loss, comm=comm))(w, A, b), g, rtol=1e-14)
    everyone = gather_global(g, comm)
    assert (everyone == everyone[0]).all(), "replicated gradient differs between ranks"
    # Plain jax.grad seeds 1 on every rank, i.e. differentiates Σ_r L_r = P·L,
    # and leaves each rank the paths through its own copy of w: only the sum
    # over ranks means anything, and it is P times the gradient.
    plain = jax.grad(loss)(w, A, b)
    np.testing.assert_allclose(allreduce(plain, comm=comm), size * g, rtol=1e-12)


def test_sharded_argument_gets_its_block(comm, rank, size):
    A, b = problem(rank)
    A_all, b_all = global_data(comm)
    w = jnp.asarray([0.5, -1.0, 2.0])

    def loss(w, A):
        return allreduce(jnp.sum(jnp.sin(A @ w - b)), comm=comm) + LAMBDA * jnp.sum(w**2)

    def reference(w, A):
        return jnp.sum(jnp.sin(A @ w - b_all)) + LAMBDA * jnp.sum(w**2)

    rw, rA = jax.grad(reference, argnums=(0, 1))(w, A_all)
    gw, gA = dad.grad(loss, argnums=(0, 1), sharded=1, comm=comm)(w, A)
    np.testing.assert_allclose(gw, rw, rtol=1e-12)
    np.testing.assert_allclose(gA, rA[my_rows(rank)], rtol=1e-12)
    # The same with the argnums reversed, negative, and sharded as a mapping.
    gA2, gw2 = jax.jit(dad.grad(loss, argnums=(-1, 0), sharded={-1: True}, comm=comm))(w, A)
    np.testing.assert_allclose(gw2, rw, rtol=1e-12)
    np.testing.assert_allclose(gA2, rA[my_rows(rank)], rtol=1e-12)
    # Only the sharded argument: its block, no allreduce needed.
    value, gA3 = dad.value_and_grad(loss, argnums=1, sharded=(1,), comm=comm)(w, A)
    np.testing.assert_allclose(value, reference(w, A_all), rtol=1e-13)
    np.testing.assert_allclose(gA3, rA[my_rows(rank)], rtol=1e-12)


def test_sharded_pytree_prefix(comm, rank, size):
    """One parameter dict with a replicated weight and a table split over
    ranks (model parallel): sharded={0: {"w": False, "table": True}}."""
    A, b = problem(rank)
    A_all, b_all = global_data(comm)
    rng = np.random.default_rng(7 + rank)
    params = {
        "w": jnp.asarray([0.2, -0.4, 0.6]),
        "scale": jnp.asarray(1.5, jnp.float32),
        "table": {"u": jnp.asarray(rng.standard_normal(ROWS)), "v": jnp.asarray(rng.standard_normal(2))},
    }
    tables = [gather_global(params["table"][k], comm) for k in ("u", "v")]

    def loss(p, A, b):
        r = p["scale"] * (A @ p["w"]) - b + p["table"]["u"] * jnp.sum(p["table"]["v"] ** 2)
        return allreduce(jnp.sum(jnp.tanh(r) ** 2), comm=comm) + LAMBDA * jnp.sum(p["w"] ** 2)

    def reference(w, scale, U, V):
        r = scale * (A_all @ w) - b_all + (U * jnp.sum(V**2, axis=1, keepdims=True)).ravel()
        return jnp.sum(jnp.tanh(r) ** 2) + LAMBDA * jnp.sum(w**2)

    spec = {0: {"w": False, "scale": False, "table": True}}
    value, g = dad.value_and_grad(loss, sharded=spec, comm=comm)(params, A, b)
    ref = jax.grad(reference, argnums=(0, 1, 2, 3))(params["w"], params["scale"], *map(jnp.asarray, tables))
    np.testing.assert_allclose(value, reference(params["w"], params["scale"], *tables), rtol=1e-6)
    np.testing.assert_allclose(g["w"], ref[0], rtol=1e-6)
    np.testing.assert_allclose(g["scale"], ref[1], rtol=1e-5)
    assert g["scale"].dtype == jnp.float32
    np.testing.assert_allclose(g["table"]["u"], ref[2][rank], rtol=1e-6)
    np.testing.assert_allclose(g["table"]["v"], ref[3][rank], rtol=1e-6)
    # A finer prefix (table.u sharded, table.v too) gives the same.
    spec2 = {0: {"w": False, "scale": False, "table": {"u": True, "v": True}}}
    g2 = jax.jit(dad.grad(loss, sharded=spec2, comm=comm))(params, A, b)
    for a, c in zip(jax.tree_util.tree_leaves(g2), jax.tree_util.tree_leaves(g)):
        np.testing.assert_allclose(a, c, rtol=1e-12)


@pytest.mark.parametrize("jit", [False, True])
def test_pytree_params_and_aux(comm, rank, size, jit):
    A, b = problem(rank)
    A_all, b_all = global_data(comm)
    params = {"w": jnp.asarray([0.1, 0.2, 0.3]), "bias": jnp.asarray(0.5)}
    wrap = jax.jit if jit else (lambda f: f)

    def loss(params, A, b):
        r = A @ params["w"] + params["bias"] - b
        total = allreduce(jnp.sum(r**2), comm=comm)
        return total, {"local": jnp.sum(r**2), "rows": A.shape[0]}

    def reference(params):
        return jnp.sum((A_all @ params["w"] + params["bias"] - b_all) ** 2)

    (value, aux), g = wrap(dad.value_and_grad(loss, has_aux=True, comm=comm))(params, A, b)
    local = jnp.sum((A @ params["w"] + params["bias"] - b) ** 2)
    np.testing.assert_allclose(aux["local"], local, rtol=1e-13)  # this rank's aux, untouched
    assert int(aux["rows"]) == ROWS
    np.testing.assert_allclose(value, reference(params), rtol=1e-13)
    ref = jax.grad(reference)(params)
    np.testing.assert_allclose(g["w"], ref["w"], rtol=1e-12)
    np.testing.assert_allclose(g["bias"], ref["bias"], rtol=1e-12)
    g2, aux2 = wrap(dad.grad(loss, has_aux=True, comm=comm))(params, A, b)
    np.testing.assert_allclose(g2["w"], ref["w"], rtol=1e-12)
    np.testing.assert_allclose(aux2["local"], local, rtol=1e-13)


def test_helper_is_differentiable_and_vmappable(comm, rank, size):
    A, b = problem(rank)
    A_all, b_all = global_data(comm)
    loss, reference = least_squares(comm)
    w = jnp.asarray([0.5, -1.0, 2.0])
    v = jnp.asarray([1.0, 0.5, -2.0])
    hessian = 2 * (A_all.T @ A_all + LAMBDA * jnp.eye(COLS))

    # Forward over the helper: all ranks move their copy of w together.
    H = jax.jit(jax.jacfwd(dad.grad(loss, comm=comm)))(w, A, b)
    np.testing.assert_allclose(H, hessian, rtol=1e-12)
    # Reverse over the helper: the helper again, on the replicated scalar g·v.
    hvp = dad.grad(lambda w: dad.grad(loss, comm=comm)(w, A, b) @ v, comm=comm)(w)
    np.testing.assert_allclose(hvp, hessian @ v, rtol=1e-12)
    # vmap over a batch of parameter vectors: one allreduce carries the batch.
    W = jnp.stack([w, v, w - v, 2 * v])
    batched = jax.vmap(dad.grad(loss, comm=comm), in_axes=(0, None, None))(W, A, b)
    for k in range(W.shape[0]):
        np.testing.assert_allclose(batched[k], jax.grad(reference)(W[k], A_all, b_all), rtol=1e-12)


def test_gradient_descent_in_fori_loop(comm, rank, size):
    A, b = problem(rank)
    A_all, b_all = global_data(comm)
    loss, reference = least_squares(comm)
    step = 0.01

    @jax.jit
    def descend(w):
        return jax.lax.fori_loop(0, 20, lambda i, w: w - step * dad.grad(loss, comm=comm)(w, A, b), w)

    w = jnp.zeros(COLS)
    expected = w
    for _ in range(20):
        expected = expected - step * jax.grad(reference)(expected, A_all, b_all)
    got = descend(w)
    np.testing.assert_allclose(got, expected, rtol=1e-12)
    assert_matches_reference(got, np.stack([np.asarray(expected)] * size), comm)

    # value_and_grad inside lax.scan, collecting the loss history.
    def body(w, _):
        value, g = dad.value_and_grad(loss, comm=comm)(w, A, b)
        return w - step * g, value

    _, history = jax.jit(lambda w: jax.lax.scan(body, w, None, length=5))(w)
    assert history.shape == (5,) and bool(jnp.all(jnp.diff(history) < 0))
    np.testing.assert_allclose(history[0], reference(w, A_all, b_all), rtol=1e-13)


def test_bcast_of_the_differentiated_parameter(comm, rank, size):
    """Root-authoritative parameters: every rank passes the same traced w to
    bcast (docs/ad.md, templates); the helper still gives the full gradient."""
    A, b = problem(rank)
    A_all, b_all = global_data(comm)
    w = jnp.asarray([0.5, -1.0, 2.0])
    root = size - 1

    def loss(w):
        w_root = bcast(w, root=root, comm=comm)
        return allreduce(jnp.sum((A @ w_root - b) ** 2), comm=comm) + LAMBDA * jnp.sum(w**2)

    _, reference = least_squares(comm)
    g = jax.jit(dad.grad(loss, comm=comm))(w)
    np.testing.assert_allclose(g, jax.grad(reference)(w, A_all, b_all), rtol=1e-12)


def test_helper_errors(comm, rank, size):
    w = jnp.ones(2)
    with pytest.raises(ValueError, match="not among argnums"):
        dad.grad(lambda w: w, argnums=0, sharded=1, comm=comm)
    with pytest.raises(ValueError, match="not among argnums"):
        dad.grad(lambda w, x: jnp.sum(w), argnums=0, sharded=-1, comm=comm)(w, w)
    with pytest.raises(TypeError, match="positional arguments"):
        dad.grad(lambda w: jnp.sum(w), argnums=2, comm=comm)(w)
    with pytest.raises(ValueError, match="repeats"):
        dad.grad(lambda w: jnp.sum(w), argnums=(0, 0), comm=comm)
    with pytest.raises(TypeError, match="bool"):
        dad.grad(lambda w: jnp.sum(w), sharded=True, comm=comm)
    with pytest.raises(TypeError, match="must be a scalar"):
        dad.grad(lambda w: w * 2, comm=comm)(w)
    with pytest.raises(TypeError, match="real floating"):
        dad.grad(lambda w: jnp.sum(w) * 1j, comm=comm)(w)
    with pytest.raises(TypeError, match="floating or complex"):
        dad.grad(lambda w: jnp.sum(w), comm=comm)(jnp.ones(2, jnp.int32))
    with pytest.raises(TypeError, match="pair"):
        dad.grad(lambda w: jnp.sum(w), has_aux=True, comm=comm)(w)
    with pytest.raises(ValueError, match="pytree prefix"):
        dad.grad(lambda p: jnp.sum(p["a"]), sharded={0: {"b": True}}, comm=comm)({"a": w})
    with pytest.raises(TypeError, match="True/False"):
        dad.grad(lambda p: jnp.sum(p["a"]), sharded={0: {"a": 1}}, comm=comm)({"a": w})
    in_step(comm)


# ---------------------------------------------------------------------------
# check_grads
@pytest.mark.parametrize("order", [1, 2])
def test_check_grads_allreduce_functions(comm, rank, size, order):
    x = jnp.asarray(np.random.default_rng(rank).uniform(0.5, 1.5, 4))

    def f(x):
        y = allreduce(x * x, comm=comm)
        p = allreduce(jnp.sin(x), "prod", comm=comm)
        m = allreduce(x + 0.1 * rank, "max", comm=comm)
        return allreduce(jnp.sin(y) * (rank + 1.0), comm=comm) + p * m

    dad.check_grads(f, (x,), order=order, comm=comm)
    if order == 1:
        dad.check_grads(f, (x,), modes="rev", comm=comm)


@pytest.mark.parametrize("order", [1, 2])
def test_check_grads_other_collectives(comm, rank, size, order):
    x = jnp.asarray(np.random.default_rng(rank).uniform(0.5, 1.5, 4))

    def f(x):
        z = allgather(jnp.sin(x), comm=comm)
        return reduce_scatter(z * (rank + 1.0), comm=comm) * scan(x, "prod", comm=comm)

    dad.check_grads(f, (x,), order=order, comm=comm)


def test_check_grads_on_every_linear_op(comm, rank, size):
    x = jnp.asarray(np.random.default_rng(rank).standard_normal(3))
    blocks = jnp.asarray(np.random.default_rng(rank + 9).standard_normal((size, 2)))
    cases = [
        ("bcast", lambda a: bcast(a, root=size - 1, comm=comm), x),
        ("reduce", lambda a: reduce(a, "sum", root=0, comm=comm), x),
        ("gather", lambda a: gather(a, root=size - 1, comm=comm), x),
        ("scatter", lambda a: scatter(a, root=0, comm=comm), blocks),
        ("allgather", lambda a: allgather(a, comm=comm), x),
        ("reduce_scatter", lambda a: reduce_scatter(a, comm=comm), blocks),
        ("alltoall", lambda a: alltoall(a, comm=comm), blocks),
        ("scan", lambda a: scan(a, comm=comm), x),
        ("exscan", lambda a: exscan(a, comm=comm), x),
        ("sendrecv", lambda a: sendrecv(a, a, (rank - 1) % size, (rank + 1) % size, comm=comm), x),
    ]
    # First order: the checker on every op's rules. Its second order through
    # allgather, reduce_scatter and scan is test_check_grads_other_collectives[2];
    # every op's own second derivatives are test_collectives.py's.
    for name, fn, arg in cases:
        try:
            dad.check_grads(fn, (arg,), comm=comm)
        except AssertionError as err:  # raised on every rank: the checks are global
            raise AssertionError(f"check_grads of {name}: {err}") from err
    in_step(comm)


def test_check_grads_pytrees_and_complex(comm, rank, size):
    rng = np.random.default_rng(rank)
    tree = {"a": jnp.asarray(rng.standard_normal(3)), "b": (jnp.asarray(rng.standard_normal(2)),)}
    z = jnp.asarray(rng.standard_normal(3) + 1j * rng.standard_normal(3))

    def f(t, s):
        total = allreduce({"x": t["a"] * s, "y": t["b"][0] ** 2}, comm=comm)
        return jnp.sum(total["x"]) * t["b"][0], {"s": jnp.tanh(total["y"]) + s}

    dad.check_grads(f, (tree, jnp.asarray(0.7)), order=2, comm=comm)

    # Holomorphic and non-holomorphic complex functions (real pairing).
    dad.check_grads(lambda z: allreduce(z * z, comm=comm) * z, (z,), comm=comm)
    dad.check_grads(lambda z: jnp.abs(allreduce(z, comm=comm)) ** 2 + jnp.conj(z), (z,), comm=comm)
    # Single precision takes single-precision tolerances.
    dad.check_grads(lambda x: jnp.sin(allreduce(x, comm=comm)), (jnp.asarray(rng.standard_normal(3), jnp.float32),),
                    comm=comm)


def test_rank_dependent_downstream(comm, rank, size):
    """loss_r = c_r * sum(allreduce(x)²): the downstream use depends on the
    rank, where an identity transpose of allreduce goes wrong."""
    x = jnp.asarray(np.random.default_rng(rank).standard_normal(3))
    c = float(rank + 1)

    def loss(x):
        return c * jnp.sum(allreduce(x, comm=comm) ** 2)

    dad.check_grads(loss, (x,), order=2, comm=comm)

    # Against the stacked reference: F(X)_r = c_r |Σ_t X_t|², rank-dependent
    # cotangents ȳ_r and tangents ẋ_r.
    X = jnp.asarray(gather_global(x, comm))
    cs = jnp.arange(1.0, size + 1)

    def stacked(X):
        return cs * jnp.sum(jnp.sum(X, axis=0) ** 2)

    ybar = 1.0 + 0.5 * rank
    xdot = jnp.asarray(np.random.default_rng(50 + rank).standard_normal(3))
    (xbar,) = jax.vjp(loss, x)[1](jnp.asarray(ybar))
    Xbar = jax.vjp(stacked, X)[1](1.0 + 0.5 * jnp.arange(size))[0]
    assert_matches_reference(xbar, Xbar, comm)
    _, ydot = jax.jvp(loss, (x,), (xdot,))
    _, Ydot = jax.jvp(stacked, (X,), (jnp.asarray(gather_global(xdot, comm)),))
    assert_matches_reference(ydot, Ydot, comm)
    # value_and_grad of a loss whose ranks disagree differentiates their mean.
    value, g = dad.value_and_grad(loss, sharded=0, comm=comm)(x)
    np.testing.assert_allclose(value, c * jnp.sum(jnp.sum(X, axis=0) ** 2), rtol=1e-13)
    mean_ref = jax.grad(lambda X: jnp.mean(stacked(X)))(X)
    assert_matches_reference(g, mean_ref, comm)


def test_check_grads_catches_identity_transpose(comm, rank, size):
    """An mpi4jax-style allreduce whose transpose is the identity."""

    @jax.custom_vjp
    def wrong_allreduce(x):
        return allreduce(x, comm=comm)

    wrong_allreduce.defvjp(lambda x: (allreduce(x, comm=comm), None), lambda _, ct: (ct,))
    x = jnp.asarray(np.random.default_rng(rank).standard_normal(3))
    if size == 1:
        # One rank: the identity is the right transpose, nothing to catch.
        dad.check_grads(wrong_allreduce, (x,), modes=("rev",), comm=comm)
        dad.check_grads(lambda x: jnp.sin(wrong_allreduce(x)) * 2.0, (x,), modes=("rev",), order=2, comm=comm)
    else:
        # Raised on every rank (pytest.raises on each), by the global test.
        with pytest.raises(AssertionError, match="dot-product test"):
            dad.check_grads(wrong_allreduce, (x,), modes=("rev",), comm=comm)
        with pytest.raises(AssertionError, match="dot-product test"):
            dad.check_grads(lambda x: (rank + 1.0) * wrong_allreduce(x), (x,), modes=("rev",), comm=comm)
    # The real primitive passes everywhere, and the ranks are still in step.
    dad.check_grads(lambda x: allreduce(x, comm=comm), (x,), comm=comm)
    dad.check_grads(lambda x: (rank + 1.0) * allreduce(x, comm=comm), (x,), order=2, comm=comm)
    in_step(comm)


def test_check_grads_catches_wrong_jvp_on_one_rank(comm, rank, size):
    """A JVP that drops the other ranks' tangents, on the last rank only:
    every rank raises, and the message names the failing rank."""
    bad_rank = size - 1

    @jax.custom_jvp
    def local_tangent_allreduce(x):
        return allreduce(x, comm=comm)

    @local_tangent_allreduce.defjvp
    def _(primals, tangents):
        (x,), (t,) = primals, tangents
        summed = allreduce(t, comm=comm)  # every rank communicates the same way
        return allreduce(x, comm=comm), (t if rank == bad_rank else summed)

    x = jnp.asarray(np.random.default_rng(rank).standard_normal(3))
    if size == 1:
        dad.check_grads(local_tangent_allreduce, (x,), modes=("fwd",), comm=comm)
    else:
        with pytest.raises(AssertionError, match=rf"forward mode \(f\).*rank\(s\) \[{bad_rank}\]"):
            dad.check_grads(local_tangent_allreduce, (x,), modes=("fwd",), comm=comm)
    in_step(comm)


def test_check_grads_catches_wrong_second_order(comm, rank, size):
    """Correct first derivative, wrong second: only order 2 sees it."""

    @jax.custom_jvp
    def sin_allreduce(x):
        return jnp.sin(allreduce(x, comm=comm))

    @sin_allreduce.defjvp
    def _(primals, tangents):
        (x,), (t,) = primals, tangents
        s = allreduce(x, comm=comm)
        # cos computed through stop_gradient: its own derivative is lost.
        return jnp.sin(s), jax.lax.stop_gradient(jnp.cos(s)) * allreduce(t, comm=comm)

    x = jnp.asarray(np.random.default_rng(rank).standard_normal(3))
    dad.check_grads(sin_allreduce, (x,), order=1, comm=comm)
    with pytest.raises(AssertionError, match="JVP of f"):
        dad.check_grads(sin_allreduce, (x,), order=2, modes=("fwd",), comm=comm)
    in_step(comm)


def test_check_grads_bad_arguments(comm, rank):
    x = jnp.ones(2)
    f = lambda x: allreduce(x, comm=comm)  # noqa: E731
    with pytest.raises(ValueError, match="unknown mode"):
        dad.check_grads(f, (x,), modes=("fwd", "bwd"), comm=comm)
    with pytest.raises(ValueError, match="order"):
        dad.check_grads(f, (x,), order=0, comm=comm)
    with pytest.raises(ValueError, match="eps"):
        dad.check_grads(f, (x,), eps=0.0, comm=comm)
    with pytest.raises(TypeError, match="floating or complex"):
        dad.check_grads(f, (jnp.ones(2, jnp.int32),), comm=comm)
    with pytest.raises(TypeError, match="outputs"):
        dad.check_grads(lambda x: jnp.argmax(allreduce(x, comm=comm)), (x,), comm=comm)
    in_step(comm)


# ---------------------------------------------------------------------------
# Replicated arguments of check_grads (issue 42, item 4)
def _replicated_scaled_solve(comm):
    """x(s, b) = (s A)⁻¹ b with A replicated, held as a sum of per-rank shares
    (its matvec allreduces): correct only while s and b are replicated."""
    import distlinalg as dl

    A = np.array([[4.0, 1.0, 0.0], [1.0, 3.0, 0.5], [0.0, 0.5, 2.0]])
    share = jnp.asarray(A / comm.Get_size())

    def solve(s, b):
        op = dl.operators.LinearOperator(lambda d, v: d[0] * allreduce(d[1] @ v, comm=comm), data=(s, share),
                                         input_structure=b, symmetric=True, hermitian=True, comm=comm)
        return dl.cg(op, b, rtol=1e-13)[0]

    return solve, A


def test_check_grads_replicated_arguments(comm, rank, size):
    """Named replicated arguments are perturbed alike on every rank: the exact
    gradient of a replicated solve passes at orders 1 and 2; perturbed per
    rank (the default), the same program fails the check from two ranks on."""
    solve, _ = _replicated_scaled_solve(comm)
    args = (jnp.asarray(1.5), jnp.array([1.0, -2.0, 0.5]))
    dad.check_grads(solve, args, order=2, replicated=(0, 1), comm=comm)
    dad.check_grads(lambda b, s: solve(s, b), args[::-1], replicated=[0, -1], comm=comm)
    if size > 1:
        with pytest.raises(AssertionError, match="check_grads"):
            dad.check_grads(solve, args, comm=comm)
    with pytest.raises(ValueError, match="replicated must hold positions"):
        dad.check_grads(solve, args, replicated=2, comm=comm)
    in_step(comm)


# ---------------------------------------------------------------------------
# MINRES's shift is differentiated (issue 42, item 3)
@pytest.mark.parametrize("layout", ["replicated", "sharded"])
def test_minres_shift_is_differentiated(comm, rank, size, layout):
    """d/dσ and d/db of a loss of x = (A − σI)⁻¹ b through distlinalg.minres,
    forward and reverse, against jax on the gathered matrix."""
    import distlinalg as dl

    n = 6
    A = np.diag(np.arange(1.0, n + 1)) + 0.3 * np.eye(n, k=1) + 0.3 * np.eye(n, k=-1) - 2.5 * np.eye(n)  # indefinite
    b_all = np.linspace(0.5, 1.5, n)
    if layout == "replicated":
        op, b = jnp.asarray(A), jnp.asarray(b_all)
        loss_of_x = lambda x: jnp.sum(x ** 3)  # noqa: E731
    else:
        part = dl.operators.Partition.even(n, size)
        lo, hi = part.starts[rank], part.starts[rank + 1]
        op = dl.operators.dense_rows(jnp.asarray(A[lo:hi]), symmetric=True, hermitian=True, comm=comm)
        b = jnp.asarray(b_all[lo:hi])
        loss_of_x = lambda x: allreduce(jnp.sum(x ** 3), comm=comm)  # noqa: E731

    def loss(shift, b):
        return loss_of_x(dl.minres(op, b, shift=shift, rtol=1e-13, layout=layout, comm=comm)[0])

    def reference(shift, b):
        return jnp.sum(jnp.linalg.solve(jnp.asarray(A) - shift * jnp.eye(n), b) ** 3)

    sigma = 0.4
    e_shift, e_b = jax.grad(reference, argnums=(0, 1))(sigma, jnp.asarray(b_all))
    if layout == "replicated":
        # The loss is replicated (every rank computes it from the same x): its exact gradient.
        g_shift, g_b = jax.jit(dad.grad(loss, comm=comm, argnums=(0, 1)))(sigma, b)
        np.testing.assert_allclose(float(g_shift), float(e_shift), rtol=1e-8)
        np.testing.assert_allclose(np.asarray(g_b), np.asarray(e_b), rtol=1e-8)
    else:
        g_shift, g_b = jax.jit(dad.grad(loss, sharded=1, comm=comm, argnums=(0, 1)))(sigma, b)
        np.testing.assert_allclose(float(g_shift), float(e_shift), rtol=1e-8)
        np.testing.assert_allclose(np.concatenate(comm.allgather(np.asarray(g_b))), np.asarray(e_b), rtol=1e-8)
    _, t_out = jax.jit(lambda s: jax.jvp(lambda s: loss(s, b), (s,), (1.0,)))(sigma)
    _, e_out = jax.jvp(lambda s: reference(s, jnp.asarray(b_all)), (sigma,), (1.0,))
    np.testing.assert_allclose(float(t_out), float(e_out), rtol=1e-8)
