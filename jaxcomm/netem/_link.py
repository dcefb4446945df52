"""The emulated link: its settings in ``tc`` syntax, and the qdisc commands that shape it.

Rates are bits per second, times seconds, sizes bytes (:func:`parse_rate`, :func:`parse_time`,
:func:`parse_size`); :class:`LinkSettings` holds one link checked, :func:`qdisc_commands` turns it
into the ``ip``/``tc`` commands of the package's table, and :func:`reshape` gives a running job's
link another rate.
"""

from __future__ import annotations

import math
import re
import subprocess
from dataclasses import asdict, dataclass

HEADER_BYTES = 66
"""Bytes of headers per TCP/IPv4 packet on a loopback qdisc: Ethernet 14 + IPv4 20 + TCP 32
(20 plus the 12-byte timestamp option that Linux enables by default)."""

LOOPBACK_MTU = 65536
"""The Linux loopback's default MTU in bytes (IPv4 packet size, Ethernet header excluded)."""

MAX_RATE_BPS = 1e12
"""The fastest link rate accepted, in bits per second (``1tbit``; faster: write ``unlimited``)."""
MAX_BURST_BYTES = 2**30
"""The largest token bucket accepted, in bytes (``1gb``)."""
QUEUE_S = 0.4
"""The tbf queue holds at least this many seconds of the link's rate (and :data:`QUEUE_MIN_BYTES`)."""
QUEUE_MIN_BYTES = 16 * 2**20
"""The tbf queue's least size in bytes: four TCP flows of a ring collective put up to about a MB
each in flight, and a queue of 400 ms at 10 Mbit/s (500 kB) dropped 123-185 packets of a 16-bit
all-reduce in 20 steps, whose retransmissions slowed its step by 16-30 %."""


class NetemError(ValueError):
    """An invalid emulation setting; the message names the option."""


class NetemUnavailable(RuntimeError):
    """This machine or process cannot create the emulated network; the message says what is needed."""


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


def parse_burst(text: str, rate_bps: float | None, mtu: int = LOOPBACK_MTU, option: str = "--burst") -> int:
    """The token bucket's size in **bytes**, from a size or a time at the link's rate.

    A size (``"256kb"``, :func:`parse_size`) is taken as it is. A time (``"1ms"``,
    :func:`parse_time`'s units) is the bytes the link passes in that time,
    ``max(mtu + 14, ceil(rate_bps · t / 8))``: after an idle spell the bucket lets at most that
    time's worth of bytes (and at least one packet, which tbf needs) through at line speed. A
    physical link lets none through: a step that computes for longer than ``burst / rate`` while
    the link is idle would otherwise send its first ``burst`` bytes for free, as if they had
    crossed during the computation (256 KiB is 210 ms at 10 Mbit/s). Without a rate
    (``rate_bps=None``), a time gives one packet.

    Raises:
      NetemError: naming ``option``, for anything that is neither.
    """
    s = str(text).strip().lower()
    m = re.fullmatch(_NUMBER + r"\s*([a-z]*)", s)
    if m and m.group(2) in _TIME_UNITS:
        seconds = parse_time(s, option)
        packet = int(mtu) + 14
        return packet if rate_bps is None else max(packet, math.ceil(rate_bps * seconds / 8))
    return parse_size(text, option)


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
      burst: ``"256kb"``, bytes, or a time at the link's rate (``"1ms"``: :func:`parse_burst`);
        it must hold one full packet, ``mtu + 14`` bytes (tbf cannot send a packet larger than
        its bucket).
      mtu: 68 to 65536 bytes.

    Raises:
      NetemError: naming the option (``--bandwidth``, ``--latency``, ``--burst``, ``--mtu``).
    """
    if bandwidth is None or isinstance(bandwidth, str):
        bw = None if bandwidth is None else parse_rate(bandwidth, "--bandwidth")
    else:
        bw = float(bandwidth)
    lat = parse_time(latency, "--latency") if isinstance(latency, str) else float(latency)
    b = parse_burst(burst, bw, mtu) if isinstance(burst, str) else int(burst)
    return LinkSettings(bandwidth_bps=bw, latency_s=lat, burst_bytes=b, mtu=mtu)  # checked there


def tbf_queue_bytes(settings: LinkSettings) -> int:
    """Bytes tbf may queue before it drops (its ``limit``): the bucket, plus :data:`QUEUE_S` of
    the rate or :data:`QUEUE_MIN_BYTES`, whichever is more (at most 2**31)."""
    rate = settings.bandwidth_bps or 0.0
    return int(min(2**31, settings.burst_bytes + max(math.ceil(rate / 8 * QUEUE_S), QUEUE_MIN_BYTES)))


def qdisc_commands(settings: LinkSettings, dev: str = "lo") -> list[list[str]]:
    """The ``ip``/``tc`` commands that set up ``dev`` in the namespace (see the module's table)."""
    cmds = [["ip", "link", "set", "dev", dev, "mtu", str(settings.mtu), "up"]]
    tbf = []
    if settings.bandwidth_bps is not None:
        tbf = [
            "tbf", "rate", f"{settings.bandwidth_bps:.0f}bit", "burst", str(settings.burst_bytes),
            "limit", str(tbf_queue_bytes(settings)),
        ]  # fmt: skip
    add = ["tc", "qdisc", "add", "dev", dev]
    if settings.latency_s > 0:
        delay = f"{settings.latency_s * 1e6:.3f}us"
        cmds.append([*add, "root", "handle", "1:", "netem", "delay", delay, "limit", "100000"])
        if settings.bandwidth_bps is not None:
            cmds.append([*add, "parent", "1:1", "handle", "10:", *tbf])
    elif settings.bandwidth_bps is not None:
        cmds.append([*add, "root", "handle", "1:", *tbf])
    else:
        cmds.append([*add, "root", "handle", "1:", "pfifo", "limit", "100000"])
    return cmds


def device_mtu(dev: str = "lo") -> int:
    """The MTU in bytes of ``dev`` in this process's network namespace (``SIOCGIFMTU``).

    Not ``/sys/class/net``: sysfs shows the devices of the namespace it was mounted in, which
    for a process that entered a new namespace without mounting sysfs again is the host's.
    """
    import fcntl
    import socket
    import struct

    siocgifmtu = 0x8921
    request = struct.pack("16si20x", dev.encode()[:15], 0)  # struct ifreq: name, then ifr_mtu
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        return struct.unpack("16si20x", fcntl.ioctl(sock.fileno(), siocgifmtu, request))[1]


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
    settings = link_settings(bandwidth, "0", burst, device_mtu(dev))
    subprocess.run(["tc", "qdisc", "del", "dev", dev, "root"], capture_output=True, check=False, timeout=60)
    for cmd in qdisc_commands(settings, dev)[1:]:  # [0] sets the device up: it is up already
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=60)
        if proc.returncode != 0:
            raise NetemUnavailable(f"{' '.join(cmd)}: {proc.stderr.strip()}")
    return settings
