"""NetKet's own SR paths on a distlinalg.netket.MCState against NetKet in one process.

    .venv/bin/python benchmarks/bench_netket_paths.py [--iters 30]            # 1 rank: both columns
    mpiexec -n 2 .venv/bin/python benchmarks/bench_netket_paths.py            # 2 ranks: distlinalg only

TFIM chain L=16, RBM α=1 (real), MetropolisLocal with 16 chains per rank, 1024
samples in all, Sgd(0.05), diag_shift 0.01. Each path is one ``driver.run(warmup +
iters)``; a callback stamps the time after every step (waiting for the new
parameters), a step is the difference of consecutive stamps, the median counts.
On one rank each path also runs on ``nk.vqs.MCState`` (NetKet alone) in the same
process, and the ratio distlinalg / NetKet is printed (machines are shared: compare
ratios of one run). Under mpiexec the distlinalg column is the P-rank job (same
1024 samples in all).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _util  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import jax

    try:
        import netket as nk
        import optax
    except ImportError as exc:  # the [netket] extra is not installed
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_rank() == 0:
            _util.write_json(args.json, {"bench": "netket_paths", "skipped": f"NetKet not installed: {exc}"})
        return

    import distlinalg.netket as dnk

    size, rank = dnk.size(), dnk.rank()
    hilbert = nk.hilbert.Spin(0.5, N=16)
    H = nk.operator.Ising(hilbert, nk.graph.Chain(16, pbc=True), h=1.0, J=1.0)
    sampler = nk.sampler.MetropolisLocal(hilbert, n_chains=16)
    model = nk.models.RBM(alpha=1, param_dtype=float)
    paths = {
        "VMC + nk.optimizer.SR() (QGTAuto, jax cg)": lambda vs: nk.driver.VMC(
            H, nk.optimizer.Sgd(0.05), variational_state=vs, preconditioner=nk.optimizer.SR(diag_shift=0.01)),
        "VMC + SR(QGTJacobianDense, cholesky)": lambda vs: nk.driver.VMC(
            H, nk.optimizer.Sgd(0.05), variational_state=vs,
            preconditioner=nk.optimizer.SR(qgt=nk.optimizer.qgt.QGTJacobianDense,
                                           solver=nk.optimizer.solver.cholesky, diag_shift=0.01)),
        "VMC + SR(QGTOnTheFly, jax cg)": lambda vs: nk.driver.VMC(
            H, nk.optimizer.Sgd(0.05), variational_state=vs,
            preconditioner=nk.optimizer.SR(qgt=nk.optimizer.qgt.QGTOnTheFly, diag_shift=0.01)),
        "VMC + SR(QGTJacobianPyTree, jax cg)": lambda vs: nk.driver.VMC(
            H, nk.optimizer.Sgd(0.05), variational_state=vs,
            preconditioner=nk.optimizer.SR(qgt=nk.optimizer.qgt.QGTJacobianPyTree, diag_shift=0.01)),
        "VMC_SR": lambda vs: nk.driver.VMC_SR(H, optax.sgd(0.05), variational_state=vs, diag_shift=0.01,
                                              use_ntk=False),
        "VMC_SR(use_ntk=True)": lambda vs: nk.driver.VMC_SR(H, optax.sgd(0.05), variational_state=vs,
                                                            diag_shift=0.01, use_ntk=True),
        "VMC_SR(use_ntk=True, chunk_size_bwd=128)": lambda vs: nk.driver.VMC_SR(
            H, optax.sgd(0.05), variational_state=vs, diag_shift=0.01, use_ntk=True, chunk_size_bwd=128),
        "VMC + dnk.SR": lambda vs: nk.driver.VMC(H, nk.optimizer.Sgd(0.05), variational_state=vs,
                                                 preconditioner=dnk.SR(diag_shift=0.01, rtol=1e-6)),
    }

    def step_ms(make, vstate) -> float:
        stamps = []

        def stamp(step, log, driver):
            jax.block_until_ready(driver.state.parameters)
            stamps.append(time.perf_counter())
            return True

        make(vstate).run(args.warmup + args.iters, out=(), show_progress=False, callback=stamp)
        return 1e3 * statistics.median(b - a for a, b in zip(stamps[args.warmup:], stamps[args.warmup + 1:]))

    rows = []
    for name, make in paths.items():
        ours = step_ms(make, dnk.MCState(sampler, model, n_samples=1024, n_discard_per_chain=4, seed=0))
        theirs = None
        if size == 1 and "dnk.SR" not in name:
            theirs = step_ms(make, nk.vqs.MCState(sampler, model, n_samples=1024, n_discard_per_chain=4, seed=0))
        rows.append({"path": name, "ranks": size, "distlinalg_ms": ours, "netket_ms": theirs})
        if rank == 0:
            ratio = f"{ours / theirs:.2f}" if theirs else "-"
            print(f"{name:45s} ranks={size}  distlinalg {ours:7.2f} ms  NetKet(1 process) "
                  f"{'-' if theirs is None else f'{theirs:7.2f} ms'}  ratio {ratio}", flush=True)
    if rank == 0:
        _util.write_json(args.json, {"bench": "netket_paths", "ranks": size, "iters": args.iters, "rows": rows})


if __name__ == "__main__":
    main()
