"""``jaxcomm run time-to-accuracy``: wall-clock time to a test accuracy on an emulated network.

Each job is one ``mpirun`` of ``procs`` processes inside a private network namespace whose
shaped loopback carries every byte between the ranks (:func:`jaxcomm.netem.launch`, Open MPI's
ring collectives :data:`jaxcomm.netem.RING_COLLECTIVES`); the ranks train with
:class:`jaxcomm.train.Trainer` over :class:`jaxcomm.comm.MPIComm`
(:mod:`~experiments.network.worker`).

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
import os
import sys
from pathlib import Path

import numpy as np

from jaxcomm.studies import (  # the study's results carry it (jaxcomm run adds it to every study's)
    config_to_dict,
    provenance,
    worker_pythonpath,
)

from .. import PACKAGE_PARENT
from ._records import (
    RECORD_KEYS,
    _label,
    _shaped,
    agreement,
    decomposed_time,
    headline,
    records_decomposed,
    records_end_to_end,
    records_predicted,
    summarize,
    sweep_records,
)
from .config import TimeToAccuracyConfig

__all__ = [
    "RECORD_KEYS",
    "agreement",
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

_WORKER = f"{__package__}.worker"


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


def _plot(panels: list, bytes_job: dict, rows: list[dict], config: TimeToAccuracyConfig, out_dir: Path) -> None:
    """Write the study's three figures into ``out_dir`` (see the module docstring), one colour per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(config.methods)
    colors = {m: plt.get_cmap("tab20")(i % 20) for i, m in enumerate(methods)}
    what = f"{config.model} on {config.dataset}, {config.procs} MPI processes"
    target = float(config.target_accuracy)
    _plot_time(plt, panels, colors, what, target, out_dir)
    _plot_bytes(plt, bytes_job, colors, what, target, out_dir)
    _plot_step_model(plt, rows, methods, colors, what, out_dir)


def _plot_time(plt, panels: list, colors: dict, what: str, target: float, out_dir: Path) -> None:
    """``accuracy_vs_time.png``: test accuracy against training wall-clock, one panel per link and route."""
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

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
        ax.set_xscale("log")  # the methods' times to target span two to three decades on one link
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))  # 1, 2, 5, 10, 20, ... s
        ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("training wall-clock (s, log scale)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("test accuracy")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="center right")
    fig.suptitle(f"Time to accuracy: {what}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.85, 1))
    fig.savefig(out_dir / "accuracy_vs_time.png", dpi=120)
    plt.close(fig)


def _plot_bytes(plt, bytes_job: dict, colors: dict, what: str, target: float, out_dir: Path) -> None:
    """``accuracy_vs_bytes.png``: test accuracy against the MB the kernel counted on the link."""
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


def _plot_step_model(plt, rows: list[dict], methods: list, colors: dict, what: str, out_dir: Path) -> None:
    """``step_time_model.png``: each summary row's measured step against the cost model's prediction."""
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


def _launch(config: TimeToAccuracyConfig, bandwidth: str, job_dir: Path, env: dict, extra: dict | None = None) -> dict:
    """One ``mpirun`` job of the worker on a link of ``bandwidth``; its results."""
    from jaxcomm import netem

    job_dir.mkdir(parents=True, exist_ok=True)
    job_config = {**config_to_dict(config), "bandwidth": bandwidth, **(extra or {})}
    (job_dir / "config.json").write_text(json.dumps(job_config, indent=1))
    print(f"time-to-accuracy: job on link {bandwidth} -> {job_dir}", flush=True)
    res = netem.launch(
        int(config.procs),
        [sys.executable, "-m", _WORKER, str(job_dir)],
        bandwidth=bandwidth,
        burst=config.burst,
        mtu=int(config.mtu),
        env=env,
        timeout=float(config.timeout_s),
        cwd=PACKAGE_PARENT,
        report=job_dir / "launch.json",
    )
    if res.returncode != 0 or not (job_dir / "results.json").exists():
        why = "timed out" if res.timed_out else f"exit code {res.returncode}"
        raise RuntimeError(f"the job on link {bandwidth} failed ({why}); see {job_dir}")
    job = json.loads((job_dir / "results.json").read_text())
    job["launch"] = {"bytes": res.bytes, "packets": res.packets, "drops": res.drops, "wall_s": res.wall_s}
    return job


def run(config: TimeToAccuracyConfig, out_dir: Path) -> dict:
    """Run the study of ``config`` (its ``route``); write the figures and return the results:
    ``records`` (one per link, method, seed and route; keys :data:`RECORD_KEYS`), ``summary``
    (:func:`summarize`), ``provenance``, the jobs (``training``, ``timing_jobs``, ``jobs``: the
    end-to-end ones), ``sweep`` (with ``lr_sweep``) and, for ``route="compare"``, ``agreement``.

    Raises:
      jaxcomm.netem.NetemUnavailable: no private network namespace can be made here.
      RuntimeError: a job failed (its output's tail is in the message).
    """
    from jaxcomm import netem

    missing = netem.missing_requirements()
    if missing:
        raise netem.NetemUnavailable(
            "time-to-accuracy runs MPI jobs on an emulated network; this process lacks: " + "; ".join(missing)
        )
    out_dir = Path(out_dir)
    route = config.route
    env = {**os.environ, **netem.RING_COLLECTIVES}
    env["PYTHONPATH"] = worker_pythonpath(__package__, env)
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
        shaped = [bw for bw in config.bandwidths if _shaped(bw)]
        training = _launch(config, "unlimited", out_dir / "train", env, {"time_links": shaped})
        compute: dict[str, list[float]] = {}
        for r in training["runs"]:
            compute.setdefault(r["method"], []).append(r["compute_s"])
        if shaped:  # the launcher counted the last link's qdisc only: the training's count is the worker's
            training["launch"] = {**training["launch"], **training.pop("link_counters")}
        timed = {tj["bandwidth"]: tj for tj in training.pop("timing_jobs", [])}
        for bandwidth in config.bandwidths:
            if not _shaped(bandwidth):  # the training job ran on this link: timed end to end
                records += records_end_to_end(training)
                continue
            tj = timed[bandwidth]
            tj["launch"] = {"drops": sum(int(t["window_drops"]) for t in tj["timings"])}
            for t in tj["timings"]:  # measured beside the window where the worker did, else training's
                t.setdefault("compute_s", float(np.mean(compute[t["method"]])))
            timing_jobs.append(tj)
            records += records_decomposed(training, tj)
        results["training"] = training
        results["timing_jobs"] = timing_jobs
        if training.get("sweep"):
            results["sweep"] = sweep_records(training)
            results["learning_rates"] = training["learning_rates"]
    if route in ("end_to_end", "compare"):
        for bandwidth in config.bandwidths:
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
        _panels(training, timing_jobs, e2e_jobs, list(config.bandwidths)),
        training or e2e_jobs[0],
        rows,
        config,
        out_dir,
    )
    return results
