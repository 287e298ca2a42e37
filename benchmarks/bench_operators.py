"""Distributed operators against one process, measured in one run.

    python benchmarks/bench_operators.py [--quick] [--ranks 2] [--output FILE] [--json FILE]

Runs itself under ``mpiexec -n 1`` and ``mpiexec -n R`` (the 1-process run is
the single-process peer: every sample / every row in one process) and
prints a table of medians:

1. Gram matvec (issue target: R=2 ranks ≤ 0.6× one process): an RBM
   log ψ(σ) = a·σ + Σ_j log cosh(b_j + W_j·σ) with L visible and αL hidden
   units (real parameters; L=64, α=1: 4224 parameters) on 2^12 samples,
   split evenly across ranks. ``distlinalg.operators.gram`` linearizes
   once; one matvec is a JVP, a VJP and one parameter-sized allreduce.
2. Sparse matvec (target: ≤ 1.5× scipy's CSR matvec time per row, 1 rank):
   the 2-D Poisson matrix (n² rows) as ``sparse_rows`` (halo exchange by
   alltoall), against ``scipy.sparse.csr_matrix @ x`` on the whole matrix.

Cores: XLA runs one process's matvec on every core it may use, so "one
process on the whole node" against "R ranks sharing the node" measures
XLA's threading, not the distribution. The target ratio is therefore taken
with equal cores per process: the single-process peer is restricted to
``nproc // R`` CPUs, the share each of the R ranks gets (distlinalg gives
node-local ranks disjoint CPU blocks at import, see distlinalg/_runtime/cpu.py). The
one-process run on the whole node is reported too.

Timings are medians of repeated jitted calls of a ``lax.fori_loop`` of
matvecs (so dispatch is amortised). Absolute times on a shared machine are
noisy; the ratios are measured within one invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()


def _median_time(fn, repeats: int) -> float:
    fn()  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def worker(args: argparse.Namespace) -> None:
    if args.cpus:
        # Before anything starts threads, so every thread inherits the mask.
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[: args.cpus])
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import numpy as np
    import scipy.sparse as sp
    from mpi4py import MPI

    import distlinalg as dl
    from distlinalg import operators as ops

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    result: dict = {"ranks": size}
    result["cpus"] = sorted(os.sched_getaffinity(0))

    # -- Gram matvec ----------------------------------------------------
    L = args.visible
    hidden = args.alpha * L
    samples_total = args.samples
    rng = np.random.default_rng(0)
    everything = rng.choice([-1.0, 1.0], size=(samples_total, L))
    per_rank = samples_total // size
    mine = jnp.asarray(everything[rank * per_rank : (rank + 1) * per_rank])
    params = {
        "a": jnp.asarray(0.01 * rng.standard_normal(L)),
        "b": jnp.asarray(0.01 * rng.standard_normal(hidden)),
        "W": jnp.asarray(0.01 * rng.standard_normal((hidden, L))),
    }

    def log_psi(p, x):
        return x @ p["a"] + jnp.sum(jnp.log(jnp.cosh(x @ p["W"].T + p["b"])), axis=-1)

    op = ops.gram(log_psi, params, mine, diag_shift=0.01)
    v = jax.tree_util.tree_map(jnp.ones_like, params)
    matvecs = args.gram_matvecs

    @jax.jit
    def repeated(v):
        return jax.lax.fori_loop(0, matvecs, lambda i, u: jax.tree_util.tree_map(lambda a: a * 1e-3, op.matvec(u)), v)

    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
    seconds = _median_time(lambda: jax.block_until_ready(repeated(v)), args.repeats)
    result["gram"] = {"params": int(n_params), "samples": samples_total, "ms_per_matvec": 1e3 * seconds / matvecs}

    # -- sparse matvec ----------------------------------------------------
    n = args.grid
    T = sp.diags([-np.ones(n - 1), 2 * np.ones(n), -np.ones(n - 1)], [-1, 0, 1])
    A = (sp.kron(sp.eye(n), T) + sp.kron(T, sp.eye(n))).tocsr()
    sparse_op = ops.sparse_rows(A)
    rows = sparse_op.pattern.rows
    x = jnp.asarray(np.linspace(0, 1, n * n)[rows.starts[rank] : rows.starts[rank + 1]])
    reps = args.sparse_matvecs

    @jax.jit
    def sparse_repeated(x):
        return jax.lax.fori_loop(0, reps, lambda i, u: 0.1 * sparse_op.matvec(u), x)

    seconds = _median_time(lambda: jax.block_until_ready(sparse_repeated(x)), args.repeats)
    local_rows = rows.size_of(rank)
    result["sparse"] = {"rows": n * n, "local_rows": local_rows, "ms_per_matvec": 1e3 * seconds / reps,
                        "ns_per_row": 1e9 * seconds / reps / max(local_rows, 1)}
    if size == 1:
        xs = np.linspace(0, 1, n * n)
        scipy_seconds = _median_time(lambda: [A @ xs for _ in range(reps)], args.repeats) / reps
        result["scipy_csr"] = {"ms_per_matvec": 1e3 * scipy_seconds, "ns_per_row": 1e9 * scipy_seconds / (n * n)}
    all_results = comm.gather(result)
    if rank == 0:
        # The slowest rank sets the pace of a distributed matvec.
        result["gram"]["ms_per_matvec"] = max(r["gram"]["ms_per_matvec"] for r in all_results)
        result["sparse"]["ms_per_matvec"] = max(r["sparse"]["ms_per_matvec"] for r in all_results)
        result["sparse"]["ns_per_row"] = max(r["sparse"]["ns_per_row"] for r in all_results)
        result["cpus_per_rank"] = min(len(r["cpus"]) for r in all_results)
        result["versions"] = {"jax": jax.__version__, "mpi": MPI.Get_library_version().splitlines()[0].strip()}
        Path(args.json_out).write_text(json.dumps(result))
    del dl


def launch(args: argparse.Namespace, ranks: int, out: Path, cpus: int = 0) -> dict:
    mpiexec = Path(sys.executable).parent / "mpiexec"
    command = [str(mpiexec) if mpiexec.exists() else "mpiexec", "-n", str(ranks), sys.executable, str(HERE),
               "--worker", "--json-out", str(out), f"--cpus={cpus}"] + args.forward
    subprocess.run(command, check=True)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats (smoke check)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--output", help="append the table (markdown) to this file")
    parser.add_argument("--json", help="write the raw results here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json-out", help=argparse.SUPPRESS)
    parser.add_argument("--cpus", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--visible", type=int, default=64)
    parser.add_argument("--alpha", type=int, default=1)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--grid", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--gram-matvecs", type=int, default=20)
    parser.add_argument("--sparse-matvecs", type=int, default=20)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.quick:
        args.visible, args.samples, args.grid, args.repeats = 32, 1024, 300, 3
    args.forward = [f"--visible={args.visible}", f"--alpha={args.alpha}", f"--samples={args.samples}",
                    f"--grid={args.grid}", f"--repeats={args.repeats}", f"--gram-matvecs={args.gram_matvecs}",
                    f"--sparse-matvecs={args.sparse_matvecs}"]
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    one = launch(args, 1, tmp / f"bench_operators_1_{os.getpid()}.json")
    many = launch(args, args.ranks, tmp / f"bench_operators_{args.ranks}_{os.getpid()}.json")
    share = many["cpus_per_rank"]
    one_share = launch(args, 1, tmp / f"bench_operators_1s_{os.getpid()}.json", cpus=share)
    gram_ratio = many["gram"]["ms_per_matvec"] / one_share["gram"]["ms_per_matvec"]
    whole_ratio = many["gram"]["ms_per_matvec"] / one["gram"]["ms_per_matvec"]
    node = len(one["cpus"])
    sparse_ratio = one["sparse"]["ns_per_row"] / one["scipy_csr"]["ns_per_row"]
    lines = [
        f"### Distributed operators, {args.ranks} ranks vs one process ({time.strftime('%Y-%m-%d')}, "
        f"jax {one['versions']['jax']}, {one['versions']['mpi']}{', QUICK' if args.quick else ''})",
        "",
        "| case | one process | distributed | ratio | target |",
        "|---|---|---|---|---|",
        f"| Gram matvec, RBM {one['gram']['params']} params, {args.samples} samples, {share} CPU(s) per process | "
        f"{one_share['gram']['ms_per_matvec']:.2f} ms | {many['gram']['ms_per_matvec']:.2f} ms ({args.ranks} ranks) | "
        f"{gram_ratio:.2f} | ≤ 0.6 ({'ok' if gram_ratio <= 0.6 else 'MISSED'}) |",
        f"| same, one process on the whole node ({node} CPUs) | {one['gram']['ms_per_matvec']:.2f} ms | "
        f"{many['gram']['ms_per_matvec']:.2f} ms ({args.ranks} ranks) | {whole_ratio:.2f} | |",
        f"| sparse_rows matvec, Poisson {args.grid}² rows, 1 rank vs scipy CSR | "
        f"{one['scipy_csr']['ns_per_row']:.2f} ns/row (scipy) | {one['sparse']['ns_per_row']:.2f} ns/row | "
        f"{sparse_ratio:.2f} | ≤ 1.5 ({'ok' if sparse_ratio <= 1.5 else 'MISSED'}) |",
        f"| sparse_rows matvec, {args.ranks} ranks (halo by alltoall) | {one['sparse']['ms_per_matvec']:.2f} ms | "
        f"{many['sparse']['ms_per_matvec']:.2f} ms | {many['sparse']['ms_per_matvec'] / one['sparse']['ms_per_matvec']:.2f} | |",
        "",
    ]
    table = "\n".join(lines)
    print(table)
    if args.output:
        with open(args.output, "a") as handle:
            handle.write("\n" + table)
    if args.json:
        Path(args.json).write_text(json.dumps({"one": one, "one_share": one_share, "many": many, "gram_ratio": gram_ratio,
                                               "sparse_ratio": sparse_ratio}, indent=1))


if __name__ == "__main__":
    main()
