"""A solve's arguments: resolved, checked, and refused on every rank together.

`setup` turns what a user passes (an operator, a callable, a matrix; Python
or traced tolerances; an iteration limit) into a `Problem` the methods run
on. Checks that can run at trace time do, and `collectively` makes an
invalid argument on one rank a ValueError (or TypeError) on every rank, so
that no rank is left waiting in the solve's first message. Traced values
that cannot be checked before the program runs are flagged in-graph
(`Problem.invalid`) for the input agreement (`_agreement`).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._runtime import jax_names
from .._runtime.mpi import Communicator, resolve_comm
from ..comm.allgather import allgather
from .._trees import join_complex, split_complex
from ..operators import LAYOUTS, LinearOperator, aslinearoperator, linearise  # operators never import the solvers
from ._common import Reductions

INT32_MAX = 2**31 - 1


class Problem(NamedTuple):
    """A solve's validated inputs (shared by every method).

    rtol, atol and maxiter are this rank's values: the iteration uses the
    ones agreed across ranks (`_agreement.agree_inputs`). `maxiter` is None
    for the default. `invalid` says that a traced rtol, atol or maxiter is
    invalid on this rank (a traced bool; False when all are concrete, which
    `setup` has checked).
    """

    matvec: Callable[[Any], Any]
    precond: Callable[[Any], Any]
    x0: Any
    rtol: Any
    atol: Any
    maxiter: Any
    reductions: Reductions
    invalid: Any
    b: Any  # the right-hand side as arrays (Python scalars become weakly typed arrays)


def identity(v: Any) -> Any:
    """The preconditioner of an unpreconditioned solve (methods test ``precond is identity``)."""
    return v


def setup(A: Any, b: Any, x0: Any, M: Any, tol: Any, rtol: Any, atol: Any, maxiter: Any,
          layout: str | None, comm: Any) -> Problem:
    """Resolve and check the arguments common to every method (trace time).

    A distlinalg operator brings its layout and communicator: ``layout=None``
    and ``comm=None`` take them from `A`. Every check is collective (see
    `collectively`): an argument that is invalid on some rank raises a
    ValueError on every rank.
    """
    if layout is None:
        layout = A.layout if isinstance(A, LinearOperator) else "replicated"
    if comm is None and isinstance(A, LinearOperator):
        comm = A.comm
    comm = resolve_comm(comm)

    def build() -> Problem:
        checked_layout = check_layout(layout)
        rtol_, atol_, bad_tolerance = resolve_tolerances(tol, rtol, atol)
        maxiter_, bad_maxiter = check_maxiter(maxiter)
        b_ = as_arrays(b)
        x0_ = jax.tree_util.tree_map(jnp.zeros_like, b_) if x0 is None else as_arrays(x0)
        check_same_structure(b_, x0_)
        # Linearised once, here: the loops apply the linearisation (a model
        # operator's model is evaluated once per solve, not per iteration).
        matvec = linearise(solver_operator(A, checked_layout, comm, b_, "A")).matvec
        precond = identity if M is None else linearise(solver_operator(M, checked_layout, comm, b_, "M")).matvec
        return Problem(matvec, precond, x0_, rtol_, atol_, maxiter_, Reductions(checked_layout, comm),
                       bad_tolerance | bad_maxiter, b_)

    return collectively(build, comm)


# ---------------------------------------------------------------------------
# Operators
def solver_operator(A: Any, layout: str, comm: Communicator, like: Any, what: str) -> LinearOperator:
    """`A` (or the preconditioner M) as a square operator of the solve's layout.

    What jax.scipy.sparse.linalg accepts (a callable, a square array, an
    object with ``__matmul__``) and distlinalg operators, converted by
    :func:`distlinalg.operators.aslinearoperator`. The checks are the solve's
    own: a distlinalg operator's layout must be the solve's; a dense array is
    a replicated operator and must fit `like` (b); anything else is a
    TypeError. The messages start with jax.scipy's wording, so code that
    matches its errors keeps working.
    """
    if isinstance(A, LinearOperator):
        if A.layout != layout:
            raise ValueError(
                f"distlinalg: the operator's layout is {A.layout!r} but the solve was asked "
                f"for layout={layout!r}; pass layout={A.layout!r}"
            )
        _check_square(A, what)
        _check_fits(A, like, what)
        return A
    if callable(A):
        return aslinearoperator(A, layout=layout, comm=comm)
    if isinstance(A, (np.ndarray, jax.Array)):
        if A.ndim != 2 or A.shape[0] != A.shape[1]:
            raise ValueError(f"linear operator must be a square matrix, but has shape: {A.shape} "
                             f"(distlinalg: {what} as a dense array)")
        if layout != "replicated":
            raise ValueError(
                f"distlinalg: a dense array {what} is a replicated operator (every rank holds all of it); "
                "use layout='replicated' or a sharded operator from distlinalg.operators"
            )
        if not _fits_dense(A, like):
            shapes = [jnp.shape(leaf) for leaf in jax.tree_util.tree_leaves(like)]
            raise ValueError(f"distlinalg: a dense {what} of shape {A.shape} does not fit b (leaf shapes {shapes})")
        return aslinearoperator(A, layout=layout, comm=comm)
    if hasattr(A, "__matmul__"):
        shape = getattr(A, "shape", None)
        if shape is not None and (len(shape) != 2 or shape[0] != shape[1]):
            raise ValueError(f"linear operator must be a square matrix, but has shape: {shape}")
        return aslinearoperator(A, layout=layout, comm=comm)
    raise TypeError(f"linear operator must be either a function or ndarray: {A!r} "
                    f"(distlinalg: {what} may be a callable, an array, an object with __matmul__ "
                    "or a distlinalg operator)")


def _check_square(A: LinearOperator, what: str) -> None:
    """A solve needs A x in the layout of x: on every rank, this rank's output
    block has the shapes of its input block. A sharded operator whose rows do
    not split as its columns (rows of an (M, N) matrix with M != N, or another
    partition) fails here on some rank, and `collectively` raises it on all."""
    ins, outs = A.in_structure, A.out_structure
    if ins is None or outs is None:
        return
    in_shapes = [leaf.shape for leaf in ins.leaves]
    out_shapes = [leaf.shape for leaf in outs.leaves]
    if ins.treedef != outs.treedef or in_shapes != out_shapes:
        raise ValueError(
            f"distlinalg: {what} is not square on this rank: it maps blocks of shapes {in_shapes} to blocks "
            f"of shapes {out_shapes}; a solve or eigensolve needs A x laid out as x (a sharded operator's "
            "rows split over the ranks as its columns)"
        )


def _check_fits(A: LinearOperator, like: Any, what: str) -> None:
    """This rank's block of b has the shapes that `A` takes (an operator, or a preconditioner such as
    multigrid, built for another grid or another split fails here, before any message)."""
    if A.in_structure is None:
        return
    expected = [tuple(leaf.shape) for leaf in A.in_structure.leaves]
    given = [tuple(jnp.shape(leaf)) for leaf in jax.tree_util.tree_leaves(like)]
    if expected != given:
        raise ValueError(
            f"distlinalg: {what} does not fit b: on this rank it takes blocks of shapes {expected}, b's are "
            f"{given} (an operator or preconditioner built for another grid, size or split of the rows?)"
        )


def _fits_dense(A: Any, like: Any) -> bool:
    leaves = jax.tree_util.tree_leaves(like)
    return len(leaves) == 1 and jnp.ndim(leaves[0]) >= 1 and jnp.shape(leaves[0])[0] == A.shape[1]


def check_layout(layout: str | None) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"distlinalg: layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def is_real_linear(A: Any) -> bool:
    """A distlinalg operator that is only real-linear on complex vectors."""
    return isinstance(A, LinearOperator) and A.real_linear


def solve_real_linear(solver: Callable[..., Any], A: Any, b: Any, x0: Any, M: Any, **options: Any) -> Any:
    """Run `solver` on the real system of (Re, Im) pairs of a real-linear A.

    An operator that is only real-linear on complex vectors (A(i v) ≠ i A v)
    is a symmetric real operator on R²ⁿ; the Krylov recurrences need that
    real inner product, Re⟨u, v⟩, not the complex one. M, if given, is paired
    the same way (a callable or matrix is first made an operator of the
    solve's layout).
    """
    layout = options.get("layout") or A.layout
    if M is not None and not isinstance(M, LinearOperator):
        comm = resolve_comm(options.get("comm") or A.comm)
        M = collectively(lambda: solver_operator(M, layout, comm, b, "M"), comm)
    x, info = solver(A.real_pairs(b), split_complex(b), None if x0 is None else split_complex(x0),
                     M=None if M is None else M.real_pairs(b), **options)
    return join_complex(x, b), info


# ---------------------------------------------------------------------------
# Vectors, tolerances and the iteration limit
def check_same_structure(b: Any, x0: Any) -> None:
    """x0 fits b (jax.scipy's wording, so code that matches its errors keeps working)."""
    sb, sx = jax.tree_util.tree_structure(b), jax.tree_util.tree_structure(x0)
    if sb != sx:
        raise ValueError(f"x0 and b must have matching tree structure: {sx} vs {sb}")
    shapes_b = [jnp.shape(leaf) for leaf in jax.tree_util.tree_leaves(b)]
    shapes_x = [jnp.shape(leaf) for leaf in jax.tree_util.tree_leaves(x0)]
    if shapes_b != shapes_x:
        raise ValueError(f"arrays in x0 and b must have matching shapes: {shapes_x} vs {shapes_b}")


def as_arrays(tree: Any) -> Any:
    """Every leaf as a JAX array (Python numbers stay weakly typed, as in jax.scipy)."""
    return jax.tree_util.tree_map(jnp.asarray, tree)


def is_traced(value: Any) -> bool:
    return isinstance(value, jax.core.Tracer)


def resolve_tolerances(tol: Any, rtol: Any, atol: Any) -> tuple[Any, Any, Any]:
    """(rtol, atol, invalid): checked tolerances.

    Python (and other concrete) numbers are checked here and raise a
    ValueError at trace time (on every rank: `setup` runs this `collectively`).
    Traced values cannot be checked before the program runs: `invalid` is
    then a traced bool that the input agreement turns into
    ``DIVERGED_INCONSISTENT_RANKS`` on every rank (False when all are concrete).
    """
    if tol is not None:
        rtol = tol
    invalid: Any = False
    for name, value in (("rtol", rtol), ("atol", atol)):
        if np.ndim(value):
            raise ValueError(f"distlinalg: {name} must be a scalar, got shape {np.shape(value)}")
        dtype = _dtype_of(value)
        if dtype is None or not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)) \
                or dtype == jnp.bool_:
            raise ValueError(f"distlinalg: {name} must be a real number, got {value!r}")
        if is_traced(value):
            invalid = invalid | ~jnp.isfinite(value) | (value < 0)
        elif not (math.isfinite(float(value)) and float(value) >= 0):
            raise ValueError(f"distlinalg: {name} must be a finite number >= 0, got {value!r}")
    if not is_traced(rtol) and not is_traced(atol):
        if float(rtol) == 0 and float(atol) == 0:
            raise ValueError("distlinalg: rtol or atol must be positive (both are 0: nothing could converge)")
    else:
        invalid = invalid | ((rtol == 0) & (atol == 0))
    return rtol, atol, invalid


def _dtype_of(value: Any) -> Any:
    """The dtype of a scalar argument, or None for something that is not a number."""
    try:
        return jnp.result_type(value)
    except (TypeError, ValueError):
        return None


def check_maxiter(maxiter: Any) -> tuple[Any, Any]:
    """(maxiter, invalid): None, a Python int (clamped to int32), or a traced int32.

    A negative or non-integer concrete value raises (trace time, every
    rank); a traced value must have an integer dtype, and a negative one is
    flagged in-graph like a bad traced tolerance.
    """
    if maxiter is None:
        return None, False
    if np.ndim(maxiter):
        raise ValueError(f"distlinalg: maxiter must be a scalar, got shape {np.shape(maxiter)}")
    dtype = _dtype_of(maxiter)
    if isinstance(maxiter, bool) or dtype is None or dtype == jnp.bool_ or not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(f"distlinalg: maxiter must be an integer, got {maxiter!r}")
    if is_traced(maxiter):
        # The loop counter is int32: clamp, after noting a negative value.
        return jnp.clip(maxiter, 0, INT32_MAX).astype(jnp.int32), maxiter < 0
    if int(maxiter) < 0:
        raise ValueError(f"distlinalg: maxiter must be >= 0, got {maxiter!r}")
    return min(int(maxiter), INT32_MAX), False


def global_size(b: Any) -> int:
    """Entries of this rank's `b` (all leaves)."""
    return sum(int(np.size(leaf)) for leaf in jax.tree_util.tree_leaves(b))


def default_maxiter(b: Any) -> int:
    """Replicated layout: 10 × the size of b, the same on every rank.

    (The input agreement checks that b's size agrees. The sharded default,
    10 × ranks × the largest block, needs the blocks of every rank, so it
    comes out of the agreement message: `_agreement._sharded_default`.)
    """
    return min(10 * global_size(b), INT32_MAX)


# ---------------------------------------------------------------------------
# Errors on every rank
_MESSAGE_BYTES = 256


_adapter_state = threading.local()


@contextlib.contextmanager
def inside_library_internals() -> Iterator[None]:
    """Solver calls made inside lineax's and optimistix's internals (by distlinalg's
    adapters): `collectively` checks their arguments on this rank only.

    Those libraries cache their traces with ``equinox.filter_jit``, keyed by
    each rank's own shapes. With uneven data a rank can find a trace cached
    (its shapes equal those of an earlier call, e.g. a rank without rows)
    while another traces afresh, and a trace-time exchange made inside would
    then wait for a rank that never comes (issue 57: a fit of 0/30/60 rows
    after one of 0/8/16, at 3 ranks). The arguments there are built by the
    adapter from the user's, so a rank-dependent error is a distlinalg bug;
    it raises on the rank that finds it (the safety net ends the job).
    """
    _adapter_state.depth = getattr(_adapter_state, "depth", 0) + 1
    try:
        yield
    finally:
        _adapter_state.depth -= 1


def _exchanges_allowed() -> bool:
    return getattr(_adapter_state, "depth", 0) == 0 or jax_names.at_top_level()


def collectively(build: Callable[[], Any], comm: Communicator) -> Any:
    """`build()`, with its ValueError (or TypeError) raised on every rank if it is raised on any.

    Argument checks run at trace time on each rank, and the arguments of a
    replicated solve can differ between ranks (a b built by rank-dependent
    code): a rank raising alone would leave the others blocked in the
    solve's first allreduce. So the ranks exchange their outcome (one small
    eager allgather of the error messages, at trace time, like the size
    exchanges of the operators; it is ordered after what the rank dispatched
    before): a rank whose arguments are invalid raises its own error, the
    others an error naming it and its message.
    """
    try:
        value, error = build(), None
    except (ValueError, TypeError) as raised:
        value, error = None, raised
    if comm.size > 1 and _exchanges_allowed():
        # The first byte of a message names the exception type (V or T).
        mine = "" if error is None else ("T" if isinstance(error, TypeError) else "V") + str(error)
        messages = _exchange_messages(mine, comm)
        failed = [r for r, message in enumerate(messages) if message]
        if failed and error is None:
            details = "; ".join(f"rank {r}: {messages[r][1:]}" for r in failed)
            kind = TypeError if all(messages[r][0] == "T" for r in failed) else ValueError
            raise kind(f"distlinalg: invalid solver arguments on rank(s) {failed} ({details})")
    if error is not None:
        raise error
    return value


def agree_options(where: str, problem: str, signature: str, comm: Communicator) -> None:
    """A preconditioner's options, checked on every rank together, before it sends anything.

    `problem`: what is wrong with this rank's options ("" when nothing);
    `signature`: a text of the options that steer its build and its messages
    (they must be the same on every rank). One exchange (at trace time, like
    `collectively`'s): a rank with a problem raises its own ValueError, the
    others one naming it and its message; options that differ between ranks
    raise the same ValueError, naming every rank's, on every rank.
    """
    if comm.size == 1 or not _exchanges_allowed():
        if problem:
            raise ValueError(f"{where}: {problem}")
        return
    messages = _exchange_messages(("!" + problem) if problem else signature, comm)
    if problem:
        raise ValueError(f"{where}: {problem}")
    failed = [r for r, message in enumerate(messages) if message.startswith("!")]
    if failed:
        details = "; ".join(f"rank {r}: {messages[r][1:]}" for r in failed)
        raise ValueError(f"{where}: invalid options on rank(s) {failed} ({details})")
    if any(message != messages[0] for message in messages):
        details = "; ".join(f"rank {r}: {message}" for r, message in enumerate(messages))
        raise ValueError(f"{where}: the ranks passed different options ({details}); every rank must pass the same")


def _exchange_messages(message: str, comm: Communicator) -> list[str]:
    """Every rank's `message` (cut to 255 bytes), on every rank, at trace time."""
    data = message.encode()[: _MESSAGE_BYTES - 1]
    row = np.zeros(_MESSAGE_BYTES, np.uint8)
    row[0] = len(data)
    row[1 : 1 + len(data)] = np.frombuffer(data, np.uint8)
    with jax.ensure_compile_time_eval():
        table = np.asarray(allgather(jnp.asarray(row), comm=comm))
    return [bytes(r[1 : 1 + int(r[0])]).decode(errors="replace") for r in table]
