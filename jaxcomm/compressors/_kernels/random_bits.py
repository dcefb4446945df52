"""Counter-based random bits: one keyed hash generator for every stochastic compressor.

:func:`uniform_bits` returns ``n`` uint32 words ``w_i = F(i; s0, s1)``,
``i = 0..n-1``. The key words ``(s0, s1) = jax.random.bits(key, (2,))`` are
the only threefry draw (every JAX key, raw ``uint32[2]`` or typed, gives its
own stream), and ``F`` is built from one xorshift-multiply finalizer

    xmx[a, r, b](h) = g16(gr(g16(h) * a) * b),   gr(h) = h XOR (h >> r)

(mod ``2^32``; a bijection of uint32 for odd ``a``, ``b``), keyed in one of two
schemes:

* ``"murmur3"``: ``F = m(m(m(i XOR s0) + s1) XOR s0)``, ``m = xmx[0x85EBCA6B,
  13, 0xC2B2AE35]`` (MurmurHash3's fmix32). For fixed key words ``F`` is a
  bijection of ``i``, so the ``n`` words are distinct. Used by the
  sparsifiers: random-k's positions, random sparsification's keep mask, the
  top-k and DGC threshold samples.
* ``"lowbias32"``: ``F = l((i * 0x9E3779B9 + s0) XOR s1)``, ``l = xmx[0x7FEB352D,
  15, 0x846CA68B]`` (C. Wellons' lowbias32). Used by the quantizers'
  stochastic rounding (QSGD, natural compression, TernGrad, stochastic
  rounding), through :func:`uniform_floats`.

The two schemes give different words for the same key, and each defines the
payloads of the compressors that use it (pinned against reference code), so
both are kept; they differ only in the finalizer's constants and the keying.
Both are statistical generators, not for cryptography (their cost against
threefry: ``docs/benchmarks.md``). Pure; works under ``jit`` and ``vmap``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def _xmx(h, a: int, r: int, b: int):
    """The xorshift-multiply finalizer ``xmx[a, r, b]`` on uint32 words (elementwise)."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(a)
    h = h ^ (h >> r)
    h = h * jnp.uint32(b)
    return h ^ (h >> 16)


def fmix32(h):
    """MurmurHash3's 32-bit finalizer: a bijection of uint32 with full avalanche."""
    return _xmx(h, 0x85EBCA6B, 13, 0xC2B2AE35)


def lowbias32(h):
    """C. Wellons' "lowbias32" integer hash: a bijection of uint32 with near-ideal avalanche."""
    return _xmx(h, 0x7FEB352D, 15, 0x846CA68B)


def key_words(key) -> Array:
    """The two uint32 words that key the hash, drawn from a PRNG key (threefry, two words only), shape ``(2,)``."""
    if jnp.issubdtype(jnp.result_type(key), jax.dtypes.prng_key):
        return jax.random.bits(key, (2,), jnp.uint32)
    return jax.random.bits(jnp.asarray(key, jnp.uint32), (2,), jnp.uint32)


def _murmur3(i, words):
    return fmix32(fmix32(fmix32(i ^ words[0]) + words[1]) ^ words[0])


def _lowbias32(i, words):
    return lowbias32((i * jnp.uint32(0x9E3779B9) + words[0]) ^ words[1])


_SCHEMES = {"murmur3": _murmur3, "lowbias32": _lowbias32}


def bits_at(words, i, scheme: str) -> Array:
    """The words ``F(i; words)`` at counters ``i`` (elementwise; ``uniform_bits(key, n)[i]`` for
    ``words = key_words(key)``).

    Being elementwise in ``i``, it fuses into whatever pass consumes it: a
    selection that only compares the words (random-k) evaluates them inside its
    passes instead of reading a materialised ``(n,)`` array.

    Args:
      words: uint32 ``(2,)`` from :func:`key_words`.
      i: uint32 counters, any shape.
      scheme: ``"murmur3"`` or ``"lowbias32"`` (static).
    Returns:
      uint32 array of ``i``'s shape.
    """
    if scheme not in _SCHEMES:
        raise ValueError(f"scheme must be one of {tuple(_SCHEMES)}; got {scheme!r}")
    return _SCHEMES[scheme](jnp.asarray(i).astype(jnp.uint32), words)


def uniform_bits(key, n: int, scheme: str) -> Array:
    """``n`` pseudo-random uint32 words ``F(i; key_words(key))``, ``i = 0..n-1`` (module doc).

    Args:
      key: a JAX PRNG key.
      n: number of words (static).
      scheme: ``"murmur3"`` or ``"lowbias32"`` (static).
    Returns:
      uint32 array of shape ``(n,)``.
    """
    return bits_at(key_words(key), jnp.arange(n, dtype=jnp.uint32), scheme)


def uniform_floats(key, n: int) -> Array:
    """Uniforms on the grid ``k 2^-23``, ``k = 0..2^23-1`` (float32, exact), shape ``(n,)``.

    Built like ``jax.random.uniform``: the top 23 bits of the ``"lowbias32"``
    words become the mantissa of a float in ``[1, 2)``, minus 1 (no
    int-to-float conversion). ``P(u < f) = ceil(f 2^23) / 2^23``, so stochastic
    rounding with these is unbiased up to ``2^-23`` of one quantization step,
    as with ``jax.random.uniform``.
    """
    bits = (uniform_bits(key, n, "lowbias32") >> 9) | jnp.uint32(0x3F800000)
    return jax.lax.bitcast_convert_type(bits, jnp.float32) - 1.0


def uniform_indices(key, n: int, d: int) -> Array:
    """``n`` indices in ``[0, d)``, uniform with replacement up to the hash, int32 ``(n,)``.

    ``w_i mod d`` of the ``"murmur3"`` words: the modulo bias is below ``d / 2^32`` relative.
    """
    h = uniform_bits(key, n, "murmur3")
    return (h % jnp.uint32(d)).astype(jnp.int32)
