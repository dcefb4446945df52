"""``jaxcomm run eventgrad-ring``: D-PSGD against EventGraD over MPI one-sided windows on a ring, to a plateau.

``num_procs`` MPI processes (:mod:`~experiments.eventgrad.worker`) on a ring inside a private
network namespace whose loopback is shaped to ``bandwidth`` (:func:`jaxcomm.netem.launch`): every
byte between the processes crosses that link and the kernel counts it. One job per seed trains
every method in turn from the same initialisation on the same batches; rank 0 reads the link's
counters around each method's training (:func:`jaxcomm.netem.measure_window`).

Afterwards this process evaluates, at every snapshot (every ``eval_every`` steps), the test
accuracy ``a`` (%) of the workers' average model ``(1/P) sum_i x_i`` (the model the paper and
``jaxcomm run eventgrad`` report). Definitions, per run (method and seed):

* plateau: the last ``K = plateau_evals`` accuracies lie within ``plateau_points``:
  ``max - min <= plateau_points``; the plateau accuracy is their mean;
* messages: tensors sent to a neighbour (``MPI_Put`` calls), summed over the workers, and as a
  percentage of D-PSGD's of the same seed; payload bytes likewise (values, and int32 indices
  with top-K); link bytes: the qdisc's count over the training (headers and acknowledgements
  included);
* target of a seed: D-PSGD's plateau accuracy minus ``target_points``; time (s, rank 0, from the
  start barrier) and steps to target: the first snapshot at or above it;
* staleness: the mean, over steps, workers and tensors (weighted by their sizes), of the number
  of steps since the tensor was last sent, ``t - t_last`` (0 when it is sent at ``t``): how old
  the copy a neighbour mixes with is, asynchrony aside.

Records, a summary per method (mean and sample standard deviation over the seeds, ``ddof = 1``),
the verdicts of the paper's claims (:func:`verdicts`) and the load average at the start and the end
go to ``results.json``; ``accuracy.png`` shows accuracy against wall-clock time and against
messages, one line per method and seed.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np

from jaxcomm.studies import config_to_dict

from ..eager.quality import launch_job, mean_std, start_emulated_study, summary_rows
from .config import RING_METHODS, TASKS, EventGradRingConfig
from .run import PAPER_TABLE1, PAPER_TABLE2

__all__ = ["plateau", "staleness", "time_to_target", "records_of_seed", "summarize", "verdict", "verdicts", "run"]

_WORKER = "experiments.eventgrad.worker"
MAGNITUDE = 0.25
"""A measured mean within this fraction of the paper's number counts as the paper's magnitude."""


def plateau(accuracy, k: int, spread: float) -> tuple[bool, float]:
    """``(plateaued, plateau accuracy)``: whether the last ``k`` values of ``accuracy`` lie within
    ``spread`` of each other (``max - min <= spread``), and their mean."""
    last = np.asarray(accuracy, np.float64)[-int(k) :]
    return bool(last.max() - last.min() <= spread), float(last.mean())


def time_to_target(times, steps, accuracy, target: float) -> tuple[float | None, int | None]:
    """``(time, step)`` of the first snapshot whose accuracy is ``>= target``; ``(None, None)`` if none."""
    hit = np.nonzero(np.asarray(accuracy, np.float64) >= target)[0]
    if not hit.size:
        return None, None
    return float(times[hit[0]]), int(steps[hit[0]])


def staleness(fired, sizes) -> float:
    """Mean over steps ``t``, workers and tensors (weighted by ``sizes``) of ``t - t_last``, the steps
    since the tensor was last sent (``t_last <= t``; a tensor not yet sent counts from step 0).

    ``fired``: ``bool [P, T, L]`` (or ``[T, L]``), whether each tensor was sent at each step.
    """
    f = np.asarray(fired, bool)
    f = f[None] if f.ndim == 2 else f
    t = f.shape[1]
    idx = np.where(f, np.arange(t)[None, :, None], 0)
    last = np.maximum.accumulate(idx, axis=1)
    age = np.arange(t)[None, :, None] - last  # [P, T, L]
    w = np.asarray(sizes, np.float64)
    return float((age.mean(axis=(0, 1)) * w).sum() / w.sum())


def _evaluate(config: EventGradRingConfig, seed: int, snaps_by_method: dict) -> dict:
    """``{method: [accuracy (%) of the average model at each snapshot]}`` on the test set."""
    import jax
    import jax.numpy as jnp

    from jaxcomm.train import classification_eval, evaluate_classifier

    from .run import _load, _model

    spec = TASKS[config.task]
    _, test = _load(spec["dataset"], 1, int(config.test_examples), int(seed))
    pure = _model(spec["model"], int(seed))
    leaves, treedef = jax.tree.flatten(pure.params)
    cuts = np.cumsum([x.size for x in leaves])[:-1]
    evaluate = classification_eval(pure)

    def accuracy(flat):
        parts = np.split(np.asarray(flat, np.float32), cuts)
        params = jax.tree.unflatten(treedef, [jnp.asarray(a.reshape(x.shape)) for a, x in zip(parts, leaves)])
        ev = evaluate_classifier(evaluate, params, pure.model_state, test.images, test.labels, 1000)
        return 100.0 * float(ev["accuracy"])

    # The workers' average model at each snapshot: [P, E, D] -> [E, D].
    return {m: [accuracy(avg) for avg in np.mean(snaps, axis=0)] for m, snaps in snaps_by_method.items()}


def records_of_seed(config: EventGradRingConfig, seed: int, ranks_by_method: dict, job_bytes: int, sizes) -> list:
    """One record per method of a seed's job from the processes' saved arrays (``ranks_by_method[m]``:
    one dict per rank) and the tensors' sizes; ``job_bytes``: what the whole job sent on the link."""
    acc = _evaluate(config, seed, {m: np.stack([r["snaps"] for r in ranks]) for m, ranks in ranks_by_method.items()})
    deg = 2  # a ring: every tensor sent goes to two neighbours
    records = []
    for m, ranks in ranks_by_method.items():
        r0 = ranks[0]
        times, steps = np.asarray(r0["times"], float), np.asarray(r0["snap_steps"], int)
        fired = np.stack([r["fired"] for r in ranks])  # [P, T, L]
        done, value = plateau(acc[m], config.plateau_evals, config.plateau_points)
        records.append(
            {
                "method": m,
                "seed": int(seed),
                "snapshot_steps": steps.tolist(),
                "snapshot_times_s": times.tolist(),
                "accuracy": acc[m],
                "final_accuracy": acc[m][-1],
                "plateaued": done,
                "plateau_accuracy": value,
                "messages": int(sum(int(r["messages"]) for r in ranks)),
                "messages_at_snapshots": (deg * fired.sum(axis=(0, 2)).cumsum()[steps - 1]).tolist(),
                "payload_bytes": int(sum(int(r["payload_bytes"]) for r in ranks)),
                "link_bytes": int(r0["link_bytes"]),
                "link_packets": int(r0["link_packets"]),
                "link_retransmitted": int(r0["link_retransmitted"]),
                "wall_s": float(r0["train_s"]),
                "first_step_s": float(max(float(r["first_step_s"]) for r in ranks)),
                "exchange_s_per_step": float(np.mean([float(r["exchange_s"]) for r in ranks])) / config.iterations,
                "staleness_steps": staleness(fired, sizes),
                "job_bytes": int(job_bytes),
            }
        )
    base = next(r for r in records if r["method"] == "dpsgd")
    target = base["plateau_accuracy"] - float(config.target_points)
    for rec in records:
        t, s = time_to_target(rec["snapshot_times_s"], rec["snapshot_steps"], rec["accuracy"], target)
        rec.update(target_accuracy=target, time_to_target_s=t, steps_to_target=s)
    for rec in records:
        t = rec["time_to_target_s"]
        rec.update(
            accuracy_vs_dpsgd=rec["plateau_accuracy"] - base["plateau_accuracy"],
            percent_messages=100.0 * rec["messages"] / base["messages"],
            percent_payload_bytes=100.0 * rec["payload_bytes"] / base["payload_bytes"],
            percent_link_bytes=100.0 * rec["link_bytes"] / base["link_bytes"],
            time_ratio=None if t is None or not base["time_to_target_s"] else t / base["time_to_target_s"],
            wall_ratio=rec["wall_s"] / base["wall_s"],
        )
    return records


_SUMMARY_KEYS = (
    "plateau_accuracy",
    "final_accuracy",
    "accuracy_vs_dpsgd",
    "percent_messages",
    "percent_payload_bytes",
    "percent_link_bytes",
    "link_bytes",
    "wall_s",
    "time_to_target_s",
    "steps_to_target",
    "time_ratio",
    "staleness_steps",
    "exchange_s_per_step",
)


def summarize(records: list[dict]) -> list[dict]:
    """One row per method: the seeds, how many plateaued and reached the target, and the mean and
    sample standard deviation (``_std``) over the seeds of each key (over the seeds that reached
    the target, for the time, steps and ratio to it)."""
    plateaued = {"plateaued": lambda mine: sum(r["plateaued"] for r in mine)}
    return summary_rows(records, "method", RING_METHODS, _SUMMARY_KEYS, plateaued)


def verdict(values, low: float, high: float, side: tuple[float, float] | None = None) -> str:
    """``"holds"``, ``"partly"`` or ``"does not"`` for a claim measured once per seed (``values``;
    ``None``: the seed never reached what the claim needs, which is against it).

    ``"holds"``: every seed in ``[low, high]`` (the paper's magnitude). ``"partly"``: the mean in
    ``[low, high]`` but not every seed, or every seed on the claim's side ``side = (lo, hi)`` (e.g.
    fewer messages than D-PSGD) without the magnitude. ``"does not"``: otherwise.
    """
    vals = list(values)
    xs = [float(v) for v in vals if v is not None]
    if xs and len(xs) == len(vals) and all(low <= v <= high for v in xs):
        return "holds"
    if xs and low <= float(np.mean(xs)) <= high:
        return "partly"
    if side is not None and xs and len(xs) == len(vals) and all(side[0] < v < side[1] for v in xs):
        return "partly"
    return "does not"


def _values(records: list[dict], method: str, key: str) -> list:
    return [r[key] for r in sorted(records, key=lambda r: r["seed"]) if r["method"] == method]


def verdicts(records: list[dict], config: EventGradRingConfig) -> list[dict]:
    """The paper's claims at 4 PEs (Tables 1 and 2), each with its per-seed values, mean, sample
    deviation, the number of seeds and the :func:`verdict`; magnitudes within :data:`MAGNITUDE`
    of the paper's number, "same accuracy" within ``same_accuracy_points`` of D-PSGD."""
    methods = {r["method"] for r in records}
    tol = float(config.same_accuracy_points)
    regular, event, pct = PAPER_TABLE1[4]
    sparse_acc, _, sparse_comm = PAPER_TABLE2[4]
    claims = []

    def claim(text, paper, method, key, low, high, side=None):
        vals = _values(records, method, key)
        mean, std = mean_std(vals)
        claims.append(
            {
                "claim": text,
                "paper": paper,
                "method": method,
                "key": key,
                "values": vals,
                "mean": mean,
                "std": std,
                "seeds": len(vals),
                "verdict": verdict(vals, low, high, side),
            }
        )

    band = lambda x: (x * (1 - MAGNITUDE), x * (1 + MAGNITUDE))
    if "eventgrad" in methods:
        claim("EventGraD: fewer messages than D-PSGD (% of D-PSGD's)", f"{pct} % (4 PEs; 'up to 60 %' fewer)",
              "eventgrad", "percent_messages", *band(pct), side=(0.0, 100.0))  # fmt: skip
        claim("EventGraD: D-PSGD's accuracy (plateau difference, points)",
              f"{event - regular:+.1f} ({event} vs {regular})",
              "eventgrad", "accuracy_vs_dpsgd", -tol, tol)  # fmt: skip
        claim("EventGraD: less time to D-PSGD's accuracy (time-to-target ratio)",
              "implied ('reduction in ... the time ... overhead of communication'), not measured",
              "eventgrad", "time_ratio", 0.0, 1.0)  # fmt: skip
    if "eventgrad_topk" in methods:
        claim("EventGraD + top-10 %: % of D-PSGD's communication (payload bytes)", f"{sparse_comm} % (4 PEs)",
              "eventgrad_topk", "percent_payload_bytes", *band(sparse_comm), side=(0.0, 100.0))  # fmt: skip
        claim("EventGraD + top-10 %: D-PSGD's accuracy (plateau difference, points)",
              f"{sparse_acc - regular:+.1f} ({sparse_acc} vs {regular})",
              "eventgrad_topk", "accuracy_vs_dpsgd", -tol, tol)  # fmt: skip
    if "dpsgd_sendrecv" in methods:
        claim("control: D-PSGD on one-sided windows has two-sided D-PSGD's accuracy (points)",
              "(not a claim of the paper: it separates the exchange from the events)",
              "dpsgd_sendrecv", "accuracy_vs_dpsgd", -tol, tol)  # fmt: skip
    return claims


def _pm(mean, std, digits: int = 1) -> str:
    """``mean ± std``; ``std`` ``None``: one seed's value; ``mean`` ``None``: no seed's."""
    if mean is None:
        return "not reached"
    return f"{mean:.{digits}f}" + (" (one seed)" if std is None else f" ± {std:.{digits}f}")


def markdown_tables(results: dict) -> str:
    """The study's two tables as docs/eventgrad.md shows them, from a ``results.json``: per method
    (mean ± sample std over the seeds), then the verdicts.

    Print them: ``python -c "import json, experiments.eventgrad.ring as r;
    print(r.markdown_tables(json.load(open('results.json'))))"``.
    """
    steps = results["config"]["iterations"]
    head = ["method", "plateau accuracy (%)", "plateaued", "vs D-PSGD (points)", "messages (% of D-PSGD)",
            "payload bytes (%)", "link bytes (%)", f"wall time, {steps} steps (s)", "reached target",
            "time to target (s)", "staleness (steps)"]  # fmt: skip
    rows = [
        [
            f"`{r['method']}`",
            _pm(r["plateau_accuracy"], r["plateau_accuracy_std"]),
            f"{r['plateaued']}/{r['seeds']}",
            _pm(r["accuracy_vs_dpsgd"], r["accuracy_vs_dpsgd_std"]),
            _pm(r["percent_messages"], r["percent_messages_std"]),
            _pm(r["percent_payload_bytes"], r["percent_payload_bytes_std"]),
            _pm(r["percent_link_bytes"], r["percent_link_bytes_std"]),
            _pm(r["wall_s"], r["wall_s_std"]),
            f"{r['reached']}/{r['seeds']}",
            _pm(r["time_to_target_s"], r["time_to_target_s_std"]),
            _pm(r["staleness_steps"], r["staleness_steps_std"], 2),
        ]
        for r in results["summary"]
    ]
    vhead = ["claim", "paper", "jaxcomm (mean ± std)", "seeds", "verdict"]
    vrows = [[v["claim"], v["paper"], _pm(v["mean"], v["std"], 2), str(v["seeds"]), v["verdict"]]
             for v in results["verdicts"]]  # fmt: skip

    def table(h, rs):
        return "\n".join(
            ["| " + " | ".join(h) + " |", "|" + "---|" * len(h)] + ["| " + " | ".join(r) + " |" for r in rs]
        )

    return table(head, rows) + "\n\n" + table(vhead, vrows)


def _plot(records: list[dict], config: EventGradRingConfig, out_dir: Path) -> None:
    """``accuracy.png``: test accuracy against wall-clock time and against messages, one line per
    method and seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = dict(zip(RING_METHODS, ("tab:blue", "tab:orange", "tab:green", "tab:gray")))
    styles = ["-", "--", ":", "-."]
    seeds = sorted({r["seed"] for r in records})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4), sharey=True)
    for r in records:
        ls = styles[seeds.index(r["seed"]) % len(styles)]
        kw = dict(ls=ls, color=colors[r["method"]], lw=1.1, label=f"{r['method']}, seed {r['seed']}")
        axes[0].plot(r["snapshot_times_s"], r["accuracy"], **kw)
        axes[1].plot(r["messages_at_snapshots"], r["accuracy"], **kw)
    axes[0].set_xlabel("wall-clock time (s, rank 0)")
    axes[1].set_xlabel("messages sent (tensors to a neighbour, all workers)")
    axes[0].set_ylabel("test accuracy of the average model (%)")
    lows = [min(r["accuracy"]) for r in records]
    axes[0].set_ylim(max(min(lows), max(r["plateau_accuracy"] for r in records) - 15.0), None)
    axes[1].legend(fontsize=6, ncol=len(seeds))
    fig.suptitle(f"{config.task}, {config.num_procs} MPI processes on a ring, {config.bandwidth} link", fontsize=10)
    fig.tight_layout()
    fig.savefig(out_dir / "accuracy.png", dpi=110)
    plt.close(fig)


def _tensor_sizes(config: EventGradRingConfig, seed: int) -> list[int]:
    import jax

    from .run import _model

    return [int(x.size) for x in jax.tree.leaves(_model(TASKS[config.task]["model"], int(seed)).params)]


def _run_seed(config: EventGradRingConfig, seed: int, env: dict) -> list[dict]:
    """One job on the emulated link: every method of ``seed`` in turn; its records."""
    p = int(config.num_procs)
    with tempfile.TemporaryDirectory(prefix="eventgrad-ring-") as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "config.json").write_text(json.dumps({**config_to_dict(config), "seed": int(seed)}))
        print(f"eventgrad-ring: seed {seed}, methods {list(config.methods)}", flush=True)
        res = launch_job(
            p, [_WORKER, str(tmp)], bandwidth=config.bandwidth, env=env, timeout=float(config.launch_timeout_s),
            what=f"the job of seed {seed}",
        )  # fmt: skip
        ranks = {m: [dict(np.load(tmp / f"{m}_rank{r}.npz")) for r in range(p)] for m in config.methods}
    return records_of_seed(config, seed, ranks, res.bytes, _tensor_sizes(config, seed))


def run(config: EventGradRingConfig, out_dir: Path) -> dict:
    """Run the study: one job per seed on the emulated link; write ``accuracy.png`` and
    ``results.json``; return ``records``, ``summary`` (:func:`summarize`), ``verdicts``
    (:func:`verdicts`), the paper's Table 1 and 2 rows at 4 PEs, the link, and the load average
    (1, 5, 15 min) at the start and the end.

    Raises:
      ValueError: ``config.threshold_rule`` not a rule of :func:`jaxcomm.algorithms.eventgrad`.
      jaxcomm.netem.NetemUnavailable: no private network namespace can be made here.
      RuntimeError: a job failed (its output's tail is in the message).
    """
    from jaxcomm.algorithms._eventgrad import THRESHOLD_RULES
    from jaxcomm.netem._link import link_settings
    from jaxcomm.studies import write_results

    if config.threshold_rule not in THRESHOLD_RULES:
        raise ValueError(f"EventGradRingConfig.threshold_rule: one of {THRESHOLD_RULES}; got {config.threshold_rule!r}")
    out_dir, env, load_start = start_emulated_study("eventgrad-ring", __package__, out_dir)
    records = [rec for seed in config.seeds for rec in _run_seed(config, int(seed), env)]
    results = {
        "config": config_to_dict(config),
        "paper": {"table1_4pes": PAPER_TABLE1[4], "table2_4pes": PAPER_TABLE2[4]},
        "link": link_settings(config.bandwidth, "0").describe(),
        "load_average_start": list(load_start),
        "load_average_end": list(os.getloadavg()),
        "records": records,
        "summary": summarize(records),
        "verdicts": verdicts(records, config),
    }
    _plot(records, config, out_dir)
    write_results(out_dir, results)
    return results
