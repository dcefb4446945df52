"""eager-SGD experiments (Li et al., PPoPP 2020): partial allreduce under load imbalance.

* ``eager-microbench`` (Sec. 7.1, Fig. 8-9): ``P`` MPI processes, linearly
  skewed 1..P ms before every call; mean latency of ``MPI_Allreduce`` versus
  the solo and majority allreduce of :class:`jaxcomm.comm.PartialAllreduce`,
  and the number of active processes (NAP).
* ``eager-hyperplane`` (Sec. 7.2.1, Fig. 10, and Sec. 7.2.3, Fig. 12):
  hyperplane regression (``y = x . w* + noise``) trained by real MPI processes
  with one random process delayed per step (synch-SGD vs eager-SGD solo and
  majority): throughput and validation MSE against wall-clock time. Then the
  severe rotating skew (50..400 ms) on a ResNet-20 with the mesh simulation
  (:func:`jaxcomm.algorithms.simulate_training`): accuracy against simulated time.

The MPI parts launch ``mpirun`` themselves; each rank runs the module
:mod:`experiments.eager.worker`. The
load-imbalance schedule (:mod:`jaxcomm.imbalance`) is computed once by the
launcher and read by every rank: the paper's "same random stream on all ranks".
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from jaxcomm._validate import as_count
from jaxcomm.studies import config_to_dict, worker_pythonpath

from .. import PACKAGE_PARENT
from .config import HyperplaneConfig, MicrobenchConfig
from .worker import hyperplane_data

__all__ = [
    "launch_mpi",
    "run_microbench",
    "run_hyperplane",
    "hyperplane_record",
    "severe_learning_rate",
    "severe_staleness",
]

_WORKER = f"{__package__}.worker"

# Paper figures (Li et al. 2020).
PAPER = {
    "microbench_speedup_solo": 53.32,  # Sec. 7.1: MPI_Allreduce latency / solo latency, 32 processes
    "microbench_speedup_majority": 2.46,
    "microbench_nap_solo": 1.0,  # "around 1"
    "microbench_nap_majority": 16.0,  # "on average 16 out of 32"
    "hyperplane_speedup_solo": {"200": 1.50, "300": 1.75, "400": 2.01},  # Sec. 7.2.1
    "hyperplane_throughput_200": {"solo": 1.64, "majority": 1.37},  # steps/s at 200 ms
    "hyperplane_final_mse": 4.7,
    "severe_speedup_majority": 1.29,  # Sec. 7.2.3, ResNet-32 on CIFAR-10, vs Horovod
}


# --------------------------------------------------------------------------- #
# Launching MPI workers
# --------------------------------------------------------------------------- #
def launch_mpi(num_procs: int, args: list, timeout: float) -> subprocess.CompletedProcess:
    """Run ``python -m <studies>.eager.worker ARGS...`` on ``num_procs`` MPI processes.

    Raises ``RuntimeError`` (with the output's tail) if ``mpirun`` is missing or
    the job fails, and ``subprocess.TimeoutExpired`` after ``timeout`` seconds.
    """
    from jaxcomm.comm._launch import mpirun_env, mpirun_path

    mpirun = mpirun_path()
    if mpirun is None:
        raise RuntimeError("mpirun not found: install the 'mpi' extra (pip install jaxcomm[mpi])")
    cmd = [mpirun, "-n", str(int(num_procs)), "--oversubscribe", sys.executable, "-m", _WORKER, *map(str, args)]
    env = mpirun_env(single_thread=True)
    env["PYTHONPATH"] = worker_pythonpath(__package__, env)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=PACKAGE_PARENT)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd)} exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
        )
    return proc


# --------------------------------------------------------------------------- #
# Launcher side: the experiments
# --------------------------------------------------------------------------- #
def _analytic_microbench(p: int, unit_ms: float) -> dict:
    """Latency (ms) and NAP of an ideal, zero-cost collective under linear skew ``(r+1) * unit``.

    MPI_Allreduce: rank r waits ``(P-1-r)`` units, mean ``(P-1)/2``. Majority with initiator
    k uniform: ranks ``r < k`` wait ``k - r`` units, mean ``(1/P^2) sum_k k(k+1)/2``;
    NAP = k + 1, mean ``(P+1)/2``. Solo: nobody waits; NAP = 1.
    """
    k = np.arange(p)
    return {
        "latency_ms_mpi_allreduce": unit_ms * (p - 1) / 2,
        "latency_ms_majority": unit_ms * float(np.sum(k * (k + 1) / 2)) / p**2,
        "latency_ms_solo": 0.0,
        "nap_solo": 1.0,
        "nap_majority": (p + 1) / 2,
    }


def run_microbench(config: MicrobenchConfig, out_dir: Path) -> dict:
    """``eager-microbench``: Fig. 8-9 on ``num_procs`` real MPI processes."""
    from jaxcomm import imbalance
    from jaxcomm.studies import write_results

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    p = int(config.num_procs)
    model = imbalance.LinearSkew(p, unit_ms=float(config.skew_unit_ms))
    with tempfile.TemporaryDirectory(prefix="eager-micro-") as tmp_name:
        tmp = Path(tmp_name)
        np.save(tmp / "schedule.npy", imbalance.schedule(model, int(config.seed), 1))
        (tmp / "config.json").write_text(json.dumps(config_to_dict(config)))
        t0 = time.time()
        launch_mpi(p, ["microbench", tmp], timeout=float(config.launch_timeout_s))
        wall = time.time() - t0
        ranks = [dict(np.load(tmp / f"micro_rank{r}.npz")) for r in range(p)]
    res: dict[str, Any] = {
        "config": config_to_dict(config),
        "paper": {k: v for k, v in PAPER.items() if k.startswith("microbench")},
        "mpirun_s": wall,
    }
    per = {}
    for name in ("mpi_allreduce", "solo", "majority"):
        lat = np.stack([r[f"{name}_latency"] for r in ranks]) * 1000.0  # [P, iters] ms
        nap = ranks[0][f"{name}_nap"]
        agree = all(np.array_equal(r[f"{name}_nap"], nap) for r in ranks)
        per[name] = {
            "mean_latency_ms": float(lat.mean()),
            "latency_ms_by_rank": lat.mean(1).tolist(),
            "nap_mean": float(nap.mean()),
            "nap_by_iteration": nap.tolist(),
            "nap_identical_on_all_ranks": bool(agree),
        }
    res["collectives"] = per
    base = per["mpi_allreduce"]["mean_latency_ms"]
    res["speedup_solo"] = base / per["solo"]["mean_latency_ms"]
    res["speedup_majority"] = base / per["majority"]["mean_latency_ms"]
    res["analytic"] = _analytic_microbench(p, float(config.skew_unit_ms))
    res["summary"] = [
        {
            "collective": n,
            "mean_latency_ms": per[n]["mean_latency_ms"],
            "speedup": base / per[n]["mean_latency_ms"],
            "nap": per[n]["nap_mean"],
            "ideal_latency_ms": res["analytic"][f"latency_ms_{n}"],
            "paper_speedup": {
                "mpi_allreduce": 1.0,
                "solo": PAPER["microbench_speedup_solo"],
                "majority": PAPER["microbench_speedup_majority"],
            }[n],
        }
        for n in ("mpi_allreduce", "solo", "majority")
    ]
    _plot_microbench(res, out_dir)
    write_results(out_dir, res)
    return res


def _plot_microbench(res: dict, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per = res["collectives"]
    names = ["mpi_allreduce", "solo", "majority"]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    axes[0].bar(names, [per[n]["mean_latency_ms"] for n in names], color=["tab:blue", "tab:orange", "tab:green"])
    axes[0].set_yscale("log")
    axes[0].set_ylabel("mean latency (ms, log)")
    axes[0].set_title(f"{res['config']['num_procs']} processes, skew 1..{res['config']['num_procs']} ms")
    for n in names:
        axes[1].plot(per[n]["latency_ms_by_rank"], marker=".", label=n)
    axes[1].set_xlabel("rank (skew = (rank+1) ms)")
    axes[1].set_ylabel("latency (ms)")
    axes[1].legend()
    axes[2].plot(per["solo"]["nap_by_iteration"], label=f"solo (mean {per['solo']['nap_mean']:.2f})")
    axes[2].plot(per["majority"]["nap_by_iteration"], label=f"majority (mean {per['majority']['nap_mean']:.2f})")
    axes[2].axhline(res["analytic"]["nap_majority"], color="k", ls=":", label="(P+1)/2")
    axes[2].set_xlabel("iteration")
    axes[2].set_ylabel("NAP")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(out_dir / "microbench.png", dpi=110)
    plt.close(fig)


def _time_to_loss(times: np.ndarray, losses: np.ndarray, target: float):
    hit = np.nonzero(losses <= target)[0]
    return float(times[hit[0]]) if hit.size else None


def run_hyperplane(config: HyperplaneConfig, out_dir: Path) -> dict:
    """``eager-hyperplane``: Sec. 7.2.1 over MPI, then Sec. 7.2.3 in the mesh simulation."""
    from jaxcomm.studies import write_results

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {
        "config": config_to_dict(config),
        "paper": {k: v for k, v in PAPER.items() if not k.startswith("microbench")},
    }
    summary = []
    if config.mpi:
        res["hyperplane"] = _run_hyperplane_mpi(config)
        summary += res["hyperplane"]["summary"]
        _plot_hyperplane(res["hyperplane"], out_dir)
    if config.severe:
        res["severe"] = _run_severe(config, out_dir)
        summary += res["severe"]["summary"]
        _plot_severe(res["severe"], out_dir)
    res["summary"] = summary
    write_results(out_dir, res)
    return res


def _run_hyperplane_mpi(config: HyperplaneConfig) -> dict:
    from jaxcomm import imbalance

    p = int(config.num_procs)
    if int(config.batch_total) % p or int(config.train_points) % p:
        raise ValueError("batch_total and train_points must be multiples of num_procs")
    steps_per_epoch = (int(config.train_points) // p) // (int(config.batch_total) // p)
    steps = steps_per_epoch * int(config.epochs)
    x_val, y_val = hyperplane_data(
        int(config.seed), int(config.val_points), int(config.features), float(config.noise_std), stream=1
    )
    runs = {}
    for delay in config.delays_ms:
        # Sec. 7.2.1: one random process of P delayed every step; same table on every rank.
        model = imbalance.RandomDelay(p, 1, float(delay))
        table = imbalance.schedule(model, int(config.seed), steps)
        with tempfile.TemporaryDirectory(prefix="eager-hyper-") as tmp_name:  # one job trains every mode in turn
            tmp = Path(tmp_name)
            np.save(tmp / "schedule.npy", table)
            (tmp / "config.json").write_text(json.dumps(config_to_dict(config)))
            launch_mpi(p, ["hyperplane-modes", tmp], timeout=float(config.launch_timeout_s))
            ranks = {m: [dict(np.load(tmp / f"hyper_{m}_rank{r}.npz")) for r in range(p)] for m in config.modes}
        for mode in config.modes:
            record = hyperplane_record(ranks[mode], x_val, y_val)
            record["epoch_times_s"] = record.pop("snapshot_times_s")  # one snapshot per epoch here
            runs[f"{mode}-{delay:g}"] = {"mode": mode, "delay_ms": float(delay), **record}
    summary = []
    for delay in config.delays_ms:
        sync = runs.get(f"sync-{delay:g}")
        for mode in config.modes:
            r = runs[f"{mode}-{delay:g}"]
            row = {
                "study": "hyperplane (MPI)",
                "mode": mode,
                "delay_ms": delay,
                "steps_per_s": r["throughput_steps_s"],
                "nap": r["nap_mean"],
                "final_val_mse": r["val_mse"][-1],
            }
            if sync is not None:
                r["speedup_throughput"] = r["throughput_steps_s"] / sync["throughput_steps_s"]
                # Equal loss: the first epoch boundary at which the run's validation MSE is within
                # equal_loss_rtol of synch-SGD's final MSE (Fig. 10b: "equivalent loss value").
                target = sync["val_mse"][-1] * (1.0 + float(config.equal_loss_rtol))
                t_sync = _time_to_loss(np.array(sync["epoch_times_s"]), np.array(sync["val_mse"]), target)
                t_mode = _time_to_loss(np.array(r["epoch_times_s"]), np.array(r["val_mse"]), target)
                r["target_val_mse"] = target
                r["time_to_sync_loss_s"] = t_mode
                r["speedup_equal_loss"] = (t_sync / t_mode) if (t_sync and t_mode) else None
                row["speedup"] = r["speedup_throughput"]
                row["speedup_equal_loss"] = r["speedup_equal_loss"]
            summary.append(row)
    return {"runs": runs, "summary": summary, "steps_per_epoch": steps_per_epoch}


def hyperplane_record(ranks: list[dict], x_val: np.ndarray, y_val: np.ndarray) -> dict:
    """One hyperplane run from its processes' saved arrays (``ranks[r]``: the worker's
    ``hyper_{mode}_rank{r}.npz``): the validation MSE ``mean((x_val . w + b - y_val)^2)`` of rank 0's
    model at each snapshot (``x_val``: ``[N, d]``, ``y_val``: ``[N]``), the snapshots' steps and
    wall-clock times (s, from the start barrier), steps, throughput (steps/s of rank 0), mean NAP, the fraction
    of fresh gradients, whether every process ended with the same model, and the norm of the
    gradients still undelivered at the end.
    """
    d = x_val.shape[1]
    mse = [float(np.mean((x_val @ s[:d] + s[d] - y_val) ** 2)) for s in ranks[0]["snaps"]]
    totals = [float(r["total"]) for r in ranks]
    nap = ranks[0]["nap"]
    steps = len(nap)
    return {
        "steps": steps,
        "snapshot_times_s": ranks[0]["times"].tolist(),
        "snapshot_steps": ranks[0]["snap_steps"].tolist(),
        "val_mse": mse,
        "rank0_time_s": totals[0],
        "slowest_rank_time_s": max(totals),
        "throughput_steps_s": steps / totals[0],
        "nap_mean": float(nap.mean()),
        "fresh_fraction": float(np.mean([r["included"].mean() for r in ranks])),
        "models_identical": bool(all(np.array_equal(r["final"], ranks[0]["final"]) for r in ranks)),
        "undelivered_norm": float(np.linalg.norm(sum(r["leftover"] for r in ranks))),
    }


def _pool_images(ds, f: int):
    """``ds`` with its ``[N, H, W, C]`` images average-pooled by ``f x f`` (H, W cropped to multiples of f)."""
    n, h, w, c = ds.images.shape
    if f < 1 or f > min(h, w):
        raise ValueError(f"severe_downsample must be in [1, {min(h, w)}]; got {f}")
    img = np.asarray(ds.images, np.float32)[:, : h - h % f, : w - w % f]
    img = img.reshape(n, h // f, f, w // f, f, c).mean(axis=(2, 4))
    return ds._replace(images=img)


def severe_learning_rate(config: HyperplaneConfig, epochs: int, rounds_per_epoch: int):
    """The severe-skew study's learning rate per round (one optimizer update per partial-allreduce round).

    ``severe_lr_schedule="constant"``: ``severe_lr``; ``"cosine"``: a cosine decay from ``severe_lr``
    to 0 at the last round (``optax.cosine_decay_schedule``). ``severe_warmup_epochs = w > 0``
    prepends a linear warm-up from 0 to ``severe_lr`` over the first ``w`` epochs (the decay then
    runs over the remaining rounds), the usual remedy for an unstable start of large-batch or
    asynchronous SGD (Goyal et al., 2017).
    """
    import optax

    lr, schedule = float(config.severe_lr), config.severe_lr_schedule
    total = max(1, int(epochs) * int(rounds_per_epoch))
    warm = int(round(float(config.severe_warmup_epochs) * int(rounds_per_epoch)))
    if not 0 <= warm < total:
        raise ValueError(
            f"severe_warmup_epochs must be >= 0 and shorter than the run ({epochs} epochs); "
            f"got {config.severe_warmup_epochs!r}"
        )
    if schedule == "constant":
        after = optax.constant_schedule(lr)
    elif schedule == "cosine":
        after = optax.cosine_decay_schedule(lr, total - warm)
    else:
        raise ValueError(f"severe_lr_schedule must be 'constant' or 'cosine'; got {schedule!r}")
    if warm == 0:
        return lr if schedule == "constant" else after
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warm), after], [warm])


def _severe_skew(config: HyperplaneConfig):
    """The severe study's imbalance: ``RotatingSkew(severe_workers, severe_min_ms, severe_max_ms)``."""
    from jaxcomm import imbalance

    return imbalance.RotatingSkew(int(config.severe_workers), float(config.severe_min_ms), float(config.severe_max_ms))


def severe_staleness(config: HyperplaneConfig, mode: str, rounds: int) -> dict:
    """How stale the severe study's delivered gradients were: :func:`staleness_profile` of its rounds
    (the same skew, clock and key as the training: ``simulate_training`` uses ``split(key)[0]``).

    Returns the profile's ``summary()`` plus ``counts`` (gradients delivered 0, 1, ... rounds stale).
    """
    import jax

    from jaxcomm.algorithms import EagerSGDConfig, staleness_profile

    key = jax.random.split(jax.random.key(int(config.seed)))[0]
    profile = staleness_profile(EagerSGDConfig(mode, _severe_skew(config), clock=config.severe_clock), rounds, key)
    stats = profile.summary()
    counts = np.asarray(profile.counts)[: stats["max_staleness"] + 1]
    return dict(stats, counts=[as_count(c, "counts") for c in counts])


def _run_severe(config: HyperplaneConfig, out_dir: Path) -> dict:
    """Sec. 7.2.3 in the mesh simulation; ``out_dir/severe_partial.json`` holds every mode's
    accuracy history so far (rewritten after every epoch), so a long run that is stopped keeps it.

    Long because every mode's run, evaluation and partial save share the data and the model built once; each
    inner function is short.
    """
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from jaxcomm.algorithms import simulate_training

    from .._common import build_model, load_image_task

    train, test = load_image_task(
        config.severe_dataset, int(config.severe_train_examples), int(config.severe_test_examples)
    )
    f = int(config.severe_downsample)
    if f > 1:  # f x f average pooling of the images: f^2 fewer FLOPs per example (28 -> 14 for f = 2)
        train, test = (_pool_images(d, f) for d in (train, test))
    p = int(config.severe_workers)
    skew = _severe_skew(config)

    def loss_fn(m, xb, yb):
        return optax.softmax_cross_entropy_with_integer_labels(m(xb), yb).mean()

    @nnx.jit
    def accuracy(m, xb, yb):
        return jnp.mean(jnp.argmax(m(xb, deterministic=True), -1) == yb)

    def evaluate(m):
        return {"test_acc": float(accuracy(m, jnp.asarray(test.images), jnp.asarray(test.labels)))}

    runs = {}
    b, epochs = int(config.severe_batch_per_worker), int(config.severe_epochs)
    lr = severe_learning_rate(config, epochs, rounds_per_epoch=len(train.labels) // (p * b))
    partial = {"config": config_to_dict(config), "history": {}}

    def save_partial(mode, entry):
        partial["history"].setdefault(mode, []).append(entry)
        tmp = out_dir / "severe_partial.json.tmp"
        tmp.write_text(json.dumps(partial, indent=1))
        tmp.replace(out_dir / "severe_partial.json")

    for mode in config.severe_modes:
        model = build_model(config.severe_model, train, int(config.seed))
        t0 = time.time()
        out = simulate_training(
            model,
            loss_fn,
            train.images,
            train.labels,
            mode=mode,
            imbalance=skew,
            batch_per_worker=b,
            epochs=epochs,
            optimizer=optax.sgd(lr, momentum=float(config.severe_momentum)),
            key=jax.random.key(int(config.seed)),
            clock=config.severe_clock,
            eval_fn=evaluate,
            progress=True,
            on_eval=functools.partial(save_partial, mode),
        )
        out.pop("model")
        out["host_seconds"] = time.time() - t0
        out["staleness"] = severe_staleness(config, mode, rounds=len(out["nap"]))
        runs[mode] = out
    summary = []
    sync = runs.get("sync")
    for mode, r in runs.items():
        last = r["history"][-1]
        row = {
            "study": f"severe skew (sim, {config.severe_model})",
            "mode": mode,
            "delay_ms": "50..400",
            "nap": float(np.mean(r["nap"])),
            "final_test_acc": last["test_acc"],
            "sim_time_s": last["sim_time_s"],
            "fresh_fraction": r["staleness"]["fresh_fraction"],
            "mean_staleness": r["staleness"]["mean_staleness"],
        }
        if sync is not None:
            r["speedup_sim_time"] = sync["history"][-1]["sim_time_s"] / last["sim_time_s"]
            row["speedup"] = r["speedup_sim_time"]
        summary.append(row)
    return {"runs": runs, "summary": summary}


def _plot_hyperplane(hp: dict, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = hp["runs"]
    delays = sorted({r["delay_ms"] for r in runs.values()})
    modes = [m for m in ("sync", "solo", "majority") if any(r["mode"] == m for r in runs.values())]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / max(1, len(modes))
    for i, mode in enumerate(modes):
        vals = [runs.get(f"{mode}-{d:g}", {}).get("throughput_steps_s", 0.0) for d in delays]
        axes[0].bar(np.arange(len(delays)) + i * width, vals, width, label=mode)
    axes[0].set_xticks(np.arange(len(delays)) + width * (len(modes) - 1) / 2)
    axes[0].set_xticklabels([f"{d:g} ms" for d in delays])
    axes[0].set_ylabel("throughput (steps/s)")
    axes[0].set_title("(a) throughput, one random process delayed")
    axes[0].set_ylim(0, 1.3 * max([r["throughput_steps_s"] for r in runs.values()] + [1e-9]))
    axes[0].legend(loc="upper left", ncol=len(modes), fontsize=8)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for key, r in runs.items():
        axes[1].plot(
            r["epoch_times_s"],
            r["val_mse"],
            marker=".",
            ms=3,
            label=key,
            color=colors[delays.index(r["delay_ms"]) % len(colors)],
            ls={"sync": "-", "solo": "--", "majority": ":"}[r["mode"]],
        )
    axes[1].set_yscale("log")
    axes[1].set_xlabel("wall-clock time (s)")
    axes[1].set_ylabel("validation MSE")
    axes[1].set_title("(b) validation loss (one point per epoch)")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "hyperplane.png", dpi=110)
    plt.close(fig)


def _plot_severe(sv: dict, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    # A fixed order (and so colour) per mode, whatever order the results were stored in.
    runs = {m: sv["runs"][m] for m in ("sync", "solo", "majority") if m in sv["runs"]}
    for mode, r in runs.items():
        h = r["history"]
        ax.plot(
            [e["sim_time_s"] for e in h],
            [e["test_acc"] for e in h],
            marker="o",
            ms=3,
            label=f"{mode} (NAP {np.mean(r['nap']):.2f})",
        )
    ax.set_xlabel("simulated wall-clock time (s)")
    ax.set_ylabel("test accuracy")
    ax.set_title("(a) severe rotating skew 50..400 ms (mesh simulation)")
    ax.legend()
    # (b) the fraction of delivered gradients that were 0, 1, 2, ... rounds stale.
    width = 0.8 / max(1, len(runs))
    for i, (mode, r) in enumerate(runs.items()):
        counts = np.asarray(r["staleness"]["counts"], float)
        bx.bar(
            np.arange(len(counts)) + i * width,
            counts / counts.sum(),
            width,
            label=f"{mode} (mean {r['staleness']['mean_staleness']:.2f})",
        )
    longest = max(len(r["staleness"]["counts"]) for r in runs.values())
    bx.set_xticks(np.arange(longest) + width * (len(runs) - 1) / 2)
    bx.set_xticklabels([str(s) for s in range(longest)])
    bx.set_xlabel("staleness of a delivered gradient (rounds)")
    bx.set_ylabel("fraction of delivered gradients")
    bx.set_title("(b) staleness")
    bx.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "severe.png", dpi=110)
    plt.close(fig)
