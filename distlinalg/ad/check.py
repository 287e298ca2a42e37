"""check_grads: the distributed analogue of jax.test_util.check_grads.

Derivatives of an SPMD program are derivatives of the global function
F(x_0, ..., x_{P-1}) = (y_0, ..., y_{P-1}), rank r holding x_r and y_r:

* forward mode: every rank draws its own random direction ẋ_r and all ranks
  perturb their inputs at the same time (x_r ± eps·ẋ_r), which evaluates
  the global function at x ± eps·ẋ; each rank compares its own output's JVP
  with the central difference;
* reverse mode: the global dot-product test
  Σ_r ⟨ȳ_r, (J ẋ)_r⟩ = Σ_r ⟨(Jᵀ ȳ)_r, ẋ_r⟩ with random ȳ_r and ẋ_r per rank,
  both sums allreduced, J ẋ by central differences (so a custom_vjp without
  forward rules can be checked). A transpose rule that is not the adjoint of
  the program (an identity transpose of allreduce) fails it on two or more
  ranks, even though every rank's own arithmetic looks plausible;
* order n > 1 recurses on the JVP function (in its primals and tangents)
  and on the VJP function (cotangent = the primal output), as
  jax.test_util.check_grads does.

Every verdict is made on numbers that all ranks hold identically (each
rank's contribution travels in its own slot of an allreduce and the sums are
formed in rank order on every rank), so the ranks pass or raise together and
stay in step for the next collective.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._runtime.mpi import Communicator, resolve_comm
from ..comm.allreduce import allreduce

_NAME = "distlinalg.ad.check_grads"

# (finite-difference step, tolerance) by the lowest precision among the
# inputs and outputs: the central difference loses ~ machine-eps/step
# relative digits to rounding and ~ step² to truncation.
_DEFAULTS = {
    8: (1e-5, 1e-5),  # float64 / complex128
    4: (1e-3, 2e-3),  # float32 / complex64
    2: (5e-2, 2e-2),  # float16
    1: (1e-1, 1e-1),  # bfloat16 (wider exponent, 8-bit mantissa)
}


def _precision_class(dtype: Any) -> int:
    dtype = np.dtype(dtype)
    if dtype == jnp.bfloat16:
        return 1
    real = np.finfo(dtype).dtype if np.issubdtype(dtype, np.complexfloating) else dtype
    return min(np.dtype(real).itemsize, 8)


def _leaves(tree: Any) -> list[Any]:
    return jax.tree_util.tree_leaves(tree)


def _check_inexact(tree: Any, what: str, where: str) -> None:
    for leaf in _leaves(tree):
        dtype = jnp.result_type(leaf)
        if not jnp.issubdtype(dtype, jnp.inexact):
            raise TypeError(
                f"{_NAME}: {where}: {what} must be floating or complex arrays, got a leaf of dtype {dtype}"
            )


def _random_like(tree: Any, rng: np.random.Generator) -> Any:
    def one(x: Any) -> Any:
        dtype = jnp.result_type(x)
        shape = np.shape(x)
        sample = rng.standard_normal(shape)
        if jnp.issubdtype(dtype, jnp.complexfloating):
            sample = sample + 1j * rng.standard_normal(shape)
        return jnp.asarray(sample, dtype)

    return jax.tree_util.tree_map(one, tree)


def _random_masked(tree: Any, replicated: Any, own: np.random.Generator, shared: np.random.Generator) -> Any:
    """Random directions shaped like `tree`: from `shared` (the same on every
    rank) where `replicated` (a bool, or a tuple of such for a tuple tree) is
    True, from this rank's `own` generator elsewhere."""
    if isinstance(replicated, (bool, np.bool_)):
        return _random_like(tree, shared if replicated else own)
    return tuple(_random_masked(t, r, own, shared) for t, r in zip(tree, replicated, strict=True))


def _step(tree: Any, scale: float, direction: Any) -> Any:
    return jax.tree_util.tree_map(lambda x, d: x + (scale * d).astype(jnp.result_type(x)), tree, direction)


def _real_pairing(a: Any, b: Any) -> float:
    """Re Σ a·b over all leaves, in float64 on the host.

    JAX transposes with respect to this real bilinear pairing (no conjugate),
    which makes the dot-product identity exact for non-holomorphic complex
    functions too.
    """
    total = 0.0
    for x, y in zip(_leaves(a), _leaves(b), strict=True):
        x = np.asarray(x)
        y = np.asarray(y)
        wide = np.complex128 if np.iscomplexobj(x) or np.iscomplexobj(y) else np.float64
        total += float(np.real(np.sum(x.astype(wide) * y.astype(wide))))
    return total


class _Checker:
    def __init__(self, comm: Communicator, modes: tuple[str, ...], atol: Any, rtol: Any, eps: Any):
        self.comm = comm
        self.modes = modes
        self.atol, self.rtol, self.eps = atol, rtol, eps
        # Different directions on every rank (the global direction must not be
        # replicated: that would hide errors in how ranks' inputs mix), the
        # same sequence of draws on every call.
        self.rng = np.random.default_rng([0x5EED, comm.rank])
        # Directions of replicated arguments: one generator seeded alike on
        # every rank, drawn from in the same order everywhere (the argument
        # structure is the same on every rank).
        self.shared_rng = np.random.default_rng([0x5EED, 0xA11])

    def direction(self, args: tuple, replicated: Any) -> Any:
        return _random_masked(args, replicated, self.rng, self.shared_rng)

    # ------------------------------------------------------------------
    def per_rank(self, row: Sequence[float]) -> np.ndarray:
        """Every rank's `row`, stacked (P, k), identical on all ranks.

        Each rank writes only its own slot (x + 0 = x exactly), so the
        allreduce is bitwise the same everywhere whatever the reduction order.
        """
        table = np.zeros((self.comm.size, len(row)), np.float64)
        table[self.comm.rank] = row
        return np.asarray(allreduce(jnp.asarray(table), "sum", comm=self.comm), np.float64)

    def tolerances(self, *trees: Any) -> tuple[float, float, float]:
        classes = [_precision_class(jnp.result_type(x)) for tree in trees for x in _leaves(tree)]
        step, tol = _DEFAULTS[min(classes, default=8)]
        atol = tol if self.atol is None else self.atol
        rtol = tol if self.rtol is None else self.rtol
        eps = step if self.eps is None else self.eps
        return atol, rtol, eps

    def central_difference(self, f: Callable[..., Any], args: tuple, direction: Any, eps: float) -> Any:
        plus = f(*_step(args, eps, direction))
        minus = f(*_step(args, -eps, direction))
        return jax.tree_util.tree_map(lambda p, m: (p - m) / (2 * eps), plus, minus)

    # ------------------------------------------------------------------
    def compare(self, what: str, got: Any, expected: Any, atol: float, rtol: float) -> None:
        """Elementwise |got - expected| <= atol + rtol |expected| on every rank."""
        worst_ratio, worst_error = 0.0, 0.0
        got_leaves, expected_leaves = _leaves(got), _leaves(expected)
        if len(got_leaves) != len(expected_leaves):
            worst_ratio = np.inf
        for g, e in zip(got_leaves, expected_leaves):
            g = np.asarray(g).astype(np.complex128 if np.iscomplexobj(g) else np.float64)
            e = np.asarray(e).astype(np.complex128 if np.iscomplexobj(e) else np.float64)
            if g.shape != e.shape:
                worst_ratio = np.inf
                continue
            if not g.size:
                continue
            with np.errstate(invalid="ignore"):
                error = np.where(g == e, 0.0, np.abs(g - e))
            error = np.where(np.isnan(error), np.inf, error)
            ratio = error / (atol + rtol * np.abs(e))
            worst_ratio = max(worst_ratio, float(np.max(ratio)))
            worst_error = max(worst_error, float(np.max(error)))
        table = self.per_rank([worst_ratio, worst_error])
        failing = [r for r in range(self.comm.size) if not table[r, 0] <= 1.0]
        if failing:
            worst = int(np.argmax(np.where(np.isnan(table[:, 0]), np.inf, table[:, 0])))
            raise AssertionError(
                f"{_NAME}: {what}: not within atol={atol:g} + rtol={rtol:g}·|expected| on "
                f"rank(s) {failing} of {self.comm.size}; largest |error| {table[worst, 1]:.3e} "
                f"on rank {worst}, where it is {table[worst, 0]:.3g} times the tolerance"
            )

    def check_jvp(self, f: Callable[..., Any], args: tuple, replicated: Any, label: str) -> None:
        direction = self.direction(args, replicated)
        out, tangent_out = jax.jvp(f, args, direction)
        _check_inexact(out, "the outputs", label)
        atol, rtol, eps = self.tolerances(args, out)
        self.compare(f"forward mode ({label}): primal output of jax.jvp vs the function", out, f(*args), atol, rtol)
        expected = self.central_difference(f, args, direction, eps)
        self.compare(
            f"forward mode ({label}): JVP vs central finite differences of the global function "
            f"(every rank perturbed along its own direction, eps={eps:g})",
            tangent_out,
            expected,
            atol,
            rtol,
        )

    def check_vjp(self, f: Callable[..., Any], args: tuple, replicated: Any, label: str) -> None:
        out, pullback = jax.vjp(f, *args)
        _check_inexact(out, "the outputs", label)
        atol, rtol, eps = self.tolerances(args, out)
        direction = self.direction(args, replicated)
        cotangent = _random_like(out, self.rng)
        forward = self.central_difference(f, args, direction, eps)
        backward = pullback(cotangent)
        table = self.per_rank([_real_pairing(cotangent, forward), _real_pairing(backward, direction)])
        expected, got = float(np.sum(table[:, 0])), float(np.sum(table[:, 1]))
        bound = atol + rtol * abs(expected)
        if not abs(got - expected) <= bound:
            raise AssertionError(
                f"{_NAME}: reverse mode ({label}): global dot-product test failed: "
                f"Σ_r ⟨ȳ_r, (J ẋ)_r⟩ = {expected:.10g} (finite differences, eps={eps:g}) but "
                f"Σ_r ⟨(Jᵀ ȳ)_r, ẋ_r⟩ = {got:.10g} (VJP); |difference| {abs(got - expected):.3e} > "
                f"atol={atol:g} + rtol={rtol:g}·{abs(expected):.3e}. The VJP is not the adjoint of "
                f"the SPMD program's derivative (per-rank terms ⟨ȳ, J ẋ⟩: {table[:, 0].tolist()}, "
                f"⟨Jᵀ ȳ, ẋ⟩: {table[:, 1].tolist()})"
            )

    # ------------------------------------------------------------------
    def run(self, f: Callable[..., Any], args: tuple, replicated: tuple, order: int, label: str) -> None:
        _check_inexact(args, "the arguments", label)
        if "fwd" in self.modes:
            self.check_jvp(f, args, replicated, label)
            if order > 1:

                def jvp_fun(primals: tuple, tangents: tuple) -> Any:
                    return jax.jvp(f, primals, tangents)

                # A replicated argument's tangent is replicated too.
                self.run(jvp_fun, (args, args), (replicated, replicated), order - 1, f"JVP of {label}")
        if "rev" in self.modes:
            self.check_vjp(f, args, replicated, label)
            if order > 1:

                def vjp_fun(*primals: Any) -> Any:
                    out, pullback = jax.vjp(f, *primals)
                    return pullback(out)

                self.run(vjp_fun, args, replicated, order - 1, f"VJP of {label}")


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
    replicated: Any = (),
) -> None:
    """Check f's JVP and VJP as derivatives of the global SPMD function.

    Every rank calls ``check_grads`` together with its own `args`; `f` is
    called (eagerly, several times) on every rank with the same structure.

    Args:
      f: any function of rank-local pieces, ``f(*args)``: pytrees of floating
        or complex arrays in and out, with any communication inside. Its
        inputs and outputs on rank r are x_r and y_r of the global function
        F(x_0, ..., x_{P-1}) = (y_0, ..., y_{P-1}).
      args: this rank's positional arguments.
      order: check derivatives up to this order (>= 1). Order n recurses on
        the JVP function ``(primals, tangents) -> jax.jvp(f, primals,
        tangents)`` and on ``primals -> vjp(primals)(f(primals))``.
      modes: ``"fwd"``: each rank's JVP against central finite differences of
        the global function, all ranks perturbing their inputs along their
        own random directions at once (and the JVP's primal output against
        f). ``"rev"``: the global dot-product test Σ_r ⟨ȳ_r, (J ẋ)_r⟩ =
        Σ_r ⟨(Jᵀ ȳ)_r, ẋ_r⟩ (real part of the unconjugated pairing, JAX's
        transpose convention), random ȳ_r and ẋ_r on every rank, sums
        allreduced, J ẋ by central differences.
      atol, rtol: tolerances, elementwise ``|got - expected| <= atol + rtol
        |expected|`` in forward mode, on the two global sums in reverse mode.
        Default by the lowest precision among inputs and outputs: 1e-5
        (64-bit), 2e-3 (32-bit), 2e-2 (float16), 1e-1 (bfloat16).
      eps: finite-difference step along the random directions (entries of
        unit variance). Default 1e-5, 1e-3, 5e-2, 1e-1 respectively.
      comm: the communicator of the program (default: distlinalg's).
      replicated: positions in `args` (an int or a sequence of ints) of
        arguments that are replicated by meaning, the same value on every
        rank (a scale of a replicated-layout operator, parameters every rank
        holds). They are perturbed along one direction shared by all ranks,
        so the check differentiates the function on the subspace where they
        stay replicated; perturbed independently, such an argument becomes
        rank-dependent and a program that relies on it being replicated
        (a replicated solve) fails the check although its derivative is
        exact. The derivatives checked are still the convention's
        (docs/ad.md): a replicated argument's VJP on rank r is its share,
        and the shares sum to the total.

    Raises:
      AssertionError on every rank (together) when a check fails anywhere,
      naming the check (mode, order: "JVP of VJP of f" ...), the failing ranks,
      the error and the tolerance. TypeError / ValueError on every rank for
      bad arguments (integer inputs or outputs, unknown modes, order < 1).

    Directions are drawn from a generator seeded with the rank, so a check is
    reproducible and every rank's direction differs (but for `replicated`
    arguments).

    Example:
      >>> import jax.numpy as jnp
      >>> from distlinalg import ad, comm
      >>> def f(x):
      ...     return comm.allreduce(jnp.sin(x)) * x       # a collective inside
      >>> x = jnp.linspace(0.1, 1.0, 4) + comm.rank()     # every rank its own input
      >>> ad.check_grads(f, (x,), order=2)                # passes (raises on every rank if not)
      >>> import distlinalg
      >>> A = jnp.array([[3.0, 1.0], [1.0, 2.0]])          # replicated operator, scaled by s
      >>> def solve(s, b):
      ...     return distlinalg.cg(lambda v: s * (A @ v), b, rtol=1e-12)[0]
      >>> ad.check_grads(solve, (2.0, jnp.ones(2)), replicated=(0, 1))   # s and b the same on every rank
    """
    communicator = resolve_comm(comm)
    mode_tuple = (modes,) if isinstance(modes, str) else tuple(modes)
    if not mode_tuple:
        raise ValueError(f"{_NAME}: modes is empty; use 'fwd' and/or 'rev'")
    for mode in mode_tuple:
        if mode not in ("fwd", "rev"):
            raise ValueError(f"{_NAME}: unknown mode {mode!r}; use 'fwd' and/or 'rev'")
    if isinstance(order, bool) or not isinstance(order, (int, np.integer)) or order < 1:
        raise ValueError(f"{_NAME}: order must be an integer >= 1, got {order!r}")
    if eps is not None and not eps > 0:
        raise ValueError(f"{_NAME}: eps must be positive, got {eps!r}")
    for name, value in (("atol", atol), ("rtol", rtol)):
        if value is not None and not value >= 0:
            raise ValueError(f"{_NAME}: {name} must be non-negative, got {value!r}")
    args = tuple(args)
    positions = (replicated,) if isinstance(replicated, (int, np.integer)) else tuple(replicated)
    for position in positions:
        if isinstance(position, bool) or not isinstance(position, (int, np.integer)) \
                or not -len(args) <= position < len(args):
            raise ValueError(f"{_NAME}: replicated must hold positions of args (0 to {len(args) - 1}), "
                             f"got {replicated!r}")
    mask = tuple(i in {p % len(args) for p in positions} for i in range(len(args)))
    checker = _Checker(communicator, mode_tuple, atol, rtol, eps)
    checker.run(f, args, mask, int(order), "f")
