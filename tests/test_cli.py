"""The command line: listing, bad names and keys, a smoke run writing JSON + PNG."""

import json

import pytest

from jaxcomm import cli, compressors
from jaxcomm.experiments import apply_overrides, experiment_names, get_experiment


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


def test_override_types_are_checked():
    cfg = get_experiment("grace").config(smoke=True)
    assert apply_overrides(cfg, {"steps": "7"})["steps"] == 7
    assert apply_overrides(cfg, {"compressors": '["topk"]'})["compressors"] == ["topk"]
    with pytest.raises(ValueError, match="could not parse .seven. as int"):
        apply_overrides(cfg, {"steps": "seven"})


def test_format_table_aligns_columns():
    table = cli.format_table([{"a": 1.23456, "b": "x"}, {"a": 2.0, "b": "long"}])
    lines = table.splitlines()
    assert len({len(line) for line in lines}) == 1
    assert "1.235" in table


def test_demo_table_covers_every_compressor(capsys):
    from jaxcomm.demo import gradient_table

    import jax.numpy as jnp

    grads = {"w": jnp.linspace(-1.0, 1.0, 640).reshape(32, 20), "b": jnp.linspace(-0.5, 0.5, 20)}
    rows = gradient_table(grads)
    assert [r["compressor"] for r in rows] == compressors.names()
    none = next(r for r in rows if r["compressor"] == "none")
    assert none["rel_error"] == 0.0 and none["wire_bits"] == 32 * 660
    for r in rows:
        assert r["wire_bits"] > 0 and r["rel_error"] >= 0.0


def test_quickstart_smoke_via_cli(tmp_path, capsys):
    out = tmp_path / "qs"
    assert cli.main(["run", "quickstart", "--smoke", "--devices", "8", "--out", str(out),
                     "--set", "steps=4", "--set", "eval_every=4"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert (out / "accuracy.png").stat().st_size > 0
    assert {r["method"] for r in results["summary"]} == set(get_experiment("quickstart").config(smoke=True)["methods"])
    by = {r["method"]: r for r in results["summary"]}
    assert by["topk-1%+EF"]["Mbit_per_worker"] < by["none"]["Mbit_per_worker"] / 10
    assert "test_accuracy" in capsys.readouterr().out


def test_grace_records_a_failing_run_and_goes_on(monkeypatch, tmp_path):
    # A run that raises (here: a fake trainer that "diverges" for qsgd) is listed under `failed`;
    # the remaining runs still happen and the figures are still written.
    from jaxcomm.experiments.grace import run as grace
    from jaxcomm.train import NonFiniteLossError

    monkeypatch.setattr(grace, "load_image_task", lambda *a, **k: (None, None))

    def fake_train(*, name, **kwargs):
        if name.startswith("qsgd"):
            raise NonFiniteLossError("loss became nan at step 3")
        return {"name": name, "history": [{"step": 1, "eval_accuracy": 0.5}], "final_accuracy": 0.5,
                "wire_bits_per_worker": 10.0, "dense_bits_per_worker": 320.0, "compute_time_s": 1.0,
                "est_comm_time_s": {"10Gbps": 0.1}}

    monkeypatch.setattr(grace, "train_data_parallel", fake_train)
    cfg = get_experiment("grace").config(smoke=True)
    cfg["compressors"] = ["none", "qsgd", "topk"]
    out = grace.run(cfg, tmp_path)
    assert [r["name"] for r in out["runs"]] == ["none", "topk", "topk+EF"]
    assert out["failed"] == [
        {"compressor": "qsgd", "error_feedback": False, "error": "NonFiniteLossError: loss became nan at step 3"},
        {"compressor": "qsgd", "error_feedback": True, "error": "NonFiniteLossError: loss became nan at step 3"},
    ]
    assert (tmp_path / "quality_vs_bits.png").exists()
