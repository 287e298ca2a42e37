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


def poisson(n):
    T = sp.diags([-np.ones(n - 1), 2 * np.ones(n), -np.ones(n - 1)], [-1, 0, 1])
    return (sp.kron(sp.eye(n), T) + sp.kron(T, sp.eye(n))).tocsr()


def concat_blocks(local, comm):
    """The global vector from every rank's block (block sizes may differ)."""
    return np.concatenate(comm.allgather(np.asarray(local)))


def block_of(global_vector, partition, rank):
    return global_vector[partition.starts[rank] : partition.starts[rank + 1]]


def even(total, size):
    """The operators' default split: the first total % size ranks one row longer."""
    return [total // size + (r < total % size) for r in range(size)]


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
HALOS = ["overlapped", "blocking"]


@pytest.mark.parametrize("halo", HALOS)
@pytest.mark.parametrize("n", [1, 2, 5])
def test_laplacian_matches_kron(comm, rank, size, n, halo):
    op = ops.laplacian_2d(n, halo=halo, comm=comm)
    A = poisson(n).toarray()
    np.testing.assert_array_equal(np.asarray(op.to_dense()), A)
    x = np.random.default_rng(0).standard_normal(n * n)
    start, stop = op.grid_rows
    y = jax.jit(op.matvec)(jnp.asarray(x[start * n : stop * n]))
    np.testing.assert_allclose(concat_blocks(y, comm), A @ x, rtol=1e-13, atol=1e-13)
    np.testing.assert_array_equal(np.asarray(op.diagonal()), 4.0)


@pytest.mark.parametrize("halo", HALOS)
def test_laplacian_transpose_and_cg(comm, rank, size, halo):
    n = 6
    op = ops.laplacian_2d(n, row_partition=uneven(n, size), halo=halo, comm=comm)
    A = poisson(n)
    start, stop = op.grid_rows
    w = np.random.default_rng(1).standard_normal(n * n)
    (t,) = jax.linear_transpose(op.matvec, op.input_structure)(jnp.asarray(w[start * n : stop * n]))
    np.testing.assert_allclose(concat_blocks(t, comm), A.T @ w, rtol=1e-13)
    b = np.arange(n * n, dtype=float)
    x, info = dl.cg(op, jnp.asarray(b[start * n : stop * n]), rtol=1e-12, comm=comm)
    assert bool(info.converged)
    np.testing.assert_allclose(concat_blocks(x, comm), np.linalg.solve(A.toarray(), b), rtol=1e-9)


@pytest.mark.parametrize("halo", HALOS)
def test_laplacian_derivatives_and_vmap(comm, rank, size, halo):
    """Loss Σ sin(A x) (allreduced): jvp and grad against the dense reference; vmap of the matvec."""
    n = 5
    op = ops.laplacian_2d(n, row_partition=uneven(n, size), halo=halo, comm=comm)
    A = jnp.asarray(poisson(n).toarray())
    start, stop = op.grid_rows
    rng = np.random.default_rng(2)
    x, t = rng.standard_normal(n * n), rng.standard_normal(n * n)
    mine = slice(start * n, stop * n)

    def loss(x_local):
        return dl.comm.allreduce(jnp.sum(jnp.sin(op.matvec(x_local))), comm=comm)

    def reference(x_all):
        return jnp.sum(jnp.sin(A @ x_all))

    value, slope = jax.jit(lambda x, t: jax.jvp(loss, (x,), (t,)))(jnp.asarray(x[mine]), jnp.asarray(t[mine]))
    expected_value, expected_slope = jax.jvp(reference, (jnp.asarray(x),), (jnp.asarray(t),))
    np.testing.assert_allclose(value, expected_value, rtol=1e-12)
    np.testing.assert_allclose(slope, expected_slope, rtol=1e-12)
    g = jax.jit(dl.ad.grad(loss, sharded=0, comm=comm))(jnp.asarray(x[mine]))
    np.testing.assert_allclose(concat_blocks(g, comm), jax.grad(reference)(jnp.asarray(x)), rtol=1e-12, atol=1e-14)
    X = rng.standard_normal((3, n * n))
    Y = jax.jit(jax.vmap(op.matvec))(jnp.asarray(X[:, mine]))
    np.testing.assert_allclose(np.concatenate(comm.allgather(np.asarray(Y)), axis=1), X @ np.asarray(A).T,
                               rtol=1e-12, atol=1e-12)
    if halo == "blocking":  # every order
        grad = dl.ad.grad(loss, sharded=0, comm=comm)
        hvp = jax.jit(lambda x, t: jax.jvp(grad, (x,), (t,))[1])(jnp.asarray(x[mine]), jnp.asarray(t[mine]))
        expected = jax.jvp(jax.grad(reference), (jnp.asarray(x),), (jnp.asarray(t),))[1]
        np.testing.assert_allclose(concat_blocks(hvp, comm), expected, rtol=1e-11, atol=1e-13)


def test_operators_reject_unknown_or_differing_halo_mode(comm, rank, size):
    """Raised on every rank, also on the ranks whose own value is fine."""
    bad = "async" if rank == size - 1 else "blocking"
    with pytest.raises(ValueError, match="halo must be one of"):
        ops.laplacian_2d(4, halo=bad, comm=comm)
    with pytest.raises(ValueError, match="halo must be one of"):
        ops.sparse_rows(poisson(3), halo=bad, comm=comm)
    if size > 1:
        differing = "overlapped" if rank == 0 else "blocking"
        with pytest.raises(ValueError, match="same on every rank.*rank 0: overlapped, rank 1: blocking"):
            ops.laplacian_2d(4, halo=differing, comm=comm)
        with pytest.raises(ValueError, match="same on every rank"):
            ops.sparse_rows(poisson(3), halo=differing, comm=comm)


# ---------------------------------------------------------------------------
# Sparse rows with a halo exchange
def random_square(n, seed):
    M = sp.random(n, n, density=0.3, random_state=seed, format="csr") + sp.eye(n) * 3
    return M.tocsr()


# The 3-rank world (oversubscribed) keeps the cases whose halo differs most
# from 2 ranks' (scattered columns, uneven blocks).
TWO = pytest.mark.max_ranks(2)


@pytest.mark.parametrize("case", [pytest.param("poisson", marks=TWO), pytest.param("random", marks=TWO), "scattered",
                                  pytest.param("rectangular", marks=TWO), "uneven"])
@pytest.mark.parametrize("halo", HALOS)
def test_sparse_rows_matvec_and_transpose(comm, rank, size, case, halo):
    if case == "poisson":
        A, kwargs = poisson(4), {}
    elif case == "random":
        A, kwargs = random_square(11, 3), {}
    elif case == "scattered":
        # 3 entries per row: two at random columns anywhere (the halo), one at a random
        # column of the row's own block (many distinct offsets there at any rank count:
        # stored as ELLPACK, not by diagonals); 10 rows per rank, at least 40.
        rng = np.random.default_rng(11)
        n = max(40, 10 * size)
        own = np.concatenate([start + rng.permutation(count) for start, count in
                              zip(np.cumsum([0] + even(n, size)[:-1]), even(n, size))])
        cols = np.stack([rng.permutation(n), rng.permutation(n), own], axis=1)
        A = sp.csr_matrix((rng.standard_normal(3 * n), (np.repeat(np.arange(n), 3), cols.ravel())), shape=(n, n))
        A = (A + sp.eye(n) * 5).tocsr()
        kwargs = {}
    elif case == "rectangular":
        A = sp.random(9, 7, density=0.4, random_state=4, format="csr")
        kwargs = {}
    else:
        A = random_square(10, 5)
        kwargs = {"row_partition": uneven(10, size), "column_partition": uneven(10, size)[::-1]}
    op = ops.sparse_rows(A, halo=halo, comm=comm, **kwargs)
    # Checked on the gathered list, so every rank passes or fails together.
    formats = comm.allgather(op.pattern.format)
    if case == "poisson":
        assert formats == ["dia"] * size  # the stencil's few offsets (the halo is a separate product)
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


@pytest.mark.parametrize("halo", HALOS)
def test_sparse_rows_rank_without_halo_under_vmap(comm, rank, size, halo):
    # The last rank's rows touch only its own columns and the first row of rank 0
    # reaches every column: under vmap (to_dense of A and of Aᵀ maps over a basis)
    # every rank's exchange must be batched alike, halo or not.
    n = 3 * size
    A = sp.lil_matrix((n, n))
    A.setdiag(4.0)
    A[0, :] = 1.0 + np.arange(n)
    A = A.tocsr()
    op = ops.sparse_rows(A, halo=halo, comm=comm)
    np.testing.assert_allclose(np.asarray(op.to_dense()), A.toarray(), rtol=1e-14)
    np.testing.assert_allclose(np.asarray(op.T.to_dense()), A.toarray().T, rtol=1e-14)


def test_sparse_rows_poisson_bulk_by_diagonals_on_every_rank(comm, rank, size):
    """The halo must not leak into the bulk's storage: every rank's own block
    is stored by the stencil's five diagonals (a halo column sits ~block
    length away from its row and, stored in the same diagonals, would make
    the last rank stream a vector twice its block), and the halo entries
    form a small separate product over the grid rows next to the block
    boundaries: at most one grid row per neighbour."""
    n = max(12, 2 * size)  # every block at least two grid rows long (n²/P ≥ 2n)
    A = poisson(n)
    op = ops.sparse_rows(A, comm=comm)
    pattern = op.pattern
    mine = {
        "format": pattern.format,
        "offsets": pattern.own.offsets.tolist() if pattern.format == "dia" else None,
        "halo_format": pattern.halo_format,
        "halo_rows": int(pattern.halo_rows.size),
    }
    everyone = comm.allgather(mine)  # every rank asserts on every rank's layout
    neighbours = [(r > 0) + (r < size - 1) for r in range(size)]
    assert [e["format"] for e in everyone] == ["dia"] * size
    assert [e["offsets"] for e in everyone] == [[-n, -1, 0, 1, n]] * size
    assert [e["halo_format"] for e in everyone] == ["dia" if size > 1 else None] * size
    assert [e["halo_rows"] for e in everyone] == [n * k for k in neighbours]
    x = np.random.default_rng(12).standard_normal(n * n)
    y = jax.jit(op.matvec)(jnp.asarray(block_of(x, pattern.columns, rank)))
    np.testing.assert_allclose(concat_blocks(y, comm), A @ x, rtol=1e-13, atol=1e-13)


def halo_heavy(size, block=10):
    """Blocks of `block` rows, one per rank, each diagonal, plus off-block
    entries: the block's first row reaches every other rank's columns, its
    other rows one column each in the next block. Uneven halo rows:
    segment-sum storage for the halo, diagonals for the own block."""
    N = block * size
    A = sp.lil_matrix((N, N))
    A.setdiag(2.0)
    if size > 1:
        for r in range(size):
            first = r * block
            outside = [c for c in range(N) if not first <= c < first + block]
            A[first, outside] = np.linspace(0.5, 1.5, len(outside))
            for i in range(1, block):
                A[first + i, (first + block + i) % N] = -0.5 - 0.1 * i
    return A.tocsr()


def test_sparse_rows_halo_segment_path(comm, rank, size):
    A = halo_heavy(size)
    op = ops.sparse_rows(A, comm=comm)
    formats = comm.allgather((op.pattern.format, op.pattern.halo_format))
    assert formats == [("dia", "segment" if size > 1 else None)] * size
    dense = A.toarray()
    np.testing.assert_allclose(np.asarray(op.to_dense()), dense, rtol=1e-14, atol=1e-15)
    np.testing.assert_allclose(np.asarray(op.T.to_dense()), dense.T, rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("case", ["poisson", "halo_heavy", "scattered"])
def test_sparse_rows_derivatives_wrt_values(comm, rank, size, case):
    """jvp and vjp of x ↦ A(values) x with respect to the values (jitted):
    the tangent is A(tangent values) x, the cotangent of entry (i, j) is w_i x_j."""
    if case == "poisson":
        A = poisson(5)
    elif case == "halo_heavy":
        A = halo_heavy(size)
    else:
        rng = np.random.default_rng(13)
        n = 30
        cols = np.stack([rng.permutation(n) for _ in range(3)], axis=1)
        A = sp.csr_matrix((np.ones(3 * n), (np.repeat(np.arange(n), 3), cols.ravel())), shape=(n, n)).tocsr()
    op = ops.sparse_rows(A, comm=comm)
    data, indices, indptr = op.local_csr
    rows = op.pattern.rows
    N = A.shape[0]
    x = np.random.default_rng(14).standard_normal(N)
    w = np.random.default_rng(15).standard_normal(N)
    x_local, w_local = jnp.asarray(block_of(x, rows, rank)), jnp.asarray(block_of(w, rows, rank))
    tangent = jnp.asarray(np.random.default_rng(16 + rank).standard_normal(data.shape))

    def apply(values):
        return op.with_data(values).matvec(x_local)

    _, y_dot = jax.jit(lambda v, t: jax.jvp(apply, (v,), (t,)))(data, tangent)
    (values_bar,) = jax.jit(lambda v, c: jax.vjp(apply, v)[1](c))(data, w_local)

    local_rows = np.repeat(np.arange(indptr.size - 1), np.diff(indptr))
    tangent_matrix = sp.coo_matrix((concat_blocks(tangent, comm),
                                    (concat_blocks(local_rows + rows.starts[rank], comm), concat_blocks(indices, comm))),
                                   shape=A.shape)
    np.testing.assert_allclose(concat_blocks(y_dot, comm), tangent_matrix @ x, rtol=1e-13, atol=1e-13)
    expected_bar = np.asarray(w_local)[local_rows] * x[indices]
    np.testing.assert_allclose(concat_blocks(values_bar, comm), concat_blocks(expected_bar, comm),
                               rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("halo", HALOS)
def test_sparse_rows_derivatives_wrt_x_and_vmap(comm, rank, size, halo):
    """Loss Σ sin(A x) (allreduced) of a halo-heavy matrix: jvp and grad in x
    against the dense reference; vmap of the matvec; Hessian-vector products
    with the blocking exchange."""
    A = halo_heavy(size, block=6)
    dense = jnp.asarray(A.toarray())
    op = ops.sparse_rows(A, halo=halo, comm=comm)
    cols = op.pattern.columns
    rng = np.random.default_rng(17)
    x, t = rng.standard_normal(A.shape[1]), rng.standard_normal(A.shape[1])
    mine = lambda v: jnp.asarray(block_of(v, cols, rank))  # noqa: E731

    def loss(x_local):
        return dl.comm.allreduce(jnp.sum(jnp.sin(op.matvec(x_local))), comm=comm)

    def reference(x_all):
        return jnp.sum(jnp.sin(dense @ x_all))

    value, slope = jax.jit(lambda x, t: jax.jvp(loss, (x,), (t,)))(mine(x), mine(t))
    expected_value, expected_slope = jax.jvp(reference, (jnp.asarray(x),), (jnp.asarray(t),))
    np.testing.assert_allclose(value, expected_value, rtol=1e-12)
    np.testing.assert_allclose(slope, expected_slope, rtol=1e-12)
    grad = dl.ad.grad(loss, sharded=0, comm=comm)
    np.testing.assert_allclose(concat_blocks(jax.jit(grad)(mine(x)), comm), jax.grad(reference)(jnp.asarray(x)),
                               rtol=1e-12, atol=1e-14)
    X = rng.standard_normal((2, A.shape[1]))
    Y = jax.jit(jax.vmap(op.matvec))(jnp.stack([mine(row) for row in X]))
    np.testing.assert_allclose(np.concatenate(comm.allgather(np.asarray(Y)), axis=1), X @ A.toarray().T,
                               rtol=1e-12, atol=1e-12)
    if halo == "blocking":
        hvp = jax.jit(lambda x, t: jax.jvp(grad, (x,), (t,))[1])(mine(x), mine(t))
        expected = jax.jvp(jax.grad(reference), (jnp.asarray(x),), (jnp.asarray(t),))[1]
        np.testing.assert_allclose(concat_blocks(hvp, comm), expected, rtol=1e-11, atol=1e-13)


def test_sparse_rows_local_blocks_and_segment_path(comm, rank, size):
    # One long row forces the segment-sum product (rank 0) instead of ELLPACK;
    # the purely diagonal blocks of the other ranks are stored by diagonals.
    # Rank 0 needs at least 5 rows for that (with fewer, its own-column block
    # has few enough diagonals for DIA): 5 rows per rank.
    n = 5 * size
    A = sp.lil_matrix((n, n))
    A.setdiag(2.0)
    A[0, :] = np.arange(1, n + 1)
    A = A.tocsr()
    sizes = uneven(n, size)
    start = sum(sizes[:rank])
    op = ops.sparse_rows(A[start : start + sizes[rank]], local=True, comm=comm)
    assert comm.allgather(op.pattern.format) == ["segment"] + ["dia"] * (size - 1)
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
@pytest.mark.parametrize("square", [True, pytest.param(False, marks=TWO)])
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


def test_a_matvec_that_does_not_match_output_structure_is_named(comm):
    """A rectangular matvec without output_structure (which defaults to input_structure) fails at
    its first product with a message that says so, eagerly and in jit, on every rank."""
    from distlinalg.operators import LinearOperator

    W = jnp.arange(12.0).reshape(4, 3)
    op = LinearOperator(lambda d, v: d @ v, data=W, input_structure=jnp.zeros(3), comm=comm)
    for apply in (lambda v: op @ v, jax.jit(lambda v: op @ v)):
        with pytest.raises(ValueError, match=r"maps float\d+\[3\] to float\d+\[4\].*pass output_structure="):
            apply(jnp.ones(3))
    fixed = LinearOperator(lambda d, v: d @ v, data=W, input_structure=jnp.zeros(3),
                           output_structure=jnp.zeros(4), comm=comm)
    np.testing.assert_allclose(fixed @ jnp.ones(3), W.sum(axis=1))
    np.testing.assert_allclose(fixed.T @ jnp.ones(4), W.sum(axis=0))
    np.testing.assert_allclose(fixed.to_dense(), W)
