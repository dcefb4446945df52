"""The compressor contract battery, public so new estimators get the same checks.

A researcher who writes a compressor runs every check in one call::

    import jaxcomm as jc
    jc.testing.check_compressor(my_compressor)          # raises AssertionError on failure

or parametrizes pytest over :func:`contract_checks` to see each check separately.
The checks are properties, not snapshots: shape/dtype preservation under jit on
the shapes ``(), (1,), (7,), (33, 17), (3, 5, 7)`` in float32 and bfloat16;
determinism for a fixed key; use as an optax transformation (``chain``,
``MultiSteps``, jit); exact ``wire_bits`` type and range; finite output on finite
input and no crash on NaN/Inf; and, for compressors declared ``unbiased``, a
Monte Carlo test of ``E[Q(x)] = x`` whose tolerance comes from the sample variance;
and, for compressors with a ``decompress_sum`` or ``compression_error`` hook,
that it equals decompressing each stacked payload and adding, or
``x − decompress(payload)`` bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .compressors import Compressor, wire_bits

__all__ = [
    "SHAPES",
    "contract_checks",
    "check_compressor",
    "check_jit_shapes_dtypes",
    "check_deterministic",
    "check_optax",
    "check_wire_bits",
    "check_nonfinite",
    "check_unbiased",
    "check_decompress_sum",
    "check_compression_error",
    "monte_carlo_mean",
]

SHAPES = ((), (1,), (7,), (33, 17), (3, 5, 7))
"""The tensor shapes every compressor must handle (scalars to rank-3)."""


def _sample(shape, dtype=jnp.float32, seed=0):
    x = jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32)
    return x.astype(dtype)


def _roundtrip_fn(c: Compressor):
    def f(x, key):
        payload, _ = c.compress(x, key)
        return c.decompress(payload), payload

    return jax.jit(f)


def check_jit_shapes_dtypes(c: Compressor, shapes=SHAPES) -> None:
    """``decompress(compress(x))`` under jit keeps shape and dtype, is finite.

    float32 on every shape in ``shapes``; bfloat16 on ``(7,)`` and ``(33, 17)``.
    """
    f = _roundtrip_fn(c)
    cases = [(s, jnp.float32) for s in shapes] + [((7,), jnp.bfloat16), ((33, 17), jnp.bfloat16)]
    for shape, dtype in cases:
        x = _sample(shape, dtype)
        y, _ = f(x, jax.random.PRNGKey(1))
        assert y.shape == x.shape, f"{c.name}: shape {x.shape} -> {y.shape}"
        assert y.dtype == x.dtype, f"{c.name}: dtype {x.dtype} -> {y.dtype} for shape {shape}"
        assert bool(jnp.all(jnp.isfinite(y.astype(jnp.float32)))), (
            f"{c.name}: non-finite output on finite input {shape}"
        )


def check_deterministic(c: Compressor) -> None:
    """The same input and key give the same payload and reconstruction."""
    f = _roundtrip_fn(c)
    x = _sample((33, 17))
    y1, p1 = f(x, jax.random.PRNGKey(3))
    y2, p2 = f(x, jax.random.PRNGKey(3))
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(y2))
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def check_optax(c: Compressor) -> None:
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


def check_wire_bits(c: Compressor) -> None:
    """``wire_bits`` is a non-negative integer, positive for a non-zero tensor, at most 64 bits/entry + 1 KiB."""
    for shape in ((7,), (33, 17)):
        x = _sample(shape)
        payload, _ = c.compress(x, jax.random.PRNGKey(0))
        bits = wire_bits(payload)
        if isinstance(bits, jax.Array):
            assert jnp.issubdtype(bits.dtype, jnp.integer), f"{c.name}: wire_bits dtype {bits.dtype}"
            bits = int(bits)
        assert isinstance(bits, int), f"{c.name}: wire_bits returned {type(bits)}"
        d = int(np.prod(shape))
        assert 0 < bits <= 64 * d + 8192, f"{c.name}: wire_bits {bits} for {d} entries"
        # jit-compatible too
        jax.jit(lambda x, k: wire_bits(c.compress(x, k)[0]))(x, jax.random.PRNGKey(0))


def check_nonfinite(c: Compressor) -> None:
    """NaN and Inf in the input do not crash compress/decompress (output keeps shape/dtype)."""
    f = _roundtrip_fn(c)
    x = _sample((33, 17)).at[0, 0].set(jnp.nan).at[1, 1].set(jnp.inf).at[2, 2].set(-jnp.inf)
    y, _ = f(x, jax.random.PRNGKey(0))
    assert y.shape == x.shape and y.dtype == x.dtype


def monte_carlo_mean(c: Compressor, x, num_samples: int, seed: int = 0):
    """Sample mean and per-coordinate sample variance of ``decompress(compress(x, key))``.

    Returns ``(mean, var)`` with ``x``'s shape (float64 NumPy), over ``num_samples``
    independent keys drawn from ``PRNGKey(seed)``.
    """
    keys = jax.random.split(jax.random.PRNGKey(seed), num_samples)
    f = jax.jit(jax.vmap(lambda k: c.decompress(c.compress(x, k)[0]).astype(jnp.float32)))
    ys = np.asarray(f(keys), dtype=np.float64)
    return ys.mean(0), ys.var(0, ddof=1)


def check_unbiased(c: Compressor, num_samples: int = 4000, z: float = 6.0, seed: int = 0) -> None:
    """Monte Carlo test of ``E[Q(x)] = x`` for a compressor declared unbiased.

    Per coordinate, ``|mean - x| <= z * sqrt(var / N) + 1e-5 * (1 + |x|)`` with the
    sample variance ``var`` and ``N`` samples. By the CLT the left side is
    approximately ``|N(0, var/N)|``; with ``z = 6`` the two-sided tail is 2e-9 per
    coordinate, so over 64 coordinates a false alarm has probability < 1.3e-7; the
    seed is fixed, so the test is deterministic. The additive term absorbs float32
    rounding of deterministic coordinates (zero variance).
    """
    if not c.unbiased:
        return
    x = _sample((64,), seed=7)
    mean, var = monte_carlo_mean(c, x, num_samples, seed)
    xn = np.asarray(x, np.float64)
    tol = z * np.sqrt(var / num_samples) + 1e-5 * (1 + np.abs(xn))
    bad = np.abs(mean - xn) > tol
    assert not bad.any(), (
        f"{c.name}: biased at coordinates {np.flatnonzero(bad)[:5]}: mean {mean[bad][:5]} vs x {xn[bad][:5]} "
        f"(tol {tol[bad][:5]})"
    )


def check_decompress_sum(c: Compressor, n: int = 5) -> None:
    """A ``decompress_sum`` hook equals ``sum_i decompress(payload_i)`` (up to summation order).

    ``n`` payloads of different (correlated, so sparse supports overlap)
    inputs and keys, stacked on a leading axis as an all-gather returns them;
    float32 on ``(33, 17)`` and ``(3, 5, 7)`` and bfloat16 on ``(33, 17)``,
    summed in float32. Skipped (passes) when the hook is ``None``.
    """
    hook = getattr(c, "decompress_sum", None)
    if hook is None:
        return
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


def check_compression_error(c: Compressor) -> None:
    """A ``compression_error`` hook equals ``x − decompress(payload)`` exactly (NaN where it is NaN).

    float32 on :data:`SHAPES`, bfloat16 on ``(33, 17)``, and float32 with NaN
    and Inf entries. Skipped (passes) when the hook is ``None``.
    """
    hook = getattr(c, "compression_error", None)
    if hook is None:
        return
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


def contract_checks() -> dict[str, Callable[[Compressor], None]]:
    """Name -> check function, for ``pytest.mark.parametrize``."""
    return {
        "jit_shapes_dtypes": check_jit_shapes_dtypes,
        "deterministic": check_deterministic,
        "optax": check_optax,
        "wire_bits": check_wire_bits,
        "nonfinite": check_nonfinite,
        "unbiased": check_unbiased,
        "decompress_sum": check_decompress_sum,
        "compression_error": check_compression_error,
    }


def check_compressor(c: Compressor) -> None:
    """Run the whole battery on ``c``; raise ``AssertionError`` naming the failed check."""
    if not isinstance(c, Compressor):
        raise TypeError(f"expected a jaxcomm.compressors.Compressor; got {type(c).__name__}")
    assert c.strategy in ("allreduce", "allgather"), f"{c.name}: bad strategy {c.strategy!r}"
    assert isinstance(c.unbiased, bool)
    for name, check in contract_checks().items():
        try:
            check(c)
        except AssertionError as e:
            raise AssertionError(f"[{name}] {e}") from e
