"""The README's main job: real data on 8 simulated devices, compression vs none.

MNIST (the full 60k/10k set) with the EventGraD CNN, 8 data-parallel workers on
a ``jax.shard_map`` mesh, plain SGD with momentum after each communicating
transform. Compared: no compression, and top-k 1 %, QSGD (16 levels),
EF-signSGD and PowerSGD rank 2, with error feedback (residual memory,
GRACE Eq. 4) except QSGD, which is unbiased and runs without it. Reports test
accuracy, exact wire bits per worker, and the estimated communication time at
10 Gbps from the α-β model (ring allreduce for summable payloads, allgather
otherwise).
"""

from __future__ import annotations

from pathlib import Path

from .._common import load_config_task, method_transform, parse_method, plot_curves, train_config
from .config import METHODS, QuickstartConfig


def _transform(method: str, lr: float, momentum: float):
    # QSGD is unbiased and needs no feedback (with it, training diverged in our runs, as
    # GRACE also reports for QSGD + EF); the biased ones get the residual memory ("+EF").
    tx, c = method_transform(METHODS, method, lr, momentum)
    strategy = "auto" if method in METHODS else parse_method(method)[2]
    return tx, c.strategy if strategy == "auto" else strategy


def figure_title(config: QuickstartConfig) -> str:
    """The accuracy figure's title, from the config: dataset, model, workers, global batch, steps."""
    return (
        f"{config.dataset}, {config.model}, {config.devices} workers, batch {config.batch_size}, {config.steps} steps"
    )


def with_cumulative(runs: list[dict], workers: int) -> list[dict]:
    """``runs`` with two running totals added to each history row.

    ``Mbit_sent = Σ_{t<=s} wire_bits_total_t / (1e6 · workers)`` (one worker's share of the
    bits all ``workers`` sent) and
    ``elapsed_s = Σ_{1<=t<=s} step_time_t`` (measured seconds per step; step 0, which
    includes XLA compilation, is left out as in ``compute_time_s``).
    """
    out = []
    for r in runs:
        bits, secs = 0, 0.0
        history = []
        for i, row in enumerate(r["history"]):
            bits += row["wire_bits_total"]
            secs += row["step_time"] if i else 0.0
            history.append({**row, "Mbit_sent": bits / (1e6 * workers), "elapsed_s": secs})
        out.append({**r, "history": history})
    return out


def run(config: QuickstartConfig, out_dir: Path) -> dict:
    """Train each method; write ``accuracy.png`` and return the results."""
    train, test = load_config_task(config)
    runs = []
    for method in config.methods:
        tx, strategy = _transform(method, config.learning_rate, config.momentum)
        runs.append(train_config(config, method, tx, train, test, strategy))
    title = figure_title(config)
    plot_curves(runs, Path(out_dir) / "accuracy.png", title=title, ylabel="test accuracy")
    cumulative = with_cumulative(runs, config.devices)
    plot_curves(
        cumulative,
        Path(out_dir) / "accuracy_vs_bits.png",
        x="Mbit_sent",
        title=title,
        xlabel="Mbit sent per worker (counted on the wire)",
        ylabel="test accuracy",
    )
    plot_curves(
        cumulative,
        Path(out_dir) / "accuracy_vs_time.png",
        x="elapsed_s",
        title=title,
        xlabel="measured step time, summed after compilation (s, CPU)",
        ylabel="test accuracy",
    )
    summary = [
        {
            "method": r["name"],
            "test_accuracy": r["final_accuracy"],
            "Mbit_per_worker": r["wire_bits_per_worker"] / 1e6,
            "compression": r["dense_bits_per_worker"] / max(r["wire_bits_per_worker"], 1.0),
            "est_comm_s_10Gbps": r["est_comm_time_s"]["10Gbps"],
            "compute_s": r["compute_time_s"],
        }
        for r in runs
    ]
    return {"runs": runs, "summary": summary}
