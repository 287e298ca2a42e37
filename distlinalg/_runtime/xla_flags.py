"""The XLA flags distlinalg sets (table row ``xla-ynn-fusions``, and ``jax-ynn-per-compile``).

XLA CPU's YNN *reduce* fusions (jaxlib 0.10.2) miscompile a reduction of a
dot: the result reads uninitialised memory (nondeterministic garbage), with
or without MPI, e.g. ``jit(lambda X, s: jnp.sum(X @ jnp.broadcast_to(s, (8, 4)), 1))``
on a (1024, 8) X, or ``jnp.sum((X @ W) ** 2, 1)``. A solve with x0=None hits
it (A x0 with x0 = zeros / scale is such a dot; reproducer in
tests/operators/test_gram.py). distlinalg sets the YNN fusion types to YNN's
individual dots only (its matmul kernels, correct on every pattern in
tests/runtime/test_ynn.py and ~2x Eigen's speed on a 512x512 float64
product here): through XLA_FLAGS before XLA starts, else per compilation
(``patches.disable_ynn_per_compile``). A jaxlib without that type gets none.
"""

from __future__ import annotations

import glob
import mmap
import os

from . import patches
from .env import switch

YNN_FLAG = "xla_cpu_experimental_ynn_fusion_type"
YNN_DOTS = "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"  # XLA_FLAGS and compiler options both take the enum name


def jaxlib_has(needle_text: str) -> bool:
    """Whether the installed jaxlib's shared libraries contain `needle_text`
    (a flag's name, an enum value's name: XLA aborts on unknown ones)."""
    import jaxlib

    needle = needle_text.encode()
    for path in glob.glob(os.path.join(os.path.dirname(jaxlib.__file__), "*.so")):
        try:
            with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
                if data.find(needle) >= 0:
                    return True
        except (OSError, ValueError):
            continue
    return False


def _safe_ynn_types() -> str:
    """The value of the YNN flag that distlinalg sets: individual dots, or
    nothing where this jaxlib's flag does not know them."""
    return YNN_DOTS if jaxlib_has(YNN_DOTS) else ""


def disable_ynn_fusion() -> str:
    """Set ``--xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT``
    (YNN's reduce fusions off, its matmuls kept) if it can still take effect;
    returns what was done (for ``python -m distlinalg``).

    ``DISTLINALG_YNN_FUSION=1`` keeps XLA's default; an XLA_FLAGS that
    already names the flag is left alone.
    """
    from .jax_names import backends_started

    flags = os.environ.get("XLA_FLAGS", "")
    if switch("DISTLINALG_YNN_FUSION", False):
        outcome = "kept (DISTLINALG_YNN_FUSION=1)"
    elif YNN_FLAG in flags:
        outcome = "as set in XLA_FLAGS"
    elif not jaxlib_has(YNN_FLAG):
        outcome = patches.missing("xla-ynn-fusions")
    else:
        value = _safe_ynn_types()
        kept = ": reduce fusions off, YNN matmuls kept" if value else ""
        if backends_started():
            # XLA_FLAGS is read once, when the backend starts; the same debug
            # option is still accepted per compilation (compiler_options).
            if patches.disable_ynn_per_compile(YNN_FLAG, value):
                outcome = f"disabled per compilation{kept} (JAX's backend started before distlinalg was imported)"
            else:
                outcome = "left on: JAX's backend started before distlinalg was imported"
        else:
            os.environ["XLA_FLAGS"] = f"{flags} --{YNN_FLAG}={value}".strip()
            outcome = f"disabled{kept}"
    patches.record("xla-ynn-fusions", outcome)
    return outcome
