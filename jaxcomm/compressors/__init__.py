"""Gradient compressors: pure lossy operators with exact wire accounting.

Each factory returns a :class:`Compressor`: an optax gradient transformation
(local lossy round trip) that also exposes ``compress``/``decompress`` per array.

>>> import jax, jax.numpy as jnp, jaxcomm as jc
>>> c = jc.compressors.topk(ratio=0.25)
>>> payload, _ = c.compress(jnp.arange(8.0), jax.random.PRNGKey(0))
>>> c.decompress(payload).tolist()
[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 6.0, 7.0]
"""

from ._base import (
    Compressor,
    CompressorState,
    DensePayload,
    Payload,
    make,
    names,
    payload_dataclass,
    register,
    static_field,
    wire_bits,
)
from ._primitives import (
    dequantize,
    desparsify,
    index_dtype,
    pack,
    packed_size,
    quantize,
    sparsify,
    unpack,
)
from ._basic import bf16, fp16, none
from ._scaled_sign import ScaledSignPayload, scaled_sign
from ._quantize import (
    ClippedPayload,
    EightBitPayload,
    GridPayload,
    InceptionnPayload,
    NaturalPayload,
    QSGDPayload,
    SketchPayload,
    TernaryPayload,
    clipping,
    eightbit,
    inceptionn,
    natural,
    qsgd,
    sketchml,
    stochastic_rounding,
    terngrad,
)
from ._sign import MeanAbsSignPayload, OneBitPayload, SignPayload, SignumState, efsignsgd, onebit, signsgd, signum
from ._kernels.select import (
    CountSparsePayload,
    MaskSparsePayload,
    RandomKPayload,
    SparsePayload,
    dgc,
    random_sparsification,
    randomk,
    threshold,
    topk,
)
from ._hybrid import AdaptivePayload, QSparsePayload, adaptive, qsparse
from ._lowrank import PowerSGDPayload, PowerSGDState, powersgd

__all__ = [
    "Compressor",
    "CompressorState",
    "DensePayload",
    "Payload",
    "payload_dataclass",
    "static_field",
    "make",
    "names",
    "register",
    "wire_bits",
    "pack",
    "unpack",
    "packed_size",
    "index_dtype",
    "sparsify",
    "desparsify",
    "quantize",
    "dequantize",
    "none",
    "fp16",
    "bf16",
    "scaled_sign",
    "ScaledSignPayload",
    "eightbit",
    "onebit",
    "signsgd",
    "signum",
    "efsignsgd",
    "qsgd",
    "natural",
    "terngrad",
    "inceptionn",
    "sketchml",
    "clipping",
    "stochastic_rounding",
    "EightBitPayload",
    "OneBitPayload",
    "SignPayload",
    "MeanAbsSignPayload",
    "SignumState",
    "QSGDPayload",
    "NaturalPayload",
    "TernaryPayload",
    "InceptionnPayload",
    "SketchPayload",
    "ClippedPayload",
    "GridPayload",
    "randomk",
    "topk",
    "threshold",
    "dgc",
    "random_sparsification",
    "adaptive",
    "qsparse",
    "powersgd",
    "SparsePayload",
    "RandomKPayload",
    "CountSparsePayload",
    "MaskSparsePayload",
    "AdaptivePayload",
    "QSparsePayload",
    "PowerSGDPayload",
    "PowerSGDState",
]
