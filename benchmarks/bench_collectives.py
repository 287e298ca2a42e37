"""Collective latency vs message size, distlinalg against its peers in one run.

    mpiexec -n 2 python benchmarks/bench_collectives.py \
        [--contenders distlinalg-jit distlinalg-eager mpi4py] [--sizes 8 65536 1048576] \
        [--ops allreduce allgather bcast alltoall sendrecv] [--repeats 3] [--target 0.05] [--json FILE]
    mpiexec -n 2 python benchmarks/bench_collectives.py --check [--repeats 7] [--output FILE] [--json FILE]

Contenders (any subset; mpi4py is always measured too, as the reference of the run):
  distlinalg-jit    a jitted ``lax.fori_loop`` of calls (trip count a runtime argument;
                    the buffer donated and fed back, so no copy or allocation per run);
                    per-call time = total / count
  distlinalg-eager  a Python loop of un-jitted calls (after the first call)
  jax-eager-floor   no communication: a jitted negation of the same buffer, called
                    eagerly and blocked on (the cheapest eager JAX operation)
  jax-eager-add     no communication: ``x + 0`` un-jitted, blocked on once after the
                    loop as distlinalg-eager is (the floor --check reports)
  mpi4py            uppercase methods on numpy buffers (Allreduce, Allgather, Bcast,
                    Alltoall, Sendrecv)
  mpi4jax           (peers venv) a jitted fori_loop of mpi4jax calls
  jax-gloo          JAX's own multi-process collectives: ``jax.distributed.initialize``
                    with the gloo CPU collectives, a ``shard_map`` over a mesh of the
                    processes' devices and a fori_loop of ``psum`` / ``all_gather`` /
                    ``all_to_all`` / ``ppermute`` (no broadcast collective: n/a)

Message size = bytes of each rank's send buffer, float64 (8 B = one element).
allgather: each rank contributes that many bytes (receives size× as much);
alltoall: the buffer is split in `size` equal blocks (at least one element each);
sendrecv: a ring shift (send to rank+1, receive from rank−1).
jit loops carry what mpi4py's loop reuses: allreduce and bcast work in place
on one buffer; allgather, alltoall and sendrecv carry a send buffer x and a
receive buffer y (y = op(x)), so XLA neither copies nor allocates per call.
Every (op, size) is timed `repeats` times, the contenders interleaved; each
sample runs enough calls to last about `target` seconds (calibrated per
contender, the count agreed across ranks) and the slowest rank's time counts.

--check: allreduce against mpi4py with the issue's targets (ratio distlinalg / mpi4py
in brackets), each case at a fixed call count instead of a calibrated one, timed
`repeats` times (default 7) alternating the contenders; the median per call, a
markdown table on stdout (appended to --output FILE):
  * in-jit allreduce of 1 float64: a fori_loop of 10^4 calls vs a Python loop of
    10^4 ``comm.Allreduce`` on numpy arrays                          [<= 1.0]
  * in-jit allreduce of 2^20 float64 (8 MiB): a fori_loop of 20 calls   [<= 1.05]
  * eager (un-jitted) allreduce of 1 float64, after the first call, 2000 calls
    [<= 3.0], next to the cost of one eager JAX op (``x + 0``, jax-eager-add),
    the floor of any eager path that returns a jax.Array
"""

from __future__ import annotations

import argparse
import importlib
import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mpi4py import MPI  # noqa: E402

import _util  # noqa: E402

OPS = ("allreduce", "allgather", "bcast", "alltoall", "sendrecv")
QUICK_SIZES = (8, 64 * 1024, 1 << 20)
FULL_SIZES = tuple(8 ** k for k in range(1, 9)) + (64 << 20,)  # 8 B, 64 B, ..., 16 MiB, 64 MiB


def elements(op: str, nbytes: int, size: int) -> int:
    n = max(1, nbytes // 8)
    if op == "alltoall":
        n = max(size, (n + size - 1) // size * size)
    return n


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------
# Contenders: each maker returns run(count) -> None that performs `count`
# calls of `op` on an n-element float64 buffer and blocks until done.

def make_mpi4py(op, n, comm):
    import numpy as np

    rank, size = comm.Get_rank(), comm.Get_size()
    x = np.ones(n)
    if op == "allreduce":
        y = np.empty_like(x)
        call = lambda: comm.Allreduce(x, y)  # noqa: E731
    elif op == "allgather":
        y = np.empty((size, n))
        call = lambda: comm.Allgather(x, y)  # noqa: E731
    elif op == "bcast":
        call = lambda: comm.Bcast(x, root=0)  # noqa: E731
    elif op == "alltoall":
        y = np.empty_like(x)
        call = lambda: comm.Alltoall(x, y)  # noqa: E731
    elif op == "sendrecv":
        y = np.empty_like(x)
        dest, source = (rank + 1) % size, (rank - 1) % size
        call = lambda: comm.Sendrecv(x, dest, recvbuf=y, source=source)  # noqa: E731

    def run(count):
        for _ in range(count):
            call()

    return run


def _jit_body(op, rank, size, ops):
    """fori_loop body for a collective library exposing allreduce/allgather/bcast/alltoall/sendrecv.

    The carry is what mpi4py's loop reuses: one buffer for the in-place
    operations (allreduce, bcast), a send buffer x and a receive buffer y for
    allgather, alltoall and sendrecv (y = op(x), as ``comm.Alltoall(x, y)``
    writes y; sendrecv also takes y as its template).
    Writing ``v = alltoall(v)`` instead would make XLA copy the result into the
    carry's buffer on every call, a copy mpi4py's program does not have.
    """

    def body(i, carry):
        if op == "allreduce":
            return ops["allreduce"](carry)
        if op == "bcast":
            return ops["bcast"](carry)
        x, y = carry
        if op == "allgather":
            return x, ops["allgather"](x)
        if op == "alltoall":
            return x, ops["alltoall"](x.reshape(size, -1)).reshape(-1)
        if op == "sendrecv":
            return x, ops["sendrecv"](x, y)
        raise ValueError(op)

    return body


def _jit_runner(op, body, n, size):
    import jax
    import jax.numpy as jnp

    # The buffers are donated and the result fed back: no copy into the loop carry and no fresh
    # output allocation per timed run (numpy's buffers are reused too), which would otherwise
    # dominate a run of one or two 64 MiB calls.
    loop = jax.jit(lambda v, count: jax.lax.fori_loop(0, count, body, v), donate_argnums=0)
    if op in ("alltoall", "sendrecv"):
        state = {"x": (jnp.ones(n), jnp.zeros(n))}
    elif op == "allgather":
        state = {"x": (jnp.ones(n), jnp.zeros((size, n)))}
    else:
        state = {"x": jnp.ones(n)}

    def run(count):
        state["x"] = loop(state["x"], jnp.int32(count))
        jax.block_until_ready(state["x"])

    return run


def distlinalg_ops(rank, size):
    from distlinalg.comm import allgather, allreduce, alltoall, bcast, sendrecv

    dest, source = (rank + 1) % size, (rank - 1) % size
    return {
        "allreduce": allreduce,
        "allgather": allgather,
        "bcast": lambda v: bcast(v, root=0),
        "alltoall": alltoall,
        "sendrecv": lambda x, y: sendrecv(x, y, source, dest),
    }


def make_distlinalg_jit(op, n, comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    return _jit_runner(op, _jit_body(op, rank, size, distlinalg_ops(rank, size)), n, size)


def make_distlinalg_eager(op, n, comm):
    import jax.numpy as jnp

    rank, size = comm.Get_rank(), comm.Get_size()
    f = distlinalg_ops(rank, size)[op]
    x = jnp.ones((size, n // size)) if op == "alltoall" else jnp.ones(n)
    args = (x, jnp.zeros(n)) if op == "sendrecv" else (x,)

    def run(count):
        out = None
        for _ in range(count):
            out = f(*args)
        out.block_until_ready()

    return run


def make_jax_eager_floor(op, n, comm):
    """The cheapest eager JAX computation on the same buffer: a jitted negation
    (JAX's C++ dispatch path), blocked on per call as distlinalg's eager calls are.
    The floor any eager operation returning a jax.Array pays; no communication."""
    import jax
    import jax.numpy as jnp

    negate = jax.jit(jnp.negative)
    x = jnp.ones(n)

    def run(count):
        for _ in range(count):
            negate(x).block_until_ready()

    return run


def mpi4jax_ops(rank, size, comm):
    import mpi4jax

    dest, source = (rank + 1) % size, (rank - 1) % size

    def strip(out):  # mpi4jax < 0.5 returned (result, token)
        return out[0] if isinstance(out, tuple) else out

    return {
        "allreduce": lambda v: strip(mpi4jax.allreduce(v, op=MPI.SUM, comm=comm)),
        "allgather": lambda v: strip(mpi4jax.allgather(v, comm=comm)),
        "bcast": lambda v: strip(mpi4jax.bcast(v, root=0, comm=comm)),
        "alltoall": lambda v: strip(mpi4jax.alltoall(v, comm=comm)),
        "sendrecv": lambda x, y: strip(mpi4jax.sendrecv(x, y, source=source, dest=dest, comm=comm)),
    }


def make_mpi4jax(op, n, comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    return _jit_runner(op, _jit_body(op, rank, size, mpi4jax_ops(rank, size, comm)), n, size)


def init_jax_gloo(comm):
    import jax

    port = comm.bcast(free_port() if comm.Get_rank() == 0 else None, root=0)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=comm.Get_size(),
                               process_id=comm.Get_rank(), initialization_timeout=120)
    if jax.device_count() != comm.Get_size():
        raise RuntimeError(f"jax sees {jax.device_count()} devices for {comm.Get_size()} processes")


def make_jax_gloo(op, n, comm):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    size = comm.Get_size()
    if op == "bcast":
        return None  # no broadcast collective in JAX
    mesh = jax.make_mesh((size,), ("x",), devices=jax.devices())
    perm = [(i, (i + 1) % size) for i in range(size)]

    def body(i, v):
        if op == "allreduce":
            return jax.lax.psum(v, "x")
        if op == "allgather":
            return v.at[0].set(jax.lax.all_gather(v, "x")[-1, 0])
        if op == "alltoall":
            return jax.lax.all_to_all(v.reshape(size, -1), "x", 0, 0).reshape(-1)
        if op == "sendrecv":
            return jax.lax.ppermute(v, "x", perm)
        raise ValueError(op)

    looped = jax.shard_map(lambda v, count: jax.lax.fori_loop(0, count, body, v), mesh=mesh,
                           in_specs=(P("x"), P()), out_specs=P("x"), check_vma=False)
    loop = jax.jit(looped, donate_argnums=0)  # buffer donated and fed back, as in _jit_runner
    sharding = NamedSharding(mesh, P("x"))
    local = jax.device_put(jnp.ones(n), jax.local_devices()[0])
    state = {"x": jax.make_array_from_single_device_arrays((size * n,), sharding, [local])}

    def run(count):
        state["x"] = loop(state["x"], jnp.int32(count))
        state["x"].block_until_ready()

    return run


def make_jax_eager_add(op, n, comm):
    """``x + 0`` un-jitted on the same buffer, blocked on once after the loop (as
    distlinalg-eager is): one eager JAX op, the floor --check reports; no communication."""
    import jax.numpy as jnp

    x = jnp.ones(n)

    def run(count):
        out = x
        for _ in range(count):
            out = x + 0
        out.block_until_ready()

    return run


MAKERS = {
    "mpi4py": make_mpi4py,
    "distlinalg-jit": make_distlinalg_jit,
    "distlinalg-eager": make_distlinalg_eager,
    "jax-eager-floor": make_jax_eager_floor,
    "jax-eager-add": make_jax_eager_add,
    "mpi4jax": make_mpi4jax,
    "jax-gloo": make_jax_gloo,
}


# --check: allreduce against mpi4py at fixed call counts, with the targets:
# (case, contender, message bytes, calls per timed sample, target ratio to mpi4py).
CHECK_CASES = (
    ("in-jit allreduce, 1 float64 (fori_loop of 10^4)", "distlinalg-jit", 8, 10_000, 1.0),
    ("in-jit allreduce, 2^20 float64 (fori_loop of 20)", "distlinalg-jit", 8 << 20, 20, 1.05),
    ("eager allreduce, 1 float64 (after the first call)", "distlinalg-eager", 8, 2_000, 3.0),
)
CHECK_FLOOR = "jax-eager-add"  # timed next to the eager case


def run_check(comm, repeats: int) -> list[dict]:
    """Time CHECK_CASES: per case the contender, mpi4py (and for the eager case the eager JAX
    floor), each warmed up with one run of the case's calls, then timed `repeats` times
    interleaved; per-call medians (the slowest rank's time)."""
    size = comm.Get_size()
    rows = []
    for case, contender, nbytes, calls, target in CHECK_CASES:
        n = elements("allreduce", nbytes, size)
        names = [contender, "mpi4py"] + ([CHECK_FLOOR] if contender == "distlinalg-eager" else [])
        runners = {name: MAKERS[name]("allreduce", n, comm) for name in names}
        for run in runners.values():
            run(calls)  # compile / first call
        samples = {name: [] for name in runners}
        for _ in range(repeats):
            for name, run in runners.items():
                samples[name].append(_util.timed_once(lambda r=run: r(calls), comm) / calls)
        medians = {name: _util.median(vals) for name, vals in samples.items()}
        rows.append({"case": case, "contender": contender, "bytes": nbytes, "calls": calls, "target": target,
                     "seconds": medians[contender], "mpi4py_seconds": medians["mpi4py"],
                     "floor_seconds": medians.get(CHECK_FLOOR), "samples": samples})
    return rows


def check_markdown(rows: list[dict], size: int) -> str:
    """The check's table: per case distlinalg and mpi4py per call, the ratio and its target
    (ok / MISSED), then the eager case in units of the eager JAX floor."""
    import jax

    lines = [
        f"### allreduce vs mpi4py `Allreduce` on numpy, {size} ranks "
        f"(jax {jax.__version__}, {MPI.Get_library_version().splitlines()[0].strip()})",
        "",
        "| case | distlinalg per call | mpi4py per call | ratio | target |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        ours, theirs, target = r["seconds"], r["mpi4py_seconds"], r["target"]
        ratio = ours / theirs
        mark = "ok" if ratio <= target else "MISSED"
        lines.append(f"| {r['case']} | {ours * 1e6:.2f} µs | {theirs * 1e6:.2f} µs | {ratio:.2f} | ≤ {target} ({mark}) |")
    eager = next(r for r in rows if r["floor_seconds"] is not None)
    floor = eager["floor_seconds"]
    lines += [
        "",
        f"For scale: one eager JAX op (`x + 0` on the same 1-element array) costs "
        f"{floor * 1e6:.2f} µs here ({floor / eager['mpi4py_seconds']:.1f}x mpi4py's allreduce): "
        f"the eager allreduce costs {eager['seconds'] / floor:.2f} eager JAX ops.",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contenders", nargs="+", default=["distlinalg-jit", "distlinalg-eager", "mpi4py"],
                        choices=list(MAKERS))
    parser.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    parser.add_argument("--sizes", nargs="+", type=int, help="message sizes in bytes (default: 8 B .. 64 MiB)")
    parser.add_argument("--quick", action="store_true", help="sizes 8 B, 64 KiB, 1 MiB")
    parser.add_argument("--repeats", type=int, help="timed samples per size (default 3; 7 with --check)")
    parser.add_argument("--target", type=float, default=0.05, help="seconds per timed sample")
    parser.add_argument("--json", help="write results here (rank 0)")
    parser.add_argument("--check", action="store_true",
                        help="only the allreduce cases with the issue's targets, at fixed call counts (see above)")
    parser.add_argument("--output", help="with --check: append its markdown table to this file")
    args = parser.parse_args()
    if args.repeats is None:
        args.repeats = 7 if args.check else 3
    if args.check:
        check_main(args)
        return
    sizes = args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES)
    contenders = ["mpi4py"] + [c for c in args.contenders if c != "mpi4py"]

    comm = MPI.COMM_WORLD.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    skipped: dict[str, str] = {}
    if "jax-gloo" in contenders:  # before anything touches a JAX backend
        try:
            init_jax_gloo(comm)
        except Exception as exc:  # noqa: BLE001
            skipped["jax-gloo"] = f"jax.distributed/gloo initialisation failed: {type(exc).__name__}: {exc}"
    import jax

    jax.config.update("jax_enable_x64", True)
    for name in contenders:
        if name in skipped:
            continue
        try:
            if name.startswith("distlinalg"):
                importlib.import_module("distlinalg")
            elif name == "mpi4jax":
                importlib.import_module("mpi4jax")
        except Exception as exc:  # noqa: BLE001
            skipped[name] = f"import failed: {type(exc).__name__}: {exc}"
    # Every rank must agree on who runs.
    for other in comm.allgather(skipped):
        skipped.update(other)
    active = [c for c in contenders if c not in skipped]

    results: dict[str, dict[str, dict[str, float]]] = {c: {op: {} for op in args.ops} for c in active}
    minima: dict[str, dict[str, dict[str, float]]] = {c: {op: {} for op in args.ops} for c in active}
    errors: dict[str, str] = {}
    t_start = time.perf_counter()
    for op in args.ops:
        for nbytes in sizes:
            n = elements(op, nbytes, size)
            runners = {}
            for name in active:
                try:
                    runner = MAKERS[name](op, n, comm)
                    if runner is None:
                        continue
                    runner(2)  # compile / first call
                    count = _util.calibrate(runner, args.target, comm)
                    runners[name] = (runner, count)
                except Exception as exc:  # noqa: BLE001
                    errors[f"{name}/{op}"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            samples = {name: [] for name in runners}
            for _ in range(args.repeats):
                for name, (runner, count) in runners.items():
                    samples[name].append(_util.timed_once(lambda r=runner, c=count: r(c), comm) / count)
            for name, vals in samples.items():
                results[name][op][str(nbytes)] = _util.median(vals)
                minima[name][op][str(nbytes)] = min(vals)
            if rank == 0:
                line = "  ".join(f"{k}={v * 1e6:.1f}us" for k, v in
                                 ((k, results[k][op][str(nbytes)]) for k in samples))
                _util.eprint(f"[collectives n={size}] {op} {nbytes} B: {line}")
            del runners
    payload = {
        "bench": "collectives",
        "ranks": size,
        "sizes": list(sizes),
        "ops": list(args.ops),
        "contenders": active,
        "results": results,
        "minima": minima,
        "skipped": skipped,
        "errors": errors,
        "repeats": args.repeats,
        "target_seconds": args.target,
        "seconds": time.perf_counter() - t_start,
        "versions": _util.versions(),
        "mpi": MPI.Get_library_version().splitlines()[0].strip(),
        "oversubscribed": size > (os.cpu_count() or 1),
    }
    if rank == 0:
        _util.write_json(args.json, payload)
    comm.Barrier()
    if "jax-gloo" in active:
        jax.distributed.shutdown()


def check_main(args) -> None:
    """--check: run_check, its table printed (and appended to --output) and its JSON, by rank 0."""
    import jax

    jax.config.update("jax_enable_x64", True)
    importlib.import_module("distlinalg")  # fails loudly: every case is distlinalg's

    comm = MPI.COMM_WORLD.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    t_start = time.perf_counter()
    rows = run_check(comm, args.repeats)
    if rank == 0:
        text = check_markdown(rows, size)
        print(text)
        if args.output:
            with open(args.output, "a") as f:
                f.write(text + "\n\n")
        if args.json:
            _util.write_json(args.json, {
                "bench": "collectives-check", "ranks": size, "cases": rows, "repeats": args.repeats,
                "seconds": time.perf_counter() - t_start, "versions": _util.versions(),
                "mpi": MPI.Get_library_version().splitlines()[0].strip(),
                "oversubscribed": size > (os.cpu_count() or 1)})
    comm.Barrier()
    comm.Free()


if __name__ == "__main__":
    main()
