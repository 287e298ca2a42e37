"""Non-blocking collectives: what the shared table in test_collectives.py
(values, JVP/VJP against the stacked reference, second order, vmap, dtypes)
does not cover: the other reduction ops, pytrees, loops, several requests
under way at once, and the errors of a request used wrongly."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distlinalg import comm as C
from distlinalg.comm import nonblocking
from conftest import gather_global


@pytest.mark.parametrize("op", ["prod", "max", "min"])
def test_iallreduce_other_ops(comm, rank, size, op):
    x = jnp.asarray(np.random.default_rng(rank).uniform(0.5, 1.5, 4))
    G = gather_global(x, comm)
    expected = {"prod": np.prod, "max": np.max, "min": np.min}[op](G, 0)
    np.testing.assert_allclose(C.wait(C.iallreduce(x, op, comm=comm)), expected, rtol=1e-13)
    np.testing.assert_allclose(jax.jit(lambda v: C.wait(C.iallreduce(v, op, comm=comm)))(x), expected, rtol=1e-13)


def test_non_sum_iallreduce_is_differentiable(comm, size):
    """max over equal values on every rank: the ties share the derivative
    equally, exactly as for the blocking allreduce (issue 42)."""
    g = jax.grad(lambda v: jnp.sum(C.wait(C.iallreduce(v, "max", comm=comm))))(jnp.ones(3))
    blocking = jax.grad(lambda v: jnp.sum(C.allreduce(v, "max", comm=comm)))(jnp.ones(3))
    np.testing.assert_array_equal(np.asarray(g), np.asarray(blocking))
    np.testing.assert_allclose(np.asarray(g), np.ones(3))  # (1/size of the total over size copies of the loss)


def test_pytree_operand(comm, rank, size):
    tree = {"a": jnp.arange(3.0) + rank, "b": (jnp.ones((2, 2)) * rank,)}
    out = C.wait(C.iallreduce(tree, comm=comm))
    np.testing.assert_allclose(out["a"], np.arange(3.0) * size + size * (size - 1) / 2)
    np.testing.assert_allclose(out["b"][0], np.full((2, 2), size * (size - 1) / 2))
    gathered = jax.jit(lambda t: C.wait(C.iallgather(t, comm=comm)))(tree)
    np.testing.assert_allclose(gathered["a"], gather_global(tree["a"], comm))


def test_requests_overlap_other_operations(comm, rank, size):
    """Two requests under way, a blocking collective between start and wait,
    waited for in the opposite order; gradient of the whole against the stack."""
    x = jnp.arange(4.0) * (rank + 1)

    def f(v):
        first = C.iallreduce(v * v, comm=comm)
        second = C.iallgather(jnp.sin(v), comm=comm)
        blocking = C.allreduce(jnp.cos(v), comm=comm)
        gathered = C.wait(second)
        return jnp.sum(C.wait(first) * blocking) + jnp.sum(gathered**2)

    def stacked(G):
        return size * jnp.sum(jnp.sum(G**2, 0) * jnp.sum(jnp.cos(G), 0)) + size * jnp.sum(jnp.sin(G) ** 2)

    G = jnp.asarray(gather_global(x, comm))
    np.testing.assert_allclose(jax.jit(f)(x), stacked(G) / size, rtol=1e-12)
    np.testing.assert_allclose(jax.jit(jax.grad(f))(x), jax.grad(stacked)(G)[rank], rtol=1e-12)


def test_inside_scan_and_while_loop(comm, rank, size):
    """Started and waited for in each iteration: the mean over ranks, repeated."""
    x = jnp.full(3, float(rank + 1))
    mean = (size + 1) / 2

    def body(carry, _):
        request = C.iallreduce(carry, comm=comm)
        return C.wait(request) / size, None

    out, _ = jax.lax.scan(body, x, None, length=3)
    np.testing.assert_allclose(out, np.full(3, mean), rtol=1e-13)
    count, value = jax.jit(lambda v: jax.lax.while_loop(
        lambda s: s[0] < 4, lambda s: (s[0] + 1, C.wait(C.iallreduce(s[1], comm=comm)) / size), (0, v)))(x)
    assert int(count) == 4
    np.testing.assert_allclose(value, np.full(3, mean), rtol=1e-13)
    # Σ_ranks Σ_entries out = Σ_entries Σ_r x_r: every rank's gradient is 1.
    grad = jax.jit(jax.grad(lambda v: jnp.sum(jax.lax.scan(body, v, None, length=2)[0])))(x)
    np.testing.assert_allclose(grad, np.ones(3), rtol=1e-13)


def test_a_request_never_waited_for_is_a_trace_time_error(comm):
    with pytest.raises(ValueError, match="never waited for in the same traced function"):
        jax.jit(lambda v: C.iallreduce(v, comm=comm)).lower(jnp.ones(2))
    with pytest.raises(ValueError, match="iallgather"):
        jax.jit(lambda v: (C.iallgather(v, comm=comm), v)[1]).lower(jnp.ones(2))


def test_waiting_twice_is_an_error(comm):
    request = C.iallreduce(jnp.ones(2), comm=comm)
    C.wait(request)
    with pytest.raises(Exception, match="not started \\(or was waited for already\\)"):
        C.wait(request)


def test_wait_rejects_other_values():
    with pytest.raises(TypeError, match="expected a Request"):
        C.wait(jnp.ones(2))


def test_requests_pending_at_exit_are_completed(comm, rank, size):
    """The exit hook waits for eager requests nobody waited for (and says so); a
    receive whose message never comes (and its send) is cancelled, not waited for."""
    request = C.iallreduce(jnp.ones(2) * rank, comm=comm)
    lonely = C.irecv(jnp.ones(3), source=rank, tag=77, comm=comm)  # nobody sends tag 77
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        nonblocking._wait_for_pending_at_exit()
    messages = " ".join(str(w.message) for w in caught)
    assert "never waited for" in messages and "iallreduce" in messages and "irecv" in messages
    for done in (request, lonely):
        with pytest.raises(Exception, match="not started"):
            C.wait(done)  # completed (and dropped) by the hook
        nonblocking._free_eager_keys.extend(done.keys)


def test_eager_calls_reuse_their_compiled_programs(comm):
    for _ in range(3):
        C.wait(C.iallreduce(jnp.ones(5), comm=comm))
    keys = {k for k in nonblocking._free_eager_keys}
    C.wait(C.iallreduce(jnp.ones(5), comm=comm))
    assert {k for k in nonblocking._free_eager_keys} == keys


def test_request_numbers_are_distinct_and_need_no_table():
    keys = [(kind, n, *suffix) for kind in ("traced", "eager") for n in (1, 2, 3, 10**6)
            for suffix in [(), ("t",), ("T",), ("t", "T"), ("T", "t"), ("t", "t", "T")]]
    numbers = [int(nonblocking._key_number(k)) for k in keys]
    assert len(set(numbers)) == len(keys)
    assert numbers == [int(nonblocking._key_number(k)) for k in keys]  # a function of the key alone
    with pytest.raises(NotImplementedError, match="nested derivatives"):
        nonblocking._key_number(("traced", 1) + ("t",) * 17)


def test_tracing_keeps_only_the_set_of_waited_keys(comm, rank, size):
    """Module state per traced start: one key in _waits_traced, nothing else (no route or name tables)."""
    from distlinalg.comm import nonblocking_p2p

    def program(v):
        right, left = (rank + 1) % size, (rank - 1) % size
        received = C.irecv(v, left, comm=comm)
        sent = C.isend(v, right, comm=comm)
        total = C.iallreduce(v, comm=comm)
        C.wait(sent)
        return C.wait(received) + C.wait(total)

    def state():
        return {name: len(value) for module in (nonblocking, nonblocking_p2p)
                for name, value in vars(module).items()
                if isinstance(value, (dict, set, list)) and name.startswith("_") and not name.startswith("__")}

    jax.jit(program).lower(jnp.ones(3))
    before = state()
    for _ in range(5):
        jax.jit(lambda v: program(v)).lower(jnp.ones(3))  # a new function: traced afresh
    grown = {name: state()[name] - count for name, count in before.items() if state()[name] != count}
    assert grown == {"_waits_traced": 15}
