"""``jaxcomm run paper-claims`` (experiments/paper_claims/): seed-paired summaries, figures, and a smoke run
of every study."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments.paper_claims import run as claims
from jaxcomm.studies import get_experiment


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


@settings(max_examples=25, deadline=None)
@given(
    slope=st.floats(1e-4, 1.0),
    step=st.integers(1, 200),
    n=st.integers(2, 12),
    frac=st.floats(0.0, 1.0),
)
def test_steps_to_reach_inverts_a_linear_curve(slope, step, n, frac):
    curve = [(step * (i + 1), slope * step * (i + 1)) for i in range(n)]
    target = slope * step * (1 + frac * (n - 1))  # between the first and the last evaluation
    assert claims.steps_to_reach(curve, target) == pytest.approx(target / slope, rel=1e-9)
    assert claims.steps_to_reach(curve, slope * step * n * 1.01) is None
    assert claims.steps_to_reach(curve, 0.0) == step  # reached at the first evaluation


def test_gap_causes_split_the_gap_into_uplink_and_downlink():
    # SGD rises 0.1 per 100 steps; DoubleSqueeze is SGD 200 steps late; MEM-SGD 100 steps late.
    grid = range(100, 1001, 100)
    late = lambda lag, seed: [(s, 0.001 * (s - lag) + 0.01 * seed) for s in grid]
    records = [
        {"variant": v, "seed": seed, "final": late(lag, seed)[-1][1], "curve": late(lag, seed)}
        for v, lag in (("SGD", 0), ("MEM-SGD top-k 1 %", 100), ("DoubleSqueeze top-k 1 %", 200))
        for seed in (0, 1, 2)
    ]
    records.append({"variant": "DoubleSqueeze top-k 10 %", "seed": 0, "final": 0.75, "curve": late(250, 0)})
    summary = claims.summarize(records, claims.PAIRS["doublesqueeze-bytes"])
    out = claims.gap_causes(records, summary, 1000)
    assert out["gap"] == pytest.approx(0.2)
    assert out["uplink"]["points"] == pytest.approx(0.1) and out["downlink"]["share_of_gap"] == pytest.approx(0.5)
    assert out["uplink"]["points"] + out["downlink"]["points"] == pytest.approx(out["gap"])
    density = out["density"]
    assert density["points"] == pytest.approx(-0.05) and density["share_of_gap"] == pytest.approx(-0.25)
    assert density["seeds"] == 1 and np.isnan(density["std"])
    assert out["lag_steps"] == pytest.approx(200)
    assert [g for _, g in out["gap_by_step"]] == pytest.approx([0.2] * 10)


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    """A persistent compilation cache for the smoke runs: a study's seeds compile the same step (only
    the data and the initial values differ), so every seed after the first loads it, and studies that
    share a variant share its step."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    names = (
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
    )
    old = {k: getattr(jax.config, k) for k in names}
    for k, v in zip(names, (str(tmp_path_factory.mktemp("jit")), 0.2, 0)):
        jax.config.update(k, v)
    compilation_cache.reset_cache()
    yield
    for k, v in old.items():
        jax.config.update(k, v)
    compilation_cache.reset_cache()


@pytest.mark.slow
@pytest.mark.parametrize("study", claims.CLAIMS)
def test_smoke_run_of_every_study(study, tmp_path, compile_cache):
    exp = get_experiment("paper-claims")
    out = exp.run(exp.config(smoke=True, overrides={"studies": study}), tmp_path, variant="smoke")
    result = json.loads((tmp_path / f"{study}.json").read_text())
    assert out["files"] == [f"{study}.json"]
    assert [(r["pair"], r["mean"]) for r in out["summary"]] == [
        (d["pair"], d["mean"]) for d in result["summary"]["differences"]
    ]
    assert result["seeds"] == [0, 1]
    runs = result["runs"]
    variants = {r["variant"] for r in runs}
    repeated = variants
    if study == "sign-ef":  # the sweep ran seed 0 only; each arm's best rate, every seed
        arms = {r["arm"] for r in runs}
        for arm in arms:
            sweep = [r for r in runs if r["arm"] == arm and r["seed"] == 0]
            assert sorted(r["lr"] for r in sweep) == sorted(result["rates"])
            assert result["best_lr"][arm] == max(sweep, key=lambda r: r["final"])["lr"]
        repeated = {f"{arm}, lr {lr:g}" for arm, lr in result["best_lr"].items()}
        (diff,) = result["summary"]["differences"]
        assert diff["pair"] == " − ".join(
            f"SignSGD{ef}, lr {result['best_lr']['SignSGD' + ef]:g}" for ef in (" + EF", "")
        )
    if study == "doublesqueeze-bytes":  # SGD's equal-bytes steps: the largest whose bits fit DoubleSqueeze's
        b = result["bytes"]
        ds = next(r for r in runs if r["variant"] == "DoubleSqueeze top-k 1 %")
        sgd = next(r for r in runs if r["variant"] == "SGD")
        assert b["P"] * b["N"] == ds["wire_bits_per_worker"] and b["D"] * b["N"] == sgd["wire_bits_per_worker"]
        assert b["sgd_steps"] == max(1, int(b["N"] * b["P"] // b["D"]))
        for r in (r for r in runs if r["variant"] == "SGD, equal bytes"):
            assert r["steps"] == b["sgd_steps"] and r["wire_bits_per_worker"] == b["sgd_steps"] * b["D"]
        assert result["summary"]["causes"]["gap"] == pytest.approx(
            result["summary"]["variants"]["SGD"]["mean"]
            - result["summary"]["variants"]["DoubleSqueeze top-k 1 %"]["mean"]
        )
    assert all(sum(r["variant"] == v for r in runs) == 2 for v in repeated)  # every seed of every variant
    for v, row in result["summary"]["variants"].items():
        finals = [r["final"] for r in runs if r["variant"] == v]
        assert row["mean"] == pytest.approx(np.mean(finals))
    assert (result["refused"] is not None) == (study in ("qsgd-ef", "sign-ef"))
    if study == "qsgd-ef":
        assert "contractive" in result["refused"]
    if study == "sign-ef":
        assert "signsgd" in result["refused"] and "efsignsgd" in result["refused"]
    from PIL import Image

    with Image.open(tmp_path / f"{study}.png") as png:
        assert png.info["Title"] == result["figure"]["title"] + " (smoke run)" and "2 seeds" in png.info["Title"]
    for suffix in result.get("more_figures", {}):
        assert (tmp_path / f"{study}-{suffix}.png").exists()
    assert claims.replot(tmp_path / f"{study}.json").exists()


@pytest.mark.parametrize("argv", [["--seeds", "0,x"], ["--seeds", ","], ["--steps", "0"], ["--study", "nosuch"]])
def test_script_refuses_bad_arguments_before_any_run(argv, tmp_path, capsys):
    """``python -m experiments.paper_claims.run``: a bad option is a usage error (exit 2), nothing written."""
    with pytest.raises(SystemExit) as e:
        claims.main([*argv, "--out", str(tmp_path / "out")])
    assert e.value.code == 2 and argv[0] in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
