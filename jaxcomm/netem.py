"""Network emulation: MPI jobs on a throttled private link, and the bytes the kernel sent.

:func:`launch` runs ``mpirun -n N CMD...`` inside a private network namespace
(``unshare(CLONE_NEWNET)``) whose only interface is its own loopback ``lo``.
Open MPI is restricted to its TCP transport (``OMPI_MCA_btl=self,tcp``: no
shared memory), so every byte one rank sends another crosses ``lo`` once, as
a TCP/IPv4 packet, through the root queueing discipline (qdisc) installed on
``lo``:

==========================  ==================================================
settings                    root qdisc on ``lo``
==========================  ==================================================
bandwidth and latency unset ``pfifo`` (counts, never delays)
bandwidth ``R``             ``tbf rate R burst B latency 400ms`` (token bucket)
latency ``L``               ``netem delay L`` (needs the kernel's ``sch_netem``)
both                        ``netem delay L`` with a ``tbf`` child
==========================  ==================================================

All ranks share that one qdisc: the emulated network is a **shared link** of
``R`` bit/s in total (not ``R`` per rank). A packet waits ``L`` once, so a TCP
round trip (data, then its ACK) takes at least ``2 L``.

The qdisc's counters are the kernel's count of what was sent:
:func:`link_counters` (``tc -s -j qdisc show dev lo``) can be read from inside
an MPI rank, and :func:`launch` reports the job's total. A payload of ``P``
bytes sent from one rank to another costs ``P`` bytes of TCP payload plus, per
IPv4 packet, ``14 + 20 + 32 = 66`` bytes of Ethernet, IPv4 and TCP headers
(with the timestamp option) -- :data:`HEADER_BYTES` -- plus Open MPI's own
fragment headers and the receivers' ACK packets (66 bytes each).

**A cluster of nodes** (``launch(n, command, devices_per_process=K)``, ``jaxcomm launch --jax``):
``n`` processes of ``command`` under ``jax.distributed`` (gloo collectives over TCP), ``K`` CPU
devices each, one per emulated *node*. Each node is a network namespace of its own (and a UTS
namespace whose host name is the node's address, the address gloo binds to):

* traffic between two devices of one node (one process) goes through that node's own loopback:
  in memory, neither shaped nor counted;
* traffic between nodes leaves through the node's ``eth0``, one end of a virtual Ethernet pair
  whose other end is a port of a bridge (the switch) in the launcher's private namespace. The
  root qdisc of every node's ``eth0`` is the table's, so every node sends into the switch at
  ``R`` bit/s (a full-duplex link per node to a non-blocking switch: the ``"switched"``
  topology of :mod:`jaxcomm.cost_model`), and its counters are the node's bytes sent.

The nodes' addresses are :data:`CLUSTER_SUBNET` ``.1`` to ``.n`` (TEST-NET-1 of RFC 5737,
which no real network uses), on interfaces that exist only inside the job's namespaces; the
coordinator of ``jax.distributed`` listens on node 0 (:data:`COORDINATOR_PORT`). Each process
finds in its environment ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``,
``XLA_FLAGS`` with ``--xla_force_host_platform_device_count=K``, ``JAX_PLATFORMS=cpu`` and
``JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo``; :func:`initialize_distributed` starts
``jax.distributed`` from them, and :func:`measure` (without ``world``) counts what a function
sends between the nodes. :func:`launch` reports the sum of the nodes' counters.

The namespaces exist only as long as the processes in them: :func:`launch`
ends every one of them on every exit path (normal exit, timeout, ``Ctrl-C``).
Only the namespaces' own interfaces are ever configured or used.

Needs: root, or the ``CAP_SYS_ADMIN`` and ``CAP_NET_ADMIN`` capabilities, and
the ``tc`` and ``ip`` tools of iproute2 (:func:`missing_requirements`).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "CLUSTER_SUBNET",
    "COORDINATOR_PORT",
    "HEADER_BYTES",
    "LOOPBACK_MTU",
    "LaunchResult",
    "LinkCounters",
    "LinkSettings",
    "MAX_BURST_BYTES",
    "MAX_DEVICES_PER_PROCESS",
    "MAX_NODES",
    "MAX_PROCESSES",
    "MAX_RATE_BPS",
    "MAX_TIMEOUT_S",
    "Measured",
    "NetemError",
    "NetemUnavailable",
    "RING_COLLECTIVES",
    "all_gather_bytes",
    "cluster_env",
    "cluster_window",
    "initialize_distributed",
    "launch",
    "link_bytes",
    "link_counters",
    "link_settings",
    "measure",
    "measure_window",
    "missing_requirements",
    "mpirun_netem_env",
    "node_address",
    "parse_qdisc_stats",
    "parse_rate",
    "parse_size",
    "parse_time",
    "qdisc_commands",
    "reshape",
    "ring_allreduce_bytes",
    "tcp_retransmissions",
    "unavailable",
    "Window",
]

HEADER_BYTES = 66
"""Bytes of headers per TCP/IPv4 packet on a loopback qdisc: Ethernet 14 + IPv4 20 + TCP 32
(20 plus the 12-byte timestamp option that Linux enables by default)."""

LOOPBACK_MTU = 65536
"""The Linux loopback's default MTU in bytes (IPv4 packet size, Ethernet header excluded)."""

MAX_PROCESSES = 256
"""The most MPI processes :func:`launch` starts (``-n``): all of them share this machine."""
MAX_RATE_BPS = 1e12
"""The fastest link rate accepted, in bits per second (``1tbit``; faster: write ``unlimited``)."""
MAX_BURST_BYTES = 2**30
"""The largest token bucket accepted, in bytes (``1gb``)."""
MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""The longest ``timeout`` of a job accepted, in seconds (7 days)."""
MAX_NODES = 254
"""The most processes (nodes) of a ``jax.distributed`` job (``-n`` with ``--jax``): one address each
in :data:`CLUSTER_SUBNET`."""
MAX_DEVICES_PER_PROCESS = 1024
"""The most CPU devices of one process of a ``jax.distributed`` job (``--devices-per-process``)."""
CLUSTER_SUBNET = "192.0.2"
"""The nodes' addresses, ``192.0.2.1`` (node 0) to ``192.0.2.n``: TEST-NET-1 (RFC 5737), reserved
for documentation, so no real network uses it; it exists only inside the job's namespaces."""
COORDINATOR_PORT = 8476
"""The port of ``jax.distributed``'s coordinator on node 0 (the namespaces are private: always free)."""
_VETH_MTU = 65535  # the largest MTU of a veth device (the loopback's 65536 is one more)
_BRIDGE = "jcswitch"

RING_COLLECTIVES = {
    "OMPI_MCA_coll_tuned_use_dynamic_rules": "1",
    "OMPI_MCA_coll_tuned_allreduce_algorithm": "4",
    "OMPI_MCA_coll_tuned_allgather_algorithm": "4",
}
"""Environment that makes Open MPI's tuned collectives use the ring all-reduce (algorithm 4) and
the ring all-gather (algorithm 4), the algorithms :mod:`jaxcomm.cost_model`'s step formulas
describe (pass it in ``env`` of :func:`launch`)."""

_TBF_QUEUE_LATENCY = "400ms"  # tbf's bound on queueing time (its `latency`), not a delay
_CAP_NET_ADMIN = 12
_CAP_SYS_ADMIN = 21
_CLONE_NEWNET = 0x40000000
_CLONE_NEWUTS = 0x04000000


class NetemError(ValueError):
    """An invalid emulation setting; the message names the option."""


class NetemUnavailable(RuntimeError):
    """This machine or process cannot create the emulated network; the message says what is needed."""


# --------------------------------------------------------------------------- #
# Settings
# --------------------------------------------------------------------------- #
_RATE_UNITS = {
    "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
    "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12,
}  # fmt: skip
_TIME_UNITS = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6}
_SIZE_UNITS = {
    "b": 1,
    "": 1,
    "kb": 1024,
    "k": 1024,
    "mb": 1024**2,
    "m": 1024**2,
    "gb": 1024**3,
}
_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)"


def parse_rate(text: str, option: str = "--bandwidth") -> float | None:
    """A rate in ``tc`` syntax, in **bits per second**; ``None`` for ``unlimited``.

    Units (case-insensitive): ``bit kbit mbit gbit tbit`` (powers of 1000 bits per
    second) and ``bps kbps mbps gbps tbps`` (bytes per second, times 8), as tc reads
    them. ``"200mbit"`` -> ``2e8``; ``"1gbit"`` -> ``1e9``; ``"unlimited"`` -> ``None``.

    Raises:
      NetemError: naming ``option``, for anything else or a rate outside [8bit, 1tbit]
        (:data:`MAX_RATE_BPS`).
    """
    s = str(text).strip().lower()
    if s in ("unlimited", "none", "inf"):
        return None
    m = re.fullmatch(_NUMBER + r"\s*([a-z]+)", s)
    if not m or m.group(2) not in _RATE_UNITS:
        raise NetemError(
            f"{option}: cannot read {text!r} as a rate; write a number and a unit "
            f"({', '.join(_RATE_UNITS)}), e.g. 200mbit or 1gbit, or 'unlimited'"
        )
    rate = float(m.group(1)) * _RATE_UNITS[m.group(2)]
    _check_rate(rate, option, text)
    return rate


def _check_rate(rate: float, option: str, shown) -> None:
    """``NetemError`` unless ``rate`` (bits per second) is in [8, :data:`MAX_RATE_BPS`]."""
    if not 8 <= rate <= MAX_RATE_BPS:  # tc's smallest rate is 1 byte/s; NaN fails too
        raise NetemError(
            f"{option}: the rate must be from 8bit (1 byte per second) to 1tbit ({MAX_RATE_BPS:g} bits per "
            f"second), or unlimited; got {shown!r}"
        )


def parse_time(text: str, option: str = "--latency") -> float:
    """A duration in ``tc`` syntax, in **seconds**: ``"0.1ms"`` -> ``1e-4``; ``"0"`` -> ``0.0``.

    Units: ``s ms us`` (also ``sec msec usec``). A bare number must be ``0``.

    Raises:
      NetemError: naming ``option``, for anything else, a negative time or one over 10 s.
    """
    s = str(text).strip().lower()
    if s in ("0", "0.0", "none"):
        return 0.0
    m = re.fullmatch(_NUMBER + r"\s*([a-z]+)", s)
    if not m or m.group(2) not in _TIME_UNITS:
        raise NetemError(
            f"{option}: cannot read {text!r} as a time; write a number and a unit (s, ms, us), e.g. 0.1ms, or 0"
        )
    seconds = float(m.group(1)) * _TIME_UNITS[m.group(2)]
    if seconds > 10.0:
        raise NetemError(f"{option}: at most 10s per packet; got {text!r}")
    return seconds


def parse_size(text: str, option: str = "--burst") -> int:
    """A size in ``tc`` syntax, in **bytes**: ``"256kb"`` -> ``262144`` (``kb`` = 1024 bytes, ``mb`` = 1024²).

    Raises:
      NetemError: naming ``option``, for anything that is not a size from 0 to 1gb (:data:`MAX_BURST_BYTES`).
    """
    s = str(text).strip().lower()
    m = re.fullmatch(_NUMBER + r"\s*([a-z]*)", s)
    if not m or m.group(2) not in _SIZE_UNITS:
        raise NetemError(f"{option}: cannot read {text!r} as a size; write a number of bytes or kb/mb, e.g. 256kb")
    size = float(m.group(1)) * _SIZE_UNITS[m.group(2)]
    if not size <= MAX_BURST_BYTES:
        raise NetemError(f"{option}: at most 1gb ({MAX_BURST_BYTES} bytes); got {text!r}")
    return round(size)


@dataclass(frozen=True)
class LinkSettings:
    """The emulated link, in base units.

    Attributes:
      bandwidth_bps: the shared link's rate in bits per second (``None``: unlimited).
      latency_s: delay added to every packet, in seconds (``0``: none).
      burst_bytes: the token bucket's size in bytes (how much may go at line speed
        after an idle spell); used only with a bandwidth.
      mtu: the loopback's MTU in bytes (IPv4 packet size); 65536 is Linux's default,
        1500 emulates Ethernet framing.
    """

    bandwidth_bps: float | None = None
    latency_s: float = 0.0
    burst_bytes: int = 256 * 1024
    mtu: int = LOOPBACK_MTU

    def __post_init__(self):
        """Check the settings however they were built (``NetemError`` naming the launcher's option)."""
        bw, lat, b, mtu = self.bandwidth_bps, self.latency_s, self.burst_bytes, self.mtu

        def real(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        if bw is not None:
            if not real(bw):
                raise NetemError(f"--bandwidth: must be a number of bits per second; got {bw!r}")
            _check_rate(bw, "--bandwidth", bw)
        if not real(lat) or not 0.0 <= lat <= 10.0:
            raise NetemError(f"--latency: must be in [0, 10] seconds; got {lat!r}")
        if isinstance(mtu, bool) or not isinstance(mtu, int) or not 68 <= mtu <= LOOPBACK_MTU:
            raise NetemError(f"--mtu: must be an integer from 68 to {LOOPBACK_MTU} bytes; got {mtu!r}")
        if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b <= MAX_BURST_BYTES:
            raise NetemError(f"--burst: must be an integer number of bytes from 0 to {MAX_BURST_BYTES}; got {b!r}")
        if bw is not None and b < mtu + 14:
            raise NetemError(
                f"--burst: the token bucket must hold one packet of mtu + 14 = {mtu + 14} bytes; got {b} bytes"
            )

    def describe(self) -> dict:
        """The settings as JSON-ready numbers (units in the key names)."""
        return asdict(self)


def link_settings(
    bandwidth: str | float | None = "unlimited",
    latency: str | float = "0",
    burst: str | int = "256kb",
    mtu: int = LOOPBACK_MTU,
) -> LinkSettings:
    """Parse and check the launcher's options (strings in tc syntax, or numbers in base units).

    Args:
      bandwidth: ``"200mbit"``, ``"1gbit"``, ``"unlimited"``, or bits per second.
      latency: ``"0.1ms"`` or seconds.
      burst: ``"256kb"`` or bytes; it must hold one full packet, ``mtu + 14`` bytes
        (tbf cannot send a packet larger than its bucket).
      mtu: 68 to 65536 bytes.

    Raises:
      NetemError: naming the option (``--bandwidth``, ``--latency``, ``--burst``, ``--mtu``).
    """
    if bandwidth is None or isinstance(bandwidth, str):
        bw = None if bandwidth is None else parse_rate(bandwidth, "--bandwidth")
    else:
        bw = float(bandwidth)
    lat = parse_time(latency, "--latency") if isinstance(latency, str) else float(latency)
    b = parse_size(burst, "--burst") if isinstance(burst, str) else int(burst)
    return LinkSettings(bandwidth_bps=bw, latency_s=lat, burst_bytes=b, mtu=mtu)  # checked there


def qdisc_commands(settings: LinkSettings, dev: str = "lo") -> list[list[str]]:
    """The ``ip``/``tc`` commands that set up ``dev`` in the namespace (see the module's table)."""
    cmds = [["ip", "link", "set", "dev", dev, "mtu", str(settings.mtu), "up"]]
    tbf = []
    if settings.bandwidth_bps is not None:
        tbf = [
            "tbf", "rate", f"{settings.bandwidth_bps:.0f}bit", "burst", str(settings.burst_bytes),
            "latency", _TBF_QUEUE_LATENCY,
        ]  # fmt: skip
    if settings.latency_s > 0:
        delay = f"{settings.latency_s * 1e6:.3f}us"
        cmds.append(
            [
                "tc",
                "qdisc",
                "add",
                "dev",
                dev,
                "root",
                "handle",
                "1:",
                "netem",
                "delay",
                delay,
                "limit",
                "100000",
            ]
        )
        if settings.bandwidth_bps is not None:
            cmds.append(
                [
                    "tc",
                    "qdisc",
                    "add",
                    "dev",
                    dev,
                    "parent",
                    "1:1",
                    "handle",
                    "10:",
                    *tbf,
                ]
            )
    elif settings.bandwidth_bps is not None:
        cmds.append(["tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf])
    else:
        cmds.append(
            [
                "tc",
                "qdisc",
                "add",
                "dev",
                dev,
                "root",
                "handle",
                "1:",
                "pfifo",
                "limit",
                "100000",
            ]
        )
    return cmds


def reshape(bandwidth: str | float | None, dev: str = "lo", *, burst: str | int = "256kb") -> LinkSettings:
    """Give ``dev`` in this process's network namespace the launcher's qdisc for ``bandwidth``.

    For a job inside :func:`launch` that measures several link rates in one run (one
    compilation, several links): the root qdisc is deleted and made anew by
    :func:`qdisc_commands` (the device's MTU kept; no added latency). A new qdisc counts from
    zero, so read :func:`link_counters` before and after a window within one shape; the
    launcher's own count around the job (``LaunchResult.bytes``) then covers only the last shape.

    Raises:
      NetemError: a bad ``bandwidth`` or ``burst`` (before anything changes).
      NetemUnavailable: ``tc`` failed (e.g. without CAP_NET_ADMIN in the namespace).
    """
    mtu = int(Path(f"/sys/class/net/{dev}/mtu").read_text())
    settings = link_settings(bandwidth, "0", burst, mtu)
    subprocess.run(["tc", "qdisc", "del", "dev", dev, "root"], capture_output=True, check=False, timeout=60)
    for cmd in qdisc_commands(settings, dev)[1:]:  # [0] sets the device up: it is up already
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=60)
        if proc.returncode != 0:
            raise NetemUnavailable(f"{' '.join(cmd)}: {proc.stderr.strip()}")
    return settings


# --------------------------------------------------------------------------- #
# Requirements
# --------------------------------------------------------------------------- #
def _effective_capabilities() -> int:
    """This process's effective capability mask (``CapEff`` in /proc/self/status); 0 if unreadable."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


def missing_requirements(
    capabilities: int | None = None,
    which: Callable[[str], str | None] = shutil.which,
    platform: str = sys.platform,
) -> list[str]:
    """What this process lacks to run :func:`launch`; ``[]`` when nothing.

    Args:
      capabilities: the effective capability mask to check (default: this process's,
        from /proc/self/status). Creating a network namespace needs ``CAP_SYS_ADMIN``
        and configuring its qdisc needs ``CAP_NET_ADMIN``; root has both.
      which: how to look a tool up on ``PATH`` (``ip`` and ``tc`` are needed).
      platform: ``sys.platform``; network namespaces are Linux's.
    Returns:
      one sentence per missing thing.
    """
    missing = []
    if not platform.startswith("linux"):
        return [f"Linux (network namespaces and tc are Linux features; this is {platform})"]
    caps = _effective_capabilities() if capabilities is None else int(capabilities)
    for bit, name, why in (
        (_CAP_SYS_ADMIN, "CAP_SYS_ADMIN", "to create a network namespace"),
        (
            _CAP_NET_ADMIN,
            "CAP_NET_ADMIN",
            "to configure the namespace's loopback and qdisc",
        ),
    ):
        if not caps >> bit & 1:
            missing.append(f"root or {name} ({why})")
    for tool in ("ip", "tc"):
        if which(tool) is None:
            missing.append(f"the '{tool}' command of iproute2 on PATH (apt-get install iproute2)")
    return missing


# --------------------------------------------------------------------------- #
# Counters
# --------------------------------------------------------------------------- #
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


# --------------------------------------------------------------------------- #
# Launcher
# --------------------------------------------------------------------------- #
@dataclass
class LaunchResult:
    """What :func:`launch` measured.

    Attributes:
      returncode: the job's exit status (``mpirun``'s); ``-9`` after a timeout.
      bytes: bytes the kernel sent through the link during the job (the root qdisc's counter).
      packets: packets sent through the link.
      drops: packets the qdisc dropped (then retransmitted: included in ``bytes``).
      wall_s: seconds from before ``mpirun`` started to after it ended.
      timed_out: whether the job was killed at ``timeout``.
      settings: the :class:`LinkSettings` as a dict.
      command: the ``mpirun`` command line run in the namespace.
      qdisc: the root qdisc's kind.
      n: the number of processes.
      stdout, stderr: the job's output when :func:`launch` captured it (``None`` otherwise).
      devices_per_process: ``K`` of a ``jax.distributed`` job (``None`` for an MPI job).
      node_bytes: a ``jax.distributed`` job's bytes per node (what each node sent into the
        switch; ``bytes`` is their sum); ``None`` for an MPI job.
    """

    returncode: int
    bytes: int
    packets: int
    drops: int
    wall_s: float
    timed_out: bool
    settings: dict
    command: list[str]
    qdisc: str = ""
    n: int = 0
    stdout: str | None = None
    stderr: str | None = None
    devices_per_process: int | None = None
    node_bytes: list[int] | None = None

    def to_json(self) -> dict:
        """The result as a JSON-ready dict (the ``--report`` file)."""
        return asdict(self)


def mpirun_netem_env(base: dict | None = None, single_thread: bool = True) -> dict:
    """:func:`jaxcomm.comm.mpirun_env` with Open MPI on TCP only, over ``lo``.

    ``OMPI_MCA_btl=self,tcp`` (no shared memory, so bytes between ranks cross the
    link) and ``OMPI_MCA_btl_tcp_if_include=lo`` (Open MPI skips loopback by default).
    Values already in ``base`` for other ``OMPI_MCA_*`` keys (a collective algorithm,
    say) are kept.
    """
    from .comm._launch import mpirun_env

    env = mpirun_env(single_thread=single_thread, base=base)
    env["OMPI_MCA_btl"] = "self,tcp"
    env["OMPI_MCA_btl_tcp_if_include"] = "lo"
    env.pop("OMPI_MCA_btl_tcp_if_exclude", None)
    env["OMPI_MCA_oob_tcp_if_include"] = "lo"
    env["PRTE_MCA_oob_tcp_if_include"] = "lo"
    return env


def node_address(index: int) -> str:
    """Node ``index``'s address in a ``jax.distributed`` job: ``CLUSTER_SUBNET.(index + 1)``."""
    return f"{CLUSTER_SUBNET}.{index + 1}"


def cluster_env(nodes: int, devices_per_process: int, base: dict | None = None) -> dict:
    """The environment every process of a ``jax.distributed`` job starts with (its
    ``JAX_PROCESS_ID`` is added by its node).

    ``base`` (default ``os.environ``) with ``JAX_COORDINATOR_ADDRESS`` (node 0,
    :data:`COORDINATOR_PORT`), ``JAX_NUM_PROCESSES``, ``JAX_PLATFORMS=cpu``,
    ``JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo`` and ``XLA_FLAGS`` whose
    ``--xla_force_host_platform_device_count`` is ``devices_per_process`` (other flags kept).
    """
    env = dict(os.environ if base is None else base)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    flags.append(f"--xla_force_host_platform_device_count={devices_per_process}")
    env.update(
        JAX_COORDINATOR_ADDRESS=f"{node_address(0)}:{COORDINATOR_PORT}",
        JAX_NUM_PROCESSES=str(nodes),
        JAX_PLATFORMS="cpu",
        JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
        XLA_FLAGS=" ".join(flags),
    )
    env.pop("JAX_PROCESS_ID", None)
    return env


def initialize_distributed(**kwargs) -> tuple[int, int]:
    """``jax.distributed.initialize`` from the environment :func:`launch` gives a ``jax.distributed``
    job's processes (:func:`cluster_env`); ``(process_id, num_processes)``.

    Call it before anything else uses JAX. ``kwargs`` go to ``jax.distributed.initialize``
    (e.g. ``initialization_timeout``).

    Raises:
      RuntimeError: not in such a job (naming the missing variables).
    """
    names = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
    missing = [name for name in names if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"initialize_distributed: {', '.join(missing)} not set; start the script with "
            "jaxcomm launch --jax -n N --devices-per-process K -- python script.py"
        )
    import jax

    pid, count = int(os.environ["JAX_PROCESS_ID"]), int(os.environ["JAX_NUM_PROCESSES"])
    jax.distributed.initialize(os.environ["JAX_COORDINATOR_ADDRESS"], count, pid, **kwargs)
    return pid, count


def unavailable(timeout: float = 30.0, *, cluster: bool = False) -> str | None:
    """``None`` if this machine can run :func:`launch`, else one sentence saying why not.

    Checks :func:`missing_requirements`, then tries it: a child process makes a private
    network namespace and installs a token-bucket qdisc on its loopback (a container may
    grant the capabilities and still refuse namespaces or qdiscs); with ``cluster`` (a
    ``jax.distributed`` job's needs) it also makes a bridge and a veth pair there. Nothing
    outside that namespace is touched.
    """
    missing = missing_requirements()
    if missing:
        return "network namespaces are not available here: lacks " + "; ".join(missing)
    probe = "ip link set lo up && tc qdisc add dev lo root tbf rate 1gbit burst 256kb latency 400ms"
    if cluster:
        probe += f" && ip link add {_BRIDGE} type bridge && ip link add jcn0 type veth peer name eth0"
    try:
        proc = subprocess.run(
            ["sh", "-c", probe], preexec_fn=_enter_private_netns, capture_output=True, text=True,
            timeout=timeout, check=False,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError) as err:
        return f"cannot make a private network namespace here: {err}"
    if proc.returncode != 0:
        what = "shape a private loopback or make a bridge and veth links" if cluster else "shape a private loopback"
        return f"cannot {what} here: {proc.stderr.strip() or proc.returncode}"
    return None


def _enter_private_netns() -> None:
    """In the child, before exec: a new network namespace, and death with the launcher."""
    if hasattr(os, "unshare"):
        os.unshare(_CLONE_NEWNET)
    else:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(_CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"unshare(CLONE_NEWNET): {os.strerror(err)}")
    _die_with_parent()


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _netns_inode(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


def _pids_in_netns(inode: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _netns_inode(int(entry)) == inode:
            pids.append(int(entry))
    return pids


def _end_namespace(proc: subprocess.Popen, inode: int | None, grace_s: float = 5.0) -> None:
    """End every process of the job: its process group (SIGTERM, then SIGKILL), then any process
    still in its private namespace (SIGKILL). Only processes of the namespace we made are touched."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        try:
            proc.wait(timeout=grace_s)
            break
        except subprocess.TimeoutExpired:
            continue
    if inode is not None and inode != _netns_inode(os.getpid()):
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            pids = _pids_in_netns(inode)
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=grace_s)


def launch(
    n: int,
    command: Sequence[str],
    *,
    bandwidth: str | float | None = "unlimited",
    latency: str | float = "0",
    burst: str | int = "256kb",
    mtu: int = LOOPBACK_MTU,
    env: dict | None = None,
    mpirun_args: Sequence[str] = (),
    timeout: float | None = None,
    report: str | Path | None = None,
    capture_output: bool = False,
    cwd: str | Path | None = None,
    check_requirements: Callable[[], list[str]] | None = None,
    devices_per_process: int | None = None,
) -> LaunchResult:
    """Run ``mpirun -n n --oversubscribe COMMAND...`` on an emulated link and count its bytes; with
    ``devices_per_process``, ``n`` processes of ``COMMAND`` under ``jax.distributed`` instead, one per
    emulated node (module docstring).

    The job runs in a new network namespace whose loopback carries every byte
    between ranks (:func:`mpirun_netem_env`), shaped by the qdisc that
    ``bandwidth``/``latency`` select (module docstring). ``bytes`` in the result is
    the qdisc's counter at the end: all TCP traffic of the job -- Open MPI's
    start-up (connection handshakes, the runtime's wire-up) included.

    Args:
      n: number of MPI processes, 1 to :data:`MAX_PROCESSES`.
      command: the program and its arguments (e.g. ``[sys.executable, "train.py"]``).
      bandwidth, latency, burst, mtu: the link (:func:`link_settings`).
      env: environment of the job (default ``os.environ``), then :func:`mpirun_netem_env`.
      mpirun_args: extra ``mpirun`` options, before the program.
      timeout: seconds, in (0, :data:`MAX_TIMEOUT_S`]; at the limit every process of the job is killed.
      report: if given, write :meth:`LaunchResult.to_json` there (a file in an existing folder,
        checked before the job starts).
      capture_output: capture the job's stdout/stderr into the result's ``stdout``/``stderr``
        instead of passing them through.
      cwd: the job's working directory.
      check_requirements: returns what is missing (default :func:`missing_requirements`;
        a test can inject a check).
      devices_per_process: ``K``, 1 to :data:`MAX_DEVICES_PER_PROCESS`: run a ``jax.distributed``
        job of ``n`` (at most :data:`MAX_NODES`) nodes with ``K`` CPU devices each, in the
        environment of :func:`cluster_env` (over ``env``); ``bandwidth`` and ``latency`` shape every
        node's link to the switch, and ``bytes`` is what the nodes sent into it (``mpirun_args`` is
        refused).

    Returns:
      the :class:`LaunchResult`.

    Raises:
      NetemError: an invalid option (before anything starts).
      NetemUnavailable: missing privileges, tools or ``mpirun``, or the kernel refused
        the qdisc (e.g. no ``sch_netem`` for ``latency``); nothing of the job has run.
    """
    cluster = devices_per_process is not None
    most = MAX_NODES if cluster else MAX_PROCESSES
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= most:
        what = "nodes of a jax.distributed job" if cluster else "processes"
        raise NetemError(f"-n: the number of {what} must be an integer from 1 to {most}; got {n!r}")
    if cluster:
        k = devices_per_process
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_DEVICES_PER_PROCESS:
            raise NetemError(
                f"--devices-per-process: must be an integer from 1 to {MAX_DEVICES_PER_PROCESS}; got {k!r}"
            )
        if mpirun_args:
            raise NetemError(f"mpirun_args: a jax.distributed job starts no mpirun; got {list(mpirun_args)!r}")
    command = [str(c) for c in command]
    if not command:
        raise NetemError("command: give the program to run (e.g. python script.py)")
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= MAX_TIMEOUT_S
    ):
        raise NetemError(f"--timeout: must be in (0, {MAX_TIMEOUT_S:g}] seconds (7 days); got {timeout!r}")
    settings = link_settings(bandwidth, latency, burst, mtu)
    if cluster:  # the nodes' links are veth devices, whose MTU is at most 65535
        settings = dataclasses.replace(settings, mtu=min(settings.mtu, _VETH_MTU))
    if report is not None:
        from ._paths import check_output_path

        try:
            report = check_output_path(report, "--report", folder=False)
        except ValueError as e:
            raise NetemError(str(e)) from None
    missing = (check_requirements or missing_requirements)()
    if missing:
        raise NetemUnavailable(
            "jaxcomm.netem needs a private network namespace with a shaped loopback; this process lacks: "
            + "; ".join(missing)
            + ". Run as root (e.g. sudo, or a container with --cap-add NET_ADMIN --cap-add SYS_ADMIN)."
        )
    if devices_per_process is not None:
        job_env, mpi_cmd = cluster_env(n, devices_per_process, env), command
    else:
        from .comm._launch import mpirun_path

        mpirun = mpirun_path()
        if mpirun is None:
            raise NetemUnavailable("mpirun not found: install the project's 'mpi' extra (pip install -e .[mpi])")
        job_env = mpirun_netem_env(base=env)
        mpi_cmd = [mpirun, "-n", str(n), "--oversubscribe", *map(str, mpirun_args), *command]

    with tempfile.TemporaryDirectory(prefix="jaxcomm-netem-") as tmp:
        spec = Path(tmp) / "spec.json"
        out = Path(tmp) / "result.json"
        if cluster:  # the switch here; each node's link and qdisc in its own namespace
            setup = [["ip", "link", "set", "dev", "lo", "up"], ["ip", "link", "add", _BRIDGE, "type", "bridge"],
                     ["ip", "link", "set", "dev", _BRIDGE, "up"]]  # fmt: skip
            nodes = {"count": n, "setup": qdisc_commands(settings, "eth0")}
        else:
            setup, nodes = qdisc_commands(settings), None
        spec.write_text(json.dumps({"setup": setup, "command": mpi_cmd, "result": str(out), "nodes": nodes}))
        inner = [
            sys.executable,
            "-P",
            str(Path(__file__).resolve()),
            "--inner",
            str(spec),
        ]
        stdio = subprocess.PIPE if capture_output else None
        proc = subprocess.Popen(
            inner, env=job_env, cwd=cwd, stdout=stdio, stderr=stdio, text=True,
            # the unshare must happen in the child between fork and exec; the launcher starts no threads
            start_new_session=True, preexec_fn=_enter_private_netns,
        )  # fmt: skip
        # Hold the namespace open while we may sweep it, so that its inode number (how the
        # sweep recognises its processes) cannot be reused by another namespace meanwhile.
        try:
            ns_fd = os.open(f"/proc/{proc.pid}/ns/net", os.O_RDONLY)
            inode = os.fstat(ns_fd).st_ino
        except OSError:
            ns_fd, inode = None, None
        timed_out = False
        try:
            try:
                stdout, stderr = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                _end_namespace(proc, inode)
                stdout, stderr = proc.communicate()
            except BaseException:  # KeyboardInterrupt and anything else: no process outlives us
                _end_namespace(proc, inode)
                raise
            if proc.poll() is None or (inode is not None and _pids_in_netns(inode)):
                _end_namespace(proc, inode)
        finally:
            if proc.poll() is None:
                _end_namespace(proc, inode)
            if ns_fd is not None:
                os.close(ns_fd)
        data: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    if "setup_error" in data:
        raise NetemUnavailable(f"setting up the emulated link failed: {data['setup_error']}")
    after = data.get("after") or {"bytes": 0, "packets": 0, "drops": 0, "kind": ""}
    before = data.get("before") or {"bytes": 0, "packets": 0, "drops": 0}
    rc = data.get("returncode")
    if rc is None:  # the inner launcher did not report: mpirun's own status
        rc = -1 if proc.returncode is None else proc.returncode
    result = LaunchResult(
        returncode=-9 if timed_out else int(rc),
        bytes=after["bytes"] - before["bytes"],
        packets=after["packets"] - before["packets"],
        drops=after["drops"] - before["drops"],
        wall_s=float(data.get("wall_s", 0.0)),
        timed_out=timed_out,
        settings=settings.describe(),
        command=mpi_cmd,
        qdisc=after.get("kind", ""),
        n=n,
        stdout=stdout if capture_output else None,
        stderr=stderr if capture_output else None,
        devices_per_process=devices_per_process,
        node_bytes=data.get("node_bytes"),
    )
    if report is not None:
        Path(report).write_text(json.dumps(result.to_json(), indent=2) + "\n")
    return result


def _inner(spec_path: str) -> int:
    """Inside the new namespace: set the link up, run the job, record the counters around it."""
    spec = json.loads(Path(spec_path).read_text())
    result_path = Path(spec["result"])
    error = _run_setup(spec["setup"])
    if error:
        result_path.write_text(json.dumps({"setup_error": error}))
        return 3
    if spec.get("nodes") is None:
        record = _run_counted(spec["command"], "lo")
    else:
        # The launcher ends the job with SIGTERM to the process group; the nodes end theirs.
        signal.signal(signal.SIGTERM, lambda *_: None)
        signal.signal(signal.SIGINT, lambda *_: None)
        t0 = time.perf_counter()
        record = _run_nodes(spec_path, spec, result_path)
        record["wall_s"] = time.perf_counter() - t0
    result_path.write_text(json.dumps(record))
    return int(record.get("returncode") or 0)


def _run_counted(command, dev: str, env: dict | None = None, forward: bool = False) -> dict:
    """Run ``command`` (it dies with this process) and read ``dev``'s counters around it: the record
    ``{"before", "after", "returncode", "wall_s"}``.

    The launcher ends a job with SIGTERM to its process group: this process then outlives the job
    by the moment it takes to read the counters (a handler, not SIG_IGN: exec resets it); with
    ``forward`` the handler also ends the job (a node's, whose job the switch ends through it).
    """
    before = asdict(link_counters(dev))
    jobs: list[subprocess.Popen] = []

    def on_term(*_) -> None:
        for job in jobs if forward else ():
            job.terminate()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, lambda *_: None)
    t0 = time.perf_counter()
    jobs.append(subprocess.Popen(command, env=env, preexec_fn=_die_with_parent))
    try:
        rc = jobs[0].wait()
    finally:
        if jobs[0].poll() is None:
            jobs[0].kill()
            jobs[0].wait()
    wall = time.perf_counter() - t0
    return {"before": before, "after": asdict(link_counters(dev)), "returncode": rc, "wall_s": wall}


def _run_setup(commands) -> str | None:
    """Run the ``ip``/``tc`` commands; ``None``, or what failed (with a hint for a missing ``sch_netem``)."""
    for cmd in commands:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
        if proc.returncode != 0:
            hint = ""
            if "netem" in cmd and "unknown" in proc.stderr.lower():
                hint = " (--latency needs the kernel's sch_netem module, which this kernel lacks)"
            return f"{' '.join(cmd)}: {proc.stderr.strip()}{hint}"
    return None


def _enter_node_namespaces() -> None:
    """In a node's launcher, before exec: new network and UTS namespaces, and death with the switch's."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWNET | _CLONE_NEWUTS) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWNET | CLONE_NEWUTS): {os.strerror(err)}")
    _die_with_parent()


def _run_nodes(spec_path: str, spec: dict, result_path: Path) -> dict:
    """In the switch's namespace: start every node (:func:`_node`), plug it into the bridge, let it
    run, end the others when one fails; the record of the job (counters summed over the nodes)."""
    count = spec["nodes"]["count"]
    nodes: list[tuple[subprocess.Popen, int]] = []
    error = None
    for i in range(count):
        read, write = os.pipe()
        proc = subprocess.Popen(
            [sys.executable, "-P", str(Path(__file__).resolve()), "--node", spec_path, str(i), str(read)],
            pass_fds=(read,), preexec_fn=_enter_node_namespaces,
        )  # fmt: skip
        os.close(read)
        nodes.append((proc, write))
        error = _run_setup(
            [
                ["ip", "link", "add", f"jcn{i}", "type", "veth", "peer", "name", "eth0", "netns", str(proc.pid)],
                ["ip", "link", "set", "dev", f"jcn{i}", "mtu", str(_VETH_MTU), "master", _BRIDGE, "up"],
            ]
        )
        if error:
            break
    for _, write in nodes:  # go (or stop, after a failed set-up)
        with contextlib.suppress(OSError):
            os.write(write, b"0" if error else b"1")
        os.close(write)
    procs = [proc for proc, _ in nodes]
    first_failure = None
    while any(p.poll() is None for p in procs):
        for p in procs:
            if first_failure is None and p.poll() not in (None, 0):
                first_failure = p.returncode  # the others would wait for it: end them
                for other in procs:
                    if other.poll() is None:
                        other.terminate()
        time.sleep(0.05)
    records = []
    for i in range(len(nodes)):
        path = Path(f"{result_path}.node{i}")
        records.append(json.loads(path.read_text()) if path.exists() else {})
    errors = [r["setup_error"] for r in records if "setup_error" in r]
    if error or errors:
        return {"setup_error": error or errors[0]}
    totals = {"bytes": 0, "packets": 0, "drops": 0, "kind": ""}
    per_node = []
    for r in records:
        before, after = r.get("before"), r.get("after")
        if not before or not after:
            per_node.append(0)
            continue
        for key in ("bytes", "packets", "drops"):
            totals[key] += after[key] - before[key]
        totals["kind"] = after["kind"]
        per_node.append(after["bytes"] - before["bytes"])
    rc = first_failure if first_failure is not None else max((p.returncode for p in procs), key=abs, default=0)
    return {"before": {"bytes": 0, "packets": 0, "drops": 0}, "after": totals, "returncode": rc, "node_bytes": per_node}


def _node(spec_path: str, index: int, go_fd: int) -> int:
    """A node of a ``jax.distributed`` job, in its own namespaces: wait for its link, set it up (the
    node's address as host name, so gloo binds to it), run the process, record its link's counters."""
    spec = json.loads(Path(spec_path).read_text())
    result_path = Path(f"{spec['result']}.node{index}")
    with os.fdopen(go_fd, "rb") as go:
        if go.read(1) != b"1":
            return 3
    address = node_address(index)
    import socket

    socket.sethostname(address)
    error = _run_setup(
        [
            *spec["nodes"]["setup"],
            ["ip", "addr", "add", f"{address}/24", "dev", "eth0"],
            ["ip", "link", "set", "dev", "lo", "up"],
        ]
    )
    if error:
        result_path.write_text(json.dumps({"setup_error": error}))
        return 3
    record = _run_counted(spec["command"], "eth0", {**os.environ, "JAX_PROCESS_ID": str(index)}, forward=True)
    result_path.write_text(json.dumps(record))
    return int(record["returncode"])


if __name__ == "__main__":  # the launcher's process inside the namespace
    if len(sys.argv) == 3 and sys.argv[1] == "--inner":
        sys.exit(_inner(sys.argv[2]))
    if len(sys.argv) == 5 and sys.argv[1] == "--node":
        sys.exit(_node(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
    sys.exit("usage: jaxcomm launch -n N [--bandwidth R] [--latency T] -- CMD ARGS...")
