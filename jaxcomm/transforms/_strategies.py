"""The strategies: how the workers' payloads of every compressed tensor become the sum ``Σ_i Q⁻¹(p_i)``.

One function per strategy, dispatched by :data:`TABLE` (keyed by the strategy's name, with the
collectives it runs); each takes the exchange's inputs (:class:`Job`) and returns one
:class:`Exchanged`:

* :func:`allreduce`: the payloads' ``summable`` fields are summed by one all-reduce (per dtype,
  with ``fuse``) and decompressed once, ``Q⁻¹(Σ_i p_i)``; a compressor with ``rounds``
  (PowerSGD) instead yields its messages, which :func:`rounds` sums in turn.
* :func:`allgather`: every payload is gathered and decompressed; with ``fuse``, the payloads of
  at most :data:`~jaxcomm.transforms._collectives.FUSE_MAX_BYTES` share one collective.
* :func:`broadcast`: each worker's payload is broadcast in turn.
* :func:`reduce_scatter`: each worker owns one of ``n`` chunks of every tensor; the chunks travel
  compressed to their owners (``n − 1`` permutation rounds), each owner decompresses and averages
  its chunk in float32, compresses the average again (:class:`Owner`), and the compressed chunks
  are all-gathered.

With one worker the single-round strategies send nothing: each payload is decompressed where it
was made (:func:`_finish`), and its bits are the payload's own count.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import memory as memory_lib
from .._bitcount import BitCount
from ..comm._protocol import ALL_GATHER, BROADCAST, PERMUTE, SUM
from ..compressors import Compressor, wire_bits
from ._collectives import (
    LOCAL,
    accumulator,
    batched_rounds,
    fused_sum,
    gather_payloads,
    run_rounds_together,
    sent_bits,
    sum_decompressed,
)

__all__ = [
    "STRATEGIES",
    "TABLE",
    "Exchanged",
    "Owned",
    "Owner",
    "exchange",
    "from_chunks",
    "stack_bits",
    "to_chunks",
]


class Owner(NamedTuple):
    """The chunk owners' step under ``"reduce_scatter"``: compress the averaged chunk again.

    Attributes:
      compressor: the owners' compressor (stateless, single-round).
      memory: the owners' error feedback (``none()`` for a plain compressed mean;
        DoubleSqueeze's server error with ``residual()``).
      memory_leaves: per tensor, the owner memory state over the whole tensor
        (each owner reads and writes only its chunk).
      keys: per tensor, the key the owners draw from (folded with the owner index).
      fold_rounding: return, in place of the owner memories, each owner's
        ``n (mean − Q(mean))`` on its chunk (zero elsewhere, the tensor's shape and
        dtype): what a plain compressed mean with error feedback adds to the owner's
        worker memory so the re-compression's rounding is fed back too.
    """

    compressor: Compressor
    memory: memory_lib.Memory
    memory_leaves: Sequence
    keys: Sequence
    fold_rounding: bool = False


def stack_bits(bits: Sequence) -> BitCount:
    """Scalar counts, one per tensor, as one :class:`~jaxcomm.BitCount` of shape ``(num_tensors,)``."""
    return BitCount.stack(bits) if bits else BitCount.zeros((0,))


class Owned(NamedTuple):
    """What the chunk owners produced under ``"reduce_scatter"``, per compressed tensor.

    Attributes:
      bits: scalar :class:`~jaxcomm.BitCount` values, bits of the averaged chunk this worker
        sent as an owner (the final all-gather).
      memory: the owners' new memories over the whole tensor (this worker wrote its chunk), or
        with :attr:`Owner.fold_rounding` its ``n (mean − Q(mean))`` on its chunk.
    """

    bits: list
    memory: list

    def wire_bits(self) -> BitCount:
        """:attr:`bits` as one count of shape ``(num_tensors,)``."""
        return stack_bits(self.bits)


class Exchanged(NamedTuple):
    """What one exchange produced, per compressed tensor (lists in tensor order).

    Attributes:
      payloads: this worker's payloads (``"reduce_scatter"``: its ``n`` chunk payloads, stacked).
      states: the compressors' new per-tensor states.
      totals: ``Σ_i Q⁻¹(p_i)`` in float32 (or wider), or ``None`` under
        ``"reduce_scatter"``, whose owners average instead.
      means: ``totals / n`` in float32 or wider (``"reduce_scatter"``: the
        all-gathered owners' averages, in the tensor's dtype).
      own: this worker's own reconstruction ``Q⁻¹(p_i)``, when it is not
        recovered from the error hook (``None`` otherwise).
      errors: ``φ_i − Q⁻¹(p_i)`` per tensor where the memory keeps the
        error (``memory.from_error``); ``None`` entries otherwise.
      bits: scalar :class:`~jaxcomm.BitCount` values, bits this worker sent per tensor.
      messages: arrays handed to collectives (Python int).
      owner: the owners' part (:class:`Owned`) under ``"reduce_scatter"``; ``None`` otherwise.
    """

    payloads: list
    states: list
    totals: list
    means: list
    own: list
    errors: list
    bits: list
    messages: int
    owner: Owned | None


class Job(NamedTuple):
    """One exchange's inputs, what every strategy function takes (lists in tensor order).

    Attributes:
      comm: the communicator; n: its size; index: this worker's index (traced).
      phis: the compensated tensors ``φ_i``; keys: one leaf key each; states: the compressors'
        per-tensor states; compressors: one per tensor.
      acc: the dtype each tensor's sum runs in (:func:`~._collectives.accumulator`).
      fuse: share collectives between small payloads.
      memory: the worker memory (``None``: no error hook is asked for).
      owner: the owners' step (``"reduce_scatter"`` only).
    """

    comm: Any
    n: int
    index: Any
    phis: list
    keys: list
    states: list
    compressors: list
    acc: list
    fuse: bool
    memory: memory_lib.Memory | None
    owner: Owner | None

    @property
    def want_error(self) -> bool:
        """Whether the memory keeps the compression error (``memory.from_error``)."""
        return self.memory is not None and self.memory.from_error is not None


class Summed(NamedTuple):
    """Tensors a strategy compressed (and, with more than one worker, summed): dicts keyed by tensor index.

    Attributes:
      payloads, states: each tensor's payload and new compressor state.
      totals: ``Σ_i Q⁻¹(p_i)`` in the tensor's accumulator dtype; a tensor missing here is
        decompressed locally by :func:`_finish` (one worker: nothing was sent).
      bits: scalar :class:`~jaxcomm.BitCount` values, bits this worker sent per tensor.
      messages: arrays handed to collectives.
    """

    payloads: dict
    states: dict
    totals: dict
    bits: dict
    messages: int


# --------------------------------------------------------------------------- #
# Single-round payloads
# --------------------------------------------------------------------------- #
def _data_fields(payload) -> list[str]:
    if not dataclasses.is_dataclass(payload):
        raise TypeError(
            f"strategy='allreduce' needs a dataclass payload (jaxcomm.compressors.payloads.payload_dataclass); "
            f"got {type(payload).__name__}"
        )
    return [f.name for f in dataclasses.fields(payload) if not f.metadata.get("static", False)]


def _summable_fields(compressor: Compressor, payload) -> tuple:
    fields = _data_fields(payload)
    summable = tuple(type(payload).summable)
    unknown = [f for f in summable if f not in fields]
    if not summable or unknown:
        raise ValueError(
            f"compressor {compressor.name!r} has strategy 'allreduce' but its payload "
            f"{type(payload).__name__} names summable fields {summable} (array fields: {fields})"
        )
    return summable


def _compress(job: Job, idx: Sequence[int], summed: bool) -> Summed:
    """Tensors ``idx`` compressed, no sums yet; the worker index is folded into each key (``n > 1``).

    ``summed``: the payloads' ``summable`` fields will be all-reduced, so their other fields must
    agree on every worker (compressed again with the shared key) and only the summed fields count;
    otherwise a payload counts its own format's bits (:func:`~jaxcomm.compressors.wire_bits`).
    """
    payloads, states, bits = {}, {}, {}
    for i in idx:
        phi, key, state, c = job.phis[i], job.keys[i], job.states[i], job.compressors[i]
        payload, new_state = c.compress(phi, key if job.n == 1 else jax.random.fold_in(key, job.index), state)
        if summed:
            summable = _summable_fields(c, payload)
            if job.n > 1 and any(f not in summable for f in _data_fields(payload)):
                # Fields that are not summed must agree on every worker: compress with the shared key.
                payload, new_state = c.compress(phi, key, state)
            bits[i] = sent_bits([getattr(payload, f) for f in summable])
        else:
            bits[i] = BitCount.of(wire_bits(payload))
        payloads[i], states[i] = payload, new_state
    return Summed(payloads, states, {}, bits, 0)


def _finish(job: Job, sent: Summed, multi_round: Summed | None = None) -> Exchanged:
    """The exchange from what the strategy ``sent`` (and, under ``"allreduce"``, the :func:`rounds` of the
    ``multi_round`` tensors).

    A tensor without a total (one worker: nothing was sent) is decompressed here. Each tensor's
    reconstruction for the memory: ``total / n`` for a multi-round tensor (GRACE's and PyTorch's PowerSGD
    convention: the memory keeps the aggregated reconstruction), else the compressor's ``error`` where
    the memory keeps the error, else ``Q⁻¹(p_i)``.
    """
    rounds_part = multi_round if multi_round is not None else Summed({}, {}, {}, {}, 0)
    payloads, states = {**sent.payloads, **rounds_part.payloads}, {**sent.states, **rounds_part.states}
    totals_of, bits = {**sent.totals, **rounds_part.totals}, {**sent.bits, **rounds_part.bits}
    count = len(job.phis)
    totals: list[Any] = [
        totals_of[i] if i in totals_of else job.compressors[i].decompress(payloads[i]).astype(job.acc[i])
        for i in range(count)
    ]
    own: list[Any] = []
    errors: list[Any] = []
    for i, (phi, c, total) in enumerate(zip(job.phis, job.compressors, totals)):
        if i in rounds_part.payloads:
            own.append((total / job.n).astype(jnp.result_type(phi)))
            errors.append(None)
        elif job.want_error:
            own.append(None)
            errors.append(c.error(phi, payloads[i]))
        else:
            own.append(c.decompress(payloads[i]))
            errors.append(None)
    return Exchanged(
        payloads=[payloads[i] for i in range(count)],
        states=[states[i] for i in range(count)],
        totals=totals,
        means=[t / job.n for t in totals],
        own=own,
        errors=errors,
        bits=[bits[i] for i in range(count)],
        messages=sent.messages + rounds_part.messages,
        owner=None,
    )


# --------------------------------------------------------------------------- #
# The strategies
# --------------------------------------------------------------------------- #
def rounds(job: Job, idx: Sequence[int]) -> Summed:
    """Multi-round tensors ``idx`` (``"allreduce"``): each message summed over the workers in turn.

    Tensors of one matrix view run as one batch (:func:`~._collectives.batched_rounds`), the others in
    lockstep (:func:`~._collectives.run_rounds_together`; with ``fuse``, one all-reduce per round for
    their small messages). Bits: every message this worker contributed; with one worker the rounds
    run over :data:`~._collectives.LOCAL` and no collective is counted.
    """
    comm = job.comm if job.n > 1 else LOCAL
    batched, messages = batched_rounds(comm, job.phis, job.keys, job.states, job.compressors) if idx else ({}, 0)
    lockstep = [i for i in idx if i not in batched]
    ran, collectives = run_rounds_together(
        comm, [(job.compressors[i], job.phis[i], job.keys[i], job.states[i]) for i in lockstep], job.fuse and job.n > 1
    )
    together = dict(zip(lockstep, ran))
    payloads, states, totals, bits = {}, {}, {}, {}
    for i in idx:
        if i in batched:
            payloads[i], states[i], sent, total = batched[i]
        else:
            payloads[i], states[i], sent = together[i]
            total = job.compressors[i].decompress(payloads[i])
        bits[i], totals[i] = sent_bits(sent), total.astype(job.acc[i])
    return Summed(payloads, states, totals, bits, messages + collectives if job.n > 1 else 0)


def allreduce(job: Job) -> Exchanged:
    """The summable fields of every single-round payload with one all-reduce per dtype (``fuse``), decompressed
    once; tensors whose compressor has ``rounds`` through :func:`rounds`."""
    multi = [i for i, c in enumerate(job.compressors) if c.rounds is not None]
    done = rounds(job, multi)
    sent = _compress(job, [i for i in range(len(job.phis)) if i not in multi], summed=True)
    if job.n > 1 and sent.payloads:
        fields = [{f: getattr(p, f) for f in type(p).summable} for p in sent.payloads.values()]
        sums, messages = fused_sum(job.comm, fields, job.fuse)
        totals = {
            i: job.compressors[i].decompress(dataclasses.replace(p, **s)).astype(job.acc[i])
            for (i, p), s in zip(sent.payloads.items(), sums)
        }
        sent = sent._replace(totals=totals, messages=messages)
    return _finish(job, sent, done)


def allgather(job: Job) -> Exchanged:
    """Every payload gathered (:func:`~._collectives.gather_payloads`) and decompressed, summed per tensor."""
    sent = _compress(job, range(len(job.phis)), summed=False)
    if job.n > 1 and sent.payloads:
        idx = list(sent.payloads)
        gathered, bits, messages = gather_payloads(job.comm, list(sent.payloads.values()), job.fuse)
        totals = {i: sum_decompressed(job.compressors[i], g, job.n, job.acc[i]) for i, g in zip(idx, gathered)}
        sent = sent._replace(totals=totals, bits=dict(zip(idx, bits)), messages=messages)
    return _finish(job, sent)


def broadcast(job: Job) -> Exchanged:
    """Root ``r``'s payload to everyone, for ``r = 0 .. n−1``; the whole payload crosses and is counted."""
    sent = _compress(job, range(len(job.phis)), summed=False)
    if job.n > 1:
        totals, bits, messages = {}, {}, 0
        for i, payload in sent.payloads.items():
            c, a = job.compressors[i], job.acc[i]
            total = jnp.zeros(jnp.shape(job.phis[i]), a)
            for r in range(job.n):
                total = total + c.decompress(job.comm.broadcast(payload, r)).astype(a)
            messages += job.n * len(jax.tree.leaves(payload))
            totals[i], bits[i] = total, sent_bits(payload)
        sent = sent._replace(totals=totals, bits=bits, messages=messages)
    return _finish(job, sent)


# --------------------------------------------------------------------------- #
# reduce-scatter: chunks travel compressed to their owners
# --------------------------------------------------------------------------- #
def _chunk_len(size: int, n: int) -> int:
    return -(-size // n)


def to_chunks(x, n: int):
    """``x`` flattened, zero-padded to ``n·c`` entries (``c = ceil(size/n)``) and reshaped ``(n, c)``."""
    flat = jnp.ravel(x)
    c = _chunk_len(flat.shape[0], n)
    return jnp.pad(flat, (0, n * c - flat.shape[0])).reshape(n, c)


def from_chunks(chunks, shape):
    """Inverse of :func:`to_chunks`: drop the padding, restore ``shape``."""
    size = int(np.prod(shape, dtype=np.int64))
    return chunks.reshape(-1)[:size].reshape(shape)


def _take_chunk(x, n: int, me):
    return jax.lax.dynamic_index_in_dim(to_chunks(x, n), me, keepdims=False)


def _put_chunk(full, part, n: int, me):
    chunks = jax.lax.dynamic_update_index_in_dim(to_chunks(full, n), part.astype(full.dtype), me, 0)
    return from_chunks(chunks, jnp.shape(full))


def _to_owners(comm, stacked: list, n: int, me) -> tuple[list, list, int]:
    """Compressed all-to-all in ``n − 1`` permutation rounds: in round ``r``, chunk ``(me + r) % n`` goes to
    its owner. ``(received, bits, messages)``: ``received[r][i]`` is tensor ``i``'s chunk payload from
    worker ``me − r``; the bits count each chunk payload whole (capacity buffers included)."""
    received = [jax.tree.map(lambda a: a[me], stacked)]
    sent: list[Any] = [0] * len(stacked)
    messages = 0
    for r in range(1, n):
        send = jax.tree.map(lambda a, r=r: a[(me + r) % n], stacked)
        sent = [b + sent_bits(p) for b, p in zip(sent, send)]
        messages += len(jax.tree.leaves(send))
        received.append(comm.permute(send, [(s, (s + r) % n) for s in range(n)]))
    return received, [BitCount.of(b) for b in sent], messages


def _at_owner(job: Job, i: int, received: list) -> tuple[Any, Any]:
    """This worker as the owner of its chunk of tensor ``i``: average the ``received`` chunk payloads in
    the accumulator dtype, compensate with the owner memory, compress again. ``(payload, owner memory)``."""
    owner, n, me = job.owner, job.n, job.index
    assert owner is not None  # reduce_scatter checks it first
    phi, c, a = job.phis[i], job.compressors[i], job.acc[i]
    dtype = jnp.result_type(phi)
    size = int(np.size(phi))
    clen = _chunk_len(size, n)
    real = me * clen + jnp.arange(clen) < size  # entries of this chunk that are not padding
    total = jnp.zeros((clen,), a)
    for rec in received:
        total = total + c.decompress(rec).astype(a)
    mean = jnp.where(real, total / n, 0).astype(dtype)
    full_mem = owner.memory_leaves[i]
    m = jax.tree.map(lambda s: _take_chunk(s, n, me), full_mem)
    v = owner.memory.compensate(m, mean)
    payload, _ = owner.compressor.compress(v, jax.random.fold_in(owner.keys[i], me), ())
    q = jnp.where(real, owner.compressor.decompress(payload), 0).astype(v.dtype)
    if owner.fold_rounding:
        rounding = jnp.where(real, (mean.astype(a) - q.astype(a)) * n, 0).astype(dtype)
        return payload, _put_chunk(jnp.zeros(jnp.shape(phi), dtype), rounding, n, me)
    new_m = owner.memory.update(m, mean, v, q)
    return payload, jax.tree.map(lambda full, part: _put_chunk(full, part, n, me), full_mem, new_m)


def reduce_scatter(job: Job) -> Exchanged:
    """Chunks to their owners compressed (:func:`_to_owners`), averaged and compressed again there
    (:func:`_at_owner`), the owners' chunks all-gathered. A worker sends ``(n − 1)`` chunk payloads and
    one averaged chunk, about ``2 (n − 1) / n`` of its payload whatever ``n``."""
    if job.owner is None:
        raise ValueError("strategy 'reduce_scatter' needs the owners' step (Owner)")
    n, me = job.n, job.index
    payloads, own, errors = [], [], []
    for phi, key, c in zip(job.phis, job.keys, job.compressors):
        # Independent draws per worker, except for summable payloads (their shared fields must agree).
        k = key if c.strategy == "allreduce" else jax.random.fold_in(key, me)
        chunk_payloads = jax.vmap(lambda x, kk, c=c: c.compress(x, kk, ())[0])(
            to_chunks(phi, n), jax.random.split(k, n)
        )
        g_hat = from_chunks(jax.vmap(c.decompress)(chunk_payloads), jnp.shape(phi)).astype(jnp.result_type(phi))
        own.append(None if job.want_error else g_hat)
        errors.append((phi - g_hat).astype(jnp.result_type(phi)) if job.want_error else None)
        payloads.append(chunk_payloads)
    received, bits, messages = _to_owners(job.comm, payloads, n, me)
    at_owners = [_at_owner(job, i, [rec[i] for rec in received]) for i in range(len(payloads))]
    owner_payloads = [payload for payload, _ in at_owners]
    gathered = job.comm.all_gather(owner_payloads)
    messages += len(jax.tree.leaves(owner_payloads))
    means = [
        from_chunks(jax.vmap(job.owner.compressor.decompress)(g), jnp.shape(phi)).astype(jnp.result_type(phi))
        for phi, g in zip(job.phis, gathered)
    ]
    count = len(payloads)
    owned = Owned([sent_bits(p) for p in owner_payloads], [memory for _, memory in at_owners])
    return Exchanged(payloads, [()] * count, [None] * count, means, own, errors, bits, messages, owned)


# --------------------------------------------------------------------------- #
# The table
# --------------------------------------------------------------------------- #
class Strategy(NamedTuple):
    """One row of :data:`TABLE`: the function that runs the strategy, and the collectives it needs
    (:func:`jaxcomm.comm.require`)."""

    run: Callable[[Job], Exchanged]
    needs: tuple[str, ...]


TABLE = {
    "allreduce": Strategy(allreduce, (SUM,)),
    "allgather": Strategy(allgather, (ALL_GATHER,)),
    "broadcast": Strategy(broadcast, (BROADCAST,)),
    "reduce_scatter": Strategy(reduce_scatter, (PERMUTE, ALL_GATHER)),
}
"""The strategies by name."""

STRATEGIES = tuple(TABLE)
"""The ways the pipeline turns payloads into a sum over workers: ``("allreduce", "allgather", "broadcast",
"reduce_scatter")`` (see :mod:`jaxcomm.transforms._strategies`)."""


def exchange(
    comm,
    phis: list,
    keys: list,
    states: list,
    compressors: list,
    strategy: str,
    *,
    fuse: bool = True,
    memory: memory_lib.Memory | None = None,
    owner: Owner | None = None,
) -> Exchanged:
    """Compress every tensor of ``phis``, communicate with ``strategy``, aggregate: ``TABLE[strategy].run``.

    Args:
      comm: the communicator (``size``, ``index()`` and the strategy's collectives).
      phis: the compensated tensors ``φ_i`` (any shapes, floating dtypes).
      keys: one leaf key per tensor (:func:`~jaxcomm._keys.step_keys`); the
        worker index is folded in where workers must draw independently.
      states: the compressors' per-tensor states.
      compressors: one compressor per tensor.
      strategy: one of :data:`STRATEGIES`.
      fuse: gather small payloads with one collective (``"allgather"``); sum the small
        summable fields, and each round's small messages of multi-round compressors,
        with one all-reduce per dtype (``"allreduce"``; :func:`~jaxcomm.comm._packing.sum_packed`).
      memory: the worker memory; when it keeps the compression error
        (``from_error``), ``errors`` come from each compressor's ``error``.
      owner: the owners' step (``"reduce_scatter"`` only).
    """
    n = int(comm.size)
    acc = [accumulator(jnp.result_type(phi)) for phi in phis]
    job = Job(comm, n, comm.index(), phis, keys, states, compressors, acc, fuse, memory, owner)
    return TABLE[strategy].run(job)
