"""The ``jaxcomm`` command line.

::

    jaxcomm list                                  # experiments and compressors
    jaxcomm run EXPERIMENT [--smoke | --full] [--devices N] [--set key=value ...] [--out DIR]
    jaxcomm demo [--devices N]                    # every compressor on a real model's gradients
    jaxcomm launch -n N [--bandwidth 200mbit] [--latency 0.1ms] [--report FILE] -- CMD ARGS...
    jaxcomm launch --jax -n N --devices-per-process K [--bandwidth 100mbit] -- python script.py
    jaxcomm launch --check                        # can this machine emulate a network?

``--devices N`` simulates N CPU devices (it sets ``XLA_FLAGS`` before jax is
imported). Each run writes ``results.json`` and PNG plots into ``--out``
(default ``runs/EXPERIMENT``) and prints a summary table.

``jaxcomm run EXPERIMENT --help`` lists every configuration key with its type,
default and meaning.

The experiments are the studies found by :mod:`jaxcomm.studies`: the folder named by
``JAXCOMM_EXPERIMENTS``, else the ``experiments/`` folder of the current directory or
the nearest one above it (a checkout of the repository), and the modules of installed
packages' ``jaxcomm.studies`` entry points. Where there are none, ``list`` and ``run``
say so in one line (exit status 2).

A method (quickstart's ``--set methods=...``, comma-separated) is a label or a
spec ``COMPRESSOR[(k=v, ...)][+MEMORY[(k=v, ...)]][@STRATEGY]``, e.g.
``topk(ratio=0.01)+residual@allgather``; the grammar is in the documentation's
command-line page, section "Method specs" (``docs/api/cli.md``).

``launch`` runs ``mpirun -n N CMD ARGS...`` on an emulated network (a private
network namespace whose loopback is throttled; :mod:`jaxcomm.netem`) and prints
the bytes the kernel sent through it; it needs root. ``launch --jax`` runs N
processes of CMD under ``jax.distributed`` instead (gloo over TCP), K CPU devices
each (``--devices-per-process``, default 1), each process an emulated node with its
own link to a switch: the traffic inside a node stays in memory, the traffic
between nodes crosses the shaped links and is counted (the script calls
``jaxcomm.netem.initialize_distributed()``). ``launch --check`` tries to make such
a namespace and exits 0 if it can, else 1 with the reason.

Errors. Every command checks all of its input before it starts any work: the
options, every configuration key against its study's config (types; ranges such
as ``steps`` >= 1, ``learning_rate`` > 0, ``momentum`` in [0, 1); floats finite,
ints within 64 bits; no empty list where the study would run nothing; a global
batch the workers can share), the method specs (grammar, names and argument names
checked without importing JAX), and that ``--out`` or ``--report`` can be written.
A bad input is one line on stderr, ``error: ...`` naming the option or key and,
where there is one, the limit (``--devices`` at most 1024; ``launch -n`` at most
256 processes, 254 with ``--jax``, ``--devices-per-process`` at most 1024, a rate at
most 1tbit, ``--timeout`` at most 7 days); the exit
status is 2, there is no traceback and nothing is created (no output folder).
Such errors appear in well under a second, except for a method spec whose
argument values need the compressor itself to be built (``topk(ratio=5)``),
which imports JAX first. A failure during the run itself (after the checks) is a
traceback and exit status 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

from ._table import format_table

__all__ = [
    "main",
]


def _plain(text: str) -> str:
    """Module docstring reStructuredText as plain text: no ``::`` markers, inline literals or roles."""
    import re

    text = text.replace("::\n", "\n").replace("``", "")
    return re.sub(r":[a-z]+:`([^`]*)`", r"\1", text).strip()


class _UsageError(Exception):
    """A command line argparse cannot read (printed as one ``error:`` line by :func:`main`)."""


class _Parser(argparse.ArgumentParser):
    """argparse, whose errors are one ``error:`` line (via :func:`main`) instead of usage and a message."""

    def error(self, message: str):  # raises instead of exiting
        raise _UsageError(message)


def _fail(message: object) -> int:
    """Print ``error: message`` as one line on stderr; the exit status 2."""
    print("error: " + " ".join(str(message).splitlines()), file=sys.stderr)
    return 2


def _check_devices(n: int | None) -> None:
    """``ValueError`` unless ``n`` (``--devices``) is ``None`` or within the studies' device range."""
    if n is not None:
        from .studies import MAX_DEVICES, check_range

        check_range("--devices", n, (1, MAX_DEVICES, True, True))


def _set_devices(n: int | None) -> None:
    """Simulate ``n`` CPU devices: set ``XLA_FLAGS`` before jax initialises its backend.

    Raises ``ValueError`` if jax was initialised with fewer devices before (the flag cannot apply).
    """
    if n is None:
        return
    _check_devices(n)
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    flags.append(f"--xla_force_host_platform_device_count={n}")
    os.environ["XLA_FLAGS"] = " ".join(flags)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax  # the backend reads XLA_FLAGS when first used, i.e. now

    if jax.device_count() < n:
        raise ValueError(
            f"--devices {n}: jax was initialised with {jax.device_count()} device(s) before the flag could apply"
        )


def _parse_sets(items: list[str]) -> dict:
    """``--set KEY=VALUE`` items as ``{KEY: VALUE}`` (strings; a key given twice: the last value)."""
    out = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--set expects KEY=VALUE (e.g. --set steps=100); got {item!r}")
        k, v = item.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def _cmd_list(args) -> int:
    from . import compressors
    from .studies import experiment_names, get_experiment

    try:
        names = experiment_names()
    except ValueError as e:  # no studies found, or a folder of studies that cannot be imported
        return _fail(e)
    print("Experiments:")
    for name in names:
        print(f"  {name:20s} {get_experiment(name).description}")
    print("\nCompressors:")
    print("  " + ", ".join(compressors.names()))
    return 0


def _cmd_run(args) -> int:
    from ._paths import check_output_path
    from .studies import config_to_dict, get_experiment

    if args.experiment is None:
        if args.help:
            args.run_parser.print_help()
            return 0
        return _fail("run: give an EXPERIMENT (jaxcomm list names them), or run --help")
    variant = " --smoke" if args.smoke else " --full" if args.full else ""
    try:  # every check, before anything is created (JAX is imported last, by _set_devices)
        exp = get_experiment(args.experiment)
        if args.help:
            _print_run_help(args.run_parser, exp)
            return 0
        _check_devices(args.devices)
        overrides = _parse_sets(args.set or [])
        if args.devices is not None and "devices" in {f.name for f in dataclasses.fields(exp.config_type)}:
            overrides["devices"] = args.devices  # --devices is the study's worker count
        config = exp.config(smoke=args.smoke, overrides=overrides, full=args.full)
        out = Path(args.out or Path("runs") / (exp.name + variant.replace(" --", "-")))
        check_output_path(out, "--out", folder=True)
        # The study's own worker count (or --devices): simulate that many CPU devices.
        _set_devices(int(config.devices) if hasattr(config, "devices") else args.devices)
    except ValueError as e:
        return _fail(e)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return _fail(f"--out: cannot make the folder {str(out)!r}: {e.strerror}")
    from .studies import provenance, write_results

    print(f"jaxcomm run {exp.name}{variant} -> {out}")
    t0 = time.time()
    which = "smoke" if args.smoke else "full" if args.full else "default"
    results = exp.run(config, out, variant=which)  # a smoke run's figures say so in their titles
    results.setdefault("config", config_to_dict(config))
    results.setdefault("experiment", exp.name)
    results["variant"] = which
    results["provenance"] = {**provenance(), "command": ["jaxcomm", *args.argv]}
    results["wall_time_s"] = time.time() - t0
    path = write_results(out, results)
    print(format_table(exp.summary(results)))
    pngs = sorted(str(p) for p in out.glob("*.png"))
    print(f"\nresults: {path}")
    if pngs:
        print("figures: " + ", ".join(pngs))
    return 0


def _print_run_help(parser, exp) -> None:
    """``jaxcomm run NAME --help``: the options, then every config key with type, default and meaning."""
    from .studies import config_help

    parser.print_help()
    print(f"\nconfig keys of {exp.name} ({exp.description}); override with --set KEY=VALUE:")
    for key, type_name, default, meaning in config_help(exp.config_type):
        print(f"  {key} ({type_name}, default {default})")
        if meaning:
            print(f"      {meaning.replace('``', '').replace(':data:', '')}")


def _cmd_demo(args) -> int:
    try:
        _set_devices(args.devices)
    except ValueError as e:
        return _fail(e)
    from .demo import run_demo

    run_demo()
    return 0


def _cmd_launch(args) -> int:
    from . import netem

    if args.check:
        why = netem.unavailable(cluster=args.jax)
        print(why or "jaxcomm launch: network emulation is available here", file=sys.stderr)
        return 0 if why is None else 1
    if args.n is None:
        return _fail("launch: give the number of processes, -n N")
    if args.devices_per_process is not None and not args.jax:
        return _fail("--devices-per-process: only with --jax (a jax.distributed job); an MPI job has no devices")
    devices = (1 if args.devices_per_process is None else args.devices_per_process) if args.jax else None
    command = list(args.cmd)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        return _fail("launch: give the command after --, e.g. jaxcomm launch -n 2 -- python train.py")
    try:
        result = netem.launch(
            args.n,
            command,
            bandwidth=args.bandwidth,
            latency=args.latency,
            burst=args.burst,
            mtu=args.mtu,
            timeout=args.timeout,
            report=args.report,
            devices_per_process=devices,
        )
    except (netem.NetemError, netem.NetemUnavailable) as e:
        return _fail(e)
    s = result.settings
    rate = "unlimited" if s["bandwidth_bps"] is None else f"{s['bandwidth_bps'] / 1e6:g} Mbit/s"
    job = f"{result.n} processes, link"
    if devices is not None:
        job = f"{result.n} nodes x {devices} devices, each node's link"
    print(
        f"jaxcomm launch: {job} {rate}, latency {s['latency_s'] * 1e3:g} ms, "
        f"qdisc {result.qdisc}: {result.bytes} bytes in {result.packets} packets "
        f"({result.drops} dropped), {result.wall_s:.2f} s" + (" (timed out)" if result.timed_out else ""),
        file=sys.stderr,
    )
    if args.report:
        print(f"report: {args.report}", file=sys.stderr)
    return result.returncode if result.returncode >= 0 else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``jaxcomm`` command (also ``python -m jaxcomm``)."""
    parser = _Parser(
        prog="jaxcomm", description=_plain(__doc__ or ""), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_list = sub.add_parser("list", help="list experiments and compressors")
    p_list.set_defaults(func=_cmd_list)
    p_run = sub.add_parser("run", help="run an experiment", add_help=False)
    p_run.add_argument("experiment", nargs="?", default=None)
    p_run.add_argument("-h", "--help", action="store_true", help="show this help and the config keys of EXPERIMENT")
    p_run.add_argument("--smoke", action="store_true", help="the small configuration (under a minute)")
    p_run.add_argument("--full", action="store_true", help="the larger study, where an experiment has one")
    p_run.add_argument("--devices", type=int, default=None, help="simulated CPU devices (sets XLA_FLAGS)")
    p_run.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key")
    p_run.add_argument("--out", default=None, help="output folder (default runs/EXPERIMENT)")
    p_run.set_defaults(func=_cmd_run, run_parser=p_run)
    p_demo = sub.add_parser("demo", help="compress a real model's gradients with every compressor")
    p_demo.add_argument("--devices", type=int, default=None)
    p_demo.set_defaults(func=_cmd_demo)
    p_launch = sub.add_parser(
        "launch",
        help="run an MPI or jax.distributed job on an emulated network (root) and count its bytes",
        description="Run mpirun -n N CMD in a private network namespace whose loopback is throttled "
        "(Open MPI over TCP only), or with --jax N processes of CMD under jax.distributed, each an emulated "
        "node with its own throttled link to a switch, and report the bytes the kernel sent through the links.",
    )
    p_launch.add_argument("-n", type=int, default=None, help="number of MPI processes (with --jax: nodes)")
    p_launch.add_argument(
        "--jax", action="store_true", help="a jax.distributed job (gloo over TCP), one process per emulated node"
    )
    p_launch.add_argument(
        "--devices-per-process", type=int, default=None, metavar="K", help="with --jax: CPU devices per process"
    )
    p_launch.add_argument(
        "--check",
        action="store_true",
        help="only check that this machine can emulate a network (with --jax: a cluster) (exit 0 or 1)",
    )
    p_launch.add_argument(
        "--bandwidth",
        default="unlimited",
        help="shared link rate (with --jax: each node's link): 200mbit, 1gbit, ... or unlimited",
    )
    p_launch.add_argument("--latency", default="0", help="delay added per packet: 0.1ms, 50us, ... (needs sch_netem)")
    p_launch.add_argument(
        "--burst",
        default="256kb",
        help="token bucket size: 256kb, or a time at the rate, e.g. 1ms (at least one packet; default 256kb)",
    )
    p_launch.add_argument(
        "--mtu", type=int, default=65536, help="loopback MTU in bytes (default 65536; 1500: Ethernet)"
    )
    p_launch.add_argument(
        "--timeout", type=float, default=None, help="seconds; then every process of the job is killed"
    )
    p_launch.add_argument(
        "--report", default=None, metavar="FILE", help="write bytes, packets, seconds, settings as JSON"
    )
    p_launch.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    p_launch.set_defaults(func=_cmd_launch)
    try:
        args = parser.parse_args(argv)
    except _UsageError as e:
        return _fail(e)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # recorded with the results
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
