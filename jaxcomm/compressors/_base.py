"""The compressor contract, exact wire accounting and the registry.

A compressor Q is two pure per-array functions,

    compress(x, key, state=None) -> (payload, new_state)
    decompress(payload)          -> x_hat            (same shape and dtype as x)

plus metadata (``name``, ``unbiased``, ``strategy``). The payload is the wire
format: its arrays are exactly what would be transmitted, and
:func:`wire_bits` counts them exactly (GRACE, Sec. III-A, counts one byte per
sign and int64 per index; we bit-pack, so our volumes are the true ones).

Every :class:`Compressor` is also an optax gradient transformation whose
``update`` is the local lossy round trip ``g -> Q^{-1}(Q(g))`` applied leaf by
leaf, so ``optax.chain(jaxcomm.compressors.topk(ratio=0.01), optax.sgd(0.1))`` works.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
from typing_extensions import dataclass_transform

from .._bitcount import BitCount
from .._keys import step_keys
from .._validate import check_choice, check_float_input, check_int, check_key, check_seed, lookup

Array = jax.Array
PRNGKey = jax.Array

__all__ = [
    "Compressor",
    "CompressorState",
    "Payload",
    "DensePayload",
    "wire_bits",
    "array_bits",
    "register",
    "make",
    "names",
]

COMPRESSOR_STRATEGIES = ("allreduce", "allgather")
"""What a compressor's payloads allow: summed as they are, or gathered (the pipeline has more strategies)."""


# --------------------------------------------------------------------------- #
# Payloads
# --------------------------------------------------------------------------- #
class Payload:
    """Base class of every payload (a pytree whose array leaves are sent).

    Subclasses are ``@payload_dataclass`` records. Static metadata (the
    original ``shape`` and ``dtype``, counts known at trace time) are pytree
    aux data and are *not* sent: both ends know the tensor's shape from the
    model. ``summable`` names the fields that an ``allreduce`` strategy may sum
    element-wise across workers (the others must be identical on every
    worker, e.g. a shared PRNG key).

    ``counted`` declares count-prefixed fields, pairs ``(field, count_field)``:
    only the first ``sum(count_field)`` rows (axis 0) of ``field`` are
    meaningful and the rest are zero, as in a fixed-capacity buffer of a
    variable number of entries. ``count_field`` is an int32 array (a scalar, or
    a few counts whose sum is the rows). The pipeline's all-gather
    (:func:`jaxcomm.comm.all_gather_counted`) then sends only the valid rows,
    and the counts in a small all-gather of their own.

    :meth:`wire_bits` is the format's own bit count, the one the compressor
    tables and papers quote: what a receiver needs. It equals the bits of the
    payload's own arrays (:func:`array_bits`): every array whole, only the
    valid rows of a ``counted`` field, and nothing for the fields named in
    ``inferred`` -- arrays a receiver recovers from the rest (a count implied
    by a mask or by class tags), which the payload holds for the pipeline but
    the format leaves out. :func:`jaxcomm.testing.check_wire_bits` checks the
    equality. What a step really sends -- counts, padding, unused capacity
    where a buffer crosses whole -- is counted by the pipeline
    (``CompressionState.wire_bits``).
    """

    summable: ClassVar[tuple[str, ...]] = ()
    counted: ClassVar[tuple[tuple[str, str], ...]] = ()
    inferred: ClassVar[tuple[str, ...]] = ()

    def wire_bits(self):
        """Exact bits of the format; default: every array leaf at its dtype width."""
        return _leaf_bits(self)


def _leaf_bits(tree) -> int:
    total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, Payload):  # pragma: no cover - nested payloads flatten
            total += leaf.wire_bits()
        else:
            total += int(np.prod(np.shape(leaf), dtype=np.int64)) * jnp.dtype(leaf.dtype).itemsize * 8
    return total


def array_bits(payload: Payload) -> int:
    """Bits of a payload's own arrays as its format sends them, read on the host.

    ``Σ`` over the payload's array fields of: the whole field (every leaf at its
    dtype width); for a ``counted`` field ``(field, count_field)``, only its
    first ``sum(count_field)`` rows (axis 0); for a field named in ``inferred``,
    nothing. For a correct payload this is :meth:`Payload.wire_bits`. Needs
    concrete arrays (it reads the counts), so it is not for use under ``jit``.
    """
    counted = dict(type(payload).counted)
    total = 0
    for f in dataclasses.fields(payload):  # type: ignore[arg-type]
        if f.metadata.get("static", False) or f.name in type(payload).inferred:
            continue
        value = getattr(payload, f.name)
        if f.name not in counted:
            total += _leaf_bits(value)
            continue
        a = np.asarray(value)
        rows = int(np.sum(np.asarray(getattr(payload, counted[f.name]), np.int64)))
        row_bits = (a.nbytes // a.shape[0]) * 8 if a.shape[0] else 0
        total += rows * row_bits
    return total


def static_field(**kwargs):
    """A payload field that is static metadata (shape, dtype, capacity)."""
    return dataclasses.field(metadata={"static": True}, **kwargs)


@dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field, static_field))
def payload_dataclass(cls):
    """Register ``cls`` as a frozen dataclass pytree.

    Fields declared with ``dataclasses.field(metadata={"static": True})`` are aux
    data (not traced, not sent); all others are array leaves.
    """
    cls = dataclasses.dataclass(frozen=True)(cls)
    fields = dataclasses.fields(cls)
    data = [f.name for f in fields if not f.metadata.get("static", False)]
    meta = [f.name for f in fields if f.metadata.get("static", False)]
    return jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=meta)


@payload_dataclass
class DensePayload(Payload):
    """A dense array sent as it is (possibly cast), e.g. by ``none`` and ``fp16``.

    Attributes:
      data: the transmitted array, shape ``shape``, dtype = wire dtype.
      dtype: dtype to restore on decompression (static).
    """

    data: Array
    dtype: Any = static_field()
    summable: ClassVar[tuple[str, ...]] = ("data",)


def wire_bits(payload) -> int | BitCount:
    """Exact number of bits a payload (or a pytree of payloads) puts on the wire.

    Packed sign/ternary codes count their packed bytes, indices their integer
    width, scalars 32 bits. Static metadata (shape, dtype) is not counted: both
    ends know the model. For fixed-size payloads the result is a Python ``int``;
    for count-based payloads (threshold methods with a fixed-capacity buffer) it
    is a scalar :class:`~jaxcomm.BitCount` computed from the count (two uint32
    words, exact up to ``2**64 - 2`` bits; ``int(bits)`` reads it on the host).

    Args:
      payload: a :class:`Payload`, or any pytree containing payloads.
    Returns:
      bits: ``int`` or a scalar :class:`~jaxcomm.BitCount`.
    """
    if isinstance(payload, Payload):
        return payload.wire_bits()
    parts = jax.tree_util.tree_leaves(payload, is_leaf=lambda n: isinstance(n, Payload))
    total: Any = 0
    for p in parts:
        total = total + (p.wire_bits() if isinstance(p, Payload) else _leaf_bits(p))
    return total


# --------------------------------------------------------------------------- #
# The compressor
# --------------------------------------------------------------------------- #
class CompressorState(NamedTuple):
    """optax state of a compressor used as a gradient transformation.

    Attributes:
      key: PRNG key (raw ``uint32[2]``), split once per step.
      leaf_states: tuple, one per-array compressor state per gradient leaf (in
        ``jax.tree.leaves`` order); ``()`` for stateless compressors.
    """

    key: Array
    leaf_states: tuple


def no_state(x):
    """The state of a stateless compressor: ``()`` for every array (the default ``init_state``)."""
    del x
    return ()


def _bound_fn(value, name: str):
    """A declared bound as ``d -> float``: ``None``, a callable, or a non-negative number (constant)."""
    if value is None or callable(value):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"{name} must be a callable d -> float, a number or None; got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be finite and >= 0; got {value}")
    return lambda d, _v=value: _v


def _finite_or_none(value) -> float | None:
    """A declared bound's value at one size; ``None`` (or NaN) means no bound at that size."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _check_hook(value, name: str):
    if value is not None and not callable(value):
        raise TypeError(f"{name} must be callable or None; got {type(value).__name__}")


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Compressor:
    """A lossy operator Q: pure per-array primitives, metadata, declared aggregation hooks.

    A frozen record, built with its fields as keywords, ``Compressor(name=...,
    compress_fn=..., decompress_fn=..., unbiased=..., strategy=...)``
    (``dataclasses.replace(c, seed=1)`` keeps every field). Every built-in factory
    declares its compressor's facts here: its error bound (``variance_factor``,
    ``contraction``, ``local_contraction`` or ``no_contraction``, with ``bound``, the
    source) and its randomness (``stochastic``). It is also an optax gradient
    transformation (``init``/``update``), whose update is the local lossy round
    trip ``g -> decompress(compress(g))`` per leaf, with per-leaf state and a PRNG
    key split once per step and per leaf, so
    ``optax.chain(jaxcomm.compressors.topk(ratio=0.01), optax.sgd(0.1))`` works.
    Communication is never done here: the transforms' pipeline
    (:mod:`jaxcomm.transforms`) runs every collective.

    Attributes:
      name: the registry name (``"topk"``, ...).
      compress_fn: ``(x, key, state) -> (payload, new_state)`` for one array
        (call it through :meth:`compress`, which checks the input).
      decompress_fn: ``payload -> x_hat`` with ``x``'s shape and dtype
        (the :meth:`decompress` method).
      unbiased: ``E[decompress(compress(x))] == x`` for every ``x``.
      strategy: ``"allreduce"`` when payloads can be summed as they are
        (fields ``Payload.summable``), else ``"allgather"``.
      init_state: ``x -> state`` for one array (default, or ``None``: stateless, ``()``).
      rounds: optional multi-round allreduce (PowerSGD): a generator function
        ``(x, key, state, size) -> payload, new_state`` that *yields* each
        message to be summed over the ``size`` workers and receives the sum
        (``total = yield message``); it returns a payload whose
        ``decompress`` is the *sum* over workers. The pipeline drives it
        (:func:`jaxcomm.transforms._collectives.run_rounds`) and counts every yielded
        message's bits.
      decompress_sum: optional ``(gathered, dtype) -> total``: given ``n``
        payloads stacked on a leading axis (what an all-gather returns), the
        sum ``sum_i decompress(gathered[i])`` in ``dtype`` (shape of ``x``), up
        to floating-point summation order (sparse payloads: one scatter-add of
        all ``n k`` entries). ``None``: the pipeline decompresses each and adds.
      compression_error: optional ``(x, payload) -> x − decompress(payload)``
        (shape and dtype of ``x``), the error an error-feedback memory keeps
        (sparse payloads: the sent entries of ``x`` zeroed in place). ``None``:
        the pipeline computes the difference.
      seed: seed of the optax transformation's key (``PRNGKey(seed)``).
      params: the hyper-parameters the factory was called with.
      variance_factor: for an unbiased compressor, ``d -> ω``: the declared bound
        ``E‖Q(x) − x‖² ≤ ω ‖x‖²`` for every ``x`` of ``d`` entries (a float is a
        constant ``ω``). ``None``: not declared.
      contraction: for a biased compressor, ``d -> δ`` in ``[0, 1]``: the declared
        bound ``E‖Q(x) − x‖² ≤ (1 − δ) ‖x‖²`` for every ``x`` of ``d`` entries (a
        float is a constant ``δ``; ``δ = 0`` declares a non-expansive operator,
        ``‖Q(x) − x‖ ≤ ‖x‖``, with no uniform contraction). ``None``: not declared.
      local_contraction: optional data-dependent bound, ``x -> δ(x)`` (a float32
        scalar, traceable) with ``E‖Q(x) − x‖² ≤ (1 − δ(x)) ‖x‖²`` for that ``x``;
        ``δ(x) < 0`` where ``Q`` may expand ``x`` (scaled sign: ``δ(x) =
        2‖x‖₁/(√d ‖x‖₂) − 1``).
      no_contraction: why ``Q`` has no bound ``E‖Q(x) − x‖² ≤ c ‖x‖²`` to declare
        (sign without a scale); empty when one is declared. Error feedback refuses
        such a compressor under a memory that needs a contraction
        (:attr:`jaxcomm.memory.Memory.needs_contraction`).
      bound: where the declared bound comes from (paper, lemma, derivation), or
        why there is none (default with ``no_contraction``: ``"no contraction: <why>"``).
      stochastic: whether ``compress`` draws from its key. ``True`` or ``None``
        (undeclared, the default of a custom compressor): :meth:`compress` and
        :meth:`roundtrip` need an explicit ``key`` (``TypeError`` without one: a
        silent fixed key would make every call the same "random" draw).
        ``False``: deterministic, the key may be omitted. Every built-in factory
        declares it.
      dense_warmup: steps at the start of training during which
        :func:`jaxcomm.transforms.compressed_mean` sends the gradient uncompressed
        (the dense all-reduce mean) and leaves the memory and the compressor's
        state untouched, so error feedback starts, from a zero memory, at the
        switch (PyTorch PowerSGD's ``start_powerSGD_iter``). ``0``: compress from
        the first step. :mod:`jaxcomm.testing` checks the declared bounds, and
        error feedback refuses an unbiased compressor whose ``ω ≥ 1``
        (:func:`jaxcomm.compressors.contractive` rescales it).
    """

    name: str
    compress_fn: Callable
    decompress_fn: Callable
    unbiased: bool
    strategy: str
    init_state: Callable = no_state  # None is taken as this: stateless
    rounds: Callable | None = None
    decompress_sum: Callable | None = None
    compression_error: Callable | None = None
    seed: int = 0
    params: dict = dataclasses.field(default_factory=dict)
    variance_factor: Callable[[int], float] | float | None = None
    contraction: Callable[[int], float] | float | None = None
    bound: str = ""
    stochastic: bool | None = None
    dense_warmup: int = 0
    local_contraction: Callable | None = None
    no_contraction: str = ""

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"name must be a non-empty string; got {self.name!r}")
        check_choice(self.strategy, "strategy", COMPRESSOR_STRATEGIES)
        if self.init_state is None:
            object.__setattr__(self, "init_state", no_state)
        for field in ("compress_fn", "decompress_fn", "init_state"):
            if not callable(getattr(self, field)):
                raise TypeError(f"{field} must be callable; got {type(getattr(self, field)).__name__}")
        for field in ("rounds", "decompress_sum", "compression_error", "local_contraction"):
            _check_hook(getattr(self, field), field)
        object.__setattr__(self, "dense_warmup", check_int(self.dense_warmup, "dense_warmup", minimum=0))
        if self.stochastic is not None and not isinstance(self.stochastic, bool):
            raise TypeError(f"stochastic must be True, False or None; got {self.stochastic!r}")
        object.__setattr__(self, "unbiased", bool(self.unbiased))
        object.__setattr__(self, "seed", check_seed(self.seed))
        object.__setattr__(self, "params", dict(self.params or {}))
        for field in ("variance_factor", "contraction"):
            object.__setattr__(self, field, _bound_fn(getattr(self, field), field))
        if self.variance_factor is not None and not self.unbiased:
            raise ValueError(
                "variance_factor (ω) is declared for unbiased compressors; a biased one declares contraction (δ)"
            )
        if not isinstance(self.bound, str):
            raise TypeError(
                f"bound must be a string (the source of the declared bound); got {type(self.bound).__name__}"
            )
        if not isinstance(self.no_contraction, str):
            raise TypeError(
                f"no_contraction must be a string (why no bound holds); got {type(self.no_contraction).__name__}"
            )
        declared = [f for f in ("variance_factor", "contraction", "local_contraction") if getattr(self, f) is not None]
        if self.no_contraction and declared:
            raise ValueError(
                f"no_contraction ({self.no_contraction!r}) says no error bound holds, but {', '.join(declared)} "
                "is declared too; declare one or the other"
            )
        if self.no_contraction and not self.bound:
            object.__setattr__(self, "bound", f"no contraction: {self.no_contraction}")

    def omega(self, d: int) -> float | None:
        """The declared variance factor ω for a tensor of ``d`` entries (``None`` if not declared)."""
        if self.variance_factor is None:
            return None
        return _finite_or_none(cast(Callable[[int], float], self.variance_factor)(int(d)))

    def delta(self, d: int) -> float | None:
        """The declared contraction δ for a tensor of ``d`` entries (``None`` if not declared).

        An unbiased compressor with ``ω < 1`` is a contraction with ``δ = 1 − ω``
        (``E‖Q(x) − x‖² ≤ ω ‖x‖²``), and that is returned when no δ is declared.
        """
        fn = cast(Callable[[int], float] | None, self.contraction)
        delta = None if fn is None else _finite_or_none(fn(int(d)))
        if delta is not None:
            return delta
        omega = self.omega(d)
        return 1.0 - omega if omega is not None and omega < 1.0 else None

    # -- per-array primitives ---------------------------------------------- #
    def compress(self, x, key=None, state=None):
        """``(payload, new_state)`` for one floating array ``x`` (``state`` defaults to ``init_state(x)``).

        ``key`` is required unless the compressor is deterministic (``stochastic=False``).

        Raises:
          TypeError: ``x`` is not a real floating array; ``key`` is not one PRNG key
            (``uint32[2]`` or a typed key), or is missing for a stochastic compressor.
          ValueError: ``x`` has no entries.
        """
        check_float_input(x, "x", nonempty=True)
        x = jnp.asarray(x)
        if key is not None:
            check_key(key, "key")
        if key is None:
            if self.stochastic is not False:
                raise TypeError(
                    f"{self!r} draws random numbers: pass key= explicitly, e.g. c.compress(x, jax.random.PRNGKey(0)) "
                    f"or c.roundtrip(x, key), and a fresh key per call (a default key would repeat the same draw)"
                )
            key = jax.random.PRNGKey(0)
        if state is None:
            state = self.init_state(x)
        return self.compress_fn(x, key, state)

    def decompress(self, payload):
        """``x_hat``: the payload decoded to the original shape and dtype.

        Raises:
          TypeError: ``payload`` is not a :class:`Payload`.
        """
        if not isinstance(payload, Payload):
            raise TypeError(
                f"payload must be a jaxcomm.compressors.Payload, as returned by {self!r}.compress; "
                f"got {type(payload).__name__}"
            )
        return self.decompress_fn(payload)

    def roundtrip(self, x, key=None, state=None):
        """``decompress(compress(x))``: the local lossy round trip of one array."""
        payload, state = self.compress(x, key, state)
        return self.decompress(payload), state

    def error(self, x, payload):
        """``x − decompress(payload)`` in ``x``'s dtype: the compression error of ``payload``
        (compressed from ``x``), via the ``compression_error`` hook when there is one."""
        if self.compression_error is not None:
            return self.compression_error(x, payload)
        return x - self.decompress(payload).astype(jnp.result_type(x))

    def check_state(self, x, state, name: str = "state") -> None:
        """Raise ``ValueError`` if ``state`` is not shaped like ``init_state(x)`` (stateful compressors).

        A compressor's per-array state (PowerSGD's ``Q``, signum's momentum) is built for one
        shape; an update with another shape must fail here, not deep inside the arithmetic.
        Checked on shapes and dtypes only (``jax.eval_shape``), so it costs nothing at run time.
        """
        if self.init_state is no_state and not jax.tree_util.tree_leaves(state):
            return  # stateless: nothing shaped to compare
        want = jax.eval_shape(self.init_state, jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)))
        got_def: Any = jax.tree_util.tree_structure(state)
        want_def: Any = jax.tree_util.tree_structure(want)
        got = [tuple(jnp.shape(a)) for a in jax.tree_util.tree_leaves(state)]
        expect = [tuple(a.shape) for a in jax.tree_util.tree_leaves(want)]
        if got_def != want_def or got != expect:
            raise ValueError(
                f"updates: a tensor of shape {tuple(jnp.shape(x))} does not match its {self.name!r} {name}, "
                f"initialised for another shape (state shapes {got}, expected {expect}); init and update must see "
                "the same tree with the same leaf shapes"
            )

    # -- optax gradient transformation ------------------------------------- #
    def init(self, params_tree) -> CompressorState:
        """optax ``init``: the key ``PRNGKey(seed)`` and one compressor state per leaf."""
        leaves = jax.tree_util.tree_leaves(params_tree)
        for leaf in leaves:
            check_float_input(leaf, "params", nonempty=True)
        return CompressorState(
            key=jax.random.PRNGKey(self.seed),
            leaf_states=tuple(self.init_state(jnp.asarray(leaf)) for leaf in leaves),
        )

    def update(self, updates, state: CompressorState, params_tree=None, **extra_args):
        """optax ``update``: every leaf replaced by its lossy round trip; ``key, step_key = split(key)``
        and leaf ``i`` uses ``split(step_key, num_leaves)[i]``.

        Raises:
          ValueError: ``updates`` has another number of leaves than ``init`` saw, an empty leaf, or
            (stateful compressors) a leaf whose shape its state was not built for.
          TypeError: a leaf is not real floating point.
        """
        del params_tree, extra_args
        leaves, treedef = jax.tree_util.tree_flatten(updates)
        if len(leaves) != len(state.leaf_states):
            raise ValueError(
                f"updates has {len(leaves)} leaves but the compressor state was initialised "
                f"for {len(state.leaf_states)}; init and update must see the same tree"
            )
        for g, s in zip(leaves, state.leaf_states):
            check_float_input(g, "updates", nonempty=True)
            self.check_state(g, s)
        key, keys = step_keys(state.key, len(leaves))
        out, new_states = [], []
        for i, (g, s) in enumerate(zip(leaves, state.leaf_states)):
            g_hat, s = self.roundtrip(g, keys[i], s)
            out.append(g_hat)
            new_states.append(s)
        return jax.tree_util.tree_unflatten(treedef, out), CompressorState(key, tuple(new_states))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"jaxcomm.compressors.{self.name}({args})"


# --------------------------------------------------------------------------- #
# Registry
# --------------------------------------------------------------------------- #
_REGISTRY: dict[str, Callable[..., Compressor]] = {}


def register(name: str, *, overwrite: bool = False):
    """Decorator: register a compressor factory under ``name`` (returned unchanged).

    A factory declares its compressor's facts itself (the error bound and its source,
    whether ``compress`` draws from its key), as :class:`Compressor` fields.

    Args:
      name: the registry name (``make(name, ...)``).
      overwrite: replace a factory already registered under ``name`` (e.g. when a
        notebook cell that registers it runs again); ``False`` raises instead.
    Raises:
      ValueError: ``name`` is already registered and ``overwrite`` is false.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty string; got {name!r}")

    def deco(factory):
        if name in _REGISTRY and not overwrite:
            raise ValueError(
                f"compressor {name!r} is already registered; pass register({name!r}, overwrite=True) to replace it"
            )
        _REGISTRY[name] = factory
        return factory

    return deco


def make(name: str, **kwargs) -> Compressor:
    """Build a registered compressor by name: ``make("topk", ratio=0.01)``.

    Raises:
      ValueError: unknown name (the message lists the valid ones).
    """
    return lookup(_REGISTRY, name, "compressor")(**kwargs)


def names() -> list[str]:
    """Sorted names of every registered compressor."""
    return sorted(_REGISTRY)
