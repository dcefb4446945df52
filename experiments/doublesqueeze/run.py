"""DoubleSqueeze (Tang et al. 2019, Figs. 1-2): loss curves and final accuracy.

Compared, all on 8 mesh workers followed by SGD with momentum: plain SGD
(uncompressed mean), DoubleSqueeze with the scaled 1-bit compressor
(``‖v‖₂/‖sign(v)‖₂ · sign(v)`` on both passes), DoubleSqueeze with top-k,
MEM-SGD (worker error feedback only), QSGD without feedback (ternary,
``levels=1``) and top-k without feedback. The paper trains ResNet-18 on
CIFAR-10; our CIFAR-class stand-in is Fashion-MNIST with the ResNet-20-style
network (CIFAR-10 is not available offline).
"""

from __future__ import annotations

from pathlib import Path

import optax

from .._common import load_config_task, plot_curves, train_config
from .config import METHODS, DoubleSqueezeConfig


def _transform(method: str, ratio: float):
    from jaxcomm import compressors
    from jaxcomm.transforms import compressed_mean, doublesqueeze

    from .baselines import memsgd, qsgd_no_feedback, topk_no_feedback

    if method == "sgd":
        return compressed_mean(compressors.none()), "allreduce"
    if method == "doublesqueeze-1bit":
        return doublesqueeze(compressors.make("scaled_sign")), "allgather"
    if method == "doublesqueeze-topk":
        return doublesqueeze(compressors.topk(ratio=ratio)), "allgather"
    if method == "memsgd-1bit":
        return memsgd(compressors.make("scaled_sign")), "allgather"
    if method == "qsgd":
        return qsgd_no_feedback(levels=1), "allgather"
    if method == "topk":
        return topk_no_feedback(ratio=ratio), "allgather"
    raise ValueError(f"unknown method {method!r}; valid: {list(METHODS)}")


def run(config: DoubleSqueezeConfig, out_dir: Path) -> dict:
    """Train each method; write ``loss.png`` and ``accuracy.png``."""
    train, test = load_config_task(config)
    runs = []
    for method in config.methods:
        comm_tx, strategy = _transform(method, config.topk_ratio)
        tx = optax.chain(comm_tx, optax.sgd(config.learning_rate, momentum=config.momentum))
        runs.append(train_config(config, method, tx, train, test, strategy))
    out = Path(out_dir)
    setting = f"{config.dataset}, {config.model}, {config.devices} workers, {config.steps} steps"
    plot_curves(
        runs,
        out / "loss.png",
        y="loss",
        ylabel="training loss",
        logy=True,
        title=f"DoubleSqueeze study: {setting}",
    )
    plot_curves(runs, out / "accuracy.png", ylabel="test accuracy", title=f"DoubleSqueeze study: {setting}")
    summary = [
        {
            "method": r["name"],
            "test_accuracy": r["final_accuracy"],
            "final_train_loss": r["history"][-1]["loss"],
            "Mbit/worker": r["wire_bits_per_worker"] / 1e6,
            "volume_%": 100 * r["wire_bits_per_worker"] / r["dense_bits_per_worker"],
        }
        for r in runs
    ]
    return {
        "runs": runs,
        "summary": summary,
        "note": "CIFAR-10 is not available offline: Fashion-MNIST + ResNet-20-style network stands in.",
    }
