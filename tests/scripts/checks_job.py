"""Jobs in which one rank blocks where the others can never meet it, for tests/runtime/test_checks.py.

    mpiexec -n P python tests/scripts/checks_job.py MODE

MODE: new-shape-on-one-rank (a compiled program already checked reruns on
every rank but rank 1, which calls it with a new shape), extra-call (rank 1
makes one more eager call after the others have finished), while-trip-count
(a while loop whose trip count depends on the rank, a collective inside).
With the default checks each job ends with an error naming what every rank
does; none may hang. Valid programs that must end cleanly: late-rank (rank 0
works on after the last collective while the others reach the end),
unread-result (a jitted collective whose result some ranks never read).
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
# Valid programs that must end cleanly (exit code 0):
elif mode == "late-rank":
    # Rank 0 works on for 4 s after the last collective while the others
    # wait in the end-of-program check: they meet there, no mismatch.
    allreduce(jnp.ones(2)).block_until_ready()
    if rank == 0:
        import time

        time.sleep(4)
elif mode == "unread-result":
    # A jitted collective whose result only rank 0 reads: on the other ranks
    # it is still queued at exit, and must run before the end-of-program check.
    f = jax.jit(lambda x: allreduce(jnp.sin(x) @ jnp.cos(x.T)))
    result = f(jnp.ones((300, 300)))
    if rank == 0:
        print(float(result.sum()), flush=True)
else:
    raise SystemExit(f"unknown mode {mode!r}")
print(f"rank {rank} finished", flush=True)
