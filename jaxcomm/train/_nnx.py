"""Flax NNX models as pure functions of arrays (``nnx.split`` / ``nnx.merge``).

A model is split once into a static graph definition, its parameters
(``nnx.Param``), its RNG streams and any other variables (``model_state``,
e.g. normalisation statistics). The step merges them back, reseeds dropout from
the step's explicit key and splits again, so the step stays a pure function.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from .._validate import check_int

__all__ = [
    "PureModel",
    "split_model",
    "classification_loss",
    "language_model_loss",
    "classification_eval",
    "evaluate_classifier",
]


@dataclasses.dataclass(frozen=True)
class PureModel:
    """A split NNX model.

    Attributes:
      graphdef: static structure (hashable; closed over by jitted functions).
      params: ``nnx.Param`` variables (the trained pytree).
      model_state: other variables, RNG streams excluded.
      rng_state: the RNG streams at split time (reseeded every call).
    """

    graphdef: Any
    params: Any
    model_state: Any
    rng_state: Any

    def module(self, params, model_state=None, *, key=None, train: bool | None = None) -> nnx.Module:
        """The NNX module holding ``params`` and ``model_state`` (default: the split-time state).

        ``key`` reseeds every RNG stream (see :meth:`PureModel.apply`); ``train`` ``True`` /
        ``False`` switches training / evaluation behaviour, ``None`` keeps the
        mode the model was split in.
        """
        state = self.model_state if model_state is None else model_state
        model = nnx.merge(self.graphdef, params, self._rng_state_for(key), state)
        if train is True:
            model.train()
        elif train is False:
            model.eval()
        return model

    def apply(self, params, model_state, x, *, key=None, train: bool = False, **kwargs):
        """Run the model: returns ``(output, new_model_state)``.

        ``key`` reseeds every RNG stream (dropout) for this call; ``train`` selects
        training behaviour (dropout on); ``kwargs`` go to the module's call.
        """
        model = self.module(params, model_state, key=key, train=bool(train))
        out = model(x, **kwargs)
        parts: tuple[Any, ...] = nnx.split(model, nnx.Param, nnx.RngState, ...)  # 4 parts for 3 filters
        new_state = parts[3]
        return out, new_state

    def _rng_state_for(self, key):
        """Fresh RNG variables (built at the current trace level) seeded from ``key``.

        Stream ``i`` (in tree order) gets ``fold_in(key, i)`` and its counter is
        reset, so a call's randomness is a function of ``key`` alone.
        """
        if key is not None:
            key = jnp.asarray(key)
            if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
                key = jax.random.wrap_key_data(key.astype(jnp.uint32))
        leaves, treedef = jax.tree.flatten(self.rng_state)
        fresh, stream = [], 0
        for leaf in leaves:
            if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                fresh.append(leaf if key is None else jax.random.fold_in(key, stream))
                stream += 1
            else:
                fresh.append(jnp.zeros_like(leaf))
        return jax.tree.unflatten(treedef, fresh)


def split_model(model: nnx.Module) -> PureModel:
    """Split an NNX module into a :class:`PureModel`.

    A Flax linen module is refused (``TypeError``) with the wrapping that makes it
    an NNX one: ``nnx.bridge.ToNNX(module, rngs=nnx.Rngs(0))`` followed by
    ``nnx.bridge.lazy_init(model, example_input)``.
    """
    if not isinstance(model, nnx.Module):
        from flax import linen

        if isinstance(model, linen.Module):
            raise TypeError(
                f"model is a Flax linen module ({type(model).__name__}); jaxcomm trains NNX modules. Wrap it: "
                "model = nnx.bridge.ToNNX(module, rngs=nnx.Rngs(0)); nnx.bridge.lazy_init(model, example_x)"
            )
        raise TypeError(f"model must be a flax.nnx.Module; got {type(model).__name__}")
    parts: tuple[Any, ...] = nnx.split(model, nnx.Param, nnx.RngState, ...)  # 4 parts for 3 filters
    graphdef, params, rng_state, model_state = parts[0], parts[1], parts[2], parts[3]
    return PureModel(graphdef, params, model_state, rng_state)


def _xy(batch):
    """``(inputs, targets)`` of a ``{"x", "y"}`` dict or an ``(images, labels)`` pair."""
    if isinstance(batch, dict):
        return batch["x"], batch["y"]
    return batch[0], batch[1]


def classification_loss(model: PureModel) -> Callable:
    """Softmax cross-entropy loss ``(params, model_state, batch, key) -> (loss, (state, metrics))``.

    ``batch`` is ``{"x": float[B, ...], "y": int32[B]}`` or a
    :class:`jaxcomm.data._split.Batch` ``(images, labels)``; metrics: ``accuracy``.
    """

    def loss_fn(params, model_state, batch, key):
        x, y = _xy(batch)
        logits, new_state = model.apply(params, model_state, x, key=key, train=True)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        acc = jnp.mean(jnp.argmax(logits, -1) == y)
        return loss, (new_state, {"accuracy": acc})

    return loss_fn


def language_model_loss(model: PureModel) -> Callable:
    """Next-token cross-entropy for a character LM; ``batch = {"x": int32[B, T], "y": int32[B, T]}``.

    Metrics: ``perplexity`` (``exp`` of the mean token loss).
    """

    def loss_fn(params, model_state, batch, key):
        x, y = _xy(batch)
        logits, new_state = model.apply(params, model_state, x, key=key, train=True)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return loss, (new_state, {"perplexity": jnp.exp(loss)})

    return loss_fn


# The named tasks of :class:`jaxcomm.train.Trainer` (``task="classification"``): each one's loss,
# built from the model.
TASK_LOSSES: dict[str, Callable[[PureModel], Callable]] = {
    "classification": classification_loss,
    "language_model": language_model_loss,
}


def classification_eval(model: PureModel) -> Callable:
    """The jitted evaluation batch ``(params, model_state, x, y) -> (loss_sum, correct_sum)``.

    ``x``: inputs ``[B, ...]``; ``y``: int targets ``[B]`` (or ``[B, T]`` for a
    language model, whose logits are ``[B, T, V]``). Sums (not means) of the
    softmax cross-entropy (nats) and of the correct argmax predictions over every
    target, evaluation mode (dropout off). Build it once per model and reuse it:
    each call of this function compiles anew.
    """

    def batch_sums(params, model_state, x, y):
        out, _ = model.apply(params, model_state, x, train=False)
        loss = optax.softmax_cross_entropy_with_integer_labels(out, y)
        return loss.sum(), (jnp.argmax(out, -1) == y).sum()

    return jax.jit(batch_sums)


def evaluate_classifier(eval_batch: Callable, params, model_state, x, y, batch_size: int = 1000) -> dict:
    """Mean ``loss`` (nats per target), ``accuracy`` (fraction) and ``perplexity`` (``exp(loss)``) on ``(x, y)``.

    Args:
      eval_batch: from :func:`classification_eval`.
      params, model_state: one model's (no worker axis).
      x, y: host or device arrays with a common leading axis ``N``.
      batch_size: examples per call (the last batch may be smaller).
    """
    batch_size = check_int(batch_size, "batch_size")
    total_loss, total_correct, count = 0.0, 0.0, 0
    for i in range(0, len(x), batch_size):
        xb, yb = jnp.asarray(x[i : i + batch_size]), jnp.asarray(y[i : i + batch_size])
        loss, correct = eval_batch(params, model_state, xb, yb)
        total_loss += float(loss)
        total_correct += float(correct)
        count += int(np.prod(yb.shape))
    mean = total_loss / count
    return {"loss": mean, "accuracy": total_correct / count, "perplexity": math.exp(min(mean, 700.0))}
