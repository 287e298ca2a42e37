"""Inputs of the one-pass vector handler tests (test_local_dots.py, test_fused_update.py):
the size classes that exercise the handlers' blocks and chunks, their dtypes, and
random vectors."""

from __future__ import annotations

import numpy as np

# 0, one partial block, several 512-element blocks, several 32768-element chunks (threads).
SIZES = [0, 1, 7, 513, 2 * 32768 + 5]
DTYPES = [np.float32, np.float64, np.complex64, np.complex128]


def vector(rng, n, dtype):
    """n standard normal values of `dtype` (real and imaginary parts for complex ones)."""
    v = rng.standard_normal(n)
    if np.issubdtype(dtype, np.complexfloating):
        v = v + 1j * rng.standard_normal(n)
    return v.astype(dtype)
