"""Every public operation lowers for CUDA: primal, JVP, VJP and vmap, and the
Krylov solvers with a communicating operator under grad.

With ``DISTLINALG_CUDA_COMPILE=<target>`` (``make test-cuda-compile``; a file
of tests/cuda_targets/, e.g. ``h100``) every program here is also compiled by
XLA's GPU compiler for that GPU, without one: JAX's CUDA plugin from PyPI
makes a deviceless topology from the target's configuration. That is where a
lowering XLA's GPU pipeline rejects shows (the CPU and the emulated handlers
never reach it); a compiler abort ends the rank, and the run fails.

Lowering for a platform needs no device of it
(``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))``), only the
CUDA lowerings, which builds with the CUDA handlers register. The emulation
passes of ``make test`` run the CUDA handlers themselves on the CPU; this
file checks what they cannot see: that no primitive (the composite protocol
primitives of differentiated point-to-point messages included) registers a
CPU-only lowering, so ``jax.jit(jax.grad(f))`` of any program compiles for
a GPU.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import distlinalg as dl
from distlinalg import comm as dlc
from distlinalg._runtime import mpi as _mpi
from distlinalg.operators import laplacian_2d

from conftest import TESTS_DIR

pytestmark = [
    pytest.mark.skipif(not _mpi.BUILD_INFO["cuda"],
                       reason="distlinalg built without the CUDA handlers (no cuda.h at build time)"),
    # What is checked here is which lowering each primitive registers for CUDA: the same rules
    # at every rank count (a 3-rank world only changes the operands' shapes). The deviceless
    # CUDA compile runs this file at 2 ranks too. (67 s of the 3-rank world.)
    pytest.mark.max_ranks(2),
]

# Custom-call targets of the comm layer (the handler registry's names).
_TARGET = re.compile(r'(?:custom_call_target\s*=\s*|stablehlo\.custom_call\s+@|call_target_name\s*=\s*)"?(distlinalg_\w+)')


_TARGETS = TESTS_DIR / "cuda_targets"
_COMPILE_TARGET = os.environ.get("DISTLINALG_CUDA_COMPILE", "").strip()


@functools.cache
def compile_device():
    """The deviceless CUDA device of ``DISTLINALG_CUDA_COMPILE``'s target, or None when unset."""
    if not _COMPILE_TARGET:
        return None
    from jax.experimental import topologies

    path = Path(_COMPILE_TARGET)
    if not path.is_file():
        path = _TARGETS / f"{_COMPILE_TARGET}.txtpb"
    if not path.is_file():
        raise FileNotFoundError(f"DISTLINALG_CUDA_COMPILE={_COMPILE_TARGET!r}: no such target configuration "
                                f"(a path, or one of {sorted(p.stem for p in _TARGETS.glob('*.txtpb'))})")
    topology = topologies.get_topology_desc(platform="cuda", target_config=path.read_text(), topology="1x1x1")
    return topology.devices[0]


def _placed(arg, device):
    """`arg`'s shape and dtype on `device` (what a deviceless compilation takes)."""
    value = jnp.asarray(arg)
    weak = not hasattr(arg, "dtype")  # a Python number: weakly typed, as jit would see it
    return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=jax.sharding.SingleDeviceSharding(device),
                                weak_type=weak)


def lower_for_cuda(fn, *args, compiled: list | None = None) -> str:
    """The StableHLO text of `fn(*args)` lowered for CUDA (raises if any part cannot be),
    compiled for the GPU of ``DISTLINALG_CUDA_COMPILE`` when it is set (its optimized HLO
    text appended to `compiled`, when given)."""
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    device = compile_device()
    if device is not None:
        placed = jax.tree_util.tree_map(lambda a: _placed(a, device), args)
        executable = jax.jit(fn).trace(*placed).lower().compile()
        if compiled is not None:
            compiled.append(executable.as_text())
    return text


def loop_vector_copies(hlo: str, length: int) -> list[str]:
    """The copies of whole vectors of `length` (any dtype) in the innermost loop bodies of optimized HLO."""
    bodies = [c for c in hlo.split("\n\n") if c.split(" ", 1)[0] in re.findall(r"body=(%[^,\s]+)", hlo)]
    bodies = [c for c in bodies if " while(" not in c]
    return [line for c in bodies for line in c.splitlines() if re.search(rf"= [a-z]+\d+\[{length}\]\S* copy\(", line)]


def targets(text: str) -> set[str]:
    return set(_TARGET.findall(text))


# Each public operation as a function of one float array whose value every
# rank supplies, shaped (size, 3) so the rooted and all-to-all operations
# see one block per rank; `ring` neighbours keep the messages matched.
def _operations(size: int, rank: int, c=None):
    """`c`: the communicator (default distlinalg's); `size` and `rank` are its."""
    right, left = (rank + 1) % size, (rank - 1) % size
    first = rank == 0

    def point_to_point(x):
        # send/recv pairs matched on every rank count: rank 0 sends right
        # first, the others receive from the left first (a chain, no cycle).
        y = x[0]
        if size == 1:
            return dlc.sendrecv(y, y * 0, source=0, dest=0, comm=c)
        if first:
            dlc.send(y, dest=right, comm=c)
            return dlc.recv(y * 0, source=left, comm=c)
        got = dlc.recv(y * 0, source=left, comm=c)
        dlc.send(y, dest=right, comm=c)
        return got

    return {
        "allreduce": lambda x: dlc.allreduce(x, op="sum", comm=c),
        "allreduce_max": lambda x: dlc.allreduce(x, op="max", comm=c),
        "allreduce_prod": lambda x: dlc.allreduce(x, op="prod", comm=c),
        "tree_allreduce": lambda x: dlc.tree_allreduce({"a": x, "b": 2 * x}, comm=c)["b"],
        "reduce": lambda x: dlc.reduce(x, "sum", root=0, comm=c),
        "bcast": lambda x: dlc.bcast(x, root=0, comm=c),
        "gather": lambda x: dlc.gather(x[rank], root=0, comm=c),
        "scatter": lambda x: dlc.scatter(x, root=0, comm=c),
        "allgather": lambda x: dlc.allgather(x[rank], comm=c),
        "reduce_scatter": lambda x: dlc.reduce_scatter(x, op="sum", comm=c),
        "alltoall": lambda x: dlc.alltoall(x, comm=c),
        "scan": lambda x: dlc.scan(x, op="sum", comm=c),
        "exscan": lambda x: dlc.exscan(x, op="sum", comm=c),
        "sendrecv": lambda x: dlc.sendrecv(x, x * 0, source=left, dest=right, comm=c),
        "sendrecv_status": lambda x: dlc.sendrecv(
            x, x * 0, source=dlc.ANY_SOURCE, dest=right, recvtag=dlc.ANY_TAG, return_status=True, comm=c
        )[0],
        "send_recv": point_to_point,
        "barrier": lambda x: (dlc.barrier(comm=c), x * 2)[1],
        "iallreduce_wait": lambda x: dlc.wait(dlc.iallreduce(x, comm=c)) + jnp.sin(x),
        "iallgather_wait": lambda x: dlc.wait(dlc.iallgather(x[rank], comm=c)) + jnp.sin(x),
        "isend_irecv_wait": lambda x: (
            lambda sent: (dlc.wait(dlc.irecv(x, source=left, comm=c)), dlc.wait(sent))[0]
        )(dlc.isend(x, dest=right, comm=c)),
        "iallreduce_overlap": lambda x: (lambda out: out[0] + out[1])(
            dlc.overlap(dlc.iallreduce(x, comm=c), jnp.sin, x)
        ),
    }


# The public operations of distlinalg.comm; a new one must be added above.
_PUBLIC = {"allreduce", "tree_allreduce", "reduce", "bcast", "gather", "scatter", "allgather", "reduce_scatter",
           "alltoall", "scan", "exscan", "send", "recv", "sendrecv", "barrier", "iallreduce", "iallgather",
           "isend", "irecv", "wait", "overlap"}


def test_every_public_operation_is_covered():
    public = {name for name in dlc.__all__ if callable(getattr(dlc, name)) and not name.endswith("_p")}
    public -= {"Status", "Communicator", "ReduceOp", "Request", "configure", "communicator", "rank", "size"}
    assert public == _PUBLIC
    covered = " ".join(_operations(2, 0))
    for name in _PUBLIC:
        assert name in covered or (name in ("send", "recv") and "send_recv" in covered), name


@pytest.fixture
def x(size):
    return jnp.asarray(np.arange(3.0 * size).reshape(size, 3) + 1.0)


def _loss(op):
    return lambda v: jnp.sum(jnp.sin(op(v)))


@pytest.mark.parametrize("name", sorted(_operations(2, 0)))
def test_operation_lowers_for_cuda_in_every_mode(name, x, rank, size):
    op = _operations(size, rank)[name]
    tangent = jnp.ones_like(x)
    programs = {
        "primal": (op, (x,)),
        "jvp": (lambda v, t: jax.jvp(op, (v,), (t,)), (x, tangent)),
        "vjp": (jax.grad(_loss(op)), (x,)),
        "vmap": (jax.vmap(op), (jnp.stack([x, 2 * x]),)),
        "vmap_of_grad": (jax.vmap(jax.grad(_loss(op))), (jnp.stack([x, 2 * x]),)),
    }
    # One rank: every operation but the point-to-point ones lowers to its local result.
    communicates = size > 1 or name in _NEED_MPI_ON_ONE_RANK
    for mode, (program, args) in programs.items():
        text = lower_for_cuda(program, *args)
        if communicates and (name != "barrier" or mode == "primal"):
            assert targets(text), f"{name} {mode}: no distlinalg custom call in the CUDA lowering"


# On a one-rank communicator these still go through MPI: a message to itself
# whose send and receive are separate calls (or a wildcard receive with its
# status), which only MPI can match.
_NEED_MPI_ON_ONE_RANK = {"sendrecv_status", "isend_irecv_wait"}


def _programs_of(op, x):
    """`op` in every AD and vmap mode: name -> (program, args)."""
    return {
        "primal": (op, (x,)),
        "jvp": (lambda v, t: jax.jvp(op, (v,), (t,)), (x, jnp.ones_like(x))),
        "vjp": (jax.grad(_loss(op)), (x,)),
        "vmap": (jax.vmap(op), (jnp.stack([x, 2 * x]),)),
        "vmap_of_grad": (jax.vmap(jax.grad(_loss(op))), (jnp.stack([x, 2 * x]),)),
        "hessian_vector": (lambda v, t: jax.jvp(jax.grad(_loss(op)), (v,), (t,)), (x, jnp.ones_like(x))),
    }


@pytest.mark.parametrize("name", sorted(_operations(2, 0)))
def test_one_rank_communicator_lowers_to_local_results(name):
    """On a one-rank communicator (COMM_SELF, on every rank of any world) each
    operation lowers, for the CPU and for CUDA, in every AD and vmap mode, to
    plain XLA operations: no custom call, so a one-rank GPU program makes no
    host round trip (issue 40). Values and derivatives equal those of the
    same programs lowered to the MPI handlers (DISTLINALG_ONE_RANK_LOCAL=0)."""
    from mpi4py import MPI

    from distlinalg.comm import _core

    op = _operations(1, 0, MPI.COMM_SELF)[name]
    x = jnp.asarray(np.arange(3.0).reshape(1, 3) + 1.0)
    for mode, (program, args) in _programs_of(op, x).items():
        if name == "isend_irecv_wait" and mode == "hessian_vector":
            continue  # (second derivatives of non-blocking messages are not supported)
        cpu = targets(jax.jit(program).trace(*args).lower().as_text()) - {"distlinalg_fence"}
        cuda = targets(lower_for_cuda(program, *args)) - {"distlinalg_fence"}
        if name in _NEED_MPI_ON_ONE_RANK:
            assert cpu and cuda, f"{name} {mode}: expected its MPI calls"
            continue
        assert not cpu and not cuda, f"{name} {mode}: custom calls on one rank: CPU {cpu}, CUDA {cuda}"
        local = jax.jit(program)(*args)
        jax.clear_caches()  # (programs are cached; the handler path must be traced and lowered afresh)
        _core.ONE_RANK_LOCAL = False
        try:
            with_handlers = jax.jit(lambda *a: program(*a))(*args)
        finally:
            _core.ONE_RANK_LOCAL = True
            jax.clear_caches()
        jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-14), local, with_handlers)


def test_differentiated_sendrecv_uses_the_flagged_protocol_on_cuda(x, rank, size, handlers_on_one_rank):
    """grad of a sendrecv goes through the flagged protocol primitive (CPU-only before)."""
    right, left = (rank + 1) % size, (rank - 1) % size
    f = lambda v: jnp.sum(dlc.sendrecv(v, v * 0, source=left, dest=right) ** 2)  # noqa: E731
    text = lower_for_cuda(jax.grad(f), x)
    assert "distlinalg_sendrecv" in targets(text)
    hessian_vector = jax.jit(lambda v, t: jax.jvp(jax.grad(f), (v,), (t,))).trace(x, x)
    assert "distlinalg_sendrecv" in targets(hessian_vector.lower(lowering_platforms=("cuda",)).as_text())


@pytest.mark.parametrize("halo", ["overlapped", "blocking"])
@pytest.mark.parametrize("solver", ["cg", "minres", "gmres", "bicgstab"])
def test_solver_with_halo_operator_lowers_for_cuda_under_grad(solver, halo, rank, size, handlers_on_one_rank):
    """grad of a solve with the sharded Laplacian (its halo exchange per matvec,
    allreduces per iteration) with respect to the right-hand side and a
    scale of the operator, and its forward-mode derivative."""
    A = laplacian_2d(6, halo=halo)
    if size == 1:  # one rank: no neighbours, no messages
        expected = {"distlinalg_allreduce"}
    elif halo == "blocking":
        expected = {"distlinalg_sendrecv", "distlinalg_allreduce"}
    else:
        expected = {"distlinalg_isend", "distlinalg_irecv", "distlinalg_fence", "distlinalg_allreduce"}
    solve = getattr(dl.solvers, solver)
    b = jnp.ones(A.input_structure.shape, A.input_structure.dtype)

    def loss(scale, b):
        x, _ = solve(lambda v: scale * (A @ v) + v, b, rtol=1e-8, layout="sharded")
        return dlc.allreduce(jnp.sum(x * x))

    text = lower_for_cuda(jax.grad(loss, argnums=(0, 1)), 1.5, b)
    assert expected <= targets(text)
    text = lower_for_cuda(lambda s, b: jax.jvp(lambda s: loss(s, b), (s,), (1.0,)), 1.5, b)
    assert expected <= targets(text)


@pytest.mark.parametrize(("solver", "kwargs"), [
    ("cg", {}), ("cg", {"method": "single_reduction"}), ("cg", {"method": "pipelined"}),
    ("minres", {}), ("gmres", {}), ("bicgstab", {}),
], ids=["cg", "cg-single_reduction", "cg-pipelined", "minres", "gmres", "bicgstab"])
def test_solvers_at_real_sizes_lower_and_compile_for_cuda(solver, kwargs, rank, size):
    """Every solver on the sharded Laplacian of 160² unknowns (≥ 64 KiB of each carried vector
    per rank up to 3 ranks: the in-place updates and their fences), jitted as users write it,
    and its gradient. The programs that aborted XLA's GPU compiler on an H100 (issue #40)."""
    A = laplacian_2d(160)
    solve = getattr(dl.solvers, solver)
    b = jnp.ones(A.input_structure.shape, A.input_structure.dtype)
    assert b.size * b.dtype.itemsize >= 64 * 1024 or size > 3
    compiled = []
    text = lower_for_cuda(lambda b: solve(A, b, **kwargs)[0], b, compiled=compiled)
    assert ("distlinalg_allreduce" in targets(text)) == (size > 1)  # one rank: local dot products
    if size > 1:
        assert "distlinalg_sendrecv" in targets(text)
    if solver in ("cg", "minres"):
        # The carried vectors are updated in place: ordered by optimization barriers
        # for the GPU (the CPU's fences are custom calls), and no copy in the loop.
        assert ("optimization_barrier" in text) == (solver == "minres" or not kwargs)  # standard CG and MINRES
        for hlo in compiled:
            assert not loop_vector_copies(hlo, b.size), loop_vector_copies(hlo, b.size)
    lower_for_cuda(jax.grad(lambda b: dlc.allreduce(jnp.sum(solve(A, b, **kwargs)[0] ** 2))), b)


@pytest.mark.parametrize("method", ["lanczos", "lobpcg"])
def test_eigsh_lowers_and_compiles_for_cuda(method, rank, size):
    """eigsh on the sharded Laplacian of 160² unknowns, jitted, and the derivative of its
    smallest eigenvalue with respect to a scale of the operator in both modes (the MINRES
    complement solves of the eigenvector tangents included): Lanczos' basis updates, LOBPCG's
    vmapped block matvec and the small eigh of both go through XLA's GPU compiler."""
    A = laplacian_2d(160)
    v0 = jnp.ones(A.input_structure.shape, A.input_structure.dtype)

    def smallest(scale):
        w, X, _ = dl.eigsh(lambda v: scale * (A @ v), 2, v0=v0, layout="sharded", method=method, tol=1e-8)
        return w[0] + dlc.allreduce(jnp.sum(X[1] ** 2 * v0))

    text = lower_for_cuda(smallest, 1.5)
    assert ("distlinalg_allreduce" in targets(text)) == (size > 1)
    lower_for_cuda(jax.grad(smallest), 1.5)
    lower_for_cuda(lambda s: jax.jvp(smallest, (s,), (1.0,)), 1.5)


@pytest.mark.parametrize("kind", ["cholesky_solve", "solve", "eigh"])
def test_dense_linalg_by_rows_lowers_and_compiles_for_cuda(kind, rank, size):
    """distlinalg.linalg's own engine (blocked Cholesky, LU with pivoting, block Jacobi) on a
    48 × 48 matrix held by uneven rows, jitted, and its derivative in both modes (the solves'
    custom_linear_solve, eigh's ring products): through XLA's GPU compiler."""
    import distlinalg.linalg as dll
    from conftest import uneven_partition

    n = 48
    p = uneven_partition(n, size)
    mine = slice(p.starts[rank], p.starts[rank + 1])
    rng = np.random.default_rng(0)
    M = rng.standard_normal((n, n))
    A = jnp.asarray((M @ M.T / n + np.eye(n))[mine])
    b = jnp.ones(p.size_of(rank))

    def loss(scale, b):
        if kind == "eigh":
            w, V = dll.eigh(scale * A, engine="distlinalg")
            return jnp.sum(w) + dlc.allreduce(jnp.sum(V ** 2 * b[:, None]))
        solver = dll.cholesky_solve if kind == "cholesky_solve" else dll.solve
        return dlc.allreduce(jnp.sum(solver(scale * A, b, engine="distlinalg", block_size=8) ** 2))

    text = lower_for_cuda(loss, 1.5, b)
    assert ("distlinalg_alltoall" in targets(text) or "distlinalg_bcast" in targets(text)
            or "distlinalg_allgather" in targets(text)) == (size > 1)
    lower_for_cuda(jax.grad(loss, argnums=(0, 1)), 1.5, b)
    lower_for_cuda(lambda s, v: jax.jvp(loss, (s, v), (1.0, v)), 1.5, b)


@pytest.mark.max_ranks(2)  # on COMM_SELF: the same programs at every rank count
@pytest.mark.parametrize(("solver", "kwargs"), [
    ("cg", {}), ("cg", {"method": "single_reduction"}), ("cg", {"method": "pipelined"}), ("minres", {}),
], ids=["cg", "cg-single_reduction", "cg-pipelined", "minres"])
def test_one_rank_solvers_at_real_sizes_have_no_mpi_calls(solver, kwargs):
    """A solve on a one-rank communicator (the sharded Laplacian of 160² unknowns on
    COMM_SELF), and its gradient, lower for CUDA to XLA's own operations only: no
    custom call at all, so no host round trip per iteration (issue 40: 1-rank CG on
    a GPU made two per iteration) and nothing but XLA's kernels in the loop. Compiled
    for the GPU under ``make test-cuda-compile``, with no vector copied in the loop."""
    from mpi4py import MPI

    A = laplacian_2d(160, comm=MPI.COMM_SELF)
    solve = getattr(dl.solvers, solver)
    b = jnp.ones(A.input_structure.shape, A.input_structure.dtype)
    compiled = []
    text = lower_for_cuda(lambda b: solve(A, b, **kwargs)[0], b, compiled=compiled)
    assert targets(text) == set(), targets(text)
    for hlo in compiled:
        assert "custom-call" not in hlo
        assert not loop_vector_copies(hlo, b.size), loop_vector_copies(hlo, b.size)
    loss = lambda b: dlc.allreduce(jnp.sum(solve(A, b, **kwargs)[0] ** 2), comm=MPI.COMM_SELF)  # noqa: E731
    assert targets(lower_for_cuda(jax.grad(loss), b)) == set()


def test_eager_twin_lowers_for_cuda(x, handlers_on_one_rank):
    """The effect-free twin that eager calls compile is registered for CUDA as well."""
    from distlinalg._runtime.mpi import ReduceOp, resolve_comm
    from distlinalg.comm import _core

    twin = _core._eager_twins[dlc.allreduce_p]
    fn = lambda v: twin.bind(v, comm=resolve_comm(None), op=ReduceOp.SUM)  # noqa: E731
    assert "distlinalg_allreduce" in targets(lower_for_cuda(fn, x))


def test_mpi_programs_compile_for_gpus_without_dynamic_slice_fusion(x, handlers_on_one_rank):
    """Modules with an MPI call are marked when lowered, and their GPU compilations get XLA's
    dynamic slice fusion off (it wraps a custom call on a slice, token included, into a fusion
    that XLA's GPU cost analysis aborts on); CPU compilations and other modules keep their
    options, and an option the caller set by name wins."""
    from jax._src import compiler
    from jax._src.lib import xla_client

    from distlinalg._runtime import patches

    def module(fn):
        return jax.jit(fn).trace(x).lower(lowering_platforms=("cuda",)).compiler_ir()

    with_mpi, without = module(lambda v: dlc.allreduce(v) + 1), module(lambda v: v + 1)
    fenced = module(lambda v: dlc.overlap(dlc.iallreduce(v), jnp.sin, v)[1])
    assert patches.MPI_MODULE_ATTRIBUTE in with_mpi.operation.attributes
    assert patches.MPI_MODULE_ATTRIBUTE in fenced.operation.attributes
    assert patches.MPI_MODULE_ATTRIBUTE not in without.operation.attributes
    assert patches.state("jax-gpu-compile-options") == "applied"
    assert hasattr(compiler.compile_or_get_cached, "_distlinalg_original")

    class Backend:
        def __init__(self, platform):
            self.platform = platform

    def overrides(platform, computation, given=()):
        options = xla_client.CompileOptions()
        options.env_option_overrides = list(given)
        return dict(patches.compile_options_for(Backend(platform), None, computation, options).env_option_overrides)

    assert overrides("cuda", with_mpi) == {"xla_gpu_enable_dynamic_slice_fusion": False}
    assert overrides("rocm", fenced) == {"xla_gpu_enable_dynamic_slice_fusion": False}
    assert overrides("cpu", with_mpi) == {}
    assert overrides("cuda", without) == {}
    mine = [("xla_gpu_enable_dynamic_slice_fusion", True), ("xla_gpu_autotune_level", 0)]
    assert overrides("cuda", with_mpi, mine) == dict(mine)
