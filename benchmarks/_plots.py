"""The PNG figures of results.md (matplotlib, Agg backend), written to benchmarks/plots/.

One function per figure, each given the JSON of the runs it draws and returning the path
of the PNG it wrote, or None when matplotlib is missing (or there is nothing to draw):
``plot_collectives`` (latency vs message size per op), ``plot_scaling`` (Krylov time per
iteration vs ranks), ``plot_sr`` (SR step time, distlinalg and NetKet).
"""

from __future__ import annotations

from _runner import CORES, HERE, failed

PLOTS = HERE / "plots"


def _pyplot():
    """matplotlib.pyplot on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _save(plt, fig, name: str) -> str:
    """Write fig to benchmarks/plots/<name> (90 dpi), close it; the path."""
    PLOTS.mkdir(exist_ok=True)
    path = PLOTS / name
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return str(path)


def plot_collectives(nprocs, main, runs):
    """Per-call latency vs message size, one panel per op: mpi4py, distlinalg jit and eager
    (the main run), mpi4jax and JAX gloo (their own runs) where they ran."""
    plt = _pyplot()
    if plt is None:
        return None
    ops = main["ops"]
    fig, axes = plt.subplots(1, len(ops), figsize=(4 * len(ops), 3.6), squeeze=False)
    series = [("mpi4py", main, "mpi4py")] + [(c, main, c) for c in ("distlinalg-jit", "distlinalg-eager")]
    for key in ("mpi4jax", "jax-gloo"):
        if key in runs and not failed(runs[key]) and key in runs[key].get("results", {}):
            series.append((key, runs[key], key))
    for ax, op in zip(axes[0], ops):
        for label, run, contender in series:
            data = run["results"].get(contender, {}).get(op, {})
            xs = [s for s in run["sizes"] if str(s) in data]
            if xs:
                ax.loglog(xs, [data[str(s)] * 1e6 for s in xs], marker="o", label=label)
        ax.set_title(op)
        ax.set_xlabel("message size (bytes)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("latency per call (µs)")
    axes[0][-1].legend(fontsize=8)
    over = " (oversubscribed)" if int(nprocs) > CORES else ""
    fig.suptitle(f"Collective latency, {nprocs} ranks{over}")
    fig.tight_layout()
    return _save(plt, fig, f"collectives_n{nprocs}.png")


def plot_scaling(kr):
    """Poisson ms/iteration vs rank count for distlinalg's solvers, with the one-process peers
    of each run dashed; kr: the Krylov runs that did not fail, by rank count."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(5.5, 4))
    ranks = sorted(int(k) for k in kr)
    for name in ("distlinalg-cg", "distlinalg-cg-sr", "distlinalg-minres", "distlinalg-cg-lib", "distlinalg-cg-local"):
        ys = [kr[str(p)]["results"].get(name, {}).get("seconds_per_iteration") for p in ranks]
        if any(y is not None for y in ys):
            ax.plot(ranks, [y * 1e3 if y else float("nan") for y in ys], marker="o", label=name)
    for name, style in (("jax-scipy-cg", "--"), ("scipy-cg", ":")):
        ys = [kr[str(p)]["results"].get(name, {}).get("seconds_per_iteration") for p in ranks]
        if any(ys):
            ax.plot(ranks, [y * 1e3 if y else float("nan") for y in ys], style, marker="x",
                    label=f"{name} (1 process, same run)")
    ax.axvspan(CORES + 0.5, max(ranks) + 0.5, color="grey", alpha=0.15, label="oversubscribed")
    n = next(iter(kr.values()))["n"]
    ax.set_xticks(ranks)
    ax.set_xlabel("MPI ranks")
    ax.set_ylabel("ms / iteration")
    ax.set_title(f"2-D Poisson {n}x{n}: time per iteration")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return _save(plt, fig, "krylov_scaling.png")


def plot_sr(sr, nk):
    """Bars of the SR step time: distlinalg by rank count, then NetKet by process count."""
    plt = _pyplot()
    if plt is None:
        return None
    ours = [(f"distlinalg\n{k} rank(s)", v["step_seconds"]) for k, v in sr.items() if not failed(v)]
    theirs = [(f"NetKet\n{k} process(es)", v["step_seconds"]) for k, v in nk.items() if not failed(v)]
    bars = ours + theirs
    if not bars:
        return None
    fig, ax = plt.subplots(figsize=(1.4 * len(bars) + 2, 3.6))
    ax.bar([b[0] for b in bars], [b[1] * 1e3 for b in bars], color=["C0"] * len(ours) + ["C1"] * len(theirs))
    ax.set_ylabel("ms / SR step")
    ax.set_title("SR step time (TFIM L=16, RBM α=1, 1008 samples)")
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    return _save(plt, fig, "sr_step.png")
