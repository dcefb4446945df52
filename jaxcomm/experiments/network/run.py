"""``jaxcomm run time-to-accuracy``: wall-clock time to a test accuracy on an emulated network.

Each job is one ``mpirun`` of ``procs`` processes inside a private network namespace whose
shaped loopback carries every byte between the ranks (:func:`jaxcomm.netem.launch`, Open MPI's
ring collectives :data:`jaxcomm.netem.RING_COLLECTIVES`); the ranks train with
:class:`jaxcomm.train.Trainer` over :class:`jaxcomm.comm.MPIComm`
(:mod:`~jaxcomm.experiments.network.worker`).

Routes (``route`` of :class:`~.config.TimeToAccuracyConfig`):

* ``"decomposed"`` (the default): the arithmetic of a step does not depend on the link, so one
  job on the unshaped link trains every method and seed to the target (steps to target, the
  kernel's byte count, the compute-only step); then the same job gives its link each shaped
  rate in turn (:func:`jaxcomm.netem.reshape`) and times each method's steps there (its
  warm-up, then whole communication periods) with the steps it compiled for training. Time to
  target on a link =
  the warm-up steps' measured times + the remaining steps to target x the mean measured step
  there. An ``"unlimited"`` link is the training job itself, timed end to end.
* ``"end_to_end"``: one job per link trains every method and seed on it, timed by the wall clock.
* ``"compare"``: both, and ``agreement`` = decomposed / end-to-end time to target per link and
  method.

Beside each measurement, the prediction of :func:`jaxcomm.cost_model.step_time` for a shared
link: per communication period of ``H`` steps, ``8 · step_bytes(strategy, P, n) / B +
step_latency_rounds(strategy, n, m) · α`` with the pipeline's own ``P`` (``wire_bits / 8``) and
``m`` (one worker's ``messages``) per period, divided by ``H``; ``B`` is the link's rate (for
``"unlimited"``, the throughput measured at the start of the job) and ``α`` the measured latency.
Predicted step = measured compute + predicted communication.

Outputs in the run folder: ``train/``, ``link-*/`` (each job's configuration, launch
report and ``results.json``; ``jaxcomm run`` adds the study's ``results.json`` with ``records``,
``summary`` and ``provenance``), ``accuracy_vs_time.png`` (one panel per link and route),
``accuracy_vs_bytes.png`` and ``step_time_model.png`` (measured against predicted step time).
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import numpy as np

from .._registry import provenance  # the study's results carry it (jaxcomm run adds it to every study's)

__all__ = [
    "RECORD_KEYS",
    "agreement",
    "check_config",
    "decomposed_time",
    "headline",
    "provenance",
    "records_decomposed",
    "records_end_to_end",
    "records_predicted",
    "run",
    "summarize",
    "sweep_records",
]

# The folder holding the ``jaxcomm`` package: the workers' working directory, so that
# ``python -m jaxcomm...`` imports the same package as the launcher.
_PACKAGE_PARENT = Path(__file__).resolve().parents[3]
_WORKER = "jaxcomm.experiments.network.worker"
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


def check_config(config: dict) -> dict:
    """The configuration as checked by :class:`~.config.TimeToAccuracyConfig`.

    Raises:
      ValueError: naming the first invalid field (before anything runs).
    """
    from .._registry import config_from_dict, config_to_dict
    from .config import TimeToAccuracyConfig

    return config_to_dict(config_from_dict(TimeToAccuracyConfig, dict(config)))


def _label(bandwidth: str) -> str:
    return "".join(ch for ch in str(bandwidth) if ch.isalnum())


def _rate_bps(bandwidth: str, link: dict) -> float:
    from ... import netem

    rate = netem.parse_rate(str(bandwidth), "bandwidths")
    return float(link["throughput_bps"]) if rate is None else float(rate)


def _shaped(bandwidth: str) -> bool:
    from ... import netem

    return netem.parse_rate(str(bandwidth), "bandwidths") is not None


def _predicted_comm_s(run: dict, n: int, rate_bps: float, latency_s: float) -> float:
    """Predicted communication per step (s): one communication period's, over its ``sync_every`` steps."""
    from ... import cost_model

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
    from ... import cost_model

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


def _record(link, run, route, time_s) -> dict:
    reached = run["reached"] is not None
    steps: int | None = None
    compute_only: float | None = None
    bytes_to: int | None = None
    utilization: float | None = None
    if reached:
        steps = int(run["reached"]["step"])
        compute_only = steps * float(run["compute_s"])
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
    entry there; bytes to target and the compute-only step are the training job's (the bytes a
    step sends do not depend on the link)."""
    timings = {t["method"]: t for t in timing_job["timings"]}
    out = []
    for r in training["runs"]:
        t = decomposed_time(r["reached"]["step"], timings[r["method"]]) if r["reached"] else None
        out.append(_record(timing_job["bandwidth"], r, "decomposed", t))
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


def _panels(
    training: dict | None, timing_jobs: list[dict], e2e_jobs: list[dict], bandwidths: list[str]
) -> list[tuple[str, list]]:
    """``(title, [(method, seed index, [time_s], [accuracy])])`` per link and route: the timed
    links (decomposed), then the end-to-end jobs, with the training job among them where an
    unshaped link is one of ``bandwidths`` (it ran on that link)."""
    panels = []
    unshaped = any(not _shaped(bw) for bw in bandwidths)
    if training is not None and unshaped and not any(job is training for job in e2e_jobs):
        e2e_jobs = [training, *e2e_jobs]
    for tj in timing_jobs:
        assert training is not None, "a decomposed timing job needs the training job it times"
        timings = {t["method"]: t for t in tj["timings"]}
        curves = []
        for r in training["runs"]:
            c = r["curve"]
            curves.append(
                (
                    r["method"],
                    r["seed"],
                    [decomposed_time(p["step"], timings[r["method"]]) for p in c],
                    [p["accuracy"] for p in c],
                )
            )
        panels.append((f"link {tj['bandwidth']} (decomposed)", curves))
    for job in e2e_jobs:
        curves = [
            (r["method"], r["seed"], [p["time_s"] for p in r["curve"]], [p["accuracy"] for p in r["curve"]])
            for r in job["runs"]
        ]
        panels.append((f"link {job['bandwidth']} (measured end to end)", curves))
    return panels


def _plot(panels: list, bytes_job: dict, rows: list[dict], config: dict, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(config["methods"])
    colors = {m: plt.get_cmap("tab20")(i % 20) for i, m in enumerate(methods)}
    what = f"{config['model']} on {config['dataset']}, {config['procs']} MPI processes"
    target = float(config["target_accuracy"])

    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.9), sharey=True, squeeze=False)
    for ax, (title, curves) in zip(axes[0], panels):
        seen = set()
        for method, _, xs, ys in curves:
            first = method not in seen
            seen.add(method)
            ax.plot(
                xs,
                ys,
                color=colors[method],
                lw=1.6 if first else 0.8,
                alpha=1.0 if first else 0.6,
                label=method if first else None,
            )
        ax.axhline(target, color="0.5", ls=":", lw=1)
        ax.set_xlim(left=0.0)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("training wall-clock (s)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("test accuracy")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="center right")
    fig.suptitle(f"Time to accuracy: {what}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.85, 1))
    fig.savefig(out_dir / "accuracy_vs_time.png", dpi=120)
    plt.close(fig)

    job = bytes_job
    fig, ax = plt.subplots(figsize=(5.6, 3.9))
    seen = set()
    for r in job["runs"]:
        c = r["curve"]
        first = r["method"] not in seen
        seen.add(r["method"])
        ax.plot(
            [p["link_bytes"] / 1e6 for p in c],
            [p["accuracy"] for p in c],
            color=colors[r["method"]],
            marker="." if len(c) < 30 else None,
            lw=1.4 if first else 0.8,
            label=r["method"] if first else None,
        )
    ax.axhline(target, color="0.5", ls=":", lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("MB through the link, all workers (measured by the kernel)")
    ax.set_ylabel("test accuracy")
    ax.set_title(f"Accuracy against bytes sent: {what}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "accuracy_vs_bytes.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7.2, 4.6))
    markers = "osD^v<>"
    rows = [r for r in rows if "step_s" in r]
    bws = list(dict.fromkeys(r["link"] for r in rows))
    for row in rows:
        ax.scatter(
            row["step_predicted_s"],
            row["step_s"],
            color=colors[row["method"]],
            marker=markers[bws.index(row["link"]) % len(markers)],
            s=40,
            zorder=3,
        )
    hi = max(max(r["step_s"], r["step_predicted_s"]) for r in rows) * 1.1
    ax.plot([0, hi], [0, hi], color="0.3", lw=1)
    ax.fill_between([0, hi], [0, hi * 0.85], [0, hi * 1.15], color="0.88", label="±15 %")
    for m in methods:
        ax.scatter([], [], color=colors[m], marker="o", label=m)
    for i, b in enumerate(bws):
        ax.scatter([], [], color="0.4", marker=markers[i % len(markers)], label=f"link {b}")
    ax.set_xlim(0, hi)
    ax.set_ylim(0, hi)
    ax.set_aspect("equal")
    ax.set_xlabel("predicted step (s): measured compute + cost_model.step_time")
    ax.set_ylabel("measured step (s, median)")
    ax.set_title(f"Step time, measured vs predicted\n{what}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.tight_layout()
    fig.savefig(out_dir / "step_time_model.png", dpi=120)
    plt.close(fig)


def _launch(config: dict, bandwidth: str, job_dir: Path, env: dict, extra: dict | None = None) -> dict:
    """One ``mpirun`` job of the worker on a link of ``bandwidth``; its results."""
    from ... import netem

    job_dir.mkdir(parents=True, exist_ok=True)
    job_config = {**config, "bandwidth": bandwidth, **(extra or {})}
    (job_dir / "config.json").write_text(json.dumps(job_config, indent=1))
    print(f"time-to-accuracy: job on link {bandwidth} -> {job_dir}", flush=True)
    res = netem.launch(
        int(config["procs"]),
        [sys.executable, "-m", _WORKER, str(job_dir)],
        bandwidth=bandwidth,
        env=env,
        timeout=float(config["timeout_s"]),
        cwd=_PACKAGE_PARENT,
        report=job_dir / "launch.json",
    )
    if res.returncode != 0 or not (job_dir / "results.json").exists():
        why = "timed out" if res.timed_out else f"exit code {res.returncode}"
        raise RuntimeError(f"the job on link {bandwidth} failed ({why}); see {job_dir}")
    job = json.loads((job_dir / "results.json").read_text())
    job["launch"] = {"bytes": res.bytes, "packets": res.packets, "drops": res.drops, "wall_s": res.wall_s}
    return job


def run(config: dict, out_dir: Path) -> dict:
    """Run the study of ``config`` (its ``route``); write the figures and return the results:
    ``records`` (one per link, method, seed and route; keys :data:`RECORD_KEYS`), ``summary``
    (:func:`summarize`), ``provenance``, the jobs (``training``, ``timing_jobs``, ``jobs``: the
    end-to-end ones), ``sweep`` (with ``lr_sweep``) and, for ``route="compare"``, ``agreement``.

    Raises:
      ValueError: an invalid configuration (before anything runs).
      jaxcomm.netem.NetemUnavailable: no private network namespace can be made here.
      RuntimeError: a job failed (its output's tail is in the message).
    """
    from ... import netem

    config = check_config(config)
    missing = netem.missing_requirements()
    if missing:
        raise netem.NetemUnavailable(
            "time-to-accuracy runs MPI jobs on an emulated network; this process lacks: " + "; ".join(missing)
        )
    out_dir = Path(out_dir)
    route = config["route"]
    env = {**os.environ, **netem.RING_COLLECTIVES}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_PACKAGE_PARENT), env.get("PYTHONPATH", "")) if p)
    # Every job compiles the same steps: a persistent compilation cache shared by the jobs
    # saves all but the first compilation (it never enters the timed steps either way).
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(out_dir / "jax_cache"))
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    results: dict = {"route": route, "provenance": provenance()}
    records: list[dict] = []
    training, timing_jobs, e2e_jobs = None, [], []
    if route in ("decomposed", "compare"):
        # One job: it trains on the unshaped link, then times every method on each shaped link
        # (the worker reshapes the namespace's link between timing windows).
        shaped = [bw for bw in config["bandwidths"] if _shaped(bw)]
        training = _launch(config, "unlimited", out_dir / "train", env, {"time_links": shaped})
        compute: dict[str, list[float]] = {}
        for r in training["runs"]:
            compute.setdefault(r["method"], []).append(r["compute_s"])
        if shaped:  # the launcher counted the last link's qdisc only: the training's count is the worker's
            training["launch"] = {**training["launch"], **training.pop("link_counters")}
        timed = {tj["bandwidth"]: tj for tj in training.pop("timing_jobs", [])}
        for bandwidth in config["bandwidths"]:
            if not _shaped(bandwidth):  # the training job ran on this link: timed end to end
                records += records_end_to_end(training)
                continue
            tj = timed[bandwidth]
            tj["launch"] = {"drops": sum(int(t["window_drops"]) for t in tj["timings"])}
            for t in tj["timings"]:
                t["compute_s"] = float(np.mean(compute[t["method"]]))
            timing_jobs.append(tj)
            records += records_decomposed(training, tj)
        results["training"] = training
        results["timing_jobs"] = timing_jobs
        if training.get("sweep"):
            results["sweep"] = sweep_records(training)
            results["learning_rates"] = training["learning_rates"]
    if route in ("end_to_end", "compare"):
        for bandwidth in config["bandwidths"]:
            if route == "compare" and not _shaped(bandwidth):
                continue  # the training job is this link's end-to-end measurement
            # route compare: the rates the training job's sweep chose, not a second sweep per link
            rates = {"lr_sweep": [], "learning_rates": results["learning_rates"]} if "learning_rates" in results else {}
            job = _launch(config, bandwidth, out_dir / f"link-{_label(bandwidth)}", env, rates)
            e2e_jobs.append(job)
            records += records_end_to_end(job)
        results["jobs"] = e2e_jobs
    jobs = ([training] if training else []) + timing_jobs + e2e_jobs
    rows = summarize(records, jobs)
    results["records"] = records
    results["summary"] = rows
    if route == "compare":
        results["agreement"] = agreement(records)
    _plot(
        _panels(training, timing_jobs, e2e_jobs, config["bandwidths"]), training or e2e_jobs[0], rows, config, out_dir
    )
    return results
