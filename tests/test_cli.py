"""The command line: listing, bad names and keys, a smoke run writing JSON + PNG."""

import contextlib
import dataclasses
import json
import re
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxcomm import cli, compressors
from jaxcomm.studies import apply_overrides, experiment_names, get_experiment


def test_list_shows_experiments_and_compressors(capsys):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    for name in experiment_names():
        assert name in out
    for name in compressors.names():
        assert name in out


def test_paper_experiments_are_registered():
    assert {"grace", "doublesqueeze", "gradient-dropping", "quickstart"} <= set(experiment_names())


def test_unknown_experiment_lists_valid_ones(capsys):
    assert cli.main(["run", "no-such-study", "--smoke"]) == 2
    err = capsys.readouterr().err
    assert "unknown experiment" in err and "grace" in err


def test_unknown_key_lists_valid_ones(capsys):
    assert cli.main(["run", "grace", "--smoke", "--set", "no_such_key=1"]) == 2
    err = capsys.readouterr().err
    assert "unknown config key" in err and "steps" in err


def test_full_is_refused_where_it_does_not_apply(capsys):
    """``--full`` needs an experiment with a larger study, and not ``--smoke`` beside it: exit 2, named."""
    assert cli.main(["run", "grace", "--full"]) == 2
    assert "--full: grace has one study" in capsys.readouterr().err
    assert cli.main(["run", "time-to-accuracy", "--smoke", "--full"]) == 2
    assert "choose one" in capsys.readouterr().err
    full = get_experiment("time-to-accuracy").config(full=True)
    assert full != get_experiment("time-to-accuracy").config() and full.model == "resnet20"


def test_override_types_are_checked():
    cfg = get_experiment("grace").config(smoke=True)
    assert apply_overrides(cfg, {"steps": "7"}) == dataclasses.replace(cfg, steps=7)
    assert apply_overrides(cfg, {"compressors": '["topk"]'}).compressors == ("topk",)
    with pytest.raises(ValueError, match=r"could not parse .seven. as int"):
        apply_overrides(cfg, {"steps": "seven"})


def test_format_table_aligns_columns():
    table = cli.format_table([{"a": 1.23456, "b": "x"}, {"a": 2.0, "b": "long"}])
    lines = table.splitlines()
    assert len({len(line) for line in lines}) == 1
    assert "1.235" in table


def test_demo_table_covers_every_compressor(capsys):
    import jax.numpy as jnp

    from jaxcomm.demo import gradient_table

    grads = {"w": jnp.linspace(-1.0, 1.0, 640).reshape(32, 20), "b": jnp.linspace(-0.5, 0.5, 20)}
    rows = gradient_table(grads)
    assert [r["compressor"] for r in rows] == compressors.names()
    none = next(r for r in rows if r["compressor"] == "none")
    assert none["rel_error"] == 0.0 and none["wire_bits"] == 32 * 660
    for r in rows:
        assert r["wire_bits"] > 0 and r["rel_error"] >= 0.0


def test_quickstart_smoke_via_cli(tmp_path, capsys):
    out = tmp_path / "qs"
    assert (
        cli.main(
            [
                "run",
                "quickstart",
                "--smoke",
                "--devices",
                "8",
                "--out",
                str(out),
                "--set",
                "steps=4",
                "--set",
                "eval_every=4",
            ]
        )
        == 0
    )
    from PIL import Image

    results = json.loads((out / "results.json").read_text())
    for png in ("accuracy.png", "accuracy_vs_bits.png", "accuracy_vs_time.png"):  # a smoke run says so
        assert Image.open(out / png).text["Title"].endswith(" (smoke run)"), png
    # Counts stay integers: the bits and messages of all 8 workers, per step and per run.
    for r in results["runs"]:
        rows = r["history"]
        assert all(type(row["wire_bits_total"]) is int and type(row["messages"]) is int for row in rows)
        assert r["wire_bits_total"] == sum(row["wire_bits_total"] for row in rows) == 8 * r["wire_bits_per_worker"]
    assert {r["method"] for r in results["summary"]} == set(get_experiment("quickstart").config(smoke=True).methods)
    by = {r["method"]: r for r in results["summary"]}
    assert by["topk-1%+EF"]["Mbit_per_worker"] < by["none"]["Mbit_per_worker"] / 10
    assert "test_accuracy" in capsys.readouterr().out
    # Where it came from: the variant, the whole configuration (seeds included) and the provenance.
    assert results["variant"] == "smoke" and results["config"]["steps"] == 4 and "seed" in results["config"]
    prov = results["provenance"]
    assert {"jax", "jaxlib", "jaxcomm", "git_commit", "hostname", "cpu_count", "date_utc"} <= set(prov)
    assert prov["command"][:4] == ["jaxcomm", "run", "quickstart", "--smoke"] and prov["command"][-1] == "eval_every=4"
    assert prov["git_commit"] == "not a git checkout" or len(prov["git_commit"]) == 40


def test_results_keep_integer_counts_integers(tmp_path):
    import jax.numpy as jnp
    import numpy as np

    from jaxcomm import BitCount
    from jaxcomm.studies import write_results

    big = BitCount.of(2**41) + BitCount.of(2**41)  # past int32 and float32's exact range
    path = write_results(
        tmp_path,
        {"bits": np.int64(879360), "m": jnp.int32(3), "x": np.float32(2.0), "a": np.arange(2), "c": big},
    )
    text = path.read_text()
    assert json.loads(text) == {"a": [0, 1], "bits": 879360, "c": 2**42, "m": 3, "x": 2.0}
    assert "879360," in text and '"x": 2.0' in text  # a measured float stays a float, even when whole
    assert json.loads(write_results(tmp_path, {"c": BitCount.of([5, 2**33])}).read_text()) == {"c": [5, 2**33]}
    with pytest.raises(TypeError, match=r"write_results: a PosixPath .* cannot be written as JSON"):
        write_results(tmp_path, {"p": tmp_path})


def _results_counts():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / "results_counts.py"
    spec = importlib.util.spec_from_file_location("results_counts", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_results_hold_counts_as_ints(tmp_path):
    rc = _results_counts()
    files = rc.results_files()
    assert len(files) >= 90 and any("benchmarks/results" in str(f) for f in files)
    assert [p for f in files for p in rc.float_counts(f)] == []
    # The rewrite: exact counts and whole shares become ints, a fractional share (a mean over
    # workers) stays a float, flags become bools, the layout is kept; a fractional count is refused.
    old = {"history": [{"wire_bits": 879360.0, "messages": 12.0, "loss": 2.0}], "wire_bits_per_worker": 2.5}
    old["trace"] = {"fired": [[1.0, 0.0]]}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(old, indent=1) + "\n")
    assert len(rc.float_counts(path, write=True)) == 4
    assert (
        path.read_text()
        == json.dumps(
            {
                "history": [{"wire_bits": 879360, "messages": 12, "loss": 2.0}],
                "wire_bits_per_worker": 2.5,
                "trace": {"fired": [[True, False]]},
            },
            indent=1,
        )
        + "\n"
    )
    assert rc.float_counts(path, write=True) == [] and rc.main([str(path)]) == 0
    path.write_text(json.dumps({"messages": 12.5}))
    assert rc.main([str(path), "--write"]) == 2 and json.loads(path.read_text()) == {"messages": 12.5}


def test_progress_in_a_log_file_is_one_line_per_update():
    import io

    from jaxcomm._progress import progress_bar

    log = io.StringIO()  # not a terminal
    bar = progress_bar(total=3, desc="fit", stream=log, log_interval_s=0.0, leave=True)
    for _ in range(3):
        bar.update(1)
    bar.close()
    text = log.getvalue()
    assert "\r" not in text and text.endswith("\n")
    lines = text.splitlines()
    assert len(lines) >= 2 and all(line.startswith("fit:") for line in lines) and "3/3" in lines[-1]


def test_grace_records_a_failing_run_and_goes_on(monkeypatch, tmp_path):
    # A run that raises (here: a fake trainer that "diverges" for qsgd) is listed under `failed`;
    # the remaining runs still happen and the figures are still written.
    from experiments import _common
    from experiments.grace import run as grace
    from jaxcomm.train import NonFiniteLossError

    monkeypatch.setattr(grace, "load_config_task", lambda config: (None, None))

    def fake_train(*, name, **kwargs):
        if name.startswith("qsgd"):
            raise NonFiniteLossError("loss became nan at step 3")
        return {
            "name": name,
            "history": [{"step": 1, "eval_accuracy": 0.5}],
            "final_accuracy": 0.5,
            "wire_bits_per_worker": 10.0,
            "dense_bits_per_worker": 320.0,
            "compute_time_s": 1.0,
            "est_comm_time_s": {"10Gbps": 0.1},
        }

    monkeypatch.setattr(_common, "train_data_parallel", fake_train)
    cfg = get_experiment("grace").config(smoke=True, overrides={"compressors": "none,qsgd,topk"})
    out = grace.run(cfg, tmp_path)
    assert [r["name"] for r in out["runs"]] == ["none", "topk", "topk+EF"]
    assert out["failed"] == [
        {"compressor": "qsgd", "error_feedback": False, "error": "NonFiniteLossError: loss became nan at step 3"},
        {"compressor": "qsgd", "error_feedback": True, "error": "NonFiniteLossError: loss became nan at step 3"},
    ]
    from PIL import Image

    for png, xlabel in (("quality_vs_bits.png", "bits sent per worker"), ("quality_vs_time.png", "estimated")):
        info = Image.open(tmp_path / png).text
        assert f"{cfg.dataset}, {cfg.model}, {cfg.devices} workers, {cfg.steps} steps" in info["Title"]
        assert info["XLabel"].startswith(xlabel) and info["YLabel"] == "compressor"
    assert "α-β model" in Image.open(tmp_path / "quality_vs_time.png").text["XLabel"]  # the model is named


# --------------------------------------------------------------------------- #
# A light package: lazy submodules, no import cycles, registration without JAX
# --------------------------------------------------------------------------- #
def _fresh_python(code: str) -> str:
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_import_jaxcomm_imports_no_submodule_and_no_heavy_dependency():
    out = _fresh_python(
        "import sys, jaxcomm\n"
        "heavy = ['jax', 'flax', 'orbax', 'matplotlib', 'optax']\n"
        "print(sorted(m for m in sys.modules if m.startswith('jaxcomm.') or m.split('.')[0] in heavy))\n"
    )
    assert out.strip() == "[]"


def test_registering_and_listing_experiments_imports_no_jax():
    out = _fresh_python(
        "import sys\n"
        "from jaxcomm.studies import experiment_names, get_experiment\n"
        "for n in experiment_names():\n"
        "    get_experiment(n).config(smoke=True)\n"
        "print(sorted(m for m in ('jax', 'flax', 'numpy', 'matplotlib') if m in sys.modules))\n"
    )
    assert out.strip() == "[]"


def test_lazy_attributes_are_the_submodules_objects():
    import jaxcomm
    import jaxcomm.transforms

    assert set(dir(jaxcomm)) == set(jaxcomm.__all__)
    assert jaxcomm.compressed_mean is jaxcomm.transforms.compressed_mean
    assert jaxcomm.wire_bits is compressors.wire_bits
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        jaxcomm.no_such_name  # noqa: B018


def _top_level_import_graph() -> dict:
    """``{a: {b, ...}}``: some module of ``jaxcomm.a`` imports ``jaxcomm.b`` (at any depth, also in functions)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "jaxcomm"
    graph: dict = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        package = parts[:-1]
        if len(parts) < 2 or parts[1] == "__init__":
            continue  # the package itself imports its submodules lazily
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                targets = [module, *(f"{module}.{a.name}" for a in node.names)]
            else:
                continue
            for target in targets:
                t = target.split(".")
                if t[0] == "jaxcomm" and len(t) > 1 and t[1] != parts[1]:
                    graph.setdefault(parts[1], set()).add(t[1])
    return graph


def test_no_import_cycle_between_top_level_modules():
    graph = _top_level_import_graph()
    # The walk resolves relative imports, also three levels deep (compressors/_kernels/select.py).
    assert "_table" in graph["cli"] and "_table" in graph["demo"] and "_vma" in graph["compressors"]

    def reach(start):
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    cycles = sorted(m for m in graph if m in reach(m))
    assert cycles == [], f"modules on an import cycle: {cycles}"


def test_typed_configs_check_keys_and_types():
    from experiments.grace import GraceConfig
    from jaxcomm.studies import config_from_dict, config_to_dict

    exp = get_experiment("grace")
    assert exp.config_type is GraceConfig
    smoke = exp.config(smoke=True)
    assert smoke == GraceConfig.smoke()
    # The dict form (JSON's): tuples as lists, and back to the same instance.
    as_dict = config_to_dict(smoke)
    assert as_dict["compressors"] == list(smoke.compressors) and config_from_dict(GraceConfig, as_dict) == smoke
    with pytest.raises(dataclasses.FrozenInstanceError):
        GraceConfig.default().steps = 3  # type: ignore[misc]
    with pytest.raises(ValueError, match=r"GraceConfig.steps: expected int, got 'four'"):
        config_from_dict(GraceConfig, dict(as_dict, steps="four"))
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['nope'\] for GraceConfig"):
        config_from_dict(GraceConfig, dict(as_dict, nope=1))
    with pytest.raises(TypeError, match=r"grace: config must be a GraceConfig; got dict"):
        exp.run(as_dict, "unused")  # type: ignore[arg-type]
    # ints widen to float fields.
    assert exp.config(overrides={"learning_rate": "1"}).learning_rate == 1.0


def test_eager_worker_is_a_module_with_a_usage_line():
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.run(
        [sys.executable, "-m", "experiments.eager.worker", "nope"],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "usage: python -m experiments.eager.worker" in proc.stderr


def test_list_overrides_take_comma_separated_items():
    cfg = get_experiment("time-to-accuracy").config(smoke=True)
    assert apply_overrides(cfg, {"methods": "topk-1%+EF"}).methods == ("topk-1%+EF",)
    assert apply_overrides(cfg, {"methods": "none, fp16"}).methods == ("none", "fp16")
    assert apply_overrides(cfg, {"seeds": "0,1,2"}).seeds == (0, 1, 2)
    assert apply_overrides(cfg, {"seeds": "[3]"}).seeds == (3,)
    with pytest.raises(ValueError, match=r"could not parse .x. as int"):
        apply_overrides(cfg, {"seeds": "1,x"})


def _cli_subprocess(*args: str, cwd):
    """``python -m jaxcomm ARGS`` in a fresh interpreter, run from ``cwd``."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root), JAX_PLATFORMS="cpu", JAXCOMM_EXPERIMENTS=str(root / "experiments"))
    return subprocess.run(
        [sys.executable, "-m", "jaxcomm", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


_QS = ["run", "quickstart", "--smoke", "--out", "{out}"]
_LAUNCH = ["launch", "-n", "2"]
_MARK = ["--", sys.executable, "-c", "open('{tmp}/ran', 'w')"]  # the job, if it ever started


def _spec(text: str) -> list[str]:
    return [*_QS, "--set", f"methods={text}"]


@pytest.mark.parametrize(
    "argv, message",
    [
        # the command line itself
        (["nosuch"], r"argument command: invalid choice: 'nosuch'"),
        ([*_QS, "--bogus"], r"unrecognized arguments: --bogus"),
        (["run"], r"run: give an EXPERIMENT"),
        (["run", "no-such-study", "--smoke"], r"unknown experiment 'no-such-study'.*grace"),
        ([*_QS, "--devices", "0"], r"--devices must be in \[1, 1024\]; got 0"),
        ([*_QS, "--devices", "100000"], r"--devices must be in \[1, 1024\]"),
        ([*_QS, "--devices", "two"], r"argument --devices: invalid int value"),
        ([*_QS, "--devices", "3"], r"QuickstartConfig.batch_size must be a multiple of QuickstartConfig.devices"),
        (["demo", "--devices", "0"], r"--devices must be in \[1, 1024\]"),
        # --out: a file, under a file, where nothing can be made
        (["run", "quickstart", "--smoke", "--out", "{tmp}/afile"], r"--out: .*afile' exists and is not a folder"),
        (["run", "quickstart", "--smoke", "--out", "{tmp}/afile/run"], r"--out: .*afile' is a file"),
        (["run", "quickstart", "--smoke", "--out", "/proc/jaxcomm-run"], r"--out: cannot write in '/proc'"),
        (
            ["run", "quickstart", "--smoke", "--out", "{tmp}/" + "n" * 300],
            r"--out: a name \(the longest of 300 bytes\)",
        ),
        # config keys: unknown, unparsable, out of range, not finite, beyond 64 bits, empty, inconsistent
        ([*_QS, "--set", "steps"], r"KEY=VALUE"),
        ([*_QS, "--set", "no_such_key=3"], r"unknown config key 'no_such_key'; valid keys: .*steps"),
        ([*_QS, "--set", "steps=many"], r"--set steps: could not parse 'many' as int"),
        ([*_QS, "--set", "steps=0"], r"QuickstartConfig.steps must be >= 1; got 0"),
        ([*_QS, "--set", "steps=" + "1" * 5000], r"--set steps: could not parse a value of 5000 characters"),
        ([*_QS, "--set", "steps=" + "1" * 20000], r"--set steps: at most 10000 characters; got 20000"),
        ([*_QS, "--set", "steps=" + "9" * 30], r"QuickstartConfig.steps: must be an integer within 64 bits"),
        ([*_QS, "--set", "seed=" + "[" * 5000], r"--set seed: brackets nested too deep"),
        ([*_QS, "--set", "learning_rate=-0.1"], r"QuickstartConfig.learning_rate must be > 0"),
        ([*_QS, "--set", "learning_rate=0"], r"QuickstartConfig.learning_rate must be > 0; got 0.0"),
        ([*_QS, "--set", "learning_rate=Infinity"], r"QuickstartConfig.learning_rate: must be a finite number"),
        ([*_QS, "--set", "learning_rate=NaN"], r"QuickstartConfig.learning_rate: must be a finite number; got nan"),
        ([*_QS, "--set", "momentum=7"], r"QuickstartConfig.momentum must be in \[0, 1\); got 7.0"),
        ([*_QS, "--set", "momentum=1"], r"QuickstartConfig.momentum must be in \[0, 1\)"),
        ([*_QS, "--set", "dataset=cifar10"], r"QuickstartConfig.dataset must be one of"),
        ([*_QS, "--set", "model=vgg16"], r"QuickstartConfig.model must be one of"),
        ([*_QS, "--set", "train_examples=-5"], r"QuickstartConfig.train_examples must be >= 0; got -5"),
        ([*_QS, "--set", "batch_size=3", "--set", "devices=2"], r"batch_size must be a multiple of .*devices=2"),
        ([*_QS, "--set", "methods="], r"QuickstartConfig.methods: give at least one item"),
        ([*_QS, "--set", "methods=[]"], r"QuickstartConfig.methods: give at least one item"),
        ([*_QS, "--set", "seed=-1"], r"QuickstartConfig.seed must be in \[0, 2\*\*32\); got -1"),
        (["run", "grace", "--smoke", "--set", "seed=4294967296"], r"GraceConfig.seed must be in \[0, 2\*\*32\)"),
        (["run", "grace", "--smoke", "--set", "error_feedback=[]"], r"GraceConfig.error_feedback: give at least"),
        (["run", "eventgrad", "--smoke", "--set", "seed=-1"], r"EventGradConfig.seed must be in \[0, 2\*\*32\)"),
        (["run", "eventgrad", "--smoke", "--set", "workers=4,0"], r"EventGradConfig.workers\[1\] must be >= 1"),
        (["run", "eager-hyperplane", "--smoke", "--set", "seed=4294967296"], r"HyperplaneConfig.seed must be in"),
        (["run", "eager-hyperplane", "--smoke", "--set", "delays_ms=-30"], r"HyperplaneConfig.delays_ms\[0\]"),
        (["run", "eager-microbench", "--smoke", "--set", "seed=-1"], r"MicrobenchConfig.seed must be in"),
        (["run", "eager-microbench", "--smoke", "--set", "iterations=0"], r"MicrobenchConfig.iterations must be >= 1"),
        (["run", "eager-microbench", "--smoke", "--set", "timeout_s=Infinity"], r"MicrobenchConfig.timeout_s: must"),
        (["run", "doublesqueeze", "--smoke", "--set", "methods=nosuch"], r"DoubleSqueezeConfig.methods must be names"),
        (["run", "gradient-dropping", "--smoke", "--set", "methods=nosuch"], r"GradientDroppingConfig.methods must be"),
        (["run", "gradient-dropping", "--smoke", "--set", "drop_ratio=1"], r"drop_ratio must be in \[0, 1\)"),
        (["run", "time-to-accuracy", "--smoke", "--set", "methods=nosuch"], r"TimeToAccuracyConfig.methods must be"),
        (["run", "time-to-accuracy", "--smoke", "--set", "learning_rate=-1"], r"learning_rate must be > 0"),
        (["run", "time-to-accuracy", "--smoke", "--set", "route=nosuch"], r"route: must be one of decomposed"),
        # method specs: grammar, names, keywords, values, bounds
        (_spec("topk(ratio=0.01"), r"expected NAME or NAME\(key=value, ...\)"),
        (_spec("nosuch"), r"unknown compressor 'nosuch'; valid: adaptive"),
        (_spec("topk(ratio=0.1)+nomem"), r"unknown memory 'nomem'"),
        (_spec("topk(ratio=0.1)@ring"), r"unknown strategy 'ring'; valid: auto, allreduce"),
        (_spec("topk(foo=1)"), r"bad arguments for compressor 'topk': unknown argument 'foo'; valid: ratio"),
        (_spec("topk"), r"bad arguments for compressor 'topk': give ratio=\.\.\."),
        (_spec("topk(ratio=0.01, ratio=0.02)"), r"argument 'ratio' given twice"),
        (_spec("topk(ratio=5)"), r"bad arguments for compressor 'topk': ratio must be in \(0, 1\]"),
        (_spec("topk(ratio=0.1)+residual(beta=-1)"), r"bad arguments for memory 'residual'"),
        (_spec("topk(ratio={[]: 1})"), r"brackets nested 3 deep; at most 2"),
        (_spec("topk(ratio=[0.1])"), r"the value of ratio must be one literal"),
        (_spec("topk(ratio=1e999)"), r"the value of ratio must be a finite number; got inf"),
        (_spec("topk(ratio=" + "9" * 900 + ")"), r"the value of ratio must be an integer within 64 bits"),
        (_spec("topk(ratio=" + "1" * 2000 + ")"), r"at most 1000 characters; got 2012"),
        (_spec("topk(ratio=" + "1" * 20000 + ")"), r"--set methods: at most 10000 characters"),
        (_spec("topk(ratio=" + "[" * 100000 + ")"), r"--set methods: at most 10000 characters"),
        (_spec("topk(ratio=" + "[" * 400 + ")"), r"brackets nested 401 deep; at most 2"),
        # launch: checked before the job starts
        (["launch", "-n", "1000", *_MARK], r"-n: the number of processes must be an integer from 1 to 256"),
        (["launch", "-n", "many", *_MARK], r"argument -n: invalid int value"),
        ([*_LAUNCH, "--report", "{tmp}/missing/r.json", *_MARK], r"--report: the folder '.*missing' does not exist"),
        ([*_LAUNCH, "--report", "{tmp}", *_MARK], r"--report: '.*' is a folder; give a file name"),
        ([*_LAUNCH, "--report", "{tmp}/afile/r.json", *_MARK], r"--report: '.*afile' is a file"),
        ([*_LAUNCH, "--bandwidth", "1" + "0" * 35 + "bit", *_MARK], r"--bandwidth: .* to 1tbit"),
        ([*_LAUNCH, "--bandwidth", "2tbit", *_MARK], r"--bandwidth: the rate must be from 8bit"),
        ([*_LAUNCH, "--burst", "9" * 400 + "kb", *_MARK], r"--burst: at most 1gb"),
        ([*_LAUNCH, "--timeout", "inf", *_MARK], r"--timeout: must be in \(0, 604800\] seconds"),
        ([*_LAUNCH, "--timeout", "nan", *_MARK], r"--timeout: must be in"),
        ([*_LAUNCH, "--latency", "1000s", *_MARK], r"--latency: at most 10s"),
        ([*_LAUNCH, "--devices-per-process", "2", *_MARK], r"--devices-per-process: only with --jax"),
        ([*_LAUNCH, "--jax", "--devices-per-process", "0", *_MARK], r"--devices-per-process: .* from 1 to 1024"),
        (["launch", "--jax", "-n", "255", *_MARK], r"-n: the number of nodes of a jax.distributed job .* 1 to 254"),
    ],
)
def test_bad_input_is_one_error_line_exit_2_and_creates_nothing(tmp_path, monkeypatch, capsys, argv, message):
    """Every refused input: exit status 2, one ``error:`` line naming the option or key (and the limit),
    no traceback, nothing on stdout, and nothing created: no output folder, no report, no job."""
    (tmp_path / "afile").write_text("")
    monkeypatch.chdir(tmp_path)  # the default --out, runs/..., would land here
    argv = [a.replace("{tmp}", str(tmp_path)).replace("{out}", str(tmp_path / "run")) for a in argv]
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and re.search(message, lines[0]), captured.err
    assert "Traceback" not in captured.err and captured.out == ""
    assert [p.name for p in tmp_path.iterdir()] == ["afile"]


def test_input_errors_import_no_jax():
    """A fresh interpreter refuses bad options, config values, method specs and paths without importing
    JAX or NumPy (so in a fraction of a second): the spec grammar and the compressors' argument names are
    read from their source."""
    cases = {  # argv -> what its error line names
        "given twice": _spec("topk(ratio=0.01, ratio=0.02)"),
        "nested 3 deep": _spec("topk(ratio={[]: 1})"),
        "unknown compressor 'nosuch'": _spec("nosuch(x=1)"),
        "unknown argument 'fraction'": _spec("topk(fraction=0.1)"),
        "unknown argument 'decay'": _spec("powersgd(rank=2)+residual(beta=1.0, decay=2)"),
        "--set methods: at most": _spec("topk(ratio=" + "1" * 20000 + ")"),
        "learning_rate: must be a finite number": [*_QS, "--set", "learning_rate=Infinity"],
        "methods: give at least one item": [*_QS, "--set", "methods=[]"],
        "train_examples must be >= 0": [*_QS, "--set", "train_examples=-5"],
        "batch_size must be a multiple": [*_QS, "--set", "batch_size=3", "--set", "devices=2"],
        "--devices must be in": [*_QS, "--devices", "0"],
        "--out: cannot write in '/proc'": ["run", "quickstart", "--smoke", "--out", "/proc/jaxcomm-run"],
        "-n: the number of processes": ["launch", "-n", "1000", "--", "true"],
        "--report: the folder": [*_LAUNCH, "--report", "/nonexistent-folder/r.json", "--", "true"],
        "--timeout: must be in": [*_LAUNCH, "--timeout", "inf", "--", "true"],
    }
    code = (
        "import json, sys\n"
        "from jaxcomm import cli\n"
        "codes = [cli.main(argv) for argv in json.loads(sys.argv[1])]\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'numpy', 'optax'))\n"
        "print(json.dumps([codes, heavy]))\n"
    )
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    argv = json.dumps([[a.replace("{out}", "/proc/jaxcomm-never") for a in case] for case in cases.values()])
    env = dict(os.environ, PYTHONPATH=str(root))
    proc = subprocess.run([sys.executable, "-c", code, argv], cwd=root, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    codes, heavy = json.loads(proc.stdout)
    assert codes == [2] * len(cases) and heavy == []
    lines = proc.stderr.splitlines()
    assert len(lines) == len(cases), proc.stderr
    for line, named in zip(lines, cases):
        assert line.startswith("error: ") and named in line, (named, line)


def test_spec_signatures_read_from_source_match_the_live_registry():
    """The table the parser reads without importing JAX (the factories' source, through ``ast``) is the
    registry's: the same compressors, memories and strategies, with the same keyword parameters."""
    import jaxcomm.memory
    import jaxcomm.transforms._pipeline  # signatures() reads the live modules where they are imported
    from jaxcomm import _spec

    comps, mems, strategies = _spec.signatures()
    assert set(comps) == set(compressors.names()) and set(mems) == set(jaxcomm.memory.names())
    assert comps["topk"].required == ("ratio",) and "matrix_approximation_rank" in comps["powersgd"].params
    assert _spec._source_compressors() == comps
    assert _spec._source_memories() == mems
    assert _spec._source_strategies() == strategies


_SCALARS = (
    st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.booleans()
    | st.none()
    | st.text(st.characters(codec="ascii", exclude_characters="'\"\\()[]{}@+,"), max_size=8)
)


@given(data=st.data())
def test_spec_formatting_and_parsing_round_trip(data):
    """``parse_method`` of a spec written from a compressor, a memory, their keywords (any of each factory's
    parameters, any scalar literal) and a strategy gives back exactly those parts."""
    from jaxcomm._spec import parse_method, signatures

    comps, mems, strategies = signatures()
    comp = data.draw(st.sampled_from(sorted(comps)))
    mem = data.draw(st.sampled_from(sorted(mems)))
    strategy = data.draw(st.sampled_from(["auto", *strategies]))

    def keywords(sig):
        optional = data.draw(st.lists(st.sampled_from(sig.params), unique=True, max_size=3)) if sig.params else []
        return {k: data.draw(_SCALARS) for k in dict.fromkeys([*sig.required, *optional])}

    comp_kw, mem_kw = keywords(comps[comp]), keywords(mems[mem])

    def call(name, kw):
        return name + (f"({', '.join(f'{k}={v!r}' for k, v in kw.items())})" if kw else "")

    spec = f"{call(comp, comp_kw)}+{call(mem, mem_kw)}@{strategy}"
    assert parse_method(spec) == ((comp, comp_kw), (mem, mem_kw), strategy)


@given(st.text(alphabet="topk(ratio=0.1,[]{}:)+EF@ -'\"\\*x9e", max_size=60))
def test_any_spec_text_is_parsed_or_refused_with_a_value_error(text):
    """Arbitrary spec text never escapes as another exception (TypeError, RecursionError, ...)."""
    from jaxcomm._spec import parse_method

    with contextlib.suppress(ValueError):
        parse_method(text)


@pytest.mark.parametrize("name", ["quickstart", "grace", "doublesqueeze"])
def test_run_help_lists_every_config_key_with_type_and_default(tmp_path, name):
    import dataclasses

    from jaxcomm.studies import config_help, config_to_dict

    exp = get_experiment(name)
    proc = _cli_subprocess("run", name, "--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    default = config_to_dict(exp.config())
    for f in dataclasses.fields(exp.config_type):
        assert f"  {f.name} (" in proc.stdout
        assert f"default {json.dumps(default[f.name])}" in proc.stdout
    rows = config_help(exp.config_type)
    assert [r[0] for r in rows] == [f.name for f in dataclasses.fields(exp.config_type)]
    assert all(r[3] for r in rows), [r[0] for r in rows if not r[3]]  # every key has a meaning
    assert list(tmp_path.iterdir()) == []


def test_top_level_help_is_plain_text(tmp_path):
    proc = _cli_subprocess("--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "jaxcomm run EXPERIMENT" in proc.stdout
    assert "``" not in proc.stdout and ":mod:" not in proc.stdout and "::" not in proc.stdout


def test_method_specs_parse_and_bad_ones_name_the_part():
    from experiments._common import parse_method

    assert parse_method("topk(ratio=0.01)+residual@allgather") == (
        ("topk", {"ratio": 0.01}),
        ("residual", {}),
        "allgather",
    )
    assert parse_method("qsgd(levels=16)+EF") == (("qsgd", {"levels": 16}), ("residual", {}), "auto")
    assert parse_method("none") == (("none", {}), ("none", {}), "auto")
    for bad, part in [
        ("topk(ratio=0.01", "expected NAME"),
        ("nosuch", "unknown compressor"),
        ("topk+nomem", "unknown memory"),
        ("topk@ring", "unknown strategy"),
        ("topk(foo=1)", "bad arguments"),
    ]:
        with pytest.raises(ValueError, match=part):
            parse_method(bad)


def test_list_override_keeps_commas_inside_a_spec():
    cfg = get_experiment("quickstart").config(
        smoke=True, overrides={"methods": "topk(ratio=0.01,seed=3)+residual,none"}
    )
    assert cfg.methods == ("topk(ratio=0.01,seed=3)+residual", "none")


def test_quickstart_figure_title_follows_the_config(tmp_path):
    from PIL import Image

    from experiments._common import plot_curves
    from experiments.quickstart.run import figure_title

    cfg = get_experiment("quickstart").config(
        smoke=True, overrides={"dataset": "fashion_mnist", "model": "mlp", "devices": 2, "steps": 7}
    )
    title = figure_title(cfg)
    assert "fashion_mnist" in title and "mlp" in title and "2 workers" in title and "7 steps" in title
    runs = [{"name": "none", "history": [{"step": 0, "eval_accuracy": 0.1}, {"step": 7, "eval_accuracy": 0.5}]}]
    png = plot_curves(runs, tmp_path / "a.png", title=title, ylabel="test accuracy")
    info = Image.open(png).text
    assert info["Title"] == title and info["XLabel"] == "step" and info["YLabel"] == "test accuracy"


def test_figures_marked_puts_the_suffix_on_each_figures_title_once(tmp_path):
    # The three places a title can be: the suptitle, the only axes' title, none (several axes).
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    from jaxcomm.studies import SMOKE_MARK, figures_marked

    def figures():
        one, ax = plt.subplots()
        ax.set_title("loss")
        sup, _ = plt.subplots(1, 2)
        sup.suptitle("two panels")
        bare, _ = plt.subplots(1, 2)
        for i, fig in enumerate((one, sup, bare)):
            for _ in range(2):  # saved twice: marked once
                fig.savefig(tmp_path / f"{i}.png", metadata={"Title": f"t{i}"})
        titles = [ax.get_title(), sup.get_suptitle(), bare.get_suptitle()]
        plt.close("all")
        return titles, [Image.open(tmp_path / f"{i}.png").text["Title"] for i in range(3)]

    with figures_marked(SMOKE_MARK):
        assert figures() == (
            ["loss (smoke run)", "two panels (smoke run)", "(smoke run)"],
            ["t0 (smoke run)", "t1 (smoke run)", "t2 (smoke run)"],
        )
    assert figures() == (["loss", "two panels", ""], ["t0", "t1", "t2"])  # outside: as drawn
    with pytest.raises(ValueError, match="variant"):
        get_experiment("quickstart").run(get_experiment("quickstart").config(smoke=True), tmp_path, variant="tiny")


def test_cumulative_bits_and_time_are_running_sums():
    import numpy as np

    from experiments.quickstart.run import with_cumulative

    rng = np.random.default_rng(0)
    bits, secs = rng.integers(1, 10**6, 9), rng.random(9)
    history = [
        {"step": i, "wire_bits_total": int(b), "step_time": float(t)} for i, (b, t) in enumerate(zip(bits, secs))
    ]
    (out,) = with_cumulative([{"name": "m", "history": history}], workers=4)
    np.testing.assert_allclose([r["Mbit_sent"] for r in out["history"]], np.cumsum(bits) / 4e6)
    secs[0] = 0.0  # step 0 (compilation) is left out
    np.testing.assert_allclose([r["elapsed_s"] for r in out["history"]], np.cumsum(secs))


def test_single_evaluation_runs_are_drawn_as_dots_over_their_names(tmp_path):
    # A smoke run evaluated once has one x value: the figure says so instead of a 3.8-4.2 axis.
    from PIL import Image

    from experiments._common import plot_curves

    runs = [
        {"name": n, "history": [{"step": 1, "loss": 2.0}, {"step": 4, "loss": 1.5, "eval_accuracy": a}]}
        for n, a in (("sgd", 0.3), ("ds", 0.2))
    ]
    png = plot_curves(runs, tmp_path / "a.png", title="t", ylabel="test accuracy")
    assert Image.open(png).text["XLabel"] == "run (one value each at step 4)"
    png = plot_curves(runs, tmp_path / "b.png", y="loss", title="t")  # curves stay curves where x varies
    assert Image.open(png).text["XLabel"] == "step"
