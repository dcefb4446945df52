"""Norm-preserving 1-bit compressor: DoubleSqueeze's ``‖v‖₂/‖sign(v)‖₂ · sign(v)``.

Tang et al. (2019), "DoubleSqueeze", Sec. 5 (1-bit compression): a vector is
sent as its signs plus one scale, the ratio of the magnitude of the
(compensated) input to the magnitude of its sign vector,

    Q(v) = (‖v‖₂ / ‖sign(v)‖₂) · sign(v).

With one bit per entry the sign of a zero is sent as ``+1`` (as DeepSpeed's
1-bit Adam does), so every entry of ``sign(v)`` is ``±1``, ``‖sign(v)‖₂ = √d``
and the scale is the root mean square of ``v``. Consequently
``‖Q(v)‖₂ = ‖v‖₂`` exactly: the compressor preserves the norm and biases only
the direction, which is why it needs error feedback (DoubleSqueeze, MEM-SGD).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from ._base import Compressor, Payload, payload_dataclass, register, static_field
from ._kernels.bitpack import pack_reduce, unpack

__all__ = ["scaled_sign", "ScaledSignPayload"]


@payload_dataclass
class ScaledSignPayload(Payload):
    """Packed signs and one float32 scale.

    Attributes:
      bits: ``uint8[ceil(d/8)]``, bit ``i`` is 1 where ``v_i < 0`` (sign ``-1``).
      scale: float32 scalar ``‖v‖₂ / √d``.
      shape: the tensor's shape (static, not sent).
      dtype: the tensor's dtype (static, not sent).

    Wire bits: ``8·ceil(d/8) + 32``.
    """

    bits: jax.Array
    scale: jax.Array
    shape: tuple = static_field()
    dtype: Any = static_field()
    # A sum of two scaled sign vectors is not a scaled sign vector.
    summable: ClassVar[tuple[str, ...]] = ()


def _pow2(k):
    """``2**k`` as float32, exactly, for integer ``k`` in ``[-126, 127]`` (built from its exponent bits)."""
    return jax.lax.bitcast_convert_type(((k + 127).astype(jnp.uint32) << 23), jnp.float32)


def _rms(xf, m=None):
    """``‖x‖₂ / √d`` of a float32 vector, safe over the whole float32 range (``m``: ``max|x|`` if known).

    The vector is first scaled by an exact power of two ``2^k`` (applied as two
    factors ``2^k1 · 2^k2``, each a normal float) that brings ``max|x|`` into
    ``[1, 2)``, so the squares neither overflow (``|x| > 1.8e19``) nor flush to
    zero (``|x| < 1e-19``; XLA on CPU flushes subnormals); the result is scaled
    back the same way. Non-finite entries give a non-finite result.
    """
    d = xf.shape[0]
    if m is None:
        m = jnp.max(jnp.abs(xf))
    biased = (jax.lax.bitcast_convert_type(m, jnp.uint32) >> 23).astype(jnp.int32) & 0xFF
    k = 127 - biased  # 2^k · m ∈ [1, 2) for normal m
    k1 = k // 2
    k2 = k - k1  # both in [-64, 64]
    y = xf * _pow2(k1) * _pow2(k2)
    rms = jnp.sqrt(jnp.sum(y * y)) / np.float32(np.sqrt(max(d, 1)))
    return rms * _pow2(-k1) * _pow2(-k2)


@register("scaled_sign")
def scaled_sign(*, seed: int = 0) -> Compressor:
    """1-bit sign compression scaled to preserve the ℓ2 norm (DoubleSqueeze, Sec. 5).

    ``Q(v) = (‖v‖₂ / ‖sign(v)‖₂) · sign(v)`` with ``sign(0) = +1``, so for a
    ``d``-element tensor the scale is ``‖v‖₂ / √d`` and ``‖Q(v)‖₂ = ‖v‖₂``.
    Deterministic and biased (``unbiased=False``); payloads are gathered, not
    summed (``strategy="allgather"``). The norm is computed in float32 after an
    exact power-of-two rescaling (no overflow or underflow of the squares over
    the whole float32 range) and the result cast back to the input's dtype. A NaN or Inf entry makes
    the scale non-finite, and so the whole reconstruction (no crash).

    >>> import jax.numpy as jnp, jaxcomm as jc
    >>> c = jc.compressors.scaled_sign()
    >>> payload, _ = c.compress(jnp.array([3.0, -4.0, 0.0, 0.0]))   # ‖x‖₂ = 5, d = 4
    >>> c.decompress(payload).tolist()
    [2.5, -2.5, 2.5, 2.5]
    >>> jc.wire_bits(payload)   # one byte of packed signs + a float32 scale
    40

    Args:
      seed: seed of the PRNG key held in the optax state (unused by the
        operator itself, which is deterministic; kept for the common contract).
    Returns:
      A :class:`~jaxcomm.compressors.Compressor` named ``"scaled_sign"``.
      Wire bits for ``d`` entries: ``8·ceil(d/8) + 32``.
    """

    def compress(x, key, state):
        del key
        xf = jnp.ravel(x).astype(jnp.float32)
        bits, (m,) = pack_reduce(xf < 0, (jnp.abs(xf),), ("max",))  # signs and max|v| in one pass
        scale = _rms(xf, m)
        payload = ScaledSignPayload(bits=bits, scale=scale, shape=tuple(x.shape), dtype=x.dtype)
        return payload, state

    def decompress(p: ScaledSignPayload):
        d = int(np.prod(p.shape, dtype=np.int64))
        negative = unpack(p.bits, 1, d).astype(jnp.bool_)
        values = jnp.where(negative, -p.scale, p.scale)
        return values.reshape(p.shape).astype(p.dtype)

    return Compressor(
        name="scaled_sign",
        compress_fn=compress,
        decompress_fn=decompress,
        unbiased=False,
        strategy="allgather",
        seed=seed,
        params={},
        stochastic=False,
        local_contraction=_delta,
        bound=(
            "(‖x‖₂/√d) sign(x) has ‖Q(x) − x‖² = (2 − 2‖x‖₁/(√d‖x‖₂)) ‖x‖² exactly, δ(x) = 2‖x‖₁/(√d‖x‖₂) − 1: "
            "a contraction where ‖x‖₁ > √d‖x‖₂/2, expanding a sparse x up to (2 − 2/√d) ‖x‖² (DoubleSqueeze "
            "assumes a bounded error instead)"
        ),
    )


def _delta(x):
    """``δ(x) = 2‖x‖₁/(√d ‖x‖₂) − 1`` in float32 (1 for ``x = 0``): scaled sign's exact contraction of ``x``."""
    xf = jnp.ravel(x).astype(jnp.float32)
    norm = jnp.sqrt(jnp.sum(jnp.square(xf)))
    r = jnp.sum(jnp.abs(xf)) / jnp.where(norm > 0, math.sqrt(xf.size) * norm, 1.0)
    return jnp.where(norm > 0, 2.0 * r - 1.0, 1.0)
