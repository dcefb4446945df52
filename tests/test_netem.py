"""jaxcomm.netem: option parsing, the missing-privilege path, and bytes counted by the kernel.

The MPI tests run a collective on an emulated 400 Mbit/s shared link (a private network
namespace's loopback with a ``tbf`` qdisc; Open MPI over TCP only) and check the qdisc's
byte counter against the collective's closed form:

- ring all-reduce of ``P`` bytes per rank: ``2 (n - 1) P`` payload bytes over all ranks;
- all-gather of ``P`` bytes per rank: ``n (n - 1) P``.

Tolerance, derived. ``tests/mpi_scripts/netem_bytes.py`` reads the counters (bytes ``W``,
packets ``K``) around the collective between barriers, and around the barriers alone
(``W_b``, ``K_b``). Every packet on an established TCP/IPv4 connection through the
loopback qdisc carries exactly ``66`` header bytes (Ethernet 14, IPv4 20, TCP 20 + 12 of
timestamps; SACK blocks appear only after a loss, and the test requires no drops), so
``W - 66 K`` is the exact TCP payload. Subtracting the barriers' payload leaves the
collective's payload ``C = (W - 66 K) - (W_b - 66 K_b)``, which is the formula ``F`` plus
Open MPI's headers. Hence the test asserts

    F <= C <= F + M,   M = sum over messages of (128 + 64 * ceil(m / 64 KiB)) bytes,

with ``M`` a bound on ob1/TCP-BTL protocol bytes for a message of ``m`` bytes: a
rendezvous header and its ACK (under 128 bytes with the TCP BTL's own header), and under
64 bytes per fragment, a fragment holding at least 64 KiB (the TCP BTL's eager limit)
except the last. The ring all-reduce sends ``2 n (n - 1)`` messages of ``P / n`` bytes, the
ring all-gather ``n (n - 1)`` of ``P`` (both algorithms are selected explicitly). The lower
bound fails if any byte bypasses the link (shared memory) and the upper bound if the
algorithm sends more (recursive doubling's all-reduce sends ``n log2(n) P``).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
from mpirun import suite_xla_flags

from jaxcomm import cli, netem
from jaxcomm.comm._packing import bucket_sizes
from jaxcomm.netem import _cluster, _counters, _launcher, _link

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "mpi_scripts" / "netem_bytes.py"
RING = _launcher.RING_COLLECTIVES  # Open MPI's ring all-reduce and ring all-gather


# --------------------------------------------------------------------------- #
# Options
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize(
    "text, bits_per_s",
    [
        ("200mbit", 2e8),
        ("1gbit", 1e9),
        ("100Mbit", 1e8),
        ("1.5kbit", 1500.0),
        ("10mbps", 8e7),
        ("unlimited", None),
    ],
)
def test_parse_rate(text, bits_per_s):
    assert _link.parse_rate(text) == bits_per_s


@pytest.mark.parametrize("text", ["200", "fast", "200mb", "-1mbit", "0bit", "", "2tbit", "1" + "0" * 40 + "bit"])
def test_bad_rate_names_the_option(text):
    with pytest.raises(netem.NetemError, match="--bandwidth"):
        _link.parse_rate(text)


def test_parse_time_and_size():
    assert _link.parse_time("0.1ms") == pytest.approx(1e-4)
    assert _link.parse_time("50us") == pytest.approx(5e-5)
    assert _link.parse_time("0") == 0.0
    assert _link.parse_size("256kb") == 262144
    assert _link.parse_size("1mb") == 1048576
    assert _link.parse_size("70000") == 70000
    for bad in ("1", "fast", "20s"):
        with pytest.raises(netem.NetemError, match="--latency"):
            _link.parse_time(bad)
    with pytest.raises(netem.NetemError, match="--burst"):
        _link.parse_size("big")
    assert _link.parse_size("1gb") == _link.MAX_BURST_BYTES
    for huge in ("1025mb", "9" * 400 + "kb"):  # over the limit, or a float overflow to inf
        with pytest.raises(netem.NetemError, match=r"--burst: at most 1gb"):
            _link.parse_size(huge)


def test_a_burst_given_as_a_time_is_that_time_at_the_rate_and_at_least_one_packet():
    """parse_burst: a time t gives max(mtu + 14, ceil(rate · t / 8)) bytes; a size is a size."""
    assert _link.parse_burst("1ms", 1e9, 9000) == 125_000  # 1 ms at 1 Gbit/s
    assert _link.parse_burst("1ms", 1e8, 9000) == 12_500
    assert _link.parse_burst("1ms", 1e7, 9000) == 9014  # 1,250 bytes: one 9,000-byte packet instead
    assert _link.parse_burst("2.5ms", 1e7, 1500) == 3125 and _link.parse_burst("1ms", None, 1500) == 1514
    assert _link.parse_burst("256kb", 1e7, 9000) == 262144
    s = _link.link_settings("10mbit", "0", "1ms", 9000)
    assert s.burst_bytes == 9014 and s.mtu == 9000
    for bad in ("1hour", "fast", "20s"):
        with pytest.raises(netem.NetemError, match="--burst"):
            _link.parse_burst(bad, 1e9, 9000)


def test_link_settings_checks_each_option():
    s = _link.link_settings("200mbit", "0.1ms", "256kb", 1500)
    assert (s.bandwidth_bps, s.burst_bytes, s.mtu) == (2e8, 262144, 1500) and s.latency_s == pytest.approx(1e-4)
    with pytest.raises(netem.NetemError, match=r"--burst.*65550"):
        _link.link_settings("1gbit", burst="32kb")  # tbf cannot pass a 64 KiB loopback packet
    with pytest.raises(netem.NetemError, match="--mtu"):
        _link.link_settings(mtu=100000)
    with pytest.raises(netem.NetemError, match="-n"):
        netem.launch(0, ["true"])
    # Settings built by hand are checked the same way.
    for kwargs, option in [
        ({"mtu": 0}, "--mtu"),
        ({"mtu": 1500.0}, "--mtu"),
        ({"latency_s": -1.0}, "--latency"),
        ({"latency_s": float("nan")}, "--latency"),
        ({"bandwidth_bps": 0.0}, "--bandwidth"),
        ({"bandwidth_bps": "fast"}, "--bandwidth"),
        ({"burst_bytes": -5}, "--burst"),
        ({"bandwidth_bps": 1e9, "burst_bytes": 1000}, "--burst"),
        ({"bandwidth_bps": 1e35}, r"--bandwidth: .* to 1tbit"),
        ({"bandwidth_bps": float("inf")}, "--bandwidth"),
        ({"bandwidth_bps": float("nan")}, "--bandwidth"),
        ({"burst_bytes": 2**31}, "--burst"),
    ]:
        with pytest.raises(netem.NetemError, match=option):
            _link.LinkSettings(**kwargs)
    assert _link.LinkSettings(bandwidth_bps=1e9, mtu=1500) == _link.link_settings("1gbit", "0", "256kb", 1500)
    with pytest.raises(netem.NetemError, match="--bandwidth"):
        netem.launch(2, ["true"], bandwidth="lots")
    assert _link.LinkSettings(bandwidth_bps=_link.MAX_RATE_BPS).bandwidth_bps == _link.parse_rate("1tbit")


def test_the_tbf_queue_holds_400_ms_of_the_rate_and_at_least_16_mib():
    queue = _link.tbf_queue_bytes
    assert queue(_link.link_settings("10mbit", burst="1ms", mtu=9000)) == 9014 + 16 * 2**20
    assert queue(_link.link_settings("1gbit", burst="1ms", mtu=9000)) == 125_000 + 50_000_000  # 0.4 s of 1 Gbit/s
    assert queue(_link.link_settings("1tbit")) == 2**31  # tbf's limit is a 32-bit count


def test_qdisc_commands():
    # the queue: 400 ms of 200 Mbit/s (10 MB) is under 16 MiB, so 16 MiB plus the bucket
    tbf = ["tbf", "rate", "200000000bit", "burst", "262144", "limit", str(16 * 2**20 + 262144)]
    lo_up = ["ip", "link", "set", "dev", "lo", "mtu", "65536", "up"]
    assert _link.qdisc_commands(_link.link_settings("200mbit")) == [
        lo_up,
        ["tc", "qdisc", "add", "dev", "lo", "root", "handle", "1:", *tbf],
    ]
    both = _link.qdisc_commands(_link.link_settings("200mbit", "0.1ms"))
    assert both[1][:9] == [
        "tc",
        "qdisc",
        "add",
        "dev",
        "lo",
        "root",
        "handle",
        "1:",
        "netem",
    ]
    assert both[2] == [
        "tc",
        "qdisc",
        "add",
        "dev",
        "lo",
        "parent",
        "1:1",
        "handle",
        "10:",
        *tbf,
    ]
    assert _link.qdisc_commands(_link.link_settings())[1][-3:] == [
        "pfifo",
        "limit",
        "100000",
    ]


def test_parse_qdisc_stats_json_and_text():
    js = '[{"kind":"tbf","handle":"8001:","root":true,"bytes":4592064,"packets":280,"drops":1}]'
    assert _counters.parse_qdisc_stats(js) == _counters.LinkCounters(4592064, 280, 1, "tbf")
    text = (
        "qdisc netem 1: root refcnt 2 limit 1000 delay 100us\n"
        " Sent 12605906 bytes 326 pkt (dropped 0, overlimits 0 requeues 0)\n"
        " backlog 0b 0p requeues 0\n"
        "qdisc tbf 10: parent 1:1 rate 200Mbit burst 256Kb lat 400ms\n"
        " Sent 99 bytes 1 pkt (dropped 0, overlimits 0 requeues 0)\n"
    )
    assert _counters.parse_qdisc_stats(text) == _counters.LinkCounters(12605906, 326, 0, "netem")
    with pytest.raises(ValueError, match="no root qdisc"):
        _counters.parse_qdisc_stats("[]")


def test_formulas():
    assert _counters.ring_allreduce_bytes(4, 1 << 20) == 6 << 20
    assert _counters.all_gather_bytes(4, 1 << 20) == 12 << 20


# --------------------------------------------------------------------------- #
# Without privileges (simulated): a clear error, and nothing starts
# --------------------------------------------------------------------------- #
def test_missing_requirements_names_what_is_needed():
    missing = _launcher.missing_requirements(capabilities=0, which=lambda tool: None)
    text = "; ".join(missing)
    for need in ("CAP_SYS_ADMIN", "CAP_NET_ADMIN", "'ip'", "'tc'"):
        assert need in text
    everything = (1 << 12) | (1 << 21)
    assert _launcher.missing_requirements(capabilities=everything, which=lambda tool: f"/usr/sbin/{tool}") == []
    assert _launcher.missing_requirements(capabilities=everything, which=lambda t: None if t == "tc" else t) == [
        "the 'tc' command of iproute2 on PATH (apt-get install iproute2)"
    ]
    assert "Linux" in _launcher.missing_requirements(platform="darwin")[0]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n": 1000}, r"-n: .* from 1 to 256; got 1000"),
        ({"n": 2.0}, r"-n: .* an integer"),
        ({"timeout": float("inf")}, r"--timeout: must be in \(0, 604800\] seconds"),
        ({"timeout": float("nan")}, r"--timeout"),
        ({"timeout": "60"}, r"--timeout"),
        ({"report": "{tmp}/missing/r.json"}, r"--report: the folder .*missing' does not exist"),
        ({"report": "{tmp}"}, r"--report: .* is a folder"),
        ({"devices_per_process": 0}, r"--devices-per-process: must be an integer from 1 to 1024; got 0"),
        ({"devices_per_process": True}, r"--devices-per-process"),
        ({"devices_per_process": 2, "n": 255}, r"-n: the number of nodes of a jax.distributed job .* 1 to 254"),
        ({"devices_per_process": 2, "mpirun_args": ["--bind-to", "none"]}, r"mpirun_args: a jax.distributed job"),
    ],
)
def test_bad_launch_options_fail_before_the_job(tmp_path, kwargs, message):
    """-n, the timeout and the report path are checked before the requirements and before anything runs."""
    marker = tmp_path / "ran"
    kwargs = {k: v.replace("{tmp}", str(tmp_path)) if isinstance(v, str) else v for k, v in kwargs.items()}
    n = kwargs.pop("n", 2)
    with pytest.raises(netem.NetemError, match=message):
        netem.launch(n, [sys.executable, "-c", f"open({str(marker)!r}, 'w')"], **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_unprivileged_launch_fails_before_starting(tmp_path):
    marker = tmp_path / "ran"
    unprivileged = lambda: _launcher.missing_requirements(capabilities=0)
    with pytest.raises(netem.NetemUnavailable, match=r"CAP_NET_ADMIN.*Run as root"):
        netem.launch(
            2,
            [sys.executable, "-c", f"open({str(marker)!r}, 'w')"],
            check_requirements=unprivileged,
        )
    assert not marker.exists()


def test_cli_reports_missing_privileges(monkeypatch, capsys):
    monkeypatch.setattr(netem, "missing_requirements", lambda: ["root or CAP_NET_ADMIN (to configure)"])
    assert cli.main(["launch", "-n", "2", "--bandwidth", "100mbit", "--", "true"]) == 2
    assert "CAP_NET_ADMIN" in capsys.readouterr().err
    assert cli.main(["launch", "-n", "2", "--bandwidth", "100", "--", "true"]) == 2
    assert "--bandwidth" in capsys.readouterr().err


def test_check_says_why_not(monkeypatch, capsys):
    monkeypatch.setattr(netem, "missing_requirements", lambda: ["root or CAP_SYS_ADMIN (to create)"])
    assert netem.unavailable() == "network namespaces are not available here: lacks root or CAP_SYS_ADMIN (to create)"
    assert cli.main(["launch", "--check"]) == 1
    assert "CAP_SYS_ADMIN" in capsys.readouterr().err
    assert cli.main(["launch", "--", "true"]) == 2
    assert "-n N" in capsys.readouterr().err


def test_check_passes_where_namespaces_work(namespaces, capsys):
    assert netem.unavailable() is None
    assert cli.main(["launch", "--check"]) == 0
    assert "available" in capsys.readouterr().err


# --------------------------------------------------------------------------- #
# On the emulated network (root)
# --------------------------------------------------------------------------- #
def _protocol_bound(messages: int, size: int) -> int:
    return messages * (128 + 64 * math.ceil(size / 65536))


def _run_collective(tmp_path, n, op, payload, via_cli=False):
    out = tmp_path / "window.json"
    cmd = [sys.executable, str(SCRIPT), op, str(payload), str(out)]
    env = {
        **os.environ,
        **RING,
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    if via_cli:
        report = tmp_path / "report.json"
        old = dict(os.environ)
        os.environ.update(env)
        try:
            rc = cli.main(
                [
                    "launch",
                    "-n",
                    str(n),
                    "--bandwidth",
                    "400mbit",
                    "--timeout",
                    "120",
                    "--report",
                    str(report),
                    "--",
                    *cmd,
                ]
            )
        finally:
            os.environ.clear()
            os.environ.update(old)
        assert rc == 0
        total = json.loads(report.read_text())
    else:
        res = netem.launch(
            n,
            cmd,
            bandwidth="400mbit",
            env=env,
            timeout=120,
            capture_output=True,
            cwd=ROOT,
        )
        assert res.returncode == 0, (res.stderr or "")[-3000:]
        total = res.to_json()
    return json.loads(out.read_text()), total


@pytest.mark.mpi
@pytest.mark.parametrize(
    "n, op, payload",
    [
        (2, "sum", 1 << 20),
        (4, "sum", 4 << 20),
        (4, "all_gather", 1 << 20),
        (2, "all_gather", 4 << 20),
    ],
)
def test_collective_bytes_match_formula(namespaces, tmp_path, n, op, payload):
    via_cli = op == "all_gather" and n == 4  # one case through `jaxcomm launch --report`
    w, total = _run_collective(tmp_path, n, op, payload, via_cli=via_cli)
    assert w["n"] == n and w["payload_bytes"] == payload and w["window"]["qdisc"] == "tbf"
    win, bar = w["window"], w["barriers"]
    assert win["drops"] == 0 and bar["drops"] == 0
    # netem.measure measured again while a window held a TCP retransmission
    assert win["retransmitted"] == 0 and bar["retransmitted"] == 0
    if op == "sum":
        formula = _counters.ring_allreduce_bytes(n, payload)
        bound = _protocol_bound(2 * n * (n - 1), payload // n)
    else:
        formula = _counters.all_gather_bytes(n, payload)
        bound = _protocol_bound(n * (n - 1), payload)
    hdr = _link.HEADER_BYTES
    payload_sent = (win["bytes"] - hdr * win["packets"]) - (bar["bytes"] - hdr * bar["packets"])
    assert formula <= payload_sent <= formula + bound, (payload_sent, formula, bound, w)
    # The job's total: the measured op and its warm-up call each sent at least the formula.
    assert total["bytes"] >= 2 * formula and total["drops"] == 0 and total["returncode"] == 0
    assert total["settings"]["bandwidth_bps"] == 4e8 and total["qdisc"] == "tbf"


@pytest.mark.mpi
def test_job_that_never_starts_mpi_sends_nothing(namespaces):
    # Each launch gets a fresh link whose counter sees only the job (the machine's own
    # loopback traffic is elsewhere); processes that never call MPI_Init open no connection.
    res = netem.launch(2, [sys.executable, "-c", "pass"], bandwidth="100mbit", timeout=60)
    assert (res.returncode, res.bytes, res.packets, res.qdisc) == (0, 0, 0, "tbf")


@pytest.mark.mpi
def test_timeout_ends_every_process(namespaces):
    marker = f"netem-{uuid.uuid4().hex}"
    res = netem.launch(2, [sys.executable, "-c", "import time; time.sleep(120)", marker], timeout=3)
    assert res.timed_out and res.returncode == -9
    alive = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                alive.append(pid)
        except OSError:
            pass
    assert alive == []


# --------------------------------------------------------------------------- #
# A whole compressed_mean step: jaxcomm.cost_model's prediction against the link
# --------------------------------------------------------------------------- #
STEP_SCRIPT = ROOT / "tests" / "mpi_scripts" / "netem_step_bytes.py"


def _module(path: Path):
    """The script at ``path`` as a module."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _step_script():
    """``tests/mpi_scripts/netem_step_bytes.py`` as a module (its ``gradient``, ``THRESHOLD_V``)."""
    return _module(STEP_SCRIPT)


def step_expectations(case: str, n: int, rows: int, cols: int) -> dict:
    """For one case of ``netem_step_bytes.py``: the wire bits one worker must report, the
    cost model's strategy, and the Open MPI protocol bound ``M`` of the step's messages.

    ``d = rows · cols`` float32 entries (``n`` divides ``d``). Messages (ring algorithms):
    ``none``: one all-reduce of ``P`` (``2n(n−1)`` messages of ``P/n``); ``topk``: one fused
    all-gather of ``P`` (``n(n−1)`` messages of ``P``); ``threshold``: the count gather
    (``n(n−1)`` messages of 4 bytes) and the data gather of ``B`` bytes (``n(n−1)`` messages),
    ``B`` the smallest bucket of ``bucket_sizes(8 d)`` at least ``8 max_r c_r``, ``c_r`` rank
    ``r``'s entries with ``|g| >= v`` (float32 value and int32 index each: ``d > 2**16``), from
    the script's gradients in NumPy; ``fp16`` reduce-scatter: ``n(n−1)``
    sendrecvs of a ``P/n`` chunk and ``n(n−1)`` all-gather messages of the ``P/n`` averaged
    chunk; ``powersgd`` rank 2: two all-reduces, of ``m_1 = 8·rows`` and ``m_2 = 8·cols`` bytes.
    """
    d = rows * cols
    if case == "threshold":
        script = _step_script()
        assert cols == script.COLS
        v = np.float32(script.THRESHOLD_V)
        counts = [int((np.abs(np.asarray(script.gradient(r, rows)["w"])) >= v).sum()) for r in range(n)]
        bucket = min(b for b in bucket_sizes(8 * d) if b >= 8 * max(counts))
        bits, strategy = 8 * (bucket + 4), "allgather"
        bound = _protocol_bound(n * (n - 1), 4) + _protocol_bound(n * (n - 1), bucket)
    elif case == "none":
        bits, strategy = 32 * d, "allreduce"
        bound = _protocol_bound(2 * n * (n - 1), 4 * d // n)
    elif case == "topk":
        k = max(1, round(0.01 * d))
        bits, strategy = k * (32 + 32), "allgather"  # float32 values, int32 indices (d > 2**16)
        bound = _protocol_bound(n * (n - 1), k * 8)
    elif case == "fp16":
        bits, strategy = 16 * d, "reduce_scatter"  # (n − 1) chunks of d/n entries + the averaged chunk
        bound = _protocol_bound(2 * n * (n - 1), 2 * d // n)
    elif case == "powersgd":
        bits, strategy = 32 * 2 * (rows + cols), "rounds"
        bound = _protocol_bound(2 * n * (n - 1), 8 * rows // n) + _protocol_bound(2 * n * (n - 1), 8 * cols // n)
    else:
        raise ValueError(f"case: unknown {case!r}")
    return {"wire_bits": bits, "strategy": strategy, "bound": bound}


@pytest.mark.mpi
@pytest.mark.parametrize("n, rows", [(2, 512), (4, 1024)])  # 2 MiB and 4 MiB float32 gradients
def test_compressed_mean_step_bytes_match_cost_model(namespaces, tmp_path, n, rows):
    from jaxcomm import cost_model

    out = tmp_path / "steps.json"
    env = {**os.environ, **RING, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, str(STEP_SCRIPT), str(rows), str(out)]
    res = netem.launch(n, cmd, bandwidth="400mbit", env=env, timeout=300, capture_output=True, cwd=ROOT)
    assert res.returncode == 0, (res.stderr or "")[-3000:]
    report = json.loads(out.read_text())
    assert report["n"] == n and report["shape"] == [rows, 1024]
    assert set(report["cases"]) == {"none", "topk", "threshold", "fp16", "powersgd"}
    rate, burst = res.settings["bandwidth_bps"], res.settings["burst_bytes"]
    hdr = _link.HEADER_BYTES
    for case, c in report["cases"].items():
        want = step_expectations(case, n, rows, 1024)
        win, bar = c["window"], c["barriers"]
        assert win["drops"] == 0 and bar["drops"] == 0 and win["qdisc"] == "tbf"
        # A retransmitted segment crosses the link twice; the script measures again until a
        # window has none (a tail loss probe after a delayed ACK added ~4 KB to a 25 KB window).
        assert win["retransmitted"] == 0 and bar["retransmitted"] == 0, (case, c)
        # (b) the pipeline's own count, against the compressor's closed form
        assert c["wire_bits"] == want["wire_bits"], (case, c)
        assert c["messages"] == {"none": 1, "topk": 1, "threshold": 2, "fp16": n, "powersgd": 2}[case], (case, c)
        # (a) the cost model's prediction from wire_bits, against the kernel's count
        predicted = cost_model.step_bytes(want["strategy"], c["wire_bits"] / 8, n)
        measured = (win["bytes"] - hdr * win["packets"]) - (bar["bytes"] - hdr * bar["packets"])
        assert predicted <= measured <= predicted + want["bound"], (case, measured, predicted, want, c)
        # The link passes at most burst + rate · t / 8 bytes in t seconds (token bucket); the
        # timed part of the window excludes one barrier, so its bytes (W_b at most) are taken off.
        assert win["wall_s"] >= 8 * (win["bytes"] - bar["bytes"] - burst) / rate, (case, c)
        # step_time with α = 0 is the time that many bytes take at the link's rate.
        t = cost_model.step_time(
            want["strategy"], c["wire_bits"] / 8, n, cost_model.Network(rate / 1e9, 0.0), messages=c["messages"]
        )
        assert t == pytest.approx(8 * predicted / rate)


# --------------------------------------------------------------------------- #
# An emulated cluster of nodes: jax.distributed, N processes x K CPU devices
# --------------------------------------------------------------------------- #
CLUSTER = ROOT / "experiments" / "benchmarks" / "cluster.py"


def test_jax_cluster_hierarchical_step_matches_one_process_and_the_link_carries_the_slow_axis(
    namespaces, tmp_path, monkeypatch, capsys
):
    """``jaxcomm launch --jax -n 2 --devices-per-process 2``: 2 nodes x 2 CPU devices under
    jax.distributed (gloo over TCP), the hierarchical compressed mean (scaled sign with the residual
    memory over ``("node", "local")``, EF-SignSGD: quick to compile) of two ``(64, 1024)`` float32
    leaves per worker.

    * The two steps' updates and the slow axis' reported bytes equal those of the same step on this
      process's 2x2 mesh.
    * The nodes sent the slow axis' all-gathers: per step ``N · Cluster.node_bytes`` (``L`` groups of
      ``N (N − 1) P`` payload bytes), at least that and at most 4 KiB more (gloo's per-message
      headers and the coordinator's keep-alives: about 1.2 KB measured with top-k). The fast axis' dense
      reduce-scatter and all-gather (512 KiB per worker in float32) stay in memory: counted on the
      link they would exceed the bound a hundredfold.
    """
    why = netem.unavailable(cluster=True)
    if why:
        pytest.skip(why)
    assert cli.main(["launch", "--check", "--jax"]) == 0
    import jax

    from jaxcomm import cost_model

    bench = _module(CLUSTER)  # its Step, the job's worker
    rows, n, k = 64, 2, 2
    out, updates, report = tmp_path / "job.json", tmp_path / "updates.npz", tmp_path / "report.json"
    config = {"rows": rows, "rounds": 1, "routes": ["hierarchical"], "methods": ["sign"], "out": str(out)}
    config["updates"] = str(updates)
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    argv = ["launch", "--jax", "-n", str(n), "--devices-per-process", str(k), "--bandwidth", "100mbit"]
    argv += ["--timeout", "240", "--report", str(report), "--", sys.executable, str(CLUSTER), "--worker"]
    assert cli.main([*argv, json.dumps(config)]) == 0, capsys.readouterr().err[-3000:]
    assert "2 nodes x 2 devices, each node's link 100 Mbit/s" in capsys.readouterr().err
    job, total = json.loads(out.read_text()), json.loads(report.read_text())
    assert (job["nodes"], job["devices_per_node"]) == (n, k)
    assert total["devices_per_process"] == k and len(total["node_bytes"]) == n and all(total["node_bytes"])

    # the one-process reference: the same step on this process's first 4 devices
    step = bench.Step("hierarchical", "sign", jax.devices()[: n * k], n, k, rows)
    state = step.init(step.zeros())
    with np.load(updates) as got:
        for t in range(2):
            u, state = step.update(step.grads(t), state)
            for leaf in bench.LEAVES:
                np.testing.assert_array_equal(np.asarray(u[leaf]), got[f"hierarchical/sign/{t}/{leaf}"])
    row = job["configs"]["hierarchical/sign"]
    # each leaf's shard: rows·1024/L signs in bits and one float32 scale
    assert row["reported_bytes"] == bench.reported(state)[0] == len(bench.LEAVES) * (rows * 1024 // k // 8 + 4)

    predicted = n * cost_model.Cluster(n, k).node_bytes("allgather", row["reported_bytes"], n)
    assert predicted == k * n * (n - 1) * row["reported_bytes"]
    (m,) = row["measured"]
    assert m["window"]["drops"] == 0 and m["window"]["retransmitted"] == 0 and m["window"]["qdisc"] == "tbf"
    assert predicted <= m["payload_bytes"] <= predicted + 4096, (m, predicted)


def test_jax_job_environment_and_a_failing_node_ends_the_others(namespaces, tmp_path):
    """Every process of ``launch(..., devices_per_process=3)`` finds its node's address as its host name
    and the jax.distributed environment; when node 1 exits with 3, node 0 (asleep) is ended and the
    job's status is 3 (before its timeout)."""
    why = netem.unavailable(cluster=True)
    if why:
        pytest.skip(why)
    keys = ["JAX_PROCESS_ID", "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PLATFORMS"]
    keys += ["JAX_CPU_COLLECTIVES_IMPLEMENTATION", "XLA_FLAGS"]
    code = (
        "import json, os, socket, sys, time\n"
        "pid, out = os.environ['JAX_PROCESS_ID'], sys.argv[1]\n"
        f"open(out + pid, 'w').write(json.dumps([socket.gethostname(), *[os.environ[k] for k in {keys!r}]]))\n"
        "while not all(os.path.exists(out + p) for p in '01'): time.sleep(0.05)\n"
        "sys.exit(3) if pid == '1' else time.sleep(300)\n"
    )
    out = tmp_path / "env"
    res = netem.launch(2, [sys.executable, "-c", code, str(out)], devices_per_process=3, timeout=120)
    assert (res.returncode, res.timed_out, res.devices_per_process, res.qdisc) == (3, False, 3, "pfifo")
    for pid in (0, 1):
        host, *env = json.loads(Path(f"{out}{pid}").read_text())
        assert host == f"192.0.2.{pid + 1}" == _cluster.node_address(pid)
        # the device count replaced, the parent's other XLA flags (the suite's compile options) kept
        flags = " ".join([*suite_xla_flags().split(), "--xla_force_host_platform_device_count=3"])
        assert env == [str(pid), "192.0.2.1:8476", "2", "cpu", "gloo", flags]
