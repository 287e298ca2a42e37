"""Buffers of more than 2**31-1 elements (MPI's int counts), for real.

Each rank holds about 2 GiB per buffer, so this runs on exactly 2 ranks (the
oversubscribed 3-rank run would need ~20 GiB). The chunking and derived
datatype paths are also exercised on small buffers in test_diagnostics.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distlinalg.comm import allreduce

BIG = 2**31 + 10


@pytest.fixture
def two_ranks(size):
    if size != 2:
        pytest.skip("large-count test runs on exactly 2 ranks (memory)")


def test_allreduce_beyond_int_max(comm, rank, two_ranks):
    x = jnp.full(BIG, rank + 1, jnp.int8)
    out = np.asarray(jax.jit(lambda a: allreduce(a, comm=comm))(x))
    assert out.shape == (BIG,)
    # Spot checks at chunk boundaries, then everything.
    for index in (0, 2**31 - 2, 2**31 - 1, 2**31, BIG - 1):
        assert out[index] == 3, index
    assert (out == 3).all()


def test_bcast_beyond_int_max(comm, rank, two_ranks):
    from distlinalg.comm import bcast

    x = jnp.full(BIG, 7 if rank == 1 else 0, jnp.uint8)
    out = np.asarray(jax.jit(lambda a: bcast(a, root=1, comm=comm))(x))
    assert out.shape == (BIG,) and out[0] == 7 and out[BIG - 1] == 7 and (out == 7).all()
