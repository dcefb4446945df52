"""The launcher's processes inside the job's namespaces: set the links up, run the job, count its bytes.

:func:`jaxcomm.netem.launch` starts ``main(["--inner", SPEC])`` in a new network namespace
(:func:`_job_command`). For an MPI job that process shapes its loopback and runs ``mpirun`` between
two readings of the counters (:func:`_run_counted`). For a ``jax.distributed`` job it is the switch:
it starts one ``main(["--node", SPEC, I, FD])`` per node in network and UTS namespaces of its own,
plugs each node's ``eth0`` into the bridge, and sums what the nodes' records say (:func:`_run_nodes`).
Every record is a JSON file next to ``SPEC``, which the launcher reads when the job has ended.

Standard library only, so that these processes start fast.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from ._cluster import BRIDGE, VETH_MTU, node_address
from ._counters import link_counters

_CLONE_NEWNET = 0x40000000
_CLONE_NEWUTS = 0x04000000
_PACKAGE_PARENT = Path(__file__).resolve().parents[2]


def _job_command(*args: str) -> list[str]:
    """The command line of a launcher process in the namespaces: :func:`main` with ``args`` in a
    fresh interpreter that imports this copy of jaxcomm (``-P``: nothing else, not even the working
    directory, is put on its ``sys.path``; the job's environment is not changed)."""
    code = (
        f"import sys; sys.path.insert(0, {str(_PACKAGE_PARENT)!r}); "
        "from jaxcomm.netem._job import main; sys.exit(main(sys.argv[1:]))"
    )
    return [sys.executable, "-P", "-c", code, *args]


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
            _job_command("--node", spec_path, str(i), str(read)),
            pass_fds=(read,), preexec_fn=_enter_node_namespaces,
        )  # fmt: skip
        os.close(read)
        nodes.append((proc, write))
        error = _run_setup(
            [
                ["ip", "link", "add", f"jcn{i}", "type", "veth", "peer", "name", "eth0", "netns", str(proc.pid)],
                ["ip", "link", "set", "dev", f"jcn{i}", "mtu", str(VETH_MTU), "master", BRIDGE, "up"],
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


def main(argv: Sequence[str]) -> int | str:
    """The launcher's process inside the namespaces: ``--inner SPEC`` (the job, or the switch of a
    ``jax.distributed`` job) or ``--node SPEC INDEX FD`` (one node); its exit status, or the usage
    line (``sys.exit`` prints it and exits with 1)."""
    if len(argv) == 2 and argv[0] == "--inner":
        return _inner(argv[1])
    if len(argv) == 4 and argv[0] == "--node":
        return _node(argv[1], int(argv[2]), int(argv[3]))
    return "usage: jaxcomm launch -n N [--bandwidth R] [--latency T] -- CMD ARGS..."
