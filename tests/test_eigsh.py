"""distlinalg.eigsh across ranks against numpy on the gathered matrix: values, vectors, both
layouts, real and complex, every `which`, and derivatives in both modes against jnp.linalg.eigh."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import distlinalg
from distlinalg.comm import allreduce
from distlinalg.solvers import eigsh
from conftest import assert_no_failures, failure_of, gather_global

N = 48


def hermitian(seed=0, n=N, complex_=False):
    """A Hermitian matrix with a known, well separated spectrum in [-3, 5]."""
    rng = np.random.default_rng(seed)
    Q = rng.standard_normal((n, n))
    if complex_:
        Q = Q + 1j * rng.standard_normal((n, n))
    Q, _ = np.linalg.qr(Q)
    return (Q * np.linspace(-3.0, 5.0, n)) @ Q.conj().T


def rows_of(rank, size, n=N):
    return np.array_split(np.arange(n), size)[rank]


def place(v, rows, n):
    """v at its (contiguous) rows of a zero vector of n entries (a slice update: transposable)."""
    return jax.lax.dynamic_update_slice(jnp.zeros(n, v.dtype), v, (int(rows[0]) if len(rows) else 0,))


def sharded(A, comm):
    """A's rows on this rank as a sharded matvec (x's blocks assembled by one allreduce)."""
    rows = rows_of(comm.Get_rank(), comm.Get_size(), A.shape[0])

    def matvec(v, A=A):
        full = allreduce(place(v, rows, A.shape[0]), comm=comm)
        return jnp.asarray(A)[rows] @ full

    return matvec, rows


def run(A, comm, layout, k, **options):
    """(w, X gathered to (k, N), info) of eigsh on A in `layout`."""
    if layout == "replicated":
        w, X, info = eigsh(jnp.asarray(A), k, comm=comm, **options)
        return np.asarray(w), np.asarray(X), info
    mv, rows = sharded(A, comm)
    v0 = jnp.ones(len(rows), A.dtype)
    w, X, info = eigsh(mv, k, v0=v0, layout="sharded", comm=comm, **options)
    whole = np.concatenate(gather_global(np.asarray(X).T, comm), axis=0).T if comm.Get_size() > 1 else np.asarray(X)
    return np.asarray(w), whole, info


@pytest.mark.parametrize("layout", ["replicated", "sharded"])
@pytest.mark.parametrize("dtype", ["float64", "complex128"])
@pytest.mark.parametrize("which", ["SA", "LA", "SM", "LM"])
def test_eigenpairs_against_numpy(comm, size, layout, dtype, which):
    A = hermitian(complex_=dtype == "complex128")
    k = 3
    w, X, info = run(A, comm, layout, k, which=which)
    values = np.linalg.eigvalsh(A)
    key = {"SA": values, "LA": -values, "SM": np.abs(values), "LM": -np.abs(values)}[which]
    expected = values[np.argsort(key, kind="stable")[:k]]
    np.testing.assert_allclose(w, expected, atol=1e-10)
    assert bool(info.converged) and int(info.reason) == 1
    # Eigenvectors: orthonormal over all ranks, and A x = λ x.
    np.testing.assert_allclose(X.conj() @ X.T, np.eye(k), atol=1e-10)
    np.testing.assert_allclose(A @ X.T, X.T * w, atol=1e-9)
    assert np.all(np.asarray(info.residual_norms) < 1e-9)
    # Identical on every rank.
    everyone = gather_global(np.concatenate([w, np.asarray(info.residual_norms),
                                             [float(info.iterations), float(info.restarts)]]), comm)
    assert (everyone == everyone[0]).all()


def test_in_jit_and_with_a_small_basis(comm):
    A = hermitian(seed=3)
    w, X, info = jax.jit(lambda A: eigsh(A, 4, ncv=9, comm=comm))(jnp.asarray(A))
    np.testing.assert_allclose(w, np.linalg.eigvalsh(A)[:4], atol=1e-10)
    assert int(info.restarts) > 1  # the thick restart did the work


def test_repeated_eigenvalues(comm):
    """An invariant subspace smaller than the basis (few distinct eigenvalues): the
    iteration continues from a fresh direction instead of inventing eigenvalues."""
    rng = np.random.default_rng(4)
    Q, _ = np.linalg.qr(rng.standard_normal((N, N)))
    values = np.repeat([1.0, 2.0, 3.0, 4.0], N // 4)
    A = (Q * values) @ Q.T
    w, X, info = eigsh(jnp.asarray(A), 3, comm=comm)
    np.testing.assert_allclose(w, [1.0, 1.0, 1.0], atol=1e-10)
    np.testing.assert_allclose(A @ np.asarray(X).T, np.asarray(X).T * np.asarray(w), atol=1e-9)


def test_sharded_laplacian_with_a_double_eigenvalue(comm, rank, size):
    """The 2-D Laplacian's λ(1,2) = λ(2,1): both copies are found (a single start vector
    sees one of them; the probes after convergence bring the other), on the library's
    sharded operator, against the analytic spectrum."""
    from distlinalg.operators import laplacian_2d

    n = 12
    A = laplacian_2d(n, comm=comm, dtype=jnp.float64)
    w, X, info = eigsh(A, 4)
    p = np.arange(1, n + 1)
    analytic = np.sort((4 - 2 * np.cos(np.pi * p[:, None] / (n + 1)) - 2 * np.cos(np.pi * p[None, :] / (n + 1))).ravel())
    np.testing.assert_allclose(w, analytic[:4], atol=1e-10)
    assert np.isclose(analytic[1], analytic[2]) and bool(info.converged)
    gathered = np.concatenate(gather_global(np.asarray(X).T, comm), axis=0).T if size > 1 else np.asarray(X)
    np.testing.assert_allclose(gathered @ gathered.T, np.eye(4), atol=1e-10)


@pytest.mark.parametrize("layout", ["replicated", "sharded"])
def test_derivatives_against_eigh(comm, size, layout):
    """d/dθ of eigenvalues and of a phase-invariant function of the eigenvectors of
    A(θ) = A₀ + θ B, forward and reverse, against jnp.linalg.eigh on the gathered matrix."""
    A0 = hermitian(seed=5)
    rng = np.random.default_rng(6)
    B = rng.standard_normal((N, N))
    B = B + B.T
    c = rng.standard_normal(N)
    k = 2

    def reference(theta):
        values, vectors = jnp.linalg.eigh(jnp.asarray(A0) + theta * jnp.asarray(B))
        return jnp.sum(values[:k] * jnp.arange(1.0, k + 1)) + jnp.sum(c * vectors[:, 1] ** 2)

    if layout == "replicated":
        def loss(theta):
            w, X, _ = eigsh(jnp.asarray(A0) + theta * jnp.asarray(B), k, comm=comm)
            return jnp.sum(w * jnp.arange(1.0, k + 1)) + jnp.sum(c * X[1] ** 2)
    else:
        rows = rows_of(comm.Get_rank(), size)
        A0r, Br, cr = jnp.asarray(A0[rows]), jnp.asarray(B[rows]), jnp.asarray(c[rows])

        def loss(theta):
            def matvec(v):
                full = allreduce(place(v, rows, N), comm=comm)
                return A0r @ full + theta * (Br @ full)

            w, X, _ = eigsh(matvec, k, v0=jnp.ones(len(rows)), layout="sharded", comm=comm)
            return jnp.sum(w * jnp.arange(1.0, k + 1)) + allreduce(jnp.sum(cr * X[1] ** 2), comm=comm)

    theta = 0.3
    # The exact gradient of a replicated loss of a replicated θ (docs/ad.md).
    value, grad = distlinalg.ad.value_and_grad(loss)(theta)
    ref_value, ref_grad = jax.value_and_grad(reference)(theta)
    np.testing.assert_allclose(value, ref_value, rtol=1e-9)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-6)
    _, tangent = jax.jvp(loss, (theta,), (1.0,))
    np.testing.assert_allclose(tangent, ref_grad, rtol=1e-6)


def test_gradient_with_respect_to_the_matrix(comm):
    """Reverse mode with respect to a replicated matrix: the symmetric part of the gradient
    is eigh's (which reads only the symmetric part of its input)."""
    A = hermitian(seed=7)
    c = np.random.default_rng(8).standard_normal(N)
    loss = lambda A: eigsh(A, 2, comm=comm)[0][0] + jnp.sum(c * eigsh(A, 2, comm=comm)[1][0] ** 2)  # noqa: E731
    ref = lambda A: jnp.linalg.eigh(A)[0][0] + jnp.sum(c * jnp.linalg.eigh(A)[1][:, 0] ** 2)  # noqa: E731
    G = np.asarray(jax.grad(loss)(jnp.asarray(A)))
    np.testing.assert_allclose((G + G.T) / 2, jax.grad(ref)(jnp.asarray(A)), atol=1e-8)


def test_bad_input_raises_on_every_rank(comm, rank, size):
    A = jnp.asarray(hermitian())
    last = rank == size - 1
    cases = {
        "k too large": (lambda: eigsh(A, N if last else 2, comm=comm), "k must be smaller"),
        "which": (lambda: eigsh(A, 2, which="XX" if last else "SA", comm=comm), "which must be one of"),
        "k": (lambda: eigsh(A, 0 if last else 2, comm=comm), "k must be a positive int"),
        "ncv": (lambda: eigsh(A, 2, ncv=2 if last else 10, comm=comm), "ncv must satisfy"),
    }
    for name, (call, message) in cases.items():
        pattern = message if last else "invalid solver arguments"
        failure = failure_of(call, pattern)
        assert_no_failures(f"{name}: {failure}" if failure else "", comm)
    with pytest.raises(ValueError, match="method must be 'lanczos'"):
        eigsh(A, 2, method="arnoldi", comm=comm)
    with pytest.raises(ValueError, match="pass v0"):
        eigsh(lambda v: v, 2, comm=comm)


def test_top_level_name():
    assert distlinalg.eigsh is eigsh
