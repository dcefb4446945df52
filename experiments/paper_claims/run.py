"""Paper claims under repetition: three seeds, longer runs, error bars.

Single-seed results of the paper studies (docs/experiments.md) that contradicted the papers or
were unexplained. Each is re-run here with every seed of ``--seeds`` (default 0, 1, 2), longer
than the original 100-120 steps, beside the variants that test a proposed cause:

==========================  ===================================================================
study                       variants (all: Fashion-MNIST images or Shakespeare characters)
==========================  ===================================================================
``topk-ef``                 GRACE-study setting (EventGraD CNN, 8 workers, global batch 128,
                            SGD lr 0.05, momentum 0.9): top-k 1 % with and without error
                            feedback; the same two with momentum 0 at lr 0.5 (the same
                            long-run step size ``lr / (1 − momentum)``); uncompressed.
``doublesqueeze-topk``      DoubleSqueeze-study setting (global batch 256): top-k 1 % without
                            feedback, MEM-SGD top-k (worker feedback), DoubleSqueeze top-k
                            (worker and server feedback); uncompressed.
``qsgd-ef``                 GRACE-study setting: QSGD (16 levels) without feedback, and with
                            error feedback on ``contractive(qsgd)`` (scaled by 1/(1 + ω));
                            uncompressed. Error feedback on the unscaled QSGD is refused by
                            the library (QSGD is not a contraction); the refusal is recorded.
``gradient-dropping``       Char-LSTM on Shakespeare, 4 workers, Adam 0.002, drop ratio 0.99
                            with warm-up T = 100, parameter averaging every 500 steps (the
                            paper's): baseline, drop99, PARTIAL, PARTIAL + sync.
``sign-ef``                 GRACE-study setting, 300 steps: SignSGD and SIGNUM without and with
                            error feedback (GRACE's residual around the unscaled sign, which
                            the library refuses unless asked: ``residual(needs_contraction=
                            False)``; the refusal is recorded) at every rate of ``SIGN_RATES``
                            with the first seed, then each arm at its best rate with the other
                            seeds; uncompressed at lr 0.05.
``doublesqueeze-bytes``     DoubleSqueeze-study setting: SGD, MEM-SGD top-k 1 %, DoubleSqueeze
                            top-k 1 % at equal steps; SGD and MEM-SGD for the steps whose bytes
                            equal DoubleSqueeze's run; DoubleSqueeze top-k 10 % (one seed). The
                            gap to SGD is split into its measured causes (:func:`gap_causes`).
==========================  ===================================================================

Every run records its evaluation curve; the summary gives, per variant, the mean and sample
standard deviation over the seeds of the final metric, and the seed-paired difference of each
compared pair (mean ± standard deviation of the per-seed differences). ``<study>.json`` and
``<study>.png`` (mean curve, ±1 standard deviation band) are written to ``--out``, with
``sign-ef-sweep.png`` (final accuracy against the rate) and ``doublesqueeze-bytes-bytes.png`` (accuracy
against the megabits a worker sent).

usage: python -m experiments.paper_claims.run [--study all|topk-ef|...] [--seeds 0,1,2]
       [--steps N] [--out docs/img/claims] [--smoke]    (from the repository's root)

or ``jaxcomm run paper-claims [--smoke] [--set studies=topk-ef --set seeds=0,1,2 --set steps=N]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TQDM_DISABLE", "1")

from .config import CLAIMS, PaperClaimsConfig

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TITLES = {
    "topk-ef": "Top-k 1 % with and without error feedback",
    "doublesqueeze-topk": "DoubleSqueeze top-k against its baselines",
    "qsgd-ef": "QSGD with error feedback, scaled to a contraction",
    "gradient-dropping": "Gradient dropping 99 % with local gradients",
    "sign-ef": "SignSGD and SIGNUM with and without EF, each at its best rate",
    "doublesqueeze-bytes": "DoubleSqueeze top-k against SGD at equal steps and equal bytes",
}
SIGN_RATES = (0.00002, 0.0001, 0.0005, 0.0025, 0.0125, 0.05)  # sign-ef's sweep: 3.4 decades, ×5 apart
SIGN_METHODS = ("SignSGD", "SIGNUM")


@dataclasses.dataclass(frozen=True)
class ImageSetting:
    """One image-classification setting (a paper study's, scaled to this machine).

    Attributes:
      model, dataset: as in the experiments' configs.
      workers: data-parallel workers (simulated devices).
      batch_size: global batch (examples per step over all workers).
      steps, eval_every: optimizer steps and steps between evaluations.
      test_examples: test images evaluated.
    """

    model: str = "eventgrad_cnn"
    dataset: str = "fashion_mnist"
    workers: int = 8
    batch_size: int = 128
    steps: int = 1500
    eval_every: int = 100
    test_examples: int = 2000


def _image_variants(study: str) -> dict[str, Callable]:
    """``label -> (() -> (tx, strategy))`` for an image study."""
    import optax

    from jaxcomm import compressors, memory
    from jaxcomm.transforms import compressed_mean, doublesqueeze

    from ..doublesqueeze.baselines import memsgd

    def sgd(lr=0.05, momentum=0.9):
        return optax.sgd(lr, momentum=momentum)

    def mean(c, ef=False):
        return compressed_mean(c, memory=memory.residual() if ef else memory.none())

    topk = lambda: compressors.topk(ratio=0.01)
    dense = {"uncompressed": lambda: (optax.chain(mean(compressors.none()), sgd()), "allreduce")}
    if study == "topk-ef":
        return {
            **dense,
            "top-k": lambda: (optax.chain(mean(topk()), sgd()), "allgather"),
            "top-k + EF": lambda: (optax.chain(mean(topk(), ef=True), sgd()), "allgather"),
            "top-k, momentum 0": lambda: (optax.chain(mean(topk()), sgd(0.5, 0.0)), "allgather"),
            "top-k + EF, momentum 0": lambda: (optax.chain(mean(topk(), ef=True), sgd(0.5, 0.0)), "allgather"),
        }
    if study == "doublesqueeze-topk":
        return {
            **dense,
            "top-k (no feedback)": lambda: (optax.chain(mean(topk()), sgd()), "allgather"),
            "MEM-SGD top-k": lambda: (optax.chain(memsgd(topk()), sgd()), "allgather"),
            "DoubleSqueeze top-k": lambda: (optax.chain(doublesqueeze(topk()), sgd()), "allgather"),
        }
    if study == "qsgd-ef":
        qsgd = lambda: compressors.qsgd(levels=16)
        return {
            **dense,
            "QSGD": lambda: (optax.chain(mean(qsgd()), sgd()), "allgather"),
            "contractive(QSGD) + EF": lambda: (
                optax.chain(mean(compressors.contractive(qsgd()), ef=True), sgd()),
                "allgather",
            ),
        }
    raise ValueError(f"not an image study: {study!r}")


PAIRS = {  # study: (first, second): the seed-paired differences first − second reported
    "topk-ef": [("top-k + EF", "top-k"), ("top-k + EF, momentum 0", "top-k, momentum 0")],
    "doublesqueeze-topk": [("DoubleSqueeze top-k", "top-k (no feedback)"), ("MEM-SGD top-k", "top-k (no feedback)")],
    "qsgd-ef": [("contractive(QSGD) + EF", "QSGD")],
    "gradient-dropping": [("partial+sync", "baseline"), ("partial+sync", "partial"), ("partial", "drop99")],
    "doublesqueeze-bytes": [
        ("SGD", "DoubleSqueeze top-k 1 %"),  # the gap at equal steps
        ("SGD", "MEM-SGD top-k 1 %"),  # its worker (uplink) part
        ("MEM-SGD top-k 1 %", "DoubleSqueeze top-k 1 %"),  # its server (downlink) part
        ("DoubleSqueeze top-k 10 %", "DoubleSqueeze top-k 1 %"),  # density (one seed)
        ("DoubleSqueeze top-k 1 %", "SGD, equal bytes"),
        ("DoubleSqueeze top-k 1 %", "MEM-SGD top-k 1 %, equal bytes (server counted)"),
    ],
}  # sign-ef's pairs depend on the best rates found: see run_study


def _refusal(study: str) -> str | None:
    """The library's error for error feedback on the unscaled compressor, where the study has one."""
    if study not in ("qsgd-ef", "sign-ef"):
        return None
    import jax.numpy as jnp

    from jaxcomm import compressors, memory
    from jaxcomm.transforms import compressed_mean

    # qsgd: a 1,000-entry tensor has ω = min(1000/16², √1000/16) = 1.98; a sign has no scale at all
    c = compressors.qsgd(levels=16) if study == "qsgd-ef" else compressors.signsgd()
    try:
        compressed_mean(c, memory=memory.residual()).init(jnp.zeros(1000))
    except ValueError as e:
        return f"ValueError: {e}"
    raise AssertionError(f"compressed_mean accepted error feedback on {c.name} (not a contraction)")


def _train_one(study: str, label: str, build: Callable, seed: int, setting: ImageSetting, data, steps=None) -> dict:
    """One run of ``build() -> (tx, strategy)`` for ``steps`` (default ``setting.steps``); its record:
    the test-accuracy curve, the final accuracy and the library's wire count (one worker's bits)."""
    from .._common import train_data_parallel

    steps = steps or setting.steps
    tx, strategy = build()
    t0 = time.perf_counter()
    r = train_data_parallel(
        name=label,
        tx=tx,
        model=setting.model,
        train=data[0],
        test=data[1],
        workers=setting.workers,
        batch_size=setting.batch_size,
        steps=steps,
        eval_every=min(setting.eval_every, steps),
        seed=seed,
        strategy=strategy,
        progress=False,
    )
    print(f"{study}: {label} seed {seed}: accuracy {r['final_accuracy']:.4f} after {steps} steps", flush=True)
    return {
        "variant": label,
        "seed": seed,
        "steps": steps,
        "curve": [(row["step"], row["eval_accuracy"]) for row in r["history"] if "eval_accuracy" in row],
        "final": r["final_accuracy"],
        "wire_bits_per_worker": r["wire_bits_per_worker"],
        "wall_s": time.perf_counter() - t0,
    }


def _image_data(setting: ImageSetting):
    from .._common import load_image_task

    return load_image_task(setting.dataset, 0, setting.test_examples)


def run_image(study: str, seeds: list[int], setting: ImageSetting, smoke: bool = False) -> list[dict]:
    """Every variant of ``study`` (smoke: the first compressed one and the last) for every seed;
    one record per run (curve of test accuracy)."""
    data = _image_data(setting)
    variants = _image_variants(study)
    if smoke:
        labels = list(variants)
        variants = {k: variants[k] for k in (labels[1], labels[-1])}
    return [_train_one(study, label, build, seed, setting, data) for label, build in variants.items() for seed in seeds]


def _sign_arm(arm: str, lr: float) -> Callable:
    """``() -> (tx, strategy)`` for one arm of ``sign-ef`` at learning rate ``lr``.

    ``arm`` is ``"SignSGD"`` or ``"SIGNUM"`` (the compressor at its defaults: SIGNUM's momentum 0.9 inside
    the compressor), optionally followed by ``" + EF"``: GRACE's Eq. 4 residual ``φ = m + g``,
    ``m ← φ − sign(φ)`` around the *unscaled* sign. The library refuses that pairing by default (a sign
    is no contraction); ``memory.residual(needs_contraction=False)`` is its opt-in. The mean of the
    workers' signs feeds SGD with momentum 0.9 at ``lr``, as in the GRACE study.
    """
    import optax

    from jaxcomm import compressors, memory
    from jaxcomm.transforms import compressed_mean

    method, _, ef = arm.partition(" + ")

    def build():
        c = {"SignSGD": compressors.signsgd, "SIGNUM": compressors.signum}[method]()
        mem = memory.residual(needs_contraction=False) if ef else memory.none()
        # the rate is a value of the optimizer state, not a constant of the program: every rate runs the
        # same compiled step (a persistent compilation cache, as the smoke test's, then compiles it once)
        sgd = optax.inject_hyperparams(optax.sgd)(learning_rate=lr, momentum=0.9)
        return optax.chain(compressed_mean(c, memory=mem), sgd), "allgather"

    return build


def run_sign_ef(seeds: list[int], setting: ImageSetting, rates, methods, smoke: bool) -> tuple[list[dict], dict]:
    """The sweep, then the seeds at each arm's best rate.

    Every arm (each of ``methods`` without and with error feedback) runs at every rate of ``rates`` with
    ``seeds[0]`` only; an arm's best rate is the one with the highest final test accuracy there (the
    lowest rate on a tie). Each arm then runs at its best rate with the other seeds, and the
    uncompressed mean at the setting's lr 0.05 with every seed (not in a smoke run). Returns the
    records (each with ``arm`` and ``lr``) and ``{arm: best rate}``.
    """
    import optax

    from jaxcomm import compressors
    from jaxcomm.transforms import compressed_mean

    data = _image_data(setting)
    arms = [f"{m}{ef}" for m in methods for ef in ("", " + EF")]

    def one(arm, lr, seed):
        r = _train_one("sign-ef", f"{arm}, lr {lr:g}", _sign_arm(arm, lr), seed, setting, data)
        return {**r, "arm": arm, "lr": lr}

    records = [one(arm, lr, seeds[0]) for arm in arms for lr in rates]
    best = {arm: max((r for r in records if r["arm"] == arm), key=lambda r: r["final"])["lr"] for arm in arms}
    records += [one(arm, best[arm], seed) for arm in arms for seed in seeds[1:]]
    if not smoke:
        dense = lambda: (optax.chain(compressed_mean(compressors.none()), optax.sgd(0.05, momentum=0.9)), "allreduce")
        records += [
            {
                **_train_one("sign-ef", "uncompressed, lr 0.05", dense, seed, setting, data),
                "arm": "uncompressed",
                "lr": 0.05,
            }
            for seed in seeds
        ]
    return records, best


DS_DENSE_RATIO = 0.1  # doublesqueeze-bytes' denser DoubleSqueeze run


def run_doublesqueeze_bytes(seeds: list[int], setting: ImageSetting, smoke: bool) -> tuple[list[dict], dict]:
    """SGD, MEM-SGD top-k 1 % and DoubleSqueeze top-k 1 % for ``setting.steps`` with every seed; then
    SGD (and MEM-SGD) for the steps whose bytes equal DoubleSqueeze's whole run, every seed; and one
    denser DoubleSqueeze (top-k ``DS_DENSE_RATIO``, ``seeds[0]``; not in a smoke run, nor MEM-SGD).

    Bytes are the library's wire count (``wire_bits_per_worker``: what one worker hands to the
    collectives). Per step, DoubleSqueeze's worker sends a top-k payload of ``P`` bits and SGD's a
    dense gradient of ``D`` bits, so SGD's equal-bytes run has ``⌊N P / D⌋`` steps. The replicated
    server step of DoubleSqueeze sends nothing on that count; counted as a parameter server (the
    paper's setting: the server sends ``P`` bits back, MEM-SGD's and SGD's server ``D``), the SGD
    step count is the same and MEM-SGD's equal-bytes run has ``⌊N · 2P / (P + D)⌋`` steps. Returns
    the records and ``{"P", "D", "N", "sgd_steps", "memsgd_steps"}``.
    """
    import optax

    from jaxcomm import compressors
    from jaxcomm.transforms import compressed_mean, doublesqueeze

    from ..doublesqueeze.baselines import memsgd

    sgd = lambda: optax.sgd(0.05, momentum=0.9)
    build = {
        "SGD": lambda: (optax.chain(compressed_mean(compressors.none()), sgd()), "allreduce"),
        "MEM-SGD top-k 1 %": lambda: (optax.chain(memsgd(compressors.topk(ratio=0.01)), sgd()), "allgather"),
        "DoubleSqueeze top-k 1 %": lambda: (
            optax.chain(doublesqueeze(compressors.topk(ratio=0.01)), sgd()),
            "allgather",
        ),
        f"DoubleSqueeze top-k {DS_DENSE_RATIO:.0%}".replace("%", " %"): lambda: (
            optax.chain(doublesqueeze(compressors.topk(ratio=DS_DENSE_RATIO)), sgd()),
            "allgather",
        ),
    }
    data = _image_data(setting)
    one = lambda label, seed, steps=None, build_label=None: _train_one(
        "doublesqueeze-bytes", label, build[build_label or label], seed, setting, data, steps
    )
    equal_steps = (
        ["SGD", "DoubleSqueeze top-k 1 %"] if smoke else ["SGD", "MEM-SGD top-k 1 %", "DoubleSqueeze top-k 1 %"]
    )
    records = [one(label, seed) for label in equal_steps for seed in seeds]
    n = setting.steps
    per_step = lambda label: next(r["wire_bits_per_worker"] / r["steps"] for r in records if r["variant"] == label)
    p, d = per_step("DoubleSqueeze top-k 1 %"), per_step("SGD")
    info = {
        "P": p,
        "D": d,
        "N": n,
        "sgd_steps": max(1, int(n * p // d)),
        "memsgd_steps": max(1, int(n * 2 * p // (p + d))),
    }
    records += [one("SGD, equal bytes", seed, info["sgd_steps"], "SGD") for seed in seeds]
    if not smoke:
        records += [
            one("MEM-SGD top-k 1 %, equal bytes (server counted)", seed, info["memsgd_steps"], "MEM-SGD top-k 1 %")
            for seed in seeds
        ]
        dense_label = list(build)[-1]
        records += [one(dense_label, seeds[0])]
    return records, info


def run_gradient_dropping(seeds: list[int], steps: int, eval_every: int, smoke: bool) -> list[dict]:
    """baseline, drop99, PARTIAL and PARTIAL + sync (every 500 steps) for every seed."""
    import tempfile

    from ..gradient_dropping.config import GradientDroppingConfig
    from ..gradient_dropping.run import run

    base = GradientDroppingConfig.smoke() if smoke else GradientDroppingConfig.default()
    base = dataclasses.replace(
        base,
        steps=steps,
        eval_every=eval_every,
        **({} if smoke else {"hidden": 128, "embed": 32, "batch_size": 32, "eval_windows": 256}),
    )
    records = []
    for seed in seeds:
        runs = ((("baseline", "drop99", "partial"), (False,)), (("partial",), (True,)))
        if smoke:
            runs = ((("drop99",), (False,)), (("partial",), (True,)))
        for methods, sync in runs:
            cfg = dataclasses.replace(base, seed=seed, methods=methods, sync=sync)
            t0 = time.perf_counter()
            with tempfile.TemporaryDirectory() as tmp:
                out = run(cfg, Path(tmp))
            wall = (time.perf_counter() - t0) / len(out["runs"])
            for r in out["runs"]:
                curve = [(row["step"], row["eval_perplexity"]) for row in r["history"] if "eval_perplexity" in row]
                records.append(
                    {
                        "variant": r["name"],
                        "seed": seed,
                        "curve": curve,
                        "final": r["final_valid_perplexity"],
                        "wire_bits_per_worker": r["wire_bits_per_worker"],
                        "wall_s": wall,
                    }
                )
                print(f"gradient-dropping: {r['name']} seed {seed}: perplexity {r['final_valid_perplexity']:.3f}")
    return records


def summarize(records: list[dict], pairs: list[tuple[str, str]]) -> dict:
    """Per variant: mean and sample std of ``final`` over seeds; per pair: seed-paired differences."""
    import numpy as np

    variants: dict[str, dict] = {}
    for r in records:
        variants.setdefault(r["variant"], {})[r["seed"]] = r["final"]
    table = {
        v: {
            "mean": float(np.mean(list(by_seed.values()))),
            "std": float(np.std(list(by_seed.values()), ddof=1)) if len(by_seed) > 1 else float("nan"),
            "seeds": len(by_seed),
            "values": [by_seed[s] for s in sorted(by_seed)],
        }
        for v, by_seed in variants.items()
    }
    diffs = []
    for a, b in pairs:
        if a not in variants or b not in variants:
            continue
        common = sorted(set(variants[a]) & set(variants[b]))
        d = np.array([variants[a][s] - variants[b][s] for s in common])
        diffs.append(
            {
                "pair": f"{a} − {b}",
                "mean": float(d.mean()),
                "std": float(d.std(ddof=1)) if len(d) > 1 else float("nan"),
                "values": d.tolist(),
            }
        )
    return {"variants": table, "differences": diffs}


def steps_to_reach(curve, target: float) -> float | None:
    """The first step at which the piecewise-linear ``curve`` ``[(step, y), ...]`` (rising steps) reaches
    ``target``: linear interpolation between the two evaluations around the crossing; the first
    step when it starts at or above ``target``; ``None`` when it never gets there."""
    prev = None
    for step, y in curve:
        if y >= target:
            if prev is None:
                return float(step)
            (s0, y0), s1 = prev, step
            return s0 + (target - y0) * (s1 - s0) / (y - y0)
        prev = (step, y)
    return None


def mean_curve(records: list[dict], variant: str) -> list[tuple[int, float]]:
    """The mean over seeds of ``variant``'s curves, evaluation by evaluation (one step grid)."""
    import numpy as np

    curves = [r["curve"] for r in records if r["variant"] == variant]
    return [(int(s), float(np.mean([c[i][1] for c in curves]))) for i, (s, _) in enumerate(curves[0])]


def gap_causes(records: list[dict], summary: dict, steps: int) -> dict:
    """doublesqueeze-bytes: the share of SGD − DoubleSqueeze (equal steps, mean over seeds) each measured
    cause accounts for.

    ``uplink`` = SGD − MEM-SGD (top-k 1 % with worker feedback, server dense) and ``downlink`` = MEM-SGD −
    DoubleSqueeze (the server's compression with its feedback, the only difference between the two):
    they add up to the gap. ``density``: DoubleSqueeze at 10 % − at 1 %, seed-paired on the one seed of
    the denser run. ``lag_steps``: how many steps earlier SGD's mean curve reached DoubleSqueeze's final
    mean accuracy (the run length SGD would need to be equal; a warm-up of the memories shows as a lag
    of about 1/ratio = 100 steps); ``gap_by_step``: the gap at every evaluation.
    """
    diff = {d["pair"]: d for d in summary["differences"]}
    gap = diff["SGD − DoubleSqueeze top-k 1 %"]["mean"]
    out = {"gap": gap}
    for name, pair in (
        ("uplink", "SGD − MEM-SGD top-k 1 %"),
        ("downlink", "MEM-SGD top-k 1 % − DoubleSqueeze top-k 1 %"),
        ("density", "DoubleSqueeze top-k 10 % − DoubleSqueeze top-k 1 %"),
    ):
        if pair in diff:
            d = diff[pair]
            out[name] = {
                "points": d["mean"],
                "std": d["std"],
                "share_of_gap": d["mean"] / gap,
                "seeds": len(d["values"]),
            }
    sgd, ds = mean_curve(records, "SGD"), mean_curve(records, "DoubleSqueeze top-k 1 %")
    reached = steps_to_reach(sgd, summary["variants"]["DoubleSqueeze top-k 1 %"]["mean"])
    out["lag_steps"] = None if reached is None else steps - reached
    out["gap_by_step"] = [(s, a - b) for (s, a), (_, b) in zip(sgd, ds)]
    return out


def plot(
    records: list[dict],
    path: Path,
    *,
    title: str,
    ylabel: str,
    logy: bool = False,
    variants: list[str] | None = None,
    x: str = "step",
) -> None:
    """Mean curve per variant over seeds with a ±1 sample-standard-deviation band.

    ``variants``: only these (default all); ``x``: ``"step"``, or ``"Mbit"`` for one worker's wire
    megabits sent by that step (log scale; each run's bits per step are its total over its steps).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7.0, 4.4))
    by_variant: dict[str, list] = {}
    for r in records:
        if variants is None or r["variant"] in variants:
            by_variant.setdefault(r["variant"], []).append(r)
    for label, runs in by_variant.items():
        curves = [r["curve"] for r in runs]
        per_step = runs[0]["wire_bits_per_worker"] / runs[0].get("steps", curves[0][-1][0]) / 1e6
        steps = [s * per_step if x == "Mbit" else s for s, _ in curves[0]]
        ys = np.array([[y for _, y in c] for c in curves])
        mean = ys.mean(axis=0)
        (line,) = ax.plot(steps, mean, label=f"{label} (n={len(curves)})", marker="." if len(steps) < 30 else None)
        if len(curves) > 1:
            std = ys.std(axis=0, ddof=1)
            ax.fill_between(steps, mean - std, mean + std, color=line.get_color(), alpha=0.2)
    ax.set_xlabel("Mbit sent per worker" if x == "Mbit" else "step")
    if x == "Mbit":
        ax.set_xscale("log")
    ax.set_ylabel(ylabel)
    if logy:
        ax.set_yscale("log")
    _finish(fig, ax, path, title)


def _finish(fig, ax, path: Path, title: str) -> None:
    """Title, grid and legend on ``ax``; ``fig`` written to ``path`` (PNG, its title in the metadata) and closed."""
    import matplotlib.pyplot as plt

    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120, metadata={"Title": title})
    plt.close(fig)


def plot_sweep(records: list[dict], path: Path, *, title: str) -> None:
    """sign-ef's sweep: the final accuracy of each arm's first seed against the learning rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seed = min(r["seed"] for r in records)
    fig, ax = plt.subplots(figsize=(7.0, 4.4))
    for arm in dict.fromkeys(r["arm"] for r in records if r["arm"] != "uncompressed"):
        pts = sorted((r["lr"], r["final"]) for r in records if r["arm"] == arm and r["seed"] == seed)
        ax.plot(*zip(*pts), marker="o", label=arm)
    ax.set_xscale("log")
    ax.set_xlabel("learning rate (SGD, momentum 0.9)")
    ax.set_ylabel("final test accuracy")
    _finish(fig, ax, path, title)


def draw(result: dict, png: Path) -> list[Path]:
    """Every figure of a study's ``result``: ``png`` (the curves), and the study's others beside it
    (``<stem>-sweep.png``, ``<stem>-bytes.png``). Returns their paths."""
    plot(result["runs"], png, **result["figure"])
    paths = [png]
    for suffix, figure in result.get("more_figures", {}).items():
        path = png.with_name(f"{png.stem}-{suffix}.png")
        if suffix == "sweep":
            plot_sweep(result["runs"], path, **figure)
        else:
            plot(result["runs"], path, **figure)
        paths.append(path)
    return paths


def run_study(study: str, seeds: list[int], steps: int | None, out: Path, smoke: bool) -> dict:
    """Run one study, write ``<study>.json`` and its figures (:func:`draw`) into ``out``; return the record."""
    t0 = time.perf_counter()
    refused = _refusal(study)  # before the runs: a failure here must not lose them
    pairs, extra, more_figures, shown = PAIRS.get(study, []), {}, {}, {}
    if study == "gradient-dropping":
        n = steps or (6 if smoke else 3000)
        records = run_gradient_dropping(seeds, n, max(1, n // 12) if not smoke else 3, smoke)
        setting = {"model": "CharLSTM", "hidden": 128, "embed": 32, "workers": 4, "steps": n, "sync_every": 500}
        ylabel, logy = "validation perplexity (worker 0)", True
        setting_text = "Shakespeare, Char-LSTM, 4 workers"
    else:
        s = ImageSetting(batch_size=256 if study.startswith("doublesqueeze") else 128)
        if study == "sign-ef":
            s = dataclasses.replace(s, steps=300, eval_every=50)
        if smoke:
            s = dataclasses.replace(s, model="mlp", workers=4, batch_size=64, steps=4, eval_every=2, test_examples=256)
        if steps:
            s = dataclasses.replace(s, steps=steps, eval_every=max(1, steps // 15))
        if study == "sign-ef":  # smoke: one method, the sweep's ends
            rates, methods = (SIGN_RATES[0], SIGN_RATES[-1]) if smoke else SIGN_RATES, SIGN_METHODS[: 1 if smoke else 2]
            records, best = run_sign_ef(seeds, s, rates, methods, smoke)
            pairs = [(f"{m} + EF, lr {best[m + ' + EF']:g}", f"{m}, lr {best[m]:g}") for m in methods]
            extra = {"rates": list(rates), "best_lr": best}
            shown = {"variants": [f"{arm}, lr {lr:g}" for arm, lr in best.items()] + ["uncompressed, lr 0.05"]}
            more_figures["sweep"] = {
                "title": f"Sign methods against the learning rate (seed {seeds[0]}, {s.steps} steps)"
            }
        elif study == "doublesqueeze-bytes":
            records, info = run_doublesqueeze_bytes(seeds, s, smoke)
            extra = {"bytes": info}
        else:
            records = run_image(study, seeds, s, smoke)
        setting = dataclasses.asdict(s)
        ylabel, logy = "test accuracy", False
        setting_text = f"{s.dataset}, {s.model}, {s.workers} workers"
    summary = summarize(records, pairs)
    if study == "doublesqueeze-bytes":
        summary["causes"] = gap_causes(records, summary, setting["steps"])
    result = {
        "study": study,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "setting": setting,
        "seeds": seeds,
        "refused": refused,
        **extra,
        "summary": summary,
        "runs": records,
        "wall_s": time.perf_counter() - t0,
        "platform": platform.platform(),
    }
    result["figure"] = {
        "title": f"{TITLES[study]}\n{setting_text}; mean ± 1 s.d. of {len(seeds)} seeds",
        "ylabel": ylabel,
        "logy": logy,
        **shown,
    }
    if study == "doublesqueeze-bytes":
        # on the library's count; MEM-SGD's equal-bytes run counts the server's dense reply too
        library_count = [v for v in summary["variants"] if "server counted" not in v]
        more_figures["bytes"] = {**result["figure"], "x": "Mbit", "variants": library_count}
    if more_figures:
        result["more_figures"] = more_figures
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{study}.json").write_text(json.dumps(result, indent=1))
    draw(result, out / f"{study}.png")
    return result


def run(config: PaperClaimsConfig, out_dir: Path) -> dict:
    """Run every study of ``config`` (:func:`run_study`: ``<study>.json`` and its figures in
    ``out_dir``); one summary row per seed-paired difference, each printed as it is known."""
    rows = []
    for study in config.studies:
        r = run_study(study, list(config.seeds), config.steps, Path(out_dir), config.small)
        for d in r["summary"]["differences"]:
            print(f"{study}: {d['pair']}: {d['mean']:+.4f} ± {d['std']:.4f} (seed-paired)", flush=True)
            rows.append({"study": study, "pair": d["pair"], "mean": d["mean"], "std": d["std"]})
    return {"summary": rows, "files": [f"{study}.json" for study in config.studies]}


def replot(path: Path) -> Path:
    """Redraw ``<study>.png`` (and the study's other figures) beside a ``<study>.json`` written by
    :func:`run_study`."""
    result = json.loads(Path(path).read_text())
    st = result["setting"]
    where = f"{st['dataset']}, {st['model']}, {st['workers']} workers" if "dataset" in st else "Shakespeare, Char-LSTM"
    result.setdefault(
        "figure",
        {
            "title": f"{TITLES[result['study']]}\n{where}; mean ± 1 s.d. of {len(result['seeds'])} seeds",
            "ylabel": "validation perplexity (worker 0)" if result["study"] == "gradient-dropping" else "test accuracy",
            "logy": result["study"] == "gradient-dropping",
        },
    )
    return draw(result, Path(path).with_suffix(".png"))[0]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--study", default="all", choices=("all", *CLAIMS))
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default: the study's)")
    p.add_argument("--out", default=str(ROOT / "docs" / "img" / "claims"))
    p.add_argument(
        "--smoke", action="store_true", help="a few steps of small models, two variants per study (checks the pipeline)"
    )
    p.add_argument("--replot", metavar="JSON", help="only redraw the figure of a written <study>.json")
    a = p.parse_args(argv)
    if a.replot:
        print(replot(Path(a.replot)))
        return
    try:
        seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
    except ValueError:
        p.error(f"--seeds must be comma-separated integers; got {a.seeds!r}")
    if not seeds:
        p.error("--seeds must name at least one seed")
    if a.steps is not None and a.steps < 1:
        p.error(f"--steps must be >= 1; got {a.steps}")
    studies = CLAIMS if a.study == "all" else (a.study,)
    run(PaperClaimsConfig(studies=studies, seeds=tuple(seeds), steps=a.steps, small=a.smoke), Path(a.out))


if __name__ == "__main__":
    main()
