"""``jaxcomm run gradient-dropping-time``: the time to the target, the records, summary and verdicts
against closed forms, the configuration's checks, and the smoke run over MPI on an emulated link
(skipped where no private network namespace can be made).

No assertion depends on timing: the smoke run's checks are what the runs must get right on any
load (records per method and seed, the target's definition, the time to it read off the curve,
the bytes of the dense and the sparse exchanges on the link, the summary's arithmetic).
"""

import json
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from experiments.gradient_dropping import timed
from jaxcomm.studies import get_experiment

pytestmark = pytest.mark.strict_promotion

EXP = get_experiment("gradient-dropping-time")


@given(
    st.floats(20.0, 100.0),  # perplexity at the first evaluation
    st.floats(0.01, 1.0),  # its fall per second
    st.floats(0.5, 3.0),  # seconds between evaluations
    st.integers(3, 30),  # evaluations
    st.floats(0.0, 1.0),  # where the target lies along the curve
)
def test_time_to_target_of_a_straight_curve_is_its_crossing(start, slope, dt, n, where):
    times = np.arange(1, n + 1) * dt
    steps = np.arange(1, n + 1) * 10
    values = start - slope * times
    target = values[0] - where * (values[0] - values[-1])
    t, s = timed.time_to_target((times, steps), values, target)
    assert t == pytest.approx((start - target) / slope, rel=1e-9, abs=1e-9)  # the straight line's crossing
    assert s == pytest.approx(t / dt * 10, rel=1e-9, abs=1e-9)
    assert timed.time_to_target((times, steps), values, values[-1] - 1.0) == (None, None)
    assert timed.time_to_target((times, steps), values, values[0] + 1.0) == (times[0], steps[0])


def _run(method, seed, times, ppl, steps_per_eval=10, step_s=0.1, bytes_per_step=1000, bits=800):
    n = len(times)
    return {
        "method": method,
        "seed": seed,
        "curve": [
            {"step": (i + 1) * steps_per_eval, "time_s": t, "perplexity": p}
            for i, (t, p) in enumerate(zip(times, ppl, strict=True))
        ],
        "steps": n * steps_per_eval,
        "time_s": times[-1],
        "step_times": [step_s] * (n * steps_per_eval),
        "wire_bits_per_step": [bits] * (n * steps_per_eval),
        "link_bytes": bytes_per_step * n * steps_per_eval,
        "params": 100,
    }


def test_records_summary_and_verdicts_of_known_runs():
    """Three seeds with chosen curves: the target is the baseline's final perplexity x 1.05; the
    times to it, the speed-ups, the means and sample deviations follow by hand; a vanilla-dropping
    run that never reaches the target gives a lower bound from its whole run."""
    config = EXP.config(overrides={"warmup_steps": 0, "bandwidth": "200mbit"})
    base_ppl = [12.0, 11.0, 10.0, 9.0]  # target 9.45: crossed half-way between the 3rd and 4th evaluation
    runs, compute = [], {"baseline": 0.05, "drop99": 0.06, "partial+sync": 0.06}
    for seed, scale in enumerate((1.0, 1.1, 1.2)):
        base_t = [scale * x for x in (10.0, 20.0, 30.0, 40.0)]
        part_t = [scale * x for x in (5.0, 10.0, 15.0, 20.0)]
        drop_ppl = [12.0, 11.0, 10.0, 9.0] if seed < 2 else [12.0, 11.0, 10.5, 10.0]  # seed 2: never
        runs += [
            _run("baseline", seed, base_t, base_ppl, step_s=0.1 * scale),
            _run("drop99", seed, [scale * x for x in (8.0, 16.0, 24.0, 32.0)], drop_ppl, bits=80),
            _run("partial+sync", seed, part_t, [12.0, 10.0, 9.4, 9.2], bits=80),
        ]
    job = {"runs": runs, "compute_s": compute}
    recs = timed.records(job, config)
    by = {(r["method"], r["seed"]): r for r in recs}
    for seed, scale in enumerate((1.0, 1.1, 1.2)):
        assert by[("baseline", seed)]["target_perplexity"] == pytest.approx(9.45)
        assert by[("baseline", seed)]["time_to_target_s"] == pytest.approx(scale * 35.5)  # 30 + 0.55 x 10 s
        assert by[("baseline", seed)]["steps_to_target"] == pytest.approx(35.5)
        # partial: 10.0 at 10 s, 9.4 at 15 s -> 9.45 at 10 + 5 * 0.55 / 0.6 s
        assert by[("partial+sync", seed)]["time_to_target_s"] == pytest.approx(scale * (10 + 5 * 0.55 / 0.6))
        assert by[("baseline", seed)]["comm_share"] == pytest.approx(1 - 0.05 / (0.1 * scale))
        assert by[("baseline", seed)]["link_bytes_per_step"] == 1000
        # 8000 bits per step at 200 Mbit/s, over the run's mean step of 1 s (x scale)
        assert by[("baseline", seed)]["link_share"] == pytest.approx(8000 / 200e6 / scale)
        assert by[("partial+sync", seed)]["wire_bytes_per_step_after_warmup"] == 10
    assert by[("drop99", 2)]["time_to_target_s"] is None
    rows = {row["method"]: row for row in timed.summarize(recs)}
    assert [rows[m]["reached"] for m in ("baseline", "drop99", "partial+sync")] == [3, 2, 3]
    base_times = [35.5 * scale for scale in (1.0, 1.1, 1.2)]
    assert rows["baseline"]["time_to_target_s"] == pytest.approx(np.mean(base_times))
    assert rows["baseline"]["time_to_target_s_std"] == pytest.approx(np.std(base_times, ddof=1))
    claims = {c["claim"].split(" (")[0]: c for c in timed.verdicts(recs, config)}
    t_part = 10 + 5 * 0.55 / 0.6
    vs_base = claims["PARTIAL + sync reaches the target faster than the uncompressed multi-node baseline"]
    assert vs_base["values"] == pytest.approx([35.5 / t_part] * 3)  # 2.43: faster, above 1.48 x 1.25
    assert vs_base["verdict"] == "partly" and vs_base["seeds"] == 3
    vs_drop = claims["PARTIAL + sync reaches the target faster than vanilla gradient dropping"]
    # drop99 crosses 9.45 at 28.4 s (x scale); seed 2 never: its whole run, 32 x 1.2 s, is a lower bound
    assert vs_drop["values"] == pytest.approx([28.4 / t_part, 28.4 / t_part, 32.0 / t_part])
    assert vs_drop["lower_bound"] == [False, False, True]
    # The common level (the seed's highest final perplexity): 9.2, and 10.0 for seed 2 (drop99's).
    assert by[("drop99", 2)]["common_perplexity"] == 10.0 and by[("baseline", 0)]["common_perplexity"] == 9.2
    assert by[("baseline", 0)]["time_to_common_s"] == pytest.approx(38.0)  # 30 + 0.8 x 10 s
    assert by[("baseline", 0)]["steps_to_common"] == pytest.approx(38.0)
    assert vs_base["at_common_level"] == pytest.approx([38.0 / 20.0, 38.0 / 20.0, 30.0 / 10.0])
    assert vs_drop["at_common_level"] == pytest.approx([30.4 / 20.0, 30.4 / 20.0, 32.0 / 10.0])
    raw = claims["gradient dropping raises the raw training speed"]
    assert raw["values"] == pytest.approx([40.0 / 32.0] * 3) and raw["verdict"] == "holds"  # 1.25 vs 1.41
    quality = claims["PARTIAL + sync loses no quality"]
    assert quality["values"] == pytest.approx([9.2 / 9.0] * 3) and quality["verdict"] == "holds"
    table = timed.headline({"summary": timed.summarize(recs)})
    assert [row["method"] for row in table[:3]] == ["baseline", "drop99", "partial+sync"]
    assert table[0]["at target"] == "3/3" and table[1]["at target"] == "2/3"


def test_the_paper_claims_are_its_table_2_ratios():
    """'48 % faster' and '28 % faster' are t_slow / t_fast - 1 of Table 2's En-De times to 33.5 BLEU."""
    h = timed.PAPER["en_de"]["time_to_target_h"]
    assert round(h["baseline"] / h["partial+sync"] - 1, 2) == 0.48
    assert round(h["drop99"] / h["partial+sync"] - 1, 2) == 0.28


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("methods", ["drop99", "partial+sync"], r"GradientDroppingTimeConfig\.methods: .*'baseline' included"),
        ("methods", ["baseline", "nosuch"], r"GradientDroppingTimeConfig\.methods: distinct names"),
        ("methods", ["baseline", "baseline"], r"GradientDroppingTimeConfig\.methods: distinct names"),
        ("seeds", [1, 1], r"GradientDroppingTimeConfig\.seeds: give distinct"),
        ("num_procs", 1, r"GradientDroppingTimeConfig\.num_procs: need at least 2"),
        ("eval_windows", 15, r"GradientDroppingTimeConfig\.eval_windows: a multiple of num_procs"),
        ("target_rtol", 0.0, r"GradientDroppingTimeConfig\.target_rtol must be > 0"),
        ("bandwidth", "fast", r"GradientDroppingTimeConfig\.bandwidth: "),
    ],
)
def test_bad_config_names_the_key_before_anything_runs(tmp_path, key, value, match):
    with pytest.raises(ValueError, match=match):
        EXP.run(EXP.config(smoke=True, overrides={key: value}), tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.mpi
def test_smoke_run_on_an_emulated_link(namespaces, tmp_path):
    pytest.importorskip("mpi4py")
    cfg = EXP.config(smoke=True)
    res = EXP.run(cfg, tmp_path)
    assert json.loads((tmp_path / "results.json").read_text())["summary"] == res["summary"]
    assert (tmp_path / "perplexity_vs_time.png").stat().st_size > 0
    assert len(res["load_average_start"]) == len(res["load_average_end"]) == 3
    recs = res["records"]
    assert sorted((r["seed"], r["method"]) for r in recs) == sorted((s, m) for s in cfg.seeds for m in cfg.methods)
    d = recs[0]["params"]
    k = round((1 - cfg.drop_ratio) * d)
    for r in recs:
        key = (r["method"], r["seed"])
        base = next(q for q in recs if q["method"] == "baseline" and q["seed"] == r["seed"])
        assert r["target_perplexity"] == pytest.approx(base["final_perplexity"] * (1 + cfg.target_rtol)), key
        steps = [c["step"] for c in r["curve"]]
        assert steps == list(range(cfg.eval_every, cfg.steps + 1, cfg.eval_every)), key
        ppl = [c["perplexity"] for c in r["curve"]]
        assert all(math.isfinite(p) and p > 1 for p in ppl), key
        assert r["common_perplexity"] == max(q["final_perplexity"] for q in recs if q["seed"] == r["seed"]), key
        assert r["time_to_common_s"] is not None, key
        assert (r["time_to_target_s"], r["steps_to_target"]) == timed.time_to_target(
            ([c["time_s"] for c in r["curve"]], steps), ppl, r["target_perplexity"]
        ), key
        if r["method"] == "baseline":  # every worker sends its dense float32 gradient every step
            assert r["wire_bytes_per_step_after_warmup"] == 4 * d and r["time_to_target_s"] is not None
            # a ring all-reduce: each of the n workers sends 2 (n - 1) / n of the gradient
            assert r["link_bytes"] >= r["steps"] * 2 * (cfg.num_procs - 1) * 4 * d, key
        else:  # after the warm-up: K (float32 value, uint16 index) pairs; the dense parameters at a sync
            assert 256 < d <= 65536, d
            after = range(cfg.warmup_steps + 1, cfg.steps + 1)
            syncs = sum(t % cfg.sync_every == 0 for t in after) if r["method"].endswith("+sync") else 0
            expected = k * (4 + 2) + 4 * d * syncs / len(after)
            assert r["wire_bytes_per_step_after_warmup"] == pytest.approx(expected), key
        # The kernel's count holds at least what the workers handed to the collectives.
        assert r["link_bytes"] >= r["steps"] * r["wire_bytes_per_step_after_warmup"], key
        assert r["link_share"] == pytest.approx(8 * r["link_bytes"] / 1e9 / r["time_s"]), key  # a 1 Gbit/s link
        assert r["compute_s"] is None and r["comm_share"] is None, key  # compute_steps = 0: not measured
    rows = {row["method"]: row for row in res["summary"]}
    for method in cfg.methods:
        mine = [r for r in recs if r["method"] == method]
        assert rows[method]["seeds"] == len(cfg.seeds)
        assert rows[method]["final_perplexity"] == pytest.approx(np.mean([r["final_perplexity"] for r in mine]))
        assert rows[method]["steps_per_s_std"] == pytest.approx(np.std([r["steps_per_s"] for r in mine], ddof=1))
    assert {c["verdict"] for c in res["verdicts"]} <= {"holds", "partly", "does not"}
    assert all(c["seeds"] == len(cfg.seeds) for c in res["verdicts"]) and len(res["verdicts"]) == 2
