"""distlinalg.linalg's dense solves by rows: each engine, against jnp.linalg in one process.

    .venv/bin/python benchmarks/bench_linalg.py --sizes 4096 8192                 # 1 rank, and jnp.linalg
    mpiexec -n 2 .venv/bin/python benchmarks/bench_linalg.py --sizes 4096 8192    # 2 ranks

For each N: a symmetric positive definite matrix (float64) held by rows (the
even split), one right-hand side; ``cholesky_solve`` with engine "scalapack"
and "distlinalg" (and on one rank jax's LAPACK path, which both take there,
and ``jnp.linalg.solve``/``jax.scipy`` cho_factor in the same process as the
peer). Reported per engine: the median of ``--repeats`` jitted calls after one
warm-up, the solve's error against the gathered reference (N ≤ 4096; the
residual ‖A x − b‖ / ‖b‖ above), and the memory per rank: the compiled
program's (XLA's arguments + temporaries + outputs) plus, for the ScaLAPACK
engine, the high-water mark of what its handler holds itself (block-cyclic
pieces, workspaces, the redistribution's panel buffers: XLA cannot see them),
the largest over the ranks.
``--eigh`` adds eigh at the sizes given there (distlinalg's Jacobi engine is
several times LAPACK's flops: keep them small).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--eigh", type=int, nargs="*", default=[])
    parser.add_argument("--engines", nargs="+", default=["scalapack", "distlinalg"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    import jax
    import jax.numpy as jnp
    import numpy as np

    jax.config.update("jax_enable_x64", True)
    import distlinalg as dl
    import distlinalg.linalg as dll
    from distlinalg.comm import allreduce
    from distlinalg.operators import Partition

    P, r = dl.size(), dl.rank()
    rows_out = []

    def timed(fn, *a):
        out = jax.block_until_ready(fn(*a))
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            out = jax.block_until_ready(fn(*a))
            times.append(time.perf_counter() - t)
        return out, statistics.median(times)

    from distlinalg.linalg import _scalapack

    def memory(fn, *a, handler_bytes=0):
        m = fn.lower(*a).compile().memory_analysis()
        mine = (m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes + handler_bytes) / 2**30
        return float(allreduce(jnp.asarray(mine), op="max"))

    def handler_peak(engine):
        """The ScaLAPACK handler's high-water bytes since the last call (0 for other engines)."""
        if engine != "scalapack" or P == 1 or not _scalapack.available()[0]:
            return 0
        return _scalapack.handler_memory(reset_peak=True)[1]

    def report(**row):
        rows_out.append(row)
        if r == 0:
            print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)

    for n in args.sizes + [-e for e in args.eigh]:
        kind, n = ("eigh", -n) if n < 0 else ("cholesky_solve", n)
        p = Partition.even(n, P)
        mine = slice(p.starts[r], p.starts[r + 1])
        # A = Q diag Qᵀ-like SPD rows, built by rows without a global N x N array on any rank:
        # A = G Gᵀ / n + I with G's rows from a per-row seed, formed by ring products.
        rng = np.random.default_rng(1000 + r)
        G_rows = jnp.asarray(rng.standard_normal((p.size_of(r), 64)))
        G_all = p.allgather(G_rows)  # N x 64, small
        A_rows = (G_rows @ G_all.T) / 64 + jnp.eye(n)[mine] * 0.5
        b = jnp.ones(p.size_of(r))
        for engine in args.engines:
            handler_peak(engine)  # restart the high-water mark
            if kind == "cholesky_solve":
                fn = jax.jit(lambda a, v, e=engine: dll.cholesky_solve(a, v, engine=e))
                x, seconds = timed(fn, A_rows, b)
                residual = float(jnp.sqrt(allreduce(jnp.sum((A_rows @ p.allgather(x) - b) ** 2)) / n))
            else:
                fn = jax.jit(lambda a, e=engine: dll.eigh(a, engine=e))
                (w, V), seconds = timed(fn, A_rows)
                residual = float(jnp.sqrt(allreduce(jnp.sum(jnp.abs(A_rows @ p.allgather(V) - V * w) ** 2))))
            used = "lapack" if P == 1 else engine
            extra = handler_peak(engine)
            operands = (A_rows, b) if kind == "cholesky_solve" else (A_rows,)
            report(op=kind, n=n, ranks=P, engine=used, seconds=seconds, residual=residual,
                   memory_gib_per_rank=memory(fn, *operands, handler_bytes=extra),
                   handler_gib=extra / 2**30)
            if P == 1:
                break  # both engines take LAPACK on one rank
        if P == 1:  # the peer: jax's own solve of the whole matrix in this process
            if kind == "cholesky_solve":
                peer = jax.jit(lambda a, v: jax.scipy.linalg.cho_solve(jax.scipy.linalg.cho_factor(a), v))
                _, seconds = timed(peer, A_rows, b)
                report(op=kind, n=n, ranks=1, engine="jax.scipy cho_factor", seconds=seconds,
                       memory_gib_per_rank=memory(peer, A_rows, b))
            else:
                peer = jax.jit(jnp.linalg.eigh)
                _, seconds = timed(peer, A_rows)
                report(op=kind, n=n, ranks=1, engine="jnp.linalg.eigh", seconds=seconds,
                       memory_gib_per_rank=memory(peer, A_rows))
    if args.json and r == 0:
        Path(args.json).write_text(json.dumps(rows_out, indent=1))


if __name__ == "__main__":
    main()
