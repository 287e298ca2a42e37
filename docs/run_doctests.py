#!/usr/bin/env python3
"""Run the documentation's doctests (sphinx-build -b doctest) as one rank of an MPI job.

    python docs/run_doctests.py                 # one rank
    mpiexec -n 2 python docs/run_doctests.py    # every rank runs every example

Every rank reads the same documents and runs the same examples in the same order (Sphinx
tests the documents in sorted order), so the collectives of the examples meet across ranks,
and an example passes only if what it prints holds on every rank. Each rank writes its
doctrees and its report (output.txt) under build/docs/doctest/n<size>/rank<rank> and exits
with Sphinx's status: 1 when an example failed or Sphinx warned on that rank. Sphinx runs
quietly: warnings and failing examples are printed (by every rank), then rank 0 prints the
summary of its report. Extra arguments go to sphinx-build (e.g. docs/solvers.md to test one
page).

A call that blocks for DISTLINALG_TIMEOUT seconds (default here 300: an example that waits for
a message that never comes) ends the job with every rank's stack, instead of hanging.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Set by the launchers (MPICH/Hydra, Open MPI, PMIx); none of them: a single process.
RANK_ENV = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
SIZE_ENV = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")


def main() -> int:
    rank = next((os.environ[k] for k in RANK_ENV if k in os.environ), "0")
    size = next((os.environ[k] for k in SIZE_ENV if k in os.environ), "1")
    os.environ.setdefault("DISTLINALG_TIMEOUT", "300")  # read when docs/conf.py imports distlinalg
    if os.environ.get("DOCS_COMPILE_CACHE", "1") != "0":
        # The examples compile the same programs on every rank count: a later run (the 2-rank
        # one after the 1-rank one, the next make docs) loads what an earlier one compiled.
        # One writer per job (rank 0), as in tests/run_mpi.py; set before JAX is imported.
        os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(ROOT, "build", "docs", "jax-cache")
        os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
        os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0" if rank == "0" else "1e9"
    out = os.path.join(ROOT, "build", "docs", "doctest", f"n{size}", f"rank{rank}")
    args = ["-b", "doctest", "-W", "--keep-going", "-q", "-d", os.path.join(out, "doctrees"),
            os.path.join(ROOT, "docs"), out, *sys.argv[1:]]
    from sphinx.cmd.build import main as sphinx_build

    status = sphinx_build(args)
    report = os.path.join(out, "output.txt")
    if rank == "0" and os.path.exists(report):
        with open(report) as f:
            text = f.read()
        summary = text[text.rfind("Doctest summary"):].strip()
        print(f"=== doctests on {size} rank(s), rank 0 ({os.path.relpath(report, ROOT)}):\n{summary}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
