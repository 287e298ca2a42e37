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


# -- operators of a model: gram, sample_gram, hessian, gauss_newton ----------------------
# Built outside jit and passed to jitted functions; compared with dense
# single-process references on the gathered samples (jacobian_reference).
import distlinalg as dl  # noqa: E402
from jax.flatten_util import ravel_pytree  # noqa: E402
from jacobian_reference import VISIBLE, jacobian_rows, params_of, rbm, rbm_with_phase  # noqa: E402

# At most 2 ranks (CI time, issue 55): pytree structure and layouts, whose distributed products run at 3 ranks in test_operators.py and test_gram.py.
pytestmark = pytest.mark.max_ranks(2)


def model_samples(size, rank, seed):
    """Uneven counts (4 + r on rank r): all samples, this rank's, and the counts."""
    counts = [4 + r for r in range(size)]
    everything = np.random.default_rng(seed).choice([-1.0, 1.0], size=(sum(counts), VISIBLE))
    start = sum(counts[:rank])
    return everything, jnp.asarray(everything[start : start + counts[rank]]), counts


def shifted_params(params, scale):
    return jax.tree_util.tree_map(lambda a: a * scale + 0.01, params)


MODEL_OPERATORS = [
    # (kind, model, mode, diag_scale)
    # (the real-mode Gram is the same code path as the complex one at 3 ranks: CI time)
    pytest.param("gram", rbm, "real", 0.05, marks=pytest.mark.max_ranks(2)),
    ("gram", rbm_with_phase, "complex", None),
    ("sample_gram", rbm, "real", None),
    ("sample_gram", rbm_with_phase, "complex", None),
]


def build(kind, f, params, X, mode, shift, scale, comm):
    if kind == "gram":
        return ops.gram(f, params, X, mode=mode, diag_shift=shift, diag_scale=scale, comm=comm)
    return ops.sample_gram(f, params, X, mode=mode, diag_shift=shift, comm=comm)


def dense_model_operator(kind, f, params, everything, mode, shift, scale):
    """S = RᵀR/N (+ ε diag) + λ (parameter space) or T = RRᵀ/N + λ (sample space), real modes."""
    R, _ = jacobian_rows(f, params, everything, mode, center=True)
    N = everything.shape[0]
    if kind == "gram":
        S = R.T @ R / N
        if scale is not None:
            S = S + scale * np.diag(np.diagonal(S))
    else:
        S = R @ R.T / N
    return S + shift * np.eye(S.shape[0])


def sample_block(vector, counts, rank, k):
    start = sum(counts[:rank]) * k
    return vector[start : start + counts[rank] * k]


@pytest.mark.parametrize("kind,f,mode,scale", MODEL_OPERATORS)
def test_model_operator_as_jit_argument(comm, rank, size, kind, f, mode, scale):
    """A Gram operator built outside jit: matvec and cg in one jitted function,
    against the dense matrix of the gathered samples; a second operator (new
    params, samples and shift, same shapes) runs the same compiled program."""
    k = 2 if (mode == "complex" and kind == "sample_gram") else 1
    traces = []

    @jax.jit
    def apply_and_solve(op, v):
        traces.append(1)
        return op @ v, dl.cg(op, v, rtol=1e-13, maxiter=500)[0]

    for step, (seed, scale_p, shift) in enumerate([(20, 1.0, 0.05), (21, 0.8, 0.2)]):
        everything, X, counts = model_samples(size, rank, seed)
        params = shifted_params(params_of(np.float64), scale_p)
        op = build(kind, f, params, X, mode, shift, scale, comm)
        dense = dense_model_operator(kind, f, params, everything, mode, shift, scale)
        rng = np.random.default_rng(30 + step)
        if kind == "gram":
            v_flat = rng.standard_normal(dense.shape[0])
            _, unravel = ravel_pytree(params)
            y, x = apply_and_solve(op, unravel(jnp.asarray(v_flat)))
            y, x = np.asarray(ravel_pytree(y)[0]), np.asarray(ravel_pytree(x)[0])
        else:
            v_flat = rng.standard_normal(dense.shape[0])
            mine = sample_block(v_flat, counts, rank, k).reshape(op.input_structure.shape)
            y, x = apply_and_solve(op, jnp.asarray(mine))
            y = np.concatenate(comm.allgather(np.asarray(y).reshape(-1)))
            x = np.concatenate(comm.allgather(np.asarray(x).reshape(-1)))
        np.testing.assert_allclose(y, dense @ v_flat, rtol=1e-11, atol=1e-12)
        np.testing.assert_allclose(x, np.linalg.solve(dense, v_flat), rtol=1e-8, atol=1e-10)
    assert len(traces) == 1 and apply_and_solve._cache_size() == 1


def test_model_operator_flattening(comm, rank, size):
    """The leaves are params, samples and the shifts; unflattening works with
    placeholder leaves and communicates nothing (rank 0 alone does it here:
    a collective would hang); equal specs give equal tree definitions."""
    everything, X, counts = model_samples(size, rank, 22)
    params = params_of(np.float64)
    S = ops.gram(rbm, params, X, diag_shift=0.1, diag_scale=0.02, comm=comm)
    leaves = jax.tree_util.tree_leaves(S)
    expected = jax.tree_util.tree_leaves((params, X, 0.1, 0.02))
    assert len(leaves) == len(expected) and all(a is b for a, b in zip(leaves, expected))
    T = ops.sample_gram(rbm, params, X, diag_shift=0.1, comm=comm)
    assert len(jax.tree_util.tree_leaves(T)) == len(jax.tree_util.tree_leaves((params, X, 0.1)))
    H = ops.hessian(lambda p, X: allreduce(jnp.sum((X @ p["a"]) ** 2), "sum", comm=comm), params, X, comm=comm)
    assert len(jax.tree_util.tree_leaves(H)) == len(jax.tree_util.tree_leaves((params, X)))
    if rank == 0:
        for op in (S, T, H):
            leaves, treedef = jax.tree_util.tree_flatten(op)
            again = jax.tree_util.tree_unflatten(treedef, [object()] * len(leaves))
            assert type(again) is type(op) and again.layout == op.layout
            assert jax.tree_util.tree_structure(again.input_structure) == jax.tree_util.tree_structure(
                op.input_structure)
    comm.Barrier()
    # Same f, shapes and counts: equal tree definitions (another f: not equal).
    other = ops.gram(rbm, shifted_params(params, 2.0), X * 0.5, diag_shift=0.3, diag_scale=0.1, comm=comm)
    assert jax.tree_util.tree_structure(other) == jax.tree_util.tree_structure(S)
    assert jax.tree_util.tree_structure(ops.gram(rbm_with_phase, params, X, diag_shift=0.1, diag_scale=0.02,
                                                 comm=comm)) != jax.tree_util.tree_structure(S)


def _count_in_loops(jaxpr, name, inside=False):
    """How many `name` equations sit inside while loops of a jaxpr (recursively)."""
    total = 0
    for eqn in jaxpr.eqns:
        total += inside and eqn.primitive.name == name
        nested = inside or eqn.primitive.name == "while"
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    total += _count_in_loops(inner, name, nested)
    return total


def test_model_operator_argument_is_linearised_once(comm, rank, size):
    """Passed to a jitted solve (and differentiated), the operator is linearised
    outside the solver's loops: the model (its cosh) is never evaluated in a loop."""
    _, X, _ = model_samples(size, rank, 23)
    params = params_of(np.float64)
    S = ops.gram(rbm, params, X, diag_shift=0.1, comm=comm)
    b = jax.tree_util.tree_map(jnp.ones_like, params)

    def loss(S):
        x = dl.cg(S, b, rtol=1e-12)[0]
        return sum(jnp.sum(jnp.tanh(leaf)) for leaf in jax.tree_util.tree_leaves(x))

    for fn in (lambda S: dl.cg(S, b)[0], jax.grad(loss)):
        jaxpr = jax.make_jaxpr(fn)(S).jaxpr
        assert _count_in_loops(jaxpr, "cosh") == 0


@pytest.mark.parametrize("kind", ["gram", pytest.param("sample_gram", marks=pytest.mark.max_ranks(2))])
def test_grad_with_respect_to_model_operator(comm, rank, size, kind):
    """jax.grad of a replicated loss of cg's solution with respect to the operator
    (passed to a jitted function) equals the gradient with respect to params,
    samples and diag_shift of the same loss with the operator built inside;
    d/dλ also against the dense formula −gᵀ(A + λ)⁻¹x on the gathered samples."""
    everything, X, counts = model_samples(size, rank, 24)
    params = params_of(np.float64)
    shift = 0.2
    rng = np.random.default_rng(25)
    _, unravel = ravel_pytree(params)
    if kind == "gram":
        b_flat = rng.standard_normal(ravel_pytree(params)[0].size)
        b = unravel(jnp.asarray(b_flat))
    else:
        b_flat = rng.standard_normal(sum(counts))
        b = jnp.asarray(sample_block(b_flat, counts, rank, 1))

    def loss_of(op):
        x = dl.cg(op, b, rtol=1e-13, maxiter=500)[0]
        local = sum(jnp.sum(jnp.tanh(leaf)) for leaf in jax.tree_util.tree_leaves(x))
        # Replicated x (gram): every rank has the whole loss; sharded (sample_gram): sum the blocks.
        return local if kind == "gram" else allreduce(local, "sum", comm=comm)

    op = build(kind, rbm, params, X, "real", shift, None, comm)
    g_op = jax.jit(jax.grad(loss_of))(op)
    assert type(g_op) is type(op)
    inside = jax.grad(lambda p, X, s: loss_of(build(kind, rbm, p, X, "real", s, None, comm)), argnums=(0, 1, 2))
    g_params, g_samples, g_shift = inside(params, X, shift)
    np.testing.assert_allclose(ravel_pytree(g_op.params)[0], ravel_pytree(g_params)[0], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(np.asarray(g_op.samples), np.asarray(g_samples), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(float(g_op.diag_shift), float(g_shift), rtol=1e-9)

    A = dense_model_operator(kind, rbm, params, everything, "real", shift, None)
    x = np.linalg.solve(A, b_flat)
    expected = -(1 - np.tanh(x) ** 2) @ np.linalg.solve(A, x)
    # jax.grad of a replicated loss seeds 1 on every rank (docs/ad.md): the
    # replicated λ's per-rank gradients are shares of P·dL/dλ.
    np.testing.assert_allclose(sum(comm.allgather(float(g_op.diag_shift))), size * expected, rtol=1e-8)


def logistic(size, rank, seed, features=4):
    rng = np.random.default_rng(seed)
    counts = [8 + r for r in range(size)]  # more samples than parameters: Jᵀ H J is definite
    X = rng.standard_normal((sum(counts), features))
    y = rng.choice([-1.0, 1.0], sum(counts))
    start = sum(counts[:rank])
    mine = slice(start, start + counts[rank])
    return X, y, jnp.asarray(X[mine]), jnp.asarray(y[mine])


@pytest.mark.max_ranks(2)  # the replicated curvature operators do not depend on the rank count beyond 2 (CI time)
def test_curvature_operators_as_jit_arguments(comm, rank, size):
    """hessian and gauss_newton built outside jit: matvec and cg in a jitted
    function against jax.hessian of the gathered loss; new params and data of
    the same shapes reuse the compilation; jax.grad with respect to the
    operator equals the gradient with the operator built inside."""

    def loss(p, X, y):
        margins = -y * (X @ p["w"] + p["c"])
        return allreduce(jnp.sum(jnp.logaddexp(0.0, margins)), "sum", comm=comm) + 0.1 * jnp.sum(jnp.cosh(p["w"]))

    def model(p, X):
        return X @ p["w"] + p["c"]

    def dense_loss(theta, X, y):  # theta = (c, w): ravel_pytree's order of {"c", "w"}
        return jnp.sum(jnp.logaddexp(0.0, -y * (X @ theta[1:] + theta[0]))) + 0.1 * jnp.sum(jnp.cosh(theta[1:]))

    traces = []

    @jax.jit
    def apply_and_solve(op, v):
        traces.append(1)
        return op @ v, dl.cg(op, v, rtol=1e-13, maxiter=500)[0]

    Xg, yg, _, y_fixed = logistic(size, rank, 40)  # gauss_newton's ℓ closes over these labels

    def loss_of_outputs(out):
        return allreduce(jnp.sum(jnp.logaddexp(0.0, -y_fixed * out)), "sum", comm=comm)

    for step, seed in enumerate([41, 42]):
        X, y, Xr, yr = logistic(size, rank, seed)
        params = {"w": jnp.asarray(np.random.default_rng(seed).standard_normal(4) * 0.3), "c": jnp.asarray(0.1 * step)}
        theta = np.asarray(ravel_pytree(params)[0])
        v = {"w": jnp.arange(1.0, 5.0), "c": jnp.asarray(0.5)}
        v_flat = np.asarray(ravel_pytree(v)[0])
        H = np.asarray(jax.hessian(dense_loss)(jnp.asarray(theta), jnp.asarray(X), jnp.asarray(y)))
        J = np.concatenate([np.ones((X.shape[0], 1)), X], axis=1)
        sigma = 1 / (1 + np.exp(yg * (X @ theta[1:] + theta[0])))
        G = J.T @ np.diag(sigma * (1 - sigma)) @ J  # ℓ'' of logaddexp(0, -y o) is σ(1-σ)
        for op, dense in ((ops.hessian(loss, params, Xr, yr, comm=comm), H),
                          (ops.gauss_newton(model, loss_of_outputs, params, Xr, comm=comm), G)):
            y_op, x_op = apply_and_solve(op, v)
            np.testing.assert_allclose(ravel_pytree(y_op)[0], dense @ v_flat, rtol=1e-10, atol=1e-12)
            np.testing.assert_allclose(ravel_pytree(x_op)[0], np.linalg.solve(dense, v_flat), rtol=1e-8)
    assert len(traces) == 2 and apply_and_solve._cache_size() == 2  # one program per operator type

    _, _, Xr, yr = logistic(size, rank, 43)
    params = {"w": jnp.asarray([0.1, -0.2, 0.3, 0.05]), "c": jnp.asarray(0.2)}
    b = {"w": jnp.ones(4), "c": jnp.asarray(1.0)}

    def objective(op):
        x = dl.cg(op, b, rtol=1e-13, maxiter=500)[0]
        return jnp.sum(jnp.tanh(x["w"])) + x["c"] ** 2

    g_op = jax.jit(jax.grad(objective))(ops.hessian(loss, params, Xr, yr, comm=comm))
    g_params, g_X = jax.grad(lambda p, X: objective(ops.hessian(loss, p, X, yr, comm=comm)), argnums=(0, 1))(params, Xr)
    np.testing.assert_allclose(ravel_pytree(g_op.params)[0], ravel_pytree(g_params)[0], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(np.asarray(g_op.args[0]), np.asarray(g_X), rtol=1e-9, atol=1e-12)
    g_op = jax.jit(jax.grad(objective))(ops.gauss_newton(model, loss_of_outputs, params, Xr, comm=comm))
    g_params = jax.grad(lambda p: objective(ops.gauss_newton(model, loss_of_outputs, p, Xr, comm=comm)))(params)
    np.testing.assert_allclose(ravel_pytree(g_op.params)[0], ravel_pytree(g_params)[0], rtol=1e-9, atol=1e-12)


def test_laplacian_has_no_children(comm, rank, size):
    """laplacian_2d flattens to no leaves (also after diagonal()), is a jit
    argument, and every laplacian_2d of the same arguments shares a compilation."""
    n = 5
    A = ops.laplacian_2d(n, comm=comm)
    assert jax.tree_util.tree_leaves(A) == []
    np.testing.assert_array_equal(np.asarray(A.diagonal()), 4.0)
    assert jax.tree_util.tree_leaves(A) == []  # the diagonal is not cached as a child
    first, last = A.grid_rows
    T = 2 * np.eye(n) - np.eye(n, k=1) - np.eye(n, k=-1)
    dense = np.kron(np.eye(n), T) + np.kron(T, np.eye(n))
    x = np.random.default_rng(50).standard_normal(n * n)
    mine = jnp.asarray(x[first * n : last * n])
    apply = jax.jit(lambda A, v: (A @ v, dl.cg(A, v, rtol=1e-13)[0]))
    for op in (A, ops.laplacian_2d(n, comm=comm)):
        y, solution = apply(op, mine)
        np.testing.assert_allclose(np.concatenate(comm.allgather(np.asarray(y))), dense @ x, rtol=1e-13)
        np.testing.assert_allclose(np.concatenate(comm.allgather(np.asarray(solution))), np.linalg.solve(dense, x),
                                   rtol=1e-9, atol=1e-11)
    assert apply._cache_size() == 1
    again = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(A), [])
    assert again.grid_rows == A.grid_rows and again.n == n
