"""The sample-space Gram operator (neural tangent kernel; MinSR, SRt):

    T x = Ō Ōᴴ x / N + λ x,        N_s·k × N_s·k,

the counterpart of the parameter-space S = Ōᴴ Ō / N (:mod:`.gram`) for
models with many more parameters than samples. Ō is the centred Jacobian of
:mod:`._jacobian` (NetKet's modes; k = 2 channels (Re, Im) per sample in
"complex" mode). The layout is "sharded" over samples: rank r owns the rows
of its own samples, and a vector is this rank's (n_r,) block, or (n_r, 2)
real in "complex" mode (NetKet's interleaved [Re x_1, Im x_1, Re x_2, ...]
once flattened).

A matvec is u = Ōᴴ x / N (a VJP; one allreduce of a parameter-sized vector
with replicated parameters) followed by Ō u (a JVP, local). The Jacobian is
never formed in a matvec; ``to_dense`` forms this rank's rows only and passes
them around a ring of ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .._trees import Structure
from ..comm.p2p import sendrecv
from ._base import LinearOperator, eager_product, function_operator, linearise, operator_class
from ._jacobian import ModelOperator, Jacobian, ModelPoint
from ._partition import gather_rows

__all__ = ["sample_gram", "sample_gram_operator", "SampleGramOperator", "sample_structure"]

_NAME = "distlinalg.operators.sample_gram"
RING_PIECE_BYTES = 32 << 20  # size of the pieces of Ō's rows that travel in to_dense's ring
RING_PIECE_ROWS = None  # or a fixed number of rows per piece (tests)


# -- the math, one small function per term -------------------------------------------
def as_rows(model: Jacobian, x: jax.Array) -> jax.Array:
    """A sample-space block (n,) or (n, 2) as (n, k) rows of the model's dtype."""
    return jnp.reshape(x, (model.n_local, model.channels)).astype(model.dtype)


def tangent_of(model: Jacobian, x: jax.Array) -> Any:
    """u = Ōᴴ x / N: the parameter-space vector a sample-space one pulls back to."""
    return jax.tree_util.tree_map(lambda a: a / model.n_total, model.adjoint(as_rows(model, x)))


def sample_gram_product(model: Jacobian, x: jax.Array) -> jax.Array:
    """Ō Ōᴴ x / N, shaped like x."""
    return jnp.reshape(model.jvp(tangent_of(model, x)), jnp.shape(x)).astype(x.dtype)


def ring_products(rows: jax.Array, counts: Any, per_sample: int, comm: Any) -> jax.Array:
    """This rank's rows of R Rᴴ from every rank's rows R_q, (n_r·k, N·k).

    The own block R_r R_rᴴ is one product. Every rank's rows then travel
    around the ring of ranks in pieces of at most RING_PIECE_BYTES (P − 1
    sendrecv steps per piece, the same number of equally sized pieces on
    every rank), each meeting this rank's rows in a product R_r R_qᴴ.
    Memory: this rank's rows, two pieces and the result.
    """
    size, rank = comm.size, comm.rank
    widths = [int(c) * per_sample for c in counts]
    blocks: list[Any] = [None] * size
    blocks[rank] = rows @ jnp.conj(rows).T
    if size == 1:
        return blocks[rank]
    piece_rows = RING_PIECE_ROWS or max(1, RING_PIECE_BYTES // (rows.shape[1] * rows.dtype.itemsize))
    n_pieces = max(1, -(-max(widths) // piece_rows))
    height = -(-max(widths) // n_pieces)
    pieces: list[list[Any]] = [[] for _ in range(size)]
    for j in range(n_pieces):
        mine = rows[j * height : (j + 1) * height]  # static slice, padded to the common height
        travelling = jnp.pad(mine, ((0, height - mine.shape[0]), (0, 0)))
        for step in range(1, size):
            travelling = sendrecv(travelling, travelling, source=(rank - 1) % size, dest=(rank + 1) % size, comm=comm)
            owner = (rank - step) % size  # whose piece has reached this rank
            pieces[owner].append(rows @ jnp.conj(travelling).T)
    for owner in range(size):
        if owner != rank:
            blocks[owner] = jnp.concatenate(pieces[owner], axis=1)[:, : widths[owner]]
    return jnp.concatenate(blocks, axis=1)


def sample_structure(point: ModelPoint | Jacobian) -> jax.ShapeDtypeStruct:
    """A sample-space block: (n_r,) of the rows' dtype, or (n_r, 2) real in "complex" mode."""
    if point.mode == "complex":
        return jax.ShapeDtypeStruct((point.n_local, 2), point.dtype)
    return jax.ShapeDtypeStruct((point.n_local,), point.dtype)


@operator_class
class SampleGramOperator(ModelOperator):
    """T = Ō Ōᴴ / N + λ I on this rank's samples; see :func:`sample_gram`.

    Args:
      point: the :class:`~distlinalg.operators.ModelPoint`.
      diag_shift: λ, a scalar (Python number or 0-d array, may be traced).

    Pytree: the children are ``(point, diag_shift)``, i.e. the leaves are
    params, this rank's samples and λ; f, the mode, every rank's sample
    count and the structures are static and compare by value. An operator
    built outside ``jax.jit`` can be an argument of a jitted function (one
    with new params or samples of the same shapes and the same f reuses the
    compilation), and ``jax.grad`` with respect to it gives a
    SampleGramOperator of cotangents (``.params``, ``.samples``,
    ``.diag_shift``). Unflattening computes and communicates nothing; a
    product evaluates the model, and the solvers linearise it once
    (:func:`~distlinalg.operators.linearise`).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import distlinalg as dl
      >>> from distlinalg import comm
      >>> from distlinalg.operators import sample_gram
      >>> f = lambda w, x: jnp.tanh(x @ w)
      >>> x = jax.random.normal(jax.random.PRNGKey(comm.rank()), (4, 3))
      >>> T = sample_gram(f, jnp.array([0.5, -0.3, 0.2]), x, diag_shift=1e-2)
      >>> T.n_samples == 4 * comm.size(), T.to_dense().shape == (4, T.n_samples)
      (True, True)
      >>> y, info = jax.jit(dl.cg)(T, jnp.ones(4))   # this rank's block: its 4 samples
      >>> bool(info.converged), bool(jnp.allclose(T @ y, 1.0, atol=1e-4))
      (True, True)
    """

    diag_shift: Any = 0.0

    layout = "sharded"

    @property
    def in_structure(self) -> Structure:
        return Structure.of(sample_structure(self.point))

    @property
    def out_structure(self) -> Structure:
        return self.in_structure

    def _matvec(self, x: jax.Array) -> jax.Array:
        eager = eager_product(self, x)
        if eager is not None:
            return eager
        return sample_gram_product(self.point.jacobian(), x) + self.diag_shift * x

    def _diagonal(self) -> jax.Array:
        return sample_gram_diagonal(self.point.jacobian(), self.diag_shift)

    @property
    def n_samples(self) -> int:
        """N, the number of samples over all ranks."""
        return self.model.n_total

    def to_dense(self, gather: bool = False) -> jax.Array:
        """This rank's rows of T, ``(n_r·k, N·k)`` (samples in rank order, the
        two channels of a sample adjacent in "complex" mode); with
        ``gather=True`` the whole ``(N·k, N·k)`` matrix on every rank.

        Replicated parameters: forms this rank's Jacobian rows (n_r·k × n)
        and passes them around the ring of ranks in pieces of 32 MiB
        (memory per rank O(n_r·k·n + N·n_r·k²), never the whole Jacobian).
        Sharded parameters (or a model that communicates): T applied to the
        N·k unit vectors (batched), whose intermediate is N·k × this rank's
        parameter block. Every rank must call it together.
        """
        model = self.point.linearise()
        k = model.channels
        if not model.sharded_params and not model.communicates:
            rows = ring_products(model.local_rows(), model.counts, k, model.comm) / model.n_total
        else:
            total = model.n_total * k
            offset = int(model.counts[: model.comm.rank].sum()) * k
            shape, dtype = self.input_structure.shape, self.input_structure.dtype
            basis = jnp.eye(total, dtype=dtype)[:, offset : offset + model.n_local * k]
            columns = jax.vmap(lambda e: jnp.reshape(sample_gram_product(model, e.reshape(shape)), (-1,)))(basis)
            rows = columns.T
        rows = rows + self.diag_shift * jnp.eye(rows.shape[0], rows.shape[1],
                                               k=int(model.counts[: model.comm.rank].sum()) * k, dtype=rows.dtype)
        if model.mode != "holomorphic":
            rows = jnp.real(rows)
        return gather_rows(rows, model.comm) if gather else rows


def sample_gram(
    f: Callable[[Any, Any], Any],
    params: Any,
    samples: Any,
    *,
    center: bool = True,
    diag_shift: Any = 0.0,
    mode: str | None = None,
    chunk_size: int | None = None,
    comm: Any = None,
    sharded_params: bool = False,
) -> SampleGramOperator:
    """The samples × samples Gram matrix T = Ō Ōᴴ / N + λ I of a sharded model.

    The sample-space form of natural gradients (MinSR / SRt): for a model
    with n parameters and N samples over all ranks, T is N·k × N·k against
    the n × n of :func:`distlinalg.operators.gram`, with the same nonzero
    spectrum (push-through identity).

    Args:
      f: ``f(params, samples) -> (n_r,)``: one output per local sample (e.g.
        log ψ(σ_i)); see :func:`distlinalg.operators.gram`.
      params: pytree of floating/complex arrays: replicated (identical on
        every rank) or, with ``sharded_params=True``, this rank's block.
      samples: pytree of arrays with a leading axis of this rank's n_r
        samples (counts may differ between ranks).
      center: subtract the mean Jacobian row over all N samples.
      diag_shift: λ (may be traced; the operator is differentiable in it).
      mode: "real", "complex" or "holomorphic" (NetKet's modes; default
        None is NetKet's choice: "complex" for a complex output, else
        "real"). "complex" has k = 2 real rows per sample (Re f, Im f).
      chunk_size: evaluate the model on at most this many local samples at a
        time (bounds memory; the model is re-linearised per chunk).
      comm: communicator (default distlinalg's).
      sharded_params: params are this rank's block and f communicates.

    Returns:
      A :class:`SampleGramOperator`, layout "sharded" over samples: vectors
      are this rank's block, shape (n_r,) (real in "real" mode, complex in
      "holomorphic" mode) or (n_r, 2) real in "complex" mode. Hermitian
      (real symmetric outside "holomorphic" mode). One parameter-sized
      allreduce per matvec (replicated parameters; with sharded parameters
      the model's collectives plus two k-vector allreduces for the
      centring). ``to_dense()`` gives this rank's rows, ``to_dense(gather=
      True)`` the whole matrix.

    AD: differentiable with respect to params, samples and diag_shift, built
    inside the differentiated function or passed to it (a pytree whose
    leaves are params, samples and diag_shift); ``jax.grad`` through a solve
    with it gives exact meta-gradients.

    Pytree and jit: see :class:`SampleGramOperator`. Every rank's sample
    count is exchanged here, once, and kept static.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from distlinalg import comm
      >>> from distlinalg.operators import sample_gram
      >>> f = lambda w, x: jnp.tanh(x @ w)          # one output per sample
      >>> w = jnp.array([0.5, -0.3, 0.2])
      >>> x = jax.random.normal(jax.random.PRNGKey(comm.rank()), (4, 3))  # this rank's samples
      >>> T = sample_gram(f, w, x, diag_shift=1e-2)  # N × N, N = 4 · ranks
      >>> X = comm.allgather(x).reshape(-1, 3)      # every rank's samples: the reference
      >>> O = jax.jacfwd(f)(w, X); O = O - O.mean(axis=0)
      >>> bool(jnp.allclose(T.to_dense(gather=True), O @ O.T / len(X) + 1e-2 * jnp.eye(len(X)), atol=1e-5))
      True
    """
    point = ModelPoint.build(f, params, samples, mode=mode, center=center, chunk_size=chunk_size, comm=comm,
                             sharded_params=sharded_params, where=_NAME)
    return SampleGramOperator(point=point, diag_shift=diag_shift)


def sample_gram_operator(point: ModelPoint, diag_shift: Any) -> SampleGramOperator:
    """T + λ I at a :class:`~distlinalg.operators.ModelPoint` (see :func:`sample_gram`)."""
    return SampleGramOperator(point=point, diag_shift=diag_shift)


def sample_gram_diagonal(model: Jacobian, diag_shift: Any, squares: Any = None) -> jax.Array:
    """T_ii = |Ō_i|² / N + λ from this rank's rows (`squares`: |Ō_i|² / N when already formed)."""
    if model.sharded_params or model.communicates:
        raise NotImplementedError(f"{_NAME}: the diagonal needs replicated parameters and a model "
                                  "that does not communicate")
    structure = sample_structure(model)
    if squares is None:
        squares = jnp.sum(jnp.abs(model.local_rows()) ** 2, axis=1) / model.n_total
    return (squares.reshape(structure.shape) + diag_shift).astype(structure.dtype)


@linearise.register
def _linearise_sample_gram(T: SampleGramOperator) -> LinearOperator:
    """The model linearised once (the diagonal, when asked for, formed once per call)."""
    model = T.point.linearise()
    return function_operator(
        lambda x: sample_gram_product(model, x) + T.diag_shift * x,
        diagonal=lambda: sample_gram_diagonal(model, T.diag_shift),
        input_structure=T.in_structure, layout="sharded", symmetric=T.symmetric, hermitian=True,
        comm=T.comm, name=T.name, linearisation=model,
    )
