"""Launching a job on the emulated network: the checks, the namespace, and what the job sent.

:func:`launch` checks its options, then runs the job from a launcher process in a new network
namespace (:mod:`jaxcomm.netem._job`), ends every process of that namespace on every exit path, and
returns the :class:`LaunchResult`; :func:`missing_requirements` and :func:`unavailable` say
whether this machine can.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
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

from ._cluster import BRIDGE, MAX_DEVICES_PER_PROCESS, MAX_NODES, VETH_MTU, cluster_env
from ._job import _enter_private_netns, _job_command
from ._link import LOOPBACK_MTU, LinkSettings, NetemError, NetemUnavailable, link_settings, qdisc_commands

MAX_PROCESSES = 256
"""The most MPI processes :func:`launch` starts (``-n``): all of them share this machine."""
MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""The longest ``timeout`` of a job accepted, in seconds (7 days)."""

RING_COLLECTIVES = {
    "OMPI_MCA_coll_tuned_use_dynamic_rules": "1",
    "OMPI_MCA_coll_tuned_allreduce_algorithm": "4",
    "OMPI_MCA_coll_tuned_allgather_algorithm": "4",
}
"""Environment that makes Open MPI's tuned collectives use the ring all-reduce (algorithm 4) and
the ring all-gather (algorithm 4), the algorithms :mod:`jaxcomm.cost_model`'s step formulas
describe (pass it in ``env`` of :func:`launch`)."""

_CAP_NET_ADMIN = 12
_CAP_SYS_ADMIN = 21


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
    """:func:`jaxcomm.comm._launch.mpirun_env` with Open MPI on TCP only, over ``lo``.

    ``OMPI_MCA_btl=self,tcp`` (no shared memory, so bytes between ranks cross the
    link) and ``OMPI_MCA_btl_tcp_if_include=lo`` (Open MPI skips loopback by default).
    Values already in ``base`` for other ``OMPI_MCA_*`` keys (a collective algorithm,
    say) are kept.
    """
    from ..comm._launch import mpirun_env

    env = mpirun_env(single_thread=single_thread, base=base)
    env["OMPI_MCA_btl"] = "self,tcp"
    env["OMPI_MCA_btl_tcp_if_include"] = "lo"
    env.pop("OMPI_MCA_btl_tcp_if_exclude", None)
    env["OMPI_MCA_oob_tcp_if_include"] = "lo"
    env["PRTE_MCA_oob_tcp_if_include"] = "lo"
    return env


def _exported_missing_requirements() -> Callable[[], list[str]]:
    """``jaxcomm.netem.missing_requirements``, looked up in the package at each call: the check
    :func:`unavailable` and :func:`launch` run is the one the package exports, so replacing it there
    (as a test of the missing-privilege path does) replaces it for them too."""
    from . import missing_requirements as exported

    return exported


def unavailable(timeout: float = 30.0, *, cluster: bool = False) -> str | None:
    """``None`` if this machine can run :func:`launch`, else one sentence saying why not.

    Checks :func:`missing_requirements`, then tries it: a child process makes a private
    network namespace and installs a token-bucket qdisc on its loopback (a container may
    grant the capabilities and still refuse namespaces or qdiscs); with ``cluster`` (a
    ``jax.distributed`` job's needs) it also makes a bridge and a veth pair there. Nothing
    outside that namespace is touched.
    """
    missing = _exported_missing_requirements()()
    if missing:
        return "network namespaces are not available here: lacks " + "; ".join(missing)
    probe = "ip link set lo up && tc qdisc add dev lo root tbf rate 1gbit burst 256kb latency 400ms"
    if cluster:
        probe += f" && ip link add {BRIDGE} type bridge && ip link add jcn0 type veth peer name eth0"
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
    emulated node (:mod:`jaxcomm.netem`).

    Long because every argument is checked before anything is launched, in the order the errors are reported;
    the processes are in ``_job``.

    The job runs in a new network namespace whose loopback carries every byte
    between ranks (:func:`mpirun_netem_env`), shaped by the qdisc that
    ``bandwidth``/``latency`` select (:mod:`jaxcomm.netem`). ``bytes`` in the result is
    the qdisc's counter at the end: all TCP traffic of the job -- Open MPI's
    start-up (connection handshakes, the runtime's wire-up) included.

    One function for the whole job, in this order: check every option (nothing has started when
    one is refused), shape the link, run the job, count what it sent, write the report. Its length
    is the description of its fourteen options; the steps are short helpers.

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
    command = _checked_job(n, command, devices_per_process, mpirun_args, timeout)
    settings = link_settings(bandwidth, latency, burst, mtu)
    if cluster:  # the nodes' links are veth devices, whose MTU is at most 65535
        settings = dataclasses.replace(settings, mtu=min(settings.mtu, VETH_MTU))
    if report is not None:
        from .._paths import check_output_path

        try:
            report = check_output_path(report, "--report", folder=False)
        except ValueError as e:
            raise NetemError(str(e)) from None
    missing = (check_requirements or _exported_missing_requirements())()
    if missing:
        raise NetemUnavailable(
            "jaxcomm.netem needs a private network namespace with a shaped loopback; this process lacks: "
            + "; ".join(missing)
            + ". Run as root (e.g. sudo, or a container with --cap-add NET_ADMIN --cap-add SYS_ADMIN)."
        )
    job_env, spec = _job_spec(n, command, settings, env, mpirun_args, devices_per_process)
    mpi_cmd = spec["command"]
    data, stdout, stderr, timed_out, returncode = _run_in_namespace(spec, job_env, cwd, capture_output, timeout)
    if "setup_error" in data:
        raise NetemUnavailable(f"setting up the emulated link failed: {data['setup_error']}")
    after = data.get("after") or {"bytes": 0, "packets": 0, "drops": 0, "kind": ""}
    before = data.get("before") or {"bytes": 0, "packets": 0, "drops": 0}
    rc = data.get("returncode")
    if rc is None:  # the inner launcher did not report: mpirun's own status
        rc = -1 if returncode is None else returncode
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


def _checked_job(
    n: int, command: Sequence[str], devices_per_process: int | None, mpirun_args: Sequence[str], timeout
) -> list[str]:
    """:func:`launch`'s checks of the job's size, command and timeout; the command as strings.

    Raises:
      NetemError: naming the option (``-n``, ``--devices-per-process``, ``mpirun_args``, ``command``,
        ``--timeout``).
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
    return command


def _job_spec(
    n: int,
    command: list[str],
    settings: LinkSettings,
    env: dict | None,
    mpirun_args: Sequence[str],
    devices_per_process: int | None,
) -> tuple[dict, dict]:
    """What :func:`launch` runs in the namespace: ``(environment, spec)``, the spec's ``setup`` the
    commands that shape the link (an MPI job's loopback, or a cluster's switch), ``nodes`` a
    cluster's count and each node's link set-up (``None`` for an MPI job), ``command`` the job.

    Raises:
      NetemUnavailable: an MPI job, and no ``mpirun``.
    """
    if devices_per_process is not None:
        setup = [["ip", "link", "set", "dev", "lo", "up"], ["ip", "link", "add", BRIDGE, "type", "bridge"],
                 ["ip", "link", "set", "dev", BRIDGE, "up"]]  # fmt: skip
        nodes = {"count": n, "setup": qdisc_commands(settings, "eth0")}  # each node's link in its namespace
        return cluster_env(n, devices_per_process, env), {"setup": setup, "command": command, "nodes": nodes}
    from ..comm._launch import mpirun_path

    mpirun = mpirun_path()
    if mpirun is None:
        raise NetemUnavailable("mpirun not found: install the project's 'mpi' extra (pip install -e .[mpi])")
    mpi_cmd = [mpirun, "-n", str(n), "--oversubscribe", *map(str, mpirun_args), *command]
    return mpirun_netem_env(base=env), {"setup": qdisc_commands(settings), "command": mpi_cmd, "nodes": None}


def _run_in_namespace(
    spec: dict, env: dict, cwd: str | Path | None, capture_output: bool, timeout: float | None
) -> tuple[dict, str | None, str | None, bool, int | None]:
    """Run the job of ``spec`` (``setup``, ``command``, ``nodes``) from a launcher process in a new
    network namespace (:func:`jaxcomm.netem._job.main`), and end every process of it on every exit
    path; ``(record, stdout, stderr, timed_out, returncode)``, the record being what the process in
    the namespace wrote (``{}`` if nothing) and ``returncode`` that process's exit status."""
    with tempfile.TemporaryDirectory(prefix="jaxcomm-netem-") as tmp:
        spec_path = Path(tmp) / "spec.json"
        out = Path(tmp) / "result.json"
        spec_path.write_text(json.dumps({**spec, "result": str(out)}))
        stdio = subprocess.PIPE if capture_output else None
        proc = subprocess.Popen(
            _job_command("--inner", str(spec_path)), env=env, cwd=cwd, stdout=stdio, stderr=stdio, text=True,
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
    return data, stdout, stderr, timed_out, proc.returncode
