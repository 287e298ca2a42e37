"""The operator contract (docs/operators.md), one table of every operator kind.

Each operator is checked for what every operator promises, whatever its
kind: a flatten/unflatten round trip (equal tree definitions, the same
products), use as a jit argument without a retrace for new leaves of the
same shapes, ``jax.grad`` with respect to the operator (an operator of the
same type whose pairing with a direction is the derivative in that
direction, summed over ranks: the whole-program adjoint, docs/ad.md),
``linearise`` (idempotent, the same products), and ``.T``, ``.H``,
``conj()`` and ``diagonal()`` against ``to_dense()`` of the operator.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse as sp
from jax.flatten_util import ravel_pytree

import distlinalg as dl
from distlinalg import operators as ops
from distlinalg.comm import allreduce
from jacobian_reference import params_of, rbm, rbm_with_phase

# The contract is the same on any number of ranks; 1 and 2 exercise both layouts,
# uneven blocks and the collectives (the operators' own tests run at 3: CI time).
pytestmark = pytest.mark.max_ranks(2)


def _block(n, comm):
    p = ops.Partition.even(n, comm.Get_size())
    r = comm.Get_rank()
    return slice(p.starts[r], p.starts[r + 1])


def _samples(comm, seed=3):
    rank = comm.Get_rank()
    return jnp.asarray(np.random.default_rng(seed + rank).choice([-1.0, 1.0], size=(4 + rank, 4)))


def _logistic(comm):
    rank = comm.Get_rank()
    rng = np.random.default_rng(10 + rank)
    X, y = jnp.asarray(rng.standard_normal((5 + rank, 3))), jnp.asarray(rng.choice([-1.0, 1.0], 5 + rank))

    def loss(p, X, y):
        return allreduce(jnp.sum(jnp.logaddexp(0.0, -y * (X @ p["w"] + p["c"]))), "sum", comm=comm)

    return X, y, loss


def _dense(comm):
    M = np.random.default_rng(0).standard_normal((5, 5)) + 1j * np.random.default_rng(1).standard_normal((5, 5))
    return ops.aslinearoperator(jnp.asarray(M), comm=comm)


def _function(comm):
    M = jnp.asarray(np.random.default_rng(2).standard_normal((4, 3)))
    return ops.LinearOperator(lambda M, v: M @ v, data=M, input_structure=jnp.zeros(3), output_structure=jnp.zeros(4),
                              transpose=lambda M, w: M.T @ w, comm=comm)


def _dense_rows(comm):
    M = np.random.default_rng(4).standard_normal((7, 7))
    return ops.dense_rows(jnp.asarray(M[_block(7, comm)]), comm=comm)


def _dense_columns(comm):
    M = np.random.default_rng(5).standard_normal((6, 6))
    return ops.dense_columns(jnp.asarray(M[:, _block(6, comm)]), comm=comm)


def _sparse(comm, halo="blocking"):
    M = sp.random(9, 9, density=0.3, random_state=6, format="csr") + sp.eye(9)
    return ops.sparse_rows(M, halo=halo, comm=comm)


def _gram(comm, f=rbm, mode="real"):
    return ops.gram(f, params_of(np.float64), _samples(comm), mode=mode, diag_shift=0.1, diag_scale=0.05, comm=comm)


def _hessian(comm):
    X, y, loss = _logistic(comm)
    return ops.hessian(loss, {"w": jnp.asarray([0.1, -0.2, 0.3]), "c": jnp.asarray(0.2)}, X, y, comm=comm)


def _gauss_newton(comm):
    X, y, _ = _logistic(comm)

    def loss_of_outputs(out):
        return allreduce(jnp.sum(jnp.logaddexp(0.0, -y * out)), "sum", comm=comm)

    return ops.gauss_newton(lambda p, X: X @ p["w"] + p["c"], loss_of_outputs,
                            {"w": jnp.asarray([0.1, -0.2, 0.3]), "c": jnp.asarray(0.2)}, X, comm=comm)


def _stencil_coefficients(comm, ny=5, nx=4):
    """Random (3, 3, rows, nx) coefficients of this rank's grid rows (an uneven split at 2 ranks)."""
    sizes = [ny] if comm.Get_size() == 1 else [2] + [0] * (comm.Get_size() - 2) + [ny - 2]
    partition = ops.Partition.from_sizes(sizes)
    r = comm.Get_rank()
    c = np.random.default_rng(4).standard_normal((3, 3, ny, nx))
    return jnp.asarray(c[:, :, partition.starts[r] : partition.starts[r + 1]])


def _symmetric_stencil(comm):
    c = _stencil_coefficients(comm)
    return ops.symmetric_stencil(c, ops.stencil_2d(c, comm=comm).stencil_grid, comm)


OPERATORS = {
    "dense": _dense,
    "function": _function,
    "dense_rows": _dense_rows,
    "dense_columns": _dense_columns,
    "sparse_rows": _sparse,
    "sparse_rows_overlapped": lambda comm: _sparse(comm, "overlapped"),
    "laplacian_2d": lambda comm: ops.laplacian_2d(4, comm=comm),
    "stencil_2d": lambda comm: ops.stencil_2d(_stencil_coefficients(comm), comm=comm),
    "symmetric_stencil": _symmetric_stencil,
    "gram": _gram,
    "gram_complex_mode": lambda comm: _gram(comm, rbm_with_phase, "complex"),
    "sample_gram": lambda comm: ops.sample_gram(rbm, params_of(np.float64), _samples(comm), diag_shift=0.1,
                                                comm=comm),
    "hessian": _hessian,
    "gauss_newton": _gauss_newton,
    "product": lambda comm: _dense_rows(comm) @ _dense_rows(comm).T,
    "sum_and_scale": lambda comm: _sparse(comm) + 0.5 * _dense_rows_square9(comm),
    "transposed": lambda comm: _function(comm).T,
    "adjoint": lambda comm: _dense(comm).H,
    "conjugated": lambda comm: _dense(comm).conj(),
}


def _dense_rows_square9(comm):
    M = np.random.default_rng(7).standard_normal((9, 9))
    p = ops.Partition.even(9, comm.Get_size())
    r = comm.Get_rank()
    return ops.dense_rows(jnp.asarray(M[p.starts[r] : p.starts[r + 1]]), comm=comm)


def _random_like(structure, seed):
    rng = np.random.default_rng(seed)

    def draw(s):
        x = rng.standard_normal(s.shape)
        if jnp.issubdtype(s.dtype, jnp.complexfloating):
            x = x + 1j * rng.standard_normal(s.shape)
        return jnp.asarray(x, s.dtype)

    return jax.tree_util.tree_map(draw, structure)


def _vector(op, seed, comm, structure=None):
    """A vector of the operator's input (or `structure`): the same on every rank when replicated."""
    structure = op.input_structure if structure is None else structure
    return _random_like(structure, seed if op.layout == "replicated" else seed + 100 * comm.Get_rank())


def _global(x, op, comm):
    """The flat global vector of this rank's piece x (gathered when sharded)."""
    flat = np.asarray(ravel_pytree(x)[0])
    return flat if op.layout == "replicated" else np.concatenate(comm.allgather(flat))


def _pairs_if_real_linear(op, x):
    flat = np.asarray(ravel_pytree(x)[0])
    return np.concatenate([flat.real, flat.imag]) if op.real_linear and np.iscomplexobj(flat) else flat


@pytest.fixture(params=sorted(OPERATORS))
def case(request, comm):
    return request.param, OPERATORS[request.param](comm)


def test_flatten_round_trip(case, comm):
    name, op = case
    leaves, treedef = jax.tree_util.tree_flatten(op)
    again = jax.tree_util.tree_unflatten(treedef, leaves)
    assert type(again) is type(op) and jax.tree_util.tree_structure(again) == treedef
    assert again.layout == op.layout and again.comm == op.comm and repr(again) == repr(op)
    v = _vector(op, 1, comm)
    apply = jax.jit(lambda op, v: op @ v)
    np.testing.assert_allclose(np.asarray(ravel_pytree(apply(again, v))[0]), np.asarray(ravel_pytree(apply(op, v))[0]),
                               rtol=1e-13, atol=1e-13, err_msg=name)
    # Placeholder leaves: unflattening computes and communicates nothing (rank 0 alone here).
    if comm.Get_rank() == 0:
        placeholders = jax.tree_util.tree_unflatten(treedef, [object()] * len(leaves))
        assert type(placeholders) is type(op)
    comm.Barrier()


def test_jit_argument_without_retrace(case, comm):
    name, op = case
    traces = []

    @jax.jit
    def apply(op, v):
        traces.append(1)
        return op @ v

    def with_leaves_scaled(scale):
        # New arrays made the same way for both calls: an array's type includes its sharding,
        # which differs between one made by jnp.asarray and one computed under the mesh NetKet sets.
        return jax.tree_util.tree_map(lambda leaf: jnp.asarray(np.asarray(leaf) * scale), op)

    v = _vector(op, 2, comm)
    first = apply(with_leaves_scaled(1.0), v)
    second = apply(with_leaves_scaled(1.5), v)
    # Wait for both programs: the fixture frees the communicator after the test, and a
    # program still running on it then would meet the next test's collectives.
    jax.block_until_ready((first, second))
    assert len(traces) == 1 and apply._cache_size() == 1, name
    assert jax.tree_util.tree_structure(first) == op.out_structure.treedef, name


def test_grad_with_respect_to_the_operator(case, comm):
    """Σ_ranks Re Σ (∂L/∂op)·δ = Σ_ranks dL(op + t δ)/dt for L = Re⟨w, op v⟩ on each rank
    (JAX's convention for complex leaves: the gradient pairs with δ without a conjugate)."""
    name, op = case
    v, w = _vector(op, 3, comm), _vector(op, 4, comm, op.output_structure)

    def loss(op):
        y = op @ v
        return sum(jnp.real(jnp.vdot(a, b)) for a, b in zip(jax.tree_util.tree_leaves(w), jax.tree_util.tree_leaves(y)))

    g = jax.jit(jax.grad(loss))(op)
    assert type(g) is type(op) and jax.tree_util.tree_structure(g) == jax.tree_util.tree_structure(op), name
    leaves = jax.tree_util.tree_leaves(op)
    directions = [_random_like(jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), 5 + i + 100 * comm.Get_rank())
                  for i, x in enumerate(leaves)]
    delta = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(op), directions)
    _, derivative = jax.jit(lambda op, delta: jax.jvp(loss, (op,), (delta,)))(op, delta)
    pairing = sum(float(jnp.real(jnp.sum(a * b))) for a, b in zip(jax.tree_util.tree_leaves(g), directions))
    total_pairing, total_derivative = sum(comm.allgather(pairing)), sum(comm.allgather(float(derivative)))
    np.testing.assert_allclose(total_pairing, total_derivative, rtol=1e-9, atol=1e-11, err_msg=name)


def test_linearise(case, comm):
    name, op = case
    linear = ops.linearise(op)
    assert ops.linearise(linear) is linear, name
    assert (linear.layout, linear.symmetric, linear.hermitian, linear.real_linear) == (
        op.layout, op.symmetric, op.hermitian, op.real_linear), name
    v = _vector(op, 6, comm)
    np.testing.assert_allclose(np.asarray(ravel_pytree(linear @ v)[0]), np.asarray(ravel_pytree(op @ v)[0]),
                               rtol=1e-12, atol=1e-12, err_msg=name)
    if type(linear) is not type(op):  # a model operator: its model is evaluated here, not in the products
        model_primitives = {"cosh", "log", "log1p", "exp", "sin", "tanh", "logistic"}
        assert not _primitives(jax.make_jaxpr(linear.matvec)(v).jaxpr) & model_primitives, name
        assert _primitives(jax.make_jaxpr(op.matvec)(v).jaxpr) & model_primitives, name


def _primitives(jaxpr):
    """The names of the primitives of a jaxpr and the jaxprs nested in it."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    names |= _primitives(inner)
    return names


def _to_dense(op):
    """The global matrix (a sample Gram operator's to_dense() is this rank's rows unless gathered)."""
    return op.to_dense(gather=True) if isinstance(op, ops.SampleGramOperator) else op.to_dense()


def test_transpose_adjoint_conj_and_diagonal_against_to_dense(case, comm):
    name, op = case

    @jax.jit  # one program for the four matrices (op by op, each to_dense would dispatch its vmapped matvec)
    def matrices(op):
        return _to_dense(op), _to_dense(op.T), _to_dense(op.H), _to_dense(op.conj())

    D, DT, DH, DC = (np.asarray(m) for m in matrices(op))
    v = _vector(op, 7, comm)
    np.testing.assert_allclose(_global(op @ v, op, comm) if not op.real_linear else
                               _pairs_if_real_linear(op, _global(op @ v, op, comm)),
                               D @ _pairs_if_real_linear(op, _global(v, op, comm)), rtol=1e-10, atol=1e-11, err_msg=name)
    np.testing.assert_allclose(DT, D.T, rtol=1e-10, atol=1e-11, err_msg=name)
    if not op.real_linear:
        np.testing.assert_allclose(DH, D.conj().T, rtol=1e-10, atol=1e-11, err_msg=name)
        np.testing.assert_allclose(DC, D.conj(), rtol=1e-10, atol=1e-11, err_msg=name)
    if op.has_diagonal and not op.real_linear:
        diagonal = _global(op.diagonal(), op, comm)
        np.testing.assert_allclose(diagonal, np.diagonal(D), rtol=1e-10, atol=1e-11, err_msg=name)


def test_a_subclass_in_the_style_of_earlier_versions(comm):
    """A plain subclass with its own __init__ calling the function constructor
    (deprecated, still working): a pytree, a jit argument, differentiable."""

    class Diagonal(ops.LinearOperator):
        def __init__(self, d):
            self.label = "mine"  # the subclass's own attribute: static
            super().__init__(lambda d, v: d * v, data=d, input_structure=jnp.zeros(3), symmetric=True, hermitian=True,
                             comm=comm)

    with pytest.warns(DeprecationWarning, match="without @operator_class"):
        A = Diagonal(jnp.asarray([1.0, 2.0, 4.0]))
    np.testing.assert_allclose(np.asarray(jax.jit(lambda A, v: A @ v)(A, jnp.ones(3))), [1.0, 2.0, 4.0])
    x, info = jax.jit(lambda A: dl.cg(A, jnp.ones(3)))(A)
    assert bool(info.converged)
    np.testing.assert_allclose(np.asarray(x), [1.0, 0.5, 0.25], rtol=1e-6)
    g = jax.grad(lambda A: jnp.sum(A @ jnp.ones(3)))(A)
    assert type(g) is Diagonal and g.label == "mine"
    np.testing.assert_allclose(np.asarray(jax.tree_util.tree_leaves(g)[0]), np.ones(3))
