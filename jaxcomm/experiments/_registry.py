"""Experiment registry: each paper study is a named :class:`Experiment`.

An experiment has a typed configuration (a frozen dataclass with ``default()``,
the full study, and ``smoke()``, under a minute on 2 cores, run by the tests)
and a runner ``run(config: dict, out_dir) -> dict`` that writes
``results.json`` and PNG figures into ``out_dir``. The runner is named by a
``"module:function"`` string and imported on the first run, so that
registering and listing experiments imports neither JAX nor Flax.

Configurations travel as flat dicts of JSON values (``--set key=value``,
``results.json``): :func:`config_to_dict` and :func:`config_from_dict` convert
between a dataclass instance and that form; tuple fields become lists.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib
import json
import math
import os
import socket
import subprocess
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "Experiment",
    "register_experiment",
    "get_experiment",
    "experiment_names",
    "apply_overrides",
    "write_results",
    "config_to_dict",
    "config_from_dict",
    "config_help",
    "check_global_batch",
    "check_range",
    "MAX_DEVICES",
    "MAX_SET_CHARS",
]


def _default_summary(results: dict) -> list:
    """The rows of ``results["summary"]`` (empty if absent)."""
    return results.get("summary", [])


@dataclasses.dataclass(frozen=True)
class Experiment:
    """A reproducible study.

    Attributes:
      name: command-line name (``jaxcomm run NAME``).
      description: one line for ``jaxcomm list``.
      config_type: frozen dataclass of the configuration, with classmethods
        ``default()`` (the full study) and ``smoke()`` (the small one).
      runner: ``"module:function"`` of ``run(config: dict, out_dir: Path) -> dict``,
        imported on first use; it writes PNGs (and may write results.json).
      summary: ``results -> list[dict]`` rows for the printed table.
    """

    name: str
    description: str
    config_type: type[Any]  # a frozen dataclass with classmethods default() and smoke()
    runner: str
    summary: Callable[[dict], list] = _default_summary

    @property
    def default(self) -> dict:
        """The full configuration as a dict."""
        return config_to_dict(self.config_type.default())

    @property
    def smoke(self) -> dict:
        """The small configuration as a dict."""
        return config_to_dict(self.config_type.smoke())

    def config(self, smoke: bool = False, overrides: dict | None = None, *, full: bool = False) -> dict:
        """The configuration as a dict: ``default()``, ``smoke()`` or ``full()``, then ``overrides``.

        ``overrides`` values may be strings from ``--set`` (parsed as the field's
        type). ``full`` is the larger study of an experiment whose configuration defines
        ``full()`` (its default is then the shorter main job). Raises ``ValueError`` naming a
        key that is not a field, or a value of the wrong type; ``smoke`` with ``full``, or
        ``full`` for an experiment without it.
        """
        if smoke and full:
            raise ValueError("--smoke and --full: choose one configuration")
        if full and not callable(getattr(self.config_type, "full", None)):
            raise ValueError(f"--full: {self.name} has one study (its default); run it without --full")
        base = self.config_type.smoke() if smoke else self.config_type.full() if full else self.config_type.default()
        merged = apply_overrides(config_to_dict(base), overrides or {})
        return config_to_dict(config_from_dict(self.config_type, merged))

    def run(self, config: dict | Any, out_dir: Path, *, variant: str = "default") -> dict:
        """Validate ``config`` (a dict or a ``config_type`` instance) and run the study into ``out_dir``.

        ``variant`` names the configuration (one of :data:`VARIANTS`, as ``results.json`` records
        it); with ``"smoke"`` every figure the study saves says so in its title
        (:func:`figures_marked`).
        """
        from .._validate import check_choice

        variant = check_choice(variant, "variant", VARIANTS)
        values: dict = config_to_dict(config) if _is_dataclass_instance(config) else config
        values = config_to_dict(config_from_dict(self.config_type, values))
        module, _, function = self.runner.partition(":")
        with figures_marked(SMOKE_MARK if variant == "smoke" else ""):
            return getattr(importlib.import_module(module), function)(values, Path(out_dir))


VARIANTS = ("default", "smoke", "full")
SMOKE_MARK = " (smoke run)"
_mark: list[str] = [""]  # the suffix figures_marked puts on the titles of figures made now


@contextlib.contextmanager
def figures_marked(suffix: str):
    """Within the block, every figure pyplot makes ends its title with ``suffix`` when saved.

    One place for every study's figures: a ``figure.hooks`` entry (matplotlib's rc setting)
    wraps the new figure's ``savefig``, which then appends ``suffix`` to the figure's
    ``suptitle`` if it has one, else to the title of its only axes, else adds ``suffix`` as a
    ``suptitle``; and to a ``Title`` in the PNG's ``metadata``. ``""``: figures as drawn.
    """
    import matplotlib

    previous = _mark[0]
    _mark[0] = suffix
    try:
        with matplotlib.rc_context({"figure.hooks": [f"{__name__}:_mark_figure"]} if suffix else {}):
            yield
    finally:
        _mark[0] = previous


def _mark_figure(fig) -> None:
    """``figure.hooks`` entry of :func:`figures_marked`: ``fig.savefig`` appends the suffix first."""
    suffix, save = _mark[0], fig.savefig

    def savefig(*args, **kwargs):
        if not getattr(fig, "_jaxcomm_marked", False):  # once, however often it is saved
            fig._jaxcomm_marked = True
            if fig.get_suptitle():
                fig._suptitle.set_text(fig._suptitle.get_text() + suffix)
            elif len(fig.get_axes()) == 1:
                (ax,) = fig.get_axes()
                ax.set_title((ax.get_title() + suffix).strip())
            else:
                fig.suptitle(suffix.strip())
        meta = kwargs.get("metadata")
        if meta and "Title" in meta:
            kwargs["metadata"] = {**meta, "Title": meta["Title"] + suffix}
        return save(*args, **kwargs)

    fig.savefig = savefig


def _is_dataclass_instance(obj) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def config_to_dict(config) -> dict:
    """The flat JSON form of a config dataclass instance (tuples become lists)."""
    return {f.name: _jsonable(getattr(config, f.name)) for f in dataclasses.fields(config)}


def _jsonable(value):
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    return value


def _check_value(cls_name: str, key: str, value, hint):
    """``value`` as the field type ``hint`` (int -> float widening, list -> tuple); ``ValueError`` otherwise."""
    origin = typing.get_origin(hint)
    if origin is tuple:
        args = typing.get_args(hint)
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{cls_name}.{key}: expected a list, got {value!r}")
        item = args[0] if args else Any
        return tuple(_check_value(cls_name, f"{key}[{i}]", v, item) for i, v in enumerate(value))
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(hint):
            try:
                return _check_value(cls_name, key, value, option)
            except ValueError:
                continue
        raise ValueError(f"{cls_name}.{key}: {value!r} is none of {hint}")
    if hint is Any:
        return value
    if hint is type(None):
        if value is None:
            return None
        raise ValueError(f"{cls_name}.{key}: expected None, got {value!r}")
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if not -(2**63) <= value < 2**63:
                raise ValueError(f"{cls_name}.{key}: must be an integer within 64 bits; got {_digits(value)}")
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if isinstance(value, int) and abs(value) >= 2**63:
                raise ValueError(f"{cls_name}.{key}: must be a finite number; got {_digits(value)}")
            if not math.isfinite(value):
                raise ValueError(f"{cls_name}.{key}: must be a finite number; got {value!r}")
            return float(value)
    elif hint is str:
        if isinstance(value, str):
            return value
    else:
        return value
    raise ValueError(f"{cls_name}.{key}: expected {hint.__name__}, got {value!r}")


def _digits(value: int) -> str:
    """A huge integer, described by its length rather than printed."""
    return f"an integer of {len(str(abs(value)))} digits"


def config_from_dict(config_type: type, values: dict):
    """A ``config_type`` instance from its flat dict form, checking keys and value types.

    Raises ``ValueError`` for a key that is not a field (listing the valid ones),
    a missing field, or a value that is not of the field's type (ints are
    accepted for float fields, lists for tuple fields); a float that is not finite,
    an int beyond 64 bits; a number outside its field's range (:data:`_RANGES`, for
    scalars and for each item of a tuple); an empty tuple for a field whose default is
    not empty (it would run nothing); a name outside its field's choices.
    """
    names = [f.name for f in dataclasses.fields(config_type)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ValueError(
            f"unknown config key(s) {unknown} for {config_type.__name__}; valid keys: {', '.join(sorted(names))}"
        )
    missing = [n for n in names if n not in values]
    if missing:
        raise ValueError(f"{config_type.__name__}: missing config key(s) {missing}")
    hints = typing.get_type_hints(config_type)
    cls_name = config_type.__name__
    checked = {n: _check_value(cls_name, n, values[n], hints[n]) for n in names}
    defaults = {f.name: f.default for f in dataclasses.fields(config_type)}
    for n, v in checked.items():
        key = f"{cls_name}.{n}" if f"{cls_name}.{n}" in _RANGES else n
        for i, item in enumerate(v) if isinstance(v, tuple) else [(None, v)]:
            check_range(f"{cls_name}.{n}" + ("" if i is None else f"[{i}]"), key, item)
        if v == () and isinstance(defaults[n], tuple) and defaults[n]:
            raise ValueError(f"{cls_name}.{n}: give at least one item (an empty list runs nothing)")
        _check_choice(cls_name, n, v)
    return config_type(**checked)


MAX_DEVICES = 1024
"""The most simulated CPU devices a study (or ``--devices``) may ask for."""

_INF = float("inf")
_COUNT = (1, _INF, True, True)  # a count of at least one
_SIZE = (0, _INF, True, True)  # a count or a time that may be zero (0: all, or none)
_POSITIVE = (0.0, _INF, False, True)  # a rate, a time or a tolerance
_MOMENTUM = (0.0, 1.0, True, False)
_FRACTION = (0.0, 1.0, False, True)  # a kept fraction
# Ranges of the studies' numeric fields, by field name, or "ConfigClass.field" where one study
# gives a name another meaning: (low, high, low inclusive, high inclusive). A tuple field's
# range applies to each item. Every float must also be finite, every int within 64 bits.
_RANGES: dict[str, tuple[float, float, bool, bool]] = {
    **dict.fromkeys(
        ("steps", "batch_size", "eval_every", "eval_windows", "seq_len", "embed", "hidden", "sync_every"), _COUNT
    ),
    **dict.fromkeys(("batch_per_worker", "resnet_batch_per_worker", "severe_batch_per_worker"), _COUNT),
    **dict.fromkeys(("workers", "resnet_workers", "severe_workers", "history", "count", "features"), _COUNT),
    **dict.fromkeys(("train_points", "val_points", "batch_total", "severe_downsample", "severe_epochs"), _COUNT),
    "MicrobenchConfig.iterations": _COUNT,  # EventGradConfig.iterations <= 0 means "run epochs"
    "num_procs": (1, 256, True, True),
    "devices": (1, MAX_DEVICES, True, True),
    **dict.fromkeys(("train_examples", "test_examples", "resnet_test_examples", "corpus_chars"), _SIZE),
    **dict.fromkeys(("severe_train_examples", "severe_test_examples", "warmup", "warmup_steps"), _SIZE),
    **dict.fromkeys(("forced_iterations", "trace_tensors", "severe_warmup_epochs", "noise_std", "horizon"), _SIZE),
    **dict.fromkeys(("skew_unit_ms", "base_compute_ms", "delays_ms", "severe_min_ms", "severe_max_ms"), _SIZE),
    **dict.fromkeys(("learning_rate", "lr", "resnet_lr", "severe_lr", "epochs"), _POSITIVE),
    **dict.fromkeys(("timeout_s", "poll_s", "launch_timeout_s", "equal_loss_rtol"), _POSITIVE),
    **dict.fromkeys(("momentum", "resnet_momentum", "severe_momentum"), _MOMENTUM),
    **dict.fromkeys(("topk_ratio", "topk"), _FRACTION),
    "drop_ratio": (0.0, 1.0, True, False),  # the dropped fraction: 1 would send nothing
    "seed": (0, 2**32, True, False),  # PRNGKey keeps 32 bits: a larger seed would alias a smaller one
    "seeds": (0, 2**32, True, False),
    "snapshots_per_epoch": _COUNT,
    "delay_ms": _SIZE,
}


def _number(v: float) -> str:
    return "2**32" if v == 2**32 else f"{v:g}"


IMAGE_DATASETS = ("mnist", "fashion_mnist", "mnist5k", "digits")
"""The image datasets of the studies (``_common.load_image_task``)."""
IMAGE_MODELS = ("mlp", "eventgrad_cnn", "resnet20")
"""The image models of the studies (``_common.build_model``)."""
_CHOICES: dict[str, tuple[str, ...]] = {"dataset": IMAGE_DATASETS, "model": IMAGE_MODELS}


def _check_choice(cls_name: str, key: str, value) -> None:
    """``ValueError`` if a field named in :data:`_CHOICES` holds a name outside its choices."""
    if key in _CHOICES and value not in _CHOICES[key]:
        raise ValueError(f"{cls_name}.{key} must be one of {', '.join(_CHOICES[key])}; got {value!r}")


def check_range(label: str, key: str, value) -> None:
    """``ValueError`` naming ``label`` if ``value`` is a number outside the range of ``key`` in :data:`_RANGES`."""
    if key not in _RANGES or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    low, high, low_in, high_in = _RANGES[key]
    ok = (value >= low if low_in else value > low) and (value <= high if high_in else value < high)
    if not ok:
        if high == float("inf"):
            want = f"{'>=' if low_in else '>'} {_number(low)}"
        else:
            want = f"in {'[' if low_in else '('}{_number(low)}, {_number(high)}{']' if high_in else ')'}"
        raise ValueError(f"{label} must be {want}; got {value!r}")


def config_help(config_type: type) -> list[tuple[str, str, str, str]]:
    """``(key, type, default, meaning)`` for every field of ``config_type``.

    The meaning is the field's entry in the class docstring's ``Attributes:``
    section (entries naming several keys, ``a, b: ...``, apply to each).
    """
    meanings: dict[str, str] = {}
    base: int | None = None  # indentation of the entries under "Attributes:"
    current: list[str] = []
    for line in (config_type.__doc__ or "").splitlines():
        text = line.strip()
        indent = len(line) - len(line.lstrip())
        if text == "Attributes:":
            base = -1
            continue
        if base is None or not text:
            continue
        if base == -1:
            base = indent
        if indent < base:
            break
        head, sep, rest = text.partition(":")
        keys = [k.strip().strip("`") for k in head.split(",")]
        if indent == base and sep and all(k.isidentifier() for k in keys):
            current = keys
            for k in keys:
                meanings[k] = rest.strip()
        elif indent > base:
            for k in current:
                meanings[k] = (meanings[k] + " " + text).strip()
    hints = typing.get_type_hints(config_type)
    default = config_type.default()  # type: ignore[attr-defined]  # every registered config has one
    rows = []
    for f in dataclasses.fields(config_type):
        hint = hints[f.name]
        type_name = hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")
        rows.append((f.name, type_name, json.dumps(_jsonable(getattr(default, f.name))), meanings.get(f.name, "")))
    return rows


_EXPERIMENTS: dict[str, Experiment] = {}


def register_experiment(exp: Experiment) -> Experiment:
    """Add ``exp`` to the registry (names must be unique; ``config_type`` a frozen dataclass)."""
    if exp.name in _EXPERIMENTS:
        raise ValueError(f"experiment {exp.name!r} is already registered")
    cls = exp.config_type
    # typeshed's DataclassInstance does not declare __dataclass_params__, which @dataclass sets.
    if not (dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen):  # type: ignore[attr-defined]
        raise ValueError(f"config_type of {exp.name!r} must be a frozen dataclass; got {cls!r}")
    for method in ("default", "smoke"):
        if not callable(getattr(cls, method, None)):
            raise ValueError(f"config_type {cls.__name__} of {exp.name!r} needs a {method}() classmethod")
    if ":" not in exp.runner:
        raise ValueError(f"runner of {exp.name!r} must be 'module:function'; got {exp.runner!r}")
    _EXPERIMENTS[exp.name] = exp
    return exp


def experiment_names() -> list[str]:
    """Names of the registered experiments, sorted."""
    _load_all()
    return sorted(_EXPERIMENTS)


def get_experiment(name: str) -> Experiment:
    """The experiment called ``name``; ``ValueError`` listing valid names otherwise."""
    _load_all()
    try:
        return _EXPERIMENTS[name]
    except KeyError:
        raise ValueError(f"unknown experiment {name!r}; valid: {', '.join(sorted(_EXPERIMENTS))}") from None


def _split_top(text: str) -> list[str]:
    """``text`` split at the commas outside parentheses: ``"a(x=1,y=2),b"`` -> ``["a(x=1,y=2)", "b"]``."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [*parts, text[start:]]


MAX_SET_CHARS = 10_000
"""The longest ``--set`` value accepted, in characters."""


def _coerce(key: str, text: Any, like: Any):
    if not isinstance(text, str):
        return text
    if len(text) > MAX_SET_CHARS:
        raise ValueError(f"--set {key}: at most {MAX_SET_CHARS} characters; got {len(text)}")
    if isinstance(like, bool):
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"--set {key}: expected a boolean, got {text!r}")
    if isinstance(like, (int, float, list, dict)) or like is None:
        try:
            value = json.loads(text)
        except RecursionError:
            raise ValueError(f"--set {key}: brackets nested too deep in {text[:40]!r}...") from None
        except ValueError as e:
            if not isinstance(e, json.JSONDecodeError):  # e.g. an integer of more than 4300 digits
                raise ValueError(f"--set {key}: could not parse a value of {len(text)} characters: {e}") from None
            if like is None:
                return text
            if isinstance(like, list):  # a,b,c: each item parsed like the default's items (any literal if empty)
                item = like[0] if like else None
                return [_coerce(key, part.strip(), item) for part in _split_top(text) if part.strip()]
            raise ValueError(f"--set {key}: could not parse {text!r} as {type(like).__name__}") from None
        if isinstance(like, float) and isinstance(value, int):
            value = float(value)
        if isinstance(like, list) and not isinstance(value, list):  # one item: a list of one
            value = [_coerce(key, text, like[0])] if like else [value]
        if like is not None and not isinstance(value, type(like)):
            raise ValueError(f"--set {key}: expected {type(like).__name__}, got {text!r}")
        return value
    return text


def check_global_batch(config) -> None:
    """``ValueError`` unless ``config.batch_size`` (the global batch) is a multiple of ``config.devices``.

    Each of the ``devices`` workers takes ``batch_size / devices`` examples per step
    (:class:`jaxcomm.data.WorkerBatches`); the study's config calls this from ``__post_init__``.
    """
    name = type(config).__name__
    if config.devices >= 1 and config.batch_size % config.devices:
        raise ValueError(
            f"{name}.batch_size must be a multiple of {name}.devices (each worker takes batch_size / devices "
            f"examples); got batch_size={config.batch_size}, devices={config.devices}"
        )


def apply_overrides(config: dict, overrides: dict) -> dict:
    """Return ``config`` updated by ``overrides`` (values may be strings from ``--set``).

    Raises ``ValueError`` for a key not in ``config`` (listing the valid keys) or a
    value that does not parse as the default's type.
    """
    out = dict(config)
    for key, value in overrides.items():
        if key not in out:
            raise ValueError(f"unknown config key {key!r}; valid keys: {', '.join(sorted(out))}")
        out[key] = _coerce(key, value, out[key])
    return out


def provenance() -> dict:
    """Where and with what a result was measured: versions of jax, jaxlib and jaxcomm, the git
    commit of the package's checkout (``"not a git checkout"`` otherwise), the host's name,
    ``os.cpu_count()`` and the date (UTC, ISO 8601)."""
    from importlib import metadata

    import jaxcomm

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    commit = "not a git checkout"
    try:
        proc = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parents[2],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if proc.returncode == 0 and proc.stdout.strip():
            commit = proc.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "jax": version("jax"),
        "jaxlib": version("jaxlib"),
        "jaxcomm": getattr(jaxcomm, "__version__", None),
        "git_commit": commit,
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _json_value(value: Any) -> Any:
    """What ``json`` cannot write itself, as JSON numbers and lists: NumPy and JAX scalars and
    arrays by their dtype (integers as ints, floats as floats: a measured float that happens to
    be whole stays a float), a :class:`~jaxcomm.BitCount` as its exact ints; anything else is a
    ``TypeError`` naming its type (a count must reach the writer as an integer, from its source)."""
    from .._bitcount import BitCount

    if isinstance(value, BitCount):
        return int(value) if value.ndim == 0 else [_json_value(value[i]) for i in range(len(value))]
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"write_results: a {type(value).__name__} ({value!r:.80}) cannot be written as JSON")


def write_results(out_dir: Path, results: dict) -> Path:
    """Write ``results`` as ``out_dir/results.json`` (creating the folder); integer counts
    (NumPy or JAX integers included) stay integers."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "results.json"
    path.write_text(json.dumps(results, indent=2, sort_keys=True, default=_json_value))
    return path


# One package per paper: jaxcomm/experiments/<paper>/__init__.py registers its experiments.
_PAPERS = ("quickstart", "network", "grace", "doublesqueeze", "gradient_dropping", "eventgrad", "eager")


def _load_all() -> None:
    for paper in _PAPERS:
        importlib.import_module(f"jaxcomm.experiments.{paper}")
