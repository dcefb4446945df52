"""The collectives the pipeline's strategies run, and the wire counts of what they carry.

* Fused sums and gathers: :func:`fused_sum` (one all-reduce per dtype for the small arrays) and
  :func:`gather_payloads` (one packed all-gather for the small fixed-size payloads, a variable-length
  one for count-prefixed payloads), both bounded by :data:`FUSE_MAX_BYTES`.
* Multi-round compressors: :func:`run_rounds` drives one tensor's ``rounds`` generator,
  :func:`run_rounds_together` every tensor's round ``r`` at once, :func:`batched_rounds` tensors
  with one matrix view as one ``jax.vmap`` batch.
* Bits: :func:`sent_bits`, every array of a payload (or of a round's messages) sent whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._bitcount import BitCount
from .._validate import check_float_input
from ..comm import Local, all_gather_counted, all_gather_packed
from ..comm._packing import fits_counted_gather, has_counted_fields, sum_packed
from ..compressors import Compressor

__all__ = [
    "FUSE_MAX_BYTES",
    "LOCAL",
    "accumulator",
    "batched_rounds",
    "fused_sum",
    "gather_payloads",
    "run_rounds",
    "run_rounds_together",
    "sent_bits",
    "sum_decompressed",
]

FUSE_MAX_BYTES = 1 << 20
"""With ``fuse=True``, payloads of at most this many bytes (per worker) share one all-gather;
a larger payload is gathered on its own (Horovod's fusion threshold)."""

_UNROLL_MAX = 16
"""Up to this many workers, gathered payloads are decompressed in one unrolled sum (XLA fuses
elementwise decoders into one pass); beyond it, a ``lax.scan`` keeps the program small."""

LOCAL = Local()
"""The one-worker communicator the single-process transforms run the pipeline on."""


def accumulator(dtype):
    """The dtype sums over workers run in: float32, or the tensor's own when it is wider (float64)."""
    return jnp.dtype(dtype) if jnp.dtype(dtype).itemsize > 4 else jnp.dtype(jnp.float32)


def _array_bits(a) -> int:
    return int(np.size(a)) * jnp.dtype(a.dtype).itemsize * 8


def sent_bits(tree) -> BitCount:
    """Bits of every array leaf of ``tree`` (a payload, or a list of messages) at its dtype,
    ``Σ size · itemsize · 8``: what crosses when it is sent whole (broadcast, permute, rounds)."""
    return BitCount.of(sum(map(_array_bits, jax.tree.leaves(tree))))


def fused_sum(comm, trees: Sequence, fuse: bool) -> tuple[list, int]:
    """``[comm.sum(t) for t in trees]``, the arrays of at most :data:`FUSE_MAX_BYTES` with one all-reduce
    per dtype when ``fuse`` (:func:`~jaxcomm.comm._packing.sum_packed`): ``(sums, collectives run)``."""
    return sum_packed(comm, trees, FUSE_MAX_BYTES if fuse else 0)


def gather_payloads(comm, payloads: list, fuse: bool) -> tuple[list, list, int]:
    """``[comm.all_gather(p) for p in payloads]``, the bits this worker sent per payload, and the
    collectives run.

    Fixed-size payloads: with ``fuse``, those of at most :data:`FUSE_MAX_BYTES` share one
    :func:`~jaxcomm.comm.all_gather_packed` collective; the others are gathered leaf by leaf.
    Their bits are their arrays' bits. Payloads with count-prefixed fields (``counted``) go
    through :func:`~jaxcomm.comm.all_gather_counted` (a count gather, then only the valid
    rows in the smallest bucket that holds every worker's): with ``fuse`` those of at most
    :data:`FUSE_MAX_BYTES` of capacity share one, each other one has its own. Their bits are
    what that gather sent for them, the group's bucket padding charged to its first payload
    (the lowest tensor index), so the bits sum to the collectives' bytes times 8. A counted
    payload of more than ``2**31 - 1`` bytes (beyond the int32 offsets of that gather) is
    gathered whole, leaf by leaf, and counted whole.
    """
    sizes = [sum(map(_array_bits, jax.tree.leaves(p))) for p in payloads]
    bits: list[Any] = [BitCount.of(b) for b in sizes]
    # A buffer past int32 byte offsets cannot go through the variable-length gather: whole, leaf by leaf.
    counted = [i for i, p in enumerate(payloads) if has_counted_fields(p) and fits_counted_gather(sizes[i])]
    small = [i for i, b in enumerate(sizes) if fuse and b <= 8 * FUSE_MAX_BYTES]
    small_fixed = [i for i in small if i not in counted]
    small_counted = [i for i in small if i in counted]
    out = dict(zip(small_fixed, all_gather_packed(comm, [payloads[i] for i in small_fixed]))) if small_fixed else {}
    messages = 1 if small_fixed else 0
    groups = ([small_counted] if small_counted else []) + [[i] for i in counted if i not in small_counted]
    for group in groups:
        res = all_gather_counted(comm, [payloads[i] for i in group])
        messages += res.messages
        for i, gathered, sent in zip(group, res.items, res.sent_bytes):
            out[i], bits[i] = gathered, BitCount.product(sent, 8)
    for i, p in enumerate(payloads):
        if i not in out:
            out[i] = comm.all_gather(p)
            messages += len(jax.tree.leaves(p))
    return [out[i] for i in range(len(payloads))], bits, messages


def sum_decompressed(compressor: Compressor, gathered, n: int, acc_dtype):
    """``Σ_i decompress(gathered[i])`` over ``n`` stacked payloads, in ``acc_dtype``."""
    if compressor.decompress_sum is not None:
        return compressor.decompress_sum(gathered, acc_dtype)

    def one(i):
        return compressor.decompress(jax.tree.map(lambda a: a[i], gathered)).astype(acc_dtype)

    if n <= _UNROLL_MAX:
        total = one(0)
        for i in range(1, n):
            total = total + one(i)
        return total

    def add_one(total, payload):
        return total + compressor.decompress(payload).astype(acc_dtype), None

    return jax.lax.scan(add_one, one(0), jax.tree.map(lambda a: a[1:], gathered))[0]


# --------------------------------------------------------------------------- #
# Multi-round compressors
# --------------------------------------------------------------------------- #
def run_rounds(compressor: Compressor, x, key, state, comm):
    """Drive a multi-round compressor's ``rounds`` over ``comm``: ``(payload, new_state, sent)``.

    Every message the generator yields is summed over the workers
    (``comm.sum``) and sent back into it; ``sent`` lists the messages (this
    worker's contributions, for wire accounting). The payload decompresses to
    the sum over workers.
    """
    (result,), _ = run_rounds_together(comm, [(compressor, x, key, state)], fuse=False)
    return result


def run_rounds_together(comm, jobs: Sequence, fuse: bool = True) -> tuple[list, int]:
    """:func:`run_rounds` for several tensors in lockstep: ``([(payload, new_state, sent)], collectives)``.

    ``jobs``: ``(compressor, x, key, state)`` per tensor. Round ``r`` of every tensor
    that has one runs at once: with ``fuse``, the messages' leaves of at most
    :data:`FUSE_MAX_BYTES` share one all-reduce per dtype (:func:`~jaxcomm.comm._packing.sum_packed`;
    PowerSGD: one for all the ``P`` matrices, one for all the ``Q``), the others are
    summed alone. Each tensor's sums, so its result, are those of its own run.
    """
    gens: list = []
    sent: list[list] = []
    results: list[Any] = [None] * len(jobs)
    waiting: dict[int, Any] = {}
    for j, (compressor, x, key, state) in enumerate(jobs):
        if compressor.rounds is None:
            raise ValueError(f"compressor {compressor.name!r} has no rounds")
        x = jnp.asarray(x)
        check_float_input(x, "x")
        if state is None:
            state = compressor.init_state(x)
        gens.append(compressor.rounds(x, key, state, int(comm.size)))
        sent.append([])
        try:
            waiting[j] = next(gens[j])
        except StopIteration as stop:
            results[j] = (*stop.value, [])
    collectives = 0
    while waiting:
        order = list(waiting)
        for j in order:
            sent[j].append(waiting[j])
        sums, k = fused_sum(comm, [waiting[j] for j in order], fuse)
        collectives += k
        waiting = {}
        for j, total in zip(order, sums):
            try:
                waiting[j] = gens[j].send(total)
            except StopIteration as stop:
                payload, new_state = stop.value
                results[j] = (payload, new_state, sent[j])
    return results, collectives


def _matrix_view(shape: tuple) -> tuple:
    """``(prod(shape[:-1]), shape[-1])`` for arrays of rank >= 2, else ``shape``: the matrix a
    batching compressor sees (:func:`jaxcomm.compressors.powersgd_plan`)."""
    return shape if len(shape) < 2 else (int(np.prod(shape[:-1], dtype=np.int64)), int(shape[-1]))


def batched_rounds(comm, phis, keys, states, compressors) -> tuple[dict, int]:
    """Rounds of tensors with one matrix view run as one batch (PyTorch PowerSGD's ``batch_tensors_with_same_shape``).

    Tensors whose compressor has ``params["batch_tensors_with_same_shape"]`` and ``rounds``
    are grouped by compressor, dtype, state shapes and matrix view (:func:`_matrix_view`:
    a ``(6, 4, 18)`` and a ``(24, 18)`` tensor share the view ``(24, 18)``, as PyTorch
    groups its ``tensor.view(n, -1)`` matrices); such a compressor must give the same
    result on a tensor and on its view, as PowerSGD does. Each group of two or more runs
    :func:`run_rounds` and ``decompress`` once under ``jax.vmap`` over the stacked views,
    keys and states: batched matrix products and one collective per round for the whole
    group, with each tensor's own key and state, so each result equals the tensor's own
    run up to float rounding. Returns ``({index: (payload, state, sent, total)},
    collectives run)``; ``total`` (the decompressed sum) has the tensor's shape, the
    payload the view's.
    """
    groups: dict = {}
    for i, (phi, st, c) in enumerate(zip(phis, states, compressors)):
        if c.rounds is not None and c.params.get("batch_tensors_with_same_shape"):
            st_shapes = tuple(jnp.shape(v) for v in jax.tree.leaves(st))
            sig = (id(c), _matrix_view(jnp.shape(phi)), jnp.result_type(phi), jax.tree.structure(st), st_shapes)
            groups.setdefault(sig, []).append(i)
    out, messages = {}, 0
    for (_, view, *_), idx in groups.items():
        if len(idx) < 2:
            continue
        c = compressors[idx[0]]
        views = [jnp.reshape(phis[i], view) for i in idx]
        seqs = (views, [keys[i] for i in idx], [states[i] for i in idx])
        stack = [jax.tree.map(lambda *v: jnp.stack(v), *seq) for seq in seqs]

        def one(x, k, s, c=c):
            payload, state, sent = run_rounds(c, x, k, s, comm)
            return payload, state, sent, c.decompress(payload)

        payload, state, sent, total = jax.vmap(one)(*stack)
        messages += sum(len(jax.tree.leaves(m)) for m in sent)
        for j, i in enumerate(idx):
            p_j, s_j, sent_j, t_j = jax.tree.map(lambda v, j=j: v[j], (payload, state, sent, total))
            out[i] = (p_j, s_j, sent_j, jnp.reshape(t_j, jnp.shape(phis[i])))
    return out, messages
