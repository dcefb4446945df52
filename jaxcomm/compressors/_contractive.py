"""Rescaling an unbiased compressor into a contraction, so that error feedback can use it."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import jax.numpy as jnp

from ._base import Compressor

__all__ = ["contractive"]


def contractive(compressor: Compressor) -> Compressor:
    """``Q(x) / (1 + ω)``: an unbiased compressor with variance factor ω, scaled into a contraction.

    If ``E Q(x) = x`` and ``E‖Q(x) − x‖² ≤ ω ‖x‖²`` (``compressor.variance_factor``),
    then ``C(x) = Q(x) / (1 + ω)`` satisfies

        E‖C(x) − x‖² = ‖x‖² − 2‖x‖²/(1 + ω) + E‖Q(x)‖²/(1 + ω)² ≤ (1 − 1/(1 + ω)) ‖x‖²,

    a contraction with ``δ = 1/(1 + ω)`` (the standard rescaling, e.g. Stich &
    Karimireddy 2020), which error feedback needs. For random sparsification
    (keep ``x_i/p`` with probability ``p``, ``ω = 1/p − 1``) this is ``C(x) = p Q(x)``:
    the kept entries sent unscaled. ``ω`` is evaluated at each tensor's size ``d``.

    The payload, its wire bits and the strategy are the compressor's own: the
    scale is applied on decoding, after any sum of payloads (it is linear), so
    ``allreduce`` compressors stay summable.

    Args:
      compressor: an unbiased :class:`Compressor` with a declared ``variance_factor``.
    Returns:
      A biased :class:`Compressor` named ``"contractive"`` with ``contraction``
      ``d -> 1/(1 + ω(d))``; ``params["compressor"]`` is the wrapped one.
    Raises:
      TypeError: ``compressor`` is not a Compressor.
      ValueError: it declares no variance factor (a biased compressor, or an
        unbiased one without a declared ω), or it is multi-round (``rounds``).
    """
    if not isinstance(compressor, Compressor):
        raise TypeError(f"compressor must be a jaxcomm.compressors.Compressor; got {type(compressor).__name__}")
    if compressor.variance_factor is None:
        raise ValueError(
            f"contractive() rescales an unbiased compressor by 1/(1 + ω); {compressor!r} declares no variance "
            f"factor ω ({compressor.bound or 'no bound declared'})"
        )
    if compressor.rounds is not None:
        raise ValueError(f"contractive() does not wrap multi-round compressors; got {compressor!r}")
    omega = cast(Callable[[int], float], compressor.variance_factor)
    inner_sum = compressor.decompress_sum

    def scale_of(shape) -> float:
        d = 1
        for n in shape:
            d *= int(n)
        return 1.0 / (1.0 + float(omega(max(d, 1))))

    def decompress(payload):
        y = compressor.decompress(payload)
        return (y.astype(jnp.float32) * scale_of(y.shape)).astype(y.dtype)

    def decompress_sum(gathered, dtype):
        assert inner_sum is not None
        total = inner_sum(gathered, dtype)
        return (total.astype(jnp.float32) * scale_of(total.shape)).astype(total.dtype)

    return Compressor(
        name="contractive",
        compress_fn=compressor.compress_fn,
        decompress_fn=decompress,
        unbiased=False,
        strategy=compressor.strategy,
        init_state=compressor.init_state,
        decompress_sum=None if inner_sum is None else decompress_sum,
        seed=compressor.seed,
        params={"compressor": compressor},
        contraction=lambda d: 1.0 / (1.0 + float(omega(d))),
        bound=f"Q(x)/(1 + ω) with ω of {compressor!r}: δ = 1/(1 + ω) ({compressor.bound})",
        stochastic=compressor.stochastic,
    )
