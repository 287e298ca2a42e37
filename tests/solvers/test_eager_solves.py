"""Eager solver calls: op by op the first time, one cached compiled program after that,
and always what the operator computes now (solvers/_eager.py).

Every value is checked against numpy's dense solve of the same system, on
every rank; the trace counts and the solver's program table show which path
ran.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import distlinalg as dl
from distlinalg.operators import aslinearoperator

# At most 2 ranks (CI time, issue 55): what an eager call compiles and reads does not depend on the rank count beyond 2.
pytestmark = pytest.mark.max_ranks(2)

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


def compiled_keys(solve) -> list:
    """The kinds of key ("static" or "traced") this process has a compiled program for."""
    return [("traced" if key[0] == "traced" else "static") for key, program in solve.programs.items()
            if program is not None]


@pytest.mark.parametrize("name", list(SOLVERS))
def test_a_repeated_user_matvec_compiles_once(comm, name):
    """A user's function is traced on every call (what it reads may have changed) and keyed by
    the program it traces to: call 1 runs op by op, call 2 compiles, call 3 reuses it."""
    solve = SOLVERS[name]
    solve.programs.clear()
    A, _ = system(0)
    traces: list[int] = []
    matvec = counting(A, traces)
    seen = [0]
    for k in range(3):
        b = np.random.default_rng(10 + k).standard_normal(N)
        x, info = solve(matvec, b, rtol=1e-10, comm=comm)
        np.testing.assert_allclose(x, np.linalg.solve(A, b), rtol=1e-6, atol=1e-8)
        assert bool(info.converged)
        seen.append(len(traces))
        assert compiled_keys(solve) == ([] if k == 0 else ["traced"])
    per_call = np.diff(seen)
    # Calls 2 and 3 trace only to find their key (the compiled program runs the
    # jaxpr, not the function); call 1 traced for its key and ran op by op too.
    assert per_call[1] == per_call[2] > 0
    assert per_call[0] > per_call[1]


def test_distlinalg_operators_are_keyed_by_their_static_data(comm):
    """An operator whose static data fixes the computation (distlinalg's own) is not traced to
    find its key: new entries of the same shape run the compiled program directly."""
    dl.cg.programs.clear()
    for k in range(3):
        A, b = system(k)
        op = aslinearoperator(jnp.asarray(A), comm=comm)
        x, _ = dl.cg(op, jnp.asarray(b), rtol=1e-10, comm=comm)
        np.testing.assert_allclose(x, np.linalg.solve(A, b), rtol=1e-6, atol=1e-8)
    assert compiled_keys(dl.cg) == ["static"]


class Diagonal:
    """An object with ``__matmul__`` whose entries change between solves (not a pytree)."""

    def __init__(self, d):
        self.d = d

    def __matmul__(self, v):
        return self.d * v

    def apply(self, v):
        return self.d * v


@pytest.mark.parametrize("name", list(SOLVERS))
def test_every_call_uses_what_the_operator_reads_now(comm, name):
    """Functions and objects that read state changed between calls (a rebound closure variable,
    an attribute, a numpy array changed in place, a captured Python number) give this call's
    solution on every call, as jax.scipy's solvers do op by op; 3 calls, so the compiled
    program runs too (cg with every kind of operator, the other solvers with two: the key is
    found the same way for all four)."""
    solve = SOLVERS[name]
    base = np.array([1.0, 2.0, 4.0, 5.0])
    b = np.ones(4)
    current = {"d": jnp.asarray(base)}
    by_closure = lambda v: current["d"] * v  # noqa: E731
    obj = Diagonal(jnp.asarray(base))
    in_place = base.copy()
    by_numpy = lambda v: jnp.asarray(in_place, v.dtype) * v  # noqa: E731
    scale = [1.0]
    by_number = lambda v: scale[0] * (jnp.asarray(base, v.dtype) * v)  # noqa: E731
    operators = (by_closure, obj, obj.apply, by_numpy, by_number) if name == "cg" else (by_closure, by_number)
    for k in range(1, 4):
        d = base * k
        current["d"] = jnp.asarray(d)
        obj.d = jnp.asarray(d)
        in_place[:] = d
        scale[0] = float(k)
        for A in operators:
            x, info = solve(A, b, rtol=1e-10, comm=comm)
            np.testing.assert_allclose(x, b / d, rtol=1e-6, err_msg=f"call {k}, operator {A}")
            assert bool(info.converged)


def test_a_preconditioner_changed_in_place_is_used(comm):
    """M reads a numpy array that becomes the exact inverse on the third call: one iteration then."""
    A = np.diag([1.0, 10.0, 100.0])
    d = np.ones(3)
    M = lambda v: v / jnp.asarray(d, v.dtype)  # noqa: E731
    iterations = []
    for k in range(4):
        if k == 2:
            d[:] = np.diag(A)
        x, info = dl.cg(A, np.ones(3), M=M, rtol=1e-8, comm=comm)
        np.testing.assert_allclose(x, 1.0 / np.diag(A), rtol=1e-6)
        iterations.append(int(info.iterations))
    assert iterations[0] == iterations[1] > 1
    assert iterations[2] == iterations[3] == 1


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
    """Rank 0's matvec traces to the same program on every call, the other ranks' to a new one
    (a Python number that changes is part of the program): every rank stays op by op."""
    dl.cg.programs.clear()
    A, _ = system(1)
    for k in range(3):
        number = 1.0 if rank == 0 else float(k + 1)
        matvec = lambda v, number=number: jnp.asarray(A, v.dtype) @ v + (v * number) * 0.0  # noqa: E731
        b = np.random.default_rng(20 + k).standard_normal(N)
        x, info = dl.cg(matvec, b, rtol=1e-10, comm=comm)
        np.testing.assert_allclose(x, np.linalg.solve(A, b), rtol=1e-6, atol=1e-8)
    assert compiled_keys(dl.cg) == ([] if comm.Get_size() > 1 else ["traced"])


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


def test_arrays_captured_inside_a_nested_jit_are_not_hidden_in_the_key(comm):
    """A matvec jitted afresh on every call over a new array: the array is a constant of the
    nested program, not in the text of the outer one, so such calls must not share a program."""
    base = np.array([1.0, 2.0, 4.0])
    b = np.ones(3)
    for k in range(1, 4):
        d = jnp.asarray(base * k)
        matvec = jax.jit(lambda v: d * v)  # noqa: E731 (jitted afresh, over this call's d)
        x, info = dl.cg(matvec, b, rtol=1e-10, comm=comm)
        np.testing.assert_allclose(x, b / (base * k), rtol=1e-6, err_msg=f"call {k}")


def test_a_user_operator_class_reading_its_own_state(comm):
    """A user's subclass of LinearOperator (a pytree node type of the user's) whose matvec reads
    a class attribute: not keyed by its static data, so every call sees the attribute's value."""
    from distlinalg.operators import LinearOperator

    class Scaled(LinearOperator):
        scale = 1.0

        def matvec(self, v):
            return self.scale * super().matvec(v)

    A = Scaled(jnp.positive, input_structure=jnp.zeros(3), comm=comm)  # a library function: only the class is the user's
    for k in range(1, 4):
        Scaled.scale = float(k)
        x, _ = dl.cg(A, np.ones(3), rtol=1e-10, comm=comm)
        np.testing.assert_allclose(x, np.full(3, 1.0 / k), rtol=1e-6, err_msg=f"call {k}")
