"""Exact bit counts that cannot wrap: :class:`BitCount`, two ``uint32`` words per count.

A step's wire volume is an integer number of bits. One int32 counter wraps at
``2**31`` bits (256 MiB): one dense float32 tensor of 67 M entries, or a sparse
payload of 34 M (value, index) pairs, is past it. With ``jax_enable_x64`` off (the
default) jax has no 64-bit integers, so a count is kept as two ``uint32`` words

    value = hi · 2**32 + lo,        0 ≤ value < 2**64,

and added with a carry. Every array shape works (one count per tensor is the usual
``(num_tensors,)``), inside ``jax.jit``, ``jax.vmap`` and ``jax.shard_map``; a
``BitCount`` is a pytree whose two leaves are the word arrays.

On the host, ``int(count)`` (a single count) and ``np.asarray(count)`` (int64,
exact below ``2**63``) read it; ``count.sum()`` adds counts exactly, on the host or
traced. ``jnp.asarray(count)`` is refused: an int32 array would wrap.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["BitCount"]

_WORD = 1 << 32
_HALF = 1 << 16
_LOW16 = _HALF - 1
# counts per partial sum in BitCount.sum: a sum of this many 16-bit halves stays below 2**32
_SUM_CHUNK = 1 << 15


def _u32(x) -> jax.Array:
    return jnp.asarray(x).astype(jnp.uint32)


@dataclasses.dataclass(frozen=True, eq=False)
class BitCount:
    """Non-negative integer counts below ``2**64``, as ``hi · 2**32 + lo`` (``uint32`` arrays, one shape).

    Build with :meth:`of` (a Python int or an integer array), :meth:`product`
    (``count · weight`` for a dynamic count and a static weight), ``+`` and ``−``; combine
    with :meth:`sum`, :meth:`stack`, :meth:`concatenate`, indexing and ``reshape``.

    Attributes:
      hi: ``uint32`` array, the high words.
      lo: ``uint32`` array, the low words (same shape).
    """

    hi: Any
    lo: Any

    # ----------------------------------------------------------------- build
    @classmethod
    def of(cls, value) -> BitCount:
        """``value`` as a count: a Python int in ``[0, 2**64)``, a non-negative integer array, or a ``BitCount``.

        Integer arrays of at most 32 bits fill the low word; 64-bit ones (with
        ``jax_enable_x64``) are split into both words.
        """
        if isinstance(value, BitCount):
            return value
        if isinstance(value, (bool, np.bool_)):
            raise TypeError(f"BitCount.of: value must be an integer, got {type(value).__name__}")
        if isinstance(value, (int, np.integer)):
            v = int(value)
            if not 0 <= v < _WORD * _WORD:
                raise ValueError(f"BitCount.of: value must lie in [0, 2**64), got {v}")
            return cls(jnp.uint32(v >> 32), jnp.uint32(v & (_WORD - 1)))
        if isinstance(value, np.ndarray) and np.issubdtype(value.dtype, np.integer) and value.dtype.itemsize > 4:
            if np.any(value < 0):
                raise ValueError("BitCount.of: counts must be non-negative")
            u = value.astype(np.uint64)
            hi, lo = (u >> np.uint64(32)).astype(np.uint32), (u & np.uint64(_WORD - 1)).astype(np.uint32)
            return cls(jnp.asarray(hi), jnp.asarray(lo))
        a = jnp.asarray(value)
        if not jnp.issubdtype(a.dtype, jnp.integer):
            raise TypeError(f"BitCount.of: value must have an integer dtype, got {a.dtype}")
        if a.dtype.itemsize > 4:
            return cls((a >> 32).astype(jnp.uint32), (a & (_WORD - 1)).astype(jnp.uint32))
        return cls(jnp.zeros(a.shape, jnp.uint32), a.astype(jnp.uint32))

    @classmethod
    def zeros(cls, shape: int | Sequence[int] = ()) -> BitCount:
        """Counts of zero, of ``shape``."""
        return cls(jnp.zeros(shape, jnp.uint32), jnp.zeros(shape, jnp.uint32))

    @classmethod
    def product(cls, count, weight: int) -> BitCount:
        """Exactly ``count · weight``: ``count`` a non-negative integer array below ``2**32``, ``weight`` a static int.

        Schoolbook multiplication in 16-bit halves, every partial product below
        ``2**32``: with ``a = a1·2**16 + a0`` and ``w = w1·2**16 + w0``,
        ``a·w = a1·w1·2**32 + (a1·w0 + a0·w1)·2**16 + a0·w0``.
        """
        if isinstance(weight, (bool, np.bool_)) or not isinstance(weight, (int, np.integer)):
            raise TypeError(f"BitCount.product: weight must be a Python int, got {type(weight).__name__}")
        w = int(weight)
        if not 0 <= w < _WORD:
            raise ValueError(f"BitCount.product: weight must lie in [0, 2**32), got {w}")
        a = _u32(count)
        a1, a0 = a >> 16, a & _LOW16
        w1, w0 = np.uint32(w >> 16), np.uint32(w & _LOW16)
        p00, p01, p10, p11 = a0 * w0, a0 * w1, a1 * w0, a1 * w1
        mid = (p00 >> 16) + (p01 & _LOW16) + (p10 & _LOW16)  # < 3·2**16
        lo = (p00 & _LOW16) | ((mid & _LOW16) << 16)
        hi = p11 + (p01 >> 16) + (p10 >> 16) + (mid >> 16)
        return cls(hi, lo)

    @classmethod
    def stack(cls, counts: Sequence, axis: int = 0) -> BitCount:
        """``jnp.stack`` of counts (``BitCount``, ints or integer arrays)."""
        cs = [cls.of(c) for c in counts]
        return cls(jnp.stack([c.hi for c in cs], axis), jnp.stack([c.lo for c in cs], axis))

    @classmethod
    def concatenate(cls, counts: Sequence, axis: int = 0) -> BitCount:
        """``jnp.concatenate`` of counts (``BitCount`` or integer arrays)."""
        cs = [cls.of(c) for c in counts]
        return cls(jnp.concatenate([c.hi for c in cs], axis), jnp.concatenate([c.lo for c in cs], axis))

    # ------------------------------------------------------------ arithmetic
    def __add__(self, other) -> BitCount:
        b = BitCount.of(other)
        lo = _u32(self.lo) + _u32(b.lo)
        carry = (lo < _u32(self.lo)).astype(jnp.uint32)
        return BitCount(_u32(self.hi) + _u32(b.hi) + carry, lo)

    __radd__ = __add__

    def __sub__(self, other) -> BitCount:
        """``self − other`` with a borrow, modulo ``2**64`` like ``+``: exact where ``other ≤ self``."""
        b = BitCount.of(other)
        lo = _u32(self.lo) - _u32(b.lo)
        borrow = (_u32(self.lo) < _u32(b.lo)).astype(jnp.uint32)
        return BitCount(_u32(self.hi) - _u32(b.hi) - borrow, lo)

    # Comparisons are element-wise and exact (boolean arrays, as for jax arrays).
    def _words(self, other) -> tuple:
        b = BitCount.of(other)
        return _u32(self.hi), _u32(self.lo), _u32(b.hi), _u32(b.lo)

    def __eq__(self, other) -> Any:
        h, lo, oh, olo = self._words(other)
        return (h == oh) & (lo == olo)

    def __ne__(self, other) -> Any:
        h, lo, oh, olo = self._words(other)
        return (h != oh) | (lo != olo)

    def __lt__(self, other) -> Any:
        h, lo, oh, olo = self._words(other)
        return (h < oh) | ((h == oh) & (lo < olo))

    def __le__(self, other) -> Any:
        h, lo, oh, olo = self._words(other)
        return (h < oh) | ((h == oh) & (lo <= olo))

    def __gt__(self, other) -> Any:
        return BitCount.of(other) < self

    def __ge__(self, other) -> Any:
        return BitCount.of(other) <= self

    __hash__ = None  # type: ignore[assignment]  # element-wise == (as for arrays): not hashable

    def sum(self, axis: int | None = None) -> BitCount:
        """The exact sum over ``axis`` (all entries when ``None``), as a ``BitCount``.

        The low words are split into 16-bit halves summed in ``uint32`` (exact for up
        to ``2**16`` terms; longer sums go by chunks of ``2**15``), then recombined
        with carries: ``Σ v = 2**32 Σ hi + 2**16 Σ (lo >> 16) + Σ (lo & 0xffff)``.
        """
        hi, lo = _u32(self.hi), _u32(self.lo)
        if axis is None:
            hi, lo, axis = hi.reshape(-1), lo.reshape(-1), 0
        hi, lo = jnp.moveaxis(hi, axis, -1), jnp.moveaxis(lo, axis, -1)
        n = lo.shape[-1]
        if n > _SUM_CHUNK:
            pad = [(0, 0)] * (lo.ndim - 1) + [(0, -n % _SUM_CHUNK)]
            shape = lo.shape[:-1] + (-1, _SUM_CHUNK)
            part = BitCount(jnp.pad(hi, pad).reshape(shape), jnp.pad(lo, pad).reshape(shape)).sum(-1)
            return part.sum(-1)
        total_hi = BitCount(jnp.sum(hi, -1, dtype=jnp.uint32), jnp.zeros(lo.shape[:-1], jnp.uint32))
        halves = BitCount.product(jnp.sum(lo >> 16, -1, dtype=jnp.uint32), _HALF)
        return total_hi + halves + jnp.sum(lo & _LOW16, -1, dtype=jnp.uint32)

    # ---------------------------------------------------------------- shape
    @property
    def shape(self) -> tuple:
        return tuple(jnp.shape(self.lo))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index) -> BitCount:
        return BitCount(self.hi[index], self.lo[index])

    def reshape(self, *shape) -> BitCount:
        new = shape[0] if len(shape) == 1 else shape
        return BitCount(jnp.reshape(self.hi, new), jnp.reshape(self.lo, new))

    # ----------------------------------------------------------------- host
    def to_numpy(self) -> np.ndarray:
        """The counts as an ``int64`` NumPy array (host; exact, ``OverflowError`` at ``2**63`` or more)."""
        hi = np.asarray(self.hi).astype(np.uint64)
        lo = np.asarray(self.lo).astype(np.uint64)
        if np.any(hi >= np.uint64(1 << 31)):
            raise OverflowError("BitCount.to_numpy: a count is 2**63 or more, beyond int64; read it with int()")
        return np.asarray(((hi << np.uint64(32)) | lo).astype(np.int64))

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self.to_numpy()
        if dtype is None:
            return out
        cast = out.astype(dtype)
        if not np.array_equal(cast.astype(np.int64), out):
            raise OverflowError(f"BitCount: counts up to {out.max()} do not fit in {np.dtype(dtype)}")
        return cast

    def __int__(self) -> int:
        if self.size != 1:
            raise TypeError(f"int(BitCount) needs a single count, this one has shape {self.shape}; use .sum()")
        return (int(np.asarray(self.hi).reshape(())) << 32) | int(np.asarray(self.lo).reshape(()))

    def __float__(self) -> float:
        return float(int(self))

    def __format__(self, spec: str) -> str:
        """A single count formats as its int (``f"{bits:,}"``), others as their list."""
        return format(int(self), spec) if self.size == 1 else format(repr(self), spec)

    def __jax_array__(self):
        raise TypeError(
            "a BitCount is two uint32 words (hi · 2**32 + lo); a jax integer array would wrap past 2**31. "
            "Read it with int(count) or np.asarray(count) on the host, or add counts with count.sum()"
        )

    def __repr__(self) -> str:
        try:
            shown: Any = int(self) if self.size == 1 and self.ndim == 0 else self.to_numpy().tolist()
        except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError, OverflowError, TypeError):
            return f"BitCount(shape={self.shape}, traced)"
        return f"BitCount({shown})"


jax.tree_util.register_dataclass(BitCount, data_fields=["hi", "lo"], meta_fields=[])
