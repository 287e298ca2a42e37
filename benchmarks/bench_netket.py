"""NetKet's SR step time on the problem of bench_sr.py (peer; runs in the peers venv).

    benchmarks/.venv-peers/bin/python benchmarks/bench_netket.py [--iters 50] [--json FILE]
    mpiexec -n 2 benchmarks/.venv-peers/bin/python benchmarks/bench_netket.py

TFIM chain L=16 (H = −h Σ X + J Σ Z Z, h = J = 1, periodic: ``nk.operator.Ising``),
RBM α=1 (real), MetropolisLocal with 16 chains, 1008 samples, 4 discarded
sweeps per chain, SR preconditioner with ``jax.scipy.sparse.linalg.cg`` and
diag_shift 0.01, SGD learning rate 0.05 — the settings of the distlinalg
example. One ``driver.run(warmup + iters)``; a callback after every step waits
for the new parameters and stamps the time, a step's time is the difference
of consecutive stamps (after `warmup` steps); the median counts.

Under mpiexec the script uses NetKet's own multi-process mode: JAX's
``jax.distributed.initialize`` (gloo CPU collectives, coordinator on
localhost, port from rank 0 by mpi4py); NetKet 3.23 then shards the samples
over the processes' devices by itself (``NETKET_EXPERIMENTAL_SHARDING`` is
deprecated there and not needed). If that
does not work the result is "skipped: <reason>".
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _util  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    payload = {"bench": "netket", "ranks": size, "iters": args.iters}

    def finish(reason=None):
        if reason:
            payload["skipped"] = reason
        if rank == 0:
            _util.write_json(args.json, payload)

    import jax

    if size > 1:
        try:
            from bench_collectives import init_jax_gloo

            init_jax_gloo(comm)
        except Exception as exc:  # noqa: BLE001
            return finish(f"NetKet multi-process mode (jax.distributed + gloo) failed to start: "
                          f"{type(exc).__name__}: {str(exc)[:300]}")
    jax.config.update("jax_enable_x64", True)
    try:
        import netket as nk
        from jax.scipy.sparse.linalg import cg

        L = 16
        graph = nk.graph.Chain(L, pbc=True)
        hilbert = nk.hilbert.Spin(s=0.5, N=L)
        H = nk.operator.Ising(hilbert=hilbert, graph=graph, h=1.0, J=1.0)
        model = nk.models.RBM(alpha=1, param_dtype=float)
        sampler = nk.sampler.MetropolisLocal(hilbert, n_chains=16)
        vstate = nk.vqs.MCState(sampler, model, n_samples=1008, n_discard_per_chain=4, seed=0, sampler_seed=1)
        sr = nk.optimizer.SR(diag_shift=0.01, solver=cg)
        driver = nk.driver.VMC(H, nk.optimizer.Sgd(learning_rate=0.05), variational_state=vstate,
                               preconditioner=sr)
    except Exception as exc:  # noqa: BLE001
        return finish(f"NetKet set-up failed: {type(exc).__name__}: {str(exc)[:300]}")
    stamps = []

    def callback(step, log_data, drv):
        jax.block_until_ready(drv.state.parameters)  # the step's work is done
        stamps.append(time.perf_counter())
        return True

    t0 = time.perf_counter()
    try:
        driver.run(n_iter=args.warmup + args.iters, out=(), show_progress=False, callback=callback)
        energy = driver.energy
    except Exception as exc:  # noqa: BLE001
        return finish(f"NetKet step failed: {type(exc).__name__}: {str(exc)[:300]}")
    times = [b - a for a, b in zip(stamps[args.warmup - 1:], stamps[args.warmup:])]
    # The slowest process's median (steps synchronise through the collectives anyway).
    times = comm.allgather(times)
    times = max(times, key=_util.median)
    payload.update(step_seconds=_util.median(times), step_samples=times, energy=float(energy.mean.real),
                   n_samples=int(vstate.n_samples), n_params=int(vstate.n_parameters),
                   devices=jax.device_count(), seconds=time.perf_counter() - t0, versions=_util.versions())
    if rank == 0:
        _util.eprint(f"[netket n={size}] step {payload['step_seconds'] * 1e3:.1f} ms, E={payload['energy']:.5f}")
    finish()
    if size > 1:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
