"""The declared error bounds of the built-in compressors, with their sources.

For a compressor ``Q`` acting on ``x`` of ``d`` entries (``E`` over its randomness):

* unbiased, variance factor ω:   ``E‖Q(x) − x‖² ≤ ω ‖x‖²``;
* biased, contraction δ ∈ (0, 1]: ``E‖Q(x) − x‖² ≤ (1 − δ) ‖x‖²``.

:func:`declare` attaches them to a compressor built by a registered factory
(``Compressor.variance_factor``, ``.contraction``, ``.bound``), from the factory's
``params``. A compressor with neither is not a contraction for every input (or
has no useful uniform bound); its ``bound`` text says why. ``jaxcomm.testing``
checks every declared bound by Monte Carlo; error feedback refuses an unbiased
compressor whose ω ≥ 1.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax

from ._base import Compressor

__all__ = ["declare", "BOUNDS"]

Declared = tuple[Callable[[int], float] | float | None, Callable[[int], float] | float | None, str]


def _num_selected(ratio: float, d: int) -> int:
    from ._sparse import num_selected

    return num_selected(ratio, d)


def _none(p) -> Declared:
    return 0.0, None, "exact: Q(x) = x"


def _fp16(p) -> Declared:
    return (
        None,
        1.0 - 2.0**-22,
        (
            "round to nearest float16 (unit roundoff u = 2^-11): |Q(x)_i − x_i| ≤ u |x_i| for entries in the normal "
            "range [6.1e-5, 65504], so δ = 1 − u²; subnormal and overflowing entries are outside the bound"
        ),
    )


def _bf16(p) -> Declared:
    return (
        None,
        1.0 - 2.0**-16,
        ("round to nearest bfloat16 (unit roundoff u = 2^-8): |Q(x)_i − x_i| ≤ u |x_i| for normal entries, δ = 1 − u²"),
    )


def _topk(p) -> Declared:
    ratio, dense_below = p["ratio"], p.get("dense_below", 0)
    return (
        None,
        lambda d: 1.0 if d <= dense_below else _num_selected(ratio, d) / d,
        ("Stich, Cordonnier & Jaggi 2018, Lemma A.1: ‖x − top_k(x)‖² ≤ (1 − k/d) ‖x‖², δ = k/d"),
    )


def _randomk(p) -> Declared:
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


def _efsignsgd(p) -> Declared:
    return (
        None,
        lambda d: 1.0 / d,
        (
            "Karimireddy et al. 2019, Lemma 8: Q(x) = (‖x‖₁/d) sign(x) has ‖Q(x) − x‖² = (1 − ‖x‖₁²/(d‖x‖²)) ‖x‖², "
            "δ ≥ 1/d"
        ),
    )


def _onebit(p) -> Declared:
    tau = p.get("threshold", 0.0)
    if isinstance(tau, jax.core.Tracer) or tau != 0.0:  # a traced τ (inject_hyperparams) may be non-zero
        return (
            None,
            None,
            (
                "1-bit SGD with a threshold τ ≠ 0 decodes to the means of the two groups split at τ, "
                "which is not a contraction for every x (both groups can share a sign); no bound declared"
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


def _natural(p) -> Declared:
    return 1.0 / 8.0, None, "Horváth et al. 2019 (natural compression), Theorem 1: ω = 1/8"


def _qsgd(p) -> Declared:
    s = p["levels"]
    return (
        lambda d: min(d / s**2, math.sqrt(d) / s),
        None,
        ("Alistarh et al. 2017, Lemma 3.1: ω = min(d/s², √d/s) with s levels"),
    )


def _terngrad(p) -> Declared:
    return (
        lambda d: math.sqrt(d) - 1.0,
        None,
        ("Wen et al. 2017: E‖Q(x) − x‖² = ‖x‖₁‖x‖∞ − ‖x‖² ≤ (√d − 1) ‖x‖², ω = √d − 1"),
    )


def _stochastic_rounding(p) -> Declared:
    levels = (1 << p["bits"]) - 1
    return (
        lambda d: d / levels**2,
        None,
        (
            "unbiased rounding to a grid of spacing D = 2M/(2^bits − 1), M = max|x|: per entry variance ≤ D²/4, "
            "so E‖Q(x) − x‖² ≤ d M²/(2^bits − 1)² ≤ d/(2^bits − 1)² ‖x‖², ω = d/(2^bits − 1)²"
        ),
    )


def _random_sparsification(p) -> Declared:
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


def _clipping(p) -> Declared:
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


def _eightbit(p) -> Declared:
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


def _adaptive(p) -> Declared:
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


def _qsparse(p) -> Declared:
    ratio, s = p["ratio"], p["levels"]

    def delta(d):
        k = _num_selected(ratio, d)
        omega_k = min(k / s**2, math.sqrt(k) / s)
        return (1.0 - omega_k) * k / d if omega_k < 1.0 else float("nan")

    return (
        None,
        delta,
        (
            "QSGD_s on top_k (Basu et al. 2019): E‖Q(x) − x‖² ≤ ‖x‖² − (1 − ω_k) ‖top_k(x)‖² with "
            "ω_k = min(k/s², √k/s) (Alistarh et al. 2017, Lemma 3.1) and ‖top_k(x)‖² ≥ (k/d) ‖x‖², so "
            "δ = (1 − ω_k) k/d where ω_k < 1; otherwise no bound"
        ),
    )


_NO_BOUND = {
    "dgc": "sends entries at or above a sampled threshold, the first k of them in index order when between k "
    "and upper_bound·k qualify, so the largest entry can be missed (non-expansive, no uniform δ > 0)",
    "inceptionn": "absolute error bound |x_i − Q(x)_i| < error_bound with |Q(x)_i| ≤ |x_i| (non-expansive), "
    "no relative δ: entries below the bound are dropped",
    "powersgd": "an orthogonal projection of the (summed) matrix onto rank r (non-expansive), with no uniform "
    "δ > 0 (Vogels et al. 2019 pair it with error feedback)",
    "scaled_sign": "(‖x‖₂/√d) sign(x) has ‖Q(x) − x‖² = (2 − 2‖x‖₁/(√d‖x‖₂)) ‖x‖², up to (2 − 2/√d) ‖x‖² "
    "for a sparse x: not a contraction for every x (DoubleSqueeze assumes a bounded error instead)",
    "signsgd": "sign(x) has no scale: ‖Q(x) − x‖ is not bounded by ‖x‖",
    "signum": "the sign of the momentum has no scale: ‖Q(x) − x‖ is not bounded by ‖x‖",
    "sketchml": "bucket means are a least-squares projection (non-expansive) with no uniform δ > 0",
    "threshold": "absolute bound: entries with |x_i| ≤ v are dropped (|x_i − Q(x)_i| ≤ v), no relative δ",
}


def _no_bound(why: str, p) -> Declared:
    return None, None, f"no bound declared: {why}"


BOUNDS: dict[str, Callable[[dict], Declared]] = {
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
    **{name: functools.partial(_no_bound, why) for name, why in _NO_BOUND.items()},
}
"""Registry name -> ``params -> (variance_factor, contraction, bound)``."""


def declare(c: Compressor) -> Compressor:
    """``c`` with the declared bound of its registry name (unchanged if it has one or the name has none)."""
    if c.variance_factor is not None or c.contraction is not None or c.bound or c.name not in BOUNDS:
        return c
    omega, delta, why = BOUNDS[c.name](c.params)
    return dataclasses.replace(c, variance_factor=omega, contraction=delta, bound=why)
