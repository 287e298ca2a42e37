"""Shallow water on distlinalg.grid: the forward run, and its gradient by jax.grad.

    mpiexec -n 4 python examples/shallow_water/shallow_water.py                 # 10 model days, 180 x 360
    mpiexec -n 4 python examples/shallow_water/shallow_water.py --paper         # the paper's 1800 x 3600 grid
    mpiexec -n 2 python examples/shallow_water/shallow_water.py --days 1 --gradient --checkpoints 20

The forward run draws a progress bar on rank 0 and saves the final surface height as
shallow_water.png (Figure 1 of the mpi4jax paper). ``--gradient`` differentiates a
data-assimilation misfit: how the squared distance of the final height from the forward
run's, after the initial height is perturbed, depends on the initial height, by jax.grad
through the whole run (``--checkpoints K`` keeps K states instead of every step's).
"""

import argparse
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_enable_x64", True)

import distlinalg as dl  # noqa: E402
import model  # noqa: E402  (examples/shallow_water/model.py)

parser = argparse.ArgumentParser()
parser.add_argument("--days", type=float, default=10.0)
parser.add_argument("--paper", action="store_true", help="the paper's 1800 x 3600 grid")
parser.add_argument("--chunk", type=int, default=100, help="steps per jitted call (the progress bar's tick)")
parser.add_argument("--gradient", action="store_true")
parser.add_argument("--checkpoints", type=int, default=None)
parser.add_argument("--plot", default="shallow_water.png")
args = parser.parse_args()

grid = model.make_grid(model.PAPER_GRID if args.paper else model.SMALL_GRID)
# Whole chunks of `chunk` steps after the first (Euler) step.
steps = 1 + args.chunk * max(1, math.ceil((args.days * model.DAY / model.DT - 1) / args.chunk))
if dl.rank() == 0:
    print(f"{grid.shape[0]} x {grid.shape[1]} grid on {grid.dims[0]} x {grid.dims[1]} ranks, {steps} steps")

# Forward run, `chunk` steps per call.
advance = jax.jit(lambda state: model.run(grid, state, args.chunk))
state = jax.jit(lambda s: model.start(grid, s))(model.initial_state(grid))
done, started = 1, time.perf_counter()
try:
    from tqdm import tqdm
except ImportError:
    tqdm = None
bar = tqdm(total=steps, initial=1, unit="step", disable=dl.rank() != 0) if tqdm else None
while done < steps:
    state = advance(state)
    state.h.block_until_ready()
    done += args.chunk
    if bar is not None:
        bar.update(args.chunk)
    elif dl.rank() == 0:
        print(f"  step {done} of {steps}", flush=True)
if bar is not None:
    bar.close()
elapsed = time.perf_counter() - started
height = grid.gather(state.h)  # the global array on rank 0
if dl.rank() == 0:
    print(f"forward: {elapsed:.2f} s, {elapsed / (done - 1) * 1e3:.2f} ms per step (the first call's compile included)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    extent = [0, grid.shape[1] * model.DX / 1e3, 0, grid.shape[0] * model.DY / 1e3]
    image = ax.imshow(np.asarray(height) - model.DEPTH, origin="lower", extent=extent, cmap="RdBu_r", vmin=-10, vmax=10)
    ax.set(xlabel="x (km)", ylabel="y (km)", title=f"surface height anomaly after {done * model.DT / model.DAY:.1f} days")
    fig.colorbar(image, label="m", orientation="horizontal", shrink=0.8, pad=0.18)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=100)
    print(f"saved {args.plot}")

if args.gradient:
    # Twin experiment: the "observed" final height comes from the initial state above; the
    # gradient of the misfit of a perturbed initial height tells how to correct it.
    first = model.initial_state(grid)
    observed = model.run(grid, model.start(grid, first), steps)
    yy, xx = model.coordinates(grid)
    bump = jnp.asarray(np.exp(-(((xx - xx.mean()) / 50e3) ** 2 + ((yy - yy.mean()) / 50e3) ** 2)))

    def misfit(h0):
        final = model.run(grid, model.start(grid, first._replace(h=h0)), steps, args.checkpoints)
        # This rank's part of the global misfit: jax.grad of it is this rank's block of the
        # global gradient (docs/ad.md); the reported value is summed over ranks.
        return jnp.sum((final.h - observed.h)[grid.interior] ** 2)

    value_and_grad = jax.jit(jax.value_and_grad(misfit))
    started = time.perf_counter()
    value, gradient = value_and_grad(first.h + 0.1 * bump)
    gradient.block_until_ready()
    total = float(dl.comm.allreduce(value))
    size = float(grid.sum(gradient**2))
    if dl.rank() == 0:
        print(f"gradient: misfit {total:.6e}, |grad| {size ** 0.5:.6e}, {time.perf_counter() - started:.2f} s")
