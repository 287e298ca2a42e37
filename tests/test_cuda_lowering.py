"""Every public operation lowers for CUDA: primal, JVP, VJP and vmap, and the
Krylov solvers with a communicating operator under grad.

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

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import distlinalg as dl
from distlinalg import _mpi, comm as dlc
from distlinalg.operators import laplacian_2d

pytestmark = pytest.mark.skipif(
    not _mpi.BUILD_INFO["cuda"], reason="distlinalg built without the CUDA handlers (no cuda.h at build time)"
)

# Custom-call targets of the comm layer (the handler registry's names).
_TARGET = re.compile(r'(?:custom_call_target\s*=\s*|stablehlo\.custom_call\s+@|call_target_name\s*=\s*)"?(distlinalg_\w+)')


def lower_for_cuda(fn, *args) -> str:
    """The StableHLO text of `fn(*args)` lowered for CUDA (raises if any part cannot be)."""
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def targets(text: str) -> set[str]:
    return set(_TARGET.findall(text))


# Each public operation as a function of one float array whose value every
# rank supplies, shaped (size, 3) so the rooted and all-to-all operations
# see one block per rank; `ring` neighbours keep the messages matched.
def _operations(size: int, rank: int):
    right, left = (rank + 1) % size, (rank - 1) % size
    first = rank == 0

    def point_to_point(x):
        # send/recv pairs matched on every rank count: rank 0 sends right
        # first, the others receive from the left first (a chain, no cycle).
        y = x[0]
        if size == 1:
            return dlc.sendrecv(y, y * 0, source=0, dest=0)
        if first:
            dlc.send(y, dest=right)
            return dlc.recv(y * 0, source=left)
        got = dlc.recv(y * 0, source=left)
        dlc.send(y, dest=right)
        return got

    return {
        "allreduce": lambda x: dlc.allreduce(x, op="sum"),
        "allreduce_max": lambda x: dlc.allreduce(x, op="max"),
        "allreduce_prod": lambda x: dlc.allreduce(x, op="prod"),
        "tree_allreduce": lambda x: dlc.tree_allreduce({"a": x, "b": 2 * x})["b"],
        "reduce": lambda x: dlc.reduce(x, "sum", root=0),
        "bcast": lambda x: dlc.bcast(x, root=0),
        "gather": lambda x: dlc.gather(x[rank], root=0),
        "scatter": lambda x: dlc.scatter(x, root=0),
        "allgather": lambda x: dlc.allgather(x[rank]),
        "reduce_scatter": lambda x: dlc.reduce_scatter(x, op="sum"),
        "alltoall": lambda x: dlc.alltoall(x),
        "scan": lambda x: dlc.scan(x, op="sum"),
        "exscan": lambda x: dlc.exscan(x, op="sum"),
        "sendrecv": lambda x: dlc.sendrecv(x, x * 0, source=left, dest=right),
        "sendrecv_status": lambda x: dlc.sendrecv(
            x, x * 0, source=dlc.ANY_SOURCE, dest=right, recvtag=dlc.ANY_TAG, return_status=True
        )[0],
        "send_recv": point_to_point,
        "barrier": lambda x: (dlc.barrier(), x * 2)[1],
        "iallreduce_wait": lambda x: dlc.wait(dlc.iallreduce(x)) + jnp.sin(x),
        "iallgather_wait": lambda x: dlc.wait(dlc.iallgather(x[rank])) + jnp.sin(x),
        "isend_irecv_wait": lambda x: (lambda sent: (dlc.wait(dlc.irecv(x, source=left)), dlc.wait(sent))[0])(
            dlc.isend(x, dest=right)
        ),
        "iallreduce_overlap": lambda x: (lambda out: out[0] + out[1])(dlc.overlap(dlc.iallreduce(x), jnp.sin, x)),
    }


# The public operations of distlinalg.comm; a new one must be added above.
_PUBLIC = {"allreduce", "tree_allreduce", "reduce", "bcast", "gather", "scatter", "allgather", "reduce_scatter",
           "alltoall", "scan", "exscan", "send", "recv", "sendrecv", "barrier", "iallreduce", "iallgather",
           "isend", "irecv", "wait", "overlap"}


def test_every_public_operation_is_covered():
    public = {name for name in dlc.__all__ if callable(getattr(dlc, name)) and not name.endswith("_p")}
    public -= {"Status", "Communicator", "ReduceOp", "Request", "configure", "rank", "size"}
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
    # tree_allreduce sends nothing on one rank (documented): there is nothing to lower then.
    communicates = name != "tree_allreduce" or size > 1
    for mode, (program, args) in programs.items():
        text = lower_for_cuda(program, *args)
        if communicates and (name != "barrier" or mode == "primal"):
            assert targets(text), f"{name} {mode}: no distlinalg custom call in the CUDA lowering"


def test_differentiated_sendrecv_uses_the_flagged_protocol_on_cuda(x, rank, size):
    """grad of a sendrecv goes through the flagged protocol primitive (CPU-only before)."""
    right, left = (rank + 1) % size, (rank - 1) % size
    f = lambda v: jnp.sum(dlc.sendrecv(v, v * 0, source=left, dest=right) ** 2)  # noqa: E731
    text = lower_for_cuda(jax.grad(f), x)
    assert "distlinalg_sendrecv" in targets(text)
    hessian_vector = jax.jit(lambda v, t: jax.jvp(jax.grad(f), (v,), (t,))).trace(x, x)
    assert "distlinalg_sendrecv" in targets(hessian_vector.lower(lowering_platforms=("cuda",)).as_text())


@pytest.mark.parametrize("halo", ["overlapped", "blocking"])
@pytest.mark.parametrize("solver", ["cg", "minres", "gmres", "bicgstab"])
def test_solver_with_halo_operator_lowers_for_cuda_under_grad(solver, halo, rank, size):
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


def test_eager_twin_lowers_for_cuda(x):
    """The effect-free twin that eager calls compile is registered for CUDA as well."""
    from distlinalg._mpi import ReduceOp, resolve_comm
    from distlinalg.comm import _core

    twin = _core._eager_twins[dlc.allreduce_p]
    fn = lambda v: twin.bind(v, comm=resolve_comm(None), op=ReduceOp.SUM)  # noqa: E731
    assert "distlinalg_allreduce" in targets(lower_for_cuda(fn, x))
