"""What the link carried: the kernel's counters of a qdisc, and a function's bytes between barriers.

:func:`link_counters` reads a root qdisc's counters (``tc -s -j qdisc show``); :func:`measure_window`
(an MPI job) and :func:`cluster_window` (a ``jax.distributed`` job) read them around one function on
every rank, and :func:`measure` subtracts a window of the barriers alone, measuring again while TCP
retransmitted. :func:`ring_allreduce_bytes` and :func:`all_gather_bytes` are the payloads the
collectives must send.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from ._link import HEADER_BYTES, NetemUnavailable


@dataclass(frozen=True)
class LinkCounters:
    """A root qdisc's counters: what the kernel sent through the link since the qdisc was made.

    Attributes:
      bytes: bytes sent (whole packets, Ethernet header included).
      packets: packets sent (a TCP segmentation-offload packet counts once).
      drops: packets dropped (a drop is retransmitted, so nonzero means bytes include resends).
      kind: the qdisc (``tbf``, ``netem``, ``pfifo``; ``noqueue`` when none counts).
    """

    bytes: int
    packets: int
    drops: int
    kind: str

    def __sub__(self, other: LinkCounters) -> LinkCounters:
        return LinkCounters(
            self.bytes - other.bytes,
            self.packets - other.packets,
            self.drops - other.drops,
            self.kind,
        )


_TEXT_QDISC = re.compile(r"^qdisc\s+(\S+)\s+\S+\s+(.*)$")
_TEXT_SENT = re.compile(r"Sent\s+(\d+)\s+bytes\s+(\d+)\s+pkt\s+\(dropped\s+(\d+)")


def parse_qdisc_stats(output: str) -> LinkCounters:
    """The root qdisc's counters from ``tc -s -j qdisc show`` (JSON) or ``tc -s qdisc show`` (text).

    Raises:
      ValueError: if ``output`` has no root qdisc with statistics.
    """
    text = output.strip()
    if text.startswith("["):
        for q in json.loads(text):
            if q.get("root"):
                return LinkCounters(
                    int(q.get("bytes", 0)),
                    int(q.get("packets", 0)),
                    int(q.get("drops", 0)),
                    q["kind"],
                )
        raise ValueError(f"no root qdisc in tc's JSON output: {text[:200]!r}")
    kind = None
    for line in text.splitlines():
        head = _TEXT_QDISC.match(line.strip())
        if head:
            kind = head.group(1) if " root " in f" {head.group(2)} " else None
            continue
        sent = _TEXT_SENT.search(line)
        if sent and kind is not None:
            return LinkCounters(int(sent.group(1)), int(sent.group(2)), int(sent.group(3)), kind)
    raise ValueError(f"no root qdisc statistics in tc's output: {text[:200]!r}")


def link_counters(dev: str = "lo") -> LinkCounters:
    """The counters of ``dev``'s root qdisc in **this process's** network namespace.

    Inside a :func:`launch` job, ``dev="lo"`` is the emulated link, and any rank may
    call this (rank 0 around a step, between barriers, gives the step's bytes).
    Runs ``tc -s -j qdisc show dev DEV`` (text output if tc has no JSON).

    Raises:
      NetemUnavailable: if ``tc`` is missing or fails.
    """
    tc = shutil.which("tc")
    if tc is None:
        raise NetemUnavailable("link_counters needs the 'tc' command of iproute2 on PATH")
    last = None
    for args in (
        [tc, "-s", "-j", "qdisc", "show", "dev", dev],
        [tc, "-s", "qdisc", "show", "dev", dev],
    ):
        proc = subprocess.run(args, capture_output=True, text=True, timeout=30, check=False)
        if proc.returncode == 0 and proc.stdout.strip():
            try:
                return parse_qdisc_stats(proc.stdout)
            except ValueError as e:
                last = str(e)
        else:
            last = proc.stderr.strip()
    raise NetemUnavailable(f"could not read the qdisc counters of {dev!r}: {last}")


def link_bytes(dev: str = "lo") -> int:
    """Bytes sent through ``dev``'s root qdisc so far (:func:`link_counters` ``.bytes``)."""
    return link_counters(dev).bytes


def tcp_retransmissions() -> int:
    """Segments TCP retransmitted in this process's network namespace (``RetransSegs`` of
    ``/proc/net/snmp``). A retransmitted segment (a tail loss probe after a delayed ACK, say)
    crosses the link twice, so a window in which this grew counts some payload twice."""
    with open("/proc/net/snmp") as f:
        rows = [line.split() for line in f if line.startswith("Tcp:")]
    return int(rows[1][rows[0].index("RetransSegs")])


@dataclass(frozen=True)
class Window:
    """What the link carried while one function ran on every rank (:func:`measure_window`).

    Attributes:
      bytes, packets, drops, qdisc: the root qdisc's counters over the window (:class:`LinkCounters`).
      wall_s: seconds from the barrier before the function to the barrier after it.
      retransmitted: TCP segments retransmitted in the window (:func:`tcp_retransmissions`).
    """

    bytes: int
    packets: int
    drops: int
    qdisc: str
    wall_s: float
    retransmitted: int

    @property
    def payload_bytes(self) -> int:
        """TCP payload of the window: ``bytes − HEADER_BYTES · packets``."""
        return self.bytes - HEADER_BYTES * self.packets


def measure_window(run: Callable[[], Any], world, root: int = 0) -> Window | None:
    """Run ``run()`` on every rank between barriers; rank ``root`` reads the link's counters around it.

    ``world`` is an ``mpi4py`` communicator (every rank calls this). Barrier, counters, barrier,
    ``run()``, barrier, counters: no rank's traffic of before or after falls inside, but the
    last two barriers do (measure a window with ``run = lambda: None`` and subtract it, as
    :func:`measure` does).

    Returns:
      the :class:`Window` on rank ``root``, ``None`` on the others.
    """
    me = world.Get_rank()
    world.Barrier()
    c0 = link_counters() if me == root else None
    x0 = tcp_retransmissions() if me == root else 0
    world.Barrier()
    t0 = time.perf_counter()
    run()
    world.Barrier()
    wall = time.perf_counter() - t0
    if me != root or c0 is None:
        return None
    c = link_counters() - c0
    return Window(c.bytes, c.packets, c.drops, c.kind, wall, tcp_retransmissions() - x0)


@dataclass(frozen=True)
class Measured:
    """A function's bytes on the link, barriers subtracted (:func:`measure`).

    Attributes:
      window: the window with the function (:func:`measure_window`).
      barriers: a window with the barriers alone, just before.
      retried: earlier ``(barriers, window)`` pairs dropped because TCP retransmitted in them.
    """

    window: Window
    barriers: Window
    retried: list

    @property
    def payload_bytes(self) -> int:
        """The function's TCP payload: ``window.payload_bytes − barriers.payload_bytes``."""
        return self.window.payload_bytes - self.barriers.payload_bytes

    def to_json(self) -> dict:
        """``{"window", "barriers", "retried", "payload_bytes"}`` with the windows as dicts."""
        return {
            "window": asdict(self.window),
            "barriers": asdict(self.barriers),
            "retried": [{"barriers": asdict(b), "window": asdict(w)} for b, w in self.retried],
            "payload_bytes": self.payload_bytes,
        }


def cluster_window(run: Callable[[], Any]) -> Window:
    """:func:`measure_window` for a ``jax.distributed`` job of :func:`launch` (``devices_per_process``):
    every process calls it; each reads its node's ``eth0`` counters (the bytes its node sent into
    the switch) around ``run()`` between barriers (``sync_global_devices``), and the counts of all
    nodes are summed (``process_allgather``). The barriers after the first reading fall inside the
    window, as with :func:`measure_window`.

    Returns:
      the :class:`Window` of all nodes together, on every process (``wall_s`` this process's).
    """
    import numpy as np
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices("jaxcomm.netem.cluster_window:start")
    c0, x0 = link_counters("eth0"), tcp_retransmissions()
    multihost_utils.sync_global_devices("jaxcomm.netem.cluster_window:run")
    t0 = time.perf_counter()
    run()
    multihost_utils.sync_global_devices("jaxcomm.netem.cluster_window:end")
    wall = time.perf_counter() - t0
    c, x = link_counters("eth0") - c0, tcp_retransmissions() - x0
    mine = np.asarray([c.bytes, c.packets, c.drops, x], np.int64)
    total = np.asarray(multihost_utils.process_allgather(mine), np.int64).reshape(-1, 4).sum(axis=0)
    return Window(int(total[0]), int(total[1]), int(total[2]), c.kind, wall, int(total[3]))


def measure(run: Callable[[], Any], world=None, *, tries: int = 5, root: int = 0) -> Measured | None:
    """The bytes ``run()`` puts on the link: a barriers-only window, then a window with ``run()``.

    Measured again, up to ``tries`` times in all, while TCP retransmitted a segment in either
    window (such a segment crosses the link twice); each try calls ``run()`` once. Every rank
    calls this with the same arguments.

    Args:
      run: the function measured (it must run the same collectives on every rank).
      world: an ``mpi4py`` communicator (an MPI job: :func:`measure_window`), or ``None`` in a
        ``jax.distributed`` job of :func:`launch` with ``devices_per_process`` (:func:`cluster_window`:
        the bytes sent between the nodes).
      tries: the most windows measured; root: the rank that reads the link (MPI only).

    Returns:
      the :class:`Measured` on rank ``root`` (on every process without ``world``; its
      ``window.retransmitted`` is 0 unless every try had a retransmission), ``None`` on the others.
    """
    retried: list = []
    base: Window | None
    meas: Window | None
    for attempt in range(tries):
        if world is None:  # every process holds the same sums: all decide alike
            barriers, window = cluster_window(lambda: None), cluster_window(run)
            again = barriers.retransmitted > 0 or window.retransmitted > 0
            base, meas, mine = barriers, window, True
        else:
            base = measure_window(lambda: None, world, root)
            meas = measure_window(run, world, root)
            again = world.bcast(
                base is not None and meas is not None and (base.retransmitted > 0 or meas.retransmitted > 0),
                root=root,
            )
            mine = world.Get_rank() == root
        if mine and base is not None and meas is not None:
            if not again or attempt == tries - 1:
                return Measured(meas, base, retried)
            retried.append((base, meas))
        if not again:
            break
    return None


def ring_allreduce_bytes(n: int, payload_bytes: int) -> int:
    """Payload bytes a ring all-reduce of ``P`` bytes per worker sends, summed over ``n`` workers.

    Reduce-scatter then all-gather, each ``n - 1`` steps of one ``P / n`` chunk per worker:
    ``n * 2 (n - 1) P / n = 2 (n - 1) P``.
    """
    return 2 * (n - 1) * payload_bytes


def all_gather_bytes(n: int, payload_bytes: int) -> int:
    """Payload bytes an all-gather of ``P`` bytes per worker sends, summed over workers: ``n (n - 1) P``.

    Every worker must receive the ``n - 1`` other blocks, whatever the algorithm (ring,
    recursive doubling, Bruck), and each received byte crossed the link once.
    """
    return n * (n - 1) * payload_bytes
