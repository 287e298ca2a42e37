"""check_grads: the distributed analogue of jax.test_util.check_grads.

Derivatives of an SPMD program are checked as derivatives of the global
function F(x_0, ..., x_{P-1}) = (y_0, ..., y_{P-1}):
  * forward mode: every rank perturbs its own inputs along its own random
    direction at the same time; the JVP is compared with central finite
    differences of the global function;
  * reverse mode: the global dot-product test Σ_r ⟨ū_r, (J v)_r⟩ =
    Σ_r ⟨(Jᵀ ū)_r, v_r⟩, both sums allreduced (J v by central differences of
    the global function), which catches any transpose rule that is not the
    adjoint of the program, on any number of ranks;
  * order 2 recurses on the JVP and VJP functions.
Every comparison is made on allreduced quantities, so all ranks reach the
same verdict and raise together.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._mpi import resolve_comm
from ..comm.allreduce import allreduce


def _leaves(tree: Any) -> list[Any]:
    return jax.tree_util.tree_leaves(tree)


def _random_like(tree: Any, seed: int) -> Any:
    rng = np.random.default_rng(seed)

    def one(x):
        x = jnp.asarray(x)
        if jnp.issubdtype(x.dtype, jnp.complexfloating):
            return jnp.asarray(rng.standard_normal(x.shape) + 1j * rng.standard_normal(x.shape), x.dtype)
        return jnp.asarray(rng.standard_normal(x.shape), x.dtype)

    return jax.tree_util.tree_map(one, tree)


def _dot(a: Any, b: Any) -> Any:
    """Σ a·b over leaves, without conjugation (JAX's transpose convention)."""
    parts = [jnp.sum(jnp.asarray(x) * jnp.asarray(y)) for x, y in zip(_leaves(a), _leaves(b))]
    return sum(parts[1:], parts[0]) if parts else jnp.zeros(())


def _axpy(alpha: Any, x: Any, y: Any) -> Any:
    return jax.tree_util.tree_map(lambda a, b: b + (alpha * a).astype(b.dtype), x, y)


def _default_tolerance(args: Any) -> float:
    low = any(jnp.asarray(x).dtype in (jnp.float32, jnp.complex64, jnp.float16, jnp.bfloat16) for x in _leaves(args))
    return 2e-2 if low else 1e-5


def _default_eps(args: Any) -> float:
    low = any(jnp.asarray(x).dtype in (jnp.float32, jnp.complex64, jnp.float16, jnp.bfloat16) for x in _leaves(args))
    return 1e-2 if low else 1e-5


def check_grads(
    f: Callable[..., Any],
    args: Sequence[Any],
    order: int = 1,
    modes: Sequence[str] = ("fwd", "rev"),
    *,
    atol: float | None = None,
    rtol: float | None = None,
    eps: float | None = None,
    comm: Any = None,
) -> None:
    """Check f's JVP and VJP against the global SPMD function.

    Args:
      f: any function of rank-local pieces ``f(*args)`` (arrays or pytrees in,
        arrays or pytrees out) that every rank calls together.
      args: this rank's inputs (floating or complex).
      order: 1 or 2 (2 also checks the derivatives of the derivatives).
      modes: any of ``"fwd"`` (finite differences) and ``"rev"`` (dot-product
        test).
      atol, rtol: tolerances on the global (allreduced) discrepancy; default
        1e-5 in double and 2e-2 in single precision.
      eps: finite-difference step (default 1e-5 double, 1e-2 single).
      comm: communicator of the program (default distlinalg's).

    Raises:
      AssertionError on every rank if any check fails, naming the check, the
      global discrepancy and the tolerance.
    """
    communicator = resolve_comm(comm)
    args = tuple(args)
    tol = _default_tolerance(args)
    atol = tol if atol is None else atol
    rtol = tol if rtol is None else rtol
    eps = _default_eps(args) if eps is None else eps
    for mode in modes:
        if mode not in ("fwd", "rev"):
            raise ValueError(f"distlinalg.ad.check_grads: unknown mode {mode!r}")
    if order not in (1, 2):
        raise ValueError("distlinalg.ad.check_grads: order must be 1 or 2")
    seed = 7919 * communicator.rank + 17 * order

    def global_sum(value: Any) -> Any:
        return allreduce(jnp.asarray(value), "sum", comm=communicator)

    def verdict(name: str, got: Any, expected: Any, scale: Any) -> None:
        discrepancy = float(jnp.sqrt(global_sum(jnp.sum(jnp.abs(got - expected) ** 2))))
        size = float(jnp.sqrt(global_sum(jnp.sum(jnp.abs(scale) ** 2))))
        bound = atol + rtol * size
        if not discrepancy <= bound:
            raise AssertionError(
                f"distlinalg.ad.check_grads ({name}, order {order}): global discrepancy "
                f"{discrepancy:.3e} exceeds {bound:.3e} (atol {atol:g} + rtol {rtol:g} × {size:.3e})"
            )

    direction = _random_like(args, seed)

    def finite_difference() -> Any:
        plus = f(*_axpy(eps, direction, args))
        minus = f(*_axpy(-eps, direction, args))
        return jax.tree_util.tree_map(lambda p, m: (p - m) / (2 * eps), plus, minus)

    def flat(tree: Any) -> Any:
        return jnp.concatenate([jnp.ravel(x) for x in _leaves(tree)] or [jnp.zeros(0)])

    if "fwd" in modes:
        _, tangent = jax.jvp(f, args, direction)
        expected = flat(finite_difference())
        verdict("forward mode vs central finite differences", flat(tangent), expected, expected)
    if "rev" in modes:
        out, pullback = jax.vjp(f, *args)
        cotangent = _random_like(out, seed + 1)
        # J v by finite differences, as jax.test_util does: the reverse check
        # must not depend on the forward rules (custom_vjp has none).
        lhs = global_sum(_dot(cotangent, finite_difference()))
        rhs = global_sum(_dot(pullback(cotangent), direction))
        verdict("reverse mode dot-product test Σ⟨ū, J v⟩ = Σ⟨Jᵀ ū, v⟩", rhs, lhs, lhs)

    if order == 2:
        if "fwd" in modes:
            def jvp_of(*a):
                return jax.jvp(f, a, direction)[1]

            check_grads(jvp_of, args, 1, modes, atol=atol, rtol=rtol, eps=eps, comm=comm)
        if "rev" in modes:
            out = f(*args)
            cotangent = _random_like(out, seed + 2)

            def vjp_of(*a):
                return jax.vjp(f, *a)[1](cotangent)

            check_grads(vjp_of, args, 1, modes, atol=atol, rtol=rtol, eps=eps, comm=comm)
