"""Sphinx configuration of distlinalg's documentation (``make docs``).

The API reference is generated from the docstrings (autodoc, Google style
through napoleon); the guides are the Markdown files of this directory and
the README (myst-parser). ``sphinx-build -b doctest`` runs every ``>>>``
example, in the docstrings and in the guides; ``make docs`` runs them on one
rank and under ``mpiexec -n 2`` (docs/run_doctests.py), so examples print
only what is true on any number of ranks.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re

from sphinx.util import logging

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))

project = "distlinalg"
author = "the distlinalg developers"
copyright = "the distlinalg developers"
release = version = importlib.import_module("distlinalg._version").__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.doctest",
    "sphinx.ext.viewcode",
    "myst_parser",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build"]

# Google-style docstrings ("Args:", "Returns:", "Raises:", "Example:").
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# The signatures' annotations are mostly ``Any``; the docstrings say what is accepted.
autodoc_typehints = "none"
autodoc_member_order = "bysource"
autodoc_default_options = {"show-inheritance": False}

# Markdown: the anchors GitHub makes for headings (the guides link to "#my-job-hangs" ...).
myst_heading_anchors = 3

# Examples are self-contained (they import what they use) and print only what holds on any
# number of ranks (make docs runs them on 1 and 2). The one setup line pins JAX's default
# precision for every page: importing NetKet (autodoc of distlinalg.netket does, while the
# pages are read) turns 64-bit mode on, and whether that happened would otherwise depend on
# which pages were read in this build. Examples that want float64 turn it on themselves.
doctest_global_setup = "import jax; jax.config.update('jax_enable_x64', False)"
doctest_test_doctest_blocks = "default"

html_theme = "alabaster"
html_title = f"distlinalg {release}"
html_theme_options = {"description": "Differentiable distributed linear algebra for JAX over MPI"}
html_static_path: list[str] = []


# Every name of every public module's __all__ must be documented in the API reference, and
# every public function and class must have a runnable example (">>>" lines, which the doctest
# runs check): anything missing is a warning (an error under make docs's -W).
PUBLIC_MODULES = [
    "distlinalg", "distlinalg.comm", "distlinalg.ad", "distlinalg.solvers", "distlinalg.operators",
    "distlinalg.mpi4jax", "distlinalg.lineax", "distlinalg.netket", "distlinalg.linalg", "distlinalg.grid",
]


def _check_api_coverage(app, env) -> None:
    logger = logging.getLogger(__name__)
    documented = set(env.get_domain("py").objects) | set(env.get_domain("py").modules)
    for modname in PUBLIC_MODULES:
        module = importlib.import_module(modname)
        for name in getattr(module, "__all__", ()):
            if f"{modname}.{name}" not in documented:
                logger.warning("%s.%s is in __all__ but not in the API reference (docs/api/)", modname, name,
                               type="distlinalg", subtype="api-coverage")
            obj = getattr(module, name)
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and ">>>" not in (obj.__doc__ or ""):
                logger.warning("%s.%s has no example (an Example: section with >>> lines)", modname, name,
                               type="distlinalg", subtype="api-examples")


# The solvers re-exported at the top level (distlinalg.cg ...) are documented once, in
# distlinalg.solvers; their entries on the distlinalg page point there.
REEXPORTED = {f"distlinalg.{name}": f"distlinalg.solvers.{name}"
              for name in ("cg", "minres", "gmres", "bicgstab", "natural_gradient")}


def _point_to_canonical(app, what, name, obj, options, lines) -> None:
    if name in REEXPORTED:
        lines[:] = [f"The same function as :func:`{REEXPORTED[name]}`, re-exported at the top level."]


# The README links relative to the repository root (docs/ad.md, examples/...); the pages that
# include it live in docs/, so its local link targets are rewritten relative to docs/ as it
# is read (docs/ad.md -> ad.md, a guide; examples/netket_sr/README.md ->
# ../examples/netket_sr/README.md, a file offered for download).
_LOCAL_LINK = re.compile(r"(\]\()(?!https?:|mailto:|#|/)([^)\s]+)\)")


def _readme_links(app, relative_path, parent_docname, content) -> None:
    if os.path.normpath(str(relative_path)) != os.path.join("..", "README.md"):
        return
    srcdir = str(app.srcdir)

    def relink(match):
        target = os.path.relpath(os.path.join(ROOT, match.group(2)), srcdir)
        if target.startswith(".."):  # outside docs/: not a page, a file to download
            target = f"path:{target}"
        return f"{match.group(1)}{target})"

    content[0] = _LOCAL_LINK.sub(relink, content[0])


# docs/runtime.md shows the patch table of distlinalg/_runtime/patches.py, rendered from the
# code as the page is read, so the page and the table cannot drift apart.
PATCH_TABLE_MARKER = "<!-- the patch table, rendered from distlinalg._runtime.patches -->"


def _render_patch_table(app, docname, source) -> None:
    if PATCH_TABLE_MARKER in source[0]:
        from distlinalg._runtime import patches

        source[0] = source[0].replace(PATCH_TABLE_MARKER, patches.markdown_table())


def setup(app):
    app.connect("source-read", _render_patch_table)
    app.connect("include-read", _readme_links)
    app.connect("autodoc-process-docstring", _point_to_canonical)
    app.connect("env-check-consistency", _check_api_coverage)
