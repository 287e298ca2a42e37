"""Run the benchmark suite side by side with its peers: one command, one table, plots.

    python benchmarks/run_all.py [--quick] [--with-petsc] [--only collectives ad krylov sr]
                                 [--no-peers] [--report-only]

(``make bench`` / ``make bench QUICK=1``.) Each benchmark runs under mpiexec
with the rank counts it needs, writes JSON (build/bench/*.json), and this
driver turns them into benchmarks/results.md (a table per benchmark: this
project and each peer measured in the same run, medians over repeats,
ratios) and PNG plots in benchmarks/plots/.

Peers live in benchmarks/.venv-peers, created here on first use (see
peers.py): mpi4jax and NetKet always, petsc4py with --with-petsc (a long
build, cached). A peer that fails to install or import is reported as
"skipped: <reason>" in results.md; so is a benchmark run that fails or
times out. --quick is a smoke check (small sizes, few repeats; under 5
minutes once the peers venv exists). --report-only rebuilds results.md and
the plots from the JSON of the last run.

All runs set OPENBLAS_NUM_THREADS=OMP_NUM_THREADS=MKL_NUM_THREADS=1:
multi-threaded BLAS on small vectors is pathological on a 2-core machine
(scipy's CG measured 12x slower with the default threads).
"""

from __future__ import annotations

# The driver's parts: _runner.py (mpiexec runs, run_benchmarks), _report.py (results.md),
# _plots.py (the PNG figures). This file: the command line and the JSON of a run.

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _util  # noqa: E402
from _report import print_targets, write_report  # noqa: E402
from _runner import BENCHES, OUT, ROOT, log, run_benchmarks  # noqa: E402


def main() -> None:
    """Parse the flags; run the selected benchmarks (or reload the last run's JSON), write the report."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke check, under 5 minutes")
    parser.add_argument("--with-petsc", action="store_true", help="build petsc4py into the peers venv (long)")
    parser.add_argument("--only", nargs="+", choices=BENCHES, default=list(BENCHES))
    parser.add_argument("--no-peers", action="store_true", help="do not create or use the peers venv")
    parser.add_argument("--report-only", action="store_true", help="rebuild results.md from the last run's JSON")
    args = parser.parse_args()
    start = time.monotonic()
    load0 = os.getloadavg()[0]
    args.out = OUT / ("quick" if args.quick else "full")
    raw = args.out / "all.json"
    previous = json.loads(raw.read_text()) if raw.exists() else None
    if args.report_only:
        if previous is None:
            raise SystemExit(f"run_all: nothing to report, {raw.relative_to(ROOT)} does not exist")
        res, meta = previous["results"], previous["meta"]
    else:
        # With --only, the other sections of the last run of this mode stay in the report.
        partial = set(args.only) != set(BENCHES)
        res = previous["results"] if (previous and partial) else {}
        argv = " ".join(sys.argv[1:])
        meta = {"command": f"python benchmarks/run_all.py {argv}".strip(), "quick": args.quick,
                "machine": _util.machine_info(), "versions": _util.versions(), "git": _util.git_revision(ROOT)}

        def save(res):
            meta.update(date=datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
                        load=(load0, os.getloadavg()[0]), wall=time.monotonic() - start)
            args.out.mkdir(parents=True, exist_ok=True)
            raw.write_text(json.dumps({"results": res, "meta": meta}, indent=1, default=str))

        run_benchmarks(args, res, save)
        save(res)
    write_report(res, meta)
    print_targets(res)
    log(f"done in {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
