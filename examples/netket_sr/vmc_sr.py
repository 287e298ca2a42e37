# Ground state of a spin-1/2 chain by variational Monte Carlo with stochastic
# reconfiguration, built from NetKet's own pieces and run on any number of MPI ranks:
#
#     mpiexec -n 2 python examples/netket_sr/vmc_sr.py              # transverse-field Ising, L = 16
#     mpiexec -n 2 python examples/netket_sr/vmc_sr.py heisenberg   # Heisenberg, L = 16
#
# The lines marked "distlinalg" are the whole change to a single-process NetKet script
# (see README.md). VMC_SR_ITERS=N runs N steps instead (make demo, the tests).
import os
import sys

import netket as nk
import optax

import distlinalg.netket as dnk  # distlinalg

model = sys.argv[1] if len(sys.argv) > 1 else "tfim"
L = 16
graph = nk.graph.Chain(length=L, pbc=True)

if model == "tfim":
    # H = -h Σ X_i + J Σ Z_i Z_{i+1}, h = J = 1 (critical)
    hilbert = nk.hilbert.Spin(s=1 / 2, N=L)
    hamiltonian = nk.operator.Ising(hilbert, graph, h=1.0, J=1.0)
    sampler = nk.sampler.MetropolisLocal(hilbert, n_chains=16)
    n_iter = 300
elif model == "heisenberg":
    # Marshall's sign rule makes the ground state positive, so a real RBM can represent it;
    # exchange moves keep the samples in the Sz = 0 sector.
    hilbert = nk.hilbert.Spin(s=1 / 2, N=L, total_sz=0)
    hamiltonian = nk.operator.Heisenberg(hilbert, graph, sign_rule=True)
    sampler = nk.sampler.MetropolisExchange(hilbert, graph=graph, n_chains=16)
    n_iter = 400
else:
    sys.exit(f"usage: vmc_sr.py [tfim|heisenberg], not {model!r}")
n_iter = int(os.environ.get("VMC_SR_ITERS", n_iter))

# 1024 samples per step over all ranks (16 chains on every rank), the same parameters on every rank.
vstate = dnk.MCState(sampler, nk.models.RBM(alpha=1, param_dtype=float), n_samples=1024,  # distlinalg
                     n_discard_per_chain=4, seed=0)
# The diagonal shift decays from 0.1 to 0.01 over the first 100 steps: the first steps from a
# random RBM are large, and with a shift of 0.01 from the start some runs jump into a state
# the sampler cannot leave (NetKet alone too, on some seeds).
diag_shift = optax.exponential_decay(0.1, transition_steps=100, decay_rate=0.1, end_value=0.01)
driver = nk.driver.VMC(hamiltonian, nk.optimizer.Sgd(learning_rate=0.05), variational_state=vstate,
                       preconditioner=dnk.SR(diag_shift=diag_shift, rtol=1e-6))  # distlinalg

log = nk.logging.RuntimeLog()
driver.run(n_iter, out=log, show_progress=dnk.rank() == 0)  # distlinalg: one progress bar

if dnk.rank() == 0:  # exact references, on one rank (2^16 or 12870 configurations)
    exact = nk.exact.lanczos_ed(hamiltonian)[0]
    full = nk.vqs.FullSumState(hilbert, vstate.model, variables=vstate.variables).expect(hamiltonian).mean.real
final = vstate.expect(hamiltonian)  # every rank: fresh samples of all ranks

if dnk.rank() == 0:
    last, sigma = log["Energy"]["Mean"].real[-20:], log["Energy"]["Sigma"][-20:]
    print(f"{model} L={L}, {dnk.size()} rank(s), {vstate.n_samples} samples per step, {n_iter} steps")
    print(f"Monte Carlo energy: last {len(last)} steps {last.mean():.5f} ± {(sigma**2).sum()**0.5 / len(last):.5f}, "
          f"final state {final}")
    print(f"exact <H> of the trained RBM {full:.6f}, ground state {exact:.6f}, "
          f"relative error {abs((full - exact) / exact):.1e}")
