"""Payload types: the base every payload derives from, and the tools to write a new one.

A payload is a pytree whose array leaves are exactly the wire format and
whose static fields (shape, dtype, counts known at trace time) are not sent;
``jaxcomm.compressors.wire_bits(payload)`` counts its bits. Write a new one
with :func:`payload_dataclass` and :func:`static_field` on a subclass of
:class:`Payload`:

>>> import jax, jax.numpy as jnp, jaxcomm as jc
>>> from jaxcomm.compressors.payloads import Payload, payload_dataclass, static_field
>>> @payload_dataclass
... class Halves(Payload):
...     values: jax.Array              # sent: 4 float16 entries, 64 bits
...     shape: tuple = static_field()  # not sent
>>> jc.compressors.wire_bits(Halves(values=jnp.zeros(4, jnp.float16), shape=(4,)))
64

:func:`array_bits` counts a payload's own arrays the way the format sends them
(counted fields: their valid rows; ``inferred`` fields: nothing);
the contract battery (:mod:`jaxcomm.testing`) requires ``wire_bits`` to equal it.

The built-in payloads are defined beside their compressors and reached through them (each
factory's docstring names what it sends): ``DensePayload`` (none, fp16, bf16),
``ScaledSignPayload`` (scaled_sign), ``SignPayload`` (signsgd, signum),
``MeanAbsSignPayload`` (efsignsgd), ``OneBitPayload`` (onebit),
``EightBitPayload``, ``QSGDPayload``, ``NaturalPayload``, ``TernaryPayload``
(terngrad), ``InceptionnPayload``, ``SketchPayload`` (sketchml),
``ClippedPayload`` (clipping), ``GridPayload`` (stochastic_rounding),
``SparsePayload`` (topk), ``RandomKPayload`` (randomk),
``CountSparsePayload`` (threshold, dgc, random_sparsification),
``MaskSparsePayload`` (random_sparsification), ``AdaptivePayload``,
``QSparsePayload``, ``PowerSGDPayload``. Per-array compressor states:
``SignumState``, ``PowerSGDState``.
"""

from ._base import Payload, array_bits, payload_dataclass, static_field

__all__ = [
    "Payload",
    "payload_dataclass",
    "static_field",
    "array_bits",
]
