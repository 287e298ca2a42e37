"""Block Jacobi with a dense Cholesky or pyamg's AMG per rank: against the block-diagonal inverse
of the gathered matrix, on uneven row splits (a rank with no rows from 3 ranks on)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse as sp

import distlinalg as dl
from distlinalg.operators import dense_rows, laplacian_2d, sparse_rows
from conftest import assert_no_failures, failure_of, uneven_partition


def poisson_with_varying_coefficient(n: int) -> sp.csr_matrix:
    """−∇·(c ∇u) on an n × n grid (5 points, c varying over two orders of magnitude): SPD."""
    x = np.linspace(0, 1, n + 1)
    c = 10.0 ** (2 * x)  # per grid line
    T = sp.diags([-c[1:-1], c[:-1] + c[1:], -c[1:-1]], [-1, 0, 1], shape=(n, n))
    return (sp.kron(sp.eye(n), T) + sp.kron(T, sp.eye(n))).tocsr()


def local_rows(matrix, partition, rank):
    return matrix[partition.starts[rank] : partition.starts[rank + 1]]


@pytest.mark.parametrize("local", ["cholesky", "amg"])
def test_sparse_rows_against_block_diagonal_inverse(comm, rank, size, local):
    if local == "amg":
        pytest.importorskip("pyamg", reason="the [pyamg] extra (make pyamg)")
    n = 12
    matrix = poisson_with_varying_coefficient(n)
    N = n * n
    partition = uneven_partition(N, size)
    A = sparse_rows(local_rows(matrix, partition, rank), local=True, symmetric=True, comm=comm)
    M = dl.solvers.block_jacobi(A, local=local)
    v = np.random.default_rng(0).standard_normal(N)
    mine = jnp.asarray(v[partition.starts[rank] : partition.starts[rank + 1]])
    got = np.concatenate(comm.allgather(np.asarray(jax.jit(lambda M, v: M @ v)(M, mine))))
    dense = matrix.toarray()
    expected = np.concatenate([np.linalg.solve(dense[s:e, s:e], v[s:e]) if e > s else np.zeros(0)
                               for s, e in zip(partition.starts[:-1], partition.starts[1:])])
    if local == "cholesky":
        np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)
    else:  # one V-cycle: an approximation of the block inverse, close in the energy norm
        error = got - expected
        relative = np.sqrt(error @ dense @ error / (expected @ dense @ expected))
        assert relative < 0.5, relative
    b = jnp.ones(partition.size_of(rank))
    solve = jax.jit(lambda M, b: dl.cg(A, b, M=M, rtol=1e-10, maxiter=2000))
    x, info = solve(M, b)
    _, plain = solve(None, b)
    assert bool(info.converged) and int(info.iterations) < int(plain.iterations)
    np.testing.assert_allclose(np.concatenate(comm.allgather(np.asarray(x))), np.linalg.solve(dense, np.ones(N)),
                               rtol=1e-7)


@pytest.mark.max_ranks(2)
def test_dense_rows_and_laplacian_blocks(comm, rank, size):
    n = 10
    partition = uneven_partition(n * n, size)
    matrix = poisson_with_varying_coefficient(n).toarray()
    A = dense_rows(jnp.asarray(matrix[partition.starts[rank] : partition.starts[rank + 1]]), comm=comm)
    L = laplacian_2d(n, row_partition=uneven_partition(n, size), comm=comm)
    for op, dense in ((A, matrix), (L, None)):
        M = dl.solvers.block_jacobi(op)  # local=None: Cholesky for these small blocks
        assert M.local == "cholesky"
        b = jnp.ones(op.input_structure.shape)
        x, info = dl.cg(op, b, M=M, rtol=1e-10)
        assert bool(info.converged)
        residual = np.sqrt(comm.allreduce(float(jnp.sum((b - op @ x) ** 2))))
        assert residual < 1e-8 * n


@pytest.mark.max_ranks(2)
def test_bad_input_raises_on_every_rank(comm, rank, size):
    partition = uneven_partition(16, size)
    A = sparse_rows(local_rows(poisson_with_varying_coefficient(4), partition, rank), local=True, symmetric=True,
                    comm=comm)
    cases = [
        (lambda: dl.solvers.block_jacobi(dl.operators.aslinearoperator(lambda v: v, layout="sharded", comm=comm)),
         "must be a sharded distlinalg operator|diagonal blocks are known"),
        (lambda: dl.solvers.block_jacobi(A, local="ilu"), "local must be None or one of"),
        (lambda: jax.jit(lambda data: dl.solvers.block_jacobi(A.with_data(data), local="amg").hierarchy)(A.data),
         "pyamg's setup needs concrete values"),
    ]
    if size > 1:
        cases.append((lambda: dl.solvers.block_jacobi(A, local="amg" if rank else "cholesky"),
                      "passed different options"))
    for fn, pattern in cases:
        assert_no_failures(failure_of(fn, pattern), comm)
