"""Allreduce bandwidth on JAX's default device (a GPU where JAX has one), 8 B to 256 MiB.

    mpiexec -n 2 python benchmarks/bench_gpu.py [--quick] [--output FILE.json]

For each message size, in the same run and interleaved:
  - distlinalg: ``distlinalg.comm.allreduce`` inside a jitted fori_loop on
    device arrays (the transport that ``python -m distlinalg`` reports:
    host-staged or CUDA-aware);
  - mpi4py-host: ``MPI.Allreduce`` on numpy host buffers, i.e. the network
    part alone (the floor that host staging adds its copies to);
  - mpi4py-roundtrip: what a user would do without distlinalg, device to
    host, ``MPI.Allreduce``, host to device.
Prints a markdown table (time per call, bus bandwidth 2(P-1)/P·bytes/time,
ratio to mpi4py-host) from rank 0 and writes JSON with ``--output``.
Ranks may share one GPU (as on the lent single-GPU machine).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _util import alternate, calibrate, machine_info, timed_once, write_json  # noqa: E402

SIZES = [8, 64, 512, 4 << 10, 32 << 10, 256 << 10, 2 << 20, 16 << 20, 64 << 20, 256 << 20]
QUICK_SIZES = [8, 4 << 10, 256 << 10, 16 << 20]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.2, help="target length of one timed run")
    parser.add_argument("--output")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from mpi4py import MPI

    import distlinalg
    from distlinalg import _cuda

    comm = MPI.COMM_WORLD
    size = comm.Get_size()
    device = jax.devices()[0]
    loop = jax.jit(
        lambda v, count: jax.lax.fori_loop(0, count, lambda i, u: distlinalg.comm.allreduce(u) * 0.5, v),
        donate_argnums=0,
    )

    rows = []
    for nbytes in QUICK_SIZES if args.quick else SIZES:
        n = max(1, nbytes // 4)
        state = {"x": jnp.ones(n, jnp.float32)}
        host_in, host_out = np.ones(n, np.float32), np.empty(n, np.float32)

        def run_distlinalg(count):
            state["x"] = loop(state["x"], jnp.int32(count))
            state["x"].block_until_ready()

        def run_host(count):
            for _ in range(count):
                comm.Allreduce(host_in, host_out, op=MPI.SUM)

        def run_roundtrip(count):
            x = state["x"]
            for _ in range(count):
                comm.Allreduce(np.array(x), host_out, op=MPI.SUM)  # a copy: on the CPU device_put may alias host_out
                x = jax.device_put(host_out, device)
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
        rows.append({"bytes": nbytes, **{f"{k}_s": v for k, v in per_call.items()}})

    if comm.Get_rank() == 0:
        bus = 2 * (size - 1) / size if size > 1 else 1.0
        print(f"allreduce float32 on {device.platform} ({device.device_kind}), {size} ranks; "
              f"transport: {_cuda.STATE.get('transport')}; device: {_cuda.STATE.get('device')}")
        print("| bytes | distlinalg µs | GB/s (bus) | mpi4py host µs | mpi4py round trip µs | distlinalg / host |")
        print("|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            d, h, t = r["distlinalg_s"], r["mpi4py-host_s"], r["mpi4py-roundtrip_s"]
            print(f"| {r['bytes']} | {d * 1e6:.1f} | {bus * r['bytes'] / d / 1e9:.2f} | {h * 1e6:.1f} | "
                  f"{t * 1e6:.1f} | {d / h:.2f} |")
        write_json(args.output, {
            "benchmark": "gpu_allreduce", "platform": device.platform, "device_kind": device.device_kind,
            "ranks": size, "transport": _cuda.STATE.get("transport"), "machine": machine_info(), "rows": rows,
        }) if args.output else None


if __name__ == "__main__":
    main()
