"""Krylov solvers on the 2-D Poisson problem, side by side in one run.

    mpiexec -n 2 python benchmarks/bench_krylov.py [--n 1000] [--iters 200] [--output FILE]
        [--contenders distlinalg-cg distlinalg-cg-sr distlinalg-minres distlinalg-cg-local jax-scipy-cg scipy-cg
                      distlinalg-gmres jax-scipy-gmres distlinalg-bicgstab jax-scipy-bicgstab]
        [--operator library|local] [--restart 20] [--converge [--converge-gmres]] [--repeats 3] [--json FILE]

5-point Laplacian on an n×n grid (Dirichlet, unscaled: 4 on the diagonal),
grid rows split across ranks, matrix-free with a halo exchange of one grid
row each way per matvec; b = A·1, x0 = 0, rtol 1e-8. The distlinalg solvers
(distlinalg-cg, -cg-sr, -cg-pipe, -minres, -gmres, -bicgstab) run on the library's operator,
``distlinalg.operators.laplacian_2d(n)`` on flat vectors, unless
``--operator local`` puts them on this file's own stencil: (rows, n) blocks,
two sendrecvs per matvec (the stencil earlier figures were measured with).
Whatever --operator says, the contender ``distlinalg-cg-local`` is cg on
this file's stencil (the comparison row run_all.py shows) and
``distlinalg-cg-lib`` cg on the library's.

Time per iteration: a fixed budget of --iters iterations (below convergence,
so every solver runs them all), median over --repeats. With --converge, one
more solve to rtol 1e-8 gives the iteration count and the total time (not for
the GMRES contenders unless --converge-gmres: restarted GMRES(20) needs
11,020 Arnoldi steps at n = 300, 10 s for distlinalg and 33 s for jax.scipy,
each solve run twice, compile and timed; many times that at n = 1000).
Allreduces per iteration are read off the traced loop body.

GMRES and BiCGSTAB (nonsymmetric solvers, on the same symmetric problem: the
rows say what an iteration of each costs, each against its jax.scipy peer):
  iteration of GMRES = one Arnoldi step = one matvec with A. Both GMRES
      contenders run restarted GMRES(m), m = --restart (20), solve_method
      "batched" (the default of both jax.scipy and distlinalg: every cycle
      builds all m basis vectors, no inner stopping test). jax.scipy's
      `maxiter` (and distlinalg's, which follows it) counts restart cycles, so
      the budget is C = --iters // m cycles for both (10 by default), i.e. C·m
      Arnoldi steps, and ms/iteration = time of the budget solve / (C·m). Each
      cycle's own work (the true-residual matvec b − A x, the small
      least-squares solve, x += V y) is the same for both and is spread over
      its m steps: per step that is (m+1)/m matvecs, not 1, for both.
      Iterations to rtol (--converge) are distlinalg's info.iterations (Arnoldi
      steps over all cycles); jax.scipy's gmres does not report them.
      The two differ in Gram–Schmidt: distlinalg always runs classical
      Gram–Schmidt twice (two passes over the basis, one allreduce each);
      jax.scipy's runs one pass (jax 0.10: _iterative_classical_gram_schmidt
      with max_iterations=2 stops its loop for a second pass before it runs,
      k < max_iterations − 1 being false after the first; its result loses
      orthogonality as one pass does). Both project on the whole zero-padded
      basis of m+1 vectors in every pass; jax.scipy keeps the Krylov index as
      the last axis of V, distlinalg as the first.
  iteration of BiCGSTAB = one pass of the loop = two matvecs (q = A p, t = A s),
      for both; a budget of --iters iterations, as for CG.

Peers (one process, on rank 0 while the other ranks sleep; the same run):
  jax-scipy-cg   jax.scipy.sparse.linalg.cg on the same stencil (jitted; it does
                 not report its iteration count)
  jax-scipy-gmres, jax-scipy-bicgstab   jax.scipy.sparse.linalg.gmres (restart m,
                 solve_method="batched") and .bicgstab on the same stencil
                 (jitted; no iteration counts either)
  scipy-cg       scipy.sparse.linalg.cg on the assembled CSR matrix
  petsc-cg, petsc-minres   petsc4py KSPCG / KSPMINRES, PCNONE, on an AIJ matrix
                 split by grid rows across all ranks (runs in the peers venv,
                 see peers.py --with-petsc)

Memory-bandwidth bound per iteration = bytes moved per iteration / the
numpy STREAM-triad bandwidth measured in the same run (see
_util.stream_triad): all ranks at once (aggregate) for distlinalg, rank 0
alone for the one-process peers. Bytes per iteration, N = n²
float64 unknowns, counting each vector once per pass between the reductions
(the fewest passes the algorithm allows; the stencil reads its input once):
  CG (standard)          11·8N: [q = A p, ⟨p,q⟩] r p, w q; [x += αp, r −= αq, ⟨r,r⟩]
                         r x p r q, w x r; [p = r + βp] r r p, w p
  CG (single reduction)  11·8N: [p = r + βp, s = w + βs, x += αp, r −= αs]
                         r r p w s x, w p s x r; [w = A r, ⟨r,r⟩, ⟨r,w⟩] r r, w w
  CG (pipelined)         20·8N: [z = n + βz, q = m + βq, s = w + βs, p = u + βp,
                         x += αp, r −= αs, u −= αq, w −= αz, ⟨r,u⟩ ⟨w,u⟩ ⟨r,r⟩]
                         r n z m q w s u p x r, w z q s p x r u w; [n = A m] r m, w n
                         (M = I: m = w, no pass)
  MINRES                 12·8N: [y = A v − c r_old, ⟨v,y⟩] r v r_old, w y;
                         [y −= c' r₂, ‖y‖] r y r₂, w y; [w = (v − ε w₁ − δ w₂)/γ,
                         x += φ w] r v w₁ w₂ x, w w x  (v = y/β fused into its users)
  scipy CSR CG           11·8N + CSR matvec extra: 5N values (8 B) + 5N column
                         indices (4 B) + N row pointers (4 B) = 11·8N + 64N
  BiCGSTAB               17·8N (M = I, two matvecs): [q = A p, ⟨r̂,q⟩] r p r̂, w q;
                         [s = r − αq] r r q, w s; [t = A s, ⟨t,s⟩ ⟨t,t⟩ ⟨s,s⟩
                         ⟨r̂,s⟩ ⟨r̂,t⟩] r s r̂, w t; [x += αp + ωs, r = s − ωt, ⟨r,r⟩,
                         p = r + β(p − ωq)] r x p s t q, w x r p  (β and ω are
                         known after the second reduction, so the next p is
                         formed in the same pass; a loop that forms p at the top
                         of the next iteration, as both implementations do,
                         needs 2 more streams: 19)
  GMRES(m)               per Arnoldi step, averaged over a cycle, classical
                         Gram–Schmidt twice (distlinalg's algorithm) on the
                         j+1 basis vectors of step j (j = 0 … m−1):
                         [w = A v_j, Vᴴw, ‖w‖²] r V(j+1), w w;
                         [w −= V h, Vᴴw, ‖w‖²] r V(j+1) w, w w;
                         [v_{j+1} = (w − V h')/‖w'‖] r V(j+1) w, w v_{j+1}
                         = 3j + 8 streams; per cycle also [v_0 = z/β] 2,
                         [x += V y] m + 2, [r = b − A x, ‖r‖²] 3 (M = I: z = r):
                         (1.5m² + 7.5m + 7)/m · 8N per step = 37.85·8N for
                         m = 20. The same model is used for the jax.scipy peer,
                         although it runs one pass (2j + 5 per step, 25.35·8N
                         for m = 20); and both implementations
                         project on all m+1 (zero-padded) basis vectors in
                         every pass, more traffic than the model's j+1: the
                         model is a bound neither can reach, read it as such.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# distlinalg runs with its default per-rank CPU blocks (distlinalg/_runtime/cpu.py;
# without them each rank's XLA threads and the other rank's busy-polling MPI
# share every core: cg on 2 ranks reached 74% of the bandwidth bound instead
# of ~100%). The one-process peers run on rank 0 while the other ranks sleep
# and get the whole node's CPUs back for their run (`on_root`); in runs of
# several ranks, though, JAX's thread pool in rank 0 was sized for that rank's
# CPU block, so the fair peer figures are those of the 1-rank run.
NODE_CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import _util  # noqa: E402

STREAMS = {"cg": 11, "cg-sr": 11, "cg-pipe": 20, "minres": 12, "bicgstab": 17}
RESTART = 20  # GMRES(m): the default --restart of both GMRES contenders (and jax.scipy's / distlinalg's own default)
CONTENDERS = ("distlinalg-cg", "distlinalg-cg-sr", "distlinalg-cg-pipe", "distlinalg-minres", "distlinalg-cg-lib",
              "distlinalg-cg-local", "distlinalg-gmres", "distlinalg-bicgstab", "jax-scipy-cg", "jax-scipy-gmres",
              "jax-scipy-bicgstab", "scipy-cg", "petsc-cg", "petsc-minres")
# The one-process peer each contender's ratio is taken to (same method where jax.scipy has it).
JAX_PEER = {"distlinalg-gmres": "jax-scipy-gmres", "jax-scipy-gmres": "jax-scipy-gmres",
            "distlinalg-bicgstab": "jax-scipy-bicgstab", "jax-scipy-bicgstab": "jax-scipy-bicgstab"}
ONE_PROCESS = ("jax-scipy-cg", "jax-scipy-gmres", "jax-scipy-bicgstab", "scipy-cg")
LABELS = {
    "distlinalg-cg": "distlinalg cg",
    "distlinalg-cg-sr": "distlinalg cg single-reduction",
    "distlinalg-cg-pipe": "distlinalg cg pipelined",
    "distlinalg-minres": "distlinalg minres",
    "distlinalg-cg-lib": "distlinalg cg, operators.laplacian_2d (flat vectors)",
    "distlinalg-cg-local": "distlinalg cg, bench_krylov's own 2-D block stencil",
    "distlinalg-gmres": "distlinalg gmres(m), per Arnoldi step",
    "distlinalg-bicgstab": "distlinalg bicgstab",
    "jax-scipy-cg": "jax.scipy.sparse.linalg.cg, 1 process (peer)",
    "jax-scipy-gmres": "jax.scipy.sparse.linalg.gmres(m) batched, per Arnoldi step, 1 process (peer)",
    "jax-scipy-bicgstab": "jax.scipy.sparse.linalg.bicgstab, 1 process (peer)",
    "scipy-cg": "scipy.sparse.linalg.cg CSR, 1 process (peer)",
    "petsc-cg": "PETSc KSPCG (peer)",
    "petsc-minres": "PETSc KSPMINRES (peer)",
}


def stencil(u, up, down):
    """4u − neighbours, with `up`/`down` the rows beyond this block."""
    padded = jnp.concatenate([up[None], u, down[None]], axis=0)
    left = jnp.pad(u[:, :-1], ((0, 0), (1, 0)))
    right = jnp.pad(u[:, 1:], ((0, 0), (0, 1)))
    return 4 * u - padded[:-2] - padded[2:] - left - right


def distributed_laplacian(rank, size):
    """This file's matvec on a (rows, n) block of grid rows: two sendrecvs of one row, then `stencil`."""
    from distlinalg.comm import sendrecv

    above = rank - 1 if rank > 0 else MPI.PROC_NULL
    below = rank + 1 if rank < size - 1 else MPI.PROC_NULL

    def matvec(u):
        zero = jnp.zeros_like(u[0])
        up = sendrecv(u[-1], zero, above, below)  # my last row goes down
        down = sendrecv(u[0], zero, below, above)
        return stencil(u, up, down)

    return matvec


def _subjaxprs(eqn):
    stack = list(eqn.params.values())
    while stack:
        value = stack.pop()
        if isinstance(value, (tuple, list)):
            stack.extend(value)
        elif hasattr(value, "eqns"):
            yield value
        elif hasattr(getattr(value, "jaxpr", None), "eqns"):
            yield value.jaxpr


def allreduces_per_iteration(fn, *args, steps_per_cycle: int | None = None):
    """distlinalg_allreduce equations in the body of the solver's while loop.

    With steps_per_cycle = m (restarted GMRES: a loop of cycles around a loop of
    m Arnoldi steps): per Arnoldi step, the inner body's count plus the rest of
    the cycle's spread over its m steps (2 + 1/m for distlinalg.gmres)."""

    def find_while(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "while":
                return eqn
            for sub in _subjaxprs(eqn):
                found = find_while(sub)
                if found is not None:
                    return found
        return None

    def count(jaxpr):
        return sum(
            (eqn.primitive.name in ("distlinalg_allreduce", "distlinalg_iallreduce"))
            + sum(count(sub) for sub in _subjaxprs(eqn))
            for eqn in jaxpr.eqns
        )

    loop = find_while(jax.make_jaxpr(fn)(*args).jaxpr)
    body = loop.params["body_jaxpr"].jaxpr
    if steps_per_cycle is None:
        return count(body)
    inner = find_while(body)
    per_step = count(inner.params["body_jaxpr"].jaxpr)
    return per_step + (count(body) - per_step) / steps_per_cycle


def on_root(fn, comm):
    """fn() on rank 0 while the other ranks sleep (not spin) in a non-blocking barrier; result everywhere."""
    result = None
    if comm.Get_rank() == 0:
        mine = sorted(os.sched_getaffinity(0)) if NODE_CPUS else []
        widen = NODE_CPUS and mine != NODE_CPUS
        if widen:
            from distlinalg._runtime.cpu import _restrict_all_threads

            _restrict_all_threads(NODE_CPUS)  # every thread, XLA's pool included
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001
            result = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        finally:
            if widen:
                _restrict_all_threads(mine)
        comm.Ibarrier().Wait()
    else:
        req = comm.Ibarrier()
        while not req.Test():
            time.sleep(0.002)
    return comm.bcast(result, root=0)


def scipy_laplacian(n):
    import scipy.sparse as sp

    T = sp.diags([-np.ones(n - 1), 2 * np.ones(n), -np.ones(n - 1)], [-1, 0, 1])
    eye = sp.identity(n)
    return (sp.kron(eye, T) + sp.kron(T, eye)).tocsr()


# ---------------------------------------------------------------------------
def distlinalg_solver(name, args, comm):
    """Set-up of a distlinalg contender on the operator it runs on (--operator, or the one its name
    fixes): the jitted budget solve, allreduces per iteration, sample() and, with --converge, converge()."""
    import distlinalg as dl

    rank, size = comm.Get_rank(), comm.Get_size()
    n = args.n
    library = {"distlinalg-cg-lib": True, "distlinalg-cg-local": False}.get(name, args.operator == "library")
    if library:
        from distlinalg.operators import laplacian_2d

        op = laplacian_2d(n)
        rows = op.grid_rows[1] - op.grid_rows[0]
        ones = jnp.ones(rows * n)
    else:
        op = distributed_laplacian(rank, size)
        rows = len(np.array_split(np.arange(n), size)[rank])
        ones = jnp.ones((rows, n))
    mv = op.matvec if hasattr(op, "matvec") else op
    b = jax.jit(mv)(ones)

    m = args.restart
    gmres = name == "distlinalg-gmres"

    def make(maxiter):
        if name == "distlinalg-minres":
            return jax.jit(lambda b: dl.minres(op, b, rtol=1e-8, maxiter=maxiter, layout="sharded"))
        if gmres:  # maxiter counts restart cycles (as jax.scipy's); the budget is in Arnoldi steps
            return jax.jit(lambda b: dl.gmres(op, b, rtol=1e-8, restart=m, maxiter=maxiter, layout="sharded",
                                              solve_method="batched"))
        if name == "distlinalg-bicgstab":
            return jax.jit(lambda b: dl.bicgstab(op, b, rtol=1e-8, maxiter=maxiter, layout="sharded"))
        method = {"distlinalg-cg-sr": "single_reduction", "distlinalg-cg-pipe": "pipelined"}.get(name, "standard")
        return jax.jit(lambda b: dl.cg(op, b, rtol=1e-8, maxiter=maxiter, layout="sharded", method=method))

    cycles = max(1, args.iters // m)
    budget_its = cycles * m if gmres else args.iters
    budget = make(cycles if gmres else args.iters)
    _, info = jax.block_until_ready(budget(b))  # compile
    if int(info.iterations) != budget_its or bool(info.converged):
        _util.eprint(f"[krylov] warning: {name} ran {int(info.iterations)} of its {budget_its} budget iterations "
                     f"(converged: {bool(info.converged)}): the budget is not below convergence")

    def sample():
        out = {}

        def run():
            out["r"] = jax.block_until_ready(budget(b))

        seconds = _util.timed_once(run, comm)
        # GMRES: info.iterations counts Arnoldi steps (cycles × m in the batched method).
        return seconds / int(out["r"][1].iterations)

    if gmres:
        reds = allreduces_per_iteration(budget, b, steps_per_cycle=m)
    else:
        # MINRES runs two iterations per loop body (its vector slots alternate; minres.py).
        steps_per_body = 2 if name == "distlinalg-minres" else 1
        reds = allreduces_per_iteration(budget, b) // steps_per_body
    result = {"iterations_budget": budget_its, "allreduces_per_iteration": reds, "sample": sample}
    if gmres:
        result["restart"] = m
    if args.converge and (not gmres or args.converge_gmres):
        def converge():
            full = make(20 * n)  # GMRES: 20n cycles (a cap never reached)
            jax.block_until_ready(full(b))
            out = {}
            seconds = _util.timed_once(lambda: out.setdefault("r", jax.block_until_ready(full(b))), comm)
            info = out["r"][1]
            return {"iterations": int(info.iterations), "seconds": seconds, "converged": bool(info.converged)}

        result["converge"] = converge
    return result


def jax_scipy_solver(name, args, comm):
    """jax.scipy's cg / gmres / bicgstab on this file's stencil, one process on rank 0 (`on_root`).
    GMRES: restart m = --restart, solve_method="batched" (jax's default), maxiter = --iters // m
    cycles; the time per iteration is per Arnoldi step (budget time / (cycles · m))."""
    import jax.scipy.sparse.linalg as jsla

    n = args.n
    m = args.restart
    cycles = max(1, args.iters // m)
    budget_its = cycles * m if name == "jax-scipy-gmres" else args.iters

    def make(mv, maxiter):
        if name == "jax-scipy-gmres":  # maxiter counts restart cycles
            return jax.jit(lambda b: jsla.gmres(mv, b, tol=1e-8, restart=m, maxiter=maxiter,
                                                solve_method="batched")[0])
        if name == "jax-scipy-bicgstab":
            return jax.jit(lambda b: jsla.bicgstab(mv, b, tol=1e-8, maxiter=maxiter)[0])
        return jax.jit(lambda b: jsla.cg(mv, b, tol=1e-8, maxiter=maxiter)[0])

    def setup():
        zero_row = jnp.zeros(n)
        full_mv = lambda u: stencil(u, zero_row, zero_row)  # noqa: E731
        full_b = jax.jit(full_mv)(jnp.ones((n, n)))
        return full_mv, full_b

    def below_tolerance(mv, b, x):
        """Did the solve reach rtol 1e-8 (then it stopped before the end of its budget)?"""
        return bool(jnp.linalg.norm(b - jax.jit(mv)(x)) <= 1e-8 * jnp.linalg.norm(b))

    state = {}

    def sample():
        def go():
            if "fn" not in state:
                full_mv, full_b = setup()
                state["b"] = full_b
                state["fn"] = make(full_mv, cycles if name == "jax-scipy-gmres" else args.iters)
                x = jax.block_until_ready(state["fn"](full_b))
                if below_tolerance(full_mv, full_b, x):
                    _util.eprint(f"[krylov] warning: {name} converged within its budget: the time per "
                                 "iteration below is too low")
            start = time.perf_counter()
            jax.block_until_ready(state["fn"](state["b"]))
            return (time.perf_counter() - start) / budget_its  # runs the whole budget (not converged)

        return on_root(go, comm)

    result = {"iterations_budget": budget_its, "allreduces_per_iteration": 0, "sample": sample}
    if name == "jax-scipy-gmres":
        result["restart"] = m
    if args.converge and (name != "jax-scipy-gmres" or args.converge_gmres):
        def converge():
            def go():
                full_mv, full_b = setup()
                fn = make(full_mv, 20 * n)  # GMRES: 20n cycles
                jax.block_until_ready(fn(full_b))
                start = time.perf_counter()
                x = jax.block_until_ready(fn(full_b))
                seconds = time.perf_counter() - start
                return {"iterations": None, "seconds": seconds, "converged": below_tolerance(full_mv, full_b, x)}

            return on_root(go, comm)

        result["converge"] = converge
    return result


def scipy_solver(args, comm):
    import scipy
    import scipy.sparse.linalg as spla

    n = args.n
    state = {}
    rtol_kw = "rtol" if tuple(int(v) for v in scipy.__version__.split(".")[:2]) >= (1, 12) else "tol"

    def setup():
        if "A" not in state:
            state["A"] = scipy_laplacian(n)
            state["b"] = state["A"] @ np.ones(n * n)

    def solve(maxiter, rtol):
        its = [0]

        def cb(_):
            its[0] += 1

        start = time.perf_counter()
        _, code = spla.cg(state["A"], state["b"], maxiter=maxiter, callback=cb, **{rtol_kw: rtol})
        return time.perf_counter() - start, its[0], code

    def sample():
        def go():
            setup()
            seconds, its, _ = solve(args.iters, 1e-8)
            return seconds / its

        return on_root(go, comm)

    result = {"iterations_budget": args.iters, "allreduces_per_iteration": 0, "sample": sample}
    if args.converge:
        def converge():
            def go():
                setup()
                seconds, its, code = solve(20 * n, 1e-8)
                return {"iterations": its, "seconds": seconds, "converged": code == 0}

            return on_root(go, comm)

        result["converge"] = converge
    return result


def petsc_solver(name, args, comm):
    from petsc4py import PETSc

    n = args.n
    rank, size = comm.Get_rank(), comm.Get_size()
    rows = np.array_split(np.arange(n), size)[rank]
    lo, hi = int(rows[0]) * n, (int(rows[-1]) + 1) * n
    local = scipy_laplacian(n)[lo:hi]  # this rank's rows, global column indices
    A = PETSc.Mat().createAIJ(size=((hi - lo, n * n), (hi - lo, n * n)),
                              csr=(local.indptr.astype(PETSc.IntType), local.indices.astype(PETSc.IntType),
                                   local.data), comm=PETSc.COMM_WORLD)
    A.assemble()
    x, b = A.createVecs()
    x.set(1.0)
    A.mult(x, b)
    ksp = PETSc.KSP().create(comm=PETSc.COMM_WORLD)
    ksp.setOperators(A)
    ksp.setType("cg" if name == "petsc-cg" else "minres")
    ksp.getPC().setType("none")
    if name == "petsc-cg":  # PCNONE: the preconditioned norm is the 2-norm anyway
        ksp.setNormType(PETSc.KSP.NormType.UNPRECONDITIONED)

    def solve(maxiter, rtol):
        x.set(0.0)
        ksp.setTolerances(rtol=rtol, atol=0.0, max_it=maxiter)
        seconds = _util.timed_once(lambda: ksp.solve(b, x), comm)
        return seconds, ksp.getIterationNumber(), ksp.getConvergedReason() > 0

    solve(args.iters, 1e-30)  # warm-up

    def sample():
        seconds, its, _ = solve(args.iters, 1e-30)
        return seconds / its

    result = {"iterations_budget": args.iters, "allreduces_per_iteration": None, "sample": sample}
    if args.converge:
        def converge():
            seconds, its, ok = solve(20 * n, 1e-8)
            return {"iterations": its, "seconds": seconds, "converged": ok}

        result["converge"] = converge
    return result


def gmres_streams(m: int) -> float:
    """Vector streams (of 8N bytes) per Arnoldi step of GMRES(m), CGS twice, averaged over a cycle
    (module docstring): Σ_j (3j + 8) over the m steps + 2 + (m + 2) + 3 per cycle, over m."""
    return (1.5 * m * m + 7.5 * m + 7) / m


def bytes_per_iteration(name, n, restart=RESTART):
    N = n * n
    if name in ("distlinalg-gmres", "jax-scipy-gmres"):
        return gmres_streams(restart) * 8 * N
    if name in ("distlinalg-bicgstab", "jax-scipy-bicgstab"):
        return STREAMS["bicgstab"] * 8 * N
    if name in ("distlinalg-minres", "petsc-minres"):
        return STREAMS["minres"] * 8 * N
    if name == "scipy-cg":
        return STREAMS["cg"] * 8 * N + 64 * N
    if name == "petsc-cg":
        return STREAMS["cg"] * 8 * N + 64 * N  # AIJ: the same CSR matvec traffic
    if name == "distlinalg-cg-pipe":
        return STREAMS["cg-pipe"] * 8 * N
    return STREAMS["cg"] * 8 * N


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--iters", type=int, default=200, help="iteration budget for the time per iteration "
                        "(GMRES: --iters // --restart cycles of --restart Arnoldi steps)")
    parser.add_argument("--restart", type=int, default=RESTART, help="GMRES(m): m of both GMRES contenders")
    parser.add_argument("--contenders", nargs="+", choices=CONTENDERS,
                        default=["distlinalg-cg", "distlinalg-cg-sr", "distlinalg-minres", "jax-scipy-cg"])
    parser.add_argument("--operator", choices=["library", "local"], default="library",
                        help="operator of the distlinalg solvers: operators.laplacian_2d (default) or this file's "
                             "stencil (distlinalg-cg-lib / distlinalg-cg-local always use the library's / this file's)")
    parser.add_argument("--converge", action="store_true", help="also solve to rtol 1e-8 once (iterations)")
    parser.add_argument("--converge-gmres", action="store_true",
                        help="with --converge, also the GMRES contenders (slow: restarted GMRES needs ~20x the "
                             "matvecs of cg on this problem)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--triad-elements", type=int, default=1 << 24)
    parser.add_argument("--output", help="append the markdown table to this file")
    parser.add_argument("--json", help="write the results as JSON (rank 0)")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    n = args.n
    t0 = time.perf_counter()

    # Bandwidth with all ranks streaming at once (for the sharded solvers), and of
    # rank 0 alone while the others sleep (for the one-process peers).
    triad = _util.stream_triad(args.triad_elements, comm=comm)
    solo = on_root(lambda: _util.stream_triad(args.triad_elements), comm)
    triad["solo_gb_s"] = solo["per_process_gb_s"]
    contenders, skipped = {}, {}
    for name in args.contenders:
        try:
            if name.startswith("distlinalg"):
                contenders[name] = distlinalg_solver(name, args, comm)
            elif name.startswith("jax-scipy"):
                contenders[name] = jax_scipy_solver(name, args, comm)
            elif name == "scipy-cg":
                contenders[name] = scipy_solver(args, comm)
            else:
                contenders[name] = petsc_solver(name, args, comm)
        except ImportError as exc:
            skipped[name] = f"import failed: {exc}"
        except Exception as exc:  # noqa: BLE001  (a peer that cannot set up is skipped, not fatal)
            if name.startswith("distlinalg"):
                raise
            skipped[name] = f"set-up failed: {type(exc).__name__}: {str(exc)[:300]}"
    samples = {name: [] for name in contenders}
    for _ in range(args.repeats):  # interleaved
        for name, c in contenders.items():
            value = c["sample"]()
            if isinstance(value, dict):
                skipped[name] = value["error"]
            else:
                samples[name].append(value)
    results = {}
    for name, c in contenders.items():
        if name in skipped:
            continue
        per_it = _util.median(samples[name])
        nbytes = bytes_per_iteration(name, n, args.restart)
        procs = 1 if name in ONE_PROCESS else size
        bw = triad["aggregate_gb_s"] if procs > 1 else triad["solo_gb_s"]
        results[name] = {
            "label": LABELS[name].replace("(m)", f"({args.restart})"), "seconds_per_iteration": per_it,
            "samples": samples[name], "peer": JAX_PEER.get(name, "jax-scipy-cg"),
            "iterations_budget": c["iterations_budget"],
            "allreduces_per_iteration": c["allreduces_per_iteration"],
            "bytes_per_iteration": nbytes, "bandwidth_bound_seconds": nbytes / (bw * 1e9), "processes": procs,
        }
        if "restart" in c:
            results[name]["restart"] = c["restart"]
        if "converge" in c:
            conv = c["converge"]()
            if isinstance(conv, dict) and "error" not in conv:
                results[name]["converge"] = conv
        if rank == 0:
            _util.eprint(f"[krylov n={size}] {name}: {per_it * 1e3:.2f} ms/it "
                         f"(bound {results[name]['bandwidth_bound_seconds'] * 1e3:.2f} ms) "
                         f"{results[name].get('converge', '')}")

    payload = {"bench": "krylov", "ranks": size, "n": n, "rtol": 1e-8, "iters": args.iters,
               "operator": args.operator, "restart": args.restart, "triad": triad, "results": results, "skipped": skipped,
               "repeats": args.repeats, "seconds": time.perf_counter() - t0, "versions": _util.versions(),
               "oversubscribed": size > (__import__("os").cpu_count() or 1)}
    if rank != 0:
        return
    if args.json:
        _util.write_json(args.json, payload)
    lines = [
        f"### 2-D Poisson {n}x{n}, rtol 1e-8, sharded rows, {size} rank(s) "
        f"(jax {jax.__version__}; budget {args.iters} iterations)",
        "",
        "| solver | ms / iteration | iterations | allreduces / iteration |",
        "|---|---|---|---|",
    ]
    for name, r in results.items():
        its = r.get("converge", {}).get("iterations") or r["iterations_budget"]
        reds = "—" if r["allreduces_per_iteration"] is None else f"{r['allreduces_per_iteration']:.3g}"
        lines.append(f"| {r['label']} | {r['seconds_per_iteration'] * 1e3:.2f} | {its} | {reds} |")
    for name, why in skipped.items():
        lines.append(f"| {LABELS[name]} | skipped: {why} | | |")
    if "jax-scipy-cg" in results and "distlinalg-cg" in results:  # the target, as before
        target = results["jax-scipy-cg"]["seconds_per_iteration"] / 1.8
        ours = results["distlinalg-cg"]["seconds_per_iteration"]
        lines += ["", f"Target for 2 ranks (jax.scipy / 1.8): {target * 1e3:.2f} ms/iteration; "
                  f"distlinalg cg on {size} rank(s): {ours * 1e3:.2f} ms ({ours / target:.2f}x the target)."]
    same_method = [(ours, peer) for ours, peer in (("distlinalg-gmres", "jax-scipy-gmres"),
                                                    ("distlinalg-bicgstab", "jax-scipy-bicgstab"))
                   if ours in results and peer in results]
    if same_method:
        lines += [""] + [
            f"{LABELS[ours].split(',')[0].replace('(m)', f'({args.restart})')} / {peer} per iteration: "
            f"{results[ours]['seconds_per_iteration'] / results[peer]['seconds_per_iteration']:.2f}"
            for ours, peer in same_method]
    text = "\n".join(lines)
    print(text)
    if args.output:
        with open(args.output, "a") as f:
            f.write(text + "\n\n")


if __name__ == "__main__":
    main()
