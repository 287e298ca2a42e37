#!/usr/bin/env python3
"""Run pytest against another build of the extension than the installed one.

    python tests/run_with_build.py BUILD_DIR -- [pytest args]

Assembles a distlinalg package from the sources and BUILD_DIR's _native
module in a temporary directory, hides the editable install, and runs
pytest (one process) on it. `make test-cpu-only-build` uses it to test the
extension built without the CUDA handlers.
"""

from __future__ import annotations

import glob
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    build_dir, sep, *pytest_args = sys.argv[1:]
    if sep != "--":
        sys.exit(__doc__)
    modules = glob.glob(str(Path(build_dir) / "_native*.so"))
    if len(modules) != 1:
        sys.exit(f"run_with_build: expected one _native*.so in {build_dir}, found {modules}")
    with tempfile.TemporaryDirectory() as tmp:
        package = Path(tmp) / "distlinalg"
        shutil.copytree(ROOT / "distlinalg", package, ignore=shutil.ignore_patterns("_native*.so", "__pycache__"))
        shutil.copy(modules[0], package)
        # The editable install's import hook would find the installed build first.
        sys.meta_path[:] = [f for f in sys.meta_path if "ScikitBuild" not in type(f).__name__]
        sys.path.insert(0, tmp)
        sys.path.insert(1, str(ROOT / "tests"))
        import distlinalg._native

        print(f"run_with_build: {distlinalg._native.__file__} (CUDA handlers: "
              f"{distlinalg._native.build_info()['cuda']})", flush=True)
        import pytest

        return int(pytest.main(["-p", "no:cacheprovider", "--rootdir", str(ROOT), *pytest_args]))


if __name__ == "__main__":
    sys.exit(main())
