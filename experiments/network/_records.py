"""The time-to-accuracy study's records: per link, method and seed, measured and predicted.

Pure functions of the jobs' ``results.json`` (no JAX, no launch): a record per link, method
and seed for each route (:func:`records_end_to_end`, :func:`records_decomposed`,
:func:`records_predicted`), their summary over seeds with the speed-ups (:func:`summarize`),
the routes' agreement (:func:`agreement`), the sweep's rows (:func:`sweep_records`) and the
headline table (:func:`headline`). :mod:`experiments.network.run` launches the jobs
and re-exports these.
"""

from __future__ import annotations

import math

import numpy as np

_SIXTEEN_BIT = ("fp16", "bf16")

RECORD_KEYS = (
    "link",
    "method",
    "seed",
    "route",
    "reached",
    "steps_to_target",
    "time_to_target_s",
    "bytes_to_target",
    "compute_only_s",
    "utilization",
)
"""The keys of one record of ``results["records"]`` (one per link, method and seed)."""


def _label(bandwidth: str) -> str:
    return "".join(ch for ch in str(bandwidth) if ch.isalnum())


def _rate_bps(bandwidth: str, link: dict) -> float:
    from jaxcomm import netem

    rate = netem.parse_rate(str(bandwidth), "bandwidths")
    return float(link["throughput_bps"]) if rate is None else float(rate)


def _shaped(bandwidth: str) -> bool:
    from jaxcomm import netem

    return netem.parse_rate(str(bandwidth), "bandwidths") is not None


def _predicted_comm_s(run: dict, n: int, rate_bps: float, latency_s: float) -> float:
    """Predicted communication per step (s): one communication period's, over its ``sync_every`` steps."""
    from jaxcomm import cost_model

    h = int(run.get("sync_every", 1))
    net = cost_model.Network(rate_bps / 1e9, latency_s)
    period = cost_model.step_time(
        run["strategy"],
        run["wire_bits_per_step"] * h / 8,
        n,
        net,
        messages=int(round(run["messages_per_step"] * h / n)),
    )
    return float(period) / h


def _predicted_bytes(run: dict, n: int) -> float:
    """Predicted bytes on the link per step, all workers: one period's over its ``sync_every`` steps."""
    from jaxcomm import cost_model

    h = int(run.get("sync_every", 1))
    return float(cost_model.step_bytes(run["strategy"], run["wire_bits_per_step"] * h / 8, n)) / h


def _mean_std(values: list[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    a = np.asarray(values, np.float64)
    return float(a.mean()), float(a.std(ddof=1)) if len(a) > 1 else 0.0


def _bytes_at(run: dict, step: int) -> int | None:
    for point in run["curve"]:
        if point["step"] == step:
            return int(point["link_bytes"])
    return None


def _record(link, run, route, time_s, compute_s: float | None = None) -> dict:
    """``compute_s``: the compute-only step (s) to count; default the run's own (``run["compute_s"]``)."""
    reached = run["reached"] is not None
    steps: int | None = None
    compute_only: float | None = None
    bytes_to: int | None = None
    utilization: float | None = None
    if reached:
        steps = int(run["reached"]["step"])
        compute_only = steps * float(run["compute_s"] if compute_s is None else compute_s)
        bytes_to = _bytes_at(run, steps)
        time_s = float(time_s)
        utilization = compute_only / time_s if time_s > 0 else None
    else:
        time_s = None
    return {
        "link": str(link),
        "method": run["method"],
        "seed": int(run["seed"]),
        "route": route,
        "reached": reached,
        "steps_to_target": steps,
        "time_to_target_s": time_s,
        "bytes_to_target": bytes_to,
        "compute_only_s": compute_only,
        "utilization": utilization,
    }


def records_end_to_end(job: dict) -> list[dict]:
    """One record per run of a training ``job`` (its ``runs``), timed end to end on its link:
    time to target = the training wall-clock (s) at the first evaluation at or above the target;
    bytes to target = the qdisc's count up to that evaluation; ``compute_only_s`` = steps to
    target x the run's compute-only step (s); ``utilization`` = ``compute_only_s`` / time."""
    return [
        _record(job["bandwidth"], r, "end_to_end", r["reached"]["time_s"] if r["reached"] else None)
        for r in job["runs"]
    ]


def decomposed_time(steps: int, timing: dict) -> float:
    """Seconds for ``steps`` steps of a method on a link, from that link's timing entry: the
    measured times of the first ``min(steps, warmup_steps)`` steps (``warmup_step_times``),
    plus the remaining steps x the mean measured step (``step_s``) of the steady window."""
    warm = list(timing.get("warmup_step_times") or [])[: int(steps)]
    return float(sum(warm) + max(int(steps) - len(warm), 0) * float(timing["step_s"]))


def records_decomposed(training: dict, timing_job: dict) -> list[dict]:
    """One record per run of the unshaped ``training`` job, timed on the link of ``timing_job``:
    time to target = :func:`decomposed_time` of the steps to target with the method's timing
    entry there; bytes to target are the training job's (the bytes a step sends do not depend on
    the link). The compute-only step is the timing entry's ``compute_s`` where it has one (measured
    in the timing job just before the method's window, under the same load as its steps), else
    the training run's."""
    timings = {t["method"]: t for t in timing_job["timings"]}
    out = []
    for r in training["runs"]:
        timing = timings[r["method"]]
        t = decomposed_time(r["reached"]["step"], timing) if r["reached"] else None
        out.append(_record(timing_job["bandwidth"], r, "decomposed", t, timing.get("compute_s")))
    return out


def records_predicted(training: dict, rate_bps: float, latency_s: float) -> list[dict]:
    """Time to target on a link the study did not time, from the cost model: one entry per run
    of the ``training`` job that reached the target, with ``method``, ``seed``,
    ``steps_to_target``, ``compute_s`` (the run's compute-only step, s), ``comm_predicted_s``
    (:func:`jaxcomm.cost_model.step_time` on a shared link of ``rate_bps`` bit/s and latency
    ``latency_s`` s for one communication period of the run's mean ``wire_bits`` and
    ``messages``, over its steps) and ``time_predicted_s`` = steps x (compute + communication).

    A run's mean bits per step include its warm-up's (DGC's denser stages), so the bytes term
    is exact in total; the latency term counts each step's messages at the steady count."""
    n = int(training["procs"])
    out = []
    for r in training["runs"]:
        if not r["reached"]:
            continue
        steps = int(r["reached"]["step"])
        comm = _predicted_comm_s(r, n, float(rate_bps), float(latency_s))
        out.append(
            {
                "method": r["method"],
                "seed": int(r["seed"]),
                "steps_to_target": steps,
                "compute_s": float(r["compute_s"]),
                "comm_predicted_s": comm,
                "time_predicted_s": steps * (float(r["compute_s"]) + comm),
            }
        )
    return out


def _measures(jobs: list[dict]) -> dict:
    """``(link, route) -> method -> (procs, link, [per-run measurement dicts])`` from the jobs."""
    out: dict = {}
    for job in jobs:
        entries = job.get("timings") if job.get("mode") == "time" else job.get("runs")
        route = "decomposed" if job.get("mode") == "time" else "end_to_end"
        per = out.setdefault((str(job["bandwidth"]), route), {})
        for e in entries or []:
            per.setdefault(e["method"], (int(job["procs"]), job["link"], job["bandwidth"], []))[3].append(e)
    return out


def summarize(records: list[dict], jobs: list[dict]) -> list[dict]:
    """One row per (link, route, method) of ``records``.

    Time to target over the seeds (mean and sample std, when every seed reached it; s); the
    speed-ups ``speedup_vs_16bit`` (the faster of ``fp16``/``bf16`` at that link and route,
    when present, over this method's time) and ``speedup_vs_fp32`` (dense, ``none``, over this
    method's time); ``compute_bound_limit_s`` = dense's mean steps to target x dense's
    compute-only step (s), and ``limit_fraction`` = that limit / this method's time; the means
    of ``utilization``, ``steps_to_target`` and ``MB_to_target`` (kernel count, 1e6 bytes).
    From ``jobs`` (training jobs' ``runs``, timing jobs' ``timings`` carrying ``compute_s``):
    measured and predicted step, communication and bytes per step (means over seeds)."""
    groups: dict = {}
    for r in records:
        groups.setdefault((r["link"], r["route"]), {}).setdefault(r["method"], []).append(r)
    measures = _measures(jobs)
    rows = []
    for (link, route), by_method in groups.items():
        times = {}
        for method, recs in by_method.items():
            reached = [r for r in recs if r["reached"]]
            times[method] = (
                _mean_std([r["time_to_target_s"] for r in reached]) if len(reached) == len(recs) else (math.nan,) * 2
            )
        dense = by_method.get("none", [])
        if dense and all(r["reached"] for r in dense):
            limit = float(np.mean([r["compute_only_s"] for r in dense]))
        else:
            limit = math.nan
        dense_t = times.get("none", (math.nan,))[0]
        sixteen = [times[m][0] for m in _SIXTEEN_BIT if m in times and times[m][0] == times[m][0]]
        sixteen_t = min(sixteen) if sixteen else math.nan
        for method, recs in by_method.items():
            t, spread = times[method]
            reached = [r for r in recs if r["reached"]]
            all_reached = len(reached) == len(recs)

            def mean_of(key, reached=reached, all_reached=all_reached):
                return float(np.mean([r[key] for r in reached])) if all_reached else math.nan

            row = {
                "link": link,
                "route": route,
                "method": method,
                "seeds": len(recs),
                "reached": f"{len(reached)}/{len(recs)}",
                "time_to_target_s": t,
                "time_std_s": spread,
                "speedup_vs_16bit": sixteen_t / t if t == t else math.nan,
                "speedup_vs_fp32": dense_t / t if t == t else math.nan,
                "compute_bound_limit_s": limit,
                "limit_fraction": limit / t if t == t else math.nan,
                "utilization": mean_of("utilization"),
                "steps_to_target": mean_of("steps_to_target"),
                "MB_to_target": mean_of("bytes_to_target") / 1e6,
            }
            got = measures.get((link, route), {}).get(method)
            if got is not None:
                n, link_meas, bandwidth, runs = got
                rate = _rate_bps(bandwidth, link_meas)
                comm_pred = float(np.mean([_predicted_comm_s(r, n, rate, link_meas["latency_s"]) for r in runs]))
                step = float(np.mean([r["step_s"] for r in runs]))
                compute = float(np.mean([r["compute_s"] for r in runs]))
                row.update(
                    {
                        "sync_every": int(runs[0].get("sync_every", 1)),
                        "step_s": step,
                        "compute_s": compute,
                        "comm_s": step - compute,
                        "comm_predicted_s": comm_pred,
                        "step_predicted_s": compute + comm_pred,
                        "link_MB_per_step": float(np.mean([r["link_bytes_per_step"] for r in runs])) / 1e6,
                        "predicted_MB_per_step": float(np.mean([_predicted_bytes(r, n) for r in runs])) / 1e6,
                    }
                )
            rows.append(row)
    return rows


def agreement(records: list[dict]) -> list[dict]:
    """Per (link, method) with both routes in ``records``: the mean time to target of each over
    the seeds that reached it in both, and ``agreement`` = decomposed / end-to-end."""
    by: dict = {}
    for r in records:
        by.setdefault((r["link"], r["method"]), {}).setdefault(r["route"], {})[r["seed"]] = r
    out = []
    for (link, method), routes in by.items():
        if set(routes) != {"decomposed", "end_to_end"}:
            continue
        dec, e2e = routes["decomposed"], routes["end_to_end"]
        seeds = [s for s in dec if s in e2e and dec[s]["reached"] and e2e[s]["reached"]]
        if not seeds:
            continue
        d = float(np.mean([dec[s]["time_to_target_s"] for s in seeds]))
        e = float(np.mean([e2e[s]["time_to_target_s"] for s in seeds]))
        out.append(
            {
                "link": link,
                "method": method,
                "seeds": len(seeds),
                "decomposed_s": d,
                "end_to_end_s": e,
                "agreement": d / e,
            }
        )
    return out


def sweep_records(training: dict) -> list[dict]:
    """One entry per run of the training job's learning-rate sweep: ``method``,
    ``learning_rate``, ``seed``, ``reached``, ``steps_to_target`` (``None`` if not reached) and
    ``final_accuracy`` (the last evaluation's test accuracy)."""
    return [
        {
            "method": r["method"],
            "learning_rate": float(r["learning_rate"]),
            "seed": int(r["seed"]),
            "reached": r["reached"] is not None,
            "steps_to_target": int(r["reached"]["step"]) if r["reached"] else None,
            "final_accuracy": float(r["curve"][-1]["accuracy"]) if r["curve"] else None,
        }
        for r in training.get("sweep", [])
    ]


def _fmt(value, spec: str) -> str:
    return "–" if value is None or value != value else format(value, spec)


def headline(results: dict) -> list[dict]:
    """The headline table's rows from a study's results: link, route, method, seeds that reached
    the target, time to target (mean ± sample std, s), speed-ups over the faster 16-bit method
    and over float32, MB to target (kernel count) and utilization (compute-only time / time)."""
    rows = []
    for row in results.get("summary", []):
        rows.append(
            {
                "link": row["link"],
                "route": row["route"],
                "method": row["method"],
                "reached": row["reached"],
                "time to target (s)": (
                    "–"
                    if row["time_to_target_s"] != row["time_to_target_s"]
                    else f"{row['time_to_target_s']:.3g} ± {row['time_std_s']:.2g}"
                ),
                "×16-bit": _fmt(row["speedup_vs_16bit"], ".2f"),
                "×fp32": _fmt(row["speedup_vs_fp32"], ".2f"),
                "MB to target": _fmt(row["MB_to_target"], ".2f"),
                "utilization": _fmt(row["utilization"], ".2f"),
            }
        )
    return rows
