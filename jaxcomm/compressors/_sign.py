"""The 1-bit family: 1-bit SGD, signSGD, SIGNUM, EF-signSGD (GRACE Sec. III-A).

Each entry is sent as one bit, packed eight to a byte with
:func:`~jaxcomm.compressors.pack` (GRACE sends a byte per sign), plus at most
two float32 scalars:

=============  ==================================  ========================
name           payload                             wire bits (d entries)
=============  ==================================  ========================
``onebit``     packed bits x_i >= tau + 2 means    ``8 ceil(d/8) + 64``
``signsgd``    packed sign bits                    ``8 ceil(d/8)``
``signum``     packed sign bits of the momentum    ``8 ceil(d/8)``
``efsignsgd``  packed sign bits + mean |x|         ``8 ceil(d/8) + 32``
=============  ==================================  ========================

Sign convention: bit 1 means ``x_i < 0`` (decoded -1); zero, -0 and NaN are
decoded +1. Error feedback (Seide et al.'s and Karimireddy et al.'s memories)
is not part of the operators; compose them with ``jaxcomm.memory``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .._validate import check_finite_scalar
from ._base import Compressor, Payload, payload_dataclass, register, static_field
from ._kernels.bitpack import pack, pack_reduce, packed_size, popcount, unpack
from ._primitives import flat32, restore, size_of
from ._quantize import jitted_compressor, nan_unless_finite

__all__ = [
    "onebit",
    "signsgd",
    "signum",
    "efsignsgd",
    "SignPayload",
    "MeanAbsSignPayload",
    "OneBitPayload",
    "SignumState",
]

Array = jax.Array


def _signs(bits, shape):
    """Packed bits -> float32 +-1 vector (bit 1 -> -1)."""
    return 1.0 - 2.0 * unpack(bits, 1, size_of(shape)).astype(jnp.float32)


@payload_dataclass
class SignPayload(Payload):
    """Packed sign bits.

    Attributes:
      signs: uint8 ``(ceil(d/8),)``; bit ``i`` (little-endian within a byte) is
        1 iff entry ``i`` is negative.
      shape, dtype: static.
    """

    signs: Array
    shape: tuple = static_field()
    dtype: Any = static_field()

    def wire_bits(self) -> int:
        """``8 ceil(d/8)``."""
        return 8 * packed_size(size_of(self.shape), 1)


@payload_dataclass
class MeanAbsSignPayload(Payload):
    """Packed sign bits and the mean absolute value (EF-signSGD).

    Attributes:
      signs: uint8 ``(ceil(d/8),)`` as in :class:`SignPayload`.
      scale: float32 scalar ``||x||_1 / d``.
      shape, dtype: static.
    """

    signs: Array
    scale: Array
    shape: tuple = static_field()
    dtype: Any = static_field()

    def wire_bits(self) -> int:
        """``8 ceil(d/8) + 32``."""
        return 8 * packed_size(size_of(self.shape), 1) + 32


@payload_dataclass
class OneBitPayload(Payload):
    """1-bit SGD: packed threshold bits and the two reconstruction values.

    Attributes:
      bits: uint8 ``(ceil(d/8),)``; bit ``i`` is 1 iff ``x_i >= tau``.
      mean_low: float32 scalar, mean of the entries with ``x_i < tau`` (0 if none).
      mean_high: float32 scalar, mean of the entries with ``x_i >= tau`` (0 if none).
      shape, dtype: static.
    """

    bits: Array
    mean_low: Array
    mean_high: Array
    shape: tuple = static_field()
    dtype: Any = static_field()

    def wire_bits(self) -> int:
        """``8 ceil(d/8) + 64``."""
        return 8 * packed_size(size_of(self.shape), 1) + 64


@register("onebit")
def onebit(*, threshold: float = 0.0, seed: int = 0) -> Compressor:
    """1-bit SGD quantization (Seide et al. 2014; GRACE Sec. III-A).

    ``b_i = [x_i >= tau]`` (GRACE: entries below ``tau`` become '0', all others
    '1'); the receiver decodes '0' to the mean of the entries below ``tau`` and
    '1' to the mean of the others, ``Q(x)_i = b_i mu_1 + (1 - b_i) mu_0``, which
    preserves the sum of ``x``. Deterministic, biased. Seide et al.'s error
    feedback is separate (``jaxcomm.memory``).

    Args:
      threshold: tau, a finite real number (default 0); may be traced
        (``optax.inject_hyperparams``), then computed in float32 and unchecked.
    Wire bits: ``8 ceil(d/8) + 64``. Non-finite input: the whole tensor decodes
    to NaN (the means are computed without overflow, so finite input gives
    finite means). NaN entries are coded '0'.
    """
    threshold = check_finite_scalar(threshold, "threshold", traceable=True)

    def compress(x, key, state):
        del key
        xf = flat32(x)
        high = xf >= threshold

        # The bits, sum_high and sum(x) in one pass (pack_reduce), then a popcount of the
        # packed bits. mu_0 uses sum(x) - sum_high: its rounding error is ~eps * sum|x|
        # instead of ~eps * sum_low |x|, which matters only when the entries below tau
        # carry a tiny part of the mass.
        def bits_and_sums(f):  # f a power of two: the sums of x * f are exact rescalings
            xs = xf * f
            return pack_reduce(high, (jnp.where(high, xs, 0.0), xs), ("sum", "sum"))

        bits, (s_high, s_all) = bits_and_sums(jnp.float32(1.0))
        n_high = jnp.sum(popcount(bits)).astype(jnp.float32)
        n_low = jnp.float32(xf.size) - n_high

        def means(s_high, s_all, f):
            return (s_all - s_high) / jnp.maximum(n_low, 1.0) / f, s_high / jnp.maximum(n_high, 1.0) / f

        # Sums that overflow (finite entries near the float32 maximum) are redone at 2^-64, by the
        # same one-pass kernel (the bits it recomputes are the same).
        ok = jnp.all(jnp.isfinite(jnp.stack(means(s_high, s_all, jnp.float32(1.0)))))
        f, bits, (s_high, s_all) = jax.lax.cond(
            ok,
            lambda: (jnp.float32(1.0), bits, (s_high, s_all)),
            lambda: (jnp.float32(2.0**-64), *bits_and_sums(jnp.float32(2.0**-64))),
        )
        mean_low, mean_high = means(s_high, s_all, f)
        payload = OneBitPayload(
            bits=bits,
            mean_low=mean_low,
            mean_high=mean_high,
            shape=x.shape,
            dtype=x.dtype,
        )
        return payload, state

    def decompress(p: OneBitPayload):
        high = unpack(p.bits, 1, size_of(p.shape)) == 1
        y = jnp.where(high, p.mean_high, p.mean_low)
        y = jnp.where(jnp.isfinite(p.mean_low) & jnp.isfinite(p.mean_high), y, jnp.nan)
        return restore(y, p.shape, p.dtype)

    return _sign_compressor("onebit", compress, decompress, seed, dict(threshold=threshold), **_onebit_bound(threshold))


def _sign_compressor(name: str, compress, decompress, seed: int, params: dict, **facts) -> Compressor:
    """A sign-based compressor: biased and deterministic (``facts``: its declared bound, its state)."""
    return jitted_compressor(
        name, compress, decompress, unbiased=False, seed=seed, params=params, stochastic=False, **facts
    )


def _onebit_bound(threshold) -> dict:
    """1-bit SGD's declared contraction and its source (a traced ``threshold`` may be non-zero)."""
    if isinstance(threshold, jax.core.Tracer) or threshold != 0.0:
        return dict(
            contraction=0.0,
            bound=(
                "1-bit SGD with a threshold τ ≠ 0 decodes to the means of the two groups split at τ: the orthogonal "
                "projection onto the two group indicators, non-expansive (δ = 0) but with no uniform δ > 0 (both "
                "groups can share a sign)"
            ),
        )
    return dict(
        contraction=lambda d: 1.0 / d,
        bound=(
            "group means (Seide et al. 2014) with τ = 0: ‖x − Q(x)‖² = ‖x‖² − S₊²/n₊ − S₋²/n₋ ≤ ‖x‖² − ‖x‖₁²/d "
            "(Cauchy-Schwarz), δ ≥ 1/d"
        ),
    )


@register("signsgd")
def signsgd(*, seed: int = 0) -> Compressor:
    """signSGD: send ``sign(x)`` (Bernstein et al. 2018; GRACE Sec. III-A).

    ``Q(x)_i = -1`` if ``x_i < 0`` else ``+1`` (zero and NaN map to +1, +-Inf to
    +-1). The magnitude is dropped; the learning rate carries it. Biased.

    Wire bits: ``8 ceil(d/8)``.
    """

    def compress(x, key, state):
        del key
        return SignPayload(signs=pack(flat32(x) < 0, 1), shape=x.shape, dtype=x.dtype), state

    def decompress(p: SignPayload):
        return restore(_signs(p.signs, p.shape), p.shape, p.dtype)

    why = (
        "sign(x) has no scale, so ‖Q(x) − x‖ is not bounded by any multiple of ‖x‖ (a small x is sent as ±1); "
        "jaxcomm.compressors.efsignsgd() sends (‖x‖₁/d) sign(x), a contraction with δ ≥ 1/d"
    )
    return _sign_compressor("signsgd", compress, decompress, seed, {}, no_contraction=why)


class SignumState(NamedTuple):
    """Per-array SIGNUM state.

    Attributes:
      momentum: float32 array of the gradient's shape, ``m_t``.
    """

    momentum: Array


@register("signum")
def signum(*, momentum: float = 0.9, seed: int = 0) -> Compressor:
    """SIGNUM: the sign of a momentum (Bernstein et al. 2018; GRACE Sec. III-A).

    ``m_t = beta m_(t-1) + (1 - beta) g_t`` (kept per array in
    :class:`SignumState`, float32, ``m_0 = 0``), ``Q_t = sign(m_t)`` with the
    convention of :func:`signsgd`. Biased; stateful: pass the state returned by
    ``compress`` to the next call (the optax ``update`` does).

    Args:
      momentum: beta in ``[0, 1)``; ``beta = 0`` is signSGD. May be traced
        (``optax.inject_hyperparams``), then computed in float32 and unchecked.
    Wire bits: ``8 ceil(d/8)``. Non-finite input: a NaN gradient entry makes
    that momentum entry NaN for good (decoded +1); +-Inf makes it +-Inf (decoded
    +-1) until an opposite Inf makes it NaN.
    """
    beta = check_finite_scalar(momentum, "momentum", nonnegative=True, traceable=True)
    if isinstance(beta, float) and beta >= 1.0:  # a traced beta is not checked
        raise ValueError(f"momentum must be in [0, 1); got {beta}")

    def init_state(x):
        return SignumState(momentum=jnp.zeros(jnp.shape(x), jnp.float32))

    def compress(x, key, state):
        del key
        m = beta * state.momentum + (1.0 - beta) * x.astype(jnp.float32)
        return SignPayload(signs=pack(jnp.ravel(m) < 0, 1), shape=x.shape, dtype=x.dtype), SignumState(m)

    def decompress(p: SignPayload):
        return restore(_signs(p.signs, p.shape), p.shape, p.dtype)

    why = (
        "the sign of the momentum has no scale, so ‖Q(x) − x‖ is not bounded by any multiple of ‖x‖; "
        "jaxcomm.compressors.efsignsgd() sends (‖x‖₁/d) sign(x), a contraction with δ ≥ 1/d"
    )
    params = dict(momentum=beta)
    return _sign_compressor("signum", compress, decompress, seed, params, init_state=init_state, no_contraction=why)


@register("efsignsgd")
def efsignsgd(*, seed: int = 0) -> Compressor:
    """EF-signSGD's scaled sign compressor (Karimireddy et al. 2019; GRACE Sec. III-A).

    ``Q(x) = (||x||_1 / d) sign(x)`` (sign convention of :func:`signsgd`): a
    delta-compressor with ``delta = ||x||_1^2 / (d ||x||_2^2)``, made convergent
    by error feedback (``jaxcomm.memory``). Biased.

    Wire bits: ``8 ceil(d/8) + 32``. Non-finite input: the scale is not finite
    and the whole tensor decodes to NaN. The mean is computed without overflow
    (:func:`~._quantize.mean_of`): finite for finite input.
    """

    def compress(x, key, state):
        del key
        xf = flat32(x)
        n = max(xf.size, 1)

        def signs_and_l1(f):  # the signs and sum |x| * f in one pass (f a power of two: exact)
            signs, (l1,) = pack_reduce(xf < 0, (jnp.abs(xf) * f,), ("sum",))
            return signs, l1

        signs, l1 = signs_and_l1(jnp.float32(1.0))
        # A sum that overflows (finite entries near the float32 maximum) is redone at 2^-64, by the
        # same one-pass kernel (the signs it recomputes are the same).
        f, signs, l1 = jax.lax.cond(
            jnp.isfinite(l1),
            lambda: (jnp.float32(1.0), signs, l1),
            lambda: (jnp.float32(2.0**-64), *signs_and_l1(jnp.float32(2.0**-64))),
        )
        scale = l1 / n / f
        return MeanAbsSignPayload(signs=signs, scale=scale, shape=x.shape, dtype=x.dtype), state

    def decompress(p: MeanAbsSignPayload):
        y = _signs(p.signs, p.shape) * p.scale
        return restore(nan_unless_finite(y, p.scale), p.shape, p.dtype)

    return _sign_compressor(
        "efsignsgd",
        compress,
        decompress,
        seed,
        {},
        contraction=lambda d: 1.0 / d,
        bound=(
            "Karimireddy et al. 2019, Lemma 8: Q(x) = (‖x‖₁/d) sign(x) has ‖Q(x) − x‖² = (1 − ‖x‖₁²/(d‖x‖²)) ‖x‖², "
            "δ ≥ 1/d"
        ),
    )
