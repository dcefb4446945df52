"""experiments/studies/paper_claims.py: seed-paired summaries, figures, and a smoke run of every study."""

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("_paper_claims", ROOT / "experiments" / "studies" / "paper_claims.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


claims = _load()


@settings(max_examples=25, deadline=None)
@given(
    a=st.lists(st.floats(-10, 10, allow_nan=False), min_size=2, max_size=5),
    shift=st.floats(-1, 1, allow_nan=False),
)
def test_summary_is_the_seed_paired_mean_and_sample_std(a, shift):
    seeds = list(range(len(a)))
    b = [x - shift * (i + 1) for i, x in enumerate(a)]
    records = [{"variant": "A", "seed": s, "final": x} for s, x in zip(seeds, a)]
    records += [{"variant": "B", "seed": s, "final": x} for s, x in zip(seeds, b)]
    out = claims.summarize(records, [("A", "B")])
    assert out["variants"]["A"]["mean"] == pytest.approx(np.mean(a))
    assert out["variants"]["B"]["std"] == pytest.approx(np.std(b, ddof=1))
    d = np.array(a) - np.array(b)
    (diff,) = out["differences"]
    assert diff["pair"] == "A − B"
    assert diff["mean"] == pytest.approx(d.mean()) and diff["std"] == pytest.approx(d.std(ddof=1), abs=1e-9)


def test_summary_pairs_only_common_seeds():
    records = [{"variant": "A", "seed": s, "final": float(s)} for s in (0, 1, 2)]
    records += [{"variant": "B", "seed": s, "final": 0.0} for s in (1, 2)]
    (diff,) = claims.summarize(records, [("A", "B"), ("A", "missing")])["differences"]
    assert diff["values"] == [1.0, 2.0]


@pytest.mark.slow
@pytest.mark.parametrize("study", claims.STUDIES)
def test_smoke_run_of_every_study(study, tmp_path):
    claims.main(["--study", study, "--smoke", "--seeds", "0,1", "--out", str(tmp_path)])
    result = json.loads((tmp_path / f"{study}.json").read_text())
    assert result["seeds"] == [0, 1]
    variants = {r["variant"] for r in result["runs"]}
    assert all(sum(r["variant"] == v for r in result["runs"]) == 2 for v in variants)  # every seed of every variant
    for v, row in result["summary"]["variants"].items():
        finals = [r["final"] for r in result["runs"] if r["variant"] == v]
        assert row["mean"] == pytest.approx(np.mean(finals))
    assert (result["refused"] is not None) == (study == "qsgd-ef")
    if study == "qsgd-ef":
        assert "contractive" in result["refused"]
    from PIL import Image

    with Image.open(tmp_path / f"{study}.png") as png:
        assert png.info["Title"] == result["figure"]["title"] and "2 seeds" in png.info["Title"]
    assert claims.replot(tmp_path / f"{study}.json").exists()
