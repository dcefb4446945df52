"""The compressor contract battery, public so new estimators get the same checks.

A researcher who writes a compressor runs every check in one call::

    import jaxcomm as jc
    jc.testing.check_compressor(my_compressor)          # raises AssertionError on failure

or parametrizes pytest over :func:`contract_checks` to see each check separately.
The checks are properties, not snapshots: shape/dtype preservation under jit on
the shapes ``(), (1,), (7,), (33, 17), (3, 5, 7)`` in float32 and bfloat16;
determinism for a fixed key; a key used as ``stochastic`` declares; use as an optax transformation (``chain``,
``MultiSteps``, jit); ``wire_bits`` equal to the bits of the payload's own arrays
(:func:`~jaxcomm.compressors.payloads.array_bits`); finite output on finite
input and no crash on NaN/Inf; and, for compressors declared ``unbiased``, a
Monte Carlo test of ``E[Q(x)] = x`` whose tolerance comes from the sample variance
(power stated: ≥ 95 % against a 1 % relative bias on 1,000 entries); the declared
error bound (variance factor ω, contraction δ, data-dependent δ(x), or a declared
absence of any, :func:`check_error_bound`); the error-feedback identity (and its
refusal of a compressor with no contraction); that an ``allreduce`` payload sums;
``vmap`` ≡ ``shard_map``; and, for compressors with a ``decompress_sum`` or
``compression_error`` hook, that it equals decompressing each stacked payload and
adding, or ``x − decompress(payload)`` bit for bit.

Every check returns one line saying what it checked, or ``"skipped: <why>"`` when
it has nothing to check for this compressor (an ``allgather`` compressor has no
sum of payloads to check); :func:`check_compressor` returns them all, so a
report lists every check and none is skipped silently.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ._bitcount import BitCount
from ._contract_stats import (
    SKIPPED,
    _sample,
    check_error_bound,
    check_unbiased,
)
from .compressors import Compressor, wire_bits
from .compressors.payloads import array_bits

__all__ = [
    "check_compressor",
    "contract_checks",
]

SHAPES = ((), (1,), (7,), (33, 17), (3, 5, 7))
"""The tensor shapes every compressor must handle (scalars to rank-3)."""


@functools.lru_cache(maxsize=64)
def _roundtrip_fn(c: Compressor):
    """``(x, key) -> (decompress(payload), payload)`` under jit, one per compressor.

    Cached (a ``Compressor`` hashes by identity), so the checks that round-trip the
    same shape share one compilation: a battery on ``c`` compiles ``(33, 17)``
    float32 once for the shape, determinism, key, wire-bits and non-finite checks.
    """

    def f(x, key):
        payload, _ = c.compress(x, key)
        return c.decompress(payload), payload

    return jax.jit(f)


def check_jit_shapes_dtypes(c: Compressor, shapes=SHAPES, bfloat16_shapes=((7,), (33, 17))) -> str:
    """``decompress(compress(x))`` under jit keeps shape and dtype, is finite.

    float32 on every shape in ``shapes``; bfloat16 on every shape in ``bfloat16_shapes``.
    """
    f = _roundtrip_fn(c)
    cases = [(s, jnp.float32) for s in shapes] + [(s, jnp.bfloat16) for s in bfloat16_shapes]
    for shape, dtype in cases:
        x = _sample(shape, dtype)
        y, _ = f(x, jax.random.PRNGKey(1))
        assert y.shape == x.shape, f"{c.name}: shape {x.shape} -> {y.shape}"
        assert y.dtype == x.dtype, f"{c.name}: dtype {x.dtype} -> {y.dtype} for shape {shape}"
        assert bool(jnp.all(jnp.isfinite(y.astype(jnp.float32)))), (
            f"{c.name}: non-finite output on finite input {shape}"
        )
    return f"shape, dtype and finiteness of decompress(compress(x)) under jit on {len(cases)} shape/dtype cases"


def check_deterministic(c: Compressor) -> str:
    """The same input and key give the same payload and reconstruction."""
    f = _roundtrip_fn(c)
    x = _sample((33, 17))
    y1, p1 = f(x, jax.random.PRNGKey(3))
    y2, p2 = f(x, jax.random.PRNGKey(3))
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(y2))
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    return "the same input and key give the same payload and reconstruction (33, 17)"


def check_key_use(c: Compressor) -> str:
    """The declared ``stochastic`` flag matches what ``compress`` does with its key.

    ``stochastic=False``: two different keys give bit-identical payloads on three
    inputs (shapes ``(33, 17)``, ``(1000,)``, ``(7,)``), and ``compress(x)`` without a
    key works. ``stochastic=True``: at least one of those inputs gives a different
    payload for two keys, and ``compress(x)`` without a key raises ``TypeError``.
    The inputs are tried in that order and the first whose payloads differ decides.
    ``None`` (undeclared): only the ``TypeError`` without a key is checked.
    """
    f = _roundtrip_fn(c)
    differs = False
    for shape, seed in (((33, 17), 0), ((1000,), 1), ((7,), 2)):  # stops at the first input that decides
        x = _sample(shape, seed=seed)
        _, p1 = f(x, jax.random.PRNGKey(1))
        _, p2 = f(x, jax.random.PRNGKey(2))
        pairs = zip(jax.tree.leaves(p1), jax.tree.leaves(p2))
        differs = any(not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in pairs)
        if differs:
            break
    x = _sample((7,))
    if c.stochastic is False:
        assert not differs, f"{c.name}: declared stochastic=False but two keys give different payloads (shape {shape})"
        c.compress(x)
        return "stochastic=False: two keys give identical payloads on 3 inputs; compress(x) works without a key"
    if c.stochastic:
        assert differs, f"{c.name}: declared stochastic=True but its payload never depends on the key"
    try:
        c.compress(x)
    except TypeError as e:
        assert "key" in str(e), f"{c.name}: compress without a key raised an unrelated TypeError: {e}"
    else:
        raise AssertionError(f"{c.name}: compress(x) without a key must raise TypeError unless stochastic=False")
    if c.stochastic:
        return "stochastic=True: two keys give different payloads; compress(x) without a key raises TypeError"
    return "stochastic undeclared: only the TypeError of compress(x) without a key is checked (declare stochastic)"


def check_optax(c: Compressor) -> str:
    """Works as an optax transformation: chain with SGD, MultiSteps, jit; tree preserved."""
    params = {"w": _sample((33, 17), seed=1), "b": _sample((7,), seed=2), "s": _sample((), seed=3)}
    grads = jax.tree.map(lambda p: 0.5 * p, params)
    tx = optax.chain(c, optax.sgd(0.1))
    state = tx.init(params)
    updates, state2 = jax.jit(tx.update)(grads, state, params)
    assert jax.tree.structure(updates) == jax.tree.structure(params)
    for u, p in zip(jax.tree.leaves(updates), jax.tree.leaves(params)):
        assert u.shape == p.shape and u.dtype == p.dtype
    # The state advances (the PRNG key is split every step) and keeps its structure.
    assert jax.tree.structure(state2) == jax.tree.structure(state)
    ms = optax.MultiSteps(tx, every_k_schedule=2)
    ms_state = ms.init(params)
    step = jax.jit(ms.update)
    # optax's MultiSteps divides a float gradient by its int32 step count
    # (optax/transforms/_accumulation.py), which strict dtype promotion rejects: run
    # it under "standard" (the default), so the battery also holds under "strict".
    with jax.numpy_dtype_promotion("standard"):
        u1, ms_state = step(grads, ms_state, params)
        u2, ms_state = step(grads, ms_state, params)
    assert all(bool(jnp.all(u == 0)) for u in jax.tree.leaves(u1)), "MultiSteps must hold the first step"
    assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(u2))
    return "optax: chain with SGD and MultiSteps under jit keep the tree, shapes and dtypes"


def check_wire_bits(c: Compressor, shape=(33, 17)) -> str:
    """``wire_bits`` equals the bits of the payload's own arrays, and is an exact integer count.

    Two float32 inputs of ``shape`` (default ``(33, 17)``): a standard normal ``x``
    (key 0) and ``x`` with two of every three entries set to zero (key 1), so a
    count-based payload holds two different numbers of valid rows (thresholds,
    class tags and masks all see fewer non-zeros). Both go through the one
    jit-compiled round trip the other checks use (no compilation per input).
    ``wire_bits(payload)`` must be an ``int``, a scalar :class:`~jaxcomm.BitCount`
    or an integer array, positive, the same under ``jit``, and equal to
    :func:`~jaxcomm.compressors.payloads.array_bits`: every array leaf at its dtype
    width for a fixed-size payload, only the counted rows of a ``counted`` field,
    and nothing for a field the payload type declares ``inferred`` (a count a
    receiver recovers from a mask or tags). A format that counts less than its
    arrays hold (indices left out) or more fails here.
    """
    f = _roundtrip_fn(c)
    x = _sample(shape)
    sparse = jnp.where(jnp.arange(x.size).reshape(x.shape) % 3 == 0, x, jnp.zeros_like(x))
    held_bits = []
    for case, (xi, seed) in {"normal": (x, 0), "two thirds zero": (sparse, 1)}.items():
        _, payload = f(xi, jax.random.PRNGKey(seed))
        bits = wire_bits(payload)
        if isinstance(bits, BitCount):
            assert bits.shape == (), f"{c.name}: wire_bits has shape {bits.shape}, not a scalar count"
            bits = int(bits)
        elif isinstance(bits, jax.Array):
            assert jnp.issubdtype(bits.dtype, jnp.integer), f"{c.name}: wire_bits dtype {bits.dtype}"
            bits = int(bits)
        assert isinstance(bits, int), f"{c.name}: wire_bits returned {type(bits)}"
        assert bits > 0, f"{c.name}: wire_bits {bits} for a non-zero tensor of shape {shape} ({case})"
        held = array_bits(payload)
        assert bits == held, (
            f"{c.name}: wire_bits() reports {bits} bits for shape {shape} ({case}) but the payload's arrays hold "
            f"{held} ({type(payload).__name__}: every array, counted rows of "
            f"{[f for f, _ in type(payload).counted]}, inferred fields {list(type(payload).inferred)} left out); "
            "count every array the format sends, or declare the fields a receiver recovers from the rest in the "
            "payload type's `inferred`"
        )
        assert int(_jit_wire_bits(payload)) == bits, f"{c.name}: wire_bits differs under jit ({case})"
        held_bits.append(held)
    kind = type(payload).__name__
    return (
        f"wire_bits == bits of the payload's arrays ({kind}: {held_bits[0]} and {held_bits[1]} bits) "
        f"on 2 inputs {shape}, and under jit"
    )


_jit_wire_bits = jax.jit(wire_bits)


def check_nonfinite(c: Compressor) -> str:
    """NaN and Inf in the input do not crash compress/decompress (output keeps shape/dtype)."""
    f = _roundtrip_fn(c)
    x = _sample((33, 17)).at[0, 0].set(jnp.nan).at[1, 1].set(jnp.inf).at[2, 2].set(-jnp.inf)
    y, _ = f(x, jax.random.PRNGKey(0))
    assert y.shape == x.shape and y.dtype == x.dtype
    return "NaN and ±Inf input: compress/decompress run and keep shape and dtype"


def check_error_feedback(c: Compressor, steps: int = 20) -> str:
    """Error feedback conserves the gradient: ``Σ_t out_t + m_T = Σ_t g_t`` (residual memory).

    ``jaxcomm.error_feedback(c)`` for ``steps`` steps on a tree of float32
    gradients (shapes ``(33, 17)``, ``(7,)``, ``()``), jitted; the identity holds
    up to float32 rounding of the running sums (``2e-4`` relative to ``Σ|g|``).
    Compressors that error feedback refuses (unbiased, ``ω ≥ 1``) are checked
    through :func:`jaxcomm.compressors.contractive`. A compressor that declares no
    contraction must be refused by ``error_feedback(c)`` (a ``ValueError`` giving
    the reason), and the identity is checked with
    ``memory.residual(needs_contraction=False)``.
    """
    from . import memory as memory_lib
    from .compressors import contractive
    from .transforms import error_feedback

    params = {"w": _sample((33, 17), seed=1), "b": _sample((7,), seed=2), "s": _sample((), seed=3)}
    sizes = [int(np.size(p)) for p in jax.tree.leaves(params)]
    how = "error_feedback(c)"
    if c.variance_factor is not None and any((c.omega(d) or 0.0) >= 1.0 for d in sizes):
        c, how = contractive(c), "error_feedback(contractive(c)) (ω ≥ 1)"
    memory = None
    if c.no_contraction:
        try:
            error_feedback(c).init(params)
        except ValueError as e:
            assert c.no_contraction in str(e), f"{c.name}: error feedback refused it without the reason: {e}"
        else:
            raise AssertionError(f"{c.name}: declares no contraction but error feedback accepted it")
        memory = memory_lib.residual(needs_contraction=False)
        how = "error_feedback(c) refused (no contraction), residual(needs_contraction=False)"
    tx = error_feedback(c, memory)
    state = tx.init(params)
    update = jax.jit(tx.update)
    sent = jax.tree.map(lambda p: np.zeros(p.shape, np.float64), params)
    grads_sum = jax.tree.map(lambda p: np.zeros(p.shape, np.float64), params)
    for t in range(steps):
        g = jax.tree.map(lambda p, t=t: _sample(p.shape, seed=100 + t) * (1 + 0.1 * t), params)
        out, state = update(g, state)
        sent = jax.tree.map(lambda a, o: a + np.asarray(o, np.float64), sent, out)
        grads_sum = jax.tree.map(lambda a, o: a + np.asarray(o, np.float64), grads_sum, g)
    for key in params:
        lhs = sent[key] + np.asarray(state.memory[key], np.float64)
        scale = float(np.sum(np.abs(grads_sum[key]))) / max(1, grads_sum[key].size) + 1.0
        np.testing.assert_allclose(
            lhs,
            grads_sum[key],
            rtol=0,
            atol=2e-4 * scale * steps,
            err_msg=f"{c.name}: Σ outputs + memory ≠ Σ gradients for leaf {key!r} (error feedback loses mass)",
        )
    return f"{how}: Σ outputs + memory = Σ gradients over {steps} steps"


def check_strategy(c: Compressor, n: int = 4) -> str:
    """A compressor declared ``allreduce`` has payloads whose sum decodes to the sum of the decodes.

    ``n`` payloads of different inputs and keys: fields not in ``summable`` must be
    identical across workers (a shared key, a static code), and decoding the
    element-wise sum of the ``summable`` fields must equal ``Σ_i decompress(p_i)``
    (``1e-5`` relative to the largest magnitude). Multi-round compressors (``rounds``)
    are checked through the pipeline's own tests; ``allgather`` ones pass.
    """
    if c.strategy != "allreduce":
        return SKIPPED + f"strategy {c.strategy!r}: payloads are gathered, not summed"
    if c.rounds is not None:
        return SKIPPED + "multi-round (rounds): its summed messages are checked by the pipeline's tests"
    compress = jax.jit(lambda x, key: c.compress(x, key)[0])
    payloads = [compress(_sample((33, 17), seed=40 + i), jax.random.PRNGKey(50)) for i in range(n)]
    cls = type(payloads[0])
    summable = tuple(getattr(cls, "summable", ()))
    assert summable, f"{c.name}: strategy 'allreduce' but payload {cls.__name__} declares no summable fields"
    import dataclasses as _dc

    fields = {f.name for f in _dc.fields(cls) if not f.metadata.get("static", False)}
    for name in fields - set(summable):
        for p in payloads[1:]:
            for a, b in zip(jax.tree.leaves(getattr(payloads[0], name)), jax.tree.leaves(getattr(p, name))):
                assert np.array_equal(np.asarray(a), np.asarray(b)), (
                    f"{c.name}: field {name!r} is not summable and differs between workers"
                )
    summed = _dc.replace(
        payloads[0],
        **{name: jax.tree.map(lambda *a: sum(a[1:], a[0]), *[getattr(p, name) for p in payloads]) for name in summable},
    )
    got = np.asarray(c.decompress(summed), np.float64)
    want = sum(np.asarray(c.decompress(p), np.float64) for p in payloads)
    scale = max(1.0, float(np.max(np.abs(want))))
    np.testing.assert_allclose(
        got,
        want,
        rtol=0,
        atol=n * _wire_eps(c) * scale,
        err_msg=f"{c.name}: decoding the sum of payloads differs from the sum of decodings (strategy 'allreduce')",
    )
    return f"allreduce: decoding the sum of {n} payloads = the sum of their decodings"


def _wire_eps(c: Compressor) -> float:
    """Relative rounding of a sum in the payload's narrowest float dtype (float32: ``1e-5`` with margin)."""
    payload, _ = c.compress(_sample((33, 17)), jax.random.PRNGKey(0))
    eps = [
        float(jnp.finfo(leaf.dtype).eps)
        for leaf in jax.tree.leaves(payload)
        if jnp.issubdtype(leaf.dtype, jnp.floating)
    ]
    return max([1e-5, *eps])


def check_vmap_shard_map(c: Compressor, workers: int = 4) -> str:
    """``compressed_mean(c)`` gives the same mean under ``jax.vmap(axis_name=...)`` and ``jax.shard_map``.

    ``workers`` per-worker gradients (shape ``(33, 17)``), the same states and
    keys; float32 summation order may differ (``1e-5`` relative). Needs
    ``workers`` devices (``XLA_FLAGS=--xla_force_host_platform_device_count=N``
    on CPU); with fewer it reports itself skipped.
    """
    if jax.device_count() < workers:
        return SKIPPED + (
            f"needs {workers} devices, have {jax.device_count()} "
            f"(XLA_FLAGS=--xla_force_host_platform_device_count={workers} before importing jax)"
        )
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from .transforms import compressed_mean

    tx = compressed_mean(c, axis_name="w")
    g = jnp.stack([_sample((33, 17), seed=60 + i) for i in range(workers)])
    state = jax.vmap(lambda _: tx.init(jnp.zeros((33, 17))))(jnp.arange(workers))

    def one(gi, si):
        return tx.update(gi, si)[0]

    by_vmap = jax.jit(jax.vmap(one, axis_name="w"))(g, state)
    mesh = jax.make_mesh((workers,), ("w",), devices=jax.devices()[:workers])
    put = lambda t: jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, P("w"))), t)

    def body(gi, si):
        gi, si = jax.tree.map(lambda a: a[0], (gi, si))
        return one(gi, si)[None]

    by_mesh = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("w"), out_specs=P("w")))(put(g), put(state))
    want = np.asarray(by_vmap, np.float64)
    scale = max(1.0, float(np.max(np.abs(want))))
    np.testing.assert_allclose(
        np.asarray(by_mesh, np.float64),
        want,
        rtol=0,
        atol=workers * _wire_eps(c) * scale,
        err_msg=f"{c.name}: compressed_mean differs between vmap and shard_map",
    )
    return f"compressed_mean: vmap and shard_map over {workers} workers agree"


def check_decompress_sum(c: Compressor, n: int = 5) -> str:
    """A ``decompress_sum`` hook equals ``sum_i decompress(payload_i)`` (up to summation order).

    ``n`` payloads of different (correlated, so sparse supports overlap)
    inputs and keys, stacked on a leading axis as an all-gather returns them;
    float32 on ``(33, 17)`` and ``(3, 5, 7)`` and bfloat16 on ``(33, 17)``,
    summed in float32. Reported skipped when the hook is ``None``.
    """
    hook = getattr(c, "decompress_sum", None)
    if hook is None:
        return SKIPPED + "no decompress_sum hook (the pipeline decompresses each payload and adds)"
    compress = jax.jit(lambda x, key: c.compress(x, key)[0])
    decompress = jax.jit(c.decompress)
    for shape, dtype in (((33, 17), jnp.float32), ((3, 5, 7), jnp.float32), ((33, 17), jnp.bfloat16)):
        base = _sample(shape, jnp.float32, seed=7)
        payloads = [
            compress((base + 0.5 * _sample(shape, jnp.float32, seed=10 + i)).astype(dtype), jax.random.PRNGKey(20 + i))
            for i in range(n)
        ]
        stacked = jax.tree.map(lambda *a: jnp.stack(a), *payloads)
        got = jax.jit(lambda g: hook(g, jnp.float32))(stacked)
        want = sum(np.asarray(decompress(p), np.float64) for p in payloads)
        assert got.shape == shape and got.dtype == jnp.float32, f"{c.name}: decompress_sum gave {got.shape} {got.dtype}"
        scale = max(1.0, float(np.max(np.abs(want))))
        np.testing.assert_allclose(
            np.asarray(got, np.float64),
            want,
            rtol=0,
            atol=1e-5 * scale,
            err_msg=f"{c.name}: decompress_sum differs from the sum of decompressions",
        )
    return f"decompress_sum = Σ decompress over {n} stacked payloads, 3 shape/dtype cases"


def check_compression_error(c: Compressor) -> str:
    """A ``compression_error`` hook equals ``x − decompress(payload)`` exactly (NaN where it is NaN).

    float32 on :data:`SHAPES`, bfloat16 on ``(33, 17)``, and float32 with NaN
    and Inf entries. Reported skipped when the hook is ``None``.
    """
    hook = getattr(c, "compression_error", None)
    if hook is None:
        return SKIPPED + "no compression_error hook (the pipeline computes x − decompress(payload))"
    nonfinite = _sample((33, 17)).at[0, 0].set(jnp.nan).at[1, 1].set(jnp.inf).at[2, 2].set(-jnp.inf)
    cases = [_sample(s) for s in SHAPES] + [_sample((33, 17), jnp.bfloat16), nonfinite]

    @jax.jit
    def both(x, key):
        payload, _ = c.compress(x, key)
        return hook(x, payload), x - c.decompress(payload).astype(x.dtype)

    for x in cases:
        got, want = both(x, jax.random.PRNGKey(5))
        assert got.shape == x.shape and got.dtype == x.dtype, (
            f"{c.name}: compression_error gave {got.shape} {got.dtype}"
        )
        np.testing.assert_array_equal(
            np.asarray(got, np.float32),
            np.asarray(want, np.float32),
            err_msg=f"{c.name}: compression_error differs from x - decompress(payload)",
        )
    return f"compression_error = x − decompress(payload) bit for bit on {len(cases)} inputs"


def contract_checks() -> dict[str, Callable[[Compressor], str]]:
    """Name -> check function, for ``pytest.mark.parametrize``."""
    return {
        "jit_shapes_dtypes": check_jit_shapes_dtypes,
        "deterministic": check_deterministic,
        "key_use": check_key_use,
        "optax": check_optax,
        "wire_bits": check_wire_bits,
        "nonfinite": check_nonfinite,
        "unbiased": check_unbiased,
        "decompress_sum": check_decompress_sum,
        "compression_error": check_compression_error,
        "error_bound": check_error_bound,
        "error_feedback": check_error_feedback,
        "strategy": check_strategy,
        "vmap_shard_map": check_vmap_shard_map,
    }


def check_compressor(c: Compressor) -> dict[str, str]:
    """Run the whole battery on ``c``; raise ``AssertionError`` naming the failed check.

    Returns:
      The report: check name -> what it checked, or ``"skipped: <why>"``
      (:data:`SKIPPED`), for every check of :func:`contract_checks`, in order.
    """
    if not isinstance(c, Compressor):
        raise TypeError(f"expected a jaxcomm.compressors.Compressor; got {type(c).__name__}")
    assert c.strategy in ("allreduce", "allgather"), f"{c.name}: bad strategy {c.strategy!r}"
    assert isinstance(c.unbiased, bool)
    report = {}
    for name, check in contract_checks().items():
        try:
            report[name] = check(c)
        except Exception as e:  # any failure names the check and the compressor
            raise AssertionError(f"[{name}] {c.name}: {type(e).__name__}: {e}") from e
        assert isinstance(report[name], str) and report[name], f"[{name}] {c.name}: the check reported nothing"
    return report
