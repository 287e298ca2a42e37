"""distlinalg.operators as pytrees: flatten/unflatten, jit arguments, composition
(@, +, -, scalar *, .T, .H) against the dense matrices of the gathered data,
gradients with respect to an operator passed to a jitted function, and the
transpose of replicated operators whose matvec communicates."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse as sp

from distlinalg import operators as ops
from distlinalg.comm import allreduce
from distlinalg.operators._base import scaled


def concat_blocks(local, comm):
    return np.concatenate(comm.allgather(np.asarray(local)))


def block(vector, partition, rank):
    return vector[partition.starts[rank] : partition.starts[rank + 1]]


def rows_operator(A, comm):
    part = ops.Partition.even(A.shape[0], comm.Get_size())
    return ops.dense_rows(block(A, part, comm.Get_rank()), comm=comm), part


def test_flatten_roundtrip_and_children(comm, rank, size):
    A = np.random.default_rng(0).standard_normal((6, 6))
    op, part = rows_operator(A, comm)
    leaves, treedef = jax.tree_util.tree_flatten(op)
    assert len(leaves) == 1 and leaves[0].shape == (part.size_of(rank), 6)  # the row block is the child
    again = jax.tree_util.tree_unflatten(treedef, leaves)
    x = jnp.asarray(block(np.arange(6.0), part, rank))
    np.testing.assert_array_equal(np.asarray(again @ x), np.asarray(op @ x))
    assert again.layout == "sharded" and again.comm == op.comm
    # The same operator flattens to equal tree definitions (jit reuses its compilation).
    assert jax.tree_util.tree_structure(op) == jax.tree_util.tree_structure(again)
    sparse = ops.sparse_rows(sp.random(7, 7, density=0.4, random_state=1, format="csr") + sp.eye(7), comm=comm)
    assert any(leaf is sparse.data for leaf in jax.tree_util.tree_leaves(sparse))
    closure = ops.laplacian_2d(3, comm=comm)  # matrix-free: no children
    assert jax.tree_util.tree_leaves(closure) == []


def test_operator_as_jit_argument(comm, rank, size):
    A = np.random.default_rng(1).standard_normal((7, 7))
    op, part = rows_operator(A, comm)
    x = np.random.default_rng(2).standard_normal(7)
    apply = jax.jit(lambda op, v: op @ v)
    y = apply(op, jnp.asarray(block(x, part, rank)))
    np.testing.assert_allclose(concat_blocks(y, comm), A @ x, rtol=1e-13)
    # New values, same static part: the compiled program is reused.
    doubled = jax.tree_util.tree_map(lambda leaf: 2 * leaf, op)
    y2 = apply(doubled, jnp.asarray(block(x, part, rank)))
    np.testing.assert_allclose(concat_blocks(y2, comm), 2 * A @ x, rtol=1e-13)
    assert apply._cache_size() == 1


def test_composition_replicated(comm, rank, size):
    rng = np.random.default_rng(3)
    A, B = rng.standard_normal((5, 5)), rng.standard_normal((5, 5))
    a, b = ops.aslinearoperator(A, comm=comm), ops.aslinearoperator(B, comm=comm)
    c = 0.7
    combined = jax.jit(lambda a, b, c: (c * a + b.T - a @ b).to_dense())(a, b, c)
    np.testing.assert_allclose(np.asarray(combined), c * A + B.T - A @ B, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(np.asarray((a @ b).T.to_dense()), (A @ B).T, rtol=1e-13)
    np.testing.assert_allclose(np.asarray((-a).diagonal()), -np.diagonal(A))
    np.testing.assert_allclose(np.asarray((a + b).diagonal()), np.diagonal(A + B))
    Z = A + 1j * B
    z = ops.aslinearoperator(Z, comm=comm)
    np.testing.assert_allclose(np.asarray(z.H.to_dense()), Z.conj().T, rtol=1e-13)
    np.testing.assert_allclose(np.asarray((1j * z).T.to_dense()), 1j * Z.T, rtol=1e-13)


def test_composition_sharded_and_layout_errors(comm, rank, size):
    rng = np.random.default_rng(4)
    A, B = rng.standard_normal((8, 8)), rng.standard_normal((8, 8))
    a, part = rows_operator(A, comm)
    b, _ = rows_operator(B, comm)
    x = rng.standard_normal(8)
    xr = jnp.asarray(block(x, part, rank))
    for op, dense in ((a @ b, A @ B), (a - 2.0 * b, A - 2 * B), (a.T + b, A.T + B), ((a @ b).T, (A @ B).T)):
        np.testing.assert_allclose(concat_blocks(jax.jit(lambda o, v: o @ v)(op, xr), comm), dense @ x,
                                   rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.asarray((a @ b).to_dense()), A @ B, rtol=1e-12, atol=1e-12)
    replicated = ops.aslinearoperator(np.eye(8), comm=comm)
    with pytest.raises(ValueError, match="different layouts"):
        a + replicated
    with pytest.raises(ValueError, match="different layouts"):
        a @ replicated
    with pytest.raises(ValueError, match="scalar"):
        scaled(jnp.ones(2), a)


def test_grad_with_respect_to_operator_passed_to_jit(comm, rank, size):
    """d/dA and d/dc of a replicated loss Σ_i (c A x)_i³ + (A x)_i² (A's row
    blocks sharded, c a traced scale), against jax on the gathered matrix."""
    rng = np.random.default_rng(5)
    A = rng.standard_normal((6, 6))
    x = rng.standard_normal(6)
    op, part = rows_operator(A, comm)
    xr = jnp.asarray(block(x, part, rank))

    @jax.jit
    def loss_and_grads(op, c):
        def loss(op, c):
            return allreduce(jnp.sum(((c * op) @ xr) ** 3) + jnp.sum((op @ xr) ** 2), comm=comm)

        return jax.grad(loss, argnums=(0, 1))(op, c)

    g_op, g_c = loss_and_grads(op, 1.5)
    assert isinstance(g_op, ops.LinearOperator)  # the cotangent has the operator's structure

    def reference(M, c):
        return jnp.sum((c * M @ x) ** 3) + jnp.sum((M @ x) ** 2)

    expected_M, expected_c = jax.grad(reference, argnums=(0, 1))(jnp.asarray(A), 1.5)
    # jax.grad of a replicated loss seeds 1 on every rank (docs/ad.md): it
    # differentiates P·L, so the sharded block's gradient is P times L's, and
    # the replicated c's is rank r's share of P·dL/dc (the shares sum to it).
    (g_rows,) = jax.tree_util.tree_leaves(g_op)
    np.testing.assert_allclose(np.concatenate(comm.allgather(np.asarray(g_rows))), size * expected_M, rtol=1e-12)
    np.testing.assert_allclose(sum(comm.allgather(float(g_c))), size * float(expected_c), rtol=1e-12)


def test_transpose_of_replicated_communicating_matvec(comm, rank, size):
    """y = allreduce(A_r x) with A = Σ_r A_r nonsymmetric, every rank holding
    the whole x: .T is Aᵀ on every rank (not each rank's adjoint share A_rᵀ Σ w)."""
    rng = np.random.default_rng(6)
    parts = [rng.standard_normal((5, 5)) + 1j * rng.standard_normal((5, 5)) for _ in range(size)]
    A = sum(parts)
    mine = jnp.asarray(parts[rank])
    op = ops.LinearOperator(lambda v: allreduce(mine @ v, comm=comm), input_structure=jnp.zeros(5, complex),
                            comm=comm)
    np.testing.assert_allclose(np.asarray(op.to_dense()), A, rtol=1e-13)
    np.testing.assert_allclose(np.asarray(op.T.to_dense()), A.T, rtol=1e-13)
    np.testing.assert_allclose(np.asarray(op.H.to_dense()), A.conj().T, rtol=1e-13)
    w = jnp.asarray(rng.standard_normal(5) + 1j * rng.standard_normal(5))
    np.testing.assert_allclose(np.asarray(jax.jit(lambda o, w: o.T @ w)(op, w)), A.T @ np.asarray(w), rtol=1e-13)
    # A rank-local replicated matvec: the transpose needs no averaging (and gets none).
    local = ops.LinearOperator(lambda v: jnp.asarray(A) @ v, input_structure=jnp.zeros(5, complex), comm=comm)
    np.testing.assert_allclose(np.asarray(local.T.to_dense()), A.T, rtol=1e-13)
    assert "allreduce" not in str(jax.make_jaxpr(local.T.matvec)(w))
