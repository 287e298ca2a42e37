# The lowest eigenvalues of the transverse-field Ising chain, its Hamiltonian split over MPI
# ranks by rows, and the derivative of the ground-state energy with respect to the field by AD:
#
#     mpiexec -n 2 python examples/eigsh_tfim/tfim_spectrum.py          # L = 20: 2^20 rows
#     mpiexec -n 4 python examples/eigsh_tfim/tfim_spectrum.py 16       # any L, any rank count
#
# H = -h Σ X_i + J Σ Z_i Z_{i+1} on a periodic chain (NetKet's nk.operator.Ising convention).
# Each rank builds only its own rows of H (L + 1 nonzeros per row), so the matrix is never
# held by one process; NetKet's lanczos_ed, the single-process reference, runs on rank 0.
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse as sp
from mpi4py import MPI

import distlinalg as dl
from distlinalg.operators import sparse_rows

jax.config.update("jax_enable_x64", True)

L = int(sys.argv[1]) if len(sys.argv) > 1 else 20
h, J = 1.0, 1.0
k = 2                                            # the ground state and the first excited state
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()

# This rank's rows: basis states start..stop-1 (an even split of 2^L), spin i = bit i (0: up).
n = 2**L
counts = [n // size + (r < n % size) for r in range(size)]
start = sum(counts[:rank])
states = np.arange(start, start + counts[rank], dtype=np.int64)
z = 1 - 2 * ((states[:, None] >> np.arange(L)) & 1)               # Z_i = ±1 on each state
zz = (z * np.roll(z, -1, axis=1)).sum(axis=1)                      # Σ Z_i Z_{i+1}, periodic
flipped = states[:, None] ^ (1 << np.arange(L))                    # X_i flips bit i

# One sparsity pattern for both terms: the diagonal (J Σ ZZ) and the L spin flips (-h Σ X).
rows = np.repeat(np.arange(len(states)), L + 1)
cols = np.concatenate([states[:, None], flipped], axis=1).ravel()
position = sp.csr_matrix((np.arange(1, rows.size + 1, dtype=np.float64), (rows, cols)),
                         shape=(len(states), n))
position.sort_indices()
order = position.data.astype(np.int64) - 1                          # CSR slot -> entry
diagonal = np.concatenate([zz[:, None], np.zeros((len(states), L))], axis=1).ravel()[order]
flips = np.concatenate([np.zeros((len(states), 1)), -np.ones((len(states), L))], axis=1).ravel()[order]
pattern = sparse_rows((jnp.zeros(rows.size), position.indices, position.indptr, (len(states), n)),
                      local=True, hermitian=True)


def hamiltonian(h):
    """H(h) on this rank's rows: the same pattern, values J·ZZ − h·X (h may be traced)."""
    return pattern.with_data(J * jnp.asarray(diagonal) + h * jnp.asarray(flips))


def lowest(h):
    """The k lowest eigenvalues of H(h) (identical on every rank)."""
    w, _, info = dl.eigsh(hamiltonian(h), k, which="SA", tol=1e-10)
    return w, info


tic = time.perf_counter()
(w, info) = jax.jit(lowest)(h)
w.block_until_ready()
seconds = time.perf_counter() - tic

# dE0/dh by AD through the eigensolver (Hellmann–Feynman), and by a central difference.
tic = time.perf_counter()
dE0_dh = jax.jit(dl.ad.grad(lambda h: lowest(h)[0][0]))(h)
ad_seconds = time.perf_counter() - tic
step = 1e-4
finite_difference = (jax.jit(lowest)(h + step)[0][0] - jax.jit(lowest)(h - step)[0][0]) / (2 * step)

if rank == 0:
    import netket as nk                                               # the single-process reference

    hilbert = nk.hilbert.Spin(s=1 / 2, N=L)
    graph = nk.graph.Chain(length=L, pbc=True)
    tic = time.perf_counter()
    exact = np.sort(nk.exact.lanczos_ed(nk.operator.Ising(hilbert, graph, h=h, J=J), k=k))
    netket_seconds = time.perf_counter() - tic
    print(f"TFIM L={L} (h={h}, J={J}), {n} rows over {size} rank(s)")
    print(f"distlinalg.eigsh: E = {np.asarray(w).tolist()}  ({int(info.matvecs)} matvecs, "
          f"{seconds:.1f} s with compilation, converged {bool(info.converged)})")
    print(f"netket lanczos_ed: E = {exact.tolist()}  ({netket_seconds:.1f} s, one process)")
    print(f"largest relative difference {np.max(np.abs(np.asarray(w) - exact) / np.abs(exact)):.1e}")
    print(f"dE0/dh: AD {float(dE0_dh):.10f} ({ad_seconds:.1f} s), central difference {float(finite_difference):.10f}, "
          f"relative difference {abs(float(dE0_dh) - float(finite_difference)) / abs(float(finite_difference)):.1e}")
