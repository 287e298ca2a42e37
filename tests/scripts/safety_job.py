"""Jobs that fail, hang or run long on purpose, for tests/runtime/test_safety_runtime.py.

    mpiexec -n P python tests/scripts/safety_job.py MODE

MODE: raise (rank 1 raises ValueError), exit (rank 1 calls sys.exit(3)),
recv (rank 1 receives a message nobody sends), barrier (the last rank never
reaches the barrier), loop (a long jitted loop of allreduces, to be
interrupted), sleep (a long time.sleep, to be interrupted), deadlock and
deadlock-jit (ranks 0 and 1 both receive from each other first, eagerly or
in a jitted program), threads and threads-jit (two threads call 50 allreduces
each on one communicator, eagerly, or one of them in jitted programs; each
rank prints what its threads saw and exits), ok (a clean run).
Every rank prints "ready" once it has made its first collective call.
SAFETY_THREAD_LEVEL=serialized runs MPI at that thread level.
"""

from __future__ import annotations

import os
import sys
import time

import mpi4py

mpi4py.rc.thread_level = os.environ.get("SAFETY_THREAD_LEVEL", "multiple")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from mpi4py import MPI  # noqa: E402

import distlinalg as dl  # noqa: E402
from distlinalg import comm as C  # noqa: E402


def fail_on_rank_one() -> None:
    if dl.rank() == 1:
        raise ValueError("rank one fails on purpose")


def exit_on_rank_one() -> None:
    if dl.rank() == 1:
        sys.exit(3)


def receive_what_nobody_sends() -> None:
    if dl.rank() == 1:
        C.recv(jnp.zeros(3), source=0, tag=5).block_until_ready()
    time.sleep(60)  # the other ranks are alive but never send


def receive_from_each_other_first(compiled: bool) -> None:
    """Ranks 0 and 1 each wait for the other's message before sending theirs."""
    if dl.rank() > 1:
        time.sleep(60)
        return
    other = 1 - dl.rank()

    def exchange(x):
        got = C.recv(jnp.zeros(3), source=other, tag=9)
        C.send(x, dest=other, tag=9)
        return got

    (jax.jit(exchange) if compiled else exchange)(jnp.ones(3)).block_until_ready()


def barrier_without_the_last_rank() -> None:
    if dl.rank() != dl.size() - 1:
        C.barrier()
    time.sleep(60)


def compile_allreduce_loop():
    """Compiled before "ready" is printed, so an interrupt lands inside the loop, not the compiler."""
    loop = jax.jit(lambda x: jax.lax.fori_loop(0, 10**8, lambda i, v: C.allreduce(v) / dl.size(), x))
    compiled = loop.lower(jnp.ones(4)).compile()

    def long_allreduce_loop() -> None:
        compiled(jnp.ones(4)).block_until_ready()

    return long_allreduce_loop


def two_threads_on_one_communicator(compiled: bool) -> None:
    """Two threads, one communicator: each sums its own value 50 times. Prints, per rank, the
    errors the threads raised and how many results were wrong, then ends the process (a thread
    whose partner raised may wait for ever)."""
    import threading

    size = dl.size()
    errors, wrong = [], [0]
    step = jax.jit(lambda x: C.allreduce(x))

    def worker(k: int, jitted: bool) -> None:
        try:
            for _ in range(50):
                x = jnp.full(4, float(k))
                y = step(x) if jitted else C.allreduce(x)
                if not bool((y == k * size).all()):
                    wrong[0] += 1
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(str(error).splitlines()[0])

    threads = [threading.Thread(target=worker, args=(k, compiled and k == 2), daemon=True) for k in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    for message in errors:
        print(f"rank {dl.rank()} thread error: {message}", flush=True)
    print(f"rank {dl.rank()} wrong {wrong[0]} errors {len(errors)}", flush=True)
    os._exit(3 if errors else 0)


def threads_on_one_communicator_every_rank_comes_back(stagger: bool) -> None:
    """The probe's repro (issue 57): two threads per rank, each a loop of 300 allreduces on one
    shared communicator (one thread's loop jitted, the other's eager). A rank that sees the threads overlap refuses its later calls; a
    thread of another rank then waits for partners that never come, unless the refusal reaches
    it. With `stagger`, the ranks other than 0 run their threads one after the other (they see
    no overlap themselves). Prints, per rank, the threads still alive after 20 s and the
    threads' errors, then ends the process (the refused operations stay pending in MPI)."""
    import threading

    shared = MPI.COMM_WORLD.Dup()
    loop = jax.jit(lambda y: jax.lax.fori_loop(0, 300, lambda i, y: C.allreduce(y, comm=shared) / dl.size(), y))
    loop(jnp.ones(4)).block_until_ready()
    MPI.COMM_WORLD.Barrier()
    errors: list[str] = []

    def worker(k: int) -> None:
        try:
            if k == 1:
                loop(jnp.full(4, float(k))).block_until_ready()
            else:  # the same loop run eagerly: the two threads' calls overlap for sure
                y = jnp.full(4, float(k))
                for _ in range(300):
                    y = C.allreduce(y, comm=shared) / dl.size()
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(str(error).splitlines()[0])

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in (1, 2)]
    start = time.monotonic()
    if stagger and dl.rank() != 0:
        for t in threads:
            t.start()
            t.join(20)
    else:
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
    alive = sum(t.is_alive() for t in threads)
    for message in errors:
        print(f"rank {dl.rank()} thread error: {message}", flush=True)
    print(f"rank {dl.rank()} alive {alive} errors {len(errors)} seconds {time.monotonic() - start:.1f}", flush=True)
    MPI.COMM_WORLD.Barrier()  # every rank has printed (on the world, not the refused communicator)
    os._exit(0)


def main(mode: str) -> None:
    C.allreduce(jnp.ones(1)).block_until_ready()  # every rank is up and talking
    run = {
        "raise": fail_on_rank_one,
        "exit": exit_on_rank_one,
        "sleep": lambda: time.sleep(60),
        "recv": receive_what_nobody_sends,
        "barrier": barrier_without_the_last_rank,
        "deadlock": lambda: receive_from_each_other_first(False),
        "deadlock-jit": lambda: receive_from_each_other_first(True),
        "threads": lambda: two_threads_on_one_communicator(False),
        "threads-jit": lambda: two_threads_on_one_communicator(True),
        "threads-loop": lambda: threads_on_one_communicator_every_rank_comes_back(False),
        "threads-loop-stagger": lambda: threads_on_one_communicator_every_rank_comes_back(True),
        "loop": None,
        "ok": lambda: None,
    }[mode] or compile_allreduce_loop()
    print(f"ready {dl.rank()}", flush=True)
    run()
    C.barrier()
    print(f"done {dl.rank()}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
