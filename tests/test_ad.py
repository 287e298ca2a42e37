"""distlinalg.ad: exact gradients of replicated losses, distributed check_grads."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import distlinalg.ad as dad
from distlinalg import comm as C
from conftest import gather_global

LAMBDA = 0.3


def problem(rank):
    rng = np.random.default_rng(40 + rank)
    return jnp.asarray(rng.standard_normal((5, 3))), jnp.asarray(rng.standard_normal(5))


def global_data(comm):
    A, b = problem(comm.Get_rank())
    return jnp.asarray(np.concatenate(comm.allgather(np.asarray(A)))), jnp.asarray(
        np.concatenate(comm.allgather(np.asarray(b)))
    )


def test_least_squares_replicated_params(comm, rank, size):
    A, b = problem(rank)
    A_all, b_all = global_data(comm)
    w = jnp.asarray([0.5, -1.0, 2.0])

    def loss(w, A, b):
        # Sum over all ranks' rows by an allreduce, plus a regulariser
        # computed redundantly on every rank.
        return C.allreduce(jnp.sum((A @ w - b) ** 2), comm=comm) + LAMBDA * jnp.sum(w**2)

    def global_loss(w, A, b):
        return jnp.sum((A @ w - b) ** 2) + LAMBDA * jnp.sum(w**2)

    value, g = dad.value_and_grad(loss, comm=comm)(w, A, b)
    np.testing.assert_allclose(value, global_loss(w, A_all, b_all), rtol=1e-13)
    np.testing.assert_allclose(g, jax.grad(global_loss)(w, A_all, b_all), rtol=1e-12)
    np.testing.assert_allclose(dad.grad(loss, comm=comm)(w, A, b), g, rtol=1e-14)
    # Jitted, and every rank holds the identical gradient.
    gj = jax.jit(dad.grad(loss, comm=comm))(w, A, b)
    everyone = gather_global(gj, comm)
    assert (everyone == everyone[0]).all()
    # Plain jax.grad seeds 1 on every rank and leaves each rank its own path.
    plain = jax.grad(loss)(w, A, b)
    np.testing.assert_allclose(C.allreduce(plain, comm=comm) / size, g, rtol=1e-12)


def test_sharded_argument_gets_its_block(comm, rank, size):
    A, b = problem(rank)
    A_all, b_all = global_data(comm)
    w = jnp.asarray([0.5, -1.0, 2.0])

    def loss(w, A):
        return C.allreduce(jnp.sum(jnp.sin(A @ w - b)), comm=comm) + LAMBDA * jnp.sum(w**2)

    def global_loss(w, A):
        return jnp.sum(jnp.sin(A @ w - b_all)) + LAMBDA * jnp.sum(w**2)

    gw, gA = dad.grad(loss, argnums=(0, 1), sharded=1, comm=comm)(w, A)
    rw, rA = jax.grad(global_loss, argnums=(0, 1))(w, A_all)
    np.testing.assert_allclose(gw, rw, rtol=1e-12)
    np.testing.assert_allclose(gA, rA[5 * rank : 5 * rank + 5], rtol=1e-12)


def test_pytree_params_and_aux(comm, rank, size):
    A, b = problem(rank)
    A_all, b_all = global_data(comm)
    params = {"w": jnp.asarray([0.1, 0.2, 0.3]), "bias": jnp.asarray(0.5)}

    def loss(params, A, b):
        r = A @ params["w"] + params["bias"] - b
        total = C.allreduce(jnp.sum(r**2), comm=comm)
        return total, {"rows": A.shape[0]}

    def global_loss(params):
        return jnp.sum((A_all @ params["w"] + params["bias"] - b_all) ** 2)

    (value, aux), g = dad.value_and_grad(loss, has_aux=True, comm=comm)(params, A, b)
    assert aux == {"rows": 5}
    ref = jax.grad(global_loss)(params)
    np.testing.assert_allclose(g["w"], ref["w"], rtol=1e-12)
    np.testing.assert_allclose(g["bias"], ref["bias"], rtol=1e-12)
    g2, aux2 = dad.grad(loss, has_aux=True, comm=comm)(params, A, b)
    np.testing.assert_allclose(g2["w"], ref["w"], rtol=1e-12)


def test_helper_errors(comm):
    with pytest.raises(ValueError, match="not among argnums"):
        dad.grad(lambda w: w, argnums=0, sharded=1, comm=comm)
    with pytest.raises(TypeError, match="must be a scalar"):
        dad.grad(lambda w: w * 2, comm=comm)(jnp.ones(2))


@pytest.mark.parametrize("order", [1, 2])
def test_check_grads_passes_on_correct_rules(comm, rank, size, order):
    x = jnp.asarray(np.random.default_rng(rank).uniform(0.5, 1.5, 4))

    def f(x):
        y = C.allreduce(x * x, comm=comm)
        z = C.allgather(jnp.sin(y), comm=comm)
        return C.reduce_scatter(z * (rank + 1.0), comm=comm) + C.scan(x, "prod", comm=comm)

    dad.check_grads(f, (x,), order=order, comm=comm)


def test_check_grads_rank_dependent_downstream(comm, rank, size):
    x = jnp.asarray(np.random.default_rng(rank).standard_normal(3))
    c = float(rank + 1)

    def loss(x):
        return c * jnp.sum(C.allreduce(x, comm=comm) ** 2)

    dad.check_grads(loss, (x,), order=2, comm=comm)
    # Against the stacked reference: d/dx_s Σ_r c_r |Σ_t x_t|² = 2 (Σ_r c_r) Σ_t x_t.
    total = gather_global(x, comm).sum(0)
    csum = sum(range(1, size + 1))
    np.testing.assert_allclose(jax.grad(loss)(x), 2 * csum * total, rtol=1e-12)


def test_check_grads_catches_identity_transpose(comm, rank, size):
    """mpi4py-style allreduce whose transpose is the identity."""

    @jax.custom_vjp
    def wrong_allreduce(x):
        return C.allreduce(x, comm=comm)

    wrong_allreduce.defvjp(lambda x: (C.allreduce(x, comm=comm), None), lambda _, ct: (ct,))
    x = jnp.asarray(np.random.default_rng(rank).standard_normal(3))
    if size == 1:
        # Identity is the right transpose on one rank.
        dad.check_grads(wrong_allreduce, (x,), modes=("rev",), comm=comm)
    else:
        with pytest.raises(AssertionError, match="dot-product test"):
            dad.check_grads(wrong_allreduce, (x,), modes=("rev",), comm=comm)
    # The real primitive passes everywhere.
    dad.check_grads(lambda x: C.allreduce(x, comm=comm), (x,), comm=comm)


def test_check_grads_on_every_linear_op(comm, rank, size):
    x = jnp.asarray(np.random.default_rng(rank).standard_normal(3))
    blocks = jnp.asarray(np.random.default_rng(rank + 9).standard_normal((size, 2)))
    for fn, arg in [
        (lambda a: C.bcast(a, root=size - 1, comm=comm), x),
        (lambda a: C.reduce(a, "sum", root=0, comm=comm), x),
        (lambda a: C.gather(a, root=size - 1, comm=comm), x),
        (lambda a: C.scatter(a, root=0, comm=comm), blocks),
        (lambda a: C.alltoall(a, comm=comm), blocks),
        (lambda a: C.exscan(a, comm=comm), x),
        (lambda a: C.sendrecv(a, a, (rank + 1) % size, (rank - 1) % size, comm=comm), x),
    ]:
        dad.check_grads(fn, (arg,), comm=comm)
