"""The primal of every reducing collective, for every reduction op, is the
same under jax.jvp, jax.vjp / value_and_grad, jax.linearize and jax.vmap as
untransformed, and equals the single-process reduction of the stacked data
(issue 42: exscan's product was 2 on rank 0 under AD). Tangents that are
Python numbers, which JAX accepts, work in every JVP rule."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distlinalg import comm as C

FLOAT_OPS = ["sum", "prod", "min", "max"]
BITWISE_OPS = ["band", "bor", "bxor", "land", "lor", "lxor"]

_NUMPY = {
    "sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum,
    "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor,
    "land": np.logical_and, "lor": np.logical_or, "lxor": np.logical_xor,
}
_IDENTITY = {"sum": 0, "prod": 1, "band": -1, "bor": 0, "bxor": 0, "land": 1, "lor": 0, "lxor": 0}


def _reduce(op, rows, dtype):
    """op over the first axis of `rows` (the ranks), in numpy."""
    out = _NUMPY[op].reduce(np.asarray(rows), axis=0)
    return np.asarray(out).astype(dtype)


def _identity(op, dtype, shape):
    if op in ("min", "max"):
        value = np.inf if op == "min" else -np.inf
        if np.issubdtype(dtype, np.integer):
            info = np.iinfo(dtype)
            value = info.max if op == "min" else info.min
        return np.full(shape, value, dtype)
    return np.full(shape, _IDENTITY[op], dtype)


def _local(rank, dtype):
    """This rank's data: no zeros, no ties between ranks (rank-distinct values)."""
    if np.issubdtype(dtype, np.integer):
        return np.array([3 + rank, 5 * (rank + 1), 6 + 2 * rank], dtype)
    return np.array([1.0 + 0.5 * rank, 2.0 - 0.25 * rank, 0.5 + rank], dtype)


def _collectives(comm, rank, size):
    """name -> (fn(x, op), reference(all ranks' data (size, 3), op, dtype))."""
    def exscan_reference(rows, op, dtype):
        return _reduce(op, rows[:rank], dtype) if rank > 0 else _identity(op, dtype, rows.shape[1:])

    def blocks(x):
        return jnp.stack([x * (q + 1) for q in range(size)])  # (size, 3): block q goes to rank q

    return {
        "allreduce": (lambda x, op: C.allreduce(x, op, comm=comm), lambda rows, op, dt: _reduce(op, rows, dt)),
        "tree_allreduce": (lambda x, op: C.tree_allreduce({"a": x, "b": x[:2]}, op, comm=comm)["a"],
                           lambda rows, op, dt: _reduce(op, rows, dt)),
        "iallreduce": (lambda x, op: C.wait(C.iallreduce(x, op, comm=comm)),
                       lambda rows, op, dt: _reduce(op, rows, dt)),
        "reduce": (lambda x, op: C.reduce(x, op, root=0, comm=comm),
                   lambda rows, op, dt: _reduce(op, rows, dt) if rank == 0 else np.zeros(rows.shape[1:], dt)),
        "reduce_scatter": (lambda x, op: C.reduce_scatter(blocks(x), op, comm=comm),
                           lambda rows, op, dt: _reduce(op, rows * (rank + 1), dt)),
        "scan": (lambda x, op: C.scan(x, op, comm=comm), lambda rows, op, dt: _reduce(op, rows[: rank + 1], dt)),
        "exscan": (lambda x, op: C.exscan(x, op, comm=comm), exscan_reference),
    }


def _cases():
    names = ["allreduce", "tree_allreduce", "iallreduce", "reduce", "reduce_scatter", "scan", "exscan"]
    return [(name, op) for name in names for op in FLOAT_OPS + BITWISE_OPS]


@pytest.mark.parametrize(("name", "op"), _cases())
def test_primal_is_unchanged_under_transformations(comm, rank, size, name, op):
    fn, reference = _collectives(comm, rank, size)[name]
    dtype = np.int32 if op in BITWISE_OPS else np.float64
    x = jnp.asarray(_local(rank, dtype))
    rows = np.stack(comm.allgather(_local(rank, dtype)))
    f = lambda v: fn(v, op)  # noqa: E731
    expected = reference(rows, op, dtype)

    plain = f(x)
    np.testing.assert_allclose(np.asarray(plain), expected, rtol=1e-14, err_msg="untransformed")
    np.testing.assert_allclose(np.asarray(jax.jit(f)(x)), expected, rtol=1e-14, err_msg="jit")
    if dtype == np.int32:
        tangent = np.zeros(x.shape, jax.dtypes.float0)
    else:
        tangent = jnp.asarray(np.linspace(0.5, -0.5, 3))
    transformed = {
        "jvp": jax.jvp(f, (x,), (tangent,))[0],
        "jit(jvp)": jax.jit(lambda v, t: jax.jvp(f, (v,), (t,)))(x, tangent)[0],
        "vjp": jax.vjp(f, x)[0],
        "vmap": jax.vmap(f)(jnp.stack([x, x]))[1],
    }
    if dtype == np.float64:
        transformed["linearize"] = jax.linearize(f, x)[0]
        value, _ = jax.value_and_grad(lambda v: jnp.sum(f(v)))(x)
        np.testing.assert_allclose(float(value), float(np.sum(expected)), rtol=1e-14, err_msg="value_and_grad")
    for how, primal in transformed.items():
        np.testing.assert_allclose(np.asarray(primal), expected, rtol=1e-14, err_msg=how)


@pytest.mark.parametrize("op", FLOAT_OPS)
@pytest.mark.parametrize("name", ["allreduce", "scan", "exscan", "reduce_scatter", "reduce", "iallreduce"])
def test_python_number_tangents(comm, rank, size, name, op):
    """jax.jvp with a Python-float tangent (JAX accepts it for a float64 scalar
    primal) gives the same tangent as the same value as an array."""
    fn, _ = _collectives(comm, rank, size)[name]
    x = jnp.asarray(1.5 + rank, jnp.float64)
    f = lambda v: fn(v[None], op)  # noqa: E731
    y, t = jax.jvp(f, (x,), (0.75,))
    y_array, t_array = jax.jvp(f, (x,), (jnp.asarray(0.75, jnp.float64),))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_array))
    np.testing.assert_array_equal(np.asarray(t), np.asarray(t_array))


@pytest.mark.parametrize("op", FLOAT_OPS)
def test_iallreduce_derivatives_equal_allreduce(comm, rank, size, op):
    """iallreduce + wait differentiates as allreduce (whose rules are checked
    against references in test_allreduce.py), forward and reverse, every op."""
    x = jnp.asarray(_local(rank, np.float64))
    direction = jnp.asarray(np.linspace(0.5, -0.5, 3) + rank)
    blocking = lambda v: jnp.sum(jnp.sin(C.allreduce(v, op, comm=comm)))  # noqa: E731
    started = lambda v: jnp.sum(jnp.sin(C.wait(C.iallreduce(v, op, comm=comm))))  # noqa: E731
    np.testing.assert_allclose(np.asarray(jax.jit(jax.grad(started))(x)), np.asarray(jax.grad(blocking)(x)),
                               rtol=1e-13)
    _, t_started = jax.jvp(started, (x,), (direction,))
    _, t_blocking = jax.jvp(blocking, (x,), (direction,))
    np.testing.assert_allclose(float(t_started), float(t_blocking), rtol=1e-13)
