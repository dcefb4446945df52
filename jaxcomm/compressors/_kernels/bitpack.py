"""Bit packing: the layouts of every packed field on the wire.

One LSB-first packer, :func:`pack_bits`, packs ``w``-bit codes into words of 8
or 32 bits: code ``i`` occupies bits ``[(i % m) w, (i % m + 1) w)`` of word
``i // m``, ``m = word_bits / w``. With uint8 words it is GRACE's
:func:`pack` (sign bits, 2-bit tags, QSparse levels, bitmasks); with uint32
words and ``w = 1`` it is the bit-packed selection mask of
:mod:`.select` (bit ``i % 32`` of word ``i // 32``: the same bits as the
uint8 packing read as little-endian words, see :func:`bytes_to_words`).

:func:`pack_codes` packs codes of any width ``1..32`` (the quantizers' codes)
bit-exactly: the width is split into its binary digits ``2^j``; 8-, 16- and
32-bit digits are stored as uint8/uint16/uint32, and 1-, 2- and 4-bit digits are
packed *plane-major* (code ``i`` in byte ``i mod B`` at bit ``2^j (i div B)``,
``B`` the field's bytes): the same size as :func:`pack_bits`, but packing and
unpacking are contiguous slices instead of strided gathers. The two orders are
distinct wire formats (each pinned by its compressors' payloads), so both stay.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Array = jax.Array

_WIDTHS = (1, 2, 4, 8)


def packed_size(n: int, bits: int) -> int:
    """Bytes needed to pack ``n`` codes of ``bits`` bits each: ``ceil(n * bits / 8)``."""
    return -(-n * bits // 8)


def pack_bits(codes, bits: int, word=jnp.uint8) -> Array:
    """Pack unsigned ``bits``-bit codes LSB-first into words of dtype ``word`` (uint8 or uint32).

    Code ``i`` occupies bits ``[(i % m) bits, (i % m + 1) bits)`` of word ``i // m``,
    ``m = 8 itemsize(word) / bits``; the last word is zero-padded.

    Args:
      codes: any shape, integer or bool, values in ``[0, 2**bits)``; flattened.
      bits: code width, dividing the word width (static).
      word: the word dtype.
    Returns:
      ``word`` array of shape ``(ceil(codes.size / m),)``.
    """
    word = jnp.dtype(word)
    m = 8 * word.itemsize // bits
    flat = jnp.ravel(codes)
    pad = (-flat.shape[0]) % m
    if pad:
        flat = jnp.pad(flat, (0, pad))
    shifts = jnp.asarray((np.arange(m) * bits).astype(word))
    return jnp.sum(flat.reshape(-1, m).astype(word) << shifts, axis=1, dtype=jnp.uint32).astype(word)


def unpack_bits(packed, bits: int, n: int) -> Array:
    """Inverse of :func:`pack_bits`: the first ``n`` codes, shape ``(n,)``, in ``packed``'s dtype."""
    word = packed.dtype
    m = 8 * word.itemsize // bits
    shifts = jnp.asarray((np.arange(m) * bits).astype(word))
    mask = jnp.asarray(np.array((1 << bits) - 1).astype(word))
    return ((packed[:, None] >> shifts[None, :]) & mask).reshape(-1)[:n]


def pack(codes: Array, bits: int) -> Array:
    """Pack unsigned integer codes of ``bits`` bits (1, 2, 4 or 8) into bytes.

    Code ``i`` occupies bits ``[(i % m)*bits, (i % m + 1)*bits)`` of byte
    ``i // m`` with ``m = 8 // bits`` (little-endian within a byte).

    Args:
      codes: any shape, integer or bool, values in ``[0, 2**bits)``; flattened.
      bits: code width.
    Returns:
      uint8 array of shape ``(ceil(codes.size * bits / 8),)``.
    """
    if bits not in _WIDTHS:
        raise ValueError(f"bits must be one of {_WIDTHS}; got {bits}")
    return pack_bits(codes, bits, jnp.uint8)


def unpack(packed: Array, bits: int, n: int) -> Array:
    """Inverse of :func:`pack`: the first ``n`` codes as ``uint8`` of shape ``(n,)``."""
    if bits not in _WIDTHS:
        raise ValueError(f"bits must be one of {_WIDTHS}; got {bits}")
    return unpack_bits(packed, bits, n)


def pack_reduce(mask, values=(), ops=()) -> tuple[Array, tuple[Array, ...]]:
    """:func:`pack` ``(mask, 1)`` and reductions of ``values`` in one pass over the entries.

    The bits and the reductions come out of one variadic reduction over rows
    of 32 entries (bit ``j`` of a row's uint32 word is entry ``32 r + j``; the
    words are split into bytes LSB first, the :func:`pack` layout), followed
    by a reduction of the per-row partials. On XLA:CPU a reduction whose input
    is computed (``|x|``, a masked ``x``) materialises that input first unless
    it shares a variadic reduce, so this is one read of the tensor instead of
    one per quantity plus a stored intermediate.

    Args:
      mask: bool ``(n,)``.
      values: float32 ``(n,)`` arrays (elementwise expressions of the tensor fuse).
      ops: one of ``"sum"``, ``"max"`` per value.
    Returns:
      ``(bits, reductions)``: uint8 ``(ceil(n/8),)`` equal to ``pack(mask, 1)``
      and one float32 scalar per value (``sum``: 0 if ``n == 0``; ``max``:
      ``-inf`` if ``n == 0``; NaN propagates through both).
    """
    if len(values) != len(ops) or any(op not in _REDUCE for op in ops):
        raise ValueError(f"ops must name one of {tuple(_REDUCE)} per value; got {ops!r}")
    n = mask.shape[0]
    rows = n // 32
    words: list = []
    partials: list[list] = [[] for _ in values]
    if rows:
        body = n - n % 32
        bits = mask[:body].reshape(rows, 32).astype(jnp.uint32) << jnp.asarray(np.arange(32, dtype=np.uint32))
        inits = (jnp.uint32(0),) + tuple(jnp.float32(_REDUCE[op][1]) for op in ops)
        fns = (lax.add,) + tuple(_REDUCE[op][0] for op in ops)
        operands = (bits,) + tuple(v[:body].reshape(rows, 32) for v in values)
        out = lax.reduce(operands, inits, lambda a, b: tuple(f(x, y) for f, x, y in zip(fns, a, b)), (1,))
        words.append(out[0])
        for p, o in zip(partials, out[1:]):
            p.append(o)
    if n % 32:  # the tail of fewer than 32 entries
        words.append(pack_bits(mask[rows * 32 :], 1, jnp.uint32))
        for p, v in zip(partials, values):
            p.append(v[rows * 32 :])
    w = jnp.concatenate(words) if len(words) > 1 else words[0] if words else jnp.zeros((0,), jnp.uint32)
    b = (w[:, None] >> jnp.asarray(np.array([0, 8, 16, 24], np.uint32))[None, :]).astype(jnp.uint8).reshape(-1)
    reductions = []
    for p, op in zip(partials, ops):
        flat = jnp.concatenate(p) if len(p) > 1 else p[0] if p else jnp.zeros((0,), jnp.float32)
        reduce_all: Any = _REDUCE[op][2]
        reductions.append(reduce_all(flat) if flat.shape[0] else jnp.float32(_REDUCE[op][1]))
    return b[: packed_size(n, 1)], tuple(reductions)


_REDUCE = {"sum": (lax.add, 0.0, jnp.sum), "max": (lax.max, -np.inf, jnp.max)}


def popcount(words) -> Array:
    """Set bits of each word, int32, shape of ``words``."""
    return lax.population_count(words).astype(jnp.int32)


def bytes_to_words(packed) -> Array:
    """uint8 ``(B,)`` of :func:`pack` (``bits = 1``) as the uint32 words ``(ceil(B/4),)`` of the same bits."""
    b = packed.astype(jnp.uint32)
    b = jnp.pad(b, (0, (-b.shape[0]) % 4)).reshape(-1, 4)
    return b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16) | (b[:, 3] << 24)


def _width_fields(width: int) -> tuple[int, ...]:
    """Binary digits of ``width`` (1 <= width <= 32) as field widths, low bits first."""
    return tuple(w for w in (1, 2, 4, 8, 16, 32) if width & w)


_RAW = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}


def _planar_pack(codes, w: int):
    """Pack uint8 codes of ``w`` in {1, 2, 4} bits, plane-major: with ``m = 8 // w``
    and ``B = ceil(n / m)`` bytes, code ``i`` sits in byte ``i mod B`` at bit
    ``w (i div B)``. Same size as :func:`~jaxcomm.compressors.pack`; the
    contiguous planes make packing and unpacking vectorize (the cost of
    decoding either layout: ``docs/benchmarks.md``)."""
    m = 8 // w
    n = codes.shape[0]
    planes = -(-n // m)
    if planes * m != n:
        codes = jnp.pad(codes, (0, planes * m - n))
    out = codes[:planes]
    for j in range(1, m):
        out = out | (codes[j * planes : (j + 1) * planes] << (j * w))
    return out


def _planar_unpack(packed, w: int, n: int):
    """Inverse of :func:`_planar_pack`: ``n`` uint8 codes."""
    m, mask = 8 // w, (1 << w) - 1
    return jnp.concatenate([(packed >> (j * w)) & mask for j in range(m)])[:n]


def pack_codes(codes: Array, width: int) -> tuple[Array, ...]:
    """Pack unsigned codes of ``width`` bits (1..32) bit-exactly into byte-aligned fields.

    ``width`` is split into its binary digits ``2^j`` (low bits first, e.g.
    ``17 -> (1, 16)``); field ``j`` holds bits ``[o_j, o_j + 2^j)`` of every
    code: for 1, 2 and 4 bits packed densely into ``ceil(n 2^j / 8)`` bytes
    (plane-major: code ``i`` in byte ``i mod B`` at bit ``2^j (i div B)``, ``B``
    the field's byte count), for 8, 16 and 32 bits stored as uint8/uint16/uint32.

    Args:
      codes: integer array, values in ``[0, 2**width)``; flattened.
      width: bits per code (static).
    Returns:
      tuple of 1-D unsigned arrays; their total size is
      :func:`packed_code_bits` ``(codes.size, width)`` bits.
    """
    if not 1 <= width <= 32:
        raise ValueError(f"width must be in [1, 32]; got {width}")
    codes = jnp.ravel(codes)
    # Narrow integer types keep the conversions cheap (XLA:CPU converts
    # float <-> uint32 slowly); int32 -> uint32 is a reinterpretation.
    work = jnp.uint8 if width <= 8 else jnp.uint32
    if codes.dtype != work:
        codes = codes.astype(work)
    fields, offset = [], 0
    for w in _width_fields(width):
        part = codes >> offset if offset else codes
        if w in _RAW:
            fields.append(part if part.dtype == _RAW[w] else part.astype(_RAW[w]))  # keeps the low w bits
        else:
            fields.append(_planar_pack(jnp.bitwise_and(part, (1 << w) - 1).astype(jnp.uint8), w))
        offset += w
    return tuple(fields)


def unpack_codes(fields, width: int, n: int) -> Array:
    """Inverse of :func:`pack_codes`: the ``n`` codes, shape ``(n,)``.

    dtype: int32 for ``width <= 31`` (cheap to convert to float), uint32 for 32.
    """
    out_dtype = jnp.int32 if width <= 31 else jnp.uint32
    parts, offset = [], 0
    for f, w in zip(fields, _width_fields(width)):
        part = (f if w in _RAW else _planar_unpack(f, w, n)).astype(out_dtype)
        parts.append(part << offset if offset else part)
        offset += w
    out = parts[0]
    for part in parts[1:]:
        out = out | part
    return out


def packed_code_bits(n: int, width: int) -> int:
    """Exact bits of :func:`pack_codes` output for ``n`` codes: ``sum_j 8 ceil(n 2^j / 8)``."""
    return sum(8 * packed_size(n, w) for w in _width_fields(width))


def code_width(num_values: int) -> int:
    """Bits needed for ``num_values`` distinct codes: ``ceil(log2(num_values))`` (>= 1)."""
    return max(1, (num_values - 1).bit_length())
