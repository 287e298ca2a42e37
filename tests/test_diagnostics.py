"""Debug logging, the cross-rank signature check and the large-count paths."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distlinalg.comm import allreduce, configure
from conftest import gather_global


@pytest.fixture
def signature_checks():
    configure(check_signatures=True)
    yield
    configure(check_signatures=False)


@pytest.fixture
def small_max_count():
    configure(max_count=7)
    yield
    configure(max_count=2**31 - 1)


def test_debug_log_names_op_dtype_and_count(comm, capfd):
    configure(debug_log=True)
    try:
        allreduce(jnp.ones(5, jnp.float32), comm=comm).block_until_ready()
        jax.jit(lambda a: allreduce(a, "max", comm=comm))(jnp.ones(3)).block_until_ready()
    finally:
        configure(debug_log=False)
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("distlinalg r")]
    assert len(lines) == 2, err
    assert f"r{comm.Get_rank()} " in lines[0] and "allreduce" in lines[0]
    assert "float32" in lines[0] and "count=5" in lines[0] and " us" in lines[0]
    assert "float64" in lines[1] and "count=3" in lines[1]


def test_mismatched_shapes_are_reported_on_every_rank(comm, rank, size, signature_checks):
    if size == 1:
        # Nothing can mismatch; the check itself must still pass through.
        np.testing.assert_allclose(allreduce(jnp.ones(3), comm=comm), np.ones(3))
        return
    x = jnp.ones(3 + (rank == size - 1))  # the last rank's array is longer
    with pytest.raises(Exception, match="allreduce was called with mismatched arguments") as info:
        allreduce(x, comm=comm).block_until_ready()
    message = str(info.value)
    assert f"rank {size - 1}: allreduce, float64[4 elements]" in message, message
    assert "rank 0: allreduce, float64[3 elements]" in message, message
    # Ranks are still in step afterwards.
    np.testing.assert_allclose(allreduce(jnp.ones(2), comm=comm), np.full(2, size))


def test_mismatched_dtypes_are_reported(comm, rank, size, signature_checks):
    if size == 1:
        np.testing.assert_allclose(allreduce(jnp.ones(3, jnp.float32), comm=comm), np.ones(3))
        return
    x = jnp.ones(3, jnp.float32 if rank == 0 else jnp.float64)
    with pytest.raises(Exception, match="mismatched arguments(.|\n)*float32(.|\n)*float64"):
        jax.jit(lambda a: allreduce(a, comm=comm))(x).block_until_ready()


@pytest.mark.parametrize("op", ["sum", "prod", "min", "max"])
def test_chunked_reductions_match(comm, rank, op, small_max_count):
    # 7 elements per MPI call: 45 elements take 7 calls, the last partial.
    x = np.random.default_rng(rank).uniform(0.5, 1.5, size=(5, 9))
    out = allreduce(jnp.asarray(x), op, comm=comm)
    ref = {"sum": np.sum, "prod": np.prod, "min": np.min, "max": np.max}[op](gather_global(x, comm), axis=0)
    np.testing.assert_allclose(out, ref, rtol=1e-13)
