"""Exact bit counts that cannot wrap: :class:`BitCount`, two ``uint32`` words per count.

A step's wire volume is an integer number of bits. One int32 counter wraps at
``2**31`` bits (256 MiB): one dense float32 tensor of 67 M entries, or a sparse
payload of 34 M (value, index) pairs, is past it. With ``jax_enable_x64`` off (the
default) jax has no 64-bit integers, so a count is kept as two ``uint32`` words

    value = hi · 2**32 + lo,        0 ≤ value ≤ 2**64 − 2,

and added with a carry. Every array shape works (one count per tensor is the usual
``(num_tensors,)``), inside ``jax.jit``, ``jax.vmap`` and ``jax.shard_map``; a
``BitCount`` is a pytree whose two leaves are the word arrays.

On the host, ``int(count)`` (a single count) and ``np.asarray(count)`` (int64,
exact below ``2**63``) read it; ``count.sum()`` adds counts exactly, on the host or
traced. ``jnp.asarray(count)`` is refused: an int32 array would wrap.

Nothing wraps silently. A count that cannot be held exactly -- a negative input, or
a sum of ``2**64 − 1`` or more -- is refused where it is concrete (eager, on the
host): ``ValueError`` for a negative or out-of-range input, ``OverflowError`` for a
sum. Where it is traced (``jit``, ``vmap``, ``shard_map``) no Python error can be
raised at run time, so it *saturates*: both words become ``2**32 − 1``, the value
``2**64 − 1`` (:data:`BitCount.SATURATED`), which no exact count takes. Saturation is
sticky (any sum with a saturated count is saturated), compares as the largest count,
and ``int()`` / ``np.asarray`` refuse it on the host with an ``OverflowError``, so
the overflow surfaces when the count is read. Saturating costs two selects per word
in the compiled step; a flag in a third array would change the pytree every caller
stores (states, checkpoints) for no extra information.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["BitCount"]

_WORD = 1 << 32
_HALF = 1 << 16
_LOW16 = _HALF - 1
# counts per partial sum in BitCount.sum: a sum of this many 16-bit halves stays below 2**32
_SUM_CHUNK = 1 << 15


_ONES = _WORD - 1  # a word of all ones: both words so mark a saturated count
_LARGEST = _WORD * _WORD - 2  # the largest exact count
_ONES32 = np.uint32(_ONES)


def _u32(x) -> jax.Array:
    return jnp.asarray(x).astype(jnp.uint32)


def _is_count_like(value) -> bool:
    """Whether ``value`` is something :meth:`BitCount.of` reads (an operand of ``+`` and the comparisons)."""
    if isinstance(value, (BitCount, int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        return True
    return isinstance(value, (np.ndarray, jax.Array, jax.core.Tracer)) and jnp.issubdtype(value.dtype, jnp.integer)


def _settle(hi, lo, bad, error: type[Exception], message) -> BitCount:
    """``BitCount(hi, lo)`` where ``bad`` is false. Where ``bad`` holds: a concrete ``bad`` raises
    ``error(message())``; a traced one makes those counts the saturated count (both words all ones)."""
    if isinstance(bad, bool):
        if bad:
            raise error(message())
        return BitCount(hi, lo)
    if not isinstance(bad, jax.core.Tracer):
        if np.any(np.asarray(bad)):
            raise error(message())
        return BitCount(hi, lo)
    return BitCount(jnp.where(bad, _ONES32, hi), jnp.where(bad, _ONES32, lo))


def _negative(a) -> Any:
    """``a < 0`` for a signed integer array (``False`` for an unsigned one)."""
    return a < 0 if jnp.issubdtype(a.dtype, jnp.signedinteger) else False


@dataclasses.dataclass(frozen=True, eq=False)
class BitCount:
    """Non-negative integer counts up to ``2**64 − 2``, as ``hi · 2**32 + lo`` (``uint32`` arrays, one shape).

    Build with :meth:`of` (a Python int or an integer array), :meth:`product`
    (``count · weight`` for a dynamic count and a static weight), ``+`` and ``−``; combine
    with :meth:`sum`, :meth:`stack`, :meth:`concatenate`, indexing and ``reshape``.
    A result that is not an exact count raises on concrete values and saturates at
    :data:`SATURATED` when traced (module docstring). ``==`` and ``!=`` with a value
    that is not a count (``None``, a float, a string) are ``False`` / ``True``, as
    Python's protocol gives for unrelated types; ``bool`` needs a single count.

    Attributes:
      hi: ``uint32`` array, the high words.
      lo: ``uint32`` array, the low words (same shape).
    """

    hi: Any
    lo: Any

    SATURATED: ClassVar[int] = _WORD * _WORD - 1
    """``2**64 − 1``: the value of a traced count that overflowed or came from a negative input."""

    # ----------------------------------------------------------------- build
    @classmethod
    def of(cls, value) -> BitCount:
        """``value`` as a count: a ``BitCount``, a Python int in ``[0, 2**64 − 1)``, or non-negative integers.

        Integers may be a jax or NumPy array, a NumPy scalar or a (nested) list of
        ints. Arrays of at most 32 bits fill the low word; 64-bit ones (NumPy, or jax
        with ``jax_enable_x64``) are split into both words.

        Raises:
          TypeError: ``value`` is not an integer (``None``, bool, float, string...).
          ValueError: a concrete value is negative, or ``2**64 − 1`` or more. A traced
            negative entry becomes :data:`SATURATED` instead.
        """
        if isinstance(value, BitCount):
            return value
        if isinstance(value, (bool, np.bool_)) or value is None or isinstance(value, (str, bytes, float, complex)):
            raise TypeError(f"BitCount.of: value must be an integer count, got {type(value).__name__}")
        if isinstance(value, (int, np.integer)):
            v = int(value)
            if not 0 <= v <= _LARGEST:
                raise ValueError(
                    f"BitCount.of: value must lie in [0, 2**64 - 1) (2**64 - 1 marks a saturated count), got {v}"
                )
            return cls(jnp.uint32(v >> 32), jnp.uint32(v & _ONES))
        if not isinstance(value, (jax.Array, jax.core.Tracer)):
            try:
                host = np.asarray(value)
            except (TypeError, ValueError) as e:
                raise TypeError(f"BitCount.of: value must be integers, got {type(value).__name__}: {e}") from None
            if host.dtype == object:
                raise ValueError(
                    "BitCount.of: value must be integers in [0, 2**64 - 1); got entries NumPy cannot hold in "
                    "one integer dtype (beyond 64 bits, or not integers)"
                )
            if not np.issubdtype(host.dtype, np.integer):
                raise TypeError(f"BitCount.of: value must have an integer dtype, got {host.dtype}")
            if host.size and np.issubdtype(host.dtype, np.signedinteger) and host.min() < 0:
                raise ValueError(f"BitCount.of: counts must be non-negative, got {host.min()}")
            u = host.astype(np.uint64)
            if host.size and u.max() > np.uint64(_LARGEST):
                raise ValueError("BitCount.of: 2**64 - 1 marks a saturated count; counts must be below it")
            hi, lo = (u >> np.uint64(32)).astype(np.uint32), (u & np.uint64(_ONES)).astype(np.uint32)
            return cls(jnp.asarray(hi), jnp.asarray(lo))
        a = value
        if not jnp.issubdtype(a.dtype, jnp.integer):
            raise TypeError(f"BitCount.of: value must have an integer dtype, got {a.dtype}")
        bad = _negative(a)
        if a.dtype.itemsize > 4:
            hi, lo = (a >> 32).astype(jnp.uint32), (a & _ONES).astype(jnp.uint32)
            bad = bad | ((hi == _ONES32) & (lo == _ONES32))
        else:
            hi, lo = jnp.zeros(a.shape, jnp.uint32), a.astype(jnp.uint32)

        def message():
            return (
                f"BitCount.of: counts must lie in [0, 2**64 - 1), got {np.asarray(a).min()} "
                f"({a.dtype}; negative, or 2**64 - 1)"
            )

        return _settle(hi, lo, bad, ValueError, message)

    @classmethod
    def zeros(cls, shape: int | Sequence[int] = ()) -> BitCount:
        """Counts of zero, of ``shape``."""
        return cls(jnp.zeros(shape, jnp.uint32), jnp.zeros(shape, jnp.uint32))

    @classmethod
    def product(cls, count, weight: int) -> BitCount:
        """Exactly ``count · weight``: ``count`` integers in ``[0, 2**32)``, ``weight`` a static int in ``[0, 2**32)``.

        Schoolbook multiplication in 16-bit halves, every partial product below
        ``2**32``: with ``a = a1·2**16 + a0`` and ``w = w1·2**16 + w0``,
        ``a·w = a1·w1·2**32 + (a1·w0 + a0·w1)·2**16 + a0·w0``. The product is at
        most ``(2**32 − 1)**2``, never saturated; a concrete count outside ``[0, 2**32)``
        raises ``ValueError``, a traced one gives :data:`SATURATED`.
        """
        if isinstance(weight, (bool, np.bool_)) or not isinstance(weight, (int, np.integer)):
            raise TypeError(f"BitCount.product: weight must be a Python int, got {type(weight).__name__}")
        w = int(weight)
        if not 0 <= w < _WORD:
            raise ValueError(f"BitCount.product: weight must lie in [0, 2**32), got {w}")
        if isinstance(count, (bool, np.bool_)) or count is None or isinstance(count, BitCount):
            raise TypeError(f"BitCount.product: count must be an integer array, got {type(count).__name__}")
        if isinstance(count, (int, np.integer)):
            if not 0 <= int(count) < _WORD:
                raise ValueError(f"BitCount.product: count must lie in [0, 2**32), got {int(count)}")
            count = np.uint32(count)
        c = count if isinstance(count, (jax.Array, jax.core.Tracer)) else np.asarray(count)
        if not jnp.issubdtype(c.dtype, jnp.integer):
            raise TypeError(f"BitCount.product: count must have an integer dtype, got {c.dtype}")
        bad = _negative(c)
        if c.dtype.itemsize > 4:
            bad = bad | (c > np.asarray(_ONES, c.dtype))
        a = _u32(c)
        a1, a0 = a >> 16, a & _LOW16
        w1, w0 = np.uint32(w >> 16), np.uint32(w & _LOW16)
        p00, p01, p10, p11 = a0 * w0, a0 * w1, a1 * w0, a1 * w1
        mid = (p00 >> 16) + (p01 & _LOW16) + (p10 & _LOW16)  # < 3·2**16
        lo = (p00 & _LOW16) | ((mid & _LOW16) << 16)
        hi = p11 + (p01 >> 16) + (p10 >> 16) + (mid >> 16)  # below 2**32: count · weight < 2**64 - 2**33

        def message():
            host = np.asarray(c)
            return f"BitCount.product: count must lie in [0, 2**32), got {host.min() if host.min() < 0 else host.max()}"

        return _settle(hi, lo, bad, ValueError, message)

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
        """The exact sum; ``OverflowError`` at ``2**64 − 1`` or more (concrete), :data:`SATURATED` (traced)."""
        if not _is_count_like(other):
            return NotImplemented
        b = BitCount.of(other)
        ah, al, bh, bl = _u32(self.hi), _u32(self.lo), _u32(b.hi), _u32(b.lo)
        lo = al + bl
        carry = (lo < al).astype(jnp.uint32)
        partial = ah + bh
        hi = partial + carry
        # a carry out of the high word, or the one value reserved for saturation
        bad = (partial < ah) | (hi < partial) | ((hi == _ONES32) & (lo == _ONES32))
        return _settle(hi, lo, bad, OverflowError, lambda: "BitCount: a sum reached 2**64 - 1 bits or more")

    __radd__ = __add__

    def __sub__(self, other) -> BitCount:
        """The exact difference where ``other ≤ self``; a difference below zero (or from a
        saturated count) raises ``OverflowError`` (concrete) or is :data:`SATURATED` (traced)."""
        if not _is_count_like(other):
            return NotImplemented
        b = BitCount.of(other)
        ah, al, bh, bl = _u32(self.hi), _u32(self.lo), _u32(b.hi), _u32(b.lo)
        lo = al - bl
        borrow = (al < bl).astype(jnp.uint32)
        hi = ah - bh - borrow
        bad = (ah < bh) | ((ah == bh) & (borrow == 1)) | self.is_saturated() | b.is_saturated()
        return _settle(
            hi, lo, bad, OverflowError, lambda: "BitCount: a difference below zero (or from a saturated count)"
        )

    # Comparisons are element-wise and exact (boolean arrays, as for jax arrays). With a value that
    # is not a count they return NotImplemented: Python then gives False for == and True for !=,
    # and a TypeError for the orderings.
    def _words(self, other) -> tuple:
        b = BitCount.of(other)
        return _u32(self.hi), _u32(self.lo), _u32(b.hi), _u32(b.lo)

    def __eq__(self, other) -> Any:
        if not _is_count_like(other):
            return NotImplemented
        h, lo, oh, olo = self._words(other)
        return (h == oh) & (lo == olo)

    def __ne__(self, other) -> Any:
        if not _is_count_like(other):
            return NotImplemented
        h, lo, oh, olo = self._words(other)
        return (h != oh) | (lo != olo)

    def __lt__(self, other) -> Any:
        if not _is_count_like(other):
            return NotImplemented
        h, lo, oh, olo = self._words(other)
        return (h < oh) | ((h == oh) & (lo < olo))

    def __le__(self, other) -> Any:
        if not _is_count_like(other):
            return NotImplemented
        h, lo, oh, olo = self._words(other)
        return (h < oh) | ((h == oh) & (lo <= olo))

    def __gt__(self, other) -> Any:
        if not _is_count_like(other):
            return NotImplemented
        return BitCount.of(other) < self

    def __ge__(self, other) -> Any:
        if not _is_count_like(other):
            return NotImplemented
        return BitCount.of(other) <= self

    def is_saturated(self) -> Any:
        """Element-wise: which counts are :data:`SATURATED` (a bool array; works traced, e.g. to stop a run)."""
        return (_u32(self.hi) == _ONES32) & (_u32(self.lo) == _ONES32)

    def __bool__(self) -> bool:
        """Whether a single count is non-zero (``ValueError`` for several, as NumPy's arrays)."""
        if self.size != 1:
            raise ValueError(
                f"the truth value of a BitCount of shape {self.shape} is ambiguous; use (count == 0).any() or .all()"
            )
        return bool(((_u32(self.hi) != 0) | (_u32(self.lo) != 0)).reshape(()))

    __hash__ = None  # type: ignore[assignment]  # element-wise == (as for arrays): not hashable

    def sum(self, axis: int | None = None) -> BitCount:
        """The exact sum over ``axis`` (all entries when ``None``), as a ``BitCount``.

        The low words are split into 16-bit halves summed in ``uint32`` (exact for up
        to ``2**16`` terms; longer sums go by chunks of ``2**15``), then recombined
        with carries: ``Σ v = 2**32 Σ hi + 2**16 Σ (lo >> 16) + Σ (lo & 0xffff)``; ``Σ hi``
        is formed from 16-bit halves as well, so a sum past the high word is seen, never
        wrapped (``OverflowError`` concrete, :data:`SATURATED` traced, as for ``+``).
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
        # Σ hi, exact (below 2**48), in 16-bit halves too: it overflows the high word iff it reaches 2**32.
        hi_sum = BitCount.product(jnp.sum(hi >> 16, -1, dtype=jnp.uint32), _HALF) + jnp.sum(
            hi & _LOW16, -1, dtype=jnp.uint32
        )
        zero = jnp.zeros(lo.shape[:-1], jnp.uint32)
        total_hi = _settle(
            hi_sum.lo, zero, hi_sum.hi != 0, OverflowError, lambda: "BitCount.sum: the sum reached 2**64 bits or more"
        )
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
        if not self.shape:
            raise TypeError("len() of a single BitCount (shape ())")
        return self.shape[0]

    def __getitem__(self, index) -> BitCount:
        return BitCount(self.hi[index], self.lo[index])

    def reshape(self, *shape) -> BitCount:
        new = shape[0] if len(shape) == 1 else shape
        return BitCount(jnp.reshape(self.hi, new), jnp.reshape(self.lo, new))

    # ----------------------------------------------------------------- host
    def to_numpy(self) -> np.ndarray:
        """The counts as an ``int64`` NumPy array (host; exact, ``OverflowError`` at ``2**63`` or more)."""
        self._refuse_saturated()
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
        self._refuse_saturated()
        return (int(np.asarray(self.hi).reshape(())) << 32) | int(np.asarray(self.lo).reshape(()))

    def __float__(self) -> float:
        return float(int(self))

    def _refuse_saturated(self) -> None:
        if np.any((np.asarray(self.hi) == _ONES) & (np.asarray(self.lo) == _ONES)):
            raise OverflowError(
                "BitCount: a count saturated (traced: a sum reached 2**64 - 1 bits or more, or an input was "
                "negative); it holds no exact value"
            )

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
            hi, lo = np.asarray(self.hi), np.asarray(self.lo)
        except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
            return f"BitCount(shape={self.shape}, traced)"
        values = [
            "saturated" if (h, low) == (_ONES, _ONES) else (h << 32) | low
            for h, low in zip(hi.reshape(-1).tolist(), lo.reshape(-1).tolist())
        ]
        shown: Any = values[0] if hi.ndim == 0 else np.asarray(values, dtype=object).reshape(hi.shape).tolist()
        return f"BitCount({shown})"


jax.tree_util.register_dataclass(BitCount, data_fields=["hi", "lo"], meta_fields=[])
