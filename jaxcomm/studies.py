"""Studies as named experiments: the registry behind ``jaxcomm list`` and ``jaxcomm run NAME``.

The library holds no study; it finds them. A study is a Python package that registers one or
more :class:`Experiment` when imported (importing neither JAX nor Flax): each has a typed
configuration (a frozen dataclass with ``default()``, the full study, and ``smoke()``, a small
one) and a runner ``run(config, out_dir) -> dict``, ``config`` an instance of that dataclass,
which writes PNG figures into ``out_dir``. The runner is named by a ``"module:function"`` string
and imported on the first run.

Where studies are found (:func:`experiment_names` and :func:`get_experiment` look once, in this
order, and take every one they find):

1. the folder named by the environment variable ``JAXCOMM_EXPERIMENTS``, else the first folder
   called ``experiments`` in the current directory or above it (a checkout's own studies). The
   folder is a Python package: it is imported under its own name, with its parent put first on
   ``sys.path``, and its ``STUDIES`` (a tuple of subpackage names) are imported in turn;
2. every entry point of the group ``jaxcomm.studies`` (a module of an installed package, e.g.
   ``[project.entry-points."jaxcomm.studies"] mine = "my_package.studies"``), imported.

Finding none is a :class:`NoStudiesError` that says where it looked.

Configurations are dataclass instances end to end; they become flat dicts of JSON values only
where JSON is written or read (``results.json``, a worker's ``config.json``):
:func:`config_to_dict` and :func:`config_from_dict` convert (tuple fields become lists), and
:func:`apply_overrides` applies ``--set key=value`` strings to an instance with
:func:`dataclasses.replace`, checking each value against its field's type first.
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
import sys
import types
import typing
from collections.abc import Callable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["Experiment", "register_experiment", "get_experiment", "write_results"]
"""The names a study's author uses; the others (overrides, the JSON form of a config, provenance,
where studies are found) serve ``jaxcomm run`` and the studies' shared helpers, and are imported
from this module by name."""

ENV_VAR = "JAXCOMM_EXPERIMENTS"
"""The environment variable naming a folder of studies (it wins over ``./experiments``)."""
ENTRY_POINT_GROUP = "jaxcomm.studies"
"""The entry-point group through which installed packages declare studies."""


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
      runner: ``"module:function"`` of ``run(config, out_dir: Path) -> dict`` (``config`` a
        ``config_type`` instance), imported on first use; it writes PNGs (and may write
        results.json).
      summary: ``results -> list[dict]`` rows for the printed table.
    """

    name: str
    description: str
    config_type: type[Any]  # a frozen dataclass with classmethods default() and smoke()
    runner: str
    summary: Callable[[dict], list] = _default_summary

    def config(self, smoke: bool = False, overrides: dict | None = None, *, full: bool = False):
        """The configuration, a ``config_type`` instance: ``default()``, ``smoke()`` or ``full()``, then ``overrides``.

        ``overrides`` values may be strings from ``--set`` (parsed as the field's type;
        :func:`apply_overrides`). ``full`` is the larger study of an experiment whose configuration
        defines ``full()`` (its default is then the shorter main job). Raises ``ValueError`` naming
        a key that is not a field, or a value of the wrong type; ``smoke`` with ``full``, or
        ``full`` for an experiment without it.
        """
        if smoke and full:
            raise ValueError("--smoke and --full: choose one configuration")
        if full and not callable(getattr(self.config_type, "full", None)):
            raise ValueError(f"--full: {self.name} has one study (its default); run it without --full")
        base = self.config_type.smoke() if smoke else self.config_type.full() if full else self.config_type.default()
        return apply_overrides(base, overrides or {})

    def run(self, config, out_dir: Path, *, variant: str = "default") -> dict:
        """Run the study of ``config`` (a ``config_type`` instance) into ``out_dir``; its results.

        ``variant`` names the configuration (one of :data:`VARIANTS`, as ``results.json`` records
        it); with ``"smoke"`` every figure the study saves says so in its title
        (:func:`figures_marked`). Raises ``TypeError`` for a ``config`` of another type.
        """
        from ._validate import check_choice

        variant = check_choice(variant, "variant", VARIANTS)
        if type(config) is not self.config_type:
            raise TypeError(f"{self.name}: config must be a {self.config_type.__name__}; got {type(config).__name__}")
        module, _, function = self.runner.partition(":")
        with figures_marked(SMOKE_MARK if variant == "smoke" else ""):
            return getattr(importlib.import_module(module), function)(config, Path(out_dir))


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


def _checked(config_type: type, key: str, value):
    """``value`` as the type of ``config_type``'s field ``key`` (:func:`_check_value`); ``ValueError``
    also for an empty tuple where the field's default is not empty (it would run nothing)."""
    cls_name = config_type.__name__
    value = _check_value(cls_name, key, value, typing.get_type_hints(config_type)[key])
    default = {f.name: f.default for f in dataclasses.fields(config_type)}[key]
    if value == () and isinstance(default, tuple) and default:
        raise ValueError(f"{cls_name}.{key}: give at least one item (an empty list runs nothing)")
    return value


def config_from_dict(config_type: type, values: dict):
    """A ``config_type`` instance from its flat dict form (as JSON holds it), checking keys and types.

    Raises ``ValueError`` for a key that is not a field (listing the valid ones), a missing
    field, or a value that is not of the field's type (ints are accepted for float fields, lists
    for tuple fields; a float must be finite, an int within 64 bits); an empty tuple for a field
    whose default is not empty (it would run nothing); and whatever the dataclass's own
    ``__post_init__`` refuses (ranges, choices).
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
    return config_type(**{n: _checked(config_type, n, values[n]) for n in names})


MAX_DEVICES = 1024
"""The most simulated CPU devices a study (or ``--devices``) may ask for."""


def _number(v: float) -> str:
    return "2**32" if v == 2**32 else f"{v:g}"


def check_range(label: str, value, bounds: tuple[float, float, bool, bool]) -> None:
    """``ValueError`` naming ``label`` if ``value`` is a number outside ``bounds``: ``(low, high, low
    inclusive, high inclusive)``. Anything but an int or a float passes (its type is checked elsewhere)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    low, high, low_in, high_in = bounds
    ok = (value >= low if low_in else value > low) and (value <= high if high_in else value < high)
    if not ok:
        if high == float("inf"):
            want = f"{'>=' if low_in else '>'} {_number(low)}"
        else:
            want = f"in {'[' if low_in else '('}{_number(low)}, {_number(high)}{']' if high_in else ')'}"
        raise ValueError(f"{label} must be {want}; got {value!r}")


def _attribute_meanings(doc: str) -> dict[str, str]:
    """The entries of a docstring's ``Attributes:`` section (``a, b: ...`` applies to each key)."""
    meanings: dict[str, str] = {}
    base: int | None = None  # indentation of the entries under "Attributes:"
    current: list[str] = []
    for line in doc.splitlines():
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
    return meanings


def config_help(config_type: type) -> list[tuple[str, str, str, str]]:
    """``(key, type, default, meaning)`` for every field of ``config_type``.

    The meaning is the field's entry in the ``Attributes:`` section of the class docstring, or
    of the nearest base class that documents it (a shared base documents the shared fields).
    """
    meanings: dict[str, str] = {}
    for cls in reversed(config_type.__mro__):
        meanings.update(_attribute_meanings(cls.__doc__ or "") if dataclasses.is_dataclass(cls) else {})
    hints = typing.get_type_hints(config_type)
    default = config_type.default()  # type: ignore[attr-defined]  # every registered config has one
    rows = []
    for f in dataclasses.fields(config_type):
        hint = hints[f.name]
        type_name = hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")
        rows.append((f.name, type_name, json.dumps(_jsonable(getattr(default, f.name))), meanings.get(f.name, "")))
    return rows


_EXPERIMENTS: dict[str, Experiment] = {}
_searched: list[bool] = [False]  # the studies were looked for (once per process)


class NoStudiesError(ValueError):
    """No folder of studies and no ``jaxcomm.studies`` entry point was found."""


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


def studies_folder(start: Path | None = None) -> Path | None:
    """The folder of studies: ``$JAXCOMM_EXPERIMENTS``, else the first ``experiments/`` holding an
    ``__init__.py`` in ``start`` (default: the current directory) or above it; ``None`` if neither.

    Raises ``ValueError`` if ``JAXCOMM_EXPERIMENTS`` names something other than a package folder.
    """
    named = os.environ.get(ENV_VAR)
    if named:
        folder = Path(named).expanduser().resolve()
        if not (folder / "__init__.py").is_file():
            raise ValueError(f"{ENV_VAR}={named}: not a folder of studies (it needs an __init__.py naming STUDIES)")
        return folder
    here = Path(start or Path.cwd()).resolve()
    for parent in (here, *here.parents):
        if (parent / "experiments" / "__init__.py").is_file():
            return parent / "experiments"
    return None


def _import_folder(folder: Path) -> None:
    """Import the package ``folder`` (its parent first on ``sys.path``) and each of its ``STUDIES``."""
    name = folder.name
    if not name.isidentifier():
        raise ValueError(f"the folder of studies {str(folder)!r} must have a Python name; got {name!r}")
    loaded = sys.modules.get(name)
    if loaded is not None and Path(getattr(loaded, "__file__", "") or "").resolve().parent != folder:
        raise ValueError(f"the folder of studies {str(folder)!r}: another module {name!r} is already imported")
    if str(folder.parent) not in sys.path:
        sys.path.insert(0, str(folder.parent))
    package = importlib.import_module(name)
    for study in getattr(package, "STUDIES", ()):
        importlib.import_module(f"{name}.{study}")  # the study's __init__ registers its experiments


def _load_all() -> None:
    """Find and import every study (once): the folder of :func:`studies_folder`, then the entry points."""
    if _searched[0]:
        return
    folder = studies_folder()
    entry_points = metadata.entry_points(group=ENTRY_POINT_GROUP)
    if folder is None and not entry_points:
        raise NoStudiesError(
            f"no studies found: no experiments/ folder in {Path.cwd()} or above it, {ENV_VAR} is not set, "
            f"and no installed package declares a {ENTRY_POINT_GROUP!r} entry point"
        )
    if folder is not None:
        _import_folder(folder)
    for entry_point in entry_points:
        entry_point.load()
    _searched[0] = True


def experiment_names() -> list[str]:
    """Names of the registered experiments, sorted (:class:`NoStudiesError` if none can be found)."""
    _load_all()
    return sorted(_EXPERIMENTS)


def get_experiment(name: str) -> Experiment:
    """The experiment called ``name``; ``ValueError`` listing valid names otherwise."""
    _load_all()
    try:
        return _EXPERIMENTS[name]
    except KeyError:
        raise ValueError(f"unknown experiment {name!r}; valid: {', '.join(sorted(_EXPERIMENTS))}") from None


def worker_pythonpath(package: str, env: Mapping[str, str] | None = None) -> str:
    """The ``PYTHONPATH`` under which a child process imports the study ``package`` (e.g. a worker
    run as ``python -m PACKAGE.worker``) and this ``jaxcomm``: the folder above the package's top
    level, then the folder holding ``jaxcomm``, then ``env``'s ``PYTHONPATH`` (default:
    ``os.environ``'s)."""
    top = Path(sys.modules[package.partition(".")[0]].__file__ or "").resolve().parents[1]
    here = Path(__file__).resolve().parents[1]
    rest = (os.environ if env is None else env).get("PYTHONPATH", "")
    return os.pathsep.join(dict.fromkeys(p for p in (str(top), str(here), rest) if p))


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


def apply_overrides(config, overrides: dict):
    """``config`` (a config dataclass instance) with ``overrides`` applied by :func:`dataclasses.replace`.

    A value may be a string from ``--set``, parsed like the field's current value (``7`` for an
    int, ``a,b`` or ``["a", "b"]`` for a tuple), then checked against the field's type. Raises
    ``ValueError`` for a key that is not a field (listing the valid keys), a value that does not
    parse as the field's type, or one that the dataclass's ``__post_init__`` refuses.
    """
    names = [f.name for f in dataclasses.fields(config)]
    changes = {}
    for key, value in overrides.items():
        if key not in names:
            raise ValueError(f"unknown config key {key!r}; valid keys: {', '.join(sorted(names))}")
        changes[key] = _checked(type(config), key, _coerce(key, value, _jsonable(getattr(config, key))))
    return dataclasses.replace(config, **changes) if changes else config


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
            cwd=Path(__file__).resolve().parents[1],
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
    from ._bitcount import BitCount

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
