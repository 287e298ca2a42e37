"""A latency-bandwidth cost model of distlinalg's collectives, CG and SR, fitted and checked.

    python benchmarks/cost_model.py [--collectives FILE ...] [--krylov FILE ...] [--sr FILE ...]
        [--plots DIR] [--markdown FILE]

Every time is built from these machine constants:

  α_op, β_op  per collective, its cost α + n·β on 2 ranks of a node (fitted to
              ``bench_collectives.py``'s in-jit distlinalg calls at 2 ranks:
              least squares on the relative error over 8 B – 64 MiB);
  B           memory bandwidth: the STREAM triad that ``bench_krylov.py``
              measures in the same run, all ranks of the node at once
              (aggregate), shared by the ranks of a node;
  network     across nodes, one message costs α_net + n/B_nic, every byte of
              a node through its NIC (stated for the cluster, not fitted).

Collectives follow the algorithms MPICH picks (Thakur, Rabenseifner, Gropp
2005). On R ranks, with L = ⌈log₂ R⌉, an operation takes `steps` latencies
and moves `factor`·n bytes per rank (``shape``):

  allreduce  n ≤ 2 KiB: recursive doubling   L steps, factor L
             larger:    Rabenseifner         2L steps, factor 2(R−1)/R
  allgather  (n per rank)                    L steps, factor R − 1
  bcast      n ≤ 12 KiB: binomial            L steps, factor L
             larger: scatter + allgather     L + R − 1 steps, factor 2(R−1)/R
  alltoall   (n per rank in all)             R − 1 steps, factor (R−1)/R
  sendrecv   ring shift                      1 step, factor 1

and costs α_op·steps(R)/steps(2) + n·β_op·factor(R)/factor(2). On a cluster,
P = R·M ranks on M nodes: the operation runs inside the nodes, then once more
across the M nodes on the data a node holds (``collective``).

One CG iteration on the 5-point Laplacian, N = n² unknowns split by grid rows:

  T = passes·8·N/P / B_rank  +  2·sendrecv(8n)  +  reductions
      passes: 11 (standard, single reduction), 20 (pipelined) (bench_krylov.py)
      reductions: 2·allreduce(8 B) standard; 1·allreduce(16 B) single reduction;
      pipelined: max(0, allreduce(24 B) − the matvec and preconditioner it
      hides behind), which needs asynchronous progress (benchmarks/results_overlap.md)

One SR step (parameter space, CG on S = OᴴO/N + λ, k iterations, N_s samples,
N_p real parameters):

  T = c₀ + c₁·N_s·N_p/P + k·(allreduce(8·N_p) + 2·allreduce(8 B))

c₀ (what does not shrink with P: the step's Python and dispatch, the loop
overhead of k iterations) and c₁ (sampling, local energies and k Jacobian
products per sample and parameter) are fitted to the 1- and 2-rank step
times; the larger P are predictions. The dense solvers (``solver="cholesky"``
of ``natural_gradient``) add:

  parameter space  2·N_s·N_p²/P flops (OᴴO) + allreduce(8·N_p²) + N_p³/3 flops (Cholesky)
  sample space     2·N_s²·N_p/P flops (ring products) + (P−1)·sendrecv(8·N_s·N_p/P)
                   + allgather(8·N_s²/P) + N_s³/3 flops
  split by rows    the ring products, then ScaLAPACK's Cholesky on the rows
                   (``row_split_solve``: N_s³/(3P) flops, panel broadcasts on a
                   √P × √P grid, the move to the block-cyclic layout and back)

at a flop rate F per rank (a measured dgemm rate, ``--flops``).

Without arguments the model reads the measurements kept in
benchmarks/data/ (this machine's collectives, CG and SR at 1, 2 and 4 ranks,
and the 16-core node's CG and SR at 1–16 ranks), prints predicted against
measured with the relative error, and predicts to 1,024 ranks for the
cluster ``HDR_CLUSTER`` below. docs/scaling.md shows and discusses its output.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
KiB = 1024


# -- machine constants -----------------------------------------------------------
@dataclass(frozen=True)
class Link:
    """One message of n bytes costs alpha + n·beta seconds."""

    alpha: float  # s
    beta: float  # s per byte

    def message(self, nbytes: float) -> float:
        return self.alpha + nbytes * self.beta


@dataclass(frozen=True)
class Machine:
    """Nodes of `ranks_per_node` ranks.

    `node`: per operation, the (α, β) of that collective between 2 ranks of a
    node (fitted); the shape functions below carry it to R ranks.
    `network`: one message between two nodes (a node's NIC: all its ranks
    share its bandwidth). `node_bandwidth`: the memory bandwidth all ranks of
    a node reach together (B/s); a rank gets its share. `flops`: one rank's
    dgemm rate (flop/s).
    """

    name: str
    node: dict[str, Link]
    network: Link
    ranks_per_node: int
    node_bandwidth: float
    flops: float
    rank_bandwidth_limit: float = math.inf  # what one rank reaches alone (one core's STREAM)

    def rank_bandwidth(self, P: int) -> float:
        return min(self.node_bandwidth / min(P, self.ranks_per_node), self.rank_bandwidth_limit)

    def split(self, P: int) -> tuple[int, int]:
        """(ranks per node R, nodes M) of P ranks placed node by node."""
        R = min(P, self.ranks_per_node)
        return R, math.ceil(P / R)


# A documented InfiniBand HDR class cluster (the prediction target). Inside a
# node: the shared-memory collectives fitted on this machine; across: HDR
# 200 Gb/s, MPI latency ~1.5 µs across one switch level, ~24 GB/s achievable
# per direction and node, shared by the node's ranks when all of them talk.
HDR_ALPHA = 1.5e-6
HDR_BYTES_PER_S = 24e9
HDR_NODE_RANKS = 64  # 2 × 32-core sockets, one rank per core
HDR_NODE_BANDWIDTH = 300e9  # STREAM triad of such a node (8-channel DDR4-3200 per socket)
HDR_RANK_FLOPS = 30e9  # one core's dgemm (AVX2 FMA at ~2.5 GHz, ~75% of peak)
HDR_RANK_BANDWIDTH = 20e9  # one core's STREAM triad alone (the node saturates at ~15 ranks)


def hdr_cluster(node: dict[str, Link]) -> Machine:
    return Machine("HDR InfiniBand cluster, 64 ranks/node", node, Link(HDR_ALPHA, 1 / HDR_BYTES_PER_S),
                   HDR_NODE_RANKS, HDR_NODE_BANDWIDTH, HDR_RANK_FLOPS, HDR_RANK_BANDWIDTH)


# -- collectives -----------------------------------------------------------------
SHORT_ALLREDUCE = 2 * KiB  # MPICH: recursive doubling up to here, Rabenseifner beyond
SHORT_BCAST = 12 * KiB  # MPICH: binomial tree up to here, scatter + allgather beyond


def shape(op: str, nbytes: float, P: int) -> tuple[float, float]:
    """(latency steps, bytes factor) of `op` on P ranks of one kind of link.

    nbytes is each rank's buffer (allgather: its contribution; alltoall: all
    its blocks together). Time = steps·α + factor·nbytes·β.
    """
    if P <= 1:
        return 0.0, 0.0
    L = math.ceil(math.log2(P))
    if op == "allreduce":
        return (L, L) if nbytes <= SHORT_ALLREDUCE else (2 * L, 2 * (P - 1) / P)
    if op == "allgather":
        return L, P - 1
    if op == "bcast":
        return (L, L) if nbytes <= SHORT_BCAST else (L + P - 1, 2 * (P - 1) / P)
    if op == "alltoall":
        return P - 1, (P - 1) / P
    if op == "sendrecv":
        return 1, 1
    raise ValueError(op)


def collective(machine: Machine, op: str, nbytes: float, P: int) -> float:
    """Seconds of one collective: inside the nodes, then (P > R) across them.

    Inside a node the per-operation (α, β) fitted at 2 ranks is carried to R
    ranks by the shape: α·steps(R)/steps(2) + n·β·factor(R)/factor(2). Across
    M nodes the algorithm runs once more between nodes on the data a node
    holds (allreduce, bcast: the vector; allgather, alltoall: R ranks' worth),
    every byte through the node's NIC.
    """
    if P <= 1:
        return 0.0
    R, M = machine.split(P)
    fit = machine.node[op]
    steps2, factor2 = shape(op, nbytes, 2)
    steps, factor = shape(op, nbytes, R)
    inside = fit.alpha * steps / steps2 + nbytes * fit.beta * factor / factor2
    if M == 1:
        return inside
    node_bytes = nbytes * (R if op in ("allgather", "alltoall") else 1)
    if op == "sendrecv":  # a halo: one message per neighbouring node, not shared
        node_bytes = nbytes
    steps, factor = shape(op, node_bytes, M)
    return inside + machine.network.alpha * steps + factor * node_bytes * machine.network.beta


def allreduce(machine: Machine, nbytes: float, P: int) -> float:
    return collective(machine, "allreduce", nbytes, P)


def sendrecv(machine: Machine, nbytes: float, P: int) -> float:
    return collective(machine, "sendrecv", nbytes, P)


def allgather(machine: Machine, nbytes_per_rank: float, P: int) -> float:
    return collective(machine, "allgather", nbytes_per_rank, P)


def fit_link(sizes: list[float], seconds: list[float]) -> Link:
    """α, β minimising Σ((α + nβ − t)/t)² (every size weighs the same)."""
    import numpy as np

    n, t = np.asarray(sizes, float), np.asarray(seconds, float)
    A = np.stack([1 / t, n / t], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(A, np.ones_like(t), rcond=None)
    return Link(max(float(alpha), 0.0), max(float(beta), 0.0))


def fit_node(table: dict[tuple[int, str], dict[int, float]]) -> dict[str, Link]:
    """Per operation, (α, β) from its 2-rank measurements.

    allreduce and bcast change algorithm with the size (see `shape`); one
    (α, β) per operation spans both, which is part of the fit's error.
    """
    return {op: fit_link(list(by_size), list(by_size.values())) for (P, op), by_size in table.items() if P == 2}


# -- CG on the 5-point Laplacian ---------------------------------------------------
PASSES = {"cg": 11, "cg-sr": 11, "cg-pipe": 20}


def cg_iteration(machine: Machine, n: int, P: int, method: str = "cg") -> dict[str, float]:
    """Seconds of one CG iteration on an n×n grid over P ranks, term by term."""
    N = n * n
    stream = PASSES[method] * 8 * N / P / machine.rank_bandwidth(P)
    halo = 2 * sendrecv(machine, 8 * n, P)
    if method == "cg":
        reductions = 2 * allreduce(machine, 8, P)
    elif method == "cg-sr":
        reductions = allreduce(machine, 16, P)
    else:  # hidden behind the matvec (5 of the 20 passes) when MPI progresses on its own
        reductions = max(0.0, allreduce(machine, 24, P) - 5 * 8 * N / P / machine.rank_bandwidth(P))
    return {"stream": stream, "halo": halo, "reductions": reductions, "total": stream + halo + reductions}


# -- SR ---------------------------------------------------------------------------
@dataclass(frozen=True)
class SRFit:
    """T_step(P) = c0 + c1·N_s·N_p/P + k·(allreduce(8 N_p) + 2 allreduce(8))."""

    c0: float
    c1: float


def sr_communication(machine: Machine, n_params: int, iterations: float, P: int) -> float:
    return iterations * (allreduce(machine, 8 * n_params, P) + 2 * allreduce(machine, 8, P))


def sr_step(machine: Machine, fit: SRFit, n_samples: int, n_params: int, iterations: float, P: int) -> float:
    return fit.c0 + fit.c1 * n_samples * n_params / P + sr_communication(machine, n_params, iterations, P)


def fit_sr(machine: Machine, runs: dict[int, dict]) -> SRFit:
    """c0, c1 from the 1- and 2-rank step times (communication subtracted)."""
    (p1, r1), (p2, r2) = sorted(runs.items())[:2]
    work = {p: r["n_samples"] * r["n_params"] / p for p, r in ((p1, r1), (p2, r2))}
    net = {p: r["step_seconds"] - sr_communication(machine, r["n_params"], r["iterations"], p)
           for p, r in ((p1, r1), (p2, r2))}
    c1 = (net[p1] - net[p2]) / (work[p1] - work[p2])
    return SRFit(net[p1] - c1 * work[p1], c1)


def dense_sr_step(machine: Machine, n_samples: int, n_params: int, P: int, space: str) -> float:
    """The dense solve of one natural-gradient step (beyond forming the Jacobian rows)."""
    F = machine.flops
    if space == "parameter":
        return 2 * n_samples * n_params**2 / P / F + allreduce(machine, 8 * n_params**2, P) + n_params**3 / 3 / F
    rows = 8 * n_samples * n_params / P
    ring = (P - 1) * sendrecv(machine, rows, P)
    return (2 * n_samples**2 * n_params / P / F + ring + allgather(machine, 8 * n_samples**2 / P, P)
            + n_samples**3 / 3 / F)


# The row-split dense solve of distlinalg.linalg (ScaLAPACK's p?potrf/p?potrs on a q × q grid, block nb).
SCALAPACK_BLOCK = 64
SCALAPACK_EFFICIENCY = 0.75  # its flop rate against one rank's dgemm (here: 0.79 at 2 ranks, N = 8192)
REDISTRIBUTION_PANELS = 8  # the handler's rows <-> block-cyclic move, one alltoallv per panel each way
HANDLER_SHARES = 1.25  # the handler's peak beside the kernel's rows, in shares N²/P (measured, N = 2048)


def row_split_solve(machine: Machine, n: int, P: int) -> dict[str, float]:
    """Seconds and bytes per rank of cholesky_solve on an n × n matrix held by rows over P ranks.

    Factorisation: n³/(3P) flops at SCALAPACK_EFFICIENCY·F, and per block column a broadcast of its
    panel (n/q × nb on average half that) along the process rows and the process columns; the two
    triangular solves: 2n²/P flops and 2 broadcasts of nb numbers per block; the move to and from
    the block-cyclic layout: 2·panels alltoalls of 8n²/(P·panels) bytes per rank.
    """
    q = max(1, math.isqrt(P))
    blocks = n / SCALAPACK_BLOCK
    panel = 8 * SCALAPACK_BLOCK * n / (2 * q)
    compute = (n**3 / 3 + 2 * n**2) / P / (SCALAPACK_EFFICIENCY * machine.flops)
    factor_messages = blocks * 2 * collective(machine, "bcast", panel, q)
    solve_messages = 2 * blocks * 2 * collective(machine, "bcast", 8 * SCALAPACK_BLOCK, q)
    move = 2 * REDISTRIBUTION_PANELS * collective(machine, "alltoall", 8 * n**2 / P / REDISTRIBUTION_PANELS, P)
    return {"compute": compute, "communication": factor_messages + solve_messages + move,
            "total": compute + factor_messages + solve_messages + move,
            "bytes_per_rank": 8 * n**2 / P * (1 + HANDLER_SHARES)}


def row_split_sr_step(machine: Machine, n_samples: int, n_params: int, P: int) -> dict[str, float]:
    """Sample-space SR with the kernel split by rows from its construction to its solution
    (dnk.cholesky_distributed): the ring products of the Jacobian rows, then row_split_solve."""
    F = machine.flops
    kernel = 2 * n_samples**2 * n_params / P / F + (P - 1) * sendrecv(machine, 8 * n_samples * n_params / P, P)
    solve = row_split_solve(machine, n_samples, P)
    return {"kernel": kernel, **solve, "total": kernel + solve["total"]}


# -- reading the measurements ------------------------------------------------------
def load(patterns: list[str]) -> list[dict]:
    out = []
    for pattern in patterns:
        for path in sorted(glob.glob(str(pattern))):
            with open(path) as f:
                out.append(json.load(f) | {"_path": path})
    return out


def collective_table(runs: list[dict], contender: str) -> dict[tuple[int, str], dict[int, float]]:
    """(P, op) -> {bytes: seconds} of one contender."""
    table = {}
    for run in runs:
        for op, by_size in run["results"].get(contender, {}).items():
            table[(run["ranks"], op)] = {int(n): t for n, t in by_size.items()}
    return table


def rel(pred: float, meas: float) -> float:
    return (pred - meas) / meas


# -- the report --------------------------------------------------------------------
def report(args: argparse.Namespace) -> str:
    import numpy as np

    lines: list[str] = []
    say = lines.append
    coll = load(args.collectives)
    if not coll:
        raise SystemExit(f"cost_model: no collective measurements in {args.collectives}")
    ours = collective_table(coll, "distlinalg-jit")
    peer = collective_table(coll, "mpi4py")
    fits, fits_peer = fit_node(ours), fit_node(peer)
    krylov = {r["ranks"]: r for r in load(args.krylov)}
    triad_here = max((r["triad"]["aggregate_gb_s"] for r in krylov.values()), default=10.0) * 1e9
    here = Machine("this machine (shared memory)", fits, Link(0.0, 0.0), 10**9, triad_here, args.flops)

    say("## Fitted constants (2 ranks, shared memory, per operation)\n")
    say("T(n) = α + n·β on 2 ranks, least squares on the relative error over 8 B – 64 MiB; "
        "the fit's own error at 2 ranks, then the prediction at 4 ranks from the shapes of the algorithms.\n")
    say("| op | α distlinalg | 1/β distlinalg | α mpi4py | 1/β mpi4py | error at 2 (median, largest) "
        "| error at 4 (median, largest) |")
    say("|---|---|---|---|---|---|---|")
    for op, fit in sorted(fits.items()):
        errors = {}
        for P in (2, 4):
            measured = ours.get((P, op), {})
            errs = [abs(rel(collective(here, op, n, P), t)) for n, t in measured.items()]
            errors[P] = f"{np.median(errs):.0%}, {max(errs):.0%}" if errs else "—"
        other = fits_peer.get(op, Link(float("nan"), float("nan")))
        say(f"| {op} | {fit.alpha * 1e6:.2f} µs | {_rate(fit.beta)} | {other.alpha * 1e6:.2f} µs | {_rate(other.beta)} "
            f"| {errors[2]} | {errors[4]} |")
    say(f"\nAcross nodes (stated, not fitted): HDR InfiniBand, α = {HDR_ALPHA * 1e6:.1f} µs, "
        f"{HDR_BYTES_PER_S / 1e9:.0f} GB/s per node, {HDR_NODE_RANKS} ranks per node, "
        f"node memory bandwidth {HDR_NODE_BANDWIDTH / 1e9:.0f} GB/s (one rank alone {HDR_RANK_BANDWIDTH / 1e9:.0f} GB/s), "
        f"{HDR_RANK_FLOPS / 1e9:.0f} GF/s dgemm per rank.\n")

    say("## CG per iteration: predicted vs measured\n")
    say("B = the STREAM triad of all ranks measured in the same run; α, β as fitted above.\n")
    say("| machine | n | P | method | stream | halo | reductions | predicted | measured | error |")
    say("|---|---|---|---|---|---|---|---|---|---|")
    for label, runs in (("this machine", load(args.krylov)), ("16-core node", load(args.krylov_node))):
        for run in sorted(runs, key=lambda r: r["ranks"]):
            P = run["ranks"]
            m = replace(here, node_bandwidth=run["triad"]["aggregate_gb_s"] * 1e9)
            for name, res in run["results"].items():
                method = name.removeprefix("distlinalg-")
                if method not in PASSES:
                    continue
                terms = cg_iteration(m, run["n"], P, method)
                meas = res["seconds_per_iteration"]
                say(f"| {label} | {run['n']} | {P} | {method} | {terms['stream'] * 1e3:.3f} | {terms['halo'] * 1e3:.4f} | "
                    f"{terms['reductions'] * 1e3:.4f} | {terms['total'] * 1e3:.3f} ms | {meas * 1e3:.3f} ms | "
                    f"{rel(terms['total'], meas):+.0%} |")
    say("")

    say("## SR step: fitted on 1 and 2 ranks, predicted beyond\n")
    say("| machine | P | predicted | measured | error |")
    say("|---|---|---|---|---|")
    sr_fits = {}
    for label, pattern in (("this machine", args.sr), ("16-core node", args.sr_node)):
        runs = {r["ranks"]: {"step_seconds": r["step_seconds"], "iterations": r["mean_solver_iterations"],
                             "n_params": r["n_params"], "n_samples": _samples(r)} for r in load(pattern)}
        if len(runs) < 2:
            continue
        fit = sr_fits[label] = fit_sr(here, runs)
        for P, r in sorted(runs.items()):
            pred = sr_step(here, fit, r["n_samples"], r["n_params"], r["iterations"], P)
            tag = " (fit)" if P <= sorted(runs)[1] else ""
            say(f"| {label} | {P}{tag} | {pred * 1e3:.2f} ms | {r['step_seconds'] * 1e3:.2f} ms | "
                f"{rel(pred, r['step_seconds']):+.0%} |")
    for label, fit in sr_fits.items():
        say(f"\n{label}: c0 = {fit.c0 * 1e3:.2f} ms per step, c1 = {fit.c1 * 1e9:.3f} ns per sample·parameter")
    say("")

    cluster = hdr_cluster(fits)
    say(f"## Predictions to 1,024 ranks: {cluster.name}\n")
    Ps = [2**k for k in range(11)]
    for n, what in ((8192, "strong scaling, 8192² unknowns"),):
        say(f"### CG per iteration, {what}\n")
        say("| P | standard | single reduction | pipelined (progress) | reductions' share (standard) |")
        say("|---|---|---|---|---|")
        for P in Ps:
            t = {m: cg_iteration(cluster, n, P, m) for m in PASSES}
            share = t["cg"]["reductions"] / t["cg"]["total"]
            say(f"| {P} | {_ms(t['cg']['total'])} | {_ms(t['cg-sr']['total'])} | {_ms(t['cg-pipe']['total'])} | {share:.1%} |")
        say("")
    say("### Where single-reduction and pipelined CG win (grid rows per rank at which the reductions cost as much as the extra passes)\n")
    say("| P | 2 allreduces − 1 (single reduction saves) | pipelined beats standard below N/P = |")
    say("|---|---|---|")
    for P in (64, 128, 256, 512, 1024):
        saved = 2 * allreduce(cluster, 8, P) - allreduce(cluster, 16, P)
        # pipelined: 9 extra passes of 8·N/P bytes against 2 allreduces of latency
        crossover = 2 * allreduce(cluster, 8, P) * cluster.rank_bandwidth(P) / (9 * 8)
        say(f"| {P} | {saved * 1e6:.1f} µs | {crossover:,.0f} unknowns per rank |")
    say("")
    fit = sr_fits.get("16-core node") or next(iter(sr_fits.values()), None)
    if fit is not None:
        say("### SR step (parameter space, CG), 16,384 samples, 85 CG iterations\n")
        say("| P | N_p = 10⁴ | N_p = 10⁵ | N_p = 10⁶ | communication share at 10⁶ |")
        say("|---|---|---|---|---|")
        for P in Ps:
            row = [sr_step(cluster, fit, 16384, Np, 85, P) for Np in (10**4, 10**5, 10**6)]
            share = sr_communication(cluster, 10**6, 85, P) / row[-1]
            say(f"| {P} | " + " | ".join(_ms(t) for t in row) + f" | {share:.0%} |")
        say("")
        say("### Dense natural-gradient solve: parameter vs sample space, 1,024 ranks\n")
        say("| N_s | N_p | parameter space | sample space | winner |")
        say("|---|---|---|---|---|")
        for Ns, Np in ((4096, 10**3), (4096, 10**4), (16384, 10**4), (4096, 10**5), (16384, 10**5)):
            tp, ts = (dense_sr_step(cluster, Ns, Np, 1024, s) for s in ("parameter", "sample"))
            say(f"| {Ns} | {Np} | {_ms(tp)} | {_ms(ts)} | {'sample' if ts < tp else 'parameter'} |")
        say("")
    say("### Sample-space SR with the kernel split by rows (dnk.cholesky_distributed), N_s = 10⁵ samples\n")
    say("| P | N_p | kernel rows | solve: compute | solve: messages | step | memory per rank | replicated solve (every rank) |")
    say("|---|---|---|---|---|---|---|---|")
    Ns = 10**5
    replicated = Ns**3 / 3 / cluster.flops
    for Np in (10**4, 10**5):
        for P in (64, 128, 256, 512, 1024):
            t = row_split_sr_step(cluster, Ns, Np, P)
            say(f"| {P} | {Np:.0e} | {_ms(t['kernel'])} | {_ms(t['compute'])} | {_ms(t['communication'])} "
                f"| {_ms(t['total'])} | {t['bytes_per_rank'] / 2**30:.2f} GiB | {_ms(replicated)}, "
                f"{8 * Ns**2 / 2**30:.0f} GiB |")
    say("")
    if args.plots:
        plot(cluster, fit, Path(args.plots))
        where = Path(args.plots).resolve() / "scaling_cluster.png"
        say(f"Plot: {where.relative_to(HERE.parent) if where.is_relative_to(HERE.parent) else where}")
    return "\n".join(lines)


def _samples(run: dict) -> int:
    words = run["problem"].split()
    return int(words[words.index("--samples") + 1])


def _rate(beta: float) -> str:
    return f"{1 / beta / 1e9:.1f} GB/s" if beta > 0 else "∞"


def _ms(t: float) -> str:
    if t >= 1:
        return f"{t:,.1f} s"
    return f"{t * 1e3:.3f} ms" if t >= 1e-3 else f"{t * 1e6:.1f} µs"


def plot(cluster: Machine, fit: SRFit | None, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Ps = [2**k for k in range(11)]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for n in (2048, 8192, 32768):
        for method, style in (("cg", "-"), ("cg-sr", "--"), ("cg-pipe", ":")):
            t = [cg_iteration(cluster, n, P, method)["total"] for P in Ps]
            left.loglog(Ps, t, style, label=f"{method}, {n}²", color={2048: "C0", 8192: "C1", 32768: "C2"}[n])
    left.set(xlabel="ranks P", ylabel="seconds per CG iteration", title="CG on the 5-point Laplacian (strong scaling)")
    left.legend(fontsize=7, ncol=1)
    if fit is not None:
        for Np, color in ((10**4, "C0"), (10**5, "C1"), (10**6, "C2")):
            t = [sr_step(cluster, fit, 16384, Np, 85, P) for P in Ps]
            c = [sr_communication(cluster, Np, 85, P) for P in Ps]
            right.loglog(Ps, t, "-", color=color, label=f"step, N_p = {Np:.0e}")
            right.loglog(Ps[1:], c[1:], ":", color=color, label="its communication")
        right.set(xlabel="ranks P", ylabel="seconds per SR step",
                  title="SR step, 16,384 samples, 85 CG iterations")
        right.legend(fontsize=7)
    fig.suptitle(cluster.name, fontsize=9)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "scaling_cluster.png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    here = DATA / "scaling_2026-11-24"
    node = DATA / "gpu_node_2026-11-24"
    parser.add_argument("--collectives", nargs="+", default=[str(here / "collectives_*.json")])
    parser.add_argument("--krylov", nargs="+", default=[str(here / "krylov_*.json")])
    parser.add_argument("--sr", nargs="+", default=[str(here / "sr_*.json")])
    parser.add_argument("--krylov-node", nargs="+", default=[str(node / "krylov_cpu_*.json")])
    parser.add_argument("--sr-node", nargs="+", default=[str(node / "sr_cpu_*.json")])
    parser.add_argument("--flops", type=float, default=HDR_RANK_FLOPS, help="one rank's dgemm rate here (flop/s)")
    parser.add_argument("--plots", default=str(HERE / "plots"), help="directory for scaling_cluster.png ('' for none)")
    parser.add_argument("--markdown", help="also write the report here")
    args = parser.parse_args()
    text = report(args)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")


if __name__ == "__main__":
    main()
