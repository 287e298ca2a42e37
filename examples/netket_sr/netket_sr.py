# NetKet's documented SR script (VMC with nk.optimizer.SR) on any number of MPI ranks. The one
# line marked "distlinalg" is the change to the single-process script; the progress bar on
# rank 0 only is cosmetic.
#
#     mpiexec -n 2 python examples/netket_sr/netket_sr.py          # transverse-field Ising, L = 16
#
# nk.optimizer.SR builds its QGT on the state: on a dnk.MCState that QGT covers every rank's
# samples (any of NetKet's QGT types and solvers), and every rank applies the same update.
# NETKET_SR_ITERS=N runs N steps (the tests run a few).
import os

import netket as nk

import distlinalg.netket as dnk

L = 16
graph = nk.graph.Chain(length=L, pbc=True)
hilbert = nk.hilbert.Spin(s=1 / 2, N=L)
hamiltonian = nk.operator.Ising(hilbert, graph, h=1.0, J=1.0)
sampler = nk.sampler.MetropolisLocal(hilbert, n_chains=16)
model = nk.models.RBM(alpha=1, param_dtype=float)

vstate = dnk.MCState(sampler, model, n_samples=1024, n_discard_per_chain=4, seed=0)  # distlinalg

optimizer = nk.optimizer.Sgd(learning_rate=0.05)
preconditioner = nk.optimizer.SR(diag_shift=0.05)
driver = nk.driver.VMC(hamiltonian, optimizer, variational_state=vstate, preconditioner=preconditioner)

log = nk.logging.RuntimeLog()
driver.run(int(os.environ.get("NETKET_SR_ITERS", 150)), out=log, show_progress=dnk.rank() == 0)

energy = vstate.expect(hamiltonian)  # every rank: fresh samples of all ranks
if dnk.rank() == 0:
    exact = -20.404594474757  # TFIM L=16 ground state (Lanczos)
    print(f"nk.optimizer.SR, {dnk.size()} rank(s): E = {energy}, relative error "
          f"{abs((energy.mean.real - exact) / exact):.1e}")
