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
