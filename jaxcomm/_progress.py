"""Progress bars that read well in a terminal and in a log file.

tqdm redraws its line with carriage returns; a log file (a CI job, ``nohup``, ``mpirun``'s
forwarded output) keeps every redraw on one very long line. Where the stream is not a terminal
(and not a notebook, where tqdm draws a widget), :func:`progress_bar` writes one plain line per
update instead, at most one every ``log_interval_s`` seconds.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any, TextIO

__all__ = ["progress_bar"]


class _Lines:
    """A file for tqdm that turns its carriage-return redraws into newline-terminated lines."""

    def __init__(self, stream: TextIO):
        self._stream = stream

    def write(self, text: str) -> None:
        line = text.replace("\r", "").rstrip()  # tqdm writes "\r" + status (+ padding), or blanks to clear
        if line:
            self._stream.write(line + "\n")

    def flush(self) -> None:
        self._stream.flush()


def progress_bar(
    iterable: Iterable | None = None,
    *,
    total: int | None = None,
    desc: str | None = None,
    unit: str = "it",
    initial: int = 0,
    disable: bool = False,
    leave: bool = False,
    stream: TextIO | None = None,
    log_interval_s: float = 30.0,
) -> Any:
    """A tqdm bar over ``iterable`` (or ``total`` updates) on ``stream`` (default: stderr).

    On a terminal or in a notebook: tqdm's own bar. Otherwise: a line per update, newline
    terminated, at most one per ``log_interval_s`` seconds (and the last one when the bar closes
    with ``leave=True``).
    """
    from tqdm.auto import tqdm

    stream = sys.stderr if stream is None else stream
    kwargs: dict[str, Any] = {"total": total, "desc": desc, "unit": unit, "initial": initial, "disable": disable}
    isatty = getattr(stream, "isatty", None)
    if (callable(isatty) and isatty()) or "ipykernel" in sys.modules:
        return tqdm(iterable, file=stream, leave=leave, **kwargs)
    return tqdm(iterable, file=_Lines(stream), leave=leave, mininterval=log_interval_s, ncols=100, **kwargs)
