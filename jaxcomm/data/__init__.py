"""Offline datasets, worker splits and resumable per-worker batching.

Nothing here downloads: loaders read standard formats (IDX, CSV, text) from a path, by
default under :func:`data_dir` (``$JAXCOMM_DATA`` or ``~/.cache/jaxcomm``), which the set-up
step ``python -m jaxcomm.data.fetch`` fills. CIFAR-10 cannot be had offline: Fashion-MNIST
with :class:`jaxcomm.models.ResNet20` is the project's CIFAR-class workload.

>>> import jax, jaxcomm.data as jd
>>> digits = jd.load_digits()
>>> digits.images.shape, digits.num_classes
((1797, 8, 8, 1), 10)
>>> shards = jd.split_iid(digits, num_workers=4, key=jax.random.key(0))
>>> it = jd.WorkerBatches(shards, batch_size=64, key=jax.random.key(1))
>>> next(it).images.shape, it.position
((4, 16, 8, 8, 1), BatchPosition(epoch=0, index=1))
"""

from ._idx import DatasetError, open_maybe_gzip, read_csv_images, read_idx, write_idx
from ._sources import (
    Dataset,
    data_dir,
    load_digits,
    load_fashion_mnist,
    load_mnist,
    load_mnist5k,
    standardize,
)
from ._split import Batch, BatchPosition, WorkerBatches, split_by_label, split_iid
from ._text import CharCorpus, load_shakespeare, strip_play_markdown

__all__ = [
    "Batch",
    "BatchPosition",
    "CharCorpus",
    "Dataset",
    "DatasetError",
    "WorkerBatches",
    "data_dir",
    "load_digits",
    "load_fashion_mnist",
    "load_mnist",
    "load_mnist5k",
    "load_shakespeare",
    "open_maybe_gzip",
    "read_csv_images",
    "read_idx",
    "split_by_label",
    "split_iid",
    "standardize",
    "strip_play_markdown",
    "write_idx",
]
