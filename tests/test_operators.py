"""distlinalg.operators: explicit distributed matrices against the dense matrix
built from the gathered data, transposes, diagonals, differentiation, bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse as sp

import distlinalg as dl
from distlinalg import operators as ops
from conftest import gather_global


def poisson(n):
    T = sp.diags([-np.ones(n - 1), 2 * np.ones(n), -np.ones(n - 1)], [-1, 0, 1])
    return (sp.kron(sp.eye(n), T) + sp.kron(T, sp.eye(n))).tocsr()


def concat_blocks(local, comm):
    """The global vector from every rank's block (block sizes may differ)."""
    return np.concatenate(comm.allgather(np.asarray(local)))


def block_of(global_vector, partition, rank):
    return global_vector[partition.starts[rank] : partition.starts[rank + 1]]


def uneven(total, size):
    """Block sizes that differ from rank to rank (rank 0 the largest)."""
    sizes = [total // size] * size
    sizes[0] += total - sum(sizes)
    if size > 1 and sizes[-1] > 0:
        sizes[0] += 1
        sizes[-1] -= 1
    return sizes


# ---------------------------------------------------------------------------
# Matrix-free Laplacian
@pytest.mark.parametrize("n", [1, 2, 5])
def test_laplacian_matches_kron(comm, rank, size, n):
    op = ops.laplacian_2d(n, comm=comm)
    A = poisson(n).toarray()
    np.testing.assert_array_equal(np.asarray(op.to_dense()), A)
    x = np.random.default_rng(0).standard_normal(n * n)
    start, stop = op.grid_rows
    y = jax.jit(op.matvec)(jnp.asarray(x[start * n : stop * n]))
    np.testing.assert_allclose(concat_blocks(y, comm), A @ x, rtol=1e-13, atol=1e-13)
    np.testing.assert_array_equal(np.asarray(op.diagonal()), 4.0)


def test_laplacian_transpose_and_cg(comm, rank, size):
    n = 6
    op = ops.laplacian_2d(n, row_partition=uneven(n, size), comm=comm)
    A = poisson(n)
    start, stop = op.grid_rows
    w = np.random.default_rng(1).standard_normal(n * n)
    (t,) = jax.linear_transpose(op.matvec, op.input_structure)(jnp.asarray(w[start * n : stop * n]))
    np.testing.assert_allclose(concat_blocks(t, comm), A.T @ w, rtol=1e-13)
    b = np.arange(n * n, dtype=float)
    x, info = dl.cg(op, jnp.asarray(b[start * n : stop * n]), rtol=1e-12, comm=comm)
    assert bool(info.converged)
    np.testing.assert_allclose(concat_blocks(x, comm), np.linalg.solve(A.toarray(), b), rtol=1e-9)


# ---------------------------------------------------------------------------
# Sparse rows with a halo exchange
def random_square(n, seed):
    M = sp.random(n, n, density=0.3, random_state=seed, format="csr") + sp.eye(n) * 3
    return M.tocsr()


@pytest.mark.parametrize("case", ["poisson", "random", "scattered", "rectangular", "uneven"])
def test_sparse_rows_matvec_and_transpose(comm, rank, size, case):
    if case == "poisson":
        A, kwargs = poisson(4), {}
    elif case == "random":
        A, kwargs = random_square(11, 3), {}
    elif case == "scattered":
        rng = np.random.default_rng(11)
        n = 40
        cols = np.stack([rng.permutation(n) for _ in range(3)], axis=1)  # 3 entries per row
        A = sp.csr_matrix((rng.standard_normal(3 * n), (np.repeat(np.arange(n), 3), cols.ravel())), shape=(n, n))
        A = (A + sp.eye(n) * 5).tocsr()
        kwargs = {}
    elif case == "rectangular":
        A = sp.random(9, 7, density=0.4, random_state=4, format="csr")
        kwargs = {}
    else:
        A = random_square(10, 5)
        kwargs = {"row_partition": uneven(10, size), "column_partition": uneven(10, size)[::-1]}
    op = ops.sparse_rows(A, comm=comm, **kwargs)
    # Checked on the gathered list, so every rank passes or fails together.
    formats = comm.allgather(op.pattern.format)
    if case == "poisson":
        assert formats == ["dia"] * size  # the stencil's few offsets, halo included
    if case == "scattered":
        assert formats == ["ell"] * size  # equal row lengths, many distinct offsets
    dense = A.toarray()
    np.testing.assert_allclose(np.asarray(op.to_dense()), dense, rtol=1e-14, atol=1e-15)
    np.testing.assert_allclose(np.asarray(op.T.to_dense()), dense.T, rtol=1e-14, atol=1e-15)
    rows, cols = op.pattern.rows, op.pattern.columns
    x = np.random.default_rng(6).standard_normal(A.shape[1])
    y = jax.jit(op.matvec)(jnp.asarray(block_of(x, cols, rank)))
    np.testing.assert_allclose(concat_blocks(y, comm), dense @ x, rtol=1e-13, atol=1e-14)
    w = np.random.default_rng(7).standard_normal(A.shape[0])
    (t,) = jax.linear_transpose(op.matvec, op.input_structure)(jnp.asarray(block_of(w, rows, rank)))
    np.testing.assert_allclose(concat_blocks(t, comm), dense.T @ w, rtol=1e-13, atol=1e-14)
    if A.shape[0] == A.shape[1] and case != "uneven":
        np.testing.assert_allclose(concat_blocks(op.diagonal(), comm), np.diagonal(dense))


def test_sparse_rows_local_blocks_and_segment_path(comm, rank, size):
    # One long row forces the segment-sum product (rank 0) instead of ELLPACK;
    # the purely diagonal blocks of the other ranks are stored by diagonals.
    A = sp.lil_matrix((8, 8))
    A.setdiag(2.0)
    A[0, :] = np.arange(1, 9)
    A = A.tocsr()
    sizes = uneven(8, size)
    start = sum(sizes[:rank])
    op = ops.sparse_rows(A[start : start + sizes[rank]], local=True, comm=comm)
    assert op.pattern.format == ("segment" if rank == 0 else "dia")
    np.testing.assert_allclose(np.asarray(op.to_dense()), A.toarray(), rtol=1e-14)


def test_sparse_rows_gradient_through_cg(comm, rank, size):
    """d/d(values) of a loss of the solution, against the dense derivative."""
    A = poisson(3) + sp.diags(np.linspace(0.1, 1, 9))
    A = A.tocsr()
    op = ops.sparse_rows(A, comm=comm)
    data, indices, indptr = op.local_csr
    rows = op.pattern.rows
    b_global = np.linspace(1, 2, 9)
    b = jnp.asarray(block_of(b_global, rows, rank))

    def loss(values):
        x, _ = dl.cg(op.with_data(values), b, rtol=1e-13)
        return dl.comm.allreduce(jnp.sum(x**3), "sum", comm=comm)

    grad_local = dl.ad.grad(loss, sharded=0, comm=comm)(data)

    row_of = np.repeat(np.arange(rows.starts[rank], rows.starts[rank + 1]), np.diff(indptr))
    all_rows = np.concatenate(comm.allgather(row_of))
    all_cols = np.concatenate(comm.allgather(indices))
    all_values = jnp.asarray(np.concatenate(comm.allgather(np.asarray(data))))

    def reference(values):
        M = jnp.zeros((9, 9)).at[all_rows, all_cols].add(values)
        return jnp.sum(jnp.linalg.solve(M, b_global) ** 3)

    expected = jax.grad(reference)(all_values)
    np.testing.assert_allclose(concat_blocks(grad_local, comm), expected, rtol=1e-8, atol=1e-10)


def test_sparse_rows_bad_input(comm, rank, size):
    A = poisson(3)
    with pytest.raises(ValueError, match="covers 8 indices but the matrix has 9"):
        ops.sparse_rows(A, row_partition=[8] + [0] * (size - 1), comm=comm)
    with pytest.raises(ValueError, match="one non-negative block size per rank"):
        ops.sparse_rows(A, row_partition=[9] * (size + 1), comm=comm)
    with pytest.raises(TypeError, match="scipy.sparse matrix"):
        ops.sparse_rows(np.eye(3), comm=comm)
    if size > 1:
        block = sp.eye(2, 4 + rank, format="csr")
        with pytest.raises(ValueError, match="disagree on the number of columns"):
            ops.sparse_rows(block, local=True, comm=comm)


# ---------------------------------------------------------------------------
# Dense row / column blocks
@pytest.mark.parametrize("square", [True, False])
def test_dense_rows_and_columns(comm, rank, size, square):
    m, n = (7, 7) if square else (8, 5)
    A = np.random.default_rng(8).standard_normal((m, n))
    row_part = ops.Partition.from_sizes(uneven(m, size))
    col_part = ops.Partition.from_sizes(uneven(n, size)) if not square else row_part
    by_rows = ops.dense_rows(block_of(A, row_part, rank), column_partition=None if square else col_part.sizes,
                             comm=comm)
    by_cols = ops.dense_columns(A[:, col_part.starts[rank] : col_part.starts[rank + 1]],
                                row_partition=None if square else row_part.sizes, comm=comm)
    for op in (by_rows, by_cols):
        np.testing.assert_allclose(np.asarray(op.to_dense()), A, rtol=1e-14)
        np.testing.assert_allclose(np.asarray(op.T.to_dense()), A.T, rtol=1e-14)
        x = np.random.default_rng(9).standard_normal(n)
        y = op @ jnp.asarray(block_of(x, col_part, rank))
        np.testing.assert_allclose(concat_blocks(y, comm), A @ x, rtol=1e-13)
        # The transpose the collectives' rules give equals the closed form.
        w = jnp.asarray(block_of(np.arange(m, dtype=float), row_part, rank))
        (t,) = jax.linear_transpose(op.matvec, op.input_structure)(w)
        np.testing.assert_allclose(np.asarray(t), np.asarray(op.T @ w), rtol=1e-13)
        if square:
            np.testing.assert_allclose(concat_blocks(op.diagonal(), comm), np.diagonal(A))


def test_dense_rows_gradient_wrt_entries(comm, rank, size):
    n = 6
    rng = np.random.default_rng(10)
    B = rng.standard_normal((n, n))
    A = B @ B.T + n * np.eye(n)
    part = ops.Partition.even(n, size)
    b = jnp.asarray(block_of(np.ones(n), part, rank))

    def loss(rows):
        x, _ = dl.cg(ops.dense_rows(rows, comm=comm), b, rtol=1e-13)
        return dl.comm.allreduce(jnp.sum(jnp.sin(x)), "sum", comm=comm)

    g = dl.ad.grad(loss, sharded=0, comm=comm)(jnp.asarray(block_of(A, part, rank)))
    expected = jax.grad(lambda M: jnp.sum(jnp.sin(jnp.linalg.solve(M, jnp.ones(n)))))(jnp.asarray(A))
    np.testing.assert_allclose(np.concatenate(comm.allgather(np.asarray(g))), expected, rtol=1e-8, atol=1e-11)


def test_operator_layout_reaches_the_solver(comm, rank, size):
    op = ops.laplacian_2d(4, comm=comm)
    b = jnp.ones(op.input_structure.shape)
    with pytest.raises(ValueError, match="layout is 'sharded'"):
        dl.cg(op, b, layout="replicated", comm=comm)
    with pytest.raises(NotImplementedError, match="does not know its diagonal"):
        ops.LinearOperator(lambda v: v, comm=comm).diagonal()
