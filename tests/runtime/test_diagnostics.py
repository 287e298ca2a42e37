"""Debug logging, the cross-rank signature check and the large-count paths."""

from __future__ import annotations

import re

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


def test_debug_log_names_op_dtype_and_count(comm, capfd, handlers_on_one_rank):
    configure(debug_log=True)
    try:
        allreduce(jnp.ones(5, jnp.float32), comm=comm).block_until_ready()
        jax.jit(lambda a: allreduce(a, "max", comm=comm))(jnp.ones(3)).block_until_ready()
    finally:
        configure(debug_log=False)
    err = capfd.readouterr().err
    logged = [line for line in err.splitlines() if line.startswith("distlinalg r")]
    starts = [line for line in logged if "start #" in line]
    lines = [line for line in logged if "start #" not in line]
    assert len(lines) == 2 and len(starts) == 2, err
    assert "allreduce" in starts[0] and "count=5" in starts[0] and "count=3" in starts[1]
    assert f"r{comm.Get_rank()} " in lines[0] and "allreduce" in lines[0]
    assert "float32" in lines[0] and "count=5" in lines[0] and " us" in lines[0]
    assert "float64" in lines[1] and "count=3" in lines[1]


def test_mismatched_shapes_are_reported_on_every_rank(comm, rank, size, signature_checks):
    if size == 1:
        # Nothing can mismatch; the check itself must still pass through.
        np.testing.assert_allclose(allreduce(jnp.ones(3), comm=comm), np.ones(3))
        return
    x = jnp.ones(3 + (rank == size - 1))  # the last rank's array is longer
    with pytest.raises(Exception, match="mismatched communication across ranks") as info:
        allreduce(x, comm=comm).block_until_ready()
    message = str(info.value)
    # every-call mode also compares the call order (the call's number).
    assert re.search(rf"rank {size - 1}: allreduce\(float64\[4\], op=sum\)[^\n]*<-- differs", message), message
    assert re.search(r"rank 0: allreduce\(float64\[3\], op=sum\)( as call #\d+)?\n", message), message
    # Ranks are still in step afterwards.
    np.testing.assert_allclose(allreduce(jnp.ones(2), comm=comm), np.full(2, size))


def test_mismatched_dtypes_are_reported(comm, rank, size, signature_checks):
    if size == 1:
        np.testing.assert_allclose(allreduce(jnp.ones(3, jnp.float32), comm=comm), np.ones(3))
        return
    x = jnp.ones(3, jnp.float32 if rank == 0 else jnp.float64)
    with pytest.raises(Exception, match="mismatched communication(.|\n)*float32(.|\n)*float64"):
        jax.jit(lambda a: allreduce(a, comm=comm))(x).block_until_ready()


@pytest.mark.parametrize("op", ["sum", "prod", "min", "max"])
def test_chunked_reductions_match(comm, rank, op, small_max_count):
    # 7 elements per MPI call: 45 elements take 7 calls, the last partial.
    x = np.random.default_rng(rank).uniform(0.5, 1.5, size=(5, 9))
    out = allreduce(jnp.asarray(x), op, comm=comm)
    ref = {"sum": np.sum, "prod": np.prod, "min": np.min, "max": np.max}[op](gather_global(x, comm), axis=0)
    np.testing.assert_allclose(out, ref, rtol=1e-13)


def test_derived_datatype_paths_for_data_movement(comm, rank, size, small_max_count):
    """Blocks above the per-call cap travel as one derived-datatype item."""
    from distlinalg import comm as C

    x = jnp.asarray(np.arange(23.0) + 100 * rank)  # 23 = 3 * 7 + 2: nested type + tail
    G = gather_global(x, comm)
    blocks = jnp.asarray((np.arange(size * 23.0) + 1000 * rank).reshape(size, 23))
    B = gather_global(blocks, comm)
    np.testing.assert_array_equal(C.bcast(x, root=size - 1, comm=comm), G[-1])
    np.testing.assert_array_equal(C.allgather(x, comm=comm), G)
    np.testing.assert_array_equal(C.gather(x, root=0, comm=comm), G if rank == 0 else 0 * G)
    np.testing.assert_array_equal(C.scatter(blocks, root=0, comm=comm), B[0][rank])
    np.testing.assert_array_equal(C.alltoall(blocks, comm=comm), B[:, rank])
    np.testing.assert_array_equal(C.reduce_scatter(blocks, comm=comm), B[:, rank].sum(0))
    np.testing.assert_array_equal(C.scan(x, comm=comm), G[: rank + 1].sum(0))
    np.testing.assert_array_equal(C.reduce(x, "max", root=0, comm=comm), G.max(0) if rank == 0 else 0 * G[0])
    got = C.sendrecv(x, x, (rank - 1) % size, (rank + 1) % size, comm=comm)
    np.testing.assert_array_equal(got, G[(rank - 1) % size])


def test_mismatched_point_to_point_is_reported(comm, rank, size, signature_checks):
    from distlinalg import comm as C

    if size == 1:
        np.testing.assert_array_equal(C.sendrecv(jnp.ones(2), jnp.ones(2), 0, 0, comm=comm), np.ones(2))
        return
    # Each rank sends rank+2 elements to the right but expects 2 from the left.
    send = jnp.ones(rank + 2)
    with pytest.raises(Exception, match="sendrecv has mismatched buffers"):
        C.sendrecv(send, jnp.ones(2), (rank - 1) % size, (rank + 1) % size, comm=comm).block_until_ready()
    np.testing.assert_allclose(allreduce(jnp.ones(1), comm=comm), [size])
