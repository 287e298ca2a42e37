"""One shallow-water run of examples/shallow_water on the ranks of an mpiexec job.

    mpiexec -n P python tests/scripts/shallow_water_job.py OUT.npz NY NX STEPS [--splits 3,2:5] [--gradient]

Rank 0 writes the gathered final height and velocities (and, with --gradient, the
gathered gradient of the misfit w.r.t. the initial height, its value, the dot test's two
sides and a Hessian-vector product) to OUT.npz, for tests/examples/test_shallow_water.py
to compare across rank counts.
"""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_enable_x64", True)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "shallow_water"))

import distlinalg as dl  # noqa: E402
import model  # noqa: E402

out, ny, nx, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
splits = None
if "--splits" in sys.argv:
    text = sys.argv[sys.argv.index("--splits") + 1]
    splits = [tuple(int(b) for b in axis.split(",")) for axis in text.split(":")]
dims = None if splits is None else tuple(len(axis) for axis in splits)
grid = model.make_grid((ny, nx), dims=dims, splits=splits)
first = model.initial_state(grid)
final = jax.jit(lambda s: model.run(grid, model.start(grid, s), steps - 1))(first)
result = {f"final_{name}": np.asarray(grid.gather(getattr(final, name))) for name in ("h", "u", "v")}

if "--gradient" in sys.argv:
    observed = final.h
    yy, xx = model.coordinates(grid)
    bump = jnp.asarray(np.exp(-(((xx - 0.5 * nx * model.DX) / 30e3) ** 2 + ((yy - 0.5 * ny * model.DY) / 30e3) ** 2)))

    def misfit(h0, checkpoints=None):
        end = model.run(grid, model.start(grid, first._replace(h=h0)), steps - 1, checkpoints)
        return jnp.sum((end.h - observed)[grid.interior] ** 2)

    h0 = first.h + 0.5 * bump
    value, gradient = jax.jit(jax.value_and_grad(misfit))(h0)
    gradient_checkpointed = jax.jit(jax.grad(lambda h: misfit(h, 4)))(h0)
    # A direction defined on the global grid (the same on every rank count), interiors only.
    everywhere = np.random.default_rng(7).standard_normal((ny, nx))
    direction = jnp.zeros(grid.block_shape).at[grid.interior].set(everywhere[grid.global_slices])
    _, tangent = jax.jit(lambda h, d: jax.jvp(misfit, (h,), (d,)))(h0, direction)
    hvp = jax.jit(lambda h, d: jax.jvp(jax.grad(misfit), (h,), (d,))[1])(h0, direction)
    total = lambda x: float(dl.comm.allreduce(x))  # noqa: E731
    result.update(
        misfit=total(value), gradient=np.asarray(grid.gather(gradient)),
        gradient_checkpointed=np.asarray(grid.gather(gradient_checkpointed)),
        jvp=total(tangent), grad_dot=total(jnp.vdot(gradient, direction)),
        direction=np.asarray(grid.gather(direction)), hvp=np.asarray(grid.gather(hvp)),
    )
    for eps in (1e-4,):
        plus = jax.jit(misfit)(h0 + eps * direction)
        minus = jax.jit(misfit)(h0 - eps * direction)
        result["central_difference"] = (total(plus) - total(minus)) / (2 * eps)
        gp = jax.jit(jax.grad(misfit))(h0 + eps * direction)
        gm = jax.jit(jax.grad(misfit))(h0 - eps * direction)
        result["hvp_difference"] = np.asarray(grid.gather((gp - gm) / (2 * eps)))
if dl.rank() == 0:
    np.savez(out, **result)
