"""GRACE Figs. 6/7: quality vs data volume and vs estimated time, whole catalogue.

The paper trains ResNet-20 on CIFAR-10 with 8 workers; CIFAR-10 cannot be had
offline, so our CIFAR-class workload is Fashion-MNIST with the ResNet-20-style
network (:class:`jaxcomm.models.ResNet20`). Every registered compressor runs
with and without error feedback (residual memory, GRACE Eq. 4; lossless-ish
casts ``none``/``fp16``/``bf16`` run once), through ``compressed_mean`` on 8
mesh devices, followed by SGD with momentum. Per run we record test accuracy,
exact wire bits per worker and the estimated time = measured compute time +
α-β communication time at 10 Gbps (ring allreduce for summable payloads,
allgather otherwise). A run that fails (e.g. diverges to a NaN loss) is listed
under ``failed`` in the results and the study goes on with the next one.
"""

from __future__ import annotations

from pathlib import Path

import optax

from ...demo import DEMO_KWARGS
from .._common import for_error_feedback, load_image_task, train_data_parallel

LOSSLESS = ("none", "fp16", "bf16")


def run(config: dict, out_dir: Path) -> dict:
    """Train every (compressor, EF) pair; write ``quality_vs_bits.png`` and ``quality_vs_time.png``."""
    from ... import compressors, memory
    from ...transforms import compressed_mean

    names = config["compressors"] or compressors.names()
    unknown = sorted(set(names) - set(compressors.names()))
    if unknown:
        raise ValueError(f"unknown compressors {unknown}; valid: {compressors.names()}")
    train, test = load_image_task(config["dataset"], config["train_examples"], config["test_examples"])
    runs, failed = [], []
    for name in names:
        for ef in config["error_feedback"]:
            if ef and name in LOSSLESS:
                continue
            c = compressors.make(name, **DEMO_KWARGS.get(name, {}))
            c = for_error_feedback(c) if ef else c  # error feedback refuses unscaled ω >= 1
            tx = optax.chain(
                compressed_mean(c, memory=memory.residual() if ef else memory.none()),
                optax.sgd(config["learning_rate"], momentum=config["momentum"]),
            )
            label = f"{name}{'+EF' if ef else ''}"
            try:
                r = train_data_parallel(
                    name=label,
                    tx=tx,
                    model=config["model"],
                    train=train,
                    test=test,
                    workers=config["devices"],
                    batch_size=config["batch_size"],
                    steps=config["steps"],
                    eval_every=config["eval_every"],
                    seed=config["seed"],
                    strategy=c.strategy,
                )
            except Exception as e:  # one failing compressor must not lose the rest of a long study
                failed.append({"compressor": name, "error_feedback": bool(ef), "error": f"{type(e).__name__}: {e}"})
                print(f"grace: {label} failed: {type(e).__name__}: {e}", flush=True)
                continue
            r.update(compressor=name, error_feedback=bool(ef), strategy=c.strategy)
            r["est_total_time_s_10Gbps"] = r["compute_time_s"] + r["est_comm_time_s"]["10Gbps"]
            runs.append(r)
    _plot(runs, Path(out_dir), f"{config['dataset']}, {config['model']}, {config['devices']} workers")
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


def _plot(runs, out: Path, setting: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for x_key, fname, xlabel in (
        ("wire_bits_per_worker", "quality_vs_bits.png", "bits sent per worker (log)"),
        ("est_total_time_s_10Gbps", "quality_vs_time.png", "estimated time at 10 Gbps, s (log)"),
    ):
        fig, ax = plt.subplots(figsize=(7.5, 5))
        for ef, marker in ((False, "o"), (True, "^")):
            sel = [r for r in runs if r["error_feedback"] == ef]
            if not sel:
                continue
            ax.scatter(
                [r[x_key] for r in sel],
                [r["final_accuracy"] for r in sel],
                marker=marker,
                label="with EF" if ef else "without EF",
            )
            for r in sel:
                ax.annotate(
                    r["compressor"],
                    (r[x_key], r["final_accuracy"]),
                    fontsize=6,
                    xytext=(3, 2),
                    textcoords="offset points",
                )
        ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("test accuracy")
        ax.set_title(f"GRACE Fig. 6/7 style: {setting}")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / fname, dpi=120)
        plt.close(fig)
