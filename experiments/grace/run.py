"""GRACE Figs. 6/7: quality vs data volume and vs estimated time, whole catalogue.

The paper trains ResNet-20 on CIFAR-10 with 8 workers; CIFAR-10 cannot be had
offline, so our CIFAR-class workload is Fashion-MNIST with the ResNet-20-style
network (:class:`jaxcomm.models.ResNet20`). Every registered compressor runs
with and without error feedback (residual memory, GRACE Eq. 4; lossless-ish
casts ``none``/``fp16``/``bf16`` run once), through ``compressed_mean`` on 8
mesh devices, followed by SGD with momentum. Per run we record test accuracy,
exact wire bits per worker, the measured compute time and the α-β estimate of the
communication time at 1, 10 and 25 Gbps (ring allreduce for summable payloads,
allgather otherwise); the figures plot accuracy against bits and against the
10 Gbps communication estimate. A run that fails (e.g. diverges to a NaN loss) is listed
under ``failed`` in the results and the study goes on with the next one.
"""

from __future__ import annotations

from pathlib import Path

import optax

from jaxcomm.demo import DEMO_KWARGS

from .._common import for_error_feedback, load_config_task, train_config
from .config import GraceConfig

LOSSLESS = ("none", "fp16", "bf16")


def run(config: GraceConfig, out_dir: Path) -> dict:
    """Train every (compressor, EF) pair; write ``quality_vs_bits.png`` and ``quality_vs_time.png``."""
    from jaxcomm import compressors, memory
    from jaxcomm.transforms import compressed_mean

    names = config.compressors or compressors.names()
    unknown = sorted(set(names) - set(compressors.names()))
    if unknown:
        raise ValueError(f"unknown compressors {unknown}; valid: {compressors.names()}")
    train, test = load_config_task(config)
    runs, failed = [], []
    for name in names:
        for ef in config.error_feedback:
            if ef and name in LOSSLESS:
                continue
            c = compressors.make(name, **DEMO_KWARGS.get(name, {}))
            c = for_error_feedback(c) if ef else c  # error feedback refuses unscaled ω >= 1
            # GRACE measures error feedback on every compressor, those with no contraction
            # (signsgd, signum) included, which a contraction-checking memory would refuse.
            mem = memory.residual(needs_contraction=not c.no_contraction) if ef else memory.none()
            tx = optax.chain(
                compressed_mean(c, memory=mem),
                optax.sgd(config.learning_rate, momentum=config.momentum),
            )
            label = f"{name}{'+EF' if ef else ''}"
            try:
                r = train_config(config, label, tx, train, test, c.strategy)
            except Exception as e:  # one failing compressor must not lose the rest of a long study
                failed.append({"compressor": name, "error_feedback": bool(ef), "error": f"{type(e).__name__}: {e}"})
                print(f"grace: {label} failed: {type(e).__name__}: {e}", flush=True)
                continue
            r.update(compressor=name, error_feedback=bool(ef), strategy=c.strategy)
            r["est_comm_time_s_10Gbps"] = r["est_comm_time_s"]["10Gbps"]
            r["est_total_time_s_10Gbps"] = r["compute_time_s"] + r["est_comm_time_s_10Gbps"]
            runs.append(r)
    setting = f"{config.dataset}, {config.model}, {config.devices} workers, {config.steps} steps"
    _plot(runs, Path(out_dir), setting, failed)
    summary = [
        {
            "compressor": r["compressor"],
            "EF": r["error_feedback"],
            "accuracy": r["final_accuracy"],
            "Mbit/worker": r["wire_bits_per_worker"] / 1e6,
            "volume_%": 100 * r["wire_bits_per_worker"] / r["dense_bits_per_worker"],
            "est_time_s@10G": r["est_total_time_s_10Gbps"],
        }
        for r in runs
    ]
    for r in runs:  # keep the JSON small: drop per-step rows without evaluation
        r["history"] = [row for row in r["history"] if "eval_accuracy" in row or row["step"] % 10 == 0]
    return {
        "runs": runs,
        "summary": summary,
        "failed": failed,
        "note": "GRACE used ResNet-20 on CIFAR-10, which is not available offline: the default "
        "configuration uses Fashion-MNIST with the ResNet-20-style network as the stand-in.",
    }


TIME_LABEL = "estimated communication time at 10 Gbps, s\n(α-β model: ring allreduce or all-gather)"


def _plot(runs, out: Path, setting: str, failed=()) -> None:
    """Two dot plots, one row per compressor (sorted by its best accuracy), without and with EF.

    ``quality_vs_bits.png``: test accuracy | bits sent per worker (log);
    ``quality_vs_time.png``: test accuracy | the α-β estimate of the run's communication time at
    10 Gbps (log); the measured compute time is left out (simulated devices share the host's
    cores, so it measures the host, not the compressor's cost on a worker). Rows instead of a
    labelled scatter: the names never overlap. A failed run (``failed`` rows of the results) is
    written on its row: "diverged" (a non-finite loss) or "failed".
    The PNGs carry ``Title``, ``XLabel`` (the right panel's) and ``YLabel`` text chunks.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = {r["compressor"]: 0.0 for r in [*runs, *failed]}
    for r in runs:
        best[r["compressor"]] = max(best[r["compressor"]], r["final_accuracy"])
    names = sorted(best, key=lambda n: best[n])
    row = {n: i for i, n in enumerate(names)}
    for x_key, fname, xlabel, log in (
        ("wire_bits_per_worker", "quality_vs_bits.png", "bits sent per worker in the run (log)", True),
        ("est_comm_time_s_10Gbps", "quality_vs_time.png", TIME_LABEL, False),
    ):
        fig, (acc, right) = plt.subplots(1, 2, sharey=True, figsize=(9, 1.5 + 0.28 * max(len(names), 2)))
        for ef, marker, offset in ((False, "o", -0.12), (True, "^", 0.12)):
            sel = [r for r in runs if r["error_feedback"] == ef]
            if not sel:
                continue
            ys = [row[r["compressor"]] + offset for r in sel]
            label = "with EF (residual memory)" if ef else "without EF"
            acc.scatter([r["final_accuracy"] for r in sel], ys, marker=marker, label=label)
            right.scatter([r[x_key] for r in sel], ys, marker=marker, label=label)
        for f in failed:
            y = row[f["compressor"]] + (0.12 if f["error_feedback"] else -0.12)
            acc.text(
                0.02,
                y,
                ("diverged" if "NonFinite" in f.get("error", "NonFinite") else "failed")
                + (" (with EF)" if f["error_feedback"] else ""),
                transform=acc.get_yaxis_transform(),
                va="center",
                fontsize=7,
                color="C3",
            )
        acc.set_yticks(range(len(names)), names, fontsize=8)
        acc.set_ylim(-0.6, len(names) - 0.4)
        acc.set_xlabel("test accuracy")
        if log:
            right.set_xscale("log")
        right.set_xlabel(xlabel)
        for ax in (acc, right):
            ax.grid(alpha=0.3)
        title = f"Every compressor, without and with error feedback: {setting}"
        fig.suptitle(title, fontsize=10)
        handles, labels = acc.get_legend_handles_labels()
        fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.97), ncol=2, fontsize=8, frameon=False)
        fig.tight_layout(rect=(0, 0, 1, 0.95))
        meta = {"Title": title, "XLabel": right.get_xlabel(), "YLabel": "compressor"}
        fig.savefig(out / fname, dpi=120, metadata=meta)
        plt.close(fig)
