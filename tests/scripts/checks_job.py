"""Jobs in which one rank blocks where the others can never meet it, for tests/test_checks.py.

    mpiexec -n P python tests/scripts/checks_job.py MODE

MODE: new-shape-on-one-rank (a compiled program already checked reruns on
every rank but rank 1, which calls it with a new shape), extra-call (rank 1
makes one more eager call after the others have finished), while-trip-count
(a while loop whose trip count depends on the rank, a collective inside).
With the default checks each job ends with an error naming what every rank
does; none may hang.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

import distlinalg as dl
from distlinalg.comm import allreduce

mode = sys.argv[1]
rank = dl.rank()

if mode == "new-shape-on-one-rank":
    f = jax.jit(lambda x: allreduce(x))
    f(jnp.ones(3, jnp.float32)).block_until_ready()
    f(jnp.ones(3 + (rank == 1), jnp.float32)).block_until_ready()
elif mode == "extra-call":
    allreduce(jnp.ones(2)).block_until_ready()
    if rank == 1:
        allreduce(jnp.ones(2)).block_until_ready()
elif mode == "while-trip-count":
    def body(state):
        k, x = state
        return k + 1, allreduce(x) / dl.size()

    loop = jax.jit(lambda n, x: jax.lax.while_loop(lambda s: s[0] < n, body, (0, x))[1])
    loop(3 + rank, jnp.ones(2)).block_until_ready()
else:
    raise SystemExit(f"unknown mode {mode!r}")
print(f"rank {rank} finished", flush=True)
