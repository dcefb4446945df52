"""The declared error bounds of the built-in compressors, with their sources.

For a compressor ``Q`` acting on ``x`` of ``d`` entries (``E`` over its randomness):

* unbiased, variance factor ω:   ``E‖Q(x) − x‖² ≤ ω ‖x‖²``;
* biased, contraction δ ∈ [0, 1]: ``E‖Q(x) − x‖² ≤ (1 − δ) ‖x‖²`` (``δ = 0``:
  non-expansive, no uniform contraction);
* data-dependent, ``δ(x)``:       ``E‖Q(x) − x‖² ≤ (1 − δ(x)) ‖x‖²`` for that ``x``
  (``δ(x) < 0`` where ``Q`` may expand ``x``);
* no contraction: no bound ``c ‖x‖²`` holds (sign without a scale), with the reason.

:func:`declare` attaches them to a compressor built by a registered factory
(``Compressor.variance_factor``, ``.contraction``, ``.local_contraction``,
``.no_contraction``, ``.bound``), from the factory's ``params``. Every built-in
declares one. ``jaxcomm.testing`` checks every declared bound by Monte Carlo;
error feedback refuses an unbiased compressor whose ω ≥ 1 and one that declares
no contraction, under a memory that needs a contraction.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ._base import Compressor

__all__ = ["declare", "BOUNDS", "Declared"]


class Declared(NamedTuple):
    """One compressor's declared bound (fields as the :class:`~jaxcomm.compressors.Compressor` fields)."""

    variance_factor: Callable[[int], float] | float | None = None
    contraction: Callable[[int], float] | float | None = None
    bound: str = ""
    local_contraction: Callable | None = None
    no_contraction: str = ""


def _ratio_of(x, kept2):
    """``kept2 / ‖x‖²`` in float32 (1 for ``x = 0``, where every bound holds)."""
    norm2 = jnp.sum(jnp.square(jnp.ravel(x).astype(jnp.float32)))
    return jnp.where(norm2 > 0, kept2 / jnp.where(norm2 > 0, norm2, 1.0), 1.0)


def _absolute(b: float):
    """``x -> δ(x) = 1 − Σ_i min(x_i², b²) / ‖x‖²``: the bound of an operator that changes every entry
    by at most ``min(|x_i|, b)``."""

    def delta(x):
        xf = jnp.ravel(x).astype(jnp.float32)
        return 1.0 - _ratio_of(x, jnp.sum(jnp.minimum(jnp.square(xf), b * b)))

    return delta


def _num_selected(ratio: float, d: int) -> int:
    from ._sparse import num_selected

    return num_selected(ratio, d)


def _none(p) -> tuple:
    return 0.0, None, "exact: Q(x) = x"


def _fp16(p) -> tuple:
    return (
        None,
        1.0 - 2.0**-22,
        (
            "round to nearest float16 (unit roundoff u = 2^-11): |Q(x)_i − x_i| ≤ u |x_i| for entries in the normal "
            "range [6.1e-5, 65504], so δ = 1 − u²; subnormal and overflowing entries are outside the bound"
        ),
    )


def _bf16(p) -> tuple:
    return (
        None,
        1.0 - 2.0**-16,
        ("round to nearest bfloat16 (unit roundoff u = 2^-8): |Q(x)_i − x_i| ≤ u |x_i| for normal entries, δ = 1 − u²"),
    )


def _topk(p) -> tuple:
    ratio, dense_below = p["ratio"], p.get("dense_below", 0)
    return (
        None,
        lambda d: 1.0 if d <= dense_below else _num_selected(ratio, d) / d,
        ("Stich, Cordonnier & Jaggi 2018, Lemma A.1: ‖x − top_k(x)‖² ≤ (1 − k/d) ‖x‖², δ = k/d"),
    )


def _randomk(p) -> tuple:
    ratio = p["ratio"]
    if p.get("replacement"):
        from ._randomk import inclusion_probability

        def prob(d: int) -> float:
            return inclusion_probability(d, _num_selected(ratio, d), True)

        if p.get("unbiased"):
            return (
                lambda d: 1.0 / prob(d) - 1.0,
                None,
                "k draws with replacement reach each position with probability p = 1 − (1 − 1/d)^k; "
                "Q = x ⊙ b / p is unbiased with E‖Q(x) − x‖² = (1/p − 1) ‖x‖², ω = 1/p − 1",
            )
        return (
            None,
            prob,
            "k draws with replacement reach each position with probability p = 1 − (1 − 1/d)^k: "
            "E‖x − C(x)‖² = (1 − p) ‖x‖², δ = p",
        )
    if p.get("unbiased"):
        return (
            lambda d: d / _num_selected(ratio, d) - 1.0,
            None,
            ("Stich et al. 2018: (d/k) rand_k is unbiased with E‖Q(x) − x‖² = (d/k − 1) ‖x‖², ω = d/k − 1"),
        )
    return (
        None,
        lambda d: _num_selected(ratio, d) / d,
        ("Stich et al. 2018, Lemma A.1: E‖x − rand_k(x)‖² = (1 − k/d) ‖x‖², δ = k/d"),
    )


def _efsignsgd(p) -> tuple:
    return (
        None,
        lambda d: 1.0 / d,
        (
            "Karimireddy et al. 2019, Lemma 8: Q(x) = (‖x‖₁/d) sign(x) has ‖Q(x) − x‖² = (1 − ‖x‖₁²/(d‖x‖²)) ‖x‖², "
            "δ ≥ 1/d"
        ),
    )


def _onebit(p) -> tuple:
    tau = p.get("threshold", 0.0)
    if isinstance(tau, jax.core.Tracer) or tau != 0.0:  # a traced τ (inject_hyperparams) may be non-zero
        return Declared(
            None,
            0.0,
            (
                "1-bit SGD with a threshold τ ≠ 0 decodes to the means of the two groups split at τ: the orthogonal "
                "projection onto the two group indicators, non-expansive (δ = 0) but with no uniform δ > 0 (both "
                "groups can share a sign)"
            ),
        )
    return (
        None,
        lambda d: 1.0 / d,
        (
            "group means (Seide et al. 2014) with τ = 0: ‖x − Q(x)‖² = ‖x‖² − S₊²/n₊ − S₋²/n₋ ≤ ‖x‖² − ‖x‖₁²/d "
            "(Cauchy-Schwarz), δ ≥ 1/d"
        ),
    )


def _natural(p) -> tuple:
    return 1.0 / 8.0, None, "Horváth et al. 2019 (natural compression), Theorem 1: ω = 1/8"


def _qsgd(p) -> tuple:
    s = p["levels"]
    return (
        lambda d: min(d / s**2, math.sqrt(d) / s),
        None,
        ("Alistarh et al. 2017, Lemma 3.1: ω = min(d/s², √d/s) with s levels"),
    )


def _terngrad(p) -> tuple:
    return (
        lambda d: math.sqrt(d) - 1.0,
        None,
        ("Wen et al. 2017: E‖Q(x) − x‖² = ‖x‖₁‖x‖∞ − ‖x‖² ≤ (√d − 1) ‖x‖², ω = √d − 1"),
    )


def _stochastic_rounding(p) -> tuple:
    levels = (1 << p["bits"]) - 1
    return (
        lambda d: d / levels**2,
        None,
        (
            "unbiased rounding to a grid of spacing D = 2M/(2^bits − 1), M = max|x|: per entry variance ≤ D²/4, "
            "so E‖Q(x) − x‖² ≤ d M²/(2^bits − 1)² ≤ d/(2^bits − 1)² ‖x‖², ω = d/(2^bits − 1)²"
        ),
    )


def _random_sparsification(p) -> tuple:
    t = int(min(2**32 - 1, max(1, round(p["p"] * 2.0**32))))
    keep = t / 2.0**32
    return (
        1.0 / keep - 1.0,
        None,
        (
            "Wangni et al. 2018: keep x_i/p with probability p gives E‖Q(x) − x‖² = (1/p − 1) ‖x‖², ω = 1/p − 1 "
            "(p the exact keep probability)"
        ),
    )


def _clipping(p) -> tuple:
    bits = p["bits"]
    return (
        None,
        1.0 - (2.0**bits + 1.0) ** -2,
        (
            "truncation of the mantissa to `bits` bits: for a normal 2^e <= |x_i| < 2^(e+1) the error "
            "r = |x_i − Q(x)_i| < 2^(e − bits) and |Q(x)_i| >= 2^e, so r/|x_i| <= r/(2^e + r) < 1/(2^bits + 1), "
            "δ = 1 − (2^bits + 1)^-2 (bits = 0, sign and exponent only: δ = 3/4)"
        ),
    )


def _eightbit(p) -> tuple:
    # Nearest of 256 codes times max|x|: |x_i − Q(x)_i| ≤ min(|x_i|, g/2 · max|x|), g/2 ≤ 0.9/128.
    # Relative form: exponent group e (y = |x_i|/max|x| in [0.1, 1]·10^-e) has 2^(6-e) cells, half gap
    # 0.9·10^-e/2^(7-e), at most 0.5625 y for e <= 3 (y >= 1e-4); below 1e-4 the error is <= 1.125e-5 max|x|.
    c2 = (0.9 / 128.0) ** 2
    rel2, small2 = 0.5625**2, 1.125e-5**2
    return (
        None,
        lambda d: max(1.0 - min(c2 * d, rel2 + small2 * d), 0.0) or float("nan"),
        (
            "Dettmers 2015's codebook: |x_i − Q(x)_i| ≤ (0.9/128) max|x| per entry, and ≤ 0.5625 |x_i| where "
            "|x_i| >= 1e-4 max|x| (≤ 1.125e-5 max|x| below), so ‖Q(x) − x‖² ≤ min(d (0.9/128)², 0.5625² + "
            "d (1.125e-5)²) ‖x‖² and δ = 1 − that minimum (positive for d < 5.4e9)"
        ),
    )


def _adaptive(p) -> tuple:
    ratio = p["ratio"]
    return (
        None,
        lambda d: 1.0 / (d * _num_selected(ratio, d)),
        (
            "each sign's k_s kept entries decode to their mean (a projection), removing (Σ kept)²/k_s ≥ "
            "max² / k_s of ‖x‖² where max is that sign's largest magnitude; the larger of the two is ≥ ‖x‖²/d "
            "and k_s ≤ k = round(ratio d), so δ = 1/(d k) (weak: the worst case is one large entry among small "
            "ones of the same sign)"
        ),
    )


def _qsparse(p) -> tuple:
    ratio, s = p["ratio"], p["levels"]

    def omega_k(d):
        k = _num_selected(ratio, d)
        return min(k / s**2, math.sqrt(k) / s)

    def delta(d):
        return (1.0 - omega_k(d)) * _num_selected(ratio, d) / d if omega_k(d) < 1.0 else float("nan")

    def local(x):
        d = x.size
        top = jnp.sort(jnp.square(jnp.ravel(x).astype(jnp.float32)))[d - _num_selected(ratio, d) :]
        return (1.0 - omega_k(d)) * _ratio_of(x, jnp.sum(top))

    return Declared(
        None,
        delta,
        (
            "QSGD_s on top_k (Basu et al. 2019): E‖Q(x) − x‖² ≤ ‖x‖² − (1 − ω_k) ‖top_k(x)‖² with "
            "ω_k = min(k/s², √k/s) (Alistarh et al. 2017, Lemma 3.1), so δ(x) = (1 − ω_k) ‖top_k(x)‖²/‖x‖² "
            "(negative where ω_k > 1: QSGD's variance may then expand x); with ‖top_k(x)‖² ≥ (k/d) ‖x‖², "
            "δ = (1 − ω_k) k/d where ω_k < 1"
        ),
        local,
    )


def _scaled_sign(p) -> tuple:
    def local(x):
        xf = jnp.ravel(x).astype(jnp.float32)
        norm = jnp.sqrt(jnp.sum(jnp.square(xf)))
        r = jnp.sum(jnp.abs(xf)) / jnp.where(norm > 0, math.sqrt(xf.size) * norm, 1.0)
        return jnp.where(norm > 0, 2.0 * r - 1.0, 1.0)

    return Declared(
        bound=(
            "(‖x‖₂/√d) sign(x) has ‖Q(x) − x‖² = (2 − 2‖x‖₁/(√d‖x‖₂)) ‖x‖² exactly, δ(x) = 2‖x‖₁/(√d‖x‖₂) − 1: "
            "a contraction where ‖x‖₁ > √d‖x‖₂/2, expanding a sparse x up to (2 − 2/√d) ‖x‖² (DoubleSqueeze "
            "assumes a bounded error instead)"
        ),
        local_contraction=local,
    )


def _threshold(p) -> tuple:
    v, max_ratio = p["v"], p["max_ratio"]
    why = "entries with |x_i| ≥ v are sent exactly, the others dropped: non-expansive, δ = 0"
    if isinstance(v, jax.core.Tracer) or max_ratio < 1.0:
        return Declared(None, 0.0, why + " (no absolute bound: a traced v, or a buffer that can drop entries ≥ v)")
    return Declared(
        None,
        0.0,
        why + "; with every qualifying entry sent (max_ratio = 1), |x_i − Q(x)_i| ≤ min(|x_i|, v), so "
        "δ(x) = 1 − Σ min(x_i², v²)/‖x‖²",
        _absolute(float(v)),
    )


def _inceptionn(p) -> tuple:
    quantum = 2.0 ** math.floor(math.log2(p["error_bound"]))
    return Declared(
        None,
        0.0,
        (
            "fixed-point truncation toward zero with step Δ = 2^floor(log2 error_bound) (entries below Δ dropped, "
            "large ones sent raw): |x_i − Q(x)_i| ≤ min(|x_i|, Δ), so non-expansive (δ = 0) and "
            "δ(x) = 1 − Σ min(x_i², Δ²)/‖x‖²"
        ),
        _absolute(quantum),
    )


_NON_EXPANSIVE = {
    "dgc": "sends entries x_i exactly at or above a sampled threshold (a mask: non-expansive, δ = 0), the first "
    "k of them in index order when between k and upper_bound·k qualify, so the largest entry can be missed "
    "(no uniform δ > 0)",
    "powersgd": "an orthogonal projection of the (summed) matrix onto rank r (non-expansive, δ = 0), with no "
    "uniform δ > 0 (Vogels et al. 2019 pair it with error feedback)",
    "sketchml": "bucket means are a least-squares projection onto the bucket indicators (non-expansive, δ = 0) "
    "with no uniform δ > 0",
}

_NO_CONTRACTION = {
    "signsgd": "sign(x) has no scale, so ‖Q(x) − x‖ is not bounded by any multiple of ‖x‖ (a small x is sent as "
    "±1); jaxcomm.compressors.efsignsgd() sends (‖x‖₁/d) sign(x), a contraction with δ ≥ 1/d",
    "signum": "the sign of the momentum has no scale, so ‖Q(x) − x‖ is not bounded by any multiple of ‖x‖; "
    "jaxcomm.compressors.efsignsgd() sends (‖x‖₁/d) sign(x), a contraction with δ ≥ 1/d",
}


def _non_expansive(why: str, p) -> tuple:
    return Declared(None, 0.0, why)


def _no_contraction(why: str, p) -> tuple:
    return Declared(bound=f"no contraction: {why}", no_contraction=why)


BOUNDS: dict[str, Callable[[dict], tuple]] = {
    "none": _none,
    "fp16": _fp16,
    "bf16": _bf16,
    "topk": _topk,
    "randomk": _randomk,
    "efsignsgd": _efsignsgd,
    "onebit": _onebit,
    "natural": _natural,
    "qsgd": _qsgd,
    "terngrad": _terngrad,
    "stochastic_rounding": _stochastic_rounding,
    "random_sparsification": _random_sparsification,
    "clipping": _clipping,
    "eightbit": _eightbit,
    "qsparse": _qsparse,
    "adaptive": _adaptive,
    "scaled_sign": _scaled_sign,
    "threshold": _threshold,
    "inceptionn": _inceptionn,
    **{name: functools.partial(_non_expansive, why) for name, why in _NON_EXPANSIVE.items()},
    **{name: functools.partial(_no_contraction, why) for name, why in _NO_CONTRACTION.items()},
}
"""Registry name -> ``params -> Declared`` (or its first three fields as a plain tuple)."""


def declare(c: Compressor) -> Compressor:
    """``c`` with the declared bound of its registry name (unchanged if it has one or the name has none)."""
    declared = (c.variance_factor, c.contraction, c.local_contraction)
    if any(b is not None for b in declared) or c.no_contraction or c.bound or c.name not in BOUNDS:
        return c
    return dataclasses.replace(c, **Declared(*BOUNDS[c.name](c.params))._asdict())
