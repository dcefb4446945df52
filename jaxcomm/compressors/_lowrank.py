"""Low-rank compression: PowerSGD (Vogels et al. 2019; GRACE Sec. III-D, Table I).

Each gradient array is viewed as a matrix ``M`` of shape ``(n, m)`` (the
product of the leading dimensions by the last: fan-in by outputs for Flax's
``(..., in, out)`` kernels, the transpose of the matrix PyTorch's
``powerSGD_hook`` forms from its ``(out, in, ...)`` layout) and
approximated by ``P Q^T`` with ``P: (n, r)``, ``Q: (m, r)`` from one step of
subspace (power) iteration, warm-started from the previous step's ``Q``:

    P = M Q;   P = orthogonalize(P);   Q = M^T P;   M_hat = P Q^T.

Across workers (the compressor's ``rounds``, driven by the transforms' pipeline)
the two products are summed between the rounds (Vogels et al., Algorithm 1), so
the result is the rank-``r`` approximation of the *sum* of the workers' matrices:

    P = sum_i M_i Q;   P = orthogonalize(P);   Q = sum_i M_i^T P;   sum_i M_i ~ P Q^T.

Option names follow ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.PowerSGDState``
(``matrix_approximation_rank``, ``min_compression_rate``, ``warm_start``,
``orthogonalization_epsilon``, ``start_powerSGD_iter``,
``batch_tensors_with_same_shape``). PyTorch's
``use_error_feedback`` is the transform's memory here
(``compressed_mean(..., memory=jaxcomm.memory.residual())``); ``start_powerSGD_iter``
is run by :func:`jaxcomm.transforms.compressed_mean` (the compressor's
``dense_warmup``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._validate import check_bool, check_finite_scalar, check_int
from ._base import Compressor, DensePayload, Payload, payload_dataclass, register, static_field
from ._quantize import scaled_l2_norm

Array = jax.Array

__all__ = ["powersgd", "PowerSGDState", "PowerSGDPayload", "orthogonalize", "powersgd_plan"]


class PowerSGDState(NamedTuple):
    """Per-array state of :func:`powersgd` (arrays it compresses, with ``warm_start``).

    Attributes:
      q: float32 ``(m, r)``: the last ``Q`` (warm start of the next power iteration).
      initialized: bool scalar; ``False`` until the first step (then ``Q`` is drawn from the key).
    """

    q: Array
    initialized: Array


@payload_dataclass
class PowerSGDPayload(Payload):
    """The two low-rank factors: ``M_hat = P Q^T`` (float32).

    Attributes:
      p: ``(n, r)`` with orthonormal columns (or zero columns, see :func:`orthogonalize`).
      q: ``(m, r)``.
      shape, dtype: original shape and dtype (static, not sent).

    Wire bits: ``32 (n + m) r``.
    """

    p: Array
    q: Array
    shape: tuple = static_field()
    dtype: Any = static_field()


def powersgd_plan(shape, rank: int, min_compression_rate: float) -> tuple[int, int, int] | None:
    """``(n, m, r)`` if PowerSGD compresses an array of ``shape``, else ``None``.

    Arrays of rank < 2 are sent uncompressed, as in PyTorch's hook. Otherwise the
    array is viewed as the matrix ``(n, m) = (prod(shape[:-1]), shape[-1])``:
    fan-in by outputs for Flax's ``(in, out)`` dense and ``(kh, kw, in, out)``
    convolution kernels, the same matrix PyTorch forms from its ``(out, in, kh,
    kw)`` layout (``shape[0]`` by the rest), transposed. ``r = min(rank, n, m)``,
    and the array is compressed iff ``(n + m) r * min_compression_rate < n m``.
    (Viewing a Flax 3x3x16x16 kernel PyTorch's way, as 3 x 768, would leave it
    uncompressed at rank 2.)
    """
    if len(shape) < 2:
        return None
    n = int(np.prod(shape[:-1], dtype=np.int64))
    m = int(shape[-1])
    r = min(rank, n, m)
    if r < 1 or (n + m) * r * min_compression_rate >= n * m:
        return None
    return n, m, r


def _matmul(a, b):
    """``a @ b`` for ``a: (k, l)``, ``b: (l, j)`` (float32), as one row-major matrix product.

    PowerSGD's products all have one thin operand (``r`` columns or rows):
    ``M Q``, ``P^T M`` and ``P Q^T``. Written as ``M.T @ P`` or ``P @ Q.T``,
    or with the transposes left for XLA to fold into the product, they
    contract a dimension other than the operands' last-by-first; XLA:CPU then
    runs them outside its matrix-product kernels, as a generic dot or (rank 1)
    a loop with a column-wise reduction over ``M``, far slower than a pass
    over ``M``. Here both operands and the result go through
    ``lax.optimization_barrier``, so the product is exactly ``dot(a, b)``
    contracting ``a``'s last with ``b``'s first dimension on row-major
    buffers, and a thin factor's transpose (``P^T: (r, n)``, ``Q^T: (r, m)``)
    is written out as its own small array. Under ``jax.vmap`` a leading batch
    dimension of both operands becomes the product's batch dimension.
    """
    a, b = lax.optimization_barrier((a, b))
    return lax.optimization_barrier(lax.dot_general(a, b, (((1,), (0,)), ((), ()))))


def orthogonalize(p, epsilon: float = 0.0):
    """Gram-Schmidt on the columns of ``p`` (float32 ``(n, r)``), with one re-orthogonalisation pass.

    Column ``i`` has its components along columns ``0..i-1`` removed twice
    ("twice is enough": a single pass loses orthogonality in float32 when ``p``
    is rank-deficient, e.g. ``P = M Q`` for a matrix ``M`` of rank ``< r``;
    PyTorch's hook switches to QR for ``r > 2`` for the same reason), then is
    normalised as in PyTorch's ``_orthogonalize_gram_schmidt``: ``col / ||col||``
    if ``epsilon == 0``, else ``col / (||col|| + epsilon)``. A zero column with
    ``epsilon == 0`` stays zero (PyTorch would divide by zero; its error message
    says to recover the column as zeros). With ``epsilon = 0`` and full column
    rank the result is the ``Q`` of a QR decomposition up to column signs.
    Norms are computed without overflow (:func:`~._quantize.scaled_l2_norm`); a column
    with a NaN or infinite entry becomes NaN (not zero), so non-finite input
    propagates to the reconstruction.
    """
    r = p.shape[1]
    for i in range(r):
        col = p[:, i]
        if i > 0:
            prev = p[:, :i]
            for _ in range(2):
                col = col - prev @ (prev.T @ col)
        norm = scaled_l2_norm(col)  # no overflow for huge entries, no lax.cond; NaN for a NaN column
        if epsilon == 0.0:
            col = jnp.where(norm == 0, 0.0, col / jnp.where(norm == 0, 1.0, norm))
        else:
            col = col / (norm + epsilon)
        p = p.at[:, i].set(col)
    return p


@register("powersgd")
def powersgd(
    rank: int | None = None,
    *,
    matrix_approximation_rank: int = 1,
    min_compression_rate: float = 2.0,
    warm_start: bool = True,
    orthogonalization_epsilon: float = 0.0,
    start_powerSGD_iter: int = 0,
    batch_tensors_with_same_shape: bool = False,
    seed: int = 0,
) -> Compressor:
    """PowerSGD low-rank compression (Vogels et al. 2019, Algorithm 1; GRACE Table I).

    Long because a compressor factory's closures share the validated hyper-parameters; each inner function is short.

    Per array (viewed as ``M: (n, m)``, :func:`powersgd_plan`): ``P = M Q``,
    ``P <- orthogonalize(P)``, ``Q = M^T P``; the payload is ``(P, Q)`` and the
    reconstruction ``P Q^T``, the projection of ``M`` on the span of ``P``. ``Q``
    is kept in the state and reused (after orthogonalisation) as the next
    step's starting point when ``warm_start`` (one power-iteration step per SGD
    step); otherwise, and at the first step, ``Q`` is a standard normal draw
    from the key (shared by the workers, so they agree). A matrix of rank
    ``<= r`` is reproduced exactly after one step (up to float rounding).

    Arrays of rank < 2, and those where ``(n + m) r * min_compression_rate >=
    n m``, are sent uncompressed (:class:`DensePayload`), as in PyTorch.

    ``rounds`` is the distributed version with two sums over the workers, which
    the pipeline runs (:func:`jaxcomm.transforms._collectives.run_rounds`): ``P = Σ_i M_i Q``,
    orthogonalize, ``Q = Σ_i M_i^T P``; its payload decompresses to the
    rank-``r`` approximation of the *sum* over workers, and the state keeps
    ``Q / n`` (identical on every worker).

    Deterministic given the state and key, biased (``unbiased=False``);
    strategy ``"allreduce"`` (through ``rounds``). Computation is in
    float32; the output has the input's dtype. Wire bits ``32 (n + m) r`` per
    compressed array, ``d bits(dtype)`` for the others. NaN/Inf propagate into
    the output; a non-finite warm-start ``Q`` is replaced by a fresh draw, so
    one bad step does not poison the following ones.

    Args:
      rank: alias of ``matrix_approximation_rank`` (give one of them).
      matrix_approximation_rank: ``r >= 1``.
      min_compression_rate: compress only arrays whose size shrinks by more
        than this factor (> 0; PyTorch's default 2).
      warm_start: reuse ``Q`` across steps (PyTorch's ``warm_start``).
      orthogonalization_epsilon: ``>= 0``, added to column norms in Gram-Schmidt.
      start_powerSGD_iter: PyTorch's dense warm-up: for steps ``0 .. start_powerSGD_iter
        - 1`` :func:`jaxcomm.transforms.compressed_mean` sends the dense mean (one
        all-reduce per tensor) and leaves the error-feedback memory at zero and ``Q``
        undrawn; PowerSGD, and the memory, start at the switch (the compressor's
        ``dense_warmup``). Integer ``>= 0``; ``0`` (the default here, PyTorch's is
        1,000): compress from the first step. PyTorch refuses ``<= 1`` with error
        feedback or warm start because DDP rebuilds its gradient buckets after
        the first step; jaxcomm's per-tensor state has no buckets, so 0 and 1 are
        accepted.
      batch_tensors_with_same_shape: PyTorch's option: tensors with the same
        matrix view ``(n, m)`` (:func:`powersgd_plan`; e.g. a ``(6, 4, 18)`` and a
        ``(24, 18)`` array, as PyTorch groups its ``(n, m)`` views) and dtype run
        their rounds as one batch (``jax.vmap``: batched matrix products and
        orthogonalisation, one all-reduce per round for the group), each with its
        own key and state, so the result equals the per-tensor one up to float
        rounding (:func:`jaxcomm.transforms.compressed_mean` under ``"allreduce"``).
      seed: seed of the optax transformation's key.
    Raises:
      ValueError/TypeError: rank < 1, both rank names given with different
        values, a non-positive or non-finite rate, a negative epsilon, a negative
        or non-integer ``start_powerSGD_iter``, a non-bool ``warm_start`` or
        ``batch_tensors_with_same_shape``.
    """
    matrix_approximation_rank = check_int(matrix_approximation_rank, "matrix_approximation_rank")
    if rank is not None:
        rank = check_int(rank, "rank")
        if matrix_approximation_rank not in (1, rank):
            raise ValueError(
                f"rank is an alias of matrix_approximation_rank: got rank={rank} and "
                f"matrix_approximation_rank={matrix_approximation_rank}; pass only one"
            )
        r_max = rank
    else:
        r_max = matrix_approximation_rank
    start = check_int(
        start_powerSGD_iter,
        "start_powerSGD_iter",
        minimum=0,
        why="it is the compressor's dense_warmup field",
    )
    rate = check_finite_scalar(min_compression_rate, "min_compression_rate", positive=True)
    eps = check_finite_scalar(orthogonalization_epsilon, "orthogonalization_epsilon", nonnegative=True)
    batch_tensors_with_same_shape = check_bool(batch_tensors_with_same_shape, "batch_tensors_with_same_shape")
    warm_start = check_bool(warm_start, "warm_start")

    def init_state(x):
        plan = powersgd_plan(tuple(np.shape(x)), r_max, rate)
        if plan is None or not warm_start:
            return ()
        _, m, r = plan
        return PowerSGDState(q=jnp.zeros((m, r), jnp.float32), initialized=jnp.bool_(False))

    def start_q(key, state, m, r):
        fresh = jax.random.normal(key, (m, r), jnp.float32)
        if not warm_start or not isinstance(state, PowerSGDState):
            return fresh
        usable = state.initialized & jnp.all(jnp.isfinite(state.q))
        return jnp.where(usable, orthogonalize(state.q, eps), fresh)

    def new_state(q):
        if not warm_start:
            return ()
        return PowerSGDState(q=q, initialized=jnp.bool_(True))

    def compress(x, key, state):
        shape = tuple(np.shape(x))
        plan = powersgd_plan(shape, r_max, rate)
        if plan is None:
            return DensePayload(data=x, dtype=x.dtype), state
        n, m, r = plan
        mat = jnp.reshape(x, (n, m)).astype(jnp.float32)
        q = start_q(key, state, m, r)
        p = orthogonalize(_matmul(mat, q), eps)
        q = _matmul(p.T, mat).T  # M^T P, computed as (P^T M)^T
        return PowerSGDPayload(p=p, q=q, shape=shape, dtype=x.dtype), new_state(q)

    def rounds(x, key, state, size):
        # Two sums over the workers (Vogels et al., Algorithm 1); the pipeline runs them.
        shape = tuple(np.shape(x))
        plan = powersgd_plan(shape, r_max, rate)
        if plan is None:
            total = yield x
            return DensePayload(data=total, dtype=x.dtype), state
        n, m, r = plan
        mat = jnp.reshape(x, (n, m)).astype(jnp.float32)
        q = start_q(key, state, m, r)
        p = orthogonalize((yield _matmul(mat, q)), eps)  # round 1: P = orth(sum_i M_i Q)
        q = yield _matmul(p.T, mat).T  # round 2: Q = sum_i M_i^T P = (sum_i P^T M_i)^T
        return PowerSGDPayload(p=p, q=q, shape=shape, dtype=x.dtype), new_state(q / size)

    def decompress(payload):
        if isinstance(payload, DensePayload):
            return payload.data.astype(payload.dtype)
        return _matmul(payload.p, payload.q.T).reshape(payload.shape).astype(payload.dtype)

    return Compressor(
        name="powersgd",
        compress_fn=compress,
        decompress_fn=decompress,
        unbiased=False,
        strategy="allreduce",
        init_state=init_state,
        rounds=rounds,
        seed=seed,
        dense_warmup=start,
        stochastic=True,
        contraction=0.0,
        bound="an orthogonal projection of the (summed) matrix onto rank r (non-expansive, δ = 0), with no "
        "uniform δ > 0 (Vogels et al. 2019 pair it with error feedback)",
        params=dict(
            matrix_approximation_rank=r_max,
            min_compression_rate=rate,
            warm_start=warm_start,
            orthogonalization_epsilon=eps,
            start_powerSGD_iter=start,
            batch_tensors_with_same_shape=bool(batch_tensors_with_same_shape),
        ),
    )
