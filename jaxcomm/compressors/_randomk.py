"""Random-k sparsification (Stich et al. 2018): ``k`` positions drawn from a key shared by every worker."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from .._validate import check_bool, check_ratio
from ._base import Compressor, Payload, payload_dataclass, register, static_field
from ._kernels.random_bits import bits_at, key_words
from ._kernels.scatter import scatter
from ._kernels.select import top_indices
from ._sparse import num_selected

Array = jax.Array


@payload_dataclass
class RandomKPayload(Payload):
    """Random-k payload: ``k`` values; positions are regenerated from ``key``.

    Attributes:
      values: ``(k,)`` the entries at the sampled positions, input dtype.
      key: the raw ``uint32[2]`` PRNG key that drew the positions.
      shape, dtype: original shape and dtype (static).
      scale: ``d / k`` if unbiased else ``1`` (static), applied on decompression.

    ``summable = ("values",)``: with a key shared by every worker the positions
    agree and the values add up. Wire bits (``Payload.wire_bits``): ``k *
    bits(dtype) + 64``; the 64 bits of the key are an upper bound: when the key
    is shared (``compressed_mean``'s allreduce) nobody sends it, and the
    transforms count only the summed ``values``.
    """

    values: Array
    key: Array
    shape: tuple = static_field()
    dtype: Any = static_field()
    scale: float = static_field()
    summable: ClassVar[tuple[str, ...]] = ("values",)


def _raw_key(key):
    if jnp.issubdtype(jnp.result_type(key), jax.dtypes.prng_key):
        return jax.random.key_data(key)
    return jnp.asarray(key, jnp.uint32)


def randomk_indices(key, d: int, k: int) -> Array:
    """The ``k`` positions random-k draws from ``key`` for a ``d``-element tensor (int32, index order).

    A uniformly random ``k``-subset, drawn as the positions of the ``k`` largest
    of ``d`` distinct pseudo-random words ``h(i)`` (:func:`~._kernels.random_bits.uniform_bits`, scheme ``"murmur3"``,
    31 high bits compared; ties, of probability ``~d / 2**31`` per draw, go to
    the lower index). Deterministic in ``key``: every worker holding the same
    key draws the same positions.
    """
    if k >= d:
        return jnp.arange(d, dtype=jnp.int32)
    words = key_words(key)
    # The selection runs on the counters i = 0..d-1 and hashes them inside each pass that
    # compares keys (keys_of is elementwise, so it fuses): the d words h(i) are never stored.
    idx, _ = top_indices(
        d,
        k,
        jax.random.fold_in(_raw_key(key), 1),
        keys_of=lambda i: (bits_at(words, i, "murmur3") >> 1).astype(jnp.int32),
    )
    return idx


def randomk_draws(key, d: int, k: int) -> Array:
    """``k`` positions drawn uniformly *with replacement* from ``key`` for a ``d``-element tensor (int32).

    ``jax.random.randint`` on the key folded with 2: ``k`` independent uniform
    draws in ``[0, d)``, repeats possible. Costs ``O(k)``, not ``O(d)``.
    """
    return jax.random.randint(jax.random.fold_in(_raw_key(key), 2), (k,), 0, d, dtype=jnp.int32)


def inclusion_probability(d: int, k: int, replacement: bool) -> float:
    """``P(position i is sent)``: ``k / d`` without replacement, ``1 − (1 − 1/d)^k`` with it."""
    if not replacement:
        return min(k, d) / d
    return -math.expm1(k * math.log1p(-1.0 / d)) if d > 1 else 1.0


@register("randomk")
def randomk(*, ratio: float, unbiased: bool = False, replacement: bool = False, seed: int = 0) -> Compressor:
    """Random-k sparsification (GRACE Table I; Stich et al. 2018).

    Sends ``k = max(1, round(ratio * d))`` entries at uniformly random positions
    without replacement (rounded half up). ``Q(x) = s * x (.) b`` with ``b`` the
    random mask and ``s = d / k`` if ``unbiased`` (then ``E[Q(x)] = x``, since
    each position is drawn with probability ``k / d``) else ``s = 1`` (biased,
    the form used with error feedback).

    With ``replacement=True`` the ``k`` positions are independent uniform draws
    (:func:`randomk_draws`, GRACE's own sampling: ``torch.randint``): ``O(k)``
    work instead of a selection over all ``d`` entries, but a position may be
    drawn twice (sent twice, written once), so fewer than ``k`` distinct entries
    arrive. Each position is sent with probability ``p = 1 − (1 − 1/d)^k``
    (slightly below ``k/d``); ``unbiased`` then scales by ``s = 1/p``, and the
    bounds become ``ω = 1/p − 1`` (unbiased) and ``δ = p`` (biased).

    Positions come from the key (:func:`randomk_indices`) and are *not* sent:
    the payload is the ``k`` values plus the key, and the receiver regenerates
    the positions. With a key shared by all workers (``compressed_mean`` passes
    the shared key to allreduce compressors) the payloads sum: strategy
    ``"allreduce"``, summable field ``values``.

    Wire bits: ``k * bits(dtype) + 64`` (the key counted although a shared key
    is never sent; the transforms count only the values). NaN/Inf are ordinary
    values: sent as they are when drawn.

    Args:
      ratio: fraction of entries sent, in (0, 1].
      unbiased: scale by ``d / k`` (``1/p`` with replacement) so that ``E[Q(x)] = x``.
      replacement: draw the positions with replacement (see above).
      seed: seed of the optax transformation's key.
    Raises:
      ValueError/TypeError: ``ratio`` outside (0, 1], ``unbiased`` or ``replacement`` not a bool.
    """
    ratio = check_ratio(ratio, "ratio", "it fixes the number of entries sent k, an array shape")
    unbiased = check_bool(unbiased, "unbiased")
    replacement = check_bool(replacement, "replacement")
    positions = randomk_draws if replacement else randomk_indices

    def compress(x, key, state):
        d = int(np.size(x))
        k = num_selected(ratio, d)
        raw = _raw_key(key)
        idx = positions(raw, d, k)
        vals = jnp.ravel(x)[idx]
        scale = 1.0 / inclusion_probability(d, k, replacement) if (unbiased and k > 0) else 1.0
        return RandomKPayload(values=vals, key=raw, shape=tuple(np.shape(x)), dtype=x.dtype, scale=scale), state

    def decompress(p: RandomKPayload):
        d = int(np.prod(p.shape, dtype=np.int64))
        idx = positions(p.key, d, p.values.shape[0])
        # distinct positions, or repeated ones carrying the same value: written, not added
        return scatter(p.values, idx, p.shape, p.dtype, p.scale, unique=not replacement, repeats=replacement)

    return Compressor(
        name="randomk",
        compress_fn=compress,
        decompress_fn=decompress,
        unbiased=unbiased,
        strategy="allreduce",
        seed=seed,
        params=dict(ratio=ratio, unbiased=unbiased, replacement=replacement),
        stochastic=True,
        **_bound(ratio, unbiased, replacement),
    )


def _bound(ratio: float, unbiased: bool, replacement: bool) -> dict:
    """Random-k's declared bound (``variance_factor`` or ``contraction``, and ``bound``, its source)."""
    if replacement:

        def prob(d: int) -> float:
            return inclusion_probability(d, num_selected(ratio, d), True)

        if unbiased:
            return dict(
                variance_factor=lambda d: 1.0 / prob(d) - 1.0,
                bound="k draws with replacement reach each position with probability p = 1 − (1 − 1/d)^k; "
                "Q = x ⊙ b / p is unbiased with E‖Q(x) − x‖² = (1/p − 1) ‖x‖², ω = 1/p − 1",
            )
        return dict(
            contraction=prob,
            bound="k draws with replacement reach each position with probability p = 1 − (1 − 1/d)^k: "
            "E‖x − C(x)‖² = (1 − p) ‖x‖², δ = p",
        )
    if unbiased:
        return dict(
            variance_factor=lambda d: d / num_selected(ratio, d) - 1.0,
            bound="Stich et al. 2018: (d/k) rand_k is unbiased with E‖Q(x) − x‖² = (d/k − 1) ‖x‖², ω = d/k − 1",
        )
    return dict(
        contraction=lambda d: num_selected(ratio, d) / d,
        bound="Stich et al. 2018, Lemma A.1: E‖x − rand_k(x)‖² = (1 − k/d) ‖x‖², δ = k/d",
    )
