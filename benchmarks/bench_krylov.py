"""Krylov solvers on the 2-D Poisson problem, side by side in one run.

    mpiexec -n 2 python benchmarks/bench_krylov.py [--n 1000] [--iters 200] [--output FILE]

5-point Laplacian on an n×n grid (Dirichlet), rows of the grid split across
ranks, matrix-free with a halo exchange (sendrecv) per matvec; b = A·1,
x0 = 0, rtol 1e-8, a fixed iteration budget (the time per iteration is what is
compared; run with --iters 0 for the full solve). Peers measured in the same
run: jax.scipy.sparse.linalg.cg on one process (rank 0, the same stencil) and,
when petsc4py is importable, PETSc KSPCG on an assembled AIJ matrix.
Reported: time per iteration, the issue target (2 ranks ≤ jax.scipy / 1.8),
and allreduces per iteration read off the traced loop body.
"""

from __future__ import annotations

import argparse
import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import distlinalg as dl  # noqa: E402
from distlinalg.comm import sendrecv  # noqa: E402


def stencil(u, up, down):
    """4u − neighbours, with `up`/`down` the rows beyond this block."""
    padded = jnp.concatenate([up[None], u, down[None]], axis=0)
    left = jnp.pad(u[:, :-1], ((0, 0), (1, 0)))
    right = jnp.pad(u[:, 1:], ((0, 0), (0, 1)))
    return 4 * u - padded[:-2] - padded[2:] - left - right


def distributed_laplacian(rank, size):
    above = rank - 1 if rank > 0 else MPI.PROC_NULL
    below = rank + 1 if rank < size - 1 else MPI.PROC_NULL

    def matvec(u):
        zero = jnp.zeros_like(u[0])
        up = sendrecv(u[-1], zero, above, below)  # my last row goes down
        down = sendrecv(u[0], zero, below, above)
        return stencil(u, up, down)

    return matvec


def _subjaxprs(eqn):
    stack = list(eqn.params.values())
    while stack:
        value = stack.pop()
        if isinstance(value, (tuple, list)):
            stack.extend(value)
        elif hasattr(value, "eqns"):
            yield value
        elif hasattr(getattr(value, "jaxpr", None), "eqns"):
            yield value.jaxpr


def allreduces_per_iteration(fn, *args) -> int:
    """distlinalg_allreduce equations in the body of the solver's while loop."""

    def find_while(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "while":
                return eqn
            for sub in _subjaxprs(eqn):
                found = find_while(sub)
                if found is not None:
                    return found
        return None

    def count(jaxpr):
        return sum(
            (eqn.primitive.name == "distlinalg_allreduce") + sum(count(sub) for sub in _subjaxprs(eqn))
            for eqn in jaxpr.eqns
        )

    loop = find_while(jax.make_jaxpr(fn)(*args).jaxpr)
    return count(loop.params["body_jaxpr"].jaxpr)


def timed(fn, *args, collective=True):
    out = fn(*args)
    jax.block_until_ready(out)
    if collective:
        MPI.COMM_WORLD.Barrier()
    start = time.perf_counter()
    out = fn(*args)
    jax.block_until_ready(out)
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--iters", type=int, default=200, help="iteration budget (0: solve to rtol)")
    parser.add_argument("--output")
    args = parser.parse_args()
    rank, size, n = dl.rank(), dl.size(), args.n
    rows = np.array_split(np.arange(n), size)[rank]
    matvec = distributed_laplacian(rank, size)
    ones = jnp.ones((len(rows), n))
    b = jax.jit(matvec)(ones)
    maxiter = args.iters or None
    results = []
    for name, kwargs in [
        ("distlinalg cg", dict(method="standard")),
        ("distlinalg cg single-reduction", dict(method="single_reduction")),
        ("distlinalg minres", None),
    ]:
        if kwargs is None:
            solve = jax.jit(lambda b: dl.minres(matvec, b, rtol=1e-8, maxiter=maxiter, layout="sharded"))
        else:
            solve = jax.jit(lambda b, kw=kwargs: dl.cg(matvec, b, rtol=1e-8, maxiter=maxiter, layout="sharded", **kw))
        seconds, (x, info) = timed(solve, b)
        seconds = MPI.COMM_WORLD.allreduce(seconds, op=MPI.MAX)
        its = int(info.iterations)
        results.append((name, seconds / its, its, allreduces_per_iteration(solve, b)))

    peer = None
    if rank == 0:
        from jax.scipy.sparse.linalg import cg as jax_cg

        zero_row = jnp.zeros(n)
        full_mv = lambda u: stencil(u, zero_row, zero_row)  # noqa: E731
        full_b = jax.jit(full_mv)(jnp.ones((n, n)))
        k = args.iters or 10 * n * n
        seconds, _ = timed(jax.jit(lambda b: jax_cg(full_mv, b, tol=1e-8, maxiter=k)), full_b, collective=False)
        # jax.scipy reports no iteration count; with a budget below convergence it runs them all.
        peer = seconds / k if args.iters else None
    peer = MPI.COMM_WORLD.bcast(peer, root=0)

    if rank != 0:
        return
    lines = [
        f"### 2-D Poisson {n}x{n}, rtol 1e-8, sharded rows, {size} rank(s) "
        f"(jax {jax.__version__}; budget {args.iters or 'to convergence'} iterations)",
        "",
        "| solver | ms / iteration | iterations | allreduces / iteration |",
        "|---|---|---|---|",
    ]
    for name, per_it, its, reds in results:
        lines.append(f"| {name} | {per_it * 1e3:.2f} | {its} | {reds} |")
    if peer is not None:
        lines.append(f"| jax.scipy.sparse.linalg.cg, 1 process (peer) | {peer * 1e3:.2f} | {args.iters} | 0 |")
        target = peer / 1.8
        ours = results[0][1]
        lines += ["", f"Target for 2 ranks (jax.scipy / 1.8): {target * 1e3:.2f} ms/iteration; "
                  f"distlinalg cg on {size} rank(s): {ours * 1e3:.2f} ms ({ours / target:.2f}x the target)."]
    text = "\n".join(lines)
    print(text)
    if args.output:
        with open(args.output, "a") as f:
            f.write(text + "\n\n")


if __name__ == "__main__":
    main()
