"""EventGraD Tables 1 and 2 and Figs. 1, 4, 5: D-PSGD vs event-triggered exchange on a ring.

``jaxcomm run eventgrad`` trains, for every task and worker count, three
decentralized runs from the same initialisation on the same batches:

* ``dpsgd``          -- D-PSGD (Lian et al. 2017; EventGraD Eq. 2, Algorithm A), the regular baseline;
* ``eventgrad``      -- EventGraD (Eq. 3-6, Algorithm B), whole tensors on events (Table 1);
* ``eventgrad_topk`` -- EventGraD sending the top-K (K = 10 %) changed entries on events (Table 2).

Tasks: ``mnist_cnn`` (MNIST with :class:`jaxcomm.models.EventGradCNN`, the paper's
earlier MNIST study), ``fmnist_resnet20`` (Fashion-MNIST with
:class:`jaxcomm.models.ResNet20`, the offline stand-in for CIFAR-10/ResNet-18),
and ``digits_cnn`` (scikit-learn's 8x8 digits scaled to 28x28; offline, for the
smoke run). The workers are simulated on one device with ``jax.vmap(axis_name=...)``:
the exchange is the mesh backend's gated ``ppermute``, and the message counts are
what an event-driven run sends (the one-sided MPI backend is checked against it in
the tests and timed in ``experiments/benchmarks/decentralized.py``).

Reductions against the paper (2 CPU cores): a fixed number of iterations per run
instead of 10 (MNIST) / 20 (CIFAR) epochs, 16 (CNN) / 8 (ResNet) examples per
worker and step instead of 64, 10 forced iterations instead of 30 (scaled with the
shorter runs), ResNet-20 on 4 workers only by default, test subsets. Every
one of them is a config key (``--set KEY=VALUE``, repeated); the paper's MNIST protocol is
``--set iterations=0 --set epochs=10 --set batch_per_worker=64 --set forced_iterations=30``.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import optax

from .config import ALGORITHMS, TASKS

# EventGraD (this paper) Tables 1 and 2: CIFAR-10, ResNet-18, 20 epochs, ring.
PAPER_TABLE1 = {4: (86.5, 87.0, 43.24), 8: (86.3, 86.2, 42.98), 16: (84.9, 84.2, 45.91), 32: (82.5, 81.9, 44.89)}
PAPER_TABLE2 = {4: (85.4, 36.6, 7.3), 8: (85.26, 37.7, 7.5), 16: (83.09, 37.7, 7.5)}


# --------------------------------------------------------------------------- #
# data and model
# --------------------------------------------------------------------------- #
def _load(dataset: str, train_examples: int, test_examples: int, seed: int):
    """``(train, test)`` :class:`jaxcomm.data.Dataset`, 28x28x1, standardised by the train mean/std."""
    from ... import data

    if dataset == "digits":
        full = data.load_digits()
        # 8x8 -> 24x24 (3x3 blocks) -> 28x28 (2-pixel border): the CNN's input size.
        img = np.kron(full.images[..., 0], np.ones((3, 3), np.float32))
        img = np.pad(img, ((0, 0), (2, 2), (2, 2)))[..., None]
        order = np.random.default_rng(seed).permutation(len(full.labels))
        cut = int(0.8 * len(order))
        train = data.Dataset(img[order[:cut]], full.labels[order[:cut]], 10)
        test = data.Dataset(img[order[cut:]], full.labels[order[cut:]], 10)
    elif dataset == "mnist":
        train, test = data.load_mnist(split="train"), data.load_mnist(split="test")
    elif dataset == "fashion_mnist":
        train, test = data.load_fashion_mnist(split="train"), data.load_fashion_mnist(split="test")
    else:
        raise ValueError(f"dataset must be mnist, fashion_mnist or digits; got {dataset!r}")
    if train_examples:
        train = train.take(np.arange(min(train_examples, train.num_examples)))
    if test_examples:
        test = test.take(np.arange(min(test_examples, test.num_examples)))
    mean, std = float(train.images.mean()), float(train.images.std())
    norm = lambda d: data.Dataset(((d.images - mean) / std).astype(np.float32), d.labels, d.num_classes)
    return norm(train), norm(test)


def _model(name: str, seed: int):
    """The model as a :class:`jaxcomm.train.PureModel` (one worker's parameters in ``.params``)."""
    from flax import nnx

    from ... import models
    from ...train import split_model

    rngs = nnx.Rngs(seed)
    model = models.EventGradCNN(rngs=rngs) if name == "eventgrad_cnn" else models.ResNet20(10, 1, rngs=rngs)
    return split_model(model)


def _tensor_names(params) -> list:
    """``"conv1/kernel"``-style names of the leaves, in ``jax.tree.leaves`` order."""

    def name(path):
        parts = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
        return "/".join(p for p in parts if p != "value")

    return [name(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]


def _traced_tensors(params, count: int) -> list:
    """Leaf indices to plot: first weight and bias, the largest tensor, the last tensor (Fig. 4's variety)."""
    sizes = [int(np.size(x)) for x in jax.tree.leaves(params)]
    picks = []
    for i in (0, 1, int(np.argmax(sizes)), len(sizes) - 1, 2, 3, 4, 5):
        if 0 <= i < len(sizes) and i not in picks:
            picks.append(i)
    return picks[:count]


# --------------------------------------------------------------------------- #
# one run
# --------------------------------------------------------------------------- #
def _make_algorithm(name: str, topo, tx, cfg):
    from ...algorithms import dpsgd, eventgrad

    if name == "dpsgd":
        return dpsgd(topo, tx, axis_name="w")
    common = dict(
        horizon=cfg["horizon"],
        history=cfg["history"],
        forced_iterations=cfg["forced_iterations"],
        threshold_rule=cfg["threshold_rule"],
        axis_name="w",
    )
    if name == "eventgrad":
        return eventgrad(topo, tx, **common)
    if name == "eventgrad_topk":
        return eventgrad(topo, tx, topk=cfg["topk"], **common)
    raise ValueError(f"algorithm must be one of {ALGORITHMS}; got {name!r}")


def _train(task: str, algorithm: str, n: int, cfg: dict, data_, model_, trace: bool) -> dict:
    """Train ``algorithm`` on ``task`` with ``n`` simulated workers; the run's curves, counts and (with
    ``trace``) per-tensor traces.

    Long because the run's set-up, the one ``simulate_decentralized`` call and the result's fields are one
    sequence over shared locals.
    """
    from ... import data, topology
    from ...algorithms import average_model, simulate_decentralized
    from ...train import classification_eval, evaluate_classifier

    spec = TASKS[task]
    pre = spec["prefix"]
    train, test = data_
    pure = model_
    params0 = pure.params
    batch = cfg[pre + "batch_per_worker"]
    lr, momentum = cfg[pre + "lr"], cfg[pre + "momentum"]
    topo = topology.make(cfg["topology"], n)
    tx = optax.sgd(lr, momentum=momentum or None)
    alg = _make_algorithm(algorithm, topo, tx, cfg)
    key = jax.random.key(cfg["seed"])
    batches = data.WorkerBatches(
        data.split_iid(train, n, jax.random.fold_in(key, 1)), n * batch, jax.random.fold_in(key, 2)
    )
    iterations = cfg[pre + "iterations"]
    if iterations <= 0:
        iterations = max(1, int(round(cfg["epochs"] * batches.steps_per_epoch)))
    picks = _traced_tensors(params0, cfg["trace_tensors"]) if trace else []

    def record(params, state):  # worker 0's value of the traced tensors' trigger fields
        fields = {
            "norm": state.norm,
            "threshold": state.check_threshold,
            "fired": state.fired,
            "last_sent_norm": state.trigger.last_sent_norm,
        }
        return {f: [jax.tree.leaves(tree)[i][0] for i in picks] for f, tree in fields.items()}

    def loss(params, model_state, b, k):  # dropout keyed by the model's own ``rngs`` argument
        logits, model_state = pure.apply(params, model_state, b.images, train=True, rngs=k)
        return optax.softmax_cross_entropy_with_integer_labels(logits, b.labels).mean(), (model_state, {})

    run = simulate_decentralized(
        alg,
        loss,
        params0,
        pure.model_state,
        batches,
        iterations,
        num_workers=n,
        key=key,
        key_offset=100,
        axis_name="w",
        record=record if picks else None,
    )
    params, state, wall, first_step_s = run["params"], run["state"], run["wall_s"], run["first_call_s"]
    ev = evaluate_classifier(
        classification_eval(pure),
        average_model(params),
        jax.tree.map(lambda a: a[0], run["model_state"]),
        test.images,
        test.labels,
        500,
    )
    acc, test_loss = 100.0 * ev["accuracy"], ev["loss"]
    train_loss = np.asarray(run["loss"]).mean(axis=1)
    out = {
        "task": task,
        "algorithm": algorithm,
        "workers": n,
        "iterations": iterations,
        "batch_per_worker": batch,
        "accuracy": acc,
        "test_loss": test_loss,
        "final_train_loss": float(train_loss[-max(1, iterations // 10) :].mean()),
        "train_loss": train_loss.tolist(),
        "wall_s": wall,
        "first_step_s": first_step_s,
        "seconds_per_iteration": (wall - first_step_s) / max(1, iterations - 1),
        "spectral_gap": topo.spectral_gap,
    }
    L = len(jax.tree.leaves(params0))
    deg = topo.degrees
    if algorithm == "dpsgd":
        size = sum(int(np.size(x)) for x in jax.tree.leaves(params0))
        out.update(
            percent_messages=100.0,
            percent_communication=100.0,
            messages=int(iterations * L * deg.sum()),
            bytes_per_worker=float(4 * size * iterations * deg.mean()),
        )
    else:
        st = alg.stats(state)
        forced = min(iterations, cfg["forced_iterations"])
        after = iterations - forced
        ev_after = st["events"] - forced * L * n
        out.update(
            percent_messages=st["percent_messages"],
            percent_communication=st["percent_communication"],
            messages=st["messages"],
            bytes_per_worker=st["bytes_sent"] / n,
            percent_messages_after_forced=(100.0 * ev_after / (after * L * n)) if after else None,
        )
    if picks:
        names = _tensor_names(params0)
        rec = run["records"]
        get = lambda f, dtype=float: np.stack([np.asarray(a, dtype=dtype) for a in rec[f]]).tolist()
        out["trace"] = {
            "tensors": [names[i] for i in picks],
            "sizes": [int(np.size(jax.tree.leaves(params0)[i])) for i in picks],
            "norm": get("norm"),
            "threshold": get("threshold"),
            "fired": get("fired", bool),
            "last_sent_norm": get("last_sent_norm"),
        }
    return out


# --------------------------------------------------------------------------- #
# figures
# --------------------------------------------------------------------------- #
def _plots(results: dict, out_dir: Path) -> list:
    """Write the study's figures into ``out_dir``; returns their paths.

    Long because it draws three kinds of figure from one ``results`` in one matplotlib session; each is a short block.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for task, trace_run in results["traces"].items():
        tr = trace_run["trace"]
        k = len(tr["tensors"])
        it = np.arange(1, len(tr["norm"][0]) + 1)
        fig, axes = plt.subplots(2, k, figsize=(3.4 * k, 5.6), squeeze=False)
        for j in range(k):
            norm, fired = np.asarray(tr["norm"][j]), np.asarray(tr["fired"][j], bool)
            ax = axes[0, j]
            ax.plot(it, norm, lw=1, label="norm (sender)")
            ax.plot(it[fired], norm[fired], "*", ms=5, color="C3", label="event")
            ax.set_title(f"{tr['tensors'][j]} ({tr['sizes'][j]})", fontsize=8)
            if j == 0:
                ax.legend(fontsize=7)
            ax = axes[1, j]
            ax.step(it, tr["last_sent_norm"][j], where="post", color="C2", lw=1, label="last received (receiver)")
            ax.set_xlabel("iteration")
            if j == 0:
                ax.legend(fontsize=7)
        fig.suptitle(
            f"{task}: tensor norms and events, worker 0 of {trace_run['workers']} (cf. paper Figs. 1, 4)", fontsize=9
        )
        fig.tight_layout()
        path = out_dir / f"norms_events_{task}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path.name)

        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        for j in range(k):
            ax.plot(it, tr["threshold"][j], lw=1, label=tr["tensors"][j])
        ax.set_xlabel("iteration")
        ax.set_ylabel("threshold compared against")
        ax.set_yscale("symlog", linthresh=1e-4)
        ax.set_title(
            f"{task}: adaptive thresholds (horizon {results['config']['horizon']:g}; cf. paper Fig. 5)", fontsize=9
        )
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"thresholds_{task}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path.name)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.0))
    for task in results["config"]["tasks"]:
        rows = [r for r in results["runs"] if r["task"] == task]
        for algo, marker in zip(ALGORITHMS, "os^"):
            pts = sorted((r["workers"], r["accuracy"]) for r in rows if r["algorithm"] == algo)
            if pts:
                axes[0].plot(*zip(*pts), marker=marker, label=f"{task} {algo}")
        for algo, key, marker in (
            ("eventgrad", "percent_messages", "s"),
            ("eventgrad_topk", "percent_messages", "^"),
            ("eventgrad_topk", "percent_communication", "v"),
        ):
            pts = sorted((r["workers"], r[key]) for r in rows if r["algorithm"] == algo)
            if pts:
                axes[1].plot(*zip(*pts), marker=marker, label=f"{task} {algo} {key.split('_')[1]}")
    ws = sorted(PAPER_TABLE1)
    axes[0].plot(ws, [PAPER_TABLE1[w][0] for w in ws], "k--", lw=0.8, label="paper CIFAR-10 regular")
    axes[0].plot(ws, [PAPER_TABLE1[w][1] for w in ws], "k:", lw=0.8, label="paper CIFAR-10 event")
    axes[1].plot(ws, [PAPER_TABLE1[w][2] for w in ws], "k--", lw=0.8, label="paper % messages")
    w2 = sorted(PAPER_TABLE2)
    axes[1].plot(w2, [PAPER_TABLE2[w][2] for w in w2], "k:", lw=0.8, label="paper top-10% % communication")
    for ax, yl in zip(axes, ("test accuracy of the average model (%)", "% of D-PSGD")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("workers (ring)")
        ax.set_ylabel(yl)
        ax.legend(fontsize=6)
    fig.tight_layout()
    path = out_dir / "tables.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path.name)
    return written


# --------------------------------------------------------------------------- #
# the experiment
# --------------------------------------------------------------------------- #
def _validate(cfg: dict) -> None:
    for task in cfg["tasks"]:
        if task not in TASKS:
            raise ValueError(f"tasks: unknown task {task!r}; valid: {sorted(TASKS)}")
    for a in cfg["algorithms"]:
        if a not in ALGORITHMS:
            raise ValueError(f"algorithms: unknown algorithm {a!r}; valid: {list(ALGORITHMS)}")
    for key in ("workers", "resnet_workers"):
        if not cfg[key] or any((not isinstance(w, int)) or w < 1 for w in cfg[key]):
            raise ValueError(f"{key} must be a non-empty list of positive ints; got {cfg[key]!r}")


def run(config: dict, out_dir: Path) -> dict:
    """Train every (task, workers, algorithm); write results.json-ready dict and the PNGs."""
    cfg = dict(config)
    _validate(cfg)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs, traces = [], {}
    for task in cfg["tasks"]:
        spec = TASKS[task]
        pre = spec["prefix"]
        data_ = _load(spec["dataset"], cfg["train_examples"], cfg[pre + "test_examples"], cfg["seed"])
        model_ = _model(spec["model"], cfg["seed"])
        workers = cfg[pre + "workers"]
        for n in workers:
            for algo in cfg["algorithms"]:
                trace = algo == "eventgrad" and n == min(workers) and cfg["trace_tensors"] > 0
                r = _train(task, algo, n, cfg, data_, model_, trace)
                print(
                    f"[eventgrad] {task} n={n} {algo}: acc {r['accuracy']:.2f}% "
                    f"msgs {r['percent_messages']:.1f}% comm {r['percent_communication']:.1f}% "
                    f"({r['wall_s']:.1f}s)",
                    flush=True,
                )
                if trace:
                    traces[task] = {"workers": n, "trace": r.pop("trace")}
                runs.append(r)
    results = {"config": cfg, "runs": runs, "traces": traces}
    results["table1"], results["table2"] = _tables(runs)
    results["paper"] = {
        "table1_cifar10_resnet18": [
            {"workers": w, "regular_accuracy": a, "event_accuracy": b, "percent_messages": c}
            for w, (a, b, c) in PAPER_TABLE1.items()
        ],
        "table2_cifar10_resnet18_top10": [
            {"workers": w, "accuracy": a, "percent_messages": b, "percent_communication": c}
            for w, (a, b, c) in PAPER_TABLE2.items()
        ],
    }
    results["summary"] = _summary_rows(results)
    results["figures"] = _plots(results, out_dir)
    return results


def _tables(runs: list) -> tuple:
    t1, t2 = [], []
    keys = sorted({(r["task"], r["workers"]) for r in runs}, key=lambda k: (k[0], k[1]))
    for task, n in keys:
        by = {r["algorithm"]: r for r in runs if r["task"] == task and r["workers"] == n}
        if "eventgrad" in by:
            row = {
                "task": task,
                "workers": n,
                "event_accuracy": by["eventgrad"]["accuracy"],
                "percent_messages": by["eventgrad"]["percent_messages"],
                "percent_messages_after_forced": by["eventgrad"].get("percent_messages_after_forced"),
            }
            if "dpsgd" in by:
                row["regular_accuracy"] = by["dpsgd"]["accuracy"]
            t1.append(row)
        if "eventgrad_topk" in by:
            r = by["eventgrad_topk"]
            t2.append(
                {
                    "task": task,
                    "workers": n,
                    "sparse_event_accuracy": r["accuracy"],
                    "percent_messages": r["percent_messages"],
                    "percent_communication": r["percent_communication"],
                }
            )
    return t1, t2


def _summary_rows(results: dict) -> list:
    rows = []
    for r in results["runs"]:
        rows.append(
            {
                "task": r["task"],
                "workers": r["workers"],
                "algorithm": r["algorithm"],
                "iterations": r["iterations"],
                "accuracy": round(r["accuracy"], 2),
                "% messages": round(r["percent_messages"], 1),
                "% communication": round(r["percent_communication"], 1),
                "s/iter": round(r["seconds_per_iteration"], 3),
            }
        )
    return rows
