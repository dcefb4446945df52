"""Gradient dropping with local gradients (Algorithm 2) and its DGC options.

Aji & Heafield (2017) drop all but the largest gradients (Algorithm 1, with
error feedback); "Combining global sparse gradients with local gradients"
(Aji, Heafield & Bogoychev, EMNLP-IJCNLP 2019, Algorithm 2) lets every node n
combine the summed sparse global gradient G_t with its own dense local gradient L^n_t:

    E^n_t ← E^n_{t-1} + L^n_t
    threshold ← K-th largest of |E^n_t|;   mask ← |E^n_t| ≥ threshold
    S^n_t ← mask ⊙ E^n_t;                  E^n_t ← ¬mask ⊙ E^n_t
    G_t ← AllReduce(S^n_t)                 (a sum over the N nodes)
    SUM:     C^n_t = (G_t + L^n_t) / 2
    PARTIAL: C^n_t = G_t − S^n_t + L^n_t
    ERROR:   C^n_t = G_t + E^n_t;  E^n_t ← 0
    ApplyOptimizer(C^n_t)

plus the drop-ratio warm-up of Sec. 5.1, ``R_t = 0.99^max(1, T/t)``, and
periodic parameter averaging (every 500 steps in the paper), because the local
terms make the workers' parameters drift apart. From Deep Gradient Compression
(Lin et al. 2018, Sec. 3.3) come two composable options: local gradient
clipping before accumulation (threshold scaled by N^{-1/2}) and the
exponential compression-ratio warm-up.

Lines 3-8 are the transforms' pipeline (:mod:`._pipeline`) with the residual
memory (``E ← E + L``, then ``E ← E − S``) and a top-k selection: the
catalogue's exact top-k (sparse exchange), Algorithm 2's threshold rule sent
dense (``mask = |E| ≥ K-th largest``, ties kept), or a fixed capacity of
magnitude-ordered pairs after a warm-up. Only the combination ``C`` is written here.

Usage (inside ``jax.shard_map`` over "data", or with ``axis_name`` bound by vmap)::

    tx = optax.chain(
        jc.gradient_dropping(jc.drop_ratio_warmup(0.99, warmup_steps=1000), mode="partial"),
        optax.adam(1e-3),
        jc.periodic_average(every=500),
    )
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .. import memory as memory_lib
from .._bitcount import BitCount
from .._validate import check_choice, check_finite_scalar, check_int
from .._vma import cast_varying, typed_cond, varying_axes
from ..comm import resolve
from ..compressors import Compressor, index_dtype, topk
from ..compressors._base import DensePayload
from ..compressors._sparse import SparsePayload
from ._checks import check_skip_nonfinite
from ._local_clip import clip_leaves
from ._pipeline import compress_step, if_finite
from ._state import CompressionState, group_vector, groups_of, init_state, ungroup

__all__ = [
    "DropRatioSchedule",
    "PeriodicAverageState",
    "gradient_dropping",
    "drop_ratio_warmup",
    "dgc_warmup",
    "periodic_average",
    "average_params",
    "num_kept",
]

COMBINATIONS = ("none", "sum", "partial", "error")
"""Algorithm 2's ways of combining the global sparse gradient with the local one (``mode=``)."""
SCOPES = ("global", "leaf")
EXCHANGES = ("auto", "sparse", "dense")

DropRatio = float | Callable[[jax.Array], jax.Array]


# --------------------------------------------------------------------------- #
# Drop-ratio schedules
# --------------------------------------------------------------------------- #
def _check_drop_ratio(value, name: str) -> float:
    value = check_finite_scalar(value, name)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1) (the fraction of entries dropped); got {value}")
    return value


@dataclasses.dataclass(frozen=True)
class DropRatioSchedule:
    """A drop-ratio schedule ``count -> R_t`` (float32 scalar, jit-compatible) that knows its final ratio.

    ``final_drop_ratio`` lets :func:`gradient_dropping` switch to the sparse
    exchange of a fixed ``K`` once the warm-up is over.
    """

    schedule: Callable[[jax.Array], jax.Array]
    final_drop_ratio: float

    def __call__(self, count) -> jax.Array:
        return self.schedule(count)


def drop_ratio_warmup(drop_ratio: float = 0.99, warmup_steps: int = 1000) -> DropRatioSchedule:
    """Drop-ratio warm-up ``R_t = R^max(1, T/t)`` (Sec. 5.1 of the local-gradients paper).

    The paper uses ``R = 0.99`` and ``T = 1000``: ``R_1 = 0.99^1000 ≈ 4.3e-5``
    (almost everything is sent), ``R_{T/2} = 0.99² = 0.9801`` and ``R_t = 0.99``
    from ``t = T`` on. The schedule follows optax's convention: it takes the
    number of updates already applied, ``count = t - 1`` (0-based), so the
    paper's 1-based step is ``t = count + 1``.

    Args:
      drop_ratio: final fraction ``R`` of entries dropped, in ``[0, 1)``.
      warmup_steps: warm-up length ``T`` in steps, an integer ``>= 1``.
    Returns:
      ``schedule(count) -> R_t``, a float32 scalar, jit-compatible. Its
      ``final_drop_ratio`` attribute (``R``) lets :func:`gradient_dropping`
      switch to the sparse exchange once the warm-up is over.
    Raises:
      ValueError: ``warmup_steps < 1`` or ``drop_ratio`` outside ``[0, 1)``.
    """
    drop_ratio = _check_drop_ratio(drop_ratio, "drop_ratio")
    warmup_steps = check_int(warmup_steps, "warmup_steps", minimum=1)

    # R^e = exp(e·ln R) with ln R taken in float64: float32(0.99)^1000 would be off by 1e-5 (relative).
    log_ratio = math.log(drop_ratio) if drop_ratio > 0 else -math.inf

    def schedule(count):
        t = jnp.asarray(count, jnp.float32) + 1.0
        exponent = jnp.maximum(1.0, warmup_steps / t)
        return jnp.exp(exponent * jnp.float32(log_ratio))

    return DropRatioSchedule(schedule, drop_ratio)


def dgc_warmup(
    final_drop_ratio: float = 0.999, steps_per_stage: int = 1000, initial_drop_ratio: float = 0.75
) -> DropRatioSchedule:
    """Deep Gradient Compression's exponential sparsity warm-up (Lin et al. 2018, Sec. 3.4).

    The kept density shrinks by the factor ``1 - initial_drop_ratio`` at every
    stage of ``steps_per_stage`` steps until the final ratio is reached:

        R(count) = min(final, 1 - (1 - initial)^(stage + 1)),  stage = count // steps_per_stage

    With the defaults: 75%, 93.75%, 98.4375%, 99.61%, then 99.9% (DGC's
    "75% ... 99.9% in the first four epochs" with one stage per epoch).

    Args:
      final_drop_ratio: ratio after warm-up, in ``[0, 1)``.
      steps_per_stage: steps per stage, integer ``>= 1``.
      initial_drop_ratio: ratio of the first stage, in ``[0, 1)``.
    Returns:
      ``schedule(count) -> R`` (float32 scalar), jit-compatible, with the
      attribute ``final_drop_ratio`` (see :func:`drop_ratio_warmup`).
    """
    final_drop_ratio = _check_drop_ratio(final_drop_ratio, "final_drop_ratio")
    initial_drop_ratio = _check_drop_ratio(initial_drop_ratio, "initial_drop_ratio")
    steps_per_stage = check_int(steps_per_stage, "steps_per_stage", minimum=1)
    if initial_drop_ratio > final_drop_ratio:
        raise ValueError(
            f"initial_drop_ratio ({initial_drop_ratio}) must not exceed final_drop_ratio ({final_drop_ratio})"
        )

    def schedule(count):
        stage = jnp.asarray(count, jnp.int32) // steps_per_stage
        return jnp.minimum(jnp.float32(final_drop_ratio), 1.0 - dgc_density(initial_drop_ratio, stage))

    return DropRatioSchedule(schedule, final_drop_ratio)


def dgc_density(initial_drop_ratio: float, stage):
    """DGC's kept density at warm-up stage ``stage`` (0-based): ``(1 - initial_drop_ratio)^(stage + 1)``.

    The one formula behind :func:`dgc_warmup` (a traced ``stage``: float32 scalar) and
    :func:`~jaxcomm.transforms.topk_warmup` (a Python ``int``: Python float, float64).
    """
    if isinstance(stage, (int, np.integer)):
        return (1.0 - initial_drop_ratio) ** (int(stage) + 1)
    return jnp.power(jnp.float32(1.0 - initial_drop_ratio), jnp.asarray(stage).astype(jnp.float32) + 1.0)


def num_kept(drop_ratio, size: int):
    """Entries kept out of ``size`` at drop ratio ``R``: ``K = clip(round((1 - R)·size), 1, size)``.

    Rounding is half-to-even. A Python float gives a Python ``int`` (computed in
    float64); a traced ratio gives an int32 scalar (computed in float32).
    """
    if isinstance(drop_ratio, (int, float, np.floating)):
        return int(min(size, max(1, round((1.0 - float(drop_ratio)) * size))))
    kept = jnp.round((1.0 - jnp.asarray(drop_ratio, jnp.float32)) * size).astype(jnp.int32)
    return jnp.clip(kept, 1, size)


# --------------------------------------------------------------------------- #
# Gradient dropping with local gradients
# --------------------------------------------------------------------------- #
def gradient_dropping(
    drop_ratio: DropRatio = 0.99,
    *,
    mode: str = "partial",
    axis_name: str | None = None,
    comm=None,
    clip_norm: float | None = None,
    scope: str = "global",
    exchange: str = "auto",
    skip_nonfinite: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """Gradient dropping (Algorithm 1) combined with the local gradient (Algorithm 2).

    Long because an optax factory's closures share the validated hyper-parameters; each inner function is short.

    Each worker n adds its local gradient ``L^n_t`` to its residual ``E^n``,
    keeps the ``K`` largest magnitudes (``S^n_t``), sums them over workers
    (``G_t``) and emits the combined gradient ``C^n_t`` of Algorithm 2 for the
    optimizer that follows (the paper uses Adam). ``G_t`` is a *sum*, exactly
    as the paper's AllReduce; with plain SGD, scale the learning rate by 1/N.

    The combined gradients differ between workers in modes ``"sum"``,
    ``"partial"`` and ``"error"``, so parameters drift apart: end the chain
    with :func:`periodic_average`.

    Selection: ``K_t = num_kept(R_t, d)`` over the ``d`` entries of a group
    (``scope="global"``: the whole gradient tree, as Algorithm 2's single
    vector; ``scope="leaf"``: each array separately). The dense exchange uses
    Algorithm 2's rule literally (``mask = |E| ≥ K-th largest |E|``, ties all
    kept). The sparse exchange sends exactly ``K`` (value, index) pairs chosen
    by ``jax.lax.top_k`` (ties broken by lower flat index); the two coincide
    whenever the K-th and (K+1)-th magnitudes differ.

    Args:
      drop_ratio: fraction ``R`` of entries dropped, in ``[0, 1)``, or a
        schedule ``count -> R_t`` such as :func:`drop_ratio_warmup` or
        :func:`dgc_warmup` (``count`` = steps already taken).
      mode: ``"sum"`` (C = (G + L)/2), ``"partial"`` (C = G − S + L),
        ``"error"`` (C = G + E, then E ← 0), or ``"none"`` for vanilla gradient
        dropping (Algorithm 1: C = G).
      axis_name: mesh axis to communicate over (inside ``shard_map``/``vmap``).
      comm: a :class:`~jaxcomm.comm.Communicator` instead (e.g. MPI). With
        neither, the ambient communicator of :func:`jaxcomm.comm.use`.
      clip_norm: DGC's local gradient clipping: before accumulation, ``L^n`` is
        rescaled to global norm at most ``clip_norm / sqrt(N)`` (DGC Sec. 3.3);
        the clipped gradient is also the local term of SUM/PARTIAL. ``None``
        (default) disables it.
      scope: ``"global"`` (one threshold over the whole tree) or ``"leaf"``.
      exchange: ``"sparse"`` (all-gather of ``K`` values and narrow indices per
        worker; needs a fixed ``drop_ratio`` so that ``K`` is static),
        ``"dense"`` (all-reduce of the masked dense tensor), or ``"auto"``:
        sparse for a fixed ratio; for a schedule, dense while ``K_t`` is above
        the final ``K`` and sparse from then on, when the schedule has a
        ``final_drop_ratio`` attribute (as :func:`drop_ratio_warmup` and
        :func:`dgc_warmup` do; warm-up starts almost dense, where a sparse
        payload would cost more than the dense one), dense throughout
        otherwise. The switch is a ``lax.cond`` on the step count, which is
        the same on every worker, so all take the same branch; its sparse
        branch sends a fixed capacity ``K_cap`` (the final ``K``) of
        (value, index) pairs, zero-padded when ``K_t < K_cap``. ``wire_bits``
        records the branch actually taken.
      skip_nonfinite: when some worker's local gradient has a NaN or Inf, every worker
        skips the step (one extra int32 all-reduce per step): ``C`` is zeros on every
        worker, the residuals ``E`` and the step count stay as they were, and
        ``state.notfinite_count`` counts the step. ``False`` (default): the step runs as
        it is and ``E`` keeps the non-finite entries that were not sent (see
        :func:`~jaxcomm.transforms.compressed_mean`).

    Returns:
      An optax transformation; its state is a :class:`~jaxcomm.transforms.CompressionState`
      (per worker). ``update(grads, state, params=None)`` maps each worker's
      local gradients to its ``C^n_t``.

    Raises:
      ValueError: bad ``mode``/``scope``/``exchange``, ``drop_ratio`` outside
        ``[0, 1)``, non-positive ``clip_norm``, ``exchange="sparse"`` with a
        schedule, or updates whose tree differs from the one ``init`` saw.
      TypeError: ``skip_nonfinite`` not a bool.
    """
    check_choice(mode, "mode", COMBINATIONS)
    check_choice(scope, "scope", SCOPES)
    check_choice(exchange, "exchange", EXCHANGES)
    scheduled = callable(drop_ratio)
    if not scheduled:
        drop_ratio = _check_drop_ratio(drop_ratio, "drop_ratio")
    final_ratio = None
    if exchange == "auto":
        final_ratio = getattr(drop_ratio, "final_drop_ratio", None) if scheduled else None
        exchange = "switch" if final_ratio is not None else ("dense" if scheduled else "sparse")
    if exchange == "sparse" and scheduled:
        raise ValueError(
            "exchange='sparse' needs a fixed drop_ratio (the payload size K must be static under jit); "
            "use exchange='dense' with a drop-ratio schedule"
        )
    if clip_norm is not None:
        clip_norm = check_finite_scalar(clip_norm, "clip_norm", positive=True)
    skip = check_skip_nonfinite(skip_nonfinite)
    communicator = resolve(axis_name=axis_name, comm=comm)
    memory = memory_lib.residual()  # E <- E + L;  E <- E - S

    def init(params):
        for leaf in jax.tree.leaves(params):
            if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
                raise TypeError(f"params must be floating point; got a leaf of dtype {jnp.result_type(leaf)}")
        # The selections keep no per-tensor state; the key feeds top-k's sampled threshold.
        return init_state(params, _threshold_rule(1), memory, scope=scope)

    def update(updates, state, params=None, **extra_args):
        del params, extra_args
        if not isinstance(state, CompressionState):
            raise TypeError(f"state must be a CompressionState (from init); got {type(state).__name__}")
        leaves, treedef = jax.tree.flatten(updates)
        res_leaves, res_def = jax.tree.flatten(state.memory)
        if treedef != res_def:
            raise ValueError(
                f"updates tree {treedef} does not match the tree gradient_dropping was initialised with {res_def}"
            )
        for g, e in zip(leaves, res_leaves):
            if jnp.shape(g) != jnp.shape(e):
                raise ValueError(f"updates leaf of shape {jnp.shape(g)} does not match the state's {jnp.shape(e)}")
        return if_finite(communicator, updates, state, step, skip=skip)

    def step(updates, state):
        leaves, treedef = jax.tree.flatten(updates)
        n = communicator.size

        if clip_norm is not None:
            # DGC Sec. 3.3: clip locally, threshold scaled by N^{-1/2}.
            leaves = clip_leaves(leaves, clip_norm, n)
            updates = treedef.unflatten(leaves)

        ratio = drop_ratio(state.count) if callable(drop_ratio) else drop_ratio

        def run(selection, strategy):
            """One exchange: Algorithm 2's lines 3-8 on the pipeline, then the combination C."""
            done = compress_step(
                communicator, updates, state, compressor=selection, memory=memory, strategy=strategy, scope=scope
            )
            combined, residual = [], treedef.flatten_up_to(done.state.memory)
            for idx, payload, total in zip(done.groups, done.payloads, done.totals):
                L = group_vector(leaves, idx)
                dtype = jnp.result_type(L)
                S = selection(L).decompress(payload).astype(dtype)  # this worker's sent entries, mask ⊙ E
                G = total.astype(dtype)  # line 8: G = AllReduce(S), a sum over workers
                if mode == "none":
                    C = G
                elif mode == "sum":
                    C = (G + L) / 2
                elif mode == "partial":
                    C = G - S + L
                else:  # "error": C = G + E, then E <- 0
                    C = G + group_vector(residual, idx)
                combined.append(ungroup(C, leaves, idx))
            if mode == "error":
                residual = [jnp.zeros_like(e) for e in residual]
            outs = [None] * len(leaves)
            for part in combined:
                for i, c in part.items():
                    outs[i] = c
            return outs, done.state._replace(memory=treedef.unflatten(residual))

        if exchange == "sparse":
            outs, new_state = run(lambda phi: _topk(float(ratio), phi), "allgather")
        elif exchange == "dense":
            outs, new_state = run(lambda phi: _threshold_rule(num_kept(ratio, int(np.size(phi)))), "allreduce")
        else:  # switch: dense while some K_t exceeds the final K, then a fixed capacity of K_cap pairs
            sizes = [int(np.size(group_vector(leaves, idx))) for idx in groups_of(len(leaves), scope)]
            assert final_ratio is not None  # the switch is chosen only for schedules that know it
            caps = [_sparse_capacity(final_ratio, drop_ratio, d) for d in sizes]
            use_sparse = jnp.all(jnp.stack([jnp.asarray(num_kept(ratio, d) <= c) for d, c in zip(sizes, caps)]))
            cap_of = dict(zip(sizes, caps))

            def sparse(_):
                return run(
                    lambda phi: _capacity_topk(num_kept(ratio, int(np.size(phi))), cap_of[int(np.size(phi))]),
                    "allgather",
                )

            def dense(_):
                return run(lambda phi: _threshold_rule(num_kept(ratio, int(np.size(phi)))), "allreduce")

            outs, new_state = typed_cond(use_sparse, sparse, dense)
        return treedef.unflatten(outs), new_state

    return optax.GradientTransformationExtraArgs(init, update)


def _topk(drop_ratio: float, phi) -> Compressor:
    """The catalogue's exact top-k with ``K = num_kept(R, d)`` (``ratio = K/d`` selects exactly ``K``)."""
    d = int(np.size(phi))
    return topk(ratio=num_kept(drop_ratio, d) / d)


def _threshold_rule(k) -> Compressor:
    """Algorithm 2's dense exchange: ``mask = |E| >= K-th largest |E|`` (ties all kept), sent dense.

    ``k`` may be traced (a drop-ratio schedule). The payload is the masked
    tensor ``S = mask ⊙ E``, summable (an all-reduce gives ``G``).
    """

    def compress(x, key, state):
        del key
        flat = jnp.ravel(x)
        magnitude = jnp.abs(flat)
        threshold = jnp.sort(magnitude)[flat.shape[0] - k]  # line 4: K-th largest |E|
        selected = jnp.where(magnitude >= threshold, flat, jnp.zeros_like(flat))  # lines 5-6
        return DensePayload(data=selected.reshape(jnp.shape(x)), dtype=x.dtype), state

    return Compressor(
        name="threshold_rule", compress_fn=compress, decompress_fn=_dense_data, unbiased=False, strategy="allreduce"
    )


def _dense_data(payload):
    return payload.data.astype(payload.dtype)


def _capacity_topk(k, cap: int) -> Compressor:
    """The ``K_t <= cap`` largest magnitudes in a fixed buffer of ``cap`` (value, index) pairs.

    ``jax.lax.top_k`` orders the pairs by magnitude (ties: lower index), so the
    first ``K_t`` slots are the selection and the rest are sent as zeros.
    """

    def compress(x, key, state):
        del key
        flat = jnp.ravel(x)
        d = flat.shape[0]
        _, index = jax.lax.top_k(jnp.abs(flat), cap)
        values = jnp.where(jnp.arange(cap) < k, flat[index], jnp.zeros((), flat.dtype))  # K_t of K_cap slots
        return SparsePayload(
            values=values, indices=index.astype(index_dtype(d)), shape=tuple(jnp.shape(x)), dtype=x.dtype
        ), state

    base = topk(ratio=1.0)
    return dataclasses.replace(
        base,
        name="capacity_topk",
        compress_fn=compress,
        params={"capacity": cap},
        contraction=None,  # not top-k(ratio=1)'s δ = 1: K_t may be 0
        bound="no bound declared: sends the K_t <= capacity largest entries, K_t possibly 0 (non-expansive)",
    )


def _sparse_capacity(final_ratio: float, schedule, d: int) -> int:
    """The final ``K`` of a schedule for ``d`` entries, as the traced ``num_kept`` computes it.

    ``num_kept`` of a traced ratio rounds in float32; the schedule's own float32
    value late in training is what the step sees. Taking the larger of that and
    the float64 count makes ``K_t <= K_cap`` hold once the warm-up is over even
    where the two roundings differ by one entry.
    """
    with jax.ensure_compile_time_eval():  # concrete even while the step is being traced
        late = int(num_kept(jnp.asarray(schedule(jnp.int32(2**30)), jnp.float32), d))
    return max(num_kept(final_ratio, d), late)


# --------------------------------------------------------------------------- #
# Periodic parameter averaging
# --------------------------------------------------------------------------- #
class PeriodicAverageState(NamedTuple):
    """State of :func:`periodic_average`.

    Attributes:
      count: int32 scalar, steps taken (identical on every worker).
      wire_bits: :class:`~jaxcomm.BitCount` of shape ``(num_leaves,)``, bits this
        worker contributed per parameter leaf in the last step (the leaf's size on
        a synchronisation step, else 0).
      messages: int32 scalar, collectives in the last step (1 or 0).
    """

    count: jax.Array  # type: ignore[assignment]  # optax's name for the step count; shadows tuple.count
    wire_bits: BitCount
    messages: jax.Array


def average_params(params, *, axis_name: str | None = None, comm=None):
    """The workers' mean of ``params`` (one all-reduce), for trainers that sync explicitly.

    Args:
      params: this worker's parameters (pytree of float arrays).
      axis_name / comm: as in :func:`gradient_dropping`.
    Returns:
      ``(1/N) Σ_n params^n``, identical on every worker.
    """
    return resolve(axis_name=axis_name, comm=comm).mean(params)


def periodic_average(
    every: int = 500, *, axis_name: str | None = None, comm=None
) -> optax.GradientTransformationExtraArgs:
    """Average the parameters across workers every ``every`` steps (the paper's "sync").

    Put it last in the chain, after the optimizer: it sees the optimizer's
    update ``u^n`` and the current parameters ``x^n``. On steps where the
    count of updates (this one included) is a multiple of ``every`` it returns

        u'^n = (1/N) Σ_m (x^m + u^m) − x^n,

    so ``optax.apply_updates`` moves every worker to the mean of the parameters
    it would have had (up to one float rounding of ``x^n + (mean − x^n)``);
    on the other steps ``u' = u`` and nothing is communicated (``lax.cond``).
    Only parameters are averaged; optimizer moments stay per worker, as in the
    paper.

    Args:
      every: synchronisation period in steps, integer ``>= 1`` (paper: 500).
      axis_name / comm: as in :func:`gradient_dropping`.
    Returns:
      An optax transformation with :class:`PeriodicAverageState`. ``update``
      requires ``params``.
    Raises:
      ValueError: ``every < 1``, or ``update`` called without ``params``.
    """
    every = check_int(every, "every", minimum=1)
    communicator = resolve(axis_name=axis_name, comm=comm)

    def init(params):
        return PeriodicAverageState(
            count=jnp.zeros((), jnp.int32),
            wire_bits=BitCount.zeros((len(jax.tree.leaves(params)),)),
            messages=jnp.zeros((), jnp.int32),
        )

    def update(updates, state, params=None, **extra_args):
        del extra_args
        if params is None:
            raise ValueError("periodic_average needs params: call update(updates, state, params)")
        if jax.tree.structure(updates) != jax.tree.structure(params):
            raise ValueError("periodic_average: updates and params must have the same tree structure")
        count = state.count + 1
        sync = count % every == 0
        # Inside shard_map both branches must agree on which axes each leaf varies over.
        axes = jax.tree.map(lambda u, p: varying_axes(u) | varying_axes(p), updates, params)

        def average(u):
            new = optax.apply_updates(params, u)
            mean = communicator.mean(new)
            return jax.tree.map(lambda m, p, a: cast_varying((m - p).astype(p.dtype), a), mean, params, axes)

        def keep(u):
            return jax.tree.map(cast_varying, u, axes)

        updates = jax.lax.cond(sync, average, keep, updates)
        sizes = [int(np.size(p)) * jnp.dtype(p.dtype).itemsize * 8 for p in jax.tree.leaves(params)]
        leaf_bits = BitCount.stack(sizes) if sizes else BitCount.zeros((0,))
        return updates, PeriodicAverageState(
            count=count,
            wire_bits=jax.tree.map(lambda w: jnp.where(sync, w, jnp.zeros_like(w)), leaf_bits),
            messages=sync.astype(jnp.int32),
        )

    return optax.GradientTransformationExtraArgs(init, update)
