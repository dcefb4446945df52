"""Deep Gradient Compression (Lin et al., ICLR 2018) from the library's pieces.

DGC's four techniques are each one piece, composed on the one pipeline:

* local gradient clipping: :func:`~jaxcomm.transforms.local_clip`;
* momentum correction and momentum factor masking: the memory :func:`jaxcomm.memory.dgc`;
* the top-k selection: :func:`jaxcomm.compressors.topk` in :func:`~jaxcomm.transforms.compressed_mean`;
* the exponential sparsity warm-up: stages of top-k (:func:`topk_warmup`), run by
  ``compressed_mean(..., warmup=...)``.

:func:`deep_gradient_compression` chains them.
"""

from __future__ import annotations

import optax

from .. import memory as memory_lib
from .._validate import check_finite_scalar, check_int, check_ratio
from ..compressors import Compressor, topk
from ._compressed_mean import compressed_mean
from ._gradient_dropping import _check_drop_ratio, dgc_density
from ._local_clip import local_clip

__all__ = ["topk_warmup", "deep_gradient_compression"]


def topk_warmup(
    final_ratio: float = 0.001, steps_per_stage: int = 1000, initial_drop_ratio: float = 0.75, *, dense_below: int = 0
) -> tuple[tuple[int, Compressor], ...]:
    """DGC's exponential sparsity warm-up (Lin et al. 2018, Sec. 3.4) as top-k stages.

    Stage ``j = 0, 1, ...`` keeps the density (fraction of entries sent)

        ρ_j = (1 - initial_drop_ratio)^(j + 1)

    (the formula of :func:`~jaxcomm.transforms.dgc_warmup`) for ``steps_per_stage``
    steps, for every ``j`` with ``ρ_j > final_ratio``; the compressor after the stages
    (``topk(ratio=final_ratio)``) takes over from there. With the defaults: densities
    25 %, 6.25 %, 1.5625 %, 0.390625 %, then 0.1 % (drop ratios 75 %, 93.75 %,
    98.4375 %, 99.61 %, 99.9 %: DGC's warm-up over the first four epochs with one stage
    per epoch).

    Args:
      final_ratio: the density after the warm-up, in ``(0, 1]``.
      steps_per_stage: steps per stage, an integer ``>= 1`` (e.g. the steps of one epoch).
      initial_drop_ratio: the first stage's drop ratio, in ``[0, 1)``.
      dense_below: of every stage's :func:`~jaxcomm.compressors.topk` (tensors of at most this
        many entries are sent whole).
    Returns:
      ``((steps_per_stage, topk(ratio=ρ_0)), (steps_per_stage, topk(ratio=ρ_1)), ...)``,
      the ``warmup`` argument of :func:`~jaxcomm.transforms.compressed_mean` (empty when
      ``ρ_0 <= final_ratio``).
    Raises:
      ValueError: ``final_ratio`` outside ``(0, 1]``, ``initial_drop_ratio`` outside ``[0, 1)``,
        ``steps_per_stage < 1``, or ``initial_drop_ratio > 1 - final_ratio`` (a warm-up
        sparser than the end).
      TypeError: a non-integer ``steps_per_stage``.
    """
    final_ratio = check_ratio(final_ratio, "final_ratio", "it fixes the number of entries sent k, an array shape")
    initial_drop_ratio = _check_drop_ratio(initial_drop_ratio, "initial_drop_ratio")
    steps_per_stage = check_int(steps_per_stage, "steps_per_stage", minimum=1)
    if initial_drop_ratio > 1.0 - final_ratio:
        raise ValueError(
            f"initial_drop_ratio ({initial_drop_ratio}) must not exceed the final drop ratio 1 - final_ratio "
            f"({1.0 - final_ratio})"
        )
    stages = []
    j = 0
    while (density := dgc_density(initial_drop_ratio, j)) > final_ratio:
        stages.append((steps_per_stage, topk(ratio=density, dense_below=dense_below)))
        j += 1
    return tuple(stages)


def deep_gradient_compression(
    ratio: float = 0.001,
    *,
    momentum: float = 0.9,
    clip_norm: float | None = None,
    steps_per_stage: int = 0,
    initial_drop_ratio: float = 0.75,
    dense_below: int = 0,
    axis_name: str | None = None,
    comm=None,
    fuse: bool = True,
    skip_nonfinite: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """Deep Gradient Compression (Lin et al., ICLR 2018): clipping, momentum correction, masking, warm-up.

    Long because its docstring states the method and every option; the body chains ``local_clip`` and
    ``compressed_mean``.

    Returns

        optax.chain(
            local_clip(clip_norm) if clip_norm else optax.identity(),
            compressed_mean(topk(ratio), memory=memory.dgc(momentum),
                            warmup=topk_warmup(ratio, steps_per_stage, initial_drop_ratio)
                                   if steps_per_stage else ()),
        )

    Chain plain SGD after it, ``optax.chain(deep_gradient_compression(...), optax.sgd(lr))``:
    the momentum lives in the memory. DGC's algorithm for momentum SGD on worker ``k``
    (Lin et al. 2018, Algorithm 1 with Sec. 3.2-3.4; numbered as listed here), and the
    piece that runs each line:

        1  G_k ← ∇f(x; w_t) on the worker's batch                  the caller (jax.grad)
        2  G_k ← G_k · min(1, thr·N^(-1/2) / ‖G_k‖)                 local_clip(clip_norm)
        3  U_k ← m·U_k + G_k                                       memory.dgc: compensate
        4  V_k ← V_k + U_k                                         memory.dgc: compensate (φ = V_k)
        5  mask ← the k largest |V_k[j]| of each tensor j          topk(ρ_t): exact k = round(ρ_t·d_j)
        6  G̃_k[j] ← V_k[j] ⊙ mask                                  topk's payload: k values, k indices
        7  V_k[j] ← V_k[j] ⊙ ¬mask;  U_k[j] ← U_k[j] ⊙ ¬mask        memory.dgc: update (factor masking)
        8  G ← (1/N) Σ_k G̃_k   (all-gather of the sparse payloads)  compressed_mean (the pipeline)
        9  w ← w − lr·G                                            optax.sgd(lr), chained after
           ρ_t: 25 %, 6.25 %, ... for steps_per_stage steps each, then ratio  topk_warmup stages

    Line 8 averages where the paper sums gradients already divided by ``N`` (line 1
    there is ``Σ ∇f / (N b)``); the two agree, because top-k and the memory are
    linear in a common scale. Shapes: every gradient leaf is a tensor ``j`` of ``d_j``
    entries, selected on its own; the state is ``(clip state, CompressionState)`` per
    worker, whose ``memory`` holds :class:`~jaxcomm.memory.DGCMemoryState` ``(U, V)``
    per leaf.

    Args:
      ratio: the density sent after the warm-up, ``ρ`` in ``(0, 1]`` (DGC: 0.001).
      momentum: ``m`` in ``[0, 1)``.
      clip_norm: ``thr``, the norm the summed gradient is clipped to (each worker clips
        its own to ``thr / sqrt(N)``); ``None`` (default): no clipping.
      steps_per_stage: steps per warm-up stage, an integer ``>= 0``; ``0`` (default):
        no warm-up, ``ratio`` from the first step.
      initial_drop_ratio: the first stage's drop ratio (DGC: 0.75).
      dense_below: tensors of at most this many entries (biases, normalisation scales) are
        sent whole, at every stage (:func:`~jaxcomm.compressors.topk`'s ``dense_below``).
      axis_name / comm: the workers' communicator, as in
        :func:`~jaxcomm.transforms.compressed_mean`.
      fuse: as in :func:`~jaxcomm.transforms.compressed_mean`.
      skip_nonfinite: as in :func:`~jaxcomm.transforms.compressed_mean`: when some worker's
        (clipped) gradient has a NaN or Inf, every worker skips the step and ``U``, ``V``
        stay as they were; ``False`` (default): ``U`` and ``V`` keep the non-finite entries.
    Returns:
      An ``optax`` chain (per-worker state) whose ``update`` maps each worker's
      gradient tree to the workers' mean of the sparse accumulated velocities,
      identical on every worker.
    Raises:
      ValueError / TypeError: a bad argument, named (``ratio``, ``momentum``,
        ``clip_norm``, ``steps_per_stage``, ``initial_drop_ratio``, ``axis_name``/``comm``).
    """
    compressor = topk(ratio=ratio, dense_below=dense_below)
    memory = memory_lib.dgc(momentum)
    if clip_norm is not None:
        clip_norm = check_finite_scalar(clip_norm, "clip_norm", positive=True)
    steps_per_stage = check_int(steps_per_stage, "steps_per_stage", minimum=0)
    stages = topk_warmup(ratio, steps_per_stage, initial_drop_ratio, dense_below=dense_below) if steps_per_stage else ()
    if not steps_per_stage:
        _check_drop_ratio(initial_drop_ratio, "initial_drop_ratio")
    clip = optax.identity() if clip_norm is None else local_clip(clip_norm, axis_name=axis_name, comm=comm)
    mean = compressed_mean(
        compressor, axis_name, comm=comm, memory=memory, fuse=fuse, warmup=stages, skip_nonfinite=skip_nonfinite
    )
    return optax.chain(clip, mean)
