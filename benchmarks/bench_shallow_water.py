"""Shallow water (issue 67): the forward step, the gradient's cost and memory, per rank count.

    python benchmarks/bench_shallow_water.py [--ranks 1 2 4] [--grid 1800 3600] [--steps 10]
        [--mpi4jax-example PATH/TO/mpi4jax/examples/shallow_water.py]

Each row is one mpiexec job (so each peak RSS is that mode's alone), all on this machine in
one run:
  * ``ours``: examples/shallow_water on distlinalg.grid (3 fused exchanges per step);
    forward ms/step (warm, a jitted scan of --steps steps), value_and_grad / forward without
    checkpoints and with a treeverse schedule of 4 checkpoints, peak RSS per rank.
  * ``mpi4jax-file``: mpi4jax's own example file, unmodified, on distlinalg.mpi4jax (a
    one-line ``mpi4jax`` shim package), on its own 180 x 360 grid (the file fixes it):
    forward ms/step and value_and_grad / forward of the same kind of loss.
  * ``halo``: one exchange of the three state fields against mpi4py Sendrecv of the same
    bytes (the exchange's cost against what the bytes cost).
The mpi4jax file is not shipped here: pass its path (mpi4jax's repository, examples/).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
import resource
import subprocess
import sys
import tempfile
import time

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _best(fn, repeats=3):
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def worker_ours(ny: int, nx: int, steps: int, mode: str) -> dict:
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_enable_x64", True)
    sys.path.insert(0, str(ROOT / "examples" / "shallow_water"))
    import model

    grid = model.make_grid((ny, nx))
    state = jax.jit(lambda s: model.start(grid, s))(model.initial_state(grid))
    forward = jax.jit(lambda s: model.run(grid, s, steps))

    def loss(h, checkpoints):
        end = model.run(grid, state._replace(h=h), steps, checkpoints)
        return jnp.sum(end.h[grid.interior] ** 2)

    t_forward = _best(lambda: forward(state).h.block_until_ready())
    out = {"forward_ms_per_step": 1e3 * t_forward / steps, "rank_blocks": grid.dims}
    if mode == "grad":
        vg = jax.jit(jax.value_and_grad(lambda h: loss(h, None)))
        out["grad_over_forward"] = _best(lambda: vg(state.h)[1].block_until_ready()) / t_forward
    elif mode == "grad-checkpointed":
        vg = jax.jit(jax.value_and_grad(lambda h: loss(h, 4)))
        out["grad_over_forward"] = _best(lambda: vg(state.h)[1].block_until_ready()) / t_forward
    elif mode == "halo":
        import numpy as np
        from mpi4py import MPI

        fields = (state.h, state.u, state.v)
        exchange = jax.jit(grid.exchange)
        t_exchange = _best(lambda: jax.block_until_ready(exchange(fields)), repeats=20)
        # The same bytes by mpi4py: per axis and direction, the three fields' layers.
        comm = grid.comm.comm
        buffers = []
        for axis in range(2):
            layer = [1, 1]
            layer[1 - axis] = grid.block_shape[1 - axis]
            count = 3 * layer[0] * layer[1]
            for side in (+1, -1):
                step = [0, 0]
                step[axis] = side
                buffers.append((np.ones(count), np.empty(count), grid.neighbour(step),
                                grid.neighbour([-s for s in step])))

        def raw():
            for send, receive, dest, source in buffers:
                comm.Sendrecv(send, dest=dest if dest >= 0 else MPI.PROC_NULL,
                              recvbuf=receive, source=source if source >= 0 else MPI.PROC_NULL)

        out["exchange_us"] = 1e6 * t_exchange
        out["mpi4py_sendrecv_us"] = 1e6 * _best(raw, repeats=20)
        out["bytes"] = int(sum(b[0].nbytes for b in buffers))
    out["peak_rss_mib"] = _peak_rss_mib()
    return out


def worker_mpi4jax_file(path: str, steps: int, mode: str) -> dict:
    shim = Path(tempfile.mkdtemp()) / "mpi4jax"
    shim.mkdir()
    (shim / "__init__.py").write_text("from distlinalg.mpi4jax import *  # noqa\n")
    sys.path[:0] = [str(shim.parent), str(Path(path).parent)]
    sys.argv = [sys.argv[0]]
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_enable_x64", True)
    sw = __import__(Path(path).stem)
    h, u, v = sw.get_initial_conditions()
    z = jnp.zeros_like(h)
    state = sw.shallow_water_step(sw.ModelState(h, u, v, z, z, z), True)
    t_forward = _best(lambda: sw.do_multistep(state, steps)[0].block_until_ready())
    out = {"forward_ms_per_step": 1e3 * t_forward / steps}
    if mode == "grad":
        def loss(h0):
            end = sw.do_multistep(state._replace(h=h0), steps)
            return jnp.sum(end.h[1:-1, 1:-1] ** 2)

        vg = jax.jit(jax.value_and_grad(loss))
        out["grad_over_forward"] = _best(lambda: vg(state.h)[1].block_until_ready()) / t_forward
    out["peak_rss_mib"] = _peak_rss_mib()
    return out


def run_job(ranks: int, args: list[str]) -> dict:
    out = Path(tempfile.mkdtemp()) / "row.json"
    cmd = [str(Path(sys.executable).parent / "mpiexec"), "-n", str(ranks), sys.executable, __file__,
           "--worker", str(out), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        return {"error": (done.stdout + done.stderr)[-400:]}
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, nargs="*", default=[1, 2, 4])
    parser.add_argument("--grid", type=int, nargs=2, default=[1800, 3600])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--mpi4jax-example", default=None)
    parser.add_argument("--worker", default=None)
    parser.add_argument("rest", nargs="*")
    args = parser.parse_args()
    if args.worker:
        kind, *rest = args.rest
        row = worker_ours(*map(int, rest[:3]), rest[3]) if kind == "ours" else worker_mpi4jax_file(
            rest[0], int(rest[1]), rest[2])
        from mpi4py import MPI

        rss = MPI.COMM_WORLD.allreduce(row["peak_rss_mib"], op=MPI.MAX)
        if MPI.COMM_WORLD.Get_rank() == 0:
            row["peak_rss_mib"] = rss
            Path(args.worker).write_text(json.dumps(row))
        return
    ny, nx = args.grid
    print(f"shallow water, {ny} x {nx} (ours), {args.steps} steps per timing, best of 3, {os.cpu_count()} cores")
    print("| ranks | what | forward ms/step | value_and_grad / forward | peak RSS / rank (MiB) | other |")
    print("|---|---|---|---|---|---|")
    for ranks in args.ranks:
        rows = [("ours, forward + grad", ["--", "ours", str(ny), str(nx), str(args.steps), "grad"]),
                ("ours, grad, treeverse 4 checkpoints", ["--", "ours", str(ny), str(nx), str(args.steps),
                                                        "grad-checkpointed"]),
                ("ours, halo exchange (h, u, v)", ["--", "ours", str(ny), str(nx), str(args.steps), "halo"])]
        if args.mpi4jax_example:
            rows.append(("mpi4jax's file on distlinalg.mpi4jax (180 x 360)",
                         ["--", "file", args.mpi4jax_example, str(args.steps), "grad"]))
        for name, job in rows:
            row = run_job(ranks, job)
            if "error" in row:
                print(f"| {ranks} | {name} | failed: {row['error']!r} | | | |")
                continue
            other = ""
            if "exchange_us" in row:
                other = (f"exchange {row['exchange_us']:.0f} us vs mpi4py Sendrecv of the same "
                         f"{row['bytes']} B {row['mpi4py_sendrecv_us']:.0f} us")
            ratio = row.get("grad_over_forward")
            print(f"| {ranks} | {name} | {row['forward_ms_per_step']:.2f} | "
                  f"{'' if ratio is None else f'{ratio:.2f}'} | {row['peak_rss_mib']:.0f} | {other} |", flush=True)


if __name__ == "__main__":
    main()
