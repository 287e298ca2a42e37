# NetKet's recommended SR driver, nk.driver.VMC_SR, on any number of MPI ranks. The one line
# marked "distlinalg" is the change to the single-process script.
#
#     mpiexec -n 2 python examples/netket_sr/netket_vmc_sr.py           # SR in parameter space
#     mpiexec -n 2 python examples/netket_sr/netket_vmc_sr.py ntk       # MinSR / NTK (sample space)
#
# On a dnk.MCState the driver's matrices cover every rank's samples: Ōᵀ Ō summed over ranks, or
# the N × N kernel Ō Ōᵀ formed from the ranks' Jacobian rows passed around a ring (the Jacobian
# is never gathered); every rank applies the same update. NETKET_VMC_SR_ITERS=N runs N steps.
import os
import sys

import netket as nk
import optax

import distlinalg.netket as dnk

use_ntk = len(sys.argv) > 1 and sys.argv[1] == "ntk"
L = 16
graph = nk.graph.Chain(length=L, pbc=True)
hilbert = nk.hilbert.Spin(s=1 / 2, N=L)
hamiltonian = nk.operator.Ising(hilbert, graph, h=1.0, J=1.0)
sampler = nk.sampler.MetropolisLocal(hilbert, n_chains=16)
model = nk.models.RBM(alpha=1, param_dtype=float)

vstate = dnk.MCState(sampler, model, n_samples=1024, n_discard_per_chain=4, seed=0)  # distlinalg

driver = nk.driver.VMC_SR(hamiltonian, optax.sgd(0.05), diag_shift=0.05, variational_state=vstate,
                          use_ntk=use_ntk)

log = nk.logging.RuntimeLog()
driver.run(int(os.environ.get("NETKET_VMC_SR_ITERS", 150)), out=log, show_progress=dnk.rank() == 0)

energy = vstate.expect(hamiltonian)
if dnk.rank() == 0:
    exact = -20.404594474757  # TFIM L=16 ground state (Lanczos)
    print(f"nk.driver.VMC_SR(use_ntk={use_ntk}), {dnk.size()} rank(s): E = {energy}, relative error "
          f"{abs((energy.mean.real - exact) / exact):.1e}")
