"""Variational Monte Carlo with stochastic reconfiguration over MPI.

Samples are sharded across ranks; every SR step solves (S + λ) δ = F with
``distlinalg.cg`` or ``distlinalg.minres`` on ``distlinalg.operators.gram``.
Run ``mpiexec -n 2 python -m examples.sharded_sr --help``; see README.md.
"""

from .hamiltonians import Hamiltonian, heisenberg, tfim
from .models import RBM, ShardedRBM
from .sampler import MetropolisSampler
from .sr import SRConfig, VMC

__all__ = ["Hamiltonian", "tfim", "heisenberg", "RBM", "ShardedRBM", "MetropolisSampler", "SRConfig", "VMC"]
