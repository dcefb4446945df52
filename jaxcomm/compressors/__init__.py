"""Gradient compressors: pure lossy operators with exact wire accounting.

Each factory returns a :class:`Compressor`: an optax gradient transformation
(local lossy round trip) that also exposes ``compress``/``decompress`` per array.
Payload types (what is sent) are in :mod:`jaxcomm.compressors.payloads`.

>>> import jax, jax.numpy as jnp, jaxcomm as jc
>>> c = jc.compressors.topk(ratio=0.25)
>>> payload, _ = c.compress(jnp.arange(8.0), jax.random.PRNGKey(0))
>>> c.decompress(payload).tolist()
[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 6.0, 7.0]
"""

from .._bitcount import BitCount
from . import payloads
from ._base import Compressor, make, names, register, wire_bits
from ._basic import bf16, fp16, none
from ._clipping import clipping
from ._contractive import contractive
from ._eightbit import eightbit
from ._half import half
from ._hybrid import adaptive, qsparse
from ._inceptionn import inceptionn
from ._lowrank import powersgd
from ._primitives import dequantize, desparsify, index_dtype, pack, packed_size, quantize, sparsify, unpack
from ._random_sparsification import random_sparsification
from ._randomk import randomk
from ._scaled_sign import scaled_sign
from ._sign import efsignsgd, onebit, signsgd, signum
from ._sketchml import sketchml
from ._stochastic import natural, qsgd, stochastic_rounding, terngrad
from ._threshold import dgc, threshold
from ._topk import topk

__all__ = [
    "BitCount",
    # the contract and the registry
    "Compressor",
    "make",
    "names",
    "register",
    "wire_bits",
    "payloads",
    # GRACE's helper operators, for writing a compressor
    "pack",
    "unpack",
    "packed_size",
    "index_dtype",
    "sparsify",
    "desparsify",
    "quantize",
    "dequantize",
    # factories
    "none",
    "fp16",
    "bf16",
    "scaled_sign",
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
    "contractive",
    "half",
    "stochastic_rounding",
    "randomk",
    "topk",
    "threshold",
    "dgc",
    "random_sparsification",
    "adaptive",
    "qsparse",
    "powersgd",
]
