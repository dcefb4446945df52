"""Where ``jaxcomm`` finds its studies, and that the installed package holds none.

The studies are the repository's ``experiments/`` folder (found from the current directory upwards,
or named by ``JAXCOMM_EXPERIMENTS``) and the modules of ``jaxcomm.studies`` entry points; each
test runs ``python -m jaxcomm`` in a fresh interpreter from a folder it makes, so what it finds is
only what the test put there.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# A study package with one experiment: its config a frozen dataclass, its runner writes what it got.
_TOY = {
    "__init__.py": """
        import dataclasses

        from jaxcomm.studies import Experiment, register_experiment


        @dataclasses.dataclass(frozen=True)
        class ToyConfig:
            '''A toy study.

            Attributes:
              steps: how many.
              names: which.
            '''

            steps: int = 3
            names: tuple[str, ...] = ("a",)

            @classmethod
            def default(cls):
                return cls()

            @classmethod
            def smoke(cls):
                return cls(steps=1)


        register_experiment(Experiment(NAME, "a toy study", ToyConfig, f"{__name__}.run:run"))
    """,
    "run.py": """
        def run(config, out_dir):
            return {"summary": [{"got": type(config).__name__, "steps": config.steps, "names": "+".join(config.names)}]}
    """,
}


def _write_study(package: Path, name: str) -> None:
    package.mkdir(parents=True)
    for file, text in _TOY.items():
        (package / file).write_text(textwrap.dedent(text).replace("NAME", repr(name)))


def _jaxcomm(*args: str, cwd: Path, pythonpath: tuple[Path, ...] = ()) -> subprocess.CompletedProcess:
    """``python -m jaxcomm ARGS`` from ``cwd``, with no ``JAXCOMM_EXPERIMENTS`` unless ``args`` set it."""
    env = {k: v for k, v in os.environ.items() if k != "JAXCOMM_EXPERIMENTS"}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in (ROOT, *pythonpath))
    return subprocess.run(
        [sys.executable, "-m", "jaxcomm", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_without_studies_list_and_run_say_so_in_one_line(tmp_path):
    for argv in (["list"], ["run", "grace", "--smoke"]):
        proc = _jaxcomm(*argv, cwd=tmp_path)
        assert proc.returncode == 2 and proc.stdout == "", proc.stderr
        (line,) = proc.stderr.splitlines()
        assert line.startswith("error: no studies found: no experiments/ folder in ") and str(tmp_path) in line
        assert "JAXCOMM_EXPERIMENTS" in line and "'jaxcomm.studies' entry point" in line
    assert list(tmp_path.iterdir()) == []  # nothing made (no runs/ folder)


def test_studies_are_found_upwards_and_by_entry_point_and_get_their_dataclass(tmp_path):
    """An ``experiments/`` folder above the current directory and a package declaring a
    ``jaxcomm.studies`` entry point both register their experiments; ``--set`` reaches the runner
    as a field of its config dataclass, and ``results.json`` holds the config's JSON form."""
    project = tmp_path / "project"
    (project / "experiments").mkdir(parents=True)
    (project / "experiments" / "__init__.py").write_text('STUDIES = ("toy",)\n')
    _write_study(project / "experiments" / "toy", "toy")
    site = tmp_path / "site"  # an installed package: its module and its dist-info with the entry point
    _write_study(site / "toyplug", "toy-plugin")
    info = site / "toyplug-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toyplug\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[jaxcomm.studies]\ntoy = toyplug\n")
    below = project / "sub" / "deeper"
    below.mkdir(parents=True)

    listed = _jaxcomm("list", cwd=below, pythonpath=(site,))
    assert listed.returncode == 0, listed.stderr
    names = [line.split()[0] for line in listed.stdout.split("\n\n")[0].splitlines()[1:]]
    assert names == ["toy", "toy-plugin"]

    out = tmp_path / "out"
    ran = _jaxcomm("run", "toy", "--set", "steps=5", "--set", "names=x,y", "--out", str(out), cwd=below)
    assert ran.returncode == 0, ran.stderr
    results = json.loads((out / "results.json").read_text())
    assert results["summary"] == [{"got": "ToyConfig", "steps": 5, "names": "x+y"}]
    assert results["config"] == {"steps": 5, "names": ["x", "y"]} and results["variant"] == "default"


def test_the_installed_package_holds_no_study():
    """The wheel's packages (pyproject's package discovery) are ``jaxcomm`` and its subpackages only; no
    folder of ``jaxcomm/`` is a study's (or an ``experiments`` one), and no module but the registry
    makes an ``Experiment``."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    from setuptools import find_packages

    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = find_packages(str(ROOT), include=find["include"], exclude=find.get("exclude", ()))
    assert "jaxcomm" in packages and "jaxcomm.compressors" in packages  # the discovery sees the package
    assert [p for p in packages if p.split(".")[0] != "jaxcomm"] == []

    from experiments import STUDIES  # the checkout's root is on sys.path (pytest's pythonpath)

    assert "grace" in STUDIES and len(STUDIES) >= 7
    named = {*STUDIES, "experiments", "studies"}
    folders = [p for p in (ROOT / "jaxcomm").rglob("*") if p.is_dir() and p.name in named]
    assert folders == []
    registering = [
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "jaxcomm").rglob("*.py")
        if p.name != "studies.py" and ("register_experiment(" in p.read_text() or "Experiment(" in p.read_text())
    ]
    assert registering == []


@pytest.mark.parametrize("value", ["", "relative/missing"])
def test_a_studies_folder_named_by_the_environment_must_be_a_package(tmp_path, monkeypatch, value):
    from jaxcomm import studies

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(studies.ENV_VAR, value)
    if value:
        with pytest.raises(ValueError, match=r"JAXCOMM_EXPERIMENTS=relative/missing: not a folder of studies"):
            studies.studies_folder()
    else:  # empty: as if unset, and there is no experiments/ here or above
        assert studies.studies_folder() is None
    monkeypatch.setenv(studies.ENV_VAR, str(ROOT / "experiments"))
    assert studies.studies_folder() == ROOT / "experiments"
