"""distlinalg.netket's NTK solvers: ``VMC_SR(use_ntk=True)`` with the kernel split by rows.

``dnk.cholesky_distributed`` / ``dnk.pinv_smooth_distributed`` as the driver's
``linear_solver`` on a ``dnk.MCState`` (and NetKet's default solver, which they
replace on more than one rank): each rank passes its rows of the NTK and of the
right-hand side to distlinalg.linalg and uses its rows of x. Checked against
NetKet's one-process ``VMC_SR`` with ``cholesky`` / ``pinv_smooth`` /
``cholesky_with_fallback`` on the samples of all ranks gathered (as in
test_netket_mpi.py), bit for bit the same on every rank, and that no rank
gathers the kernel. ``dnk.MCState`` holds as many samples on every rank (it
raises otherwise, see test_netket_mpi.py), so the row split is always even.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nk = pytest.importorskip("netket", reason="NetKet is not installed (pip install -e '.[netket]'; make test does)")

import distlinalg.netket as dnk  # noqa: E402
from distlinalg.netket import _vmc_sr  # noqa: E402

L = 8
N_CHAINS = 4  # per rank
CHAIN_LENGTH = 4
SHIFT = 0.01
TWO = pytest.mark.max_ranks(2)

MODELS = {
    "real": lambda: nk.models.RBM(alpha=1, param_dtype=float),  # "real" mode
    "modphase": lambda: nk.models.RBMModPhase(alpha=1, param_dtype=float),  # "complex" mode: 2 rows a sample
}


def _leaves(tree) -> np.ndarray:
    return np.concatenate([np.asarray(x).ravel() for x in jax.tree_util.tree_leaves(tree)])


def _bitwise_same_on_every_rank(tree, comm) -> bool:
    mine = _leaves(tree).view(np.uint8)
    return all(np.array_equal(mine, other) for other in comm.allgather(mine))


@pytest.fixture(scope="module")
def ising():
    hilbert = nk.hilbert.Spin(0.5, N=L)
    return hilbert, nk.operator.Ising(hilbert, nk.graph.Chain(L, pbc=True), h=1.0, J=1.0)


def _state(hilbert, model):
    return dnk.MCState(nk.sampler.MetropolisLocal(hilbert, n_chains=N_CHAINS), MODELS[model](),
                       n_samples_per_rank=N_CHAINS * CHAIN_LENGTH, n_discard_per_chain=2, seed=0)


def _gathered_reference(vstate, comm):
    """A single-process nk.vqs.MCState holding every rank's samples (rank-major chains)."""
    everyone = np.concatenate(comm.allgather(np.asarray(vstate.samples)), axis=0)
    ref = nk.vqs.MCState(nk.sampler.MetropolisLocal(vstate.hilbert, n_chains=everyone.shape[0]), vstate.model,
                         variables=vstate.variables, n_samples=everyone.shape[0] * everyone.shape[1],
                         n_discard_per_chain=0)
    ref._samples = jnp.asarray(everyone)
    return ref


@pytest.fixture
def row_solves(monkeypatch):
    """The shapes of (A, b) every distlinalg.linalg solve is traced with; gathering the kernel fails."""
    import distlinalg.linalg as dll

    seen = []
    for name in ("cholesky_solve", "pinv_smooth"):
        original = getattr(dll, name)

        def record(A, b, *args, _original=original, **kwargs):
            seen.append((tuple(A.shape), tuple(b.shape)))
            return _original(A, b, *args, **kwargs)

        monkeypatch.setattr(dll, name, record)

    def no_gather(rows, comm):
        raise AssertionError("the NTK was gathered")

    monkeypatch.setattr(_vmc_sr, "_gather_rows", no_gather)
    for step in (_vmc_sr.sr_update, _vmc_sr.ntk_onthefly_update):  # traced afresh, so the patches are seen
        step.clear_cache()
    yield seen
    for step in (_vmc_sr.sr_update, _vmc_sr.ntk_onthefly_update):
        step.clear_cache()


def _steps_against_netket(H, vstate, comm, options, reference_options, steps=2):
    """`steps` driver steps on the dnk.MCState and NetKet's own step on the gathered samples,
    with the same momentum buffer: (our updates, NetKet's, our infos)."""
    import optax

    base = nk.driver.VMC_SR.compute_loss_and_update.__wrapped__  # NetKet's own step
    driver = nk.driver.VMC_SR(H, optax.sgd(0.01), variational_state=vstate, **options)
    reference = nk.driver.VMC_SR(H, optax.sgd(0.01), variational_state=_gathered_reference(vstate, comm),
                                 **reference_options)
    ours, theirs, infos = [], [], []
    for step in range(steps):
        vstate.reset()
        reference._variational_state = _gathered_reference(vstate, comm)
        reference._old_updates, reference._step_count = driver._old_updates, step
        driver._step_count = step
        ours.append(driver.compute_loss_and_update()[1])
        theirs.append(base(reference)[1])
        infos.append(driver.info)
    return ours, theirs, infos


SOLVERS = {  # ours, NetKet's
    "cholesky": (dnk.cholesky_distributed, lambda: nk.optimizer.solver.cholesky),
    "pinv_smooth": (dnk.pinv_smooth_distributed(rtol=1e-12, rtol_smooth=1e-12),
                    lambda: nk.optimizer.solver.pinv_smooth(rtol=1e-12, rtol_smooth=1e-12)),
}


# Each solver on each path (the lazy NTK, NetKet's default, and the Jacobian's) and each mode,
# SPRING (two steps: the second has a momentum buffer) on each path. Time: on one rank both
# sides are NetKet's own step, so only one case runs there, as in the 3-rank world (whose lazy NTK
# steps with NetKet's default solver run in test_netket_mpi.py).
@pytest.mark.parametrize(("model", "on_the_fly", "solver", "spring"), [
    pytest.param("real", True, "cholesky", True, marks=TWO),
    pytest.param("modphase", True, "pinv_smooth", False, marks=TWO),
    ("real", False, "pinv_smooth", True),
    pytest.param("modphase", False, "cholesky", True, marks=TWO),
])
def test_distributed_ntk_solvers_equal_netket_on_gathered_samples(ising, model, on_the_fly, solver, spring, comm,
                                                                   row_solves):
    """SPRING steps (momentum, proj_reg, a scheduled shift): NetKet's update on the gathered
    samples, bit for bit the same on every rank, from this rank's rows of the kernel only."""
    if comm.Get_size() == 1 and (on_the_fly or model != "real"):
        pytest.skip("one rank: NetKet's own step on both sides (one case runs it with these solvers)")
    hilbert, H = ising
    ours, netket_solver = SOLVERS[solver]
    per_sample = 1 if model == "real" else 2
    rows = N_CHAINS * CHAIN_LENGTH * per_sample
    common = {"diag_shift": lambda step: SHIFT * (1 + step), "use_ntk": True, "on_the_fly": on_the_fly,
              "proj_reg": 1.0, **({"momentum": 0.8} if spring else {})}
    updates, expected, infos = _steps_against_netket(H, _state(hilbert, model), comm,
                                                     {**common, "linear_solver": ours},
                                                     {**common, "linear_solver": netket_solver()},
                                                     steps=2 if spring else 1)
    for update, reference, info in zip(updates, expected, infos):
        np.testing.assert_allclose(_leaves(update), _leaves(reference), rtol=1e-9, atol=1e-12)
        assert _bitwise_same_on_every_rank([update, info], comm)
    if comm.Get_size() > 1:  # this rank's rows of the kernel and of the right-hand side, traced once
        assert row_solves == [((rows, rows * comm.Get_size()), (rows,))], row_solves
    if solver == "pinv_smooth":
        assert set(infos[-1]) == {"eval_min", "eval_max", "rank", "cond_number"}


def test_default_solver_is_distributed_on_more_than_one_rank(ising, comm, row_solves):
    """NetKet's default (cholesky, pinv_smooth on NaN/Inf) keeps the kernel split on P > 1, and
    falls back as NetKet's does: an indefinite kernel (a negative shift) takes pinv_smooth."""
    hilbert, H = ising
    n_local = N_CHAINS * CHAIN_LENGTH
    for shift, fallback in ((SHIFT, False), (-0.5, True)):  # one program: the shift is traced
        options = {"diag_shift": shift, "use_ntk": True, "on_the_fly": False}  # the switch is the same for both
        updates, expected, infos = _steps_against_netket(H, _state(hilbert, "real"), comm, options, options,
                                                         steps=1)
        np.testing.assert_allclose(_leaves(updates[0]), _leaves(expected[0]), rtol=1e-9, atol=1e-12,
                                   err_msg=f"shift {shift}")
        assert _bitwise_same_on_every_rank([updates[0], infos[0]], comm)
        assert bool(infos[0]["solver_fallback"]) is fallback
    if comm.Get_size() > 1:  # the Cholesky solve and its fallback, both on rows
        mine = ((n_local, n_local * comm.Get_size()), (n_local,))
        assert row_solves == [mine, mine], row_solves
    else:  # one rank: NetKet's own step and solver
        assert row_solves == []


def test_solvers_called_directly_solve_a_whole_matrix(comm):
    """Outside the driver of a dnk.MCState: NetKet's solvers of a whole (replicated) matrix, on
    every rank by itself; a rank's rows cannot be told from a whole matrix there, so a
    non-square matrix raises; keywords alone give hashable partials."""
    rng = np.random.default_rng(7)  # the same matrix on every rank
    M = rng.standard_normal((12, 12))
    A = jnp.asarray(M @ M.T + 0.1 * np.eye(12))
    b = jnp.asarray(rng.standard_normal(12))
    x, info = dnk.cholesky_distributed(A, b)
    np.testing.assert_allclose(x, nk.optimizer.solver.cholesky(A, b)[0], rtol=1e-10)
    assert info is None
    solver = dnk.pinv_smooth_distributed(rtol=1e-6)
    assert solver == dnk.pinv_smooth_distributed(rtol=1e-6) and hash(solver) == hash(
        dnk.pinv_smooth_distributed(rtol=1e-6))
    assert solver != dnk.pinv_smooth_distributed(rtol=1e-7)
    x, info = jax.jit(solver)(A, {"b": b})  # pytrees, under jit, as NetKet's solvers
    x_ref, info_ref = nk.optimizer.solver.pinv_smooth(rtol=1e-6)(A, {"b": b})
    np.testing.assert_allclose(x["b"], x_ref["b"], rtol=1e-10)
    for key, value in info_ref.items():
        np.testing.assert_allclose(info[key], value, rtol=1e-10, err_msg=key)
    with pytest.raises(ValueError, match="whole, replicated N x N matrix"):
        dnk.cholesky_distributed(A[:6], b[:6])
    with pytest.raises(TypeError, match="unexpected keyword"):
        dnk.cholesky_distributed(tile=64)
