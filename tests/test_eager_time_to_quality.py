"""``jaxcomm run eager-time-to-quality``: the summary and verdict rules against closed forms, the
configuration's checks, and the smoke run over MPI on an emulated link (skipped where no private
network namespace can be made).

No assertion depends on timing: the smoke run's checks are what the runs must get right on any
load (records per mode and seed, the target's definition, the link's count against the messages
the protocol must send, the summary's arithmetic over the records).
"""

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from experiments.eager import quality
from jaxcomm.studies import get_experiment

pytestmark = pytest.mark.strict_promotion

EXP = get_experiment("eager-time-to-quality")


def _messages_by_enumeration(p: int) -> int:
    """Messages of one recursive-doubling round, counted rank by rank as the progress thread sends
    them: a rank above the largest power of two ``p2`` sends its data down once; a rank below
    ``p - p2`` sends the result back up once; every rank below ``p2`` sends once per stage."""
    p2 = 1
    while p2 * 2 <= p:
        p2 *= 2
    sends = 0
    for me in range(p):
        if me >= p2:
            sends += 1
            continue
        sends += sum(1 for bit in (1 << s for s in range(p2.bit_length() - 1)) if bit < p2)
        sends += 1 if me < p - p2 else 0
    return sends


@given(st.integers(1, 40), st.integers(1, 9000))
def test_allreduce_message_bytes_counts_every_message_of_the_round(p, features):
    message = 8 + 4 * (features + 1) + p  # round (int64), data (float32), contributor mask
    assert quality.allreduce_message_bytes(p, features) == _messages_by_enumeration(p) * message


@pytest.mark.parametrize(
    ("values", "above_one", "paper", "expected"),
    [
        ([1.4, 1.5, 1.6], True, 1.5, "holds"),
        ([1.4, 1.5, 1.6], True, None, "holds"),
        ([1.9, 2.0, 2.1], True, 1.5, "partly"),  # every seed faster, 33 % above the paper's number
        ([0.9, 1.5, 1.6], True, None, "partly"),  # the mean faster, one seed not
        ([1.3, None, 1.4], True, None, "partly"),  # one seed never reached the target
        ([0.8, 0.9, 1.05], True, None, "does not"),
        ([None, None], True, None, "does not"),
        ([0.8, 0.85, 0.9], False, 0.835, "holds"),
        ([1.1, 1.2], False, None, "does not"),
    ],
)
def test_verdict_rule(values, above_one, paper, expected):
    assert quality.verdict(values, above_one, paper) == expected


def test_mean_std_is_numpys_with_ddof_1():
    xs = [3.0, 5.0, 10.0]
    assert quality.mean_std([*xs, None]) == pytest.approx((np.mean(xs), np.std(xs, ddof=1)))
    assert quality.mean_std([2.0]) == (2.0, None) and quality.mean_std([None]) == (None, None)


def _record(mode, seed, t, thr, loss, sync_t, sync_thr):
    return {
        "mode": mode,
        "seed": seed,
        "time_to_target_s": t,
        "steps_to_target": None if t is None else 10,
        "speedup_time_to_target": None if t is None else sync_t / t,
        "throughput_steps_s": thr,
        "speedup_throughput": thr / sync_thr,
        "final_val_mse": loss,
        "nap_mean": {"sync": 4.0, "solo": 1.2, "majority": 2.5}[mode],
        "link_bytes_per_step": 1000.0,
    }


def test_summary_and_verdicts_of_known_records():
    """Three seeds with chosen times, throughputs and losses: the summary's means and sample
    deviations are NumPy's, and each claim's per-seed values and verdict follow from them."""
    sync_t, sync_thr = [10.0, 12.0, 11.0], [2.5, 2.4, 2.6]
    solo_t, solo_thr, solo_loss = [5.0, 6.0, None], [5.0, 4.9, 5.1], [5.0, 5.2, 7.0]
    maj_t, maj_thr = [7.0, 8.0, 7.5], [4.0, 4.1, 3.9]
    records = []
    for s in range(3):
        records.append(_record("sync", s, sync_t[s], sync_thr[s], 5.0, sync_t[s], sync_thr[s]))
        records.append(_record("solo", s, solo_t[s], solo_thr[s], solo_loss[s], sync_t[s], sync_thr[s]))
        records.append(_record("majority", s, maj_t[s], maj_thr[s], 5.1, sync_t[s], sync_thr[s]))
    rows = {r["mode"]: r for r in quality.summarize(records)}
    assert [rows[m]["reached"] for m in ("sync", "solo", "majority")] == [3, 2, 3]
    assert rows["solo"]["time_to_target_s"] == pytest.approx(5.5)
    assert rows["solo"]["time_to_target_s_std"] == pytest.approx(np.std([5.0, 6.0], ddof=1))
    speed = np.array(sync_thr)
    assert rows["majority"]["speedup_throughput"] == pytest.approx(np.mean(np.array(maj_thr) / speed))
    assert rows["majority"]["speedup_throughput_std"] == pytest.approx(np.std(np.array(maj_thr) / speed, ddof=1))
    config = EXP.config()  # at 200 ms: the paper's numbers apply
    round_ms = {"sync": [395.0] * 3, "solo": [240.0, 230.0, 238.0], "majority": [300.0, 302.0, 304.0]}
    claims = {c["claim"].split(" (")[0]: c for c in quality.verdicts(records, config, round_ms)}
    thr = claims["solo: higher throughput than synch-SGD"]
    assert thr["values"] == pytest.approx(list(np.array(solo_thr) / speed)) and thr["seeds"] == 3
    assert thr["ideal"] == pytest.approx(np.mean(395.0 / np.array(round_ms["solo"])))
    assert thr["verdict"] == "partly"  # ~2.0 against 1.50
    # Seed 2's solo run never reached the target, and its final loss is 40 % above synch-SGD's.
    ttq = claims["solo: synch-SGD's loss in less wall-clock time"]
    assert ttq["values"] == pytest.approx([2.0, 2.0, None]) and ttq["verdict"] == "partly"
    assert ttq["final_loss_ratio"] == pytest.approx([1.0, 1.04, 1.4])
    maj = claims["majority: higher throughput than synch-SGD"]
    assert maj["ideal"] == pytest.approx(np.mean(395.0 / np.array(round_ms["majority"])))
    assert maj["verdict"] == "partly"  # ~1.6 against 1.25
    assert claims["majority: synch-SGD's loss in less wall-clock time"]["verdict"] == "holds"
    ratio = claims["majority: lower throughput than solo"]
    assert ratio["values"] == pytest.approx(list(np.array(maj_thr) / np.array(solo_thr)))
    assert ratio["ideal"] == pytest.approx(np.mean(np.array(round_ms["solo"]) / np.array(round_ms["majority"])))
    assert ratio["verdict"] == "holds"  # 0.80 against 0.835
    # Another delay: the paper's numbers are at 200 ms, so only the sides of 1 decide.
    other = {c["claim"]: c["verdict"] for c in quality.verdicts(records, dataclasses.replace(config, delay_ms=300.0))}
    assert other["solo: higher throughput than synch-SGD (steps/s)"] == "holds"
    assert all(c["ideal"] is None for c in quality.verdicts(records, config))  # no simulated rounds given


def test_simulated_rounds_of_synch_sgd_wait_for_the_delayed_process():
    """With one process delayed every step, every synchronous round of the free collective ends
    when that process arrives: base + delay (5 + 30 ms in the smoke configuration)."""
    cfg = EXP.config(smoke=True, overrides={"modes": ["sync"], "seeds": [3]})
    assert quality.simulated_round_ms(cfg) == {"sync": [pytest.approx(35.0)]}


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("modes", ["solo", "majority"], r"TimeToQualityConfig\.modes: .*'sync' included"),
        ("modes", ["sync", "sync"], r"TimeToQualityConfig\.modes: distinct"),
        ("seeds", [1, 1], r"TimeToQualityConfig\.seeds: give distinct"),
        ("seeds", [2**32], r"TimeToQualityConfig\.seeds\[0\] must be in"),
        ("num_procs", 3, r"TimeToQualityConfig\.num_procs: at least 2, dividing"),
        ("snapshots_per_epoch", 3, r"TimeToQualityConfig\.snapshots_per_epoch: must divide the 8 steps"),
        ("snapshots_per_epoch", 0, r"TimeToQualityConfig\.snapshots_per_epoch must be >= 1"),
        ("delay_ms", -1.0, r"TimeToQualityConfig\.delay_ms must be >= 0"),
        ("bandwidth", "fast", r"TimeToQualityConfig\.bandwidth: "),
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
    assert (tmp_path / "loss_vs_time.png").stat().st_size > 0
    assert len(res["load_average_start"]) == len(res["load_average_end"]) == 3
    p, seeds, modes = cfg.num_procs, cfg.seeds, cfg.modes
    steps_per_epoch = cfg.train_points // cfg.batch_total
    steps = steps_per_epoch * cfg.epochs
    every = steps_per_epoch // cfg.snapshots_per_epoch
    records = res["records"]
    assert sorted((r["seed"], r["mode"]) for r in records) == sorted((s, m) for s in seeds for m in modes)
    message_bytes = quality.allreduce_message_bytes(p, cfg.features)
    for r in records:
        key = (r["mode"], r["seed"])
        assert r["models_identical"] and r["steps"] == steps, key  # every process applied every round
        assert r["snapshot_steps"] == list(range(every, steps + 1, every)), key
        assert len(r["val_mse"]) == len(r["snapshot_times_s"]) == steps // every, key
        sync = next(q for q in records if q["mode"] == "sync" and q["seed"] == r["seed"])
        assert r["target_val_mse"] == pytest.approx(sync["val_mse"][-1] * (1 + cfg.equal_loss_rtol))
        hits = [i for i, v in enumerate(r["val_mse"]) if v <= r["target_val_mse"]]
        if hits:
            assert r["time_to_target_s"] == r["snapshot_times_s"][hits[0]], key
            assert r["steps_to_target"] == r["snapshot_steps"][hits[0]], key
        else:
            assert r["time_to_target_s"] is None and r["steps_to_target"] is None, key
        assert 1 <= r["nap_mean"] <= p, key
        # The kernel's count holds at least every message of every round (a packet each at least).
        assert r["link_bytes"] >= steps * message_bytes and r["link_packets"] >= steps * 8, key
        assert r["link_bytes_per_step"] == r["link_bytes"] / steps, key
    for s in seeds:
        mine = [r for r in records if r["seed"] == s]
        assert mine[0]["job_bytes"] >= sum(r["link_bytes"] for r in mine)  # the job holds every window
        sync = next(r for r in mine if r["mode"] == "sync")
        assert sync["nap_mean"] == p and sync["fresh_fraction"] == 1.0
        assert sync["time_to_target_s"] is not None and sync["speedup_time_to_target"] == 1.0
        assert next(r for r in mine if r["mode"] == "solo")["nap_mean"] < p  # a delayed process is left out
    rows = {row["mode"]: row for row in res["summary"]}
    for mode in modes:
        mine = [r for r in records if r["mode"] == mode]
        assert rows[mode]["seeds"] == len(seeds)
        assert rows[mode]["final_val_mse"] == pytest.approx(np.mean([r["final_val_mse"] for r in mine]))
        assert rows[mode]["nap_mean_std"] == pytest.approx(np.std([r["nap_mean"] for r in mine], ddof=1))
    assert {c["verdict"] for c in res["verdicts"]} <= {"holds", "partly", "does not"}
    assert all(c["seeds"] == len(seeds) for c in res["verdicts"]) and len(res["verdicts"]) == 5
