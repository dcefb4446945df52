"""The study helper every study shares: data and model set-up, a data-parallel run and its
evaluation, the α-β estimate of its communication time, and plots. (Results are written by
:func:`jaxcomm.studies.write_results`.)"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from jaxcomm._spec import parse_method

from ._config import IMAGE_DATASETS, IMAGE_MODELS, DataParallelConfig

__all__ = [
    "load_config_task",
    "load_image_task",
    "method_transform",
    "parse_method",
    "train_config",
    "train_data_parallel",
    "estimated_comm_time",
    "plot_curves",
]

NETWORKS_GBPS = (1.0, 10.0, 25.0)


def load_image_task(dataset: str, train_examples: int = 0, test_examples: int = 0):
    """``(train, test)`` Datasets for ``"mnist"``, ``"fashion_mnist"``, ``"mnist5k"`` or ``"digits"``.

    ``train_examples``/``test_examples`` > 0 keep a prefix (for smoke runs).
    """
    from jaxcomm import data

    if dataset == "mnist":
        train, test = data.load_mnist(split="train"), data.load_mnist(split="test")
    elif dataset == "fashion_mnist":
        train, test = data.load_fashion_mnist(split="train"), data.load_fashion_mnist(split="test")
    elif dataset == "digits":
        full = data.load_digits()
        cut = int(0.8 * len(full.labels))
        train, test = full.take(np.arange(cut)), full.take(np.arange(cut, len(full.labels)))
    elif dataset == "mnist5k":
        full = data.load_mnist5k()
        train, test = full.take(np.arange(4000)), full.take(np.arange(4000, 5000))
    else:
        raise ValueError(f"dataset must be one of {', '.join(IMAGE_DATASETS)}; got {dataset!r}")
    if train_examples:
        train = train.take(np.arange(min(train_examples, len(train.labels))))
    if test_examples:
        test = test.take(np.arange(min(test_examples, len(test.labels))))
    return train, test


def load_config_task(config: DataParallelConfig):
    """:func:`load_image_task` of a data-parallel study's ``dataset``, ``train_examples`` and ``test_examples``."""
    return load_image_task(config.dataset, config.train_examples, config.test_examples)


def build_model(name: str, train, seed: int):
    """An NNX model for the image ``train`` set: ``mlp``, ``eventgrad_cnn`` or ``resnet20``."""
    from flax import nnx

    from jaxcomm import models

    rngs = nnx.Rngs(seed)
    shape = train.images.shape[1:]
    if name == "mlp":
        return models.MLP(in_features=int(np.prod(shape)), hidden=(128,), num_classes=train.num_classes, rngs=rngs)
    if name == "eventgrad_cnn":
        return models.EventGradCNN(rngs=rngs)
    if name == "resnet20":
        return models.ResNet20(num_classes=train.num_classes, in_channels=shape[-1], rngs=rngs)
    raise ValueError(f"model must be one of {', '.join(IMAGE_MODELS)}; got {name!r}")


def for_error_feedback(c):
    """``c``, or ``jaxcomm.compressors.contractive(c)`` where error feedback needs the rescaling: an
    unbiased compressor whose declared ω can reach 1 (random sparsification with ``p <= 1/2``,
    QSGD, TernGrad, stochastic rounding); error feedback refuses those unscaled."""
    from jaxcomm import compressors

    omega = c.variance_factor
    if omega is not None and (callable(omega) or omega >= 1.0):
        return compressors.contractive(c)
    return c


def method_transform(methods: dict, label: str, learning_rate: float, momentum: float):
    """``(tx, compressor)`` for a method label of ``methods`` (label -> ``(compressor name, kwargs)``) or a spec.

    ``tx = optax.chain(compressed_mean(c, memory=m, strategy=s), optax.sgd(learning_rate, momentum))``.
    A label of ``methods`` gives ``m`` the residual memory (GRACE Eq. 4) when it ends in
    ``+EF``, else no memory, and ``s = "auto"``; any other label is parsed by
    :func:`parse_method` (``topk(ratio=0.01)+residual@allgather``). With a memory that feeds
    back, ``c`` is made contractive where it must be (:func:`for_error_feedback`).
    The communicator is the trainer's (``compressed_mean`` is built without one).
    """
    import optax

    from jaxcomm import compressors, memory
    from jaxcomm.transforms import compressed_mean

    if label in methods:
        name, kwargs = methods[label]
        c = compressors.make(name, **kwargs)
        mem = memory.residual() if label.endswith("+EF") else memory.none()
        strategy = "auto"
    else:
        try:
            (name, kwargs), (mem_name, mem_kwargs), strategy = parse_method(label)
        except ValueError as e:
            raise ValueError(f"{e} (or a label of {list(methods)})") from None
        c = compressors.make(name, **kwargs)
        mem = memory.make(mem_name, **mem_kwargs)
    if mem.name != "none":
        c = for_error_feedback(c)
    tx = optax.chain(compressed_mean(c, memory=mem, strategy=strategy), optax.sgd(learning_rate, momentum=momentum))
    return tx, c


def per_worker(total: int, workers: int) -> int | float:
    """One worker's share of a count summed over ``workers`` (e.g. a history's ``wire_bits_total``):
    ``total / workers``, an ``int`` when it divides exactly (every worker sent alike, as
    fixed-size payloads do), else the mean over workers as a ``float``."""
    q, r = divmod(int(total), int(workers))
    return q if r == 0 else int(total) / int(workers)


def estimated_comm_time(bits_per_worker_per_step: list[float], workers: int, strategy: str) -> dict:
    """Estimated communication time (s) of a run at 1/10/25 Gbps (α-β model).

    ``strategy`` is the collective's algorithm (``allreduce``: ring; ``allgather``).
    """
    from jaxcomm import cost_model

    out = {}
    for gbps in NETWORKS_GBPS:
        net = cost_model.Network(bandwidth_gbps=gbps)
        out[f"{gbps:g}Gbps"] = float(
            sum(cost_model.comm_time(strategy, b, workers, net) for b in bits_per_worker_per_step)
        )
    return out


def train_data_parallel(
    *,
    name: str,
    tx,
    model: str,
    train,
    test,
    workers: int,
    batch_size: int,
    steps: int,
    eval_every: int,
    seed: int,
    strategy: str = "allreduce",
    non_iid: bool = False,
    callback: Callable | None = None,
    progress: bool = True,
) -> dict:
    """Train ``model`` with the optax chain ``tx`` on ``workers`` mesh devices; return the record.

    Returns a dict: ``name``, ``history`` (per-step rows: loss, accuracy,
    ``wire_bits_total`` and ``messages`` (all workers), step_time, eval results every
    ``eval_every``), ``final_accuracy``, ``wire_bits_total`` (the run's bits, all workers, an
    ``int``), ``wire_bits_per_worker`` (its :func:`per_worker` share), ``dense_bits_per_worker``
    (what uncompressed float32 would send), ``est_comm_time_s`` at 1/10/25 Gbps
    and ``compute_time_s`` (sum of measured step times).
    """
    from jaxcomm import data
    from jaxcomm.train import Trainer

    trainer = Trainer(build_model(model, train, seed), tx, num_workers=workers, seed=seed)
    key = jax.random.PRNGKey(seed)
    shards = (
        data.split_by_label(train, workers, labels_per_worker=max(2, -(-train.num_classes // workers)), key=key)
        if non_iid
        else data.split_iid(train, workers, key)
    )
    batches = data.WorkerBatches(shards, batch_size, jax.random.fold_in(key, 1))
    state = trainer.init_state()

    def evaluate(s):
        return trainer.evaluate(s, test.images, test.labels)

    state, history = trainer.fit(
        state,
        batches,
        steps,
        eval_fn=evaluate,
        eval_every=eval_every,
        progress=progress,
        desc=name,
        callback=callback,
    )
    n_params = sum(int(np.size(p)) for p in jax.tree.leaves(trainer.pure.params))
    bits = [row["wire_bits_total"] / workers for row in history]  # one worker's, per step
    total = sum(row["wire_bits_total"] for row in history)
    final = [r for r in history if "eval_accuracy" in r][-1]
    return {
        "name": name,
        "history": history,
        "final_accuracy": final["eval_accuracy"],
        "final_loss": final["eval_loss"],
        "wire_bits_total": total,
        "wire_bits_per_worker": per_worker(total, workers),
        "dense_bits_per_worker": 32 * n_params * len(history),
        "est_comm_time_s": estimated_comm_time(bits, workers, strategy),
        "compute_time_s": float(sum(r["step_time"] for r in history[1:])),
        "params": n_params,
    }


def train_config(config: DataParallelConfig, name: str, tx, train, test, strategy: str = "allreduce") -> dict:
    """:func:`train_data_parallel` of ``tx`` with a data-parallel study's ``model``, ``devices``,
    ``batch_size``, ``steps``, ``eval_every`` and ``seed``; the run's record."""
    return train_data_parallel(
        name=name,
        tx=tx,
        model=config.model,
        train=train,
        test=test,
        workers=config.devices,
        batch_size=config.batch_size,
        steps=config.steps,
        eval_every=config.eval_every,
        seed=config.seed,
        strategy=strategy,
    )


def plot_curves(
    runs: list[dict],
    path: Path,
    *,
    x: str = "step",
    y: str = "eval_accuracy",
    title: str = "",
    xlabel: str | None = None,
    ylabel: str | None = None,
    logy: bool = False,
) -> Path:
    """Line plot of ``y`` against ``x`` for each run's history (rows lacking ``y`` are skipped).

    When every run has a single ``x`` value (a smoke run evaluated once), each run is drawn as one
    dot over its name and the x label says so. The PNG carries ``Title``, ``XLabel`` and
    ``YLabel`` text chunks (``savefig(metadata=...)``) equal to the drawn ones, so tests and
    readers can check them without OCR.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    series = [(run["name"], [r for r in run["history"] if y in r]) for run in runs]
    xs = {r[x] for _, rows in series for r in rows}
    if len(xs) <= 1:  # one value per run (a smoke run): a dot per run, not a curve on an empty axis
        at = f" at {x} {next(iter(xs))}" if xs else ""
        for i, (name, rows) in enumerate(series):
            ax.plot([i] * len(rows), [r[y] for r in rows], "o", label=name)
        ax.set_xticks(range(len(series)), [name for name, _ in series], fontsize=8)
        ax.set_xlim(-0.5, len(series) - 0.5)
        xlabel = f"run (one value each{at})"
    else:
        for name, rows in series:
            ax.plot([r[x] for r in rows], [r[y] for r in rows], label=name, marker="." if len(rows) < 30 else None)
    ax.set_xlabel(xlabel or x)
    ax.set_ylabel(ylabel or y)
    if logy:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    meta = {"Title": title, "XLabel": ax.get_xlabel(), "YLabel": ax.get_ylabel()}
    fig.savefig(path, dpi=120, metadata=meta)
    plt.close(fig)
    return Path(path)
