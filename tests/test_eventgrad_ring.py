"""``jaxcomm run eventgrad-ring``: the plateau, target, staleness and verdict rules against closed forms
and brute force, the configuration's checks, and the smoke run over MPI one-sided windows on an
emulated link (skipped where no private network namespace can be made).

No assertion depends on timing: the smoke run's checks are what the runs must get right on any load
(records per method and seed, the message counts against D-PSGD's closed form, the link's count
against the payload the puts carry, the summary's arithmetic over the records).
"""

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from experiments.eventgrad import ring
from jaxcomm.studies import get_experiment

pytestmark = pytest.mark.strict_promotion

EXP = get_experiment("eventgrad-ring")


def test_plateau_and_time_to_target_of_known_curves():
    acc = [50.0, 80.0, 90.0, 90.4, 90.9, 90.6]
    assert ring.plateau(acc, 3, 0.5) == (True, pytest.approx((90.4 + 90.9 + 90.6) / 3))
    assert ring.plateau(acc, 4, 0.5) == (False, pytest.approx(np.mean(acc[-4:])))
    times, steps = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [10, 20, 30, 40, 50, 60]
    assert ring.time_to_target(times, steps, acc, 90.4) == (4.0, 40)
    assert ring.time_to_target(times, steps, acc, 91.0) == (None, None)


@given(hnp.arrays(bool, st.tuples(st.integers(1, 3), st.integers(1, 12), st.integers(1, 4))), st.data())
def test_staleness_is_the_mean_age_of_the_last_sent_copy(fired, data):
    """Against a loop over workers, steps and tensors: the steps since the tensor was last sent."""
    p, t, l = fired.shape
    sizes = data.draw(st.lists(st.integers(1, 50), min_size=l, max_size=l))
    ages = np.zeros((p, t, l))
    for w in range(p):
        for j in range(l):
            last = 0
            for s in range(t):
                last = s if fired[w, s, j] else last
                ages[w, s, j] = s - last
    expected = (ages.mean(axis=(0, 1)) * np.array(sizes)).sum() / sum(sizes)
    assert ring.staleness(fired, sizes) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("values", "low", "high", "side", "expected"),
    [
        ([40.0, 42.0, 44.0], 32.4, 54.1, (0.0, 100.0), "holds"),
        ([30.0, 42.0, 44.0], 32.4, 54.1, (0.0, 100.0), "partly"),  # the mean in range, one seed not
        ([60.0, 62.0, 70.0], 32.4, 54.1, (0.0, 100.0), "partly"),  # fewer messages, another magnitude
        ([60.0, 62.0, 120.0], 32.4, 54.1, (0.0, 100.0), "does not"),
        ([-0.5, 0.2, -2.5], -1.0, 1.0, None, "partly"),
        ([-2.5, -3.0, -1.5], -1.0, 1.0, None, "does not"),
        ([0.8, None, 0.9], 0.0, 1.0, None, "partly"),  # one seed never reached the target
        ([None, None], 0.0, 1.0, None, "does not"),
    ],
)
def test_verdict_rule(values, low, high, side, expected):
    assert ring.verdict(values, low, high, side) == expected


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("methods", ["eventgrad"], r"EventGradRingConfig\.methods: .*'dpsgd' included"),
        ("methods", ["dpsgd", "dpsgd"], r"EventGradRingConfig\.methods: distinct"),
        ("seeds", [1, 1], r"EventGradRingConfig\.seeds: give distinct"),
        ("task", "cifar", r"EventGradRingConfig\.task: one of"),
        ("eval_every", 7, r"EventGradRingConfig\.eval_every: must divide iterations \(20\)"),
        ("plateau_evals", 3, r"EventGradRingConfig\.plateau_evals: the run has 2 evaluations"),
        ("threshold_rule", "both", r"EventGradRingConfig\.threshold_rule: one of"),
        ("bandwidth", "fast", r"EventGradRingConfig\.bandwidth: "),
        ("topk", 1.5, r"EventGradRingConfig\.topk must be in"),
    ],
)
def test_bad_config_names_the_key_before_anything_runs(tmp_path, key, value, match):
    with pytest.raises(ValueError, match=match):
        EXP.run(EXP.config(smoke=True, overrides={key: value}), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_docs_show_the_committed_results_tables():
    """docs/eventgrad.md shows exactly the tables :func:`ring.markdown_tables` makes of the committed
    results, whose summary is the records' arithmetic and whose verdicts follow the rule."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    res = json.loads((root / "docs/img/eventgrad/ring_4procs_200mbit_1500_steps.json").read_text())
    assert ring.summarize(res["records"]) == res["summary"]
    config = EXP.config_type(**{k: tuple(v) if isinstance(v, list) else v for k, v in res["config"].items()})
    assert ring.verdicts(res["records"], config) == res["verdicts"]
    page = (root / "docs/eventgrad.md").read_text()
    assert all(t in page for t in ring.markdown_tables(res).split("\n\n"))


@pytest.mark.mpi
def test_smoke_run_on_an_emulated_link(namespaces, tmp_path):
    pytest.importorskip("mpi4py")
    cfg = EXP.config(smoke=True)
    res = EXP.run(cfg, tmp_path)
    assert json.loads((tmp_path / "results.json").read_text())["summary"] == res["summary"]
    assert (tmp_path / "accuracy.png").stat().st_size > 0
    assert len(res["load_average_start"]) == len(res["load_average_end"]) == 3
    sizes = ring._tensor_sizes(cfg, cfg.seeds[0])
    p, t, tensors, param_bytes = cfg.num_procs, cfg.iterations, len(sizes), 4 * sum(sizes)
    records = {(r["method"], r["seed"]): r for r in res["records"]}
    assert sorted(records) == sorted((m, s) for m in cfg.methods for s in cfg.seeds)
    for (method, seed), r in records.items():
        assert r["snapshot_steps"] == list(range(cfg.eval_every, t + 1, cfg.eval_every)), method
        assert len(r["accuracy"]) == len(r["snapshot_times_s"]) == t // cfg.eval_every
        assert all(0.0 <= a <= 100.0 for a in r["accuracy"])
        assert r["messages_at_snapshots"][-1] == r["messages"]  # the puts are the fired tensors x 2
        # Every payload byte crossed the link (plus headers, acknowledgements, the locks' messages).
        assert r["link_bytes"] >= r["payload_bytes"] > 0, method
        base = records[("dpsgd", seed)]
        assert r["target_accuracy"] == pytest.approx(base["plateau_accuracy"] - cfg.target_points)
        assert r["percent_messages"] == pytest.approx(100.0 * r["messages"] / base["messages"])
    for seed in cfg.seeds:
        base, event = records[("dpsgd", seed)], records[("eventgrad", seed)]
        # D-PSGD puts every tensor into both neighbours' windows every step: its closed form.
        assert base["messages"] == 2 * p * t * tensors and base["payload_bytes"] == 2 * p * t * param_bytes
        assert base["staleness_steps"] == 0.0 and base["time_to_target_s"] is not None
        # EventGraD sends every tensor in its forced steps, and at most every tensor every step.
        assert 2 * p * cfg.forced_iterations * tensors <= event["messages"] <= base["messages"]
        assert base["link_bytes"] < 1.25 * base["payload_bytes"]  # the puts dominate the link
    rows = {row["method"]: row for row in res["summary"]}
    for m in cfg.methods:
        mine = [r for r in res["records"] if r["method"] == m]
        assert rows[m]["seeds"] == len(cfg.seeds)
        assert rows[m]["plateau_accuracy"] == pytest.approx(np.mean([r["plateau_accuracy"] for r in mine]))
    claims = res["verdicts"]
    assert [c["method"] for c in claims] == ["eventgrad"] * 3
    assert all(c["seeds"] == len(cfg.seeds) and c["verdict"] in {"holds", "partly", "does not"} for c in claims)
