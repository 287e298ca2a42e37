"""distlinalg.netket: NetKet's own VMC driver under mpiexec, on 1, 2 and 3 ranks.

Every distributed quantity is checked against NetKet itself, run in one
process on the samples of all ranks gathered (mpi4py allgather, rank-major):
the global statistics against ``nk.stats.statistics``, the energy and
gradient against ``nk.vqs.MCState.expect_and_grad``, the SR update against
``nk.optimizer.SR`` with a dense QGT (parameter space) and NetKet's
sample-space (MinSR/NTK) solve, up to NetKet's factor 2; a few driver steps
give bitwise identical parameters on every rank and the updates and
energies of that single-process reference. The example script runs as a
whole mpiexec job (``serial``). Skipped when NetKet is not installed
(``make test`` installs it).
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nk = pytest.importorskip("netket", reason="NetKet is not installed (pip install -e '.[netket]'; make test does)")

import distlinalg.netket as dnk  # noqa: E402
from conftest import REPO_ROOT  # noqa: E402
from run_mpi import find_mpiexec  # noqa: E402

# At most 2 ranks (CI time, issue 55): the adapter's distributed arithmetic is the operators' and solvers', which run at 3 ranks in tests/operators and tests/solvers.
pytestmark = pytest.mark.max_ranks(2)

SCRIPT = REPO_ROOT / "examples" / "netket_sr" / "vmc_sr.py"
L = 8
N_CHAINS = 4  # per rank
CHAIN_LENGTH = 16
SHIFT = 0.01

tmap = jax.tree_util.tree_map


def _leaves(tree) -> np.ndarray:
    return np.concatenate([np.asarray(x).ravel() for x in jax.tree_util.tree_leaves(tree)])


def _bitwise_same_on_every_rank(tree, comm) -> bool:
    mine = _leaves(tree).view(np.uint8)
    return all(np.array_equal(mine, other) for other in comm.allgather(mine))


def _assert_trees_close(actual, expected, rtol, atol=0.0, err_msg=""):
    np.testing.assert_allclose(_leaves(actual), _leaves(expected), rtol=rtol, atol=atol, err_msg=err_msg)


def _assert_stats_close(ours, theirs, rtol=1e-10, atol=1e-12):
    for field in ("mean", "error_of_mean", "variance", "tau_corr", "R_hat"):
        np.testing.assert_allclose(np.asarray(getattr(ours, field)), np.asarray(getattr(theirs, field)), rtol=rtol,
                                   atol=atol, err_msg=field)


@pytest.fixture(scope="module")
def ising():
    graph = nk.graph.Chain(L, pbc=True)
    hilbert = nk.hilbert.Spin(0.5, N=L)
    return hilbert, nk.operator.Ising(hilbert, graph, h=1.0, J=1.0)


MODELS = {
    # NetKet picks "real" mode for the first, "complex" for the others (holomorphic where declared)
    "real": lambda: nk.models.RBM(alpha=1, param_dtype=float),
    "holomorphic": lambda: nk.models.RBM(alpha=1, param_dtype=complex),
    "modphase": lambda: nk.models.RBMModPhase(alpha=1, param_dtype=float),  # real params, complex output
    # complex params differentiated as (Re, Im) pairs: the QGTs declared holomorphic=False
    "nonholomorphic": lambda: nk.models.RBM(alpha=1, param_dtype=complex),
}


def _state(hilbert, model: str, seed: int = 0):
    sampler = nk.sampler.MetropolisLocal(hilbert, n_chains=N_CHAINS)
    return dnk.MCState(sampler, MODELS[model](), n_samples_per_rank=N_CHAINS * CHAIN_LENGTH, n_discard_per_chain=2,
                       seed=seed)


def _gathered_reference(vstate, comm):
    """A single-process nk.vqs.MCState holding every rank's samples (rank-major chains)."""
    samples = np.asarray(vstate.samples)
    everyone = np.concatenate(comm.allgather(samples), axis=0)  # (P n_chains, chain_length, N)
    ref = nk.vqs.MCState(nk.sampler.MetropolisLocal(vstate.hilbert, n_chains=everyone.shape[0]), vstate.model,
                         variables=vstate.variables, n_samples=everyone.shape[0] * everyone.shape[1],
                         n_discard_per_chain=0)
    ref._samples = jnp.asarray(everyone)  # NetKet's cache of the current samples
    return ref


# -- statistics ---------------------------------------------------------------------------
def _chains(rng, shape, dtype, rho=0.8):
    """AR(1) chains (autocorrelated, like Markov chains)."""
    noise = rng.standard_normal(shape) + (1j * rng.standard_normal(shape) if dtype is complex else 0)
    out = np.empty(shape, dtype=noise.dtype)
    out[:, 0] = noise[:, 0]
    for t in range(1, shape[1]):
        out[:, t] = rho * out[:, t - 1] + noise[:, t]
    return out + 3.0


@pytest.mark.parametrize(("shape", "dtype"), [
    ((4, 64), float),      # blocks (fewer than 32 chains in small worlds)
    ((3, 33), complex),    # odd length: R̂ drops the last value
    ((16, 40), float),     # 32+ chains from 2 ranks on: the chain-mean estimator
    ((1, 10), float),      # too short for either estimator on 1 rank: NaN error bar
    ((1, 1), float),       # one value per rank
])
def test_statistics_equal_netket_on_gathered_chains(shape, dtype, comm):
    rng = np.random.default_rng(100 + comm.Get_rank())
    mine = _chains(rng, shape, dtype)
    everyone = np.concatenate(comm.allgather(mine), axis=0)
    expected = nk.stats.statistics(jnp.asarray(everyone))
    ours = jax.jit(lambda x: dnk.statistics(x, comm=comm))(mine)
    assert isinstance(ours, nk.stats.Stats)
    _assert_stats_close(ours, expected)
    assert _bitwise_same_on_every_rank([ours.mean, ours.error_of_mean, ours.tau_corr, ours.R_hat], comm)


def test_statistics_eagerly_of_a_vector_is_one_chain(comm):
    mine = _chains(np.random.default_rng(comm.Get_rank()), (1, 50), float)
    everyone = np.concatenate(comm.allgather(mine), axis=0)
    _assert_stats_close(dnk.statistics(mine[0], comm=comm), nk.stats.statistics(jnp.asarray(everyone)))


# -- the variational state ------------------------------------------------------------------
def test_state_counts_seeds_and_identical_parameters(ising, comm):
    hilbert, _ = ising
    size, rank = comm.Get_size(), comm.Get_rank()
    vstate = dnk.MCState(nk.sampler.MetropolisLocal(hilbert, n_chains=N_CHAINS), MODELS["real"](), n_samples=100,
                         seed=3)
    per_rank = int(np.ceil(100 / (N_CHAINS * size))) * N_CHAINS
    assert vstate.n_samples_per_rank == per_rank and vstate.n_samples == per_rank * size
    assert vstate.samples.shape == (N_CHAINS, per_rank // N_CHAINS, L)
    assert _bitwise_same_on_every_rank(vstate.parameters, comm)
    everyone = comm.allgather(np.asarray(vstate.samples))
    assert all(not np.array_equal(everyone[0], other) for other in everyone[1:]), "ranks sampled the same chains"
    # Rank 0 is NetKet's own state with the same seed and per-rank sample count.
    plain = nk.vqs.MCState(nk.sampler.MetropolisLocal(hilbert, n_chains=N_CHAINS), MODELS["real"](),
                           n_samples=per_rank, seed=3)
    assert np.array_equal(_leaves(plain.parameters), _leaves(vstate.parameters))
    if rank == 0:
        np.testing.assert_array_equal(np.asarray(plain.samples), np.asarray(vstate.samples))
    # A checkpoint written by rank 0 (flax serialisation, as NetKet's loggers do) restores the
    # parameters and the total sample count everywhere, and the ranks' chains differ again.
    from flax import serialization

    restored = serialization.from_bytes(vstate, comm.bcast(serialization.to_bytes(vstate), root=0))
    assert type(restored) is type(vstate) and restored.n_samples == vstate.n_samples
    assert np.array_equal(_leaves(restored.parameters), _leaves(vstate.parameters))
    keys = comm.allgather(np.asarray(jax.random.key_data(restored.sampler_state.rng)))
    assert all(not np.array_equal(keys[0], other) for other in keys[1:])
    # No seed: rank 0 draws one for everyone.
    unseeded = dnk.MCState(nk.sampler.MetropolisLocal(hilbert, n_chains=N_CHAINS), MODELS["real"](),
                           n_samples_per_rank=32)
    assert _bitwise_same_on_every_rank(unseeded.parameters, comm)


# -- energy, gradient and the SR preconditioner -------------------------------------------------
def _netket_dense_sr(ref, model):
    """nk.optimizer.SR with a dense QGT and a Cholesky solve; holomorphic where declared."""
    kwargs = {"holomorphic": True} if model == "holomorphic" else {}
    return nk.optimizer.SR(qgt=nk.optimizer.qgt.QGTJacobianDense, solver=nk.optimizer.solver.cholesky,
                           diag_shift=SHIFT, **kwargs)


# The modes and spaces on 1 and 2 ranks; the oversubscribed 3-rank world runs the first (its
# collectives are those of every case) and the driver test.
TWO = pytest.mark.max_ranks(2)


@pytest.mark.parametrize(("model", "space", "solver"), [
    ("real", "parameters", "cg"),
    pytest.param("real", "samples", "cg", marks=TWO),
    pytest.param("holomorphic", "parameters", "cg", marks=TWO),  # complex RBM
    pytest.param("modphase", "samples", "cholesky", marks=TWO),  # real params, complex output: "complex" mode
])
def test_energy_gradient_and_sr_update_equal_netket_on_gathered_samples(ising, model, space, solver, comm):
    hilbert, H = ising
    vstate = _state(hilbert, model)
    stats, grad = vstate.expect_and_grad(H)
    ref = _gathered_reference(vstate, comm)
    ref_stats, ref_grad = ref.expect_and_grad(H)
    _assert_stats_close(stats, ref_stats)
    _assert_stats_close(vstate.expect(H), ref_stats)
    _assert_trees_close(grad, ref_grad, rtol=1e-10, atol=1e-13)
    assert _bitwise_same_on_every_rank(grad, comm)

    mode = "holomorphic" if model == "holomorphic" else None
    sr = dnk.SR(diag_shift=SHIFT, space=space, solver=solver, rtol=1e-13, mode=mode)
    update = sr(vstate, grad, 0)
    assert int(sr.info.reason) > 0, sr.info
    assert _bitwise_same_on_every_rank(update, comm)
    expected = _netket_dense_sr(ref, model)(ref, ref_grad, 0)
    _assert_trees_close(update, expected, rtol=1e-8, atol=1e-10, err_msg="against nk.optimizer.SR")

    # NetKet's sample-space (NTK / MinSR) solve of the same system: 2 δ as well.
    from netket._src.ngd.sr_srt_common import srt

    e_loc = ref.local_estimators(H).data.reshape(-1)
    ntk_mode = "real" if model == "real" else "complex"
    ntk, _, _ = srt(ref._apply_fun, e_loc, ref.parameters, ref.model_state, ref.samples.reshape(-1, L),
                    diag_shift=SHIFT, solver_fn=lambda A, b: jax.scipy.linalg.solve(A, b, assume_a="pos"),
                    mode=ntk_mode)
    _assert_trees_close(update, ntk, rtol=1e-8, atol=1e-10, err_msg="against NetKet's sample-space solve")


def test_sr_needs_local_energies(ising, comm):
    hilbert, H = ising
    plain = nk.vqs.MCState(nk.sampler.MetropolisLocal(hilbert, n_chains=N_CHAINS), MODELS["real"](),
                           n_samples=N_CHAINS * CHAIN_LENGTH, seed=0, sampler_seed=comm.Get_rank())
    with pytest.raises(TypeError, match="local energies"):
        dnk.SR()(plain, None, 0)
    # With the Hamiltonian it computes them itself: the update of all ranks' samples.
    update = dnk.SR(hamiltonian=H, rtol=1e-13)(plain, None, 0)
    ref = _gathered_reference(plain, comm)
    expected = _netket_dense_sr(ref, "real")(ref, ref.expect_and_grad(H)[1], 0)
    _assert_trees_close(update, expected, rtol=1e-8, atol=1e-10)


# -- the driver ---------------------------------------------------------------------------------
def test_driver_steps_match_single_process_netket(ising, comm):
    hilbert, H = ising
    lr = 0.05
    vstate = _state(hilbert, "real", seed=2)
    schedule = lambda step: SHIFT * (1 + step)  # noqa: E731  (a scheduled shift goes through `step`)
    driver = nk.driver.VMC(H, nk.optimizer.Sgd(lr), variational_state=vstate,
                           preconditioner=dnk.SR(diag_shift=schedule, rtol=1e-13))
    records = []

    class Record(nk.callbacks.AbstractCallback):
        def before_parameter_update(self, step, log_data, driver):
            state = driver.state
            records.append({"params": state.parameters, "samples": np.asarray(state.samples),
                            "energy": log_data["Energy"], "update": driver._dp, "step": step})

    driver.run(3, out=(), show_progress=False, callback=Record())
    assert len(records) == 3
    records.append({"params": vstate.parameters})
    for before, after in zip(records[:-1], records[1:]):
        assert _bitwise_same_on_every_rank(before["params"], comm)
        assert _bitwise_same_on_every_rank(before["energy"].mean, comm)
        everyone = np.concatenate(comm.allgather(before["samples"]), axis=0)
        ref = nk.vqs.MCState(nk.sampler.MetropolisLocal(hilbert, n_chains=everyone.shape[0]), vstate.model,
                             variables={"params": before["params"]}, n_samples=everyone[..., 0].size)
        ref._samples = jnp.asarray(everyone)
        ref_energy, ref_grad = ref.expect_and_grad(H)
        _assert_stats_close(before["energy"], ref_energy)
        sr = nk.optimizer.SR(qgt=nk.optimizer.qgt.QGTJacobianDense, solver=nk.optimizer.solver.cholesky,
                             diag_shift=schedule)
        expected = sr(ref, ref_grad, before["step"])
        _assert_trees_close(before["update"], expected, rtol=1e-8, atol=1e-10)
        _assert_trees_close(after["params"], tmap(lambda p, u: p - lr * u, before["params"], before["update"]),
                            rtol=1e-14, atol=1e-15)
    assert _bitwise_same_on_every_rank(vstate.parameters, comm)


# -- whole programs -------------------------------------------------------------------------------
def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DISTLINALG_", "PYTEST_"))}
    env.update(extra)
    return env


@pytest.mark.serial
def test_importing_distlinalg_netket_does_not_import_netket():
    code = ("import sys, distlinalg, distlinalg.netket as d; assert 'netket' not in sys.modules, 'imported'; "
            "d.SR(diag_shift=0.1); assert 'netket' not in sys.modules")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.serial
def test_example_script_on_two_ranks():
    """examples/netket_sr/vmc_sr.py as a 2-rank job, 25 steps: the last line is the accuracy."""
    cmd = find_mpiexec() + ["-n", "2", sys.executable, str(SCRIPT)]
    try:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=_env(VMC_SR_ITERS="25"), capture_output=True, text=True,
                              timeout=240, start_new_session=True)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"vmc_sr.py still running after {err.timeout} s: {err.output}")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert "tfim L=16, 2 rank(s), 1024 samples per step, 25 steps" in proc.stdout, proc.stdout
    match = re.search(r"relative error (\d\.\de-\d\d)$", lines[-1])
    assert match, lines[-1]
    assert float(match.group(1)) < 3e-3, lines[-1]  # 25 steps from a random RBM: about 1e-3


@pytest.mark.serial
def test_tfim_spectrum_example_against_lanczos_ed():
    """examples/eigsh_tfim/tfim_spectrum.py at L = 12 on 3 ranks: distlinalg.eigsh on the rows
    split over the ranks against NetKet's lanczos_ed, and dE0/dh by AD against a central difference."""
    script = REPO_ROOT / "examples" / "eigsh_tfim" / "tfim_spectrum.py"
    cmd = find_mpiexec() + ["-n", "3", sys.executable, str(script), "12"]
    try:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=300,
                              start_new_session=True)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"tfim_spectrum.py still running after {err.timeout} s: {err.output}")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "TFIM L=12 (h=1.0, J=1.0), 4096 rows over 3 rank(s)" in proc.stdout, proc.stdout
    assert "converged True" in proc.stdout, proc.stdout
    energies = re.search(r"largest relative difference (\S+)", proc.stdout)
    assert energies and float(energies.group(1)) < 1e-10, proc.stdout
    derivative = re.search(r"dE0/dh: AD (\S+) .* relative difference (\S+)$", proc.stdout.strip().splitlines()[-1])
    assert derivative and float(derivative.group(2)) < 1e-6, proc.stdout


# -- NetKet's own SR paths on a dnk.MCState ------------------------------------------------------
QGT = nk.optimizer.qgt
SOLVERS = {
    "cg": jax.scipy.sparse.linalg.cg,  # nk.optimizer.SR's default
    "cholesky": nk.optimizer.solver.cholesky,
    "svd": nk.optimizer.solver.svd,
    "pinv_smooth": nk.optimizer.solver.pinv_smooth,
}


def _qgt_cases(model: str):
    """(name, QGT constructor as a user writes it) for every NetKet QGT type."""
    holomorphic = {"holomorphic": True} if model == "holomorphic" else {}
    if model == "nonholomorphic":
        holomorphic = {"holomorphic": False}
    return [
        ("QGTAuto", None),
        ("QGTOnTheFly", QGT.QGTOnTheFly(**holomorphic) if holomorphic else QGT.QGTOnTheFly),
        ("QGTOnTheFly chunked", QGT.QGTOnTheFly(chunk_size=16, **holomorphic)),
        ("QGTJacobianDense", QGT.QGTJacobianDense(**holomorphic) if holomorphic else QGT.QGTJacobianDense),
        ("QGTJacobianDense diag_scale", QGT.QGTJacobianDense(diag_scale=0.05, **holomorphic)),
        ("QGTJacobianPyTree chunked", QGT.QGTJacobianPyTree(chunk_size=16, **holomorphic)),
    ]


# The oversubscribed 3-rank world runs the real model (an odd rank count); 1 and 2 ranks all three.
@pytest.mark.parametrize("model", ["real", pytest.param("holomorphic", marks=TWO), pytest.param("modphase", marks=TWO),
                                   pytest.param("nonholomorphic", marks=TWO)])
def test_netket_sr_with_every_qgt_type_is_global(ising, model, comm):
    """nk.optimizer.SR(qgt=...) unchanged on a dnk.MCState: the QGT of every type is NetKet's
    on the gathered samples (product, dense form, solve), and the update is bit for bit the
    same on every rank."""
    hilbert, H = ising
    vstate = _state(hilbert, model)
    _, grad = vstate.expect_and_grad(H)
    ref = _gathered_reference(vstate, comm)
    _, ref_grad = ref.expect_and_grad(H)
    tight_cg = functools.partial(jax.scipy.sparse.linalg.cg, tol=1e-12)
    for name, qgt in _qgt_cases(model):
        S = vstate.quantum_geometric_tensor(qgt) if qgt is not None else vstate.quantum_geometric_tensor()
        S_ref = ref.quantum_geometric_tensor(qgt) if qgt is not None else ref.quantum_geometric_tensor()
        if comm.Get_size() == 1:  # one rank holds every sample: NetKet's own QGT
            assert type(S) is type(S_ref), (name, type(S))
        else:  # NetKet's class, subclassed, over every rank's samples
            assert type(S).__name__.startswith("Distributed") and type(S).__mro__[1] is type(S_ref), (name, type(S))
        _assert_trees_close(S @ grad, S_ref @ ref_grad, rtol=1e-10, atol=1e-14, err_msg=name)
        # NetKet has no dense form of the on-the-fly QGT of complex parameters (holomorphic or not).
        if not (name.startswith("QGTOnTheFly") and model in ("holomorphic", "nonholomorphic")) and "Auto" not in name:
            dense = np.asarray(S.to_dense())
            np.testing.assert_allclose(dense, np.asarray(S_ref.to_dense()), rtol=1e-10, atol=1e-14, err_msg=name)
            assert _bitwise_same_on_every_rank(dense, comm), name
        # The preconditioner as the driver calls it.
        sr = nk.optimizer.SR(qgt=qgt, solver=tight_cg, diag_shift=SHIFT)
        update = sr(vstate, grad, 0)
        expected = nk.optimizer.SR(qgt=qgt, solver=tight_cg, diag_shift=SHIFT)(ref, ref_grad, 0)
        _assert_trees_close(update, expected, rtol=1e-7, atol=1e-10, err_msg=name)
        assert _bitwise_same_on_every_rank(update, comm), name
    # Every solver of NetKet's (the default cg with its default tolerance too) on the dense QGT.
    for name, solver in SOLVERS.items():
        update = nk.optimizer.SR(solver=solver, diag_shift=SHIFT)(vstate, grad, 0)
        expected = nk.optimizer.SR(solver=solver, diag_shift=SHIFT)(ref, ref_grad, 0)
        rtol = 1e-4 if name == "cg" else 1e-7  # cg stops at NetKet's tol=1e-5 on both sides
        _assert_trees_close(update, expected, rtol=rtol, atol=1e-8, err_msg=name)
        assert _bitwise_same_on_every_rank(update, comm), name


VMC_SR_CASES = [
    {"use_ntk": False},
    {"use_ntk": True, "on_the_fly": False},
    {"use_ntk": True, "momentum": 0.8, "proj_reg": 1.0, "chunk_size_bwd": 16},  # on the fly (NetKet's default)
    {"use_ntk": False, "momentum": 0.5, "linear_solver": nk.optimizer.solver.pinv_smooth},
]


@pytest.mark.parametrize("model", ["real", pytest.param("holomorphic", marks=TWO), pytest.param("modphase", marks=TWO)])
def test_vmc_sr_steps_equal_netket_on_gathered_samples(ising, model, comm):
    """nk.driver.VMC_SR unchanged on a dnk.MCState: two steps of each formulation (SR and
    NTK, SPRING momentum, proj_reg, chunked, another solver, a scheduled shift) give NetKet's
    update on the gathered samples, the same on every rank."""
    import optax

    hilbert, H = ising
    base = nk.driver.VMC_SR.compute_loss_and_update.__wrapped__  # NetKet's own step
    for case in VMC_SR_CASES:
        vstate = _state(hilbert, model)
        options = {"diag_shift": lambda step: SHIFT * (1 + step), **case}
        driver = nk.driver.VMC_SR(H, optax.sgd(0.01), variational_state=vstate, **options)
        reference = nk.driver.VMC_SR(H, optax.sgd(0.01), variational_state=_gathered_reference(vstate, comm),
                                     **options)
        for step in range(2):
            vstate.reset()
            reference._variational_state = _gathered_reference(vstate, comm)
            reference._old_updates, reference._step_count = driver._old_updates, step
            driver._step_count = step
            stats, update = driver.compute_loss_and_update()
            ref_stats, expected = base(reference)
            assert _bitwise_same_on_every_rank([update, stats.mean], comm), case
            _assert_trees_close(update, expected, rtol=1e-9, atol=1e-12, err_msg=str(case))
            np.testing.assert_allclose(np.asarray(stats.mean), np.asarray(ref_stats.mean), rtol=1e-12)


def test_training_with_netket_sr_paths_keeps_parameters_identical(ising, comm):
    """A short run of each SR path NetKet users write: identical parameters on every rank, and
    the energy goes down from the random RBM towards the ground state."""
    import optax

    hilbert, H = ising
    drivers = {
        "VMC + nk.optimizer.SR": lambda vs: nk.driver.VMC(H, nk.optimizer.Sgd(0.05), variational_state=vs,
                                                          preconditioner=nk.optimizer.SR(diag_shift=0.05)),
        "VMC_SR": lambda vs: nk.driver.VMC_SR(H, optax.sgd(0.05), variational_state=vs, diag_shift=0.05),
        "VMC_SR ntk": lambda vs: nk.driver.VMC_SR(H, optax.sgd(0.05), variational_state=vs, diag_shift=0.05,
                                                  use_ntk=True),
    }
    for name, make in drivers.items():
        vstate = _state(hilbert, "real", seed=1)
        first = vstate.expect(H).mean.real
        make(vstate).run(8, out=(), show_progress=False)
        assert _bitwise_same_on_every_rank(vstate.parameters, comm), name
        assert vstate._distlinalg_updates == 8 or comm.Get_size() == 1, name
        last = vstate.expect(H).mean.real
        assert last < first - 0.5, (name, first, last)


def test_paths_that_cannot_be_global_raise_on_every_rank(ising, comm):
    hilbert, H = ising
    vstate = _state(hilbert, "real")
    import netket.experimental as nkx

    with pytest.raises(NotImplementedError, match="TDVP on a distlinalg.netket.MCState"):
        nkx.driver.TDVP(H, vstate, nkx.dynamics.Euler(dt=0.01))
    with pytest.raises(NotImplementedError, match="Infidelity_SR on a distlinalg.netket.MCState"):
        nk.driver.Infidelity_SR(vstate, nk.optimizer.Sgd(0.01), diag_shift=0.01, variational_state=vstate)

    class MyVMC(nk.driver.VMC):  # a step of its own would see this rank's samples
        def compute_loss_and_update(self):
            return super().compute_loss_and_update()

    with pytest.raises(NotImplementedError, match="MyVMC"):
        MyVMC(H, nk.optimizer.Sgd(0.01), variational_state=vstate)
    with pytest.raises(NotImplementedError, match="not one of NetKet's"):
        vstate.quantum_geometric_tensor(lambda vs, **kw: None)
    # A plain NetKet state is untouched by the routes.
    plain = nk.vqs.MCState(nk.sampler.MetropolisLocal(hilbert, n_chains=N_CHAINS), MODELS["real"](), n_samples=64)
    assert type(plain.quantum_geometric_tensor(QGT.QGTJacobianDense)).__name__ == "QGTJacobianDenseT"


def test_parameters_that_drift_apart_raise_on_every_rank(ising, comm):
    hilbert, _ = ising
    vstate = _state(hilbert, "real")
    drifted = tmap(lambda p: p + 1e-12 * comm.Get_rank(), vstate.parameters)  # one rank's own update
    if comm.Get_size() == 1:  # nothing to compare with: the check is off
        assert not vstate._distlinalg_check
        vstate.parameters = drifted
        return
    with pytest.raises(RuntimeError, match=r"after parameter update 1 the parameters differ between ranks"):
        vstate.parameters = drifted
    from distlinalg.comm import bcast

    vstate.parameters = bcast(vstate.parameters, comm=comm)  # rank 0's everywhere: identical again
    assert vstate._distlinalg_updates == 2
    quiet = dnk.MCState(nk.sampler.MetropolisLocal(hilbert, n_chains=N_CHAINS), MODELS["real"](),
                        n_samples_per_rank=32, seed=0, check_parameters=False)
    quiet.parameters = drifted  # the check is off


def test_unequal_sample_counts_raise_on_every_rank(ising, comm):
    hilbert, _ = ising
    chains = 2 + 2 * (comm.Get_rank() == 0)  # rank 0: 4 chains of 2 steps, the others 2 chains of 3

    def make():
        return dnk.MCState(nk.sampler.MetropolisLocal(hilbert, n_chains=chains), MODELS["real"](),
                           n_samples_per_rank=6, seed=0)

    if comm.Get_size() == 1:  # one rank: nothing to differ from
        assert make().n_samples_per_rank == 8
        return
    with pytest.raises(ValueError, match="between 6 and 8 samples per step"):
        make()


@pytest.mark.serial
@pytest.mark.parametrize(("script", "variable", "args", "expected"), [
    ("netket_sr.py", "NETKET_SR_ITERS", [], "nk.optimizer.SR, 2 rank(s): E = "),
    ("netket_vmc_sr.py", "NETKET_VMC_SR_ITERS", ["ntk"], "nk.driver.VMC_SR(use_ntk=True), 2 rank(s): E = "),
])
def test_netket_documented_scripts_on_two_ranks(script, variable, args, expected):
    """NetKet's own SR scripts with only the state changed (examples/netket_sr), as 2-rank jobs,
    a few steps each: they run to the end and print the energy of all ranks' samples."""
    cmd = find_mpiexec() + ["-n", "2", sys.executable, str(REPO_ROOT / "examples" / "netket_sr" / script), *args]
    try:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=_env(**{variable: "5"}), capture_output=True, text=True,
                              timeout=240, start_new_session=True)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"{script} still running after {err.timeout} s: {err.output}")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert expected in proc.stdout, proc.stdout
