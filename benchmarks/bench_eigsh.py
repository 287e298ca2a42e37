"""The k smallest eigenpairs of the 2-D Laplacian, to a tolerance, side by side in one run.

    mpiexec -n 2 python benchmarks/bench_eigsh.py [--n 1000] [--k 10] [--tol 1e-6] [--repeats 3]
        [--contenders distlinalg-lanczos distlinalg-lobpcg scipy-eigsh jax-lobpcg]
        [--ncv NCV] [--lanczos-maxiter C] [--lobpcg-maxiter I] [--scipy-maxiter C] [--jax-lobpcg-maxiter I]
        [--output FILE] [--json FILE]

The operator: the 5-point Dirichlet Laplacian on an n×n grid (4 on the
diagonal, N = n² unknowns), eigenvalues 4 sin²(πp/(2(n+1))) + 4 sin²(πq/(2(n+1))),
p, q = 1..n, so the k wanted ones are known exactly (λ_pq = λ_qp: most come
in pairs; for k = 10 the wanted set ends with a complete pair, 17 and 18 in
units of (π/(n+1))²). Each contender is timed from start to tolerance
(compile excluded: the jitted solves are compiled ahead of time with
``.lower().compile()``, no warm-up solve), median over --repeats, the
contenders interleaved repeat by repeat; a distributed time is the slowest
rank's (MPI max after a barrier).

Contenders:
  distlinalg-lanczos  ``distlinalg.eigsh(A, k, tol=tol, method="lanczos")`` on
                      ``operators.laplacian_2d(n)`` (sharded grid rows), jitted:
                      thick-restart Lanczos (Krylov–Schur), basis ncv
                      (default min(N, max(2k+1, 20)) = 21 for k = 10), maxiter =
                      restart cycles.
  distlinalg-lobpcg   the same with method="lobpcg", no preconditioner (block of k,
                      maxiter = iterations). No preconditioned variant is run: the
                      cheap ones (Jacobi: 4·I) do nothing here, and an exact fast
                      solver (the sine transform) would be the answer itself.
  scipy-eigsh         ``scipy.sparse.linalg.eigsh(L, k, which="SA", tol=tol, ncv=ncv,
                      maxiter=C)`` (ARPACK implicitly restarted Lanczos, one
                      process) on the CSR matrix behind a LinearOperator that
                      counts its matvecs. Its restart count (ARPACK's iparam(3))
                      is read off the solver's state by wrapping scipy's private
                      ``_SymmetricArpackParams.extract`` (— if that fails).
                      No convergence within maxiter: ArpackNoConvergence, which
                      returns only the pairs it counts converged; their
                      eigenvalue error is to the nearest wanted exact value.
  jax-lobpcg          ``jax.experimental.sparse.linalg.lobpcg_standard`` (one
                      process, jitted) on a matrix-free stencil of the same
                      operator on (N, c) blocks. It finds the LARGEST eigenvalues,
                      so it runs on B = 8·I − A and λ = 8 − θ. X0: normal
                      pseudo-random (N, k), fixed seed. Matvecs: k for the start
                      and 4k per iteration (its Rayleigh–Ritz step applies B to
                      the whole [X, P, R] basis, 3k vectors, and then B X for the
                      new residuals, k more: jax 0.10's source).

One-process peers in a run of several ranks run on rank 0 while the other
ranks sleep (as in bench_krylov.py); rank 0's XLA thread pool was sized for
its share of the CPUs there, so jax-lobpcg's fair figures are the 1-rank
run's. scipy's ARPACK/CSR path is single-threaded either way.

Tolerances, all mapped to the same per-pair target ‖A x − θ x‖ ≤ tol·|θ|:
  distlinalg  a pair converges when ‖A x − θ x‖ ≤ max(tol·|θ|, 64 ε ‖A‖est)
              (Ritz estimate in Lanczos, the block residual in LOBPCG); the
              floor 64 ε·8 ≈ 1.1e-13 is far below tol·λ₁ here.
  scipy       ARPACK: Ritz estimate ≤ tol·max(ε^(2/3), |θ|): the same test.
  jax-lobpcg  ‖B v − θ_B v‖ < tol_jax · 10 N (θ_B + ‖B v‖), θ_B ≈ ‖B v‖ ≈ 8: one
              scalar for all pairs, so tol_jax = tol·λ₁ / (10 N · 16) (λ₁ the
              smallest exact eigenvalue): the strictest pair's target for every
              pair (stricter than the others' tol·|θᵢ| by up to λ_k/λ₁ = 8.5×).
Iteration caps. The k smallest eigenvalues are ≈ (π/(n+1))²·{2, 5, 5, 8, …, 17} with
gaps of ≈ (π/(n+1))² against ‖A‖ ≈ 8, so unpreconditioned methods need many
matvecs, growing faster than n. Measured to tol 1e-6 (1 rank): n = 100: Lanczos
(distlinalg / ARPACK) ~4,000 / 3,300 matvecs, LOBPCG (distlinalg / jax) ~1,200 /
560 iterations; n = 300: 33,000 / 26,000 matvecs, 6,000 / 2,100 iterations (×8, ×4
for 3× n). At n = 1000 that extrapolates to ~300,000 matvecs for Lanczos and
~10,000 LOBPCG iterations: hours for every contender on this machine. So the
defaults are caps that stop each contender after about 1–4 minutes at n = 1000
on one rank (--lanczos-maxiter 600 cycles, the same as --scipy-maxiter 600 for
ARPACK; --lobpcg-maxiter 120 and --jax-lobpcg-maxiter 120): nothing converges
there and each row says what was reached (residuals, errors). At n ≤ 300 pass
caps that are not reached (results_eigsh.md: 20000 / 10000 / 20000 / 10000).
After a converged Krylov–Schur pass, distlinalg's Lanczos runs probes for missed
copies of multiple eigenvalues (up to k, each a Lanczos run for one pair with up
to maxiter cycles of its own), so a converged run's cycles can exceed maxiter;
before commit 4d841d3 the probes also ran after an unconverged pass (220 cycles
at maxiter = 20 in the first n = 1000 runs).
Every result is then checked the same way, independently of the contender: the
returned vectors (gathered to rank 0) against scipy's CSR matrix, residual
‖A xᵢ − θᵢ xᵢ‖, "checked" = every pair within max(tol·|θᵢ|, 64 ε·8), and
the largest |θᵢ − λᵢ| against the sorted exact spectrum (a missed copy of a
double eigenvalue shows up there).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# bench_krylov fixes the node's CPU list before distlinalg's per-rank CPU blocks apply
# (its on_root widens rank 0 back to the node for the one-process peers).
from bench_krylov import on_root, scipy_laplacian  # noqa: E402

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import _util  # noqa: E402

CONTENDERS = ("distlinalg-lanczos", "distlinalg-lobpcg", "scipy-eigsh", "jax-lobpcg")
ONE_PROCESS = ("scipy-eigsh", "jax-lobpcg")
LABELS = {
    "distlinalg-lanczos": "distlinalg eigsh lanczos",
    "distlinalg-lobpcg": "distlinalg eigsh lobpcg",
    "scipy-eigsh": "scipy eigsh (ARPACK, CSR)",
    "jax-lobpcg": "jax lobpcg_standard (8I − A)",
}
SHIFT = 8.0  # jax-lobpcg runs on SHIFT·I − A (≥ 0: ‖A‖ < 8)


def exact_eigenvalues(n: int, k: int) -> np.ndarray:
    """The k smallest eigenvalues of the n×n Dirichlet Laplacian, ascending (no cancellation)."""
    m = min(n, k)
    s = 4 * np.sin(np.pi * np.arange(1, m + 1) / (2 * (n + 1))) ** 2
    return np.sort((s[:, None] + s[None, :]).ravel())[:k]


def floor_abs() -> float:
    return 64 * np.finfo(np.float64).eps * SHIFT


# ---------------------------------------------------------------------------
def check(L, w, X, exact, tol):
    """Independent check on rank 0: CSR residuals of (w, X) (X: (N, j) columns), errors to the
    exact spectrum (sorted against sorted when all k came back, else to the nearest wanted one)."""
    w = np.asarray(w, dtype=np.float64)
    order = np.argsort(w)
    w, X = w[order], X[:, order]
    R = L @ X - X * w[None, :]
    res = np.linalg.norm(R, axis=0)
    ok = res <= np.maximum(tol * np.abs(w), floor_abs())
    if len(w) == len(exact):
        err = np.abs(w - exact)
    else:
        err = np.array([np.min(np.abs(exact - v)) for v in w]) if len(w) else np.array([np.nan])
    return {"eigenvalues": w.tolist(), "residuals": res.tolist(), "pairs_ok": int(ok.sum()),
            "returned": int(len(w)), "checked": bool(ok.all() and len(w) == len(exact)),
            "max_error": float(np.max(err)), "max_residual": float(np.max(res)) if len(res) else float("nan"),
            "max_relative_residual": float(np.max(res / np.abs(w))) if len(res) else float("nan")}


class State:
    """What the contenders share on rank 0: the CSR matrix for the checks and the exact values."""

    def __init__(self, args):
        self.args = args
        self.exact = exact_eigenvalues(args.n, args.k)
        self._L = None

    @property
    def L(self):
        if self._L is None:
            self._L = scipy_laplacian(self.args.n)
        return self._L


def distlinalg_contender(name, args, comm, state):
    import distlinalg as dl
    from distlinalg.operators import laplacian_2d

    method = name.split("-")[1]
    A = laplacian_2d(args.n, dtype=jnp.float64)
    cap = args.lanczos_maxiter if method == "lanczos" else args.lobpcg_maxiter
    kwargs = dict(tol=args.tol, method=method, maxiter=cap)
    if method == "lanczos" and args.ncv is not None:
        kwargs["ncv"] = args.ncv
    t = time.perf_counter()
    compiled = jax.jit(lambda: dl.eigsh(A, args.k, **kwargs)).lower().compile()
    compile_s = time.perf_counter() - t

    def sample():
        out = {}
        seconds = _util.timed_once(lambda: out.setdefault("r", jax.block_until_ready(compiled())), comm)
        w, V, info = out["r"]
        parts = comm.gather(np.asarray(V), root=0)  # (k, local rows) per rank, in rank order
        result = None
        if comm.Get_rank() == 0:
            X = np.concatenate(parts, axis=1).T        # (N, k)
            result = check(state.L, np.asarray(w), X, state.exact, args.tol)
            result.update(
                seconds=seconds, matvecs=int(info.matvecs),
                iterations=int(info.restarts) if method == "lanczos" else int(info.iterations),
                steps=int(info.iterations), cap=cap, converged=bool(info.converged),
                own_max_residual=float(np.max(np.asarray(info.residual_norms))))
        return comm.bcast(result, root=0)

    return {"sample": sample, "compile_seconds": compile_s, "cap": cap,
            "iterations_unit": "restart cycles" if method == "lanczos" else "iterations"}


def scipy_contender(args, comm, state):
    import scipy.sparse.linalg as spla
    from scipy.sparse.linalg._eigen.arpack import arpack as _arpack

    N = args.n * args.n
    cap = args.scipy_maxiter

    def run():
        L = state.L
        count = [0]

        def mv(x):
            count[0] += 1
            return L @ x

        op = spla.LinearOperator((N, N), matvec=mv, dtype=np.float64)
        seen = {}
        original = _arpack._SymmetricArpackParams.extract

        def extract(self, *a, **kw):  # ARPACK's restart count, Ritz values and estimates (eigsh returns none)
            seen["iter"] = int(self.arpack_dict.get("iter", -1))
            at, m = int(self.ipntr[5]), int(self.ncv)        # workl's ritz / bounds arrays (0-based here)
            seen["ritz"] = self.workl[at:at + m].copy()
            seen["bounds"] = self.workl[int(self.ipntr[6]):int(self.ipntr[6]) + m].copy()
            return original(self, *a, **kw)

        _arpack._SymmetricArpackParams.extract = extract
        try:
            start = time.perf_counter()
            try:
                w, X = spla.eigsh(op, k=args.k, which="SA", tol=args.tol, ncv=args.ncv, maxiter=cap, rng=12345)
                converged = True
            except spla.ArpackNoConvergence as exc:
                w, X, converged = exc.eigenvalues, exc.eigenvectors, False
            seconds = time.perf_counter() - start
        finally:
            _arpack._SymmetricArpackParams.extract = original
        result = check(L, w, X, state.exact, args.tol)
        result.update(seconds=seconds, matvecs=count[0], iterations=seen.get("iter"), cap=cap,
                      converged=converged, own_max_residual=None)
        if not converged and "ritz" in seen:
            # What it reached: the k smallest of ARPACK's ncv Ritz values at the cap and their Ritz
            # estimates (no vectors come back, so nothing to check them with).
            order = np.argsort(seen["ritz"])[:args.k]
            ritz, bounds = seen["ritz"][order], np.abs(seen["bounds"][order])
            result.update(ritz_values=ritz.tolist(), ritz_estimates=bounds.tolist(),
                          ritz_max_error=float(np.max(np.abs(ritz - state.exact))),
                          ritz_max_estimate=float(np.max(bounds)),
                          ritz_max_relative_estimate=float(np.max(bounds / np.abs(ritz))))
        return result

    return {"sample": lambda: on_root(run, comm), "compile_seconds": 0.0, "cap": cap,
            "iterations_unit": "restart cycles"}


def jax_lobpcg_contender(args, comm, state):
    from jax.experimental.sparse.linalg import lobpcg_standard

    n, k = args.n, args.k
    N = n * n
    cap = args.jax_lobpcg_maxiter
    tol_jax = args.tol * float(state.exact[0]) / (10 * N * 2 * SHIFT)
    holder = {}

    def shifted(X):
        """(SHIFT·I − A) X for X of shape (N, c): the stencil on the (n, n, c) grid, c fastest."""
        U = X.reshape(n, n, -1)
        zr, zc = jnp.zeros_like(U[:1]), jnp.zeros_like(U[:, :1])
        up = jnp.concatenate([zr, U[:-1]], axis=0)
        down = jnp.concatenate([U[1:], zr], axis=0)
        left = jnp.concatenate([zc, U[:, :-1]], axis=1)
        right = jnp.concatenate([U[:, 1:], zc], axis=1)
        return ((SHIFT - 4.0) * U + up + down + left + right).reshape(X.shape)

    def build():
        X0 = jax.random.normal(jax.random.PRNGKey(7), (N, k), jnp.float64)
        t = time.perf_counter()
        fn = jax.jit(lambda X: lobpcg_standard(shifted, X, m=cap, tol=tol_jax)).lower(X0).compile()
        holder.update(fn=fn, X0=X0, compile=time.perf_counter() - t)
        return holder["compile"]

    compile_s = on_root(lambda: build(), comm)

    def run():
        start = time.perf_counter()
        theta, U, its = jax.block_until_ready(holder["fn"](holder["X0"]))
        seconds = time.perf_counter() - start
        its = int(its)
        result = check(state.L, SHIFT - np.asarray(theta), np.asarray(U), state.exact, args.tol)
        result.update(seconds=seconds, matvecs=k + 4 * k * its, iterations=its, cap=cap, converged=its < cap,
                      own_max_residual=None, tol_jax=tol_jax)
        return result

    return {"sample": lambda: on_root(run, comm), "compile_seconds": compile_s, "cap": cap,
            "iterations_unit": "iterations", "tol_jax": tol_jax}


# ---------------------------------------------------------------------------
def fmt(x, spec=".3g"):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return format(x, spec)


def table(payload) -> str:
    args = payload["args"]
    n, k, size = args["n"], args["k"], payload["ranks"]
    results, skipped = payload["results"], payload["skipped"]
    exact = payload["exact"]
    peers_where = ("in this 1-rank run" if size == 1 else
                   "on rank 0 of this run while the other ranks sleep")
    lines = [
        f"### 2-D Laplacian {n}×{n} (N = {n * n:,}), k = {k} smallest, tol = {args['tol']:g}, "
        f"{size} rank(s) (jax {jax.__version__}; medians of {args['repeats']} repeat(s))",
        "",
        f"Exact λ₁ … λ_k = {exact[0]:.6g} … {exact[-1]:.6g}; target per pair ‖Ax − θx‖ ≤ tol·|θ| "
        f"({args['tol'] * exact[0]:.2g} … {args['tol'] * exact[-1]:.2g}). One-process peers {peers_where}.",
        "",
        "| contender | processes | time to tol (s) | time / scipy-eigsh | matvecs | ms / matvec | iterations (cap) "
        "| converged (own test) | checked pairs ok | max \\|θ − λ\\| | max ‖Ax − θx‖ | max ‖Ax − θx‖ / \\|θ\\| |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ref = results.get("scipy-eigsh", {}).get("seconds")
    for name, r in results.items():
        ratio = fmt(r["seconds"] / ref, ".2f") if ref else "—"
        its = "—" if r["iterations"] is None else str(r["iterations"])
        unit = "cycles" if r["iterations_unit"] == "restart cycles" else "its"
        ok = f"{r['pairs_ok']}/{k}" + ("" if r["returned"] == k else f" ({r['returned']} returned)")
        err, res, rel = (fmt(r[key], ".2e") for key in ("max_error", "max_residual", "max_relative_residual"))
        if "ritz_max_error" in r:  # scipy at its cap: ARPACK's own Ritz values and estimates (marked ‡)
            err, res, rel = (fmt(r[key], ".2e") + " ‡" for key in
                             ("ritz_max_error", "ritz_max_estimate", "ritz_max_relative_estimate"))
        lines.append(
            f"| {LABELS[name]} | {r['processes']} | {r['seconds']:.3g} | {ratio} | {r['matvecs']:,} | "
            f"{1e3 * r['seconds'] / max(r['matvecs'], 1):.3g} | {its} {unit} ({r['cap']}) | "
            f"{'yes' if r['converged'] else '**no**'} | {ok} | {err} | {res} | {rel} |")
    for name, why in skipped.items():
        lines.append(f"| {LABELS[name]} | skipped: {why} | | | | | | | | | | |")
    lines.append("")
    if any("ritz_max_error" in r for r in results.values()):
        lines.append("‡ scipy-eigsh stopped at its cap (ArpackNoConvergence returns only the pairs ARPACK counts "
                     "converged): the k smallest of ARPACK's ncv Ritz values at that point and their Ritz "
                     "estimates, read off its state; no vectors, so not checked.")
    lanczos = results.get("distlinalg-lanczos")
    if lanczos and lanczos["iterations"] > lanczos["cap"]:
        lines.append(f"distlinalg-lanczos ran {lanczos['iterations']} restart cycles with maxiter = {lanczos['cap']}: "
                     "after the Krylov–Schur pass the library's probes for missed copies of multiple eigenvalues "
                     "(one Lanczos run for one pair each, up to k, each with its own maxiter cycles) ran (before "
                     "commit 4d841d3 also after an unconverged pass).")
    if "jax-lobpcg" in results:
        lines.append(f"jax-lobpcg's tol = {results['jax-lobpcg']['tol_jax']:.3g} (its test: residual < tol·10N·"
                     f"(θ_B + ‖Bv‖), mapped to tol·λ₁ for every pair).")
    lines.append("Compile (excluded): " + ", ".join(f"{name} {r['compile_seconds']:.1f} s"
                                                     for name, r in results.items() if r["compile_seconds"]) + ".")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=1000, help="grid points per side (N = n²)")
    parser.add_argument("--k", type=int, default=10, help="eigenpairs wanted (smallest)")
    parser.add_argument("--tol", type=float, default=1e-6, help="relative tolerance per pair: ‖Ax − θx‖ ≤ tol·|θ|")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=list(CONTENDERS))
    parser.add_argument("--ncv", type=int, default=None,
                        help="Lanczos basis size for distlinalg-lanczos and scipy-eigsh (default: each one's own, "
                             "min(N, max(2k+1, 20)) for both)")
    parser.add_argument("--lanczos-maxiter", type=int, default=600,
                        help="distlinalg-lanczos: restart cycles (default: a cap for n = 1000; see the docstring)")
    parser.add_argument("--lobpcg-maxiter", type=int, default=120, help="distlinalg-lobpcg: iterations")
    parser.add_argument("--scipy-maxiter", type=int, default=600, help="scipy-eigsh: ARPACK restart cycles")
    parser.add_argument("--jax-lobpcg-maxiter", type=int, default=120, help="jax-lobpcg: iterations (its m)")
    parser.add_argument("--output", help="append the markdown table to this file")
    parser.add_argument("--json", help="write the results as JSON (rank 0)")
    args = parser.parse_args()

    import distlinalg  # noqa: F401  (before JAX's backend starts: the per-rank CPU blocks)

    comm = MPI.COMM_WORLD.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    t0 = time.perf_counter()
    revision = _util.git_revision(Path(__file__).resolve().parent.parent)  # the code this run imported
    state = State(args)
    load_start = Path("/proc/loadavg").read_text().strip() if Path("/proc/loadavg").exists() else "?"

    contenders, skipped = {}, {}
    for name in args.contenders:
        try:
            if name.startswith("distlinalg"):
                contenders[name] = distlinalg_contender(name, args, comm, state)
            elif name == "scipy-eigsh":
                contenders[name] = scipy_contender(args, comm, state)
            else:
                contenders[name] = jax_lobpcg_contender(args, comm, state)
        except ImportError as exc:
            skipped[name] = f"import failed: {exc}"
        if rank == 0 and name in contenders:
            _util.eprint(f"[eigsh n={args.n} ranks={size}] {name}: set up "
                         f"(compile {contenders[name]['compile_seconds']:.1f} s)")

    samples = {name: [] for name in contenders}
    for rep in range(args.repeats):  # interleaved
        for name, c in contenders.items():
            value = c["sample"]()
            if "error" in value:
                skipped[name] = value["error"]
                continue
            samples[name].append(value)
            if rank == 0:
                _util.eprint(f"[eigsh n={args.n} ranks={size}] repeat {rep + 1} {name}: {value['seconds']:.3g} s, "
                             f"{value['matvecs']} matvecs, iterations {value['iterations']}, converged "
                             f"{value['converged']}, checked {value['pairs_ok']}/{args.k}, max error "
                             f"{value['max_error']:.2e}, max residual {value['max_residual']:.2e}")

    results = {}
    for name, c in contenders.items():
        if name in skipped or not samples[name]:
            continue
        runs = samples[name]
        times = [s["seconds"] for s in runs]
        middle = sorted(runs, key=lambda s: s["seconds"])[(len(runs) - 1) // 2]  # the median run's details
        results[name] = dict(middle, seconds=_util.median(times), samples=times,
                             processes=1 if name in ONE_PROCESS else size,
                             compile_seconds=c["compile_seconds"], iterations_unit=c["iterations_unit"])
    load_end = Path("/proc/loadavg").read_text().strip() if Path("/proc/loadavg").exists() else "?"
    payload = {"bench": "eigsh", "ranks": size, "args": vars(args), "exact": state.exact.tolist(),
               "results": results, "skipped": skipped, "seconds": time.perf_counter() - t0,
               "loadavg_start": load_start, "loadavg_end": load_end, "versions": _util.versions(),
               "git": revision,
               "machine": _util.machine_info()}
    if rank != 0:
        return
    if args.json:
        _util.write_json(args.json, payload)
    text = table(payload)
    print(text)
    print(f"\n(distlinalg at {payload['git']}; load average at start: {load_start}; at end: {load_end}; "
          f"{payload['seconds']:.0f} s in all)")
    if args.output:
        with open(args.output, "a") as f:
            f.write(text + "\n\n")


if __name__ == "__main__":
    main()
