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

from ._common import load_image_task, plot_curves, train_data_parallel
from ._registry import Experiment, register_experiment

METHODS = ("sgd", "doublesqueeze-1bit", "doublesqueeze-topk", "memsgd-1bit", "qsgd", "topk")

DEFAULT = {
    "dataset": "fashion_mnist",
    "model": "resnet20",
    "devices": 8,
    "batch_size": 256,
    "steps": 200,
    "eval_every": 50,
    "learning_rate": 0.05,
    "momentum": 0.9,
    "topk_ratio": 0.01,
    "methods": list(METHODS),
    "train_examples": 0,
    "test_examples": 2000,
    "seed": 0,
}
SMOKE = {"model": "mlp", "devices": 4, "batch_size": 64, "steps": 4, "eval_every": 4,
         "methods": ["sgd", "doublesqueeze-1bit"], "train_examples": 1024, "test_examples": 256}


def _transform(method: str, ratio: float):
    from .. import compressors
    from ..transforms import compressed_mean, doublesqueeze, memsgd, qsgd_no_feedback, topk_no_feedback

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


def run(config: dict, out_dir: Path) -> dict:
    """Train each method; write ``loss.png`` and ``accuracy.png``."""
    train, test = load_image_task(config["dataset"], config["train_examples"], config["test_examples"])
    runs = []
    for method in config["methods"]:
        comm_tx, strategy = _transform(method, config["topk_ratio"])
        tx = optax.chain(comm_tx, optax.sgd(config["learning_rate"], momentum=config["momentum"]))
        runs.append(train_data_parallel(
            name=method, tx=tx, model=config["model"], train=train, test=test, workers=config["devices"],
            batch_size=config["batch_size"], steps=config["steps"], eval_every=config["eval_every"],
            seed=config["seed"], strategy=strategy,
        ))
    out = Path(out_dir)
    plot_curves(runs, out / "loss.png", y="loss", ylabel="training loss", logy=True,
                title=f"DoubleSqueeze study: {config['dataset']}, {config['model']}, {config['devices']} workers")
    plot_curves(runs, out / "accuracy.png", ylabel="test accuracy", title="DoubleSqueeze study: test accuracy")
    summary = [
        {"method": r["name"], "test_accuracy": r["final_accuracy"], "final_train_loss": r["history"][-1]["loss"],
         "Mbit/worker": r["wire_bits_per_worker"] / 1e6,
         "volume_%": 100 * r["wire_bits_per_worker"] / r["dense_bits_per_worker"]}
        for r in runs
    ]
    return {"runs": runs, "summary": summary,
            "note": "CIFAR-10 is not available offline: Fashion-MNIST + ResNet-20-style network stands in."}


EXPERIMENT = register_experiment(Experiment(
    name="doublesqueeze",
    description="DoubleSqueeze (1-bit, top-k) vs MEM-SGD vs QSGD vs top-k without feedback vs SGD",
    default=DEFAULT,
    smoke=SMOKE,
    run=run,
))
