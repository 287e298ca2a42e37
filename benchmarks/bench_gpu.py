"""Collective bandwidth on JAX's default device (a GPU where JAX has one) against the copy limit.

    mpiexec -n 2 python benchmarks/bench_gpu.py [--ops allreduce allgather sendrecv] [--quick]
        [--output FILE.json]

For each operation and message size (bytes per rank, 8 B to 256 MiB), in the
same run and interleaved:
  - distlinalg: the ``distlinalg.comm`` operation inside a jitted fori_loop on
    device arrays (the transport that ``python -m distlinalg`` reports:
    host-staged or CUDA-aware);
  - mpi4py-host: the same MPI call on numpy host buffers, i.e. the network
    part alone (the floor that host staging adds its copies to);
  - mpi4py-roundtrip: what a user would do without distlinalg: device to
    host, the MPI call, host to device.
and, once per size, the device→host and host→device copy bandwidth of one
buffer (``np.asarray`` of a device array; ``jax.device_put`` of a numpy
array): host staging moves the operand down and the result up, so
1 / (1/D2H + 1/H2D) bounds a host-staged call's bandwidth before any MPI cost.
Operations: allreduce (sum, bus bandwidth 2(P-1)/P·bytes/time), allgather
(bytes per rank in, P× out; bus bandwidth (P-1)·bytes/time) and sendrecv
(ring: to rank+1, from rank-1; bytes/time).
Prints a markdown table per operation from rank 0 and writes JSON with
``--output``. Ranks may share one GPU (as on the lent single-GPU machine).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _util import alternate, calibrate, machine_info, timed_once, write_json  # noqa: E402

SIZES = [8, 64, 512, 4 << 10, 32 << 10, 256 << 10, 2 << 20, 16 << 20, 64 << 20, 256 << 20]
QUICK_SIZES = [8, 4 << 10, 256 << 10, 16 << 20]
OPS = ("allreduce", "allgather", "sendrecv")


def bus_factor(op: str, size: int) -> float:
    """Bytes a rank's link carries per byte of its message (the usual 'bus bandwidth' factors)."""
    if op == "allreduce":
        return 2 * (size - 1) / size if size > 1 else 1.0
    if op == "allgather":
        return float(max(size - 1, 1))
    return 1.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--max-bytes", type=int, default=None, help="drop sizes above this")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.2, help="target length of one timed run")
    parser.add_argument("--output")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from mpi4py import MPI

    import distlinalg
    from distlinalg._runtime import cuda as _cuda

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    right, left = (rank + 1) % size, (rank - 1) % size
    device = jax.devices()[0]
    sizes = [s for s in (QUICK_SIZES if args.quick else SIZES) if args.max_bytes is None or s <= args.max_bytes]

    # One step of each operation maps a length-n float32 vector to a length-n vector, so a
    # jitted fori_loop can chain them (the scaling keeps the values bounded).
    steps = {
        "allreduce": lambda u: distlinalg.comm.allreduce(u) * (1.0 / size),
        "allgather": lambda u: distlinalg.comm.allgather(u)[rank],
        "sendrecv": lambda u: distlinalg.comm.sendrecv(u, u, source=left, dest=right),
    }

    def host_call(op, send, recv):
        if op == "allreduce":
            comm.Allreduce(send, recv, op=MPI.SUM)
        elif op == "allgather":
            comm.Allgather(send, recv)
        else:
            comm.Sendrecv(send, dest=right, recvbuf=recv, source=left)

    def copy_bandwidth(n: int) -> dict[str, float]:
        """Device→host and host→device seconds for one n-float32 buffer (median of interleaved runs)."""
        x = jnp.ones(n, jnp.float32) + 0  # a buffer XLA owns on the device
        host = np.ones(n, np.float32)
        x.block_until_ready()

        def d2h(count):
            for _ in range(count):
                np.asarray(x + 0)  # `+ 0` defeats the host-copy cache of a jax.Array
            # the add itself is a device kernel of n elements, ~2 n·4 B at device bandwidth: negligible

        def h2d(count):
            for _ in range(count):
                jax.device_put(host, device).block_until_ready()

        runners = {"d2h": d2h, "h2d": h2d}
        for run in runners.values():
            run(1)
        counts = {k: calibrate(run, args.seconds, comm) for k, run in runners.items()}
        return alternate({k: (lambda k=k: timed_once(lambda: runners[k](counts[k]), comm) / counts[k])
                          for k in runners}, args.repeats)

    tables = {}
    copies = {}
    for op in args.ops:
        step = steps[op]
        loop = jax.jit(lambda v, count, step=step: jax.lax.fori_loop(0, count, lambda i, u: step(u), v),
                       donate_argnums=0)
        rows = []
        for nbytes in sizes:
            n = max(1, nbytes // 4)
            state = {"x": jnp.ones(n, jnp.float32)}
            host_in = np.ones(n, np.float32)
            host_out = np.empty(n * size if op == "allgather" else n, np.float32)

            def run_distlinalg(count):
                state["x"] = loop(state["x"], jnp.int32(count))
                state["x"].block_until_ready()

            def run_host(count):
                for _ in range(count):
                    host_call(op, host_in, host_out)

            def run_roundtrip(count):
                x = state["x"]
                for _ in range(count):
                    host_call(op, np.array(x), host_out)  # a copy: on the CPU device_put may alias host_out
                    out = host_out[rank * n:(rank + 1) * n] if op == "allgather" else host_out
                    x = jax.device_put(out, device)
                x.block_until_ready()

            runners = {"distlinalg": run_distlinalg, "mpi4py-host": run_host, "mpi4py-roundtrip": run_roundtrip}
            for run in runners.values():
                run(1)  # compile, allocate and connect outside the measurement
            counts = {name: calibrate(run, args.seconds, comm) for name, run in runners.items()}
            per_call = alternate(
                {name: (lambda name=name: timed_once(lambda: runners[name](counts[name]), comm) / counts[name])
                 for name in runners},
                args.repeats,
            )
            if nbytes not in copies:
                copies[nbytes] = copy_bandwidth(n)
            rows.append({"bytes": nbytes, **{f"{k}_s": v for k, v in per_call.items()},
                         **{f"{k}_s": v for k, v in copies[nbytes].items()}})
        tables[op] = rows

    if rank == 0:
        print(f"{size} ranks on {device.platform} ({device.device_kind}); "
              f"transport: {_cuda.STATE.get('transport')}; device: {_cuda.STATE.get('device')}")
        for op, rows in tables.items():
            bus = bus_factor(op, size)
            print(f"\n{op} float32 (bytes per rank)")
            print("| bytes | distlinalg µs | GB/s (bus) | mpi4py host µs | mpi4py round trip µs | "
                  "distlinalg / host | D2H GB/s | H2D GB/s | staging bound GB/s |")
            print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
            for r in rows:
                d, h, t = r["distlinalg_s"], r["mpi4py-host_s"], r["mpi4py-roundtrip_s"]
                b = r["bytes"]
                bound = b / (r["d2h_s"] + r["h2d_s"]) / 1e9
                print(f"| {b} | {d * 1e6:.1f} | {bus * b / d / 1e9:.2f} | {h * 1e6:.1f} | {t * 1e6:.1f} | "
                      f"{d / h:.2f} | {b / r['d2h_s'] / 1e9:.2f} | {b / r['h2d_s'] / 1e9:.2f} | {bound:.2f} |")
        if args.output:
            write_json(args.output, {
                "benchmark": "gpu_collectives", "platform": device.platform, "device_kind": device.device_kind,
                "ranks": size, "transport": _cuda.STATE.get("transport"), "machine": machine_info(),
                "tables": tables,
            })


if __name__ == "__main__":
    main()
