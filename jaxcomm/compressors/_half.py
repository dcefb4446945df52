"""Sending any compressor's payload in 16 bits: :func:`half`."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from .._bitcount import BitCount
from ._base import Compressor, Payload, payload_dataclass, static_field

__all__ = ["half"]

_WIRE = {"float16": jnp.float16, "bfloat16": jnp.bfloat16}
_UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8}


def _narrowed(a) -> bool:
    """Whether leaf ``a`` is a floating array wider than 16 bits (the ones sent in 16 bits)."""
    dtype = jnp.result_type(a)
    return bool(jnp.issubdtype(dtype, jnp.floating)) and jnp.dtype(dtype).itemsize > 2


def round_stochastic(a, wire, key):
    """``a`` rounded to ``wire`` (float16 or bfloat16) stochastically: ``E[round(a)] = a``.

    Each entry goes to one of its two neighbours ``lo ≤ a ≤ hi`` in ``wire``, to ``hi``
    with probability ``(a − lo)/(hi − lo)`` (a uniform draw from ``key`` per entry), so
    the error is below one spacing and has mean zero. NaN and ±Inf stay; entries
    beyond the largest finite ``wire`` value saturate to it.
    """
    a32 = jnp.asarray(a).astype(jnp.float32)
    near = a32.astype(wire)
    n32 = near.astype(jnp.float32)
    down = jnp.nextafter(near, jnp.full_like(near, -jnp.inf))
    up = jnp.nextafter(near, jnp.full_like(near, jnp.inf))
    lo = jnp.where(n32 > a32, down, near)
    hi = jnp.where(n32 < a32, up, near)
    gap = hi.astype(jnp.float32) - lo.astype(jnp.float32)
    p_hi = jnp.where(gap > 0, (a32 - lo.astype(jnp.float32)) / jnp.where(gap > 0, gap, 1.0), 0.0)
    return jnp.where(jax.random.uniform(key, a32.shape) < p_hi, hi, lo)


def _to_wire(tree, wire, key):
    """``tree``'s wide floating leaves in ``wire`` (nearest, or stochastic with ``key``) and their dtypes.

    Returns ``(narrowed tree, dtypes)``: ``dtypes`` holds, per leaf, the dtype name it had
    (``None`` for a leaf left as it is).
    """
    leaves, treedef = jax.tree.flatten(tree)
    out: list = []
    dtypes: list[str | None] = []
    for i, a in enumerate(leaves):
        if not _narrowed(a):
            out.append(a)
            dtypes.append(None)
            continue
        dtypes.append(jnp.dtype(jnp.result_type(a)).name)
        out.append(
            jnp.asarray(a).astype(wire) if key is None else round_stochastic(a, wire, jax.random.fold_in(key, i))
        )
    return jax.tree.unflatten(treedef, out), tuple(dtypes)


def _from_wire(tree, dtypes):
    """The leaves of ``tree`` cast back to ``dtypes`` (``None``: left as it is)."""
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, [a if t is None else a.astype(t) for a, t in zip(leaves, dtypes)])


@functools.cache
def _half_type(cls: type) -> type:
    """``cls`` with its wide floating fields in 16 bits: a subclass with one more static field, ``wide``.

    ``wide`` holds, per data field of ``cls``, the dtypes its leaves had before the cast
    (:func:`_to_wire`), so decoding restores them. The subclass keeps ``cls``'s
    ``summable``, ``counted`` and ``inferred`` fields and its decoder; its ``wire_bits``
    is ``cls``'s less ``w − 16`` bits per sent entry of a leaf narrowed from ``w`` bits.
    """
    namespace = {
        "__annotations__": {"wide": "tuple", "half_of": ClassVar[type]},
        "__doc__": f"{cls.__name__} with its floating arrays sent in 16 bits (jaxcomm.compressors.half).",
        "__module__": __name__,
        "__qualname__": f"Half{cls.__name__}",
        "wide": static_field(default=()),
        "wire_bits": _half_wire_bits,
        "half_of": cls,
    }
    return payload_dataclass(type(f"Half{cls.__name__}", (cls,), namespace))


def _data_fields(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if not f.metadata.get("static", False)]


def _narrow(payload: Payload, wire, key) -> Payload:
    """``payload`` as its :func:`_half_type`, its wide floating arrays in ``wire`` (inferred fields, not sent,
    stay as they are)."""
    cls: Any = type(payload)
    values = {f.name: getattr(payload, f.name) for f in dataclasses.fields(cls)}
    wide = []
    for j, name in enumerate(_data_fields(cls)):
        if name in cls.inferred:
            wide.append((None,) * len(jax.tree.leaves(values[name])))
            continue
        values[name], dtypes = _to_wire(values[name], wire, None if key is None else jax.random.fold_in(key, j))
        wide.append(dtypes)
    return _half_type(cls)(**values, wide=tuple(wide))


def _restore(payload):
    """A :func:`_half_type` payload as the wrapped compressor's own (its floats cast back); others as they are
    (the payload a multi-round compressor builds from its sums)."""
    cls = getattr(type(payload), "half_of", None)
    if cls is None:
        return payload
    values = {f.name: getattr(payload, f.name) for f in dataclasses.fields(cls)}
    for name, dtypes in zip(_data_fields(cls), payload.wide):
        values[name] = _from_wire(values[name], dtypes)
    return cls(**values)


def _half_wire_bits(self) -> int | BitCount:
    """The wrapped format's bits less ``w − 16`` per sent entry of every leaf narrowed from ``w`` bits."""
    cls = type(self).half_of
    counted = dict(cls.counted)
    saved: Any = 0
    for name, dtypes in zip(_data_fields(cls), self.wide):
        for a, was in zip(jax.tree.leaves(getattr(self, name)), dtypes):
            if was is None:
                continue
            per_entry = jnp.dtype(was).itemsize * 8 - 16
            if name not in counted:
                saved = saved + per_entry * math.prod(jnp.shape(a))
                continue
            rows = jnp.sum(jnp.asarray(getattr(self, counted[name]), jnp.int32))
            saved = saved + BitCount.product(rows, per_entry * math.prod(jnp.shape(a)[1:]))
    bits = _restore(self).wire_bits()
    if isinstance(bits, int) and isinstance(saved, int):
        return bits - saved
    return BitCount.of(bits) - saved


def half(compressor: Compressor, dtype: str = "float16") -> Compressor:
    """``compressor`` with every floating array of its payload sent in 16 bits (float16 or bfloat16).

    Long because a wrapper's closures (compress, decompress, rounds, decompress_sum) share the wrapped
    compressor and the dtype; each is short.

    PyTorch's ``fp16_compress_wrapper``: ``compress`` runs the wrapped compressor, then
    casts each floating payload array wider than 16 bits (values, scales, norms, low-rank
    factors) to ``dtype``; integer arrays (indices, codes, counts) cross as they are.
    ``decompress`` casts them back and decodes in float32. A multi-round compressor
    (PowerSGD) sends each message of its ``rounds`` in 16 bits and continues from the sum
    cast back to float32. Sums over workers are those of the communicator on 16-bit
    arrays (float32 over MPI; ``compressed_mean``'s ``"auto"`` strategy sums 16-bit
    payloads in float32 at the chunk owners when a memory keeps the error).

    Wire bits: the wrapped format's, less ``w − 16`` bits per sent entry of each array
    narrowed from ``w`` bits (a top-k payload of ``k`` float32 values and ``b``-bit indices:
    ``k (16 + b)`` bits). Error feedback sees the rounding as part of the compression
    error: its memory keeps ``x − decompress(payload)`` of the 16-bit payload.

    Rounding, with unit roundoff ``u`` (``2⁻¹¹`` for float16, ``2⁻⁸`` for bfloat16) and
    every decoded entry one payload float times exact factors (a product of two for
    PowerSGD's rank-1 ``P Qᵀ``):

    * a biased ``compressor`` rounds to nearest; ``‖C(x) − Q(x)‖ ≤ ε ‖Q(x)‖`` with
      ``ε = 2u + u²``, so its declared ``δ`` (or ``δ(x)``) becomes
      ``1 − δ' = (√(1 − δ) + ε (1 + √(1 − δ)))²``: the uniform ``δ'`` where it is ``≥ 0``
      and the data-dependent ``δ'(x)`` (negative where ``δ`` is near 0) always;
    * an unbiased one rounds stochastically (``E[C(x)] = E[Q(x)] = x``, one spacing
      ``≤ 2u|v|`` at most, variance ``≤ u² v²`` per float ``v``), so
      ``ω' = ω + u² (1 + ω)``: error feedback refuses it where ``ω' ≥ 1`` and
      :func:`jaxcomm.compressors.contractive` scales it;
    * no contraction stays no contraction.

    Float16 entries below ``6.1e-5`` (subnormal) or above ``65504`` (overflow, to ±Inf)
    are outside the bound, as for :func:`jaxcomm.compressors.fp16`; bfloat16 has float32's range.
    So is a decoded entry that sums products of rounded floats: PowerSGD's single-round
    ``P Qᵀ`` at rank ``r > 1`` has ``ε`` up to ``(1 + √r) u``; its rounds, which round only the
    messages ``M Q`` and ``Mᵀ P`` around a float32 orthogonalisation, stay within ``ε`` on one
    worker (the 16-bit sum over workers rounds once more, as any 16-bit all-reduce does).

    Args:
      compressor: any :class:`Compressor`.
      dtype: ``"float16"`` or ``"bfloat16"``, the wire dtype of the floating arrays.
    Returns:
      A :class:`Compressor` named ``"half"`` with the wrapped one's strategy, state and
      randomness (stochastic too when it rounds stochastically); ``params`` holds
      ``compressor`` and ``dtype``.
    Raises:
      TypeError: ``compressor`` is not a Compressor.
      ValueError: ``dtype`` is neither ``"float16"`` nor ``"bfloat16"``.
    """
    if not isinstance(compressor, Compressor):
        raise TypeError(f"compressor must be a jaxcomm.compressors.Compressor; got {type(compressor).__name__}")
    if not isinstance(dtype, str) or dtype not in _WIRE:
        raise ValueError(f"dtype must be 'float16' or 'bfloat16' (the wire dtype); got {dtype!r}")
    wire, u = _WIRE[dtype], _UNIT_ROUNDOFF[dtype]
    inner = compressor
    stochastic_rounding = inner.unbiased  # keep E[C(x)] = x

    def compress(x, key, state):
        round_key = None
        if stochastic_rounding:
            key, round_key = jax.random.split(key)
        payload, state = inner.compress_fn(x, key, state)
        return _narrow(payload, wire, round_key), state

    def decompress(payload):
        return inner.decompress(_restore(payload))

    def rounds(x, key, state, size):
        assert inner.rounds is not None
        round_key = None
        if stochastic_rounding:
            key, round_key = jax.random.split(key)
        gen = inner.rounds(x, key, state, size)
        try:
            message = next(gen)
            r = 0
            while True:
                sent, dtypes = _to_wire(message, wire, None if round_key is None else jax.random.fold_in(round_key, r))
                total = yield sent
                message = gen.send(_from_wire(total, dtypes))
                r += 1
        except StopIteration as stop:
            return stop.value

    inner_sum = inner.decompress_sum

    def decompress_sum(gathered, acc_dtype):
        assert inner_sum is not None
        return inner_sum(_restore(gathered), acc_dtype)

    declared = _declare(inner, u)
    return Compressor(
        name="half",
        compress_fn=compress,
        decompress_fn=decompress,
        unbiased=inner.unbiased,
        strategy=inner.strategy,
        init_state=inner.init_state,
        rounds=None if inner.rounds is None else rounds,
        decompress_sum=None if inner_sum is None else decompress_sum,
        seed=inner.seed,
        params={"compressor": inner, "dtype": dtype},
        stochastic=True if stochastic_rounding else inner.stochastic,
        dense_warmup=inner.dense_warmup,
        **declared,
    )


def _declare(inner: Compressor, u: float) -> dict:
    """The bound of :func:`half` around ``inner`` (the rules in its docstring)."""
    where = f"{inner!r} ({inner.bound})" if inner.bound else repr(inner)
    if inner.no_contraction:
        return {"no_contraction": inner.no_contraction, "bound": f"no contraction: {inner.no_contraction}"}
    if inner.unbiased:
        if inner.variance_factor is None:
            return {}

        def variance_factor(d):
            omega = inner.omega(d)
            return float("nan") if omega is None else omega + u * u * (1.0 + omega)

        return {
            "variance_factor": variance_factor,
            "bound": f"ω' = ω + u²(1 + ω) with u = {u:.3g} (stochastic rounding to 16 bits) around {where}",
        }
    eps = 2 * u + u * u

    def widen(delta):  # 1 − δ' = (√(1 − δ) + ε(1 + √(1 − δ)))²
        r = math.sqrt(max(0.0, 1.0 - delta))
        return 1.0 - (r + eps * (1.0 + r)) ** 2

    def widen_traced(delta):
        r = jnp.sqrt(jnp.maximum(0.0, 1.0 - delta))
        return 1.0 - (r + eps * (1.0 + r)) ** 2

    out: dict = {"bound": f"1 − δ' = (√(1 − δ) + ε(1 + √(1 − δ)))², ε = 2u + u², u = {u:.3g}, around {where}"}
    if inner.contraction is not None:

        def contraction(d):
            delta = inner.delta(d)
            wider = float("nan") if delta is None else widen(delta)
            return wider if wider >= 0 else float("nan")

        out["contraction"] = contraction
    if inner.local_contraction is not None:
        local = inner.local_contraction
        out["local_contraction"] = lambda x: widen_traced(local(x)).astype(jnp.float32)
    elif inner.contraction is not None:

        def local_from_uniform(x):  # -inf (no bound) where the wrapped δ has no value at this size
            delta = inner.delta(int(x.size))
            return jnp.float32(-math.inf if delta is None else widen(delta))

        out["local_contraction"] = local_from_uniform
    return out
