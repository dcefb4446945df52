"""Checks of output paths, made before any work starts (the command line's ``--out``, ``--report``)."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

__all__ = ["check_output_path"]


def _exists(path: Path, option: str) -> bool:
    try:
        return path.exists() or path.is_symlink()
    except OSError as e:  # a name too long, or a parent folder that may not be searched
        if e.errno == errno.ENAMETOOLONG:
            longest = max(len(os.fsencode(part)) for part in path.parts)
            raise ValueError(
                f"{option}: a name (the longest of {longest} bytes) or the whole path "
                f"({len(os.fsencode(str(path)))} bytes) is longer than the file system allows"
            ) from None
        raise ValueError(f"{option}: cannot look at {str(path)!r}: {e.strerror}") from None


def check_output_path(path: str | os.PathLike, option: str, *, folder: bool) -> Path:
    """``path`` as an absolute :class:`~pathlib.Path`, once it is known that it can be written.

    ``folder=True``: ``path`` is an output folder, created later with its missing parents (or an
    existing folder, reused). ``folder=False``: ``path`` is a file, written later into its
    existing parent folder (an existing file is replaced). Writability is tried by making and
    removing a temporary folder in the nearest existing folder, so that read-only file systems,
    permissions and pseudo file systems such as ``/proc`` (where even root cannot create
    anything) are all caught; nothing else is created, and nothing stays.

    Raises:
      ValueError: naming ``option``: an empty path or one with a NUL byte; a name longer than the
        file system allows; an existing file where a folder is wanted, or a folder where a file
        is; a file where a parent folder should be; a missing parent folder of a file; a folder
        that cannot be written.
    """
    text = os.fspath(path)
    if not isinstance(text, str) or not text or "\0" in text:
        raise ValueError(f"{option}: give a path (non-empty, without NUL bytes); got {text!r}")
    p = Path(os.path.abspath(text))
    anchor = p
    while not _exists(anchor, option):
        anchor = anchor.parent
    if anchor == p:
        if folder and not p.is_dir():
            raise ValueError(f"{option}: {text!r} exists and is not a folder")
        if not folder and p.is_dir():
            raise ValueError(f"{option}: {text!r} is a folder; give a file name")
        probe = p if folder else p.parent
    else:
        if not anchor.is_dir():
            raise ValueError(f"{option}: {str(anchor)!r} is a file, so {text!r} cannot be made under it")
        if not folder and anchor != p.parent:
            raise ValueError(f"{option}: the folder {str(p.parent)!r} does not exist")
        probe = anchor
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".jaxcomm-write-check-", dir=probe))
    except OSError as e:
        raise ValueError(f"{option}: cannot write in {str(probe)!r}: {e.strerror}") from None
    return p
