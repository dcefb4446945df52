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

from ._idx import DatasetError, read_csv_images, read_idx, write_idx
from ._sources import (
    Dataset,
    load_digits,
    load_fashion_mnist,
    load_mnist,
    load_mnist5k,
    standardize,
)
from ._split import WorkerBatches, split_by_label, split_iid
from ._text import CharCorpus, load_shakespeare

__all__ = [
    "Dataset",
    "DatasetError",
    "load_digits",
    "load_mnist",
    "load_fashion_mnist",
    "load_mnist5k",
    "load_shakespeare",
    "CharCorpus",
    "read_idx",
    "write_idx",
    "read_csv_images",
    "standardize",
    "split_iid",
    "split_by_label",
    "WorkerBatches",
]
