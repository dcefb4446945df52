"""Splitting a dataset across workers and iterating over per-worker batches, resumably.

The batch at a position ``(epoch, index)`` is a pure function of the PRNG key, the shards and
that position: worker ``w`` reads its shard in a permutation drawn from the stream
``(key, epoch, w)``. So a run restored from a checkpointed :class:`BatchPosition` sees
bit-identical batches to an uninterrupted run.

Permutations are host-side NumPy draws (PCG64 seeded by ``SeedSequence(entropy=key data,
spawn_key=stream)``): the JAX key decides them, but no device work or per-size compilation
is spent on shuffling indices.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from .._validate import check_int
from ._sources import Dataset

__all__ = ["Batch", "BatchPosition", "WorkerBatches", "split_iid", "split_by_label"]


class Batch(NamedTuple):
    """One batch of a labelled dataset.

    Attributes:
      images: ``[num_workers, per_worker_batch, H, W, C]`` (or ``[batch, H, W, C]`` without a worker axis).
      labels: ``int32 [num_workers, per_worker_batch]`` (or ``[batch]``).
    """

    images: np.ndarray
    labels: np.ndarray


class BatchPosition(NamedTuple):
    """Where an epoch iterator stands: the next batch it yields is batch ``index`` of ``epoch``.

    Plain Python ints, so it checkpoints as JSON or as two scalars.
    """

    epoch: int
    # Shadows tuple.index (a method) on purpose: `index` is the public, checkpointed field name.
    index: int  # type: ignore[assignment]


def _key_words(key) -> list[int]:
    """The uint32 words of a JAX PRNG key (typed ``jax.random.key`` or raw ``PRNGKey``)."""
    if isinstance(key, jax.Array) and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    words = np.asarray(key)
    if words.dtype != np.uint32 or words.ndim != 1:
        raise TypeError(
            f"key must be a single JAX PRNG key (jax.random.key or PRNGKey); got {words.dtype}{words.shape}"
        )
    return words.tolist()


def _permutation(key, n: int, stream: tuple[int, ...] = ()) -> np.ndarray:
    """A permutation of ``range(n)`` determined by ``key`` and the integer ``stream`` path."""
    seq = np.random.SeedSequence(entropy=_key_words(key), spawn_key=tuple(int(s) for s in stream))
    return np.random.Generator(np.random.PCG64(seq)).permutation(n)


def _iid_index_shards(n: int, num_workers: int, key) -> list[np.ndarray]:
    if num_workers > n:
        raise ValueError(f"num_workers={num_workers} exceeds the number of examples ({n})")
    return np.array_split(_permutation(key, n, (0,)), num_workers)


def split_iid(dataset: Dataset, num_workers: int, key) -> list[Dataset]:
    """Shuffle and deal the examples into ``num_workers`` near-equal i.i.d. shards.

    Every example lands in exactly one shard; shard sizes differ by at most one
    (``numpy.array_split`` of a random permutation).

    Args:
      dataset: the :class:`Dataset` to split (``N`` examples).
      num_workers: ``p >= 1``, at most ``N``.
      key: PRNG key for the permutation.
    Returns:
      list of ``p`` :class:`Dataset` shards.
    """
    num_workers = check_int(num_workers, "num_workers", 1)
    shards = _iid_index_shards(dataset.check().num_examples, num_workers, key)
    return [dataset.take(idx) for idx in shards]


def split_by_label(
    dataset: Dataset,
    num_workers: int,
    labels_per_worker: int,
    key: Any | None = None,
) -> list[Dataset]:
    """Non-i.i.d. split: each worker sees only ``labels_per_worker`` classes.

    Worker ``w`` holds the classes ``{(w * k + j) mod C : 0 <= j < k}`` with
    ``k = labels_per_worker`` and ``C = num_classes``; the examples of class ``c`` are dealt in
    near-equal parts to the workers holding ``c``. This is a partition: every example goes to
    exactly one worker (hence ``num_workers * labels_per_worker >= num_classes`` is required).

    Args:
      dataset: the :class:`Dataset` to split.
      num_workers: ``p >= 1``.
      labels_per_worker: ``k`` in ``1 .. num_classes``.
      key: optional PRNG key; shuffles each class's examples before dealing. ``None`` keeps
        the dataset order (deterministic without a key).
    Returns:
      list of ``p`` :class:`Dataset` shards.
    Raises:
      ValueError: ``labels_per_worker`` outside ``1..num_classes``, or
        ``num_workers * labels_per_worker < num_classes`` (some classes would be dropped).
    """
    num_workers = check_int(num_workers, "num_workers", 1)
    labels_per_worker = check_int(labels_per_worker, "labels_per_worker", 1)
    c = int(dataset.check().num_classes)
    if labels_per_worker > c:
        raise ValueError(f"labels_per_worker must be <= num_classes ({c}); got {labels_per_worker}")
    if num_workers * labels_per_worker < c:
        raise ValueError(
            f"num_workers * labels_per_worker = {num_workers * labels_per_worker} < num_classes = {c}: "
            "some classes would belong to no worker; raise labels_per_worker"
        )
    holders: list[list[int]] = [[] for _ in range(c)]
    for w in range(num_workers):
        for j in range(labels_per_worker):
            holders[(w * labels_per_worker + j) % c].append(w)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_workers)]
    labels = np.asarray(dataset.labels)
    for cls in range(c):
        idx = np.flatnonzero(labels == cls)
        if key is not None:
            idx = idx[_permutation(key, idx.size, (1, cls))]
        for w, chunk in zip(holders[cls], np.array_split(idx, len(holders[cls]))):
            parts[w].append(chunk)
    return [dataset.take(np.concatenate(p).astype(np.int64)) for p in parts]


def _as_tree(shard, w: int = 0) -> Any:
    if isinstance(shard, Dataset):
        shard.check(f"shard {w}")
        return Batch(np.asarray(shard.images), np.asarray(shard.labels))
    return shard


class WorkerBatches:
    """Resumable epoch iterator yielding per-worker batches ``(num_workers, per_worker_batch, ...)``.

    ``batch_size`` is the global batch; each of the ``p = len(shards)`` workers gets
    ``batch_size / p`` examples of its own shard per step. An epoch is
    ``steps_per_epoch = min_w len(shard_w) // (batch_size / p)`` steps (the tail of each
    shuffled shard is dropped, so every step has full, static shapes). Iteration never stops
    by itself: it rolls over into the next epoch with a fresh permutation.

    Example::

        it = WorkerBatches(split_iid(train, 8, k1), batch_size=256, key=k2)
        batch = next(it)            # Batch(images [8, 32, 28, 28, 1], labels [8, 32])
        saved = it.position         # BatchPosition(epoch=0, index=1): checkpoint this
        it2 = WorkerBatches(shards, 256, k2, start=saved)   # continues bit-identically

    Args:
      shards: one per worker; each a :class:`Dataset` (yielding :class:`Batch`) or any pytree
        of arrays with a common leading example axis (yielding the same pytree, batched).
      batch_size: global batch size, divisible by ``len(shards)``.
      key: PRNG key of the shuffling.
      shuffle: ``False`` reads every shard in order (the same order each epoch).
      start: position of the first batch to yield.
      worker_axis: ``False`` (only with one shard) drops the leading worker axis.
    Raises:
      ValueError: ``batch_size`` not divisible by the number of workers, a shard smaller than
        the per-worker batch, or a ``start`` outside the epoch.
    """

    def __init__(
        self,
        shards: Sequence[Any],
        batch_size: int,
        key,
        *,
        shuffle: bool = True,
        start: BatchPosition = BatchPosition(0, 0),
        worker_axis: bool = True,
    ):
        if len(shards) == 0:
            raise ValueError("shards must hold at least one worker's data")
        self.num_workers = len(shards)
        batch_size = check_int(batch_size, "batch_size", 1)
        if batch_size % self.num_workers:
            raise ValueError(
                f"batch_size={batch_size} is not divisible by the number of workers ({self.num_workers}); "
                "the global batch is split evenly across workers"
            )
        if not worker_axis and self.num_workers != 1:
            raise ValueError(f"worker_axis=False needs exactly one shard; got {self.num_workers}")
        self.batch_size = batch_size
        self.per_worker_batch = batch_size // self.num_workers
        if shuffle:
            _key_words(key)  # fail early on a bad key
        self.key = key
        self.shuffle = bool(shuffle)
        self.worker_axis = bool(worker_axis)
        self._trees = [_as_tree(s, w) for w, s in enumerate(shards)]
        self._sizes = []
        for w, tree in enumerate(self._trees):
            leaves = jax.tree.leaves(tree)
            if not leaves:
                raise ValueError(f"shard {w} holds no arrays")
            n = {int(np.shape(x)[0]) for x in leaves}
            if len(n) != 1:
                raise ValueError(f"shard {w}: arrays disagree on the number of examples: {sorted(n)}")
            self._sizes.append(n.pop())
        self.steps_per_epoch = min(self._sizes) // self.per_worker_batch
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"batch_size={batch_size} gives {self.per_worker_batch} examples per worker, more than the "
                f"smallest shard ({min(self._sizes)} examples)"
            )
        self._order_epoch: int | None = None
        self._order: list[np.ndarray] = []
        self.position = self._check_position(start)

    def _check_position(self, position) -> BatchPosition:
        epoch, index = (int(v) for v in position)
        if epoch < 0 or not 0 <= index < self.steps_per_epoch:
            raise ValueError(
                f"start/position {tuple(position)} outside the iteration: need epoch >= 0 and "
                f"0 <= index < steps_per_epoch = {self.steps_per_epoch}"
            )
        return BatchPosition(epoch, index)

    def epoch_order(self, epoch: int) -> list[np.ndarray]:
        """Per-worker example order of ``epoch``: worker ``w`` reads ``shard_w[order[w]]``."""
        if self._order_epoch != epoch:
            if self.shuffle:
                self._order = [_permutation(self.key, n, (2, epoch, w)) for w, n in enumerate(self._sizes)]
            else:
                self._order = [np.arange(n) for n in self._sizes]
            self._order_epoch = epoch
        return self._order

    def batch_at(self, position) -> Any:
        """The batch at ``position`` (a pure function of key, shards and position)."""
        epoch, index = self._check_position(position)
        order = self.epoch_order(epoch)
        b = self.per_worker_batch
        picks = [order[w][index * b : (index + 1) * b] for w in range(self.num_workers)]
        per_worker = [jax.tree.map(lambda x, i=i: np.asarray(x)[i], tree) for tree, i in zip(self._trees, picks)]
        if not self.worker_axis:
            return per_worker[0]
        return jax.tree.map(lambda *xs: np.stack(xs), *per_worker)

    def __iter__(self) -> WorkerBatches:
        return self

    def __next__(self) -> Any:
        batch = self.batch_at(self.position)
        epoch, index = self.position
        index += 1
        if index == self.steps_per_epoch:
            epoch, index = epoch + 1, 0
        self.position = BatchPosition(epoch, index)
        return batch

    def seek(self, position) -> None:
        """Move to ``position`` (e.g. one restored from a checkpoint)."""
        self.position = self._check_position(position)
