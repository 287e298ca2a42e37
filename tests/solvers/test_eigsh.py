"""distlinalg.eigsh across ranks against numpy on the gathered matrix: values, vectors, both
layouts, real and complex, every `which`, both methods (Lanczos, LOBPCG with and without a
preconditioner), vmap, and derivatives in both modes against jnp.linalg.eigh."""

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


METHODS = [("lanczos", which) for which in ["SA", "LA", "SM", "LM"]] + [("lobpcg", "SA"), ("lobpcg", "LA")]


# The replicated layout does not depend on the rank count beyond 2 (CI time).
REPLICATED_UP_TO_TWO = pytest.param("replicated", marks=pytest.mark.max_ranks(2))


@pytest.mark.parametrize("layout", [REPLICATED_UP_TO_TWO, "sharded"])
@pytest.mark.parametrize("dtype", ["float64", "complex128"])
@pytest.mark.parametrize("method,which", METHODS)
def test_eigenpairs_against_numpy(comm, size, layout, dtype, method, which):
    A = hermitian(complex_=dtype == "complex128")
    k = 3
    w, X, info = run(A, comm, layout, k, which=which, method=method)
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
                                             [float(info.iterations), float(info.restarts), float(info.matvecs)]]),
                             comm)
    assert (everyone == everyone[0]).all()


@pytest.mark.parametrize("method", ["lanczos", "lobpcg"])
def test_pytree_vectors(comm, size, method):
    """Vectors that are pytrees (a dict of two leaves of different shapes), sharded: each rank
    holds its rows of both leaves. Against numpy on the matrix of the flattened vector."""
    A = hermitian(seed=9)
    rows = rows_of(comm.Get_rank(), size)
    split = len(rows) // 2  # this rank's rows: the first `split` go to leaf "a", the rest to "b" (2-D)

    def matvec(v):
        flat = jnp.concatenate([v["a"], v["b"].ravel()])
        out = jnp.asarray(A)[rows] @ allreduce(place(flat, rows, N), comm=comm)
        return {"a": out[:split], "b": out[split:].reshape(-1, 1)}

    v0 = {"a": jnp.ones(split), "b": jnp.ones((len(rows) - split, 1))}
    w, X, info = eigsh(matvec, 3, v0=v0, layout="sharded", method=method, comm=comm)
    np.testing.assert_allclose(w, np.linalg.eigvalsh(A)[:3], atol=1e-10)
    assert X["a"].shape == (3, split) and X["b"].shape == (3, len(rows) - split, 1)
    assert bool(info.converged) and float(np.max(info.residual_norms)) < 1e-9


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
def test_lobpcg_with_a_preconditioner(comm, size, layout):
    """A diagonally dominant matrix with a wide diagonal (clustered at the bottom relative to ‖A‖):
    Jacobi-preconditioned LOBPCG finds the same pairs as numpy in a few dozen iterations; without
    the preconditioner 100 iterations are far from enough."""
    rng = np.random.default_rng(11)
    d = np.geomspace(1.0, 1e4, N)
    E = rng.standard_normal((N, N))
    A = np.diag(d) + 0.05 * (E + E.T)
    if layout == "replicated":
        M = jnp.diag(1 / jnp.asarray(d))
    else:
        d_rows = jnp.asarray(d[rows_of(comm.Get_rank(), size)])
        M = lambda v: v / d_rows  # noqa: E731
    w, X, info = run(A, comm, layout, 3, method="lobpcg", M=M)
    _, _, plain = run(A, comm, layout, 3, method="lobpcg", maxiter=100)
    np.testing.assert_allclose(w, np.linalg.eigvalsh(A)[:3], rtol=1e-12)
    np.testing.assert_allclose(A @ X.T, X.T * w, atol=1e-9)
    assert bool(info.converged) and int(info.iterations) < 50
    assert not bool(plain.converged) and np.max(np.asarray(plain.residual_norms)) > 1e-3
    assert int(info.matvecs) == 3 * (int(info.iterations) + 1 + int(info.iterations) // 20 * 2 + 1) + 3


def test_lobpcg_in_jit_on_the_sharded_laplacian(comm, size):
    """A block method finds both copies of the Laplacian's double eigenvalue at once."""
    from distlinalg.operators import laplacian_2d

    n = 12
    A = laplacian_2d(n, comm=comm, dtype=jnp.float64)
    w, X, info = jax.jit(lambda: eigsh(A, 4, method="lobpcg"))()
    p = np.arange(1, n + 1)
    analytic = np.sort((4 - 2 * np.cos(np.pi * p[:, None] / (n + 1)) - 2 * np.cos(np.pi * p[None, :] / (n + 1))).ravel())
    np.testing.assert_allclose(w, analytic[:4], atol=1e-10)
    assert bool(info.converged) and int(info.restarts) == 0
    gathered = np.concatenate(gather_global(np.asarray(X).T, comm), axis=0).T if size > 1 else np.asarray(X)
    np.testing.assert_allclose(gathered @ gathered.T, np.eye(4), atol=1e-10)


@pytest.mark.max_ranks(2)  # CI time (issue 55): eigsh's batching is its collectives' vmap rules, tested at 3 ranks in tests/comm
@pytest.mark.parametrize("method", ["lanczos", "lobpcg"])
@pytest.mark.parametrize("layout", [REPLICATED_UP_TO_TWO, "sharded"])
def test_vmap_over_independent_operators(comm, size, method, layout):
    """jax.vmap over a batch of operators (in the sharded layout: each rank's rows of each):
    every member against numpy, and the batched gradient of the smallest eigenvalues."""
    batch = [hermitian(seed=20 + b) + b * np.eye(N) for b in range(3)]
    rows = rows_of(comm.Get_rank(), size)
    if layout == "replicated":
        def smallest(A):
            return eigsh(A, 2, method=method, comm=comm)
        stacked = jnp.asarray(np.stack(batch))
    else:
        def smallest(A_rows):
            def matvec(v):
                return A_rows @ allreduce(place(v, rows, N), comm=comm)
            return eigsh(matvec, 2, v0=jnp.ones(len(rows)), layout="sharded", method=method, comm=comm)
        stacked = jnp.asarray(np.stack([A[rows] for A in batch]))
    w, X, info = jax.jit(jax.vmap(smallest))(stacked)
    for b, A in enumerate(batch):
        np.testing.assert_allclose(w[b], np.linalg.eigvalsh(A)[:2], atol=1e-10)
    assert np.asarray(info.converged).all() and np.asarray(info.residual_norms).max() < 1e-9
    # d(λ₁ + λ₂)/dA of each member: the projector onto its two eigenvectors (its rows here;
    # the exact gradient of a replicated loss of sharded rows, docs/ad.md).
    sharded_rows = () if layout == "replicated" else 0
    G = np.asarray(jax.jit(distlinalg.ad.grad(lambda S: jnp.sum(jax.vmap(smallest)(S)[0]), sharded=sharded_rows,
                                              comm=comm))(stacked))
    for b, A in enumerate(batch):
        U = np.linalg.eigh(A)[1][:, :2]
        projector = U @ U.T
        expected = projector if layout == "replicated" else projector[rows]
        np.testing.assert_allclose(G[b], expected, atol=1e-8)


@pytest.mark.max_ranks(2)  # replicated layout: nothing here depends on the rank count beyond 2
def test_degenerate_eigenvalues_derivatives(comm):
    """A double eigenvalue: the derivative of the sum of its copies exists (the trace of Ȧ on the
    eigenspace) and is returned; the eigenvectors' derivative does not, and is NaN, also when k
    takes only one of the copies."""
    rng = np.random.default_rng(12)
    Q, _ = np.linalg.qr(rng.standard_normal((N, N)))
    values = np.concatenate([[-2.0, -2.0], np.linspace(0.0, 4.0, N - 2)])
    A0 = (Q * values) @ Q.T
    B = rng.standard_normal((N, N))
    B = B + B.T
    U = Q[:, :2]
    for method in ("lanczos", "lobpcg"):
        def values_sum(theta, method=method):
            return jnp.sum(eigsh(jnp.asarray(A0) + theta * jnp.asarray(B), 2, method=method, comm=comm)[0])

        def vector_part(theta, method=method):
            return jnp.sum(eigsh(jnp.asarray(A0) + theta * jnp.asarray(B), 2, method=method, comm=comm)[1][0] ** 2
                           * jnp.arange(N))

        np.testing.assert_allclose(jax.jit(jax.grad(values_sum))(0.0), np.trace(U.T @ B @ U), rtol=1e-8)
        assert np.isnan(jax.jit(jax.grad(vector_part))(0.0))
        assert np.isnan(jax.jit(lambda t: jax.jvp(vector_part, (t,), (1.0,))[1])(0.0))
    # k = 1 cuts the double eigenvalue: the other copy is in the complement, whose MINRES
    # solve then fails, and the eigenvector's tangent is NaN too.
    cut = lambda t: jnp.sum(eigsh(jnp.asarray(A0) + t * jnp.asarray(B), 1, comm=comm)[1][0] ** 2 * jnp.arange(N))  # noqa: E731
    assert np.isnan(jax.jit(jax.grad(cut))(0.0))


@pytest.mark.max_ranks(2)  # replicated layout: nothing here depends on the rank count beyond 2
def test_unconverged_derivative_raises_eagerly_and_is_nan_in_jit(comm, rank, size):
    """maxiter too small: the eigensolve says it did not converge; differentiating it raises a
    ValueError on every rank eagerly, and gives NaN under jit."""
    A = jnp.asarray(hermitian(seed=13))

    def smallest(theta):
        w, _, info = eigsh(A * theta, 2, ncv=4, maxiter=1, comm=comm)
        return w[0], info

    info = smallest(1.0)[1]
    assert not bool(info.converged) and int(info.reason) == -3
    assert int(info.restarts) == 1  # maxiter is kept: no probes after an unconverged run
    failure = failure_of(lambda: jax.grad(lambda t: smallest(t)[0])(1.0), "cannot differentiate an eigensolve")
    assert_no_failures(failure or "", comm)
    assert np.isnan(jax.jit(jax.grad(lambda t: smallest(t)[0]))(1.0))


@pytest.mark.max_ranks(2)  # CI time (issue 55): the derivative rules are formulas over the distributed eigenpairs; test_shift_invert_nearest_sigma_and_derivatives differentiates at 3 ranks
@pytest.mark.parametrize("method", ["lanczos", "lobpcg"])
@pytest.mark.parametrize("layout", [REPLICATED_UP_TO_TWO, "sharded"])
def test_derivatives_against_eigh(comm, size, layout, method):
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
            w, X, _ = eigsh(jnp.asarray(A0) + theta * jnp.asarray(B), k, method=method, comm=comm)
            return jnp.sum(w * jnp.arange(1.0, k + 1)) + jnp.sum(c * X[1] ** 2)
    else:
        rows = rows_of(comm.Get_rank(), size)
        A0r, Br, cr = jnp.asarray(A0[rows]), jnp.asarray(B[rows]), jnp.asarray(c[rows])

        def loss(theta):
            def matvec(v):
                full = allreduce(place(v, rows, N), comm=comm)
                return A0r @ full + theta * (Br @ full)

            w, X, _ = eigsh(matvec, k, v0=jnp.ones(len(rows)), layout="sharded", method=method, comm=comm)
            return jnp.sum(w * jnp.arange(1.0, k + 1)) + allreduce(jnp.sum(cr * X[1] ** 2), comm=comm)

    theta = 0.3
    # The exact gradient of a replicated loss of a replicated θ (docs/ad.md).
    value, grad = jax.jit(distlinalg.ad.value_and_grad(loss))(theta)
    ref_value, ref_grad = jax.value_and_grad(reference)(theta)
    np.testing.assert_allclose(value, ref_value, rtol=1e-9)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-6)
    tangent = jax.jit(lambda t: jax.jvp(loss, (t,), (1.0,))[1])(theta)
    np.testing.assert_allclose(tangent, ref_grad, rtol=1e-6)


@pytest.mark.parametrize("layout", [REPLICATED_UP_TO_TWO, "sharded"])
def test_shift_invert_nearest_sigma_and_derivatives(comm, size, layout):
    """sigma=σ: the k eigenvalues nearest σ (inside the spectrum), nearest first, against numpy;
    their derivatives along A(θ) = A₀ + θ B, forward and reverse, against eigh."""
    A0 = hermitian(seed=9)
    sigma, k = 1.03, 3
    w, X, info = run(A0, comm, layout, k, sigma=sigma, tol=1e-10)
    exact = np.linalg.eigvalsh(A0)
    nearest = exact[np.argsort(np.abs(exact - sigma))[:k]]
    np.testing.assert_allclose(w, nearest, rtol=1e-9)
    assert bool(info.converged) and np.all(np.asarray(info.residual_norms) < 1e-8)
    np.testing.assert_allclose(np.abs(X @ A0 @ X.T), np.diag(np.abs(nearest)), atol=1e-8)
    B = np.random.default_rng(10).standard_normal((N, N))
    B = (B + B.T) / 10
    theta = 0.2
    values = np.linalg.eigvalsh(A0 + theta * B)
    order = np.argsort(np.abs(values - sigma))[:k]
    weights = jnp.arange(1.0, k + 1)
    reference = lambda t: jnp.sum(jnp.linalg.eigh(jnp.asarray(A0) + t * jnp.asarray(B))[0][order] * weights)  # noqa: E731
    if layout == "replicated":
        loss = lambda t: jnp.sum(eigsh(jnp.asarray(A0) + t * jnp.asarray(B), k, sigma=sigma, comm=comm)[0] * weights)  # noqa: E731
    else:
        rows = rows_of(comm.Get_rank(), size)
        A0r, Br = jnp.asarray(A0[rows]), jnp.asarray(B[rows])

        def loss(t):
            def matvec(v):
                full = allreduce(place(v, rows, N), comm=comm)
                return A0r @ full + t * (Br @ full)

            w, _, _ = eigsh(matvec, k, v0=jnp.ones(len(rows)), layout="sharded", sigma=sigma, comm=comm)
            return jnp.sum(w * weights)

    grad = jax.jit(distlinalg.ad.grad(loss))(theta)
    np.testing.assert_allclose(grad, jax.grad(reference)(theta), rtol=1e-7)
    tangent = jax.jit(lambda t: jax.jvp(loss, (t,), (1.0,))[1])(theta)
    np.testing.assert_allclose(tangent, jax.grad(reference)(theta), rtol=1e-7)


@pytest.mark.max_ranks(2)  # replicated layout: nothing here depends on the rank count beyond 2
def test_gradient_with_respect_to_the_matrix(comm):
    """Reverse mode with respect to a replicated matrix: the symmetric part of the gradient
    is eigh's (which reads only the symmetric part of its input)."""
    A = hermitian(seed=7)
    c = np.random.default_rng(8).standard_normal(N)
    loss = lambda A: eigsh(A, 2, comm=comm)[0][0] + jnp.sum(c * eigsh(A, 2, comm=comm)[1][0] ** 2)  # noqa: E731
    ref = lambda A: jnp.linalg.eigh(A)[0][0] + jnp.sum(c * jnp.linalg.eigh(A)[1][:, 0] ** 2)  # noqa: E731
    G = np.asarray(jax.jit(jax.grad(loss))(jnp.asarray(A)))
    np.testing.assert_allclose((G + G.T) / 2, jax.grad(ref)(jnp.asarray(A)), atol=1e-8)


def test_bad_input_raises_on_every_rank(comm, rank, size):
    A = jnp.asarray(hermitian())
    last = rank == size - 1
    cases = {
        "k too large": (lambda: eigsh(A, N if last else 2, comm=comm), "k must be smaller"),
        "which": (lambda: eigsh(A, 2, which="XX" if last else "SA", comm=comm), "which must be one of"),
        "k": (lambda: eigsh(A, 0 if last else 2, comm=comm), "k must be a positive int"),
        "ncv": (lambda: eigsh(A, 2, ncv=2 if last else 10, comm=comm), "ncv must satisfy"),
        "method": (lambda: eigsh(A, 2, method="arnoldi" if last else "lanczos", comm=comm), "method must be one of"),
        "non-square": (lambda: eigsh(A[:, :-1] if last else A, 2, comm=comm), "must be a square matrix"),
        "lobpcg which": (lambda: eigsh(A, 2, which="SM" if last else "SA", method="lobpcg", comm=comm),
                         "LOBPCG finds the algebraic ends"),
        "lanczos M": (lambda: eigsh(A, 2, M=jnp.eye(N) if last else None, comm=comm), "takes no preconditioner"),
        "lobpcg ncv": (lambda: eigsh(A, 2, ncv=10 if last else None, method="lobpcg", comm=comm),
                       "ncv is the Lanczos basis size"),
        "M shape": (lambda: eigsh(A, 2, M=jnp.eye(N + 1 if last else N), method="lobpcg", comm=comm),
                    "does not fit"),
        "sigma method": (lambda: eigsh(A, 2, sigma=0.5 if last else None, method="lobpcg", comm=comm),
                         "method must be 'lanczos'"),
        "sigma which": (lambda: eigsh(A, 2, sigma=0.5, which="SA" if last else "LM", comm=comm),
                        "with sigma, which must be 'LM'"),
        "sigma value": (lambda: eigsh(A, 2, sigma=float("nan") if last else 0.5, comm=comm),
                        "sigma must be a finite real number"),
    }
    for name, (call, message) in cases.items():
        pattern = message if last else "invalid solver arguments"
        failure = failure_of(call, pattern)
        assert_no_failures(f"{name}: {failure}" if failure else "", comm)
    # Valid on each rank, but not the same everywhere: the same error on every rank.
    if size > 1:
        for name, call in {"k": lambda: eigsh(A, 3 if last else 2, comm=comm),
                           "tol": lambda: eigsh(A, 2, tol=1e-6 if last else 1e-8, comm=comm)}.items():
            failure = failure_of(call, "the ranks were given different parameters")
            assert_no_failures(f"{name} differing: {failure}" if failure else "", comm)
    with pytest.raises(ValueError, match="pass v0"):
        eigsh(lambda v: v, 2, comm=comm)


def test_top_level_name():
    assert distlinalg.eigsh is eigsh


def _loop_bodies(jaxpr):
    """The bodies of every while loop in `jaxpr`, outermost first."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "while":
            yield eqn.params["body_jaxpr"].jaxpr
        for sub in _subjaxprs(eqn):
            yield from _loop_bodies(sub)


def _subjaxprs(eqn):
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else [value]:
            inner = getattr(item, "jaxpr", None)
            if inner is not None and hasattr(inner, "eqns"):
                yield inner
            elif hasattr(item, "eqns"):
                yield item


def _allreduces(jaxpr, in_conds=False):
    """distlinalg allreduce equations in `jaxpr` (nested), outside `cond` branches unless `in_conds`."""
    total = 0
    for eqn in jaxpr.eqns:
        total += eqn.primitive.name == "distlinalg_allreduce"
        if eqn.primitive.name != "cond" or in_conds:
            total += sum(_allreduces(sub, in_conds) for sub in _subjaxprs(eqn))
    return total


@pytest.mark.parametrize("method", ["lanczos", "lobpcg"])
def test_three_allreduces_per_step_in_the_sharded_layout(comm, method):
    """The counts docs/eigensolvers.md states, read off the traced loops on the sharded Laplacian
    (whose matvec exchanges halos and reduces nothing): a Lanczos step (the innermost loop) and a
    LOBPCG iteration each take three allreduces (the breakdown branch of Lanczos aside)."""
    from distlinalg.operators import laplacian_2d

    A = laplacian_2d(8, comm=comm, dtype=jnp.float64)
    jaxpr = jax.make_jaxpr(lambda: eigsh(A, 2, method=method))().jaxpr
    bodies = list(_loop_bodies(jaxpr))
    step = [b for b in bodies if not list(_loop_bodies(b))][0] if method == "lanczos" else bodies[0]
    assert _allreduces(step) == 3


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.complex128])
def test_block_grams_of_long_uneven_vectors(comm, rank, size, dtype):
    """The Gram products behind LOBPCG and Lanczos (Xᴴ Y over all ranks) on vectors long enough to be
    summed by chunks, with a remainder, a second leaf, and a different length on every rank."""
    import sys

    eigen = sys.modules["distlinalg.solvers._eigen"]
    from distlinalg.solvers._common import Reductions

    lengths = [17 * eigen.GRAM_CHUNK + 5 + 1000 * r for r in range(size)]
    rng = np.random.default_rng(11)

    def draw(rows, n):
        x = rng.standard_normal((rows, n))
        return x + 1j * rng.standard_normal((rows, n)) if dtype == jnp.complex128 else x

    X_all, Y_all = [draw(3, n) for n in lengths], [draw(4, n) for n in lengths]
    small_X, small_Y = draw(3, 7), draw(4, 7)  # a short second leaf (the same on every rank)
    X = {"long": jnp.asarray(X_all[rank]), "short": jnp.asarray(small_X)}
    Y = {"long": jnp.asarray(Y_all[rank]), "short": jnp.asarray(small_Y)}
    def gram(X, Y):
        return jax.jit(lambda X, Y: eigen.grams(Reductions("sharded", distlinalg.comm.communicator()), [(X, Y)])[0])(X, Y)

    expected = sum(x.conj() @ y.T for x, y in zip(X_all, Y_all)) + size * (small_X.conj() @ small_Y.T)
    np.testing.assert_allclose(np.asarray(gram(X, Y)), expected, rtol=1e-12, atol=1e-10)
    first = jax.tree_util.tree_map(lambda leaf: leaf[:1], Y)  # against one vector: the plain dot
    np.testing.assert_allclose(np.asarray(gram(X, first)), expected[:, :1], rtol=1e-12, atol=1e-10)
