"""MPI worker of ``jaxcomm run gradient-dropping-time``: one process per rank, on the emulated link.

``python -m experiments.gradient_dropping.worker DIR`` (started by
:func:`experiments.gradient_dropping.timed.run` through :func:`jaxcomm.netem.launch`) reads
``DIR/config.json`` (the :class:`~.config.GradientDroppingTimeConfig` fields) and rank 0 writes
``DIR/results.json`` (again after every run, ``"complete"`` once all are done):

* ``link``: the latency and throughput of the link as Open MPI sees it
  (:func:`experiments.network.worker.measure_link`);
* ``compute_s``: per method, its step without communication: the same optimizer on a one-worker
  communicator (:class:`jaxcomm.comm.Local`; forward, backward, selection, Adam), timed on every
  rank at once so that the processes share the cores as in training
  (:func:`~experiments.network.worker.timed_steps_alone`; the median of ``compute_steps`` steps,
  the slowest rank's, s; empty with ``compute_steps = 0``);
* ``runs``: per seed and method, trained with :class:`jaxcomm.train.Trainer` over
  :class:`jaxcomm.comm.MPIComm` by the studies' one loop
  (:func:`~experiments.network.worker.train_to_target`, never stopped early): ``curve`` (after
  every ``eval_every`` steps: ``step``, ``time_s``, ``loss`` and ``perplexity`` (below),
  ``link_bytes``, ``wire_bits``), ``step_times`` (s, rank 0, every step), ``wire_bits_per_step``
  (one worker's, every step) and ``link_bytes``.

Validation: every rank evaluates its own model on its ``1 / num_procs`` of the ``eval_windows``
validation windows; ``loss`` is the mean over the ranks of their mean cross-entropy (nats per
character) and ``perplexity = exp(loss)``. The ranks' models are one model for the baseline and
vanilla dropping; with the local gradient they drift apart between averagings, and the number
is the mean worker's.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

__all__ = ["main"]


def _compute_only(label: str, cfg: dict, corpus, world) -> float:
    """The slowest rank's compute-only step (s) of ``label``: its optimizer over ``Local()``."""
    import jax
    import numpy as np

    from jaxcomm.comm import Local
    from jaxcomm.train import Trainer

    from ..network.worker import timed_steps_alone
    from .config import time_method_parts
    from .run import char_lstm

    seed = int(cfg["seeds"][0])
    method, sync = time_method_parts(label)
    trainer = Trainer(
        char_lstm(corpus.vocab_size, int(cfg["embed"]), int(cfg["hidden"]), seed),
        _transform(method, sync, cfg),
        task="language_model",
        comm=Local(),
        seed=seed,
    )
    batches = corpus.batches(int(cfg["seq_len"]), int(cfg["batch_size"]), jax.random.PRNGKey(seed + 7), num_workers=1)
    # the median step: an averaging step sends nothing here, so it is a step like the others
    seconds = timed_steps_alone(trainer, batches, int(cfg["compute_steps"]), 1, world)
    return float(np.max(world.allgather(seconds)))


def _transform(method: str, sync: bool, cfg: dict):
    from .run import transform

    return transform(
        method,
        learning_rate=float(cfg["learning_rate"]),
        drop_ratio=float(cfg["drop_ratio"]),
        warmup_steps=int(cfg["warmup_steps"]),
        sync_every=int(cfg["sync_every"]) if sync else 0,
    )


def _train(label: str, seed: int, cfg: dict, corpus, valid, world, rank: int) -> dict:
    """One run of ``label`` for ``seed``: ``steps`` steps over MPI, evaluated every ``eval_every``."""
    import jax
    import numpy as np

    from jaxcomm.comm import MPIComm
    from jaxcomm.train import Trainer

    from ..network.worker import load_step, train_to_target
    from .config import time_method_parts
    from .run import char_lstm

    n = world.Get_size()
    method, sync = time_method_parts(label)
    trainer = Trainer(
        char_lstm(corpus.vocab_size, int(cfg["embed"]), int(cfg["hidden"]), seed),
        _transform(method, sync, cfg),
        task="language_model",
        comm=MPIComm(),
        seed=seed,
    )
    key = jax.random.PRNGKey(seed)
    seq_len, global_batch = int(cfg["seq_len"]), n * int(cfg["batch_size"])
    load_step(
        trainer, label, corpus.batches(seq_len, global_batch, jax.random.fold_in(key, 2), num_workers=n), world, rank
    )
    batches = corpus.batches(seq_len, global_batch, key, num_workers=n)

    def evaluate(state) -> dict:
        x, y = valid
        loss = float(world.allreduce(trainer.evaluate(state, x, y, batch_size=256)["loss"])) / n
        return {"loss": loss, "perplexity": math.exp(loss)}

    run = train_to_target(
        trainer,
        trainer.init_state(),
        batches,
        world,
        every=int(cfg["eval_every"]),
        max_steps=int(cfg["steps"]),
        evaluate=evaluate,
        reached=lambda metrics: False,  # whole runs: the time to the target is read off the curve
        shown=("perplexity", "validation perplexity"),
        desc=f"{cfg['bandwidth']} {label} seed {seed}",
    )
    return {
        "method": label,
        "seed": seed,
        "curve": run["curve"],
        "steps": run["steps"],
        "time_s": run["time_s"],
        "step_times": run["step_times"],
        "wire_bits_per_step": [b / n for b in run["bits"]],
        "messages_per_step": run["messages"],
        "link_bytes": int(run["link_bytes"]),
        "params": int(sum(np.size(p) for p in jax.tree.leaves(trainer.pure.params))),
    }


def main(argv: list[str] | None = None) -> None:
    """Run the job of ``DIR/config.json``; rank 0 writes ``DIR/results.json``."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: python -m experiments.gradient_dropping.worker DIR (launched by jaxcomm run)")
    out = Path(argv[0])
    cfg = json.loads((out / "config.json").read_text())
    from mpi4py import MPI

    from ..network.worker import link_payload, measure_link, write_job_results
    from .run import char_corpus

    world = MPI.COMM_WORLD
    rank, n = world.Get_rank(), world.Get_size()
    t0 = time.perf_counter()
    corpus = char_corpus(int(cfg["corpus_chars"]))
    xv, yv = corpus.windows(int(cfg["seq_len"]), "valid")
    per = int(cfg["eval_windows"]) // n
    valid = (xv[rank * per : (rank + 1) * per], yv[rank * per : (rank + 1) * per])
    result: dict = {
        "bandwidth": cfg["bandwidth"],
        "procs": n,
        "link": measure_link(world, payload_bytes=link_payload(cfg["bandwidth"], n)),
        "compute_s": {},
        "runs": [],
    }
    for label in cfg["methods"] if int(cfg["compute_steps"]) else ():
        result["compute_s"][label] = _compute_only(label, cfg, corpus, world)
        if rank == 0:
            print(f"[compute] {label}: {result['compute_s'][label] * 1e3:.1f} ms per step without communication")
    plan = [(label, int(seed)) for seed in cfg["seeds"] for label in cfg["methods"]]
    for i, (label, seed) in enumerate(plan):
        result["runs"].append(_train(label, seed, cfg, corpus, valid, world, rank))
        if rank == 0:
            r = result["runs"][-1]
            print(
                f"[run] {label} seed {seed}: perplexity {r['curve'][-1]['perplexity']:.3f} after {r['steps']} steps, "
                f"{r['time_s']:.1f} s of steps, {r['link_bytes'] / 1e6:.1f} MB on the link",
                flush=True,
            )
            write_job_results(result, out, t0, complete=i + 1 == len(plan))


if __name__ == "__main__":
    main()
