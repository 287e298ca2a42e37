"""Multigrid-preconditioned CG on the 2-D Poisson problem, against plain CG and PETSc CG + GAMG.

    python benchmarks/bench_multigrid.py [--n 128 500 1000 2000] [--ranks 1 2] [--plain-up-to 2000]
        [--block-jacobi-up-to 1000]

For each grid size n (n² unknowns, ``laplacian_2d(n)``, b = 1, rtol 1e-8 on
the true residual norm ‖b − A x‖ ≤ 1e-8 ‖b‖), in one run:

* ``distlinalg mg-cg``: ``cg(A, b, M=multigrid(A))``, the multigrid setup
  included in the time (one jitted program: build, then solve; compiled
  first, then timed as the best of 3 runs);
* ``distlinalg cg``: plain CG (up to n = --plain-up-to; its iteration count
  grows like n);
* ``block-Jacobi(AMG)-CG``: the same matrix as ``sparse_rows`` (an operator
  without a grid), ``cg(S, b, M=block_jacobi(S, local="amg"))``: pyamg's
  smoothed aggregation on each rank's diagonal block, applied in JAX; the
  build (outside jit: pyamg needs the values) included in the time (up to
  n = --block-jacobi-up-to);
* ``PETSc CG + GAMG`` (peer): KSPCG with PCGAMG on an AIJ matrix, stopping on
  the unpreconditioned residual norm, ``KSPSetUp`` (GAMG's setup) included in
  the time, best of 3. It runs in its own process under its own MPI
  (Debian's petsc4py with Open MPI: ``apt-get install python3-petsc4py``); it
  is skipped, with the reason, where it is missing.

Each rank count is one mpiexec job. The table goes to stdout (markdown) and
benchmarks/results_multigrid.md with --write.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RTOL = 1e-8


def worker(sizes: list[int], plain_up_to: int, block_jacobi_up_to: int) -> None:
    """Inside mpiexec: time the distlinalg solves, print one JSON line per size on rank 0."""
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import numpy as np

    import distlinalg as dl
    from distlinalg.operators import laplacian_2d

    def with_multigrid(A, b):
        M = dl.solvers.multigrid(A)
        x, info = dl.cg(A, b, M=M, rtol=RTOL, maxiter=1000)
        return x, info

    def plain(A, b):
        return dl.cg(A, b, rtol=RTOL, maxiter=100_000)

    programs = {"mg-cg": jax.jit(with_multigrid), "cg": jax.jit(plain)}
    preconditioned_cg = jax.jit(lambda A, b, M: dl.cg(A, b, M=M, rtol=RTOL, maxiter=10_000))

    def block_jacobi_amg(n):
        """CG + block_jacobi(local="amg") on the same Poisson matrix held as sparse_rows (no grid): pyamg's
        hierarchy per rank's diagonal block, built outside jit (it needs the values), its build timed too."""
        try:
            import pyamg  # noqa: F401
        except ImportError:
            return {"error": "pyamg not installed (make pyamg)"}
        import scipy.sparse as sp

        T = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(n, n))
        S = dl.operators.sparse_rows((sp.kron(sp.eye(n), T) + sp.kron(T, sp.eye(n))).tocsr(), symmetric=True)
        b = jnp.ones(S.input_structure.shape)
        preconditioned_cg(S, b, dl.solvers.block_jacobi(S, local="amg"))  # compiled first
        times = []
        for _ in range(3):
            dl.comm.barrier()
            start = time.perf_counter()
            x, info = preconditioned_cg(S, b, dl.solvers.block_jacobi(S, local="amg"))
            jax.block_until_ready(x)
            times.append(time.perf_counter() - start)
        return {"iterations": int(info.iterations), "seconds": min(times), "converged": bool(info.converged)}

    for n in sizes:
        A = laplacian_2d(n)
        b = jnp.ones(A.input_structure.shape)
        row = {"n": n, "ranks": dl.comm.size()}
        for name, program in programs.items():
            if name == "cg" and n > plain_up_to:
                continue
            start = time.perf_counter()
            x, info = program(A, b)
            jax.block_until_ready(x)
            first = time.perf_counter() - start
            times = []
            for _ in range(3 if name == "mg-cg" else 1):
                start = time.perf_counter()
                x, info = program(A, b)
                jax.block_until_ready(x)
                times.append(time.perf_counter() - start)
            local = np.asarray(jnp.sum((b - A @ x) ** 2))
            residual = float(np.sqrt(dl.comm.allreduce(jnp.asarray(local)))) / n  # ‖b‖ = n
            row[name] = {"iterations": int(info.iterations), "seconds": min(times), "compile_and_first": first,
                         "relative_residual": residual, "converged": bool(info.converged)}
        if n <= block_jacobi_up_to:
            row["bj-amg-cg"] = block_jacobi_amg(n)
        row["levels"] = dl.solvers.multigrid(A).levels  # on every rank: the build is collective
        if dl.comm.rank() == 0:
            print("RESULT " + json.dumps(row), flush=True)


def eigsh_worker(n: int, k: int) -> None:
    """Inside mpiexec: the k smallest eigenvalues of laplacian_2d(n), LOBPCG + multigrid and
    shift-invert (σ = 0) + multigrid, each compiled first, then timed once; rank 0 prints."""
    import jax

    jax.config.update("jax_enable_x64", True)
    import numpy as np

    import distlinalg as dl
    from distlinalg.operators import laplacian_2d

    A = laplacian_2d(n)
    exact = exact_smallest(n, k)
    runs = {
        "lobpcg+mg": jax.jit(lambda A: dl.eigsh(A, k, method="lobpcg", M=dl.solvers.multigrid(A), tol=1e-6)),
        "shift-invert+mg": jax.jit(lambda A: dl.eigsh(A, k, sigma=0.0, M=dl.solvers.multigrid(A), tol=1e-6)),
    }
    row = {"n": n, "k": k, "ranks": dl.comm.size()}
    for name, program in runs.items():
        start = time.perf_counter()
        w, _, info = program(A)
        jax.block_until_ready(w)
        first = time.perf_counter() - start
        start = time.perf_counter()
        w, _, info = program(A)
        jax.block_until_ready(w)
        row[name] = {"seconds": time.perf_counter() - start, "compile_and_first": first,
                     "iterations": int(info.iterations), "converged": bool(info.converged),
                     "max_relative_error": float(np.max(np.abs(np.asarray(w) - exact) / exact))}
    if dl.comm.rank() == 0:
        print("RESULT " + json.dumps(row), flush=True)


def scipy_lobpcg_pyamg(n: int, k: int) -> dict:
    """scipy's lobpcg with a pyamg smoothed-aggregation preconditioner (the SciPy user's way), one process.

    scipy's ``tol`` bounds every pair's residual norm ‖A x − θ x‖ absolutely; distlinalg's tol = 1e-6
    is relative, ‖A x − θ x‖ ≤ 1e-6·θ. So scipy runs twice: at 1e-6·λ₁ (every pair at least as
    tight as distlinalg's) and at 1e-6·λ_k (the smallest pairs looser), each timed with pyamg's setup.
    """
    try:
        import pyamg
    except ImportError:
        return {"error": "pyamg not installed (pip install pyamg)"}
    import numpy as np
    import scipy.sparse as sp
    from scipy.sparse.linalg import lobpcg

    T = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(n, n))
    A = (sp.kron(sp.eye(n), T) + sp.kron(T, sp.eye(n))).tocsr()
    exact = exact_smallest(n, k)
    runs = {}
    for name, tol in (("tol 1e-6 lambda_1", 1e-6 * exact[0]), ("tol 1e-6 lambda_k", 1e-6 * exact[-1])):
        start = time.perf_counter()
        M = pyamg.smoothed_aggregation_solver(A).aspreconditioner()
        X = np.random.default_rng(0).standard_normal((n * n, k))
        w, _, history = lobpcg(A, X, M=M, tol=tol, largest=False, maxiter=400, retResidualNormsHistory=True)
        runs[name] = {"seconds": time.perf_counter() - start, "iterations": len(history),
                      "max_relative_error": float(np.max(np.abs(np.sort(w) - exact) / exact))}
    return runs


def exact_smallest(n: int, k: int):
    """The k smallest eigenvalues of laplacian_2d(n), ascending."""
    import numpy as np

    p, q = np.meshgrid(np.arange(1, n + 1), np.arange(1, n + 1))
    return np.sort((4 - 2 * np.cos(np.pi * p / (n + 1)) - 2 * np.cos(np.pi * q / (n + 1))).ravel())[:k]


PETSC_SCRIPT = r"""
import json, sys, time
from petsc4py import PETSc
n = int(sys.argv[1]); rtol = float(sys.argv[2])
comm = PETSc.COMM_WORLD
N = n * n
A = PETSc.Mat().createAIJ([N, N], nnz=(5, 2), comm=comm)
start, end = A.getOwnershipRange()
for row in range(start, end):
    i, j = divmod(row, n)
    A.setValue(row, row, 4.0)
    for (ii, jj) in ((i - 1, j), (i + 1, j), (i, j - 1), (i, j + 1)):
        if 0 <= ii < n and 0 <= jj < n:
            A.setValue(row, ii * n + jj, -1.0)
A.assemble()
b = A.createVecLeft(); b.set(1.0)
best = None
for _ in range(3):
    x = A.createVecRight(); x.set(0.0)
    ksp = PETSc.KSP().create(comm)
    ksp.setOperators(A)
    ksp.setType("cg")
    ksp.getPC().setType("gamg")
    ksp.setNormType(PETSc.KSP.NormType.UNPRECONDITIONED)
    ksp.setTolerances(rtol=rtol, atol=0.0, max_it=10000)
    comm.barrier()
    t = time.perf_counter()
    ksp.setUp()
    ksp.solve(b, x)
    elapsed = time.perf_counter() - t
    best = elapsed if best is None else min(best, elapsed)
    iterations = ksp.getIterationNumber()
r = b.duplicate(); A.mult(x, r); r.aypx(-1.0, b)
relative = r.norm() / b.norm()  # collective: on every rank, before rank 0 prints
if comm.getRank() == 0:
    print("RESULT " + json.dumps({"iterations": iterations, "seconds": best, "relative_residual": relative,
                                  "converged": ksp.getConvergedReason() > 0}), flush=True)
"""


def petsc_environment() -> tuple[dict[str, str] | None, str]:
    """(environment for Debian's petsc4py, "") or (None, why it is missing)."""
    dirs = sorted(glob.glob("/usr/lib/petscdir/petsc*/x86_64-linux-gnu-real"))
    if not dirs or not Path("/usr/bin/python3").exists():
        return None, "Debian's petsc4py not installed (apt-get install python3-petsc4py)"
    env = dict(os.environ, PETSC_DIR=dirs[-1], OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMP_NUM_THREADS="1")
    probe = subprocess.run(["/usr/bin/python3", "-c", "from petsc4py import PETSc"], env=env, capture_output=True)
    if probe.returncode != 0:
        return None, "petsc4py does not import: " + probe.stderr.decode()[-200:]
    return env, ""


def petsc_run(n: int, ranks: int, env: dict[str, str]) -> dict:
    script = ROOT / "build" / "bench_petsc_gamg.py"
    script.parent.mkdir(exist_ok=True)
    script.write_text(PETSC_SCRIPT)
    cmd = ["/usr/bin/python3", str(script), str(n), str(RTOL)]
    if ranks > 1:
        cmd = ["/usr/bin/mpiexec.openmpi", "--oversubscribe", "-n", str(ranks)] + cmd
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"error": (out.stdout + out.stderr)[-300:]}


def distlinalg_run(sizes: list[int], ranks: int, plain_up_to: int, block_jacobi_up_to: int) -> list[dict]:
    mpiexec = Path(sys.executable).parent / "mpiexec"
    cmd = [str(mpiexec), "-n", str(ranks), sys.executable, __file__, "--worker", "--n", *map(str, sizes),
           "--plain-up-to", str(plain_up_to), "--block-jacobi-up-to", str(block_jacobi_up_to)]
    env = dict(os.environ, DISTLINALG_STALL="0")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=7200)
    rows = [json.loads(line[7:]) for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if len(rows) != len(sizes):
        sys.exit(f"bench_multigrid: the {ranks}-rank job failed:\n{(out.stdout + out.stderr)[-3000:]}")
    return rows


def table(results: list[dict], petsc_note: str) -> str:
    lines = [
        "| ranks | n (unknowns) | levels | mg-cg iterations | mg-cg s (setup incl.) | cg iterations | cg s "
        "| PETSc CG+GAMG iterations | PETSc s (setup incl.) | mg-cg / cg time | mg-cg / PETSc time "
        "| block-Jacobi(AMG)-CG iterations / s (sparse_rows, build incl.) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results:
        mg, cg, petsc, bj = row.get("mg-cg", {}), row.get("cg"), row.get("petsc"), row.get("bj-amg-cg")

        def cell(entry, key, fmt):
            return fmt.format(entry[key]) if entry and key in entry else "–"

        ratio_cg = f"{mg['seconds'] / cg['seconds']:.3f}" if cg else "–"
        ratio_petsc = f"{mg['seconds'] / petsc['seconds']:.2f}" if petsc and "seconds" in petsc else "–"
        lines.append(
            f"| {row['ranks']} | {row['n']} ({row['n'] ** 2:,}) | {row.get('levels', '–')} | {mg['iterations']} "
            f"| {mg['seconds']:.3f} | {cell(cg, 'iterations', '{}')} | {cell(cg, 'seconds', '{:.2f}')} "
            f"| {cell(petsc, 'iterations', '{}')} | {cell(petsc, 'seconds', '{:.3f}')} | {ratio_cg} | {ratio_petsc} "
            f"| {cell(bj, 'iterations', '{}')} / {cell(bj, 'seconds', '{:.3f}')} |"
        )
    if petsc_note:
        lines.append(f"\nPETSc: {petsc_note}.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, nargs="+", default=[128, 500, 1000, 2000])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--plain-up-to", type=int, default=2000)
    parser.add_argument("--block-jacobi-up-to", type=int, default=1000,
                        help="CG + block_jacobi(local='amg') on the matrix as sparse_rows up to this n")
    parser.add_argument("--no-petsc", action="store_true")
    parser.add_argument("--eigsh", type=int, default=0, metavar="K",
                        help="instead: the K smallest eigenvalues at the first --n (LOBPCG and shift-invert, "
                             "with multigrid; scipy lobpcg + pyamg as the peer)")
    parser.add_argument("--write", action="store_true", help="write benchmarks/results_multigrid.md")
    args = parser.parse_args()
    if args.worker and args.eigsh:
        eigsh_worker(args.n[0], args.eigsh)
        return
    if args.worker:
        worker(args.n, args.plain_up_to, args.block_jacobi_up_to)
        return
    if args.eigsh:
        mpiexec = Path(sys.executable).parent / "mpiexec"
        for ranks in args.ranks:
            out = subprocess.run([str(mpiexec), "-n", str(ranks), sys.executable, __file__, "--worker", "--eigsh",
                                  str(args.eigsh), "--n", str(args.n[0])], capture_output=True, text=True,
                                 env=dict(os.environ, DISTLINALG_STALL="0"), timeout=3600)
            lines = [line[7:] for line in out.stdout.splitlines() if line.startswith("RESULT ")]
            print(lines[0] if lines else (out.stdout + out.stderr)[-3000:], flush=True)
        print(json.dumps({"scipy lobpcg + pyamg (1 process)": scipy_lobpcg_pyamg(args.n[0], args.eigsh)}))
        return
    env, petsc_note = (None, "not run (--no-petsc)") if args.no_petsc else petsc_environment()
    results = []
    for ranks in args.ranks:
        rows = distlinalg_run(args.n, ranks, args.plain_up_to, args.block_jacobi_up_to)
        for row in rows:
            if env is not None:
                row["petsc"] = petsc_run(row["n"], ranks, env)
            results.append(row)
            print(json.dumps(row), flush=True)
    if args.write:  # merged with earlier runs' rows (by rank count and n): a run may cover some of them
        store = ROOT / "benchmarks" / "data" / "multigrid.json"
        kept = {(r["ranks"], r["n"]): r for r in (json.loads(store.read_text()) if store.exists() else [])}
        kept.update({(r["ranks"], r["n"]): r for r in results})
        results = [kept[key] for key in sorted(kept)]
        store.write_text(json.dumps(results, indent=1) + "\n")
    text = table(results, petsc_note)
    print(text)
    if args.write:
        header = (ROOT / "benchmarks" / "results_multigrid.md")
        # The eigenvalue section (written from --eigsh runs) is kept below the new table.
        previous = header.read_text() if header.exists() else ""
        kept = previous[previous.index("\n## Eigenvalues"):] if "\n## Eigenvalues" in previous else ""
        header.write_text(
            "# Multigrid-preconditioned CG on the 2-D Poisson problem\n\n"
            f"`python benchmarks/bench_multigrid.py --write` ({time.strftime('%Y-%m-%d')}, this machine: "
            f"{os.cpu_count()} cores). b = 1, rtol 1e-8 on the true residual; times are the best of 3 "
            "runs after compilation, setup included (multigrid's build; PETSc's KSPSetUp with GAMG). "
            "PETSc: Debian's PETSc 3.18 with Open MPI, KSPCG + PCGAMG, unpreconditioned norm.\n\n"
            + text + "\n" + kept
        )


if __name__ == "__main__":
    main()
