"""``jaxcomm run gradient-dropping-time``: gradient dropping with local gradients, timed on an emulated link.

The paper's end-to-end study (Sec. 5.3, Table 2) on the char-LSTM of ``gradient-dropping``:
``num_procs`` MPI processes (:mod:`~experiments.gradient_dropping.worker`, trained by
:class:`jaxcomm.train.Trainer` over MPI) inside a private network namespace whose loopback is
shaped by tc (:func:`jaxcomm.netem.launch`): every byte between the processes crosses that link
and the kernel counts it. One job trains every method of every seed in turn, each for the same
number of steps from the same initialisation on the same batches.

Quality target of a seed: its baseline's final validation perplexity ``PPL_base`` times
``1 + target_rtol``. Time to target of a run: the training steps' wall-clock time (rank 0,
evaluation not counted) at which its validation perplexity first reaches the target, linear
between the two evaluations around the crossing; ``None`` if it never does.

The paper's speed claims are ratios of times to a quality: "48 % faster" is
``t_base / t_method - 1`` (En-De, time to 33.5 BLEU: 11.69 h / 7.89 h = 1.48; 28 %:
10.12 h / 7.89 h). :func:`verdicts` computes them so, per seed.

Needs no JAX in this module (the worker imports it).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from jaxcomm.studies import config_to_dict

from ..eager.quality import (
    CLAIM_TOLERANCE,
    claim_row,
    launch_job,
    plot_against_time,
    start_emulated_study,
    summary_rows,
    verdict,
)
from .config import GradientDroppingTimeConfig

__all__ = ["PAPER", "time_to_target", "records", "summarize", "verdicts", "headline", "results_of", "run"]

_WORKER = "experiments.gradient_dropping.worker"

PAPER: dict[str, Any] = {
    "setting": "4 nodes x 4 P100, 40 Gb/s InfiniBand, Marian, Adam; drop ratio 0.99, warm-up 1000 steps, "
    "PARTIAL, parameters averaged every 500 steps (Sec. 4, 5.3)",
    "en_de": {
        "target": "33.5 BLEU",
        "time_to_target_h": {"baseline": 11.69, "drop99": 10.12, "partial+sync": 7.89},
        "words_per_s": {"baseline": 41020, "drop99": 58000, "partial+sync": 56836},
        "dev_bleu": {"baseline": 34.45, "drop99": 34.38, "partial+sync": 34.52},
    },
    "ro_en": {
        "target": "34.5 BLEU",
        "time_to_target_h": {"baseline": 1.38, "drop99": 1.28, "partial+sync": 1.19},
        "words_per_s": {"baseline": 73216, "drop99": 116424, "partial+sync": 112060},
        "dev_bleu": {"baseline": 35.59, "drop99": 35.6, "partial+sync": 35.6},
    },
}
"""Table 2 of the paper (multi-node 4x4 rows: ``baseline`` is the uncompressed multi-node run,
``drop99`` gradient dropping, ``partial+sync`` the local gradient update)."""


def _paper_ratio(task: str, key: str, num: str, den: str) -> float:
    values = PAPER[task][key]
    return float(values[num]) / float(values[den])


def time_to_target(times, values, target: float) -> tuple[float | None, float | None]:
    """``(time, step)`` at which ``values`` (per evaluation, at ``times`` and steps) first reach
    ``target`` or below: linear between the evaluation before and the first at or below (at the
    first evaluation itself if it is already there); ``(None, None)`` if none is.

    ``times`` is a pair ``(times, steps)`` of equal-length sequences.
    """
    t, s = (np.asarray(a, np.float64) for a in times)
    v = np.asarray(values, np.float64)
    hit = np.nonzero(v <= target)[0]
    if not hit.size:
        return None, None
    i = int(hit[0])
    if i == 0:
        return float(t[0]), float(s[0])
    w = (v[i - 1] - target) / (v[i - 1] - v[i])  # in (0, 1]: v[i-1] > target >= v[i]
    return float(t[i - 1] + w * (t[i] - t[i - 1])), float(s[i - 1] + w * (s[i] - s[i - 1]))


def records(job: dict, config: GradientDroppingTimeConfig) -> list[dict]:
    """One record per run of the worker's ``job``: the target and the time and steps to it, the
    time and steps to the seed's common level (``common_perplexity``: the highest final perplexity of the
    seed's runs, which every one of them reaches; not the paper's criterion, a level where the
    speeds of runs that miss the target can still be compared), the final perplexity, the run's
    throughput and steady step, the compute-only step and the communication's share of the steady
    step, the link's and the pipeline's bytes.

    ``step_s``: the mean step after the warm-up (s); ``comm_share = 1 - compute_s / step_s``
    (``None`` where the compute-only step was not measured);
    ``steps_per_s``: steps over the run's timed seconds (warm-up included);
    ``link_bytes_per_step``: the kernel's count over the run (all ranks) per step;
    ``link_share``: the seconds the link needs at its rate for a step's bytes, over the run's mean
    step (``8 link_bytes_per_step / rate / (time_s / steps)``; a lower bound on the communication's
    share that does not depend on a compute-only time measured at another moment; ``None`` on an
    unshaped link).
    """
    from jaxcomm.netem import parse_rate

    warm = int(config.warmup_steps)
    rate = parse_rate(config.bandwidth, "bandwidth")
    by_seed: dict[int, dict] = {}
    for r in job["runs"]:
        by_seed.setdefault(int(r["seed"]), {})[r["method"]] = r
    out = []
    for seed, runs in by_seed.items():
        base_final = runs["baseline"]["curve"][-1]["perplexity"]
        target = base_final * (1.0 + float(config.target_rtol))
        common = max(r["curve"][-1]["perplexity"] for r in runs.values())  # every run of the seed reaches it
        for method, r in runs.items():
            curve = r["curve"]
            clock = ([c["time_s"] for c in curve], [c["step"] for c in curve])
            t, s = time_to_target(clock, [c["perplexity"] for c in curve], target)
            t_common, s_common = time_to_target(clock, [c["perplexity"] for c in curve], common)
            steady = r["step_times"][warm:] or r["step_times"]
            step_s = float(np.mean(steady))
            compute_s = job["compute_s"].get(method)  # None: not measured
            out.append(
                {
                    "method": method,
                    "seed": seed,
                    "target_perplexity": target,
                    "time_to_target_s": t,
                    "steps_to_target": s,
                    "common_perplexity": common,
                    "time_to_common_s": t_common,
                    "steps_to_common": s_common,
                    "final_perplexity": curve[-1]["perplexity"],
                    "final_perplexity_ratio": curve[-1]["perplexity"] / base_final,
                    "steps": int(r["steps"]),
                    "time_s": float(r["time_s"]),
                    "steps_per_s": int(r["steps"]) / float(r["time_s"]),
                    "step_s": step_s,
                    "compute_s": compute_s,
                    "comm_share": None if compute_s is None else 1.0 - compute_s / step_s,
                    "link_bytes": int(r["link_bytes"]),
                    "link_bytes_per_step": int(r["link_bytes"]) / int(r["steps"]),
                    "link_share": None if rate is None else 8 * int(r["link_bytes"]) / rate / float(r["time_s"]),
                    "wire_bytes_per_step_after_warmup": float(np.mean(r["wire_bits_per_step"][warm:] or [0])) / 8,
                    "params": int(r["params"]),
                    "curve": curve,
                }
            )
    return out


_SUMMARY_KEYS = (
    "time_to_target_s",
    "steps_to_target",
    "time_to_common_s",
    "steps_to_common",
    "final_perplexity",
    "steps_per_s",
    "step_s",
    "compute_s",
    "comm_share",
    "link_share",
    "link_bytes_per_step",
    "wire_bytes_per_step_after_warmup",
)


def summarize(recs: list[dict]) -> list[dict]:
    """One row per method: the seeds, how many reached the target, and the mean and sample
    standard deviation (``_std``, ``ddof = 1``) over the seeds of each key (over the seeds that
    reached the target, for the time and steps to it)."""
    return summary_rows(recs, "method", dict.fromkeys(r["method"] for r in recs), _SUMMARY_KEYS)


def _per_seed(recs: list[dict], method: str) -> dict[int, dict]:
    return {r["seed"]: r for r in recs if r["method"] == method}


def _speedups(recs: list[dict], slow: str, fast: str) -> tuple[list, list[bool], list[float]]:
    """Per seed ``t_slow / t_fast`` (times to the target); ``None`` where ``fast`` never reached it.
    Where ``slow`` never did, its whole run's time stands for its time: the ratio is a lower bound
    (flagged ``True`` in the second list). Third: the same ratio of the times to the seed's common
    level (``time_to_common_s``), which both reach."""
    a, b = _per_seed(recs, slow), _per_seed(recs, fast)
    values, bounds, common = [], [], []
    for seed in sorted(b):
        t_fast, t_slow = b[seed]["time_to_target_s"], a[seed]["time_to_target_s"]
        bound = t_slow is None
        values.append(None if t_fast is None else (a[seed]["time_s"] if bound else t_slow) / t_fast)
        bounds.append(bound and t_fast is not None)
        common.append(a[seed]["time_to_common_s"] / b[seed]["time_to_common_s"])
    return values, bounds, common


def verdicts(recs: list[dict], config: GradientDroppingTimeConfig) -> list[dict]:
    """The paper's claims, each with its per-seed values, mean and sample deviation and the
    verdict of :func:`experiments.eager.quality.verdict` (``holds``: every seed on the claimed side
    of 1 and the mean within :data:`~experiments.eager.quality.CLAIM_TOLERANCE` of the paper's
    En-De number; ``partly``; ``does not``).

    * the 48 % claim: ``t_baseline / t_partial+sync`` per seed, against 1.48;
    * the 28 % claim: ``t_drop99 / t_partial+sync``, against 1.28 (a lower bound where vanilla
      dropping never reached the target: its whole run's time);
    * beside both, ``at_common_level``: the same ratios of the times to the seed's common level
      (:func:`records`), which do not decide the verdict;
    * the regime: gradient dropping's raw speed, steps/s of ``drop99`` over ``baseline``, against
      the paper's words/s ratio 1.41;
    * no quality loss: the final perplexity of ``partial+sync`` over the baseline's, each seed
      judged against ``1 + target_rtol`` (the verdict's values are the ratios over it).
    """
    methods = {r["method"] for r in recs}
    rtol = float(config.target_rtol)
    claims: list[dict] = []
    en, ro = "en_de", "ro_en"
    if {"baseline", "partial+sync"} <= methods:
        values, _, common = _speedups(recs, "baseline", "partial+sync")
        paper = _paper_ratio(en, "time_to_target_h", "baseline", "partial+sync")
        claims.append(
            claim_row(
                "PARTIAL + sync reaches the target faster than the uncompressed multi-node baseline "
                "(t_baseline / t_method; '48 % faster' = 1.48)",
                f"{paper:.2f} (En-De, 11.69 h / 7.89 h to 33.5 BLEU); "
                f"{_paper_ratio(ro, 'time_to_target_h', 'baseline', 'partial+sync'):.2f} (Ro-En)",
                paper,
                values,
                True,
                at_common_level=common,
            )
        )
    if {"drop99", "partial+sync"} <= methods:
        values, bounds, common = _speedups(recs, "drop99", "partial+sync")
        paper = _paper_ratio(en, "time_to_target_h", "drop99", "partial+sync")
        claims.append(
            claim_row(
                "PARTIAL + sync reaches the target faster than vanilla gradient dropping "
                "(t_drop / t_method; '28 % faster' = 1.28)",
                f"{paper:.2f} (En-De, 10.12 h / 7.89 h); "
                f"{_paper_ratio(ro, 'time_to_target_h', 'drop99', 'partial+sync'):.2f} (Ro-En)",
                paper,
                values,
                True,
                lower_bound=bounds,
                at_common_level=common,
            )
        )
    if {"baseline", "drop99"} <= methods:
        base, drop = _per_seed(recs, "baseline"), _per_seed(recs, "drop99")
        paper = _paper_ratio(en, "words_per_s", "drop99", "baseline")
        claims.append(
            claim_row(
                "gradient dropping raises the raw training speed (steps/s over the baseline's)",
                f"{paper:.2f} (En-De words/s, 58,000 / 41,020); "
                f"{_paper_ratio(ro, 'words_per_s', 'drop99', 'baseline'):.2f} (Ro-En)",
                paper,
                [drop[s]["steps_per_s"] / base[s]["steps_per_s"] for s in sorted(drop)],
                True,
            )
        )
    if {"baseline", "partial+sync"} <= methods:
        ratios = [r["final_perplexity_ratio"] for r in sorted(_per_seed(recs, "partial+sync").values(),
                                                             key=lambda r: r["seed"])]  # fmt: skip
        row = claim_row(
            f"PARTIAL + sync loses no quality (final perplexity within {rtol:.0%} of the baseline's)",
            "dev BLEU 34.52 against 34.45 (En-De), 35.6 against 35.59 (Ro-En)",
            None,
            ratios,
            False,
        )
        row["verdict"] = verdict([v / (1.0 + rtol) for v in ratios], False, None)
        claims.append(row)
    return claims


def _pm(row: dict, key: str, fmt: str) -> str:
    """``"mean ± std"`` of ``row[key]`` (``"-"`` without a mean, the mean alone without a deviation)."""
    mean, std = row[key], row[f"{key}_std"]
    if mean is None:
        return "-"
    return format(mean, fmt) + ("" if std is None else " ± " + format(std, fmt))


def headline(results: dict) -> list[dict]:
    """The printed table: per method, the seeds at the target, the time and steps to it, the final
    perplexity, the steps per second, the communication's share of the steady step, the link's
    share of a step and its kB per step (mean ± sample deviation over the seeds). The verdicts are
    in ``results["verdicts"]``."""
    return [
        {
            "method": row["method"],
            "at target": f"{row['reached']}/{row['seeds']}",
            "time to target (s)": _pm(row, "time_to_target_s", ".1f"),
            "steps to target": _pm(row, "steps_to_target", ".0f"),
            "final perplexity": _pm(row, "final_perplexity", ".3f"),
            "steps/s": _pm(row, "steps_per_s", ".2f"),
            "comm share": _pm(row, "comm_share", ".2f"),
            "link share": _pm(row, "link_share", ".2f"),
            "link kB/step": format(row["link_bytes_per_step"] / 1e3, ".1f"),
        }
        for row in results["summary"]
    ]


def _plot(recs: list[dict], config: GradientDroppingTimeConfig, out_dir: Path) -> None:
    """``perplexity_vs_time.png``: validation perplexity against the training steps' wall-clock
    time, one line per method and seed, each seed's target dotted."""
    methods = list(dict.fromkeys(r["method"] for r in recs))
    plot_against_time(
        recs, out_dir / "perplexity_vs_time.png", x=lambda r: [c["time_s"] for c in r["curve"]],
        y=lambda r: [c["perplexity"] for c in r["curve"]], group="method", color=lambda m: f"C{methods.index(m)}",
        target="target_perplexity", labels=("training steps' wall-clock time (s, rank 0)", "validation perplexity"),
        title=f"char-LSTM on Shakespeare, {config.num_procs} MPI processes on a {config.bandwidth} link;\n"
        f"target: the baseline's final perplexity x {1 + config.target_rtol:g} (dotted)",
    )  # fmt: skip


def _launch(config: GradientDroppingTimeConfig, env: dict, job_dir: Path) -> dict:
    """The one ``mpirun`` job on the emulated link; the worker's results and the launcher's count."""
    (job_dir / "config.json").write_text(json.dumps(config_to_dict(config)))
    print(f"gradient-dropping-time: {list(config.methods)} x seeds {list(config.seeds)}", flush=True)
    res = launch_job(
        int(config.num_procs),
        [_WORKER, str(job_dir)],
        bandwidth=config.bandwidth,
        env=env,
        timeout=float(config.launch_timeout_s),
        what="the job",
    )
    job = json.loads((job_dir / "results.json").read_text())
    job["launch"] = {"bytes": res.bytes, "packets": res.packets, "drops": res.drops, "wall_s": res.wall_s}
    return job


def run(config: GradientDroppingTimeConfig, out_dir: Path) -> dict:
    """Run the study: one job on the emulated link; write ``perplexity_vs_time.png`` and
    ``results.json``; return ``records`` (:func:`records`), ``summary`` (:func:`summarize`),
    ``verdicts`` (:func:`verdicts`), the paper's numbers, the link (its settings and what Open MPI
    measured on it), the job's totals and the load average (1, 5, 15 min) at the start and the end
    (:func:`results_of`); the worker's own results go to ``job.json``.

    Raises:
      jaxcomm.netem.NetemUnavailable: no private network namespace can be made here.
      RuntimeError: the job failed (its output's tail is in the message).
    """
    from jaxcomm import netem
    from jaxcomm.studies import write_results

    out_dir, env, load_start = start_emulated_study(
        "gradient-dropping-time", __package__, out_dir, netem.RING_COLLECTIVES
    )
    with tempfile.TemporaryDirectory(prefix="gradient-dropping-time-") as tmp:
        # one persistent compilation cache: rank 0 compiles each step, the other ranks load it
        env.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(tmp) / "jax_cache"))
        env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
        job = _launch(config, env, Path(tmp))
    job["load_average"] = {"start": list(load_start), "end": list(os.getloadavg())}
    (out_dir / "job.json").write_text(json.dumps(job))
    results = results_of(job, config)
    _plot(results["records"], config, out_dir)
    write_results(out_dir, results)
    return results


def results_of(job: dict, config: GradientDroppingTimeConfig) -> dict:
    """The study's results from the worker's ``job`` (``job.json`` of a run folder, which also
    records the load average at the start and the end)."""
    from jaxcomm.netem._link import link_settings

    recs = records(job, config)
    return {
        "config": config_to_dict(config),
        "paper": PAPER,
        "claim_tolerance": CLAIM_TOLERANCE,
        "link": {"settings": link_settings(config.bandwidth, "0").describe(), "measured": job["link"]},
        "job": {"launch": job["launch"], "job_s": job["job_s"], "compute_s": job["compute_s"]},
        "load_average_start": job["load_average"]["start"],
        "load_average_end": job["load_average"]["end"],
        "records": recs,
        "summary": summarize(recs),
        "verdicts": verdicts(recs, config),
    }
