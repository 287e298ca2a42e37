"""Where one SR step of examples/netket_sr goes, phase by phase.

    [mpiexec -n 2] python benchmarks/profile_sr_step.py [--steps 25] [--warmup 5]

The example's problem (TFIM chain L=16, RBM α=1, 1024 samples over all ranks,
16 chains per rank, SR with CG at rtol 1e-6, diag_shift 0.01): each step is
split into its phases, each timed to completion (``block_until_ready``)
between barriers, the slowest rank's time counting:

  sample           fresh samples (NetKet's MetropolisLocal sampler)
  expect_and_grad  local energies, energy statistics and the force (one allreduce)
  sr_solve         ``distlinalg.netket.SR``: linearisation, CG matvecs, allreduces
  update           the parameter update

Prints the median of each phase and its share of the step (rank 0). For the
comparison with NetKet's own pieces, the same phases with ``nk.vqs.MCState``
and ``nk.optimizer.SR`` take the same sampling time on one process (the
sampler is NetKet's in both) and an SR solve within ~10% (QGTJacobianDense).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
from mpi4py import MPI


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    import netket as nk

    import distlinalg.netket as dnk

    L = 16
    hilbert = nk.hilbert.Spin(s=1 / 2, N=L)
    hamiltonian = nk.operator.Ising(hilbert, nk.graph.Chain(length=L, pbc=True), h=1.0, J=1.0)
    sampler = nk.sampler.MetropolisLocal(hilbert, n_chains=16)
    vstate = dnk.MCState(sampler, nk.models.RBM(alpha=1, param_dtype=float), n_samples=1024,
                         n_discard_per_chain=4, seed=0)
    sr = dnk.SR(diag_shift=0.01, rtol=1e-6)
    comm = MPI.COMM_WORLD
    phases: dict[str, list[float]] = {"sample": [], "expect_and_grad": [], "sr_solve": [], "update": []}

    def timed(name, fn):
        comm.Barrier()
        start = time.perf_counter()
        out = jax.block_until_ready(fn())
        phases[name].append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
        return out

    def update(delta):
        vstate.parameters = jax.tree_util.tree_map(lambda p, d: p - 0.05 * d, vstate.parameters, delta)
        return vstate.parameters

    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            for times in phases.values():
                times.clear()
        vstate.reset()
        timed("sample", lambda: vstate.samples)
        _, gradient = timed("expect_and_grad", lambda: vstate.expect_and_grad(hamiltonian))
        delta = timed("sr_solve", lambda: sr(vstate, gradient))
        timed("update", lambda: update(delta))
    if comm.Get_rank() == 0:
        median = {name: statistics.median(times) * 1e3 for name, times in phases.items()}
        total = sum(median.values())
        print(f"{comm.Get_size()} rank(s): step {total:.1f} ms; "
              + ", ".join(f"{name} {ms:.1f} ms ({ms / total:.0%})" for name, ms in median.items()))


if __name__ == "__main__":
    main()
