"""Eager solver calls: op by op the first time, one cached compiled program after that.

Every value is checked against numpy's dense solve of the same system, on
every rank; the trace counts show which path ran (solvers/_eager.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import distlinalg as dl
from distlinalg.operators import aslinearoperator
from conftest import gather_global

N = 12
SOLVERS = {"cg": dl.cg, "minres": dl.minres, "gmres": dl.gmres, "bicgstab": dl.bicgstab}


def system(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    Q = rng.standard_normal((N, N))
    return Q @ Q.T / N + np.diag(np.linspace(1.0, 3.0, N)), rng.standard_normal(N)


def counting(A: np.ndarray, traces: list[int]):
    def matvec(v):
        traces.append(1)  # once per trace of the matvec (a compiled run does not trace)
        return jnp.asarray(A, v.dtype) @ v

    return matvec


@pytest.mark.parametrize("name", list(SOLVERS))
def test_a_repeated_operator_compiles_once(comm, name):
    solve = SOLVERS[name]
    A, _ = system(0)
    traces: list[int] = []
    matvec = counting(A, traces)
    seen = []
    for k in range(3):
        b = np.random.default_rng(10 + k).standard_normal(N)
        x, info = solve(matvec, b, rtol=1e-10, comm=comm)
        np.testing.assert_allclose(x, np.linalg.solve(A, b), rtol=1e-6, atol=1e-8)
        assert bool(info.converged)
        seen.append(len(traces))
    # Call 1 traces op by op, call 2 compiles (traces once more), call 3
    # reuses the program with a new right-hand side: no trace.
    assert 0 < seen[0] < seen[1] == seen[2]


def test_new_matrix_entries_reuse_the_program(comm):
    """A dense matrix and an operator's arrays are arguments of the program, not part of its key
    (the key is the same for every solver: cg stands for all four)."""
    for k in range(3):
        A, b = system(k)
        x, _ = dl.cg(A, b, rtol=1e-10, comm=comm)
        np.testing.assert_allclose(x, np.linalg.solve(A, b), rtol=1e-6, atol=1e-8)
        y, _ = dl.cg(aslinearoperator(jnp.asarray(A), comm=comm), jnp.asarray(b), rtol=1e-10, comm=comm)
        np.testing.assert_allclose(y, np.linalg.solve(A, b), rtol=1e-6, atol=1e-8)


def test_keys_that_repeat_on_some_ranks_only(comm, rank):
    """Rank 0 reuses its matvec, the others write a new one per call: every rank stays op by op."""
    A, _ = system(1)
    traces: list[int] = []
    kept = counting(A, traces)
    for k in range(3):
        matvec = kept if rank == 0 else counting(A, traces)
        b = np.random.default_rng(20 + k).standard_normal(N)
        x, info = dl.cg(matvec, b, rtol=1e-10, comm=comm)
        np.testing.assert_allclose(x, np.linalg.solve(A, b), rtol=1e-6, atol=1e-8)
    counts = gather_global(np.array([len(traces)]), comm)
    if comm.Get_size() > 1:  # rank 0 traced on every call too: no compiled path anywhere
        assert counts[0, 0] == counts[1, 0]


def test_errors_on_every_call(comm):
    """An invalid argument raises on the compiled path too (where the trace runs the checks)."""
    A, b = system(2)
    for _ in range(2):  # op by op, then compiling
        with pytest.raises(ValueError, match="rtol"):
            dl.cg(A, b, rtol=-1.0, comm=comm)
    x, _ = dl.cg(A, b, rtol=1e-10, comm=comm)
    np.testing.assert_allclose(x, np.linalg.solve(A, b), rtol=1e-6, atol=1e-8)


def test_unhashable_options_run_op_by_op(comm):
    """A traced-array option cannot be a cache key: the call still solves, op by op."""
    A, b = system(3)
    for _ in range(2):
        x, _ = dl.minres(A, b, shift=jnp.asarray(0.5), rtol=1e-10, comm=comm)
        np.testing.assert_allclose(x, np.linalg.solve(A - 0.5 * np.eye(N), b), rtol=1e-6, atol=1e-8)


def test_a_retrace_uses_this_calls_communicator(comm):
    """A program cached under a freed communicator's handle, retraced for new shapes under a new
    communicator (MPI may reuse the handle): the trace runs on the new one."""
    first = comm.Dup()
    A, b = system(4)
    for _ in range(2):  # the second call compiles
        jax.block_until_ready(dl.cg(A, b, rtol=1e-10, comm=first))  # (done before the Free)
    first.Free()
    second = comm.Dup()
    try:
        A2 = np.diag(np.linspace(1.0, 2.0, N + 3))
        b2 = np.ones(N + 3)
        for _ in range(2):
            x, info = dl.cg(A2, b2, rtol=1e-10, comm=second)
            np.testing.assert_allclose(x, b2 / np.diag(A2), rtol=1e-6)
            assert bool(info.converged)
    finally:
        second.Free()
