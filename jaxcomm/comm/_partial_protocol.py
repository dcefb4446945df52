"""The partial allreduce's wire and records: message tags and layouts, the majority initiator's hash,
the binomial activation tree, and the errors and results both threads of
:class:`~jaxcomm.comm.PartialAllreduce` share. Also the host-side MPI helpers it shares with the
MPI watchdog and the one-sided exchange: mpi4py imported on first use, the odd ranks out, a ``with``
block's close-or-abort and the job abort.

NumPy and mpi4py only (mpi4py imported on first use), like every module of the partial allreduce,
so that MPI worker scripts can load them without JAX.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

_MPI: Any = None  # the mpi4py.MPI module once _import_mpi() ran


def _import_mpi():
    """The ``mpi4py.MPI`` module, imported on first use: importing it initialises MPI, which
    importing jaxcomm must not do."""
    global _MPI
    if _MPI is None:
        try:
            from mpi4py import MPI
        except ImportError as e:  # pragma: no cover - depends on the install
            raise ImportError("PartialAllreduce needs mpi4py (pip install 'jaxcomm[mpi]')") from e
        _MPI = MPI
    return _MPI


PARTIAL_MODES = ("solo", "majority", "sync")

# Tags on the dedicated communicator.
_TAG_ACT = 11
_TAG_PING = 12
_TAG_PONG = 13
_TAG_PRE = 14
_TAG_POST = 15
_TAG_VERDICT = 16
_TAG_RD = 32  # + stage
# Tag of the construction handshake on the caller's communicator.
_TAG_HELLO = 30011

_MASK64 = (1 << 64) - 1
# Liveness state a progress thread reports to a probe (int64 each).
_ST_RANK, _ST_CALLS, _ST_SNAP, _ST_DONE, _ST_CLOSING, _ST_FAILED, _ST_IN_CALL, _ST_IDLE_MS = range(8)
_ST_LEN = 8
# Verdict message: int64 header [reporter, round, n_culprits, detail_bytes], int64 culprits[P], detail.
_VERDICT_DETAIL = 2048


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def majority_initiator(seed: int, round_index: int, size: int) -> int:
    """The rank that initiates majority round ``round_index`` (same on every process).

    A counter-based hash (SplitMix64 of ``(seed, round)``), uniform over
    ``[0, size)``: the "same seed for all the processes" of Sec. 4.2, without
    any shared generator state.
    """
    if size < 1:
        raise ValueError(f"size must be >= 1; got {size}")
    h = _splitmix64((_splitmix64(int(seed) & _MASK64) ^ (int(round_index) & _MASK64)) & _MASK64)
    return int(h % size)


class PartialCollectiveError(RuntimeError):
    """A partial collective failed (protocol error, use after failure or close)."""


class PartialCollectiveTimeout(TimeoutError):
    """A partial collective waited longer than its timeout for other processes.

    Attributes:
      rank: the process that timed out.
      round: the round it was in (-1: the construction handshake).
      missing_ranks: the ranks identified as the cause: processes that did not
        answer a liveness probe (dead), processes whose progress thread answers
        but whose application has not called the collective for longer than the
        timeout (hung), or, where the round needs them, processes alive but not
        arrived (a majority initiator; anyone, for a synchronous round;
        never-constructed peers in the handshake); for a call-count mismatch, the
        ranks whose number of calls differs from the most common one.
      detail: human-readable explanation.
    """

    def __init__(self, rank: int, round_index: int, missing_ranks: Sequence[int], detail: str):
        self.rank = int(rank)
        self.round = int(round_index)
        self.missing_ranks = tuple(sorted(int(r) for r in missing_ranks))
        self.detail = detail
        where = "construction" if round_index < 0 else f"round {round_index}"
        super().__init__(
            f"partial allreduce timed out on rank {self.rank} ({where}); missing ranks {list(self.missing_ranks)}: "
            f"{detail}"
        )


class PartialResult(NamedTuple):
    """The outcome of one partial allreduce call.

    Attributes:
      data: the sum of all contributions of the round (same shape/dtype as the
        input; identical on every process). eager-SGD divides it by ``P``.
      included: whether this call's data is in ``data`` (Lemma 6.1's bit).
      nap: number of active processes: fresh contributions in ``data``.
      contributors: ``bool[P]``, whose fresh data is in ``data``.
      round: the round index (= the number of earlier calls).
    """

    data: np.ndarray
    included: bool
    nap: int
    contributors: np.ndarray
    round: int


def _odd_ones(counts: dict) -> list:
    """Ranks whose value differs from the most common one (ties: the larger value wins)."""
    values = list(counts.values())
    common = max(set(values), key=lambda v: (values.count(v), v))
    return sorted(q for q, v in counts.items() if v != common)


def _close_or_abort(close: Callable[[], object], faults, fault_exit: Callable[[BaseException], None]) -> None:
    """A ``with`` block's clean exit from an MPI object: ``close()``; a fault it raises (an instance
    of ``faults``, a class or a tuple of them) goes to ``fault_exit`` (which may end the job, see
    :func:`_abort_job`) and then on to the caller."""
    try:
        close()
    except faults as e:
        fault_exit(e)
        raise


def _abort_job(comm, rank: int, err: BaseException, *, where: str = "", code: int = 1) -> None:
    """End the MPI job on a fault (an object's ``abort_on_fault``): ``err`` on stderr, then
    ``comm.Abort(code)``. A hung peer never reaches ``MPI_Finalize``, which would otherwise block this
    process forever. The line reads ``jaxcomm: rank R: <type><where>: <err>; aborting the job``."""
    sys.stderr.write(f"jaxcomm: rank {rank}: {type(err).__name__}{where}: {err}; aborting the job\n")
    sys.stderr.flush()
    comm.Abort(code)


def _children(rank: int, root: int, size: int) -> list:
    """Children of ``rank`` in the binomial tree rooted at ``root`` (relative ranks)."""
    rel = (rank - root) % size
    out = []
    bit = 1
    while bit <= rel:
        bit <<= 1
    # rel's children are rel + 2^j for 2^j > rel (rel == 0: every power of two).
    while rel + bit < size:
        out.append((rel + bit + root) % size)
        bit <<= 1
    return out
