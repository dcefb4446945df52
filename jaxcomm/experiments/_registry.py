"""Experiment registry: each paper study is a named :class:`Experiment`.

An experiment has a full configuration (``default``), a small one (``smoke``,
under a minute on 2 cores, run by the tests) and a ``run(config, out_dir)``
function that writes ``results.json`` and PNG figures into ``out_dir`` and
returns the results dictionary.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable

__all__ = ["Experiment", "register_experiment", "get_experiment", "experiment_names", "apply_overrides",
           "write_results"]


@dataclasses.dataclass(frozen=True)
class Experiment:
    """A reproducible study.

    Attributes:
      name: command-line name (``jaxcomm run NAME``).
      description: one line for ``jaxcomm list``.
      default: full configuration (flat dict of JSON scalars/lists).
      smoke: overrides of ``default`` for the small configuration.
      run: ``(config: dict, out_dir: Path) -> dict``; writes results.json + PNGs.
      summary: ``results -> list[dict]`` rows for the printed table.
    """

    name: str
    description: str
    default: dict
    smoke: dict
    run: Callable[[dict, Path], dict]
    summary: Callable[[dict], list] = lambda results: results.get("summary", [])

    def config(self, smoke: bool = False, overrides: dict | None = None) -> dict:
        """The configuration: ``default``, then ``smoke`` if asked, then ``overrides``."""
        cfg = dict(self.default)
        if smoke:
            cfg.update(self.smoke)
        return apply_overrides(cfg, overrides or {})


_EXPERIMENTS: dict[str, Experiment] = {}


def register_experiment(exp: Experiment) -> Experiment:
    """Add ``exp`` to the registry (names must be unique)."""
    if exp.name in _EXPERIMENTS:
        raise ValueError(f"experiment {exp.name!r} is already registered")
    unknown = set(exp.smoke) - set(exp.default)
    if unknown:
        raise ValueError(f"smoke config of {exp.name!r} has keys not in default: {sorted(unknown)}")
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


def _coerce(key: str, text: Any, like: Any):
    if not isinstance(text, str):
        return text
    if isinstance(like, bool):
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"--set {key}: expected a boolean, got {text!r}")
    if isinstance(like, (int, float, list, dict)) or like is None:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            if like is None:
                return text
            raise ValueError(f"--set {key}: could not parse {text!r} as {type(like).__name__}") from None
        if isinstance(like, float) and isinstance(value, int):
            value = float(value)
        if like is not None and not isinstance(value, type(like)):
            raise ValueError(f"--set {key}: expected {type(like).__name__}, got {text!r}")
        return value
    return text


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


def write_results(out_dir: Path, results: dict) -> Path:
    """Write ``results`` as ``out_dir/results.json`` (creating the folder)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "results.json"
    path.write_text(json.dumps(results, indent=2, sort_keys=True, default=float))
    return path


_MODULES = ("grace", "doublesqueeze", "gradient_dropping", "eventgrad", "eager", "quickstart")


def _load_all() -> None:
    import importlib

    for mod in _MODULES:
        try:
            importlib.import_module(f"jaxcomm.experiments.{mod}")
        except ModuleNotFoundError as e:
            if e.name != f"jaxcomm.experiments.{mod}":
                raise
