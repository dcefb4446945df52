"""``jaxcomm run time-to-accuracy``: wall-clock time to a test accuracy on an emulated network.

For every bandwidth of the configuration, one ``mpirun`` job of ``procs`` processes runs
inside a private network namespace whose shaped loopback carries every byte between the
ranks (:func:`jaxcomm.netem.launch`, Open MPI's ring collectives
:data:`jaxcomm.netem.RING_COLLECTIVES`). Each job trains every method and seed with
:class:`jaxcomm.train.Trainer` over :class:`jaxcomm.comm.MPIComm`
(:mod:`~jaxcomm.experiments.network.worker`) and measures the training wall-clock, the bytes
on the link and the step without its communication.

Beside each measurement, the prediction of :func:`jaxcomm.cost_model.step_time` for a shared
link: ``8 · step_bytes(strategy, P, n) / B + step_latency_rounds(strategy, n, m) · α`` with the
pipeline's own ``P`` (``wire_bits / 8``) and ``m`` (one worker's ``messages``) per step, ``B`` the link's
rate (for ``"unlimited"``, the throughput measured at the start of the job) and ``α`` the
measured latency. Predicted step = measured compute + predicted communication.

Outputs in the run folder: ``link-*/`` (each job's configuration, launch report and
``results.json`` with every curve and measurement; ``jaxcomm run`` adds the whole study's
``results.json``), ``accuracy_vs_time.png`` (one panel per bandwidth), ``accuracy_vs_bytes.png`` and
``step_time_model.png`` (measured against predicted step time).
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import numpy as np

from .config import METHODS

__all__ = ["check_config", "run", "summarize"]

# The folder holding the ``jaxcomm`` package: the workers' working directory, so that
# ``python -m jaxcomm...`` imports the same package as the launcher.
_PACKAGE_PARENT = Path(__file__).resolve().parents[3]
_WORKER = "jaxcomm.experiments.network.worker"


def check_config(config: dict) -> None:
    """Raise ``ValueError`` naming the first invalid field of ``config`` (before anything runs)."""
    from ... import netem

    if int(config["procs"]) < 2:
        raise ValueError(f"procs: need at least 2 processes; got {config['procs']}")
    if not config["bandwidths"]:
        raise ValueError("bandwidths: give at least one link rate (e.g. 100mbit, or unlimited)")
    for bw in config["bandwidths"]:
        netem.parse_rate(str(bw), "bandwidths")
    unknown = [m for m in config["methods"] if m not in METHODS]
    if unknown or not config["methods"]:
        raise ValueError(f"methods: unknown {unknown}; valid: {list(METHODS)}")
    if not 0.0 < float(config["target_accuracy"]) <= 1.0:
        raise ValueError(f"target_accuracy: must be in (0, 1]; got {config['target_accuracy']}")
    for key in ("max_steps", "eval_every", "batch_size", "compute_steps"):
        if int(config[key]) < 1:
            raise ValueError(f"{key}: must be >= 1; got {config[key]}")
    if int(config["eval_examples"]) < int(config["procs"]):
        raise ValueError(f"eval_examples: need at least one per process ({config['procs']})")
    if not config["seeds"]:
        raise ValueError("seeds: give at least one seed")


def _label(bandwidth: str) -> str:
    return "".join(ch for ch in str(bandwidth) if ch.isalnum())


def _rate_bps(bandwidth: str, link: dict) -> float:
    from ... import netem

    rate = netem.parse_rate(str(bandwidth), "bandwidths")
    return float(link["throughput_bps"]) if rate is None else float(rate)


def _predicted_comm_s(run: dict, n: int, rate_bps: float, latency_s: float) -> float:
    from ... import cost_model

    net = cost_model.Network(rate_bps / 1e9, latency_s)
    return float(
        cost_model.step_time(
            run["strategy"], run["wire_bits_per_step"] / 8, n, net, messages=int(round(run["messages_per_step"] / n))
        )
    )


def _predicted_bytes(run: dict, n: int) -> float:
    from ... import cost_model

    return float(cost_model.step_bytes(run["strategy"], run["wire_bits_per_step"] / 8, n))


def _mean_std(values: list[float]) -> tuple[float, float]:
    a = np.asarray(values, np.float64)
    return float(a.mean()), float(a.std(ddof=1)) if len(a) > 1 else 0.0


def summarize(jobs: list[dict], target: float) -> list[dict]:
    """One row per (bandwidth, method): time to ``target`` over the seeds (mean, sample std),
    the speed-up over the uncompressed method at that bandwidth, and measured vs predicted step
    time, communication time and bytes (means over seeds)."""
    rows = []
    for job in jobs:
        n, link = int(job["procs"]), job["link"]
        rate = _rate_bps(job["bandwidth"], link)
        by_method: dict[str, list[dict]] = {}
        for r in job["runs"]:
            by_method.setdefault(r["method"], []).append(r)
        dense_time = None
        for method, runs in by_method.items():
            times = [r["reached"]["time_s"] for r in runs if r["reached"]]
            all_reached = len(times) == len(runs)
            mean_t, std_t = _mean_std(times) if all_reached else (math.nan, math.nan)
            if method == "none" and all_reached:
                dense_time = mean_t
            comm_meas = float(np.mean([r["step_s"] - r["compute_s"] for r in runs]))
            comm_pred = float(np.mean([_predicted_comm_s(r, n, rate, link["latency_s"]) for r in runs]))
            step_meas = float(np.mean([r["step_s"] for r in runs]))
            compute = float(np.mean([r["compute_s"] for r in runs]))
            rows.append(
                {
                    "bandwidth": job["bandwidth"],
                    "method": method,
                    "seeds": len(runs),
                    "reached": f"{len(times)}/{len(runs)}",
                    "time_to_target_s": mean_t,
                    "time_std_s": std_t,
                    "steps": float(np.mean([r["steps"] for r in runs])),
                    "step_s": step_meas,
                    "compute_s": compute,
                    "comm_s": comm_meas,
                    "comm_predicted_s": comm_pred,
                    "step_predicted_s": compute + comm_pred,
                    "link_MB_per_step": float(np.mean([r["link_bytes_per_step"] for r in runs])) / 1e6,
                    "predicted_MB_per_step": float(np.mean([_predicted_bytes(r, n) for r in runs])) / 1e6,
                }
            )
        for row in rows:
            if row["bandwidth"] == job["bandwidth"]:
                t = row["time_to_target_s"]
                row["speedup_vs_dense"] = dense_time / t if dense_time and t == t else math.nan
    return rows


def _plot(jobs: list[dict], rows: list[dict], config: dict, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(config["methods"])
    colors = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(methods)}
    what = f"{config['model']} on {config['dataset']}, {config['procs']} MPI processes"
    target = float(config["target_accuracy"])

    fig, axes = plt.subplots(1, len(jobs), figsize=(4.6 * len(jobs), 3.9), sharey=True, squeeze=False)
    for ax, job in zip(axes[0], jobs):
        seen = set()
        for r in job["runs"]:
            c = r["curve"]
            first = r["method"] not in seen
            seen.add(r["method"])
            ax.plot(
                [p["time_s"] for p in c],
                [p["accuracy"] for p in c],
                color=colors[r["method"]],
                lw=1.6 if first else 0.8,
                alpha=1.0 if first else 0.6,
                label=r["method"] if first else None,
            )
        ax.axhline(target, color="0.5", ls=":", lw=1)
        ax.set_xlim(left=0.0)
        ax.set_title(f"link {job['bandwidth']} (measured)")
        ax.set_xlabel("training wall-clock (s, measured)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("test accuracy")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="center right")
    fig.suptitle(f"Time to accuracy: {what}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.88, 1))
    fig.savefig(out_dir / "accuracy_vs_time.png", dpi=120)
    plt.close(fig)

    job = jobs[0]
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
    bws = [j["bandwidth"] for j in jobs]
    for row in rows:
        ax.scatter(
            row["step_predicted_s"],
            row["step_s"],
            color=colors[row["method"]],
            marker=markers[bws.index(row["bandwidth"]) % len(markers)],
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


def run(config: dict, out_dir: Path) -> dict:
    """Launch one emulated-network job per bandwidth; write the figures and return the results.

    Raises:
      ValueError: an invalid configuration (before anything runs).
      jaxcomm.netem.NetemUnavailable: no private network namespace can be made here.
      RuntimeError: a job failed (its output's tail is in the message).
    """
    from ... import netem

    check_config(config)
    missing = netem.missing_requirements()
    if missing:
        raise netem.NetemUnavailable(
            "time-to-accuracy runs MPI jobs on an emulated network; this process lacks: " + "; ".join(missing)
        )
    out_dir = Path(out_dir)
    jobs = []
    env = {**os.environ, **netem.RING_COLLECTIVES}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_PACKAGE_PARENT), env.get("PYTHONPATH", "")) if p)
    # Every job compiles the same steps: a persistent compilation cache shared by the jobs
    # saves all but the first compilation (it never enters the timed steps either way).
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(out_dir / "jax_cache"))
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    for bandwidth in config["bandwidths"]:
        job_dir = out_dir / f"link-{_label(bandwidth)}"
        job_dir.mkdir(parents=True, exist_ok=True)
        (job_dir / "config.json").write_text(json.dumps({**config, "bandwidth": bandwidth}, indent=1))
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
        jobs.append(job)
    rows = summarize(jobs, float(config["target_accuracy"]))
    _plot(jobs, rows, config, out_dir)
    return {"jobs": jobs, "summary": rows}
