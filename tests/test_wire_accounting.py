"""state.wire_bits is what the compiled collectives carry, for every compressor of the catalogue.

On a 4-device mesh (``jax.shard_map`` with ``check_vma=True``, inside ``jax.jit``), one
``compressed_mean`` step per registered compressor at its own strategy: the bytes one
device hands to the collectives of the compiled HLO (``tests/hlo_collectives.py``) times 8
equal ``state.wire_bits.sum()`` on every worker. Payloads with count-prefixed fields
(``Payload.counted``) go through the variable-length all-gather, whose data collective sits
in one ``lax.switch`` branch per bucket: there the test computes, in NumPy from each
worker's payload, the valid bytes ``L_w`` and checks that the branch sizes are the
geometric buckets up to the capacity ``S``, that the reported bytes are the fixed
collectives plus the smallest bucket ``>= max_w L_w``, and how they split per tensor.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from counted_bytes import expected_sent, layout
from hlo_collectives import collectives
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from test_compressor_contract import build

import jaxcomm as jc
from jaxcomm._keys import step_keys
from jaxcomm.transforms import compressed_mean

pytestmark = pytest.mark.strict_promotion

N = 4
SHAPES = {"b": (5,), "w": (64, 33)}  # sorted keys: tensor 0 is "b"
COUNTED = {"threshold", "dgc", "adaptive", "inceptionn", "random_sparsification"}
LOWERED: dict = {}  # compressor name -> the last step's lowered (pre-optimisation) HLO text


def gradients():
    """Per worker, different scales, so count-based payloads differ in length between workers."""
    rng = np.random.default_rng(0)
    return {
        k: jnp.asarray(rng.standard_normal((N, *s)) * (1.0 + np.arange(N)).reshape((N,) + (1,) * len(s)), jnp.float32)
        for k, s in SHAPES.items()
    }


def run_step(c, strategy="auto"):
    """(compiled HLO text, wire_bits (N, tensors), messages (N,), the state the step started from)."""
    mesh = Mesh(np.array(jax.devices()[:N]), ("data",))
    tx = compressed_mean(c, "data", strategy=strategy)

    def worker(g, state):
        g, state = jax.tree.map(lambda v: v[0], (g, state))
        u, state = tx.update(g, state)
        return jax.tree.map(lambda v: v[None], (u, state))

    step = jax.jit(jax.shard_map(worker, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    g = jax.device_put(gradients(), NamedSharding(mesh, P("data")))
    init = tx.init({k: jnp.zeros(s) for k, s in SHAPES.items()})
    state = jax.device_put(jax.tree.map(lambda v: jnp.stack([v] * N), init), NamedSharding(mesh, P("data")))
    lowered = step.lower(g, state)
    LOWERED[c.name] = lowered.as_text(dialect="hlo")
    hlo = lowered.compile().as_text()
    _, new = step(g, state)
    return hlo, np.asarray(new.wire_bits, np.int64), np.asarray(new.messages), init


def payloads(c, init):
    """Every worker's payload per tensor, compressed as the pipeline does at the first step
    (memory none: φ = g; key ``fold_in(split(step_key)[t], worker)``)."""
    _, keys = step_keys(init.key, len(SHAPES))
    g = gradients()
    compress = jax.jit(lambda x, key: c.compress(x, key)[0])  # compiled once per shape, as in the step
    return [[compress(g[k][w], jax.random.fold_in(keys[t], w)) for t, k in enumerate(sorted(SHAPES))] for w in range(N)]


@pytest.mark.parametrize("name", jc.compressors.names())
def test_wire_bits_are_the_compiled_collectives(name):
    c = build(name)
    hlo, bits, messages, init = run_step(c)
    found = collectives(hlo, N)
    fixed = sum(b for _, b in found.fixed)
    totals = bits.sum(axis=1)
    assert (totals == totals[0]).all(), bits  # every worker hands the same bytes to the collectives
    if name not in COUNTED:
        assert not found.switches, found
        if name == "bf16":
            # XLA:CPU promotes a bfloat16 all-reduce to float32 (its all-reduce promotion pass); the
            # program jax lowers, what a GPU runs, carries the bfloat16 words that wire_bits counts.
            assert found.fixed == [("all-reduce", 2 * totals[0] // 8)], found
            lowered = collectives(LOWERED[name], N)
            assert totals[0] == 8 * sum(b for _, b in lowered.fixed), (bits, lowered)
            return
        assert totals[0] == 8 * fixed, (bits, found)
        return
    # The variable-length all-gather: a count gather, then the valid bytes in one bucket.
    sent_payloads = payloads(c, init)  # [worker][tensor]
    per = [[layout(p) for p in row] for row in sent_payloads]
    longest = max(sum(v for v, _, _ in row) for row in per)
    capacity = sum(s for _, s, _ in per[0])
    entries = sum(e for _, _, e in per[0])
    assert ("all-gather", 4 * entries) in found.fixed, found
    if capacity <= 1024:  # one size: the whole buffer, no switch
        assert not found.switches and ("all-gather", capacity) in found.fixed, found
        bucket = capacity
    else:
        (sizes,) = found.switches
        assert sizes == sorted(sizes) and sizes[0] == 1024 and sizes[-1] == capacity, sizes
        assert all(b <= a * 2**0.25 + 1 for a, b in itertools.pairwise(sizes)), sizes  # geometric, ratio 2**(1/4)
        bucket = min(b for b in sizes if b >= longest)
        assert bucket <= max(1024, 2**0.25 * longest + 1)
    assert totals[0] == 8 * (fixed + bucket), (bits, found, longest)
    assert messages.tolist() == [2] * N
    # Per tensor: valid bytes and counts; the first tensor also carries the bucket padding.
    assert expected_sent(sent_payloads) == (bucket, (bits // 8).tolist()), bits


@pytest.mark.parametrize("name", ["threshold", "adaptive", "dgc", "inceptionn", "random_sparsification"])
def test_reduce_scatter_counts_whole_buffers(name):
    """Under reduce_scatter the chunk payloads cross whole (permutes, then the owners' all-gather):
    wire_bits counts them whole, and equals the compiled collectives.

    Except where XLA drops a collective whose result nothing reads: INCEPTIONN's decoder reads
    the class tags, not its three int32 counts (which exist for the all-gather's count gather),
    so on the mesh those 12 bytes per payload message are never sent (``N - 1`` permutes and one
    all-gather per tensor); over MPI every array is sent (mpi4jax calls have effects).
    """
    hlo, bits, _, _ = run_step(build(name), "reduce_scatter")
    found = collectives(hlo, N)
    assert not found.switches
    unread = 12 * N * len(SHAPES) if name == "inceptionn" else 0
    assert (bits.sum(axis=1) == 8 * (sum(b for _, b in found.fixed) + unread)).all(), (bits, found)
    assert {op for op, _ in found.fixed} == {"collective-permute", "all-gather"}
