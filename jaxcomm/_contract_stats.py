"""The contract battery's statistical checks: unbiasedness and the declared error bound.

:mod:`jaxcomm.testing` re-exports every public name here; its docstring describes the battery.
Both checks draw many compressions of fixed vectors and compare a sample statistic with a
bound, with a tolerance of ``z`` standard errors (the power and false-alarm rates are stated
in each check's docstring). The battery's other checks share ``SKIPPED`` and ``_sample``
(their standard normal inputs) with these.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .compressors import Compressor

SKIPPED = "skipped: "
"""The prefix of a check's result when it had nothing to check (the rest says why)."""


def _sample(shape, dtype=jnp.float32, seed=0):
    """A standard normal draw of ``shape`` from ``PRNGKey(seed)``, in float32, cast to ``dtype``."""
    x = jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32)
    return x.astype(dtype)


def monte_carlo_mean(c: Compressor, x, num_samples: int, seed: int = 0):
    """Sample mean and per-coordinate sample variance of ``decompress(compress(x, key))``.

    Returns ``(mean, var)`` with ``x``'s shape (float64 NumPy), over ``num_samples``
    independent keys drawn from ``PRNGKey(seed)``.
    """
    keys = jax.random.split(jax.random.PRNGKey(seed), num_samples)
    f = jax.jit(jax.vmap(lambda k: c.decompress(c.compress(x, k)[0]).astype(jnp.float32)))
    ys = np.asarray(f(keys), dtype=np.float64)
    return ys.mean(0), ys.var(0, ddof=1)


def check_unbiased(c: Compressor, num_samples: int = 20000, z: float = 5.0, seed: int = 0) -> str:
    """Monte Carlo test of ``E[Q(x)] = x`` for a compressor declared unbiased.

    On a standard normal ``x`` of ``d = 1000`` entries, ``N = num_samples``
    independent draws, sample mean ``m`` and per-coordinate sample variance ``v``,
    three statistics, each compared with ``z`` times its standard error:

    * the relative bias along ``x``: ``s = ⟨m − x, x⟩ / ‖x‖²``,
      ``se² = Σ_i v_i x_i² / (N ‖x‖⁴)`` (catches ``E Q(x) = (1 + b) x``);
    * the mean offset ``o = Σ_i (m_i − x_i) / d``, ``se² = Σ_i v_i / (N d²)``
      (catches ``E Q(x) = x + c``);
    * every coordinate: ``|m_i − x_i| ≤ (z + 1) sqrt(v_i / N)`` (a local bias).

    Each standardised statistic is approximately ``N(0, 1)`` (CLT) under
    unbiasedness; at ``z = 5`` a false alarm of the first two has probability
    ``< 1.2e-6`` and of the coordinate test ``< 6e-6`` over 1,000 coordinates.
    Power: a bias is caught with probability ≥ 95 % once it exceeds ``(z + 1.65)``
    standard errors. Samples are drawn in chunks of 4,000 until
    ``se(s) ≤ 0.01 / (z + 1.65) = 1.5e-3`` (at most ``8 num_samples``), which gives
    ≥ 95 % power against a 1 % relative bias on the 1,000-entry vector
    (``tests/test_compressor_contract.py`` checks that every unbiased built-in,
    scaled by 1.01, fails). The seed is fixed, so the check is deterministic. An
    additive ``1e-5 (1 + |x|)`` absorbs float32 rounding of deterministic
    coordinates (zero variance).
    """
    if not c.unbiased:
        return SKIPPED + "declared biased (unbiased=False): no E[Q(x)] = x to test"
    x = _sample((1000,), seed=7)
    xn = np.asarray(x, np.float64)
    n, total, sq = 0, np.zeros_like(xn), np.zeros_like(xn)
    chunk = 4000
    while True:
        for i in range(max(1, num_samples // chunk)):
            keys = jax.random.split(jax.random.fold_in(jax.random.PRNGKey(seed), n + i), chunk)
            ys = _sampler(c)(x, keys)
            total += ys.sum(0)
            sq += (ys * ys).sum(0)
        n += max(1, num_samples // chunk) * chunk
        mean = total / n
        var = np.maximum(sq / n - mean * mean, 0.0) * n / (n - 1)
        se_s = np.sqrt(np.sum(var * xn**2) / n) / np.sum(xn**2)
        if se_s <= 0.01 / (z + 1.65) or n >= 8 * num_samples:
            break
    s_rel = np.sum((mean - xn) * xn) / np.sum(xn**2)
    se_o = np.sqrt(np.sum(var) / n) / xn.size
    offset = np.mean(mean - xn)
    slack = 1e-5 * (1 + np.abs(xn))
    assert abs(s_rel) <= z * se_s + 1e-5, (
        f"{c.name}: biased: E[Q(x)] ≈ (1 {s_rel:+.4g}) x along x (standard error {se_s:.2g}, {n} samples)"
    )
    assert abs(offset) <= z * se_o + 1e-5, (
        f"{c.name}: biased: E[Q(x)] − x has mean {offset:+.4g} over the entries (standard error {se_o:.2g})"
    )
    bad = np.abs(mean - xn) > (z + 1) * np.sqrt(var / n) + slack
    assert not bad.any(), (
        f"{c.name}: biased at coordinates {np.flatnonzero(bad)[:5]}: mean {mean[bad][:5]} vs x {xn[bad][:5]}"
    )
    return f"E[Q(x)] = x: relative bias {s_rel:+.2g} (se {se_s:.2g}), offset and 1,000 coordinates, {n} samples"


def _sampler(c: Compressor):
    """``(x, keys) -> float64 NumPy [len(keys), *x.shape]`` of ``decompress(compress(x, key))``."""
    f = jax.jit(jax.vmap(lambda k, x: c.decompress(c.compress(x, k)[0]).astype(jnp.float32), in_axes=(0, None)))
    return lambda x, keys: np.asarray(f(keys, x), dtype=np.float64)


def bound_inputs(d: int = 1000, seed: int = 11) -> dict[str, jax.Array]:
    """The vectors a declared bound is checked on (``d`` entries, float32).

    ``gaussian`` (typical), ``flat`` (random signs, equal magnitudes: the worst case
    of top-k's ``δ = k/d``), ``spiky`` (one large entry in small noise: the worst
    case of sign methods) and ``heavy`` (Student-t, 2 degrees of freedom).
    """
    return dict(_bound_inputs(d, seed))


@functools.lru_cache(maxsize=4)
def _bound_inputs(d: int, seed: int) -> tuple[tuple[str, jax.Array], ...]:
    """:func:`bound_inputs`, drawn once per ``(d, seed)`` (the Student-t draw alone costs seconds to compile)."""
    with jax.ensure_compile_time_eval():  # concrete arrays even when first called under a trace
        k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
        signs = jnp.where(jax.random.bernoulli(k1, 0.5, (d,)), 1.0, -1.0)
        noise = 1e-3 * jax.random.normal(k2, (d,))
        return (
            ("gaussian", _sample((d,), seed=seed)),
            ("flat", signs),
            ("spiky", noise.at[d // 3].set(10.0)),
            ("heavy", jax.random.t(k3, 2.0, (d,))),
        )


def check_error_bound(c: Compressor, num_samples: int = 512, z: float = 5.0) -> str:
    """The declared bound holds, and a bound (or its absence) is declared.

    Each declared form is checked on every vector of :func:`bound_inputs`
    (``d = 1000``): the variance factor, ``E‖Q(x) − x‖² ≤ ω ‖x‖²`` (unbiased); the
    contraction, ``≤ (1 − δ) ‖x‖²`` (``δ = 0``: non-expansive); the data-dependent
    contraction, ``≤ (1 − δ(x)) ‖x‖²`` with ``δ(x) = c.local_contraction(x)``. From
    ``N = num_samples`` draws of ``e_j = ‖Q_j(x) − x‖²`` (one for a deterministic
    compressor) the check fails when the lower confidence limit
    ``mean(e) − z · sd(e)/√N`` exceeds the bound by more than float32 rounding
    (``1e-5 ‖x‖²``): a declared bound that is violated on average by more than
    ``z`` standard errors is caught, and a true bound fails with probability
    ``< 3e-7`` per vector (one-sided, CLT).

    A compressor that declares no contraction (``c.no_contraction``, its reason)
    has nothing to check and says so; one that declares nothing at all fails:
    every compressor states its bound or why there is none.
    """
    omega = c.omega(1000) if c.variance_factor is not None else None
    delta = c.delta(1000) if c.contraction is not None else None
    uniform = omega is not None or delta is not None
    if not uniform and c.local_contraction is None:
        if c.no_contraction:
            return SKIPPED + f"declares no contraction: {c.no_contraction}"
        assert c.variance_factor is not None or c.contraction is not None, (
            f"{c.name}: declares no error bound: give Compressor variance_factor=ω (unbiased), "
            "contraction=δ, local_contraction=x -> δ(x), or no_contraction='why no bound holds'"
        )
        return SKIPPED + f"the declared bound gives no value at d = 1000 ({c.bound or 'no reason given'})"
    factor = omega if omega is not None else 1.0 - (delta or 0.0)
    what = f"ω = {omega:.4g}" if omega is not None else f"δ = {delta or 0.0:.4g}"
    keys = jax.random.split(jax.random.PRNGKey(3), num_samples)
    f = jax.jit(
        jax.vmap(
            lambda k, x: jnp.sum((c.decompress(c.compress(x, k)[0]).astype(jnp.float32) - x) ** 2), in_axes=(0, None)
        )
    )
    local = None if c.local_contraction is None else jax.jit(c.local_contraction)
    for label, x in bound_inputs().items():
        e = np.asarray(f(keys, x), np.float64)
        norm2 = float(np.sum(np.asarray(x, np.float64) ** 2))
        lower = e.mean() - z * e.std(ddof=1) / np.sqrt(num_samples)
        checks = [(factor, what)] if uniform else []
        if local is not None:
            dx = float(local(x))
            checks.append((1.0 - dx, f"δ(x) = {dx:.4g}"))
        for fac, name in checks:
            assert lower <= (fac + 1e-5) * norm2 + 1e-6, (
                f"{c.name}: declared {name} ({c.bound}) is violated on the {label!r} input: "
                f"E‖Q(x) − x‖² ≈ {e.mean():.6g} > {fac:.6g} ‖x‖² = {fac * norm2:.6g}"
            )
    forms = ([what] if uniform else []) + (["data-dependent δ(x)"] if local is not None else [])
    return f"declared {' and '.join(forms)} hold on {len(bound_inputs())} inputs (d = 1000), {num_samples} draws"
