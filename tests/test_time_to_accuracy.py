"""``jaxcomm run time-to-accuracy``: its configuration checks, its records and summary on hand-made
jobs (closed forms), and a smoke run on an emulated network (2 processes: trained on the unshaped
link, timed on a 200 Mbit/s one) whose measurements are checked against each other: the bytes
the kernel counted against the cost model's formula for the pipeline's own count, the curve's
bookkeeping, the link's rate against the measured time, and the records' keys and types."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from jaxcomm import cost_model, netem
from jaxcomm.studies import get_experiment

pytestmark = pytest.mark.strict_promotion

EXP = get_experiment("time-to-accuracy")


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("procs", 1, "procs"),
        ("bandwidths", ["fast"], "bandwidths"),
        ("bandwidths", [], "bandwidths"),
        ("methods", ["topk"], "methods"),
        ("target_accuracy", 1.5, "target_accuracy"),
        ("max_steps", 0, "max_steps"),
        ("eval_examples", 1, "eval_examples"),
        ("seeds", [], "seeds"),
        ("route", "fast", "route"),
        ("learning_rates", {"nosuch": 0.1}, "learning_rates"),
        ("learning_rates", {"none": -0.1}, "learning_rates"),
        ("lr_sweep", [0.0], "lr_sweep"),
        ("timing_steps", 0, "timing_steps"),
        ("method_timing_steps", {"none": 0}, "method_timing_steps"),
        ("method_timing_steps", {"nosuch": 10}, "method_timing_steps"),
        ("dgc_steps_per_stage", 0, "dgc_steps_per_stage"),
        ("burst", "fast", r"TimeToAccuracyConfig\.burst: cannot read 'fast'"),
        ("burst", "1kb", r"TimeToAccuracyConfig\.burst: .*9014"),  # smaller than one 9,000-byte packet
        ("mtu", 10, r"TimeToAccuracyConfig\.mtu"),
    ],
)
def test_bad_config_names_the_field_before_anything_runs(key, value, match):
    """A bad value is refused where the configuration is made (from ``--set`` or JSON), so no run can start."""
    from jaxcomm.studies import config_from_dict, config_to_dict

    with pytest.raises(ValueError, match=match):
        config_from_dict(EXP.config_type, {**config_to_dict(EXP.config(smoke=True)), key: value})


def _run(method, reached_step, compute_s, seed=0, reached_s=None, strategy="allreduce", bits=32e6, sync_every=1):
    """A hand-made run of a training job: evaluations every 10 steps, 1,000 kernel bytes per step."""
    last = reached_step or 300
    return {
        "method": method,
        "seed": seed,
        "strategy": strategy,
        "sync_every": sync_every,
        "compute_s": compute_s,
        "step_s": 0.2,
        "wire_bits_per_step": bits,
        "messages_per_step": 4,
        "link_bytes_per_step": 1000.0,
        "steps": last,
        "reached": None if reached_step is None else {"step": reached_step, "time_s": reached_s},
        "curve": [
            {"step": k, "time_s": 0.2 * k, "accuracy": 0.1, "link_bytes": 1000 * k} for k in range(10, last + 1, 10)
        ],
    }


def _timing(method, step_s, warmup_step_times=(), sync_every=1, bits=32e6, messages=4, strategy="allreduce"):
    return {
        "method": method,
        "seed": 0,
        "strategy": strategy,
        "sync_every": sync_every,
        "warmup_steps": len(warmup_step_times),
        "warmup_step_times": list(warmup_step_times),
        "step_times": [step_s] * 20,
        "step_s": step_s,
        "compute_s": 0.05,
        "wire_bits_per_step": bits,
        "messages_per_step": messages,
        "link_bytes_per_step": 1000.0,
    }


LINK = {"latency_s": 1e-4, "throughput_bps": 5e9}
TRAINING = {
    "bandwidth": "unlimited",
    "procs": 4,
    "mode": "train",
    "link": LINK,
    "runs": [
        _run("none", 100, 0.05, seed=0, reached_s=12.0),
        _run("none", 120, 0.05, seed=1, reached_s=13.0),
        _run("fp16", 80, 0.06, seed=0, reached_s=9.0),
        _run("fp16", 80, 0.06, seed=1, reached_s=9.0),
        _run("bf16", 90, 0.06, seed=0, reached_s=10.0),
        _run("bf16", 90, 0.06, seed=1, reached_s=11.0),
        _run("topk-1%+EF", 200, 0.08, seed=0, reached_s=30.0, strategy="allgather"),
        _run("topk-1%+EF", None, 0.08, seed=1, strategy="allgather"),
    ],
}
TIMING = {
    "bandwidth": "10mbit",
    "procs": 4,
    "mode": "time",
    "link": LINK,
    "timings": [
        _timing("none", 1.0),
        _timing("fp16", 0.5),
        _timing("bf16", 0.4),
        _timing("topk-1%+EF", 0.1, warmup_step_times=[0.3] * 10, strategy="allgather"),
    ],
}


def test_decomposed_records_and_summary_against_closed_forms():
    from experiments.network.run import RECORD_KEYS, decomposed_time, records_decomposed, summarize

    assert decomposed_time(200, TIMING["timings"][3]) == pytest.approx(10 * 0.3 + 190 * 0.1)
    assert decomposed_time(5, TIMING["timings"][3]) == pytest.approx(5 * 0.3)
    records = records_decomposed(TRAINING, TIMING)
    assert len(records) == len(TRAINING["runs"]) and all(tuple(r) == RECORD_KEYS for r in records)
    rec = {(r["method"], r["seed"]): r for r in records}
    none0 = rec[("none", 0)]
    assert none0["route"] == "decomposed" and none0["link"] == "10mbit" and none0["reached"] is True
    assert none0["steps_to_target"] == 100 and none0["time_to_target_s"] == pytest.approx(100.0)
    assert none0["bytes_to_target"] == 100_000 and none0["compute_only_s"] == pytest.approx(5.0)
    assert none0["utilization"] == pytest.approx(0.05)
    missed = rec[("topk-1%+EF", 1)]
    assert missed["reached"] is False
    assert all(missed[k] is None for k in RECORD_KEYS[5:])
    rows = {r["method"]: r for r in summarize(records, [TRAINING, TIMING])}
    none, fp16, bf16, topk = rows["none"], rows["fp16"], rows["bf16"], rows["topk-1%+EF"]
    assert none["time_to_target_s"] == pytest.approx(110.0) and none["time_std_s"] == pytest.approx(
        np.std([100, 120], ddof=1)
    )
    # 16-bit: the faster of fp16 (80 x 0.5 = 40 s) and bf16 (90 x 0.4 = 36 s)
    assert fp16["time_to_target_s"] == pytest.approx(40.0) and bf16["time_to_target_s"] == pytest.approx(36.0)
    assert none["speedup_vs_16bit"] == pytest.approx(36.0 / 110.0) and bf16["speedup_vs_16bit"] == pytest.approx(1.0)
    assert fp16["speedup_vs_fp32"] == pytest.approx(110.0 / 40.0) and none["speedup_vs_fp32"] == pytest.approx(1.0)
    keys = list(none)
    assert keys.index("speedup_vs_16bit") < keys.index("speedup_vs_fp32")
    # the compute-bound limit: dense's mean steps to target x its compute-only step, for every row
    for row in rows.values():
        assert row["compute_bound_limit_s"] == pytest.approx(110 * 0.05)
    assert fp16["limit_fraction"] == pytest.approx(5.5 / 40.0)
    # utilization counts the compute-only step the timing job measured beside its window (0.05) ...
    assert fp16["utilization"] == pytest.approx(80 * 0.05 / 40.0)
    # ... and the training run's (0.06) where the timing entry has none
    bare = {**TIMING, "timings": [{k: v for k, v in t.items() if k != "compute_s"} for t in TIMING["timings"]]}
    fp16_bare = next(r for r in records_decomposed(TRAINING, bare) if r["method"] == "fp16")
    assert fp16_bare["utilization"] == pytest.approx(80 * 0.06 / 40.0)
    assert fp16["MB_to_target"] == pytest.approx(0.08) and fp16["steps_to_target"] == pytest.approx(80)
    assert topk["reached"] == "1/2" and math.isnan(topk["time_to_target_s"]) and math.isnan(topk["speedup_vs_fp32"])
    # communication predicted for the link's rate and the measured latency
    want = 8 * 2 * 3 * 4e6 / 1e7 + 2 * 3 * 1 * 1e-4
    assert none["comm_predicted_s"] == pytest.approx(want) and none["step_predicted_s"] == pytest.approx(0.05 + want)
    assert none["comm_s"] == pytest.approx(1.0 - 0.05)


def test_periodic_methods_predicted_per_period():
    """A method that communicates every H steps: the prediction is one period's, over H steps."""
    from experiments.network.run import summarize

    timing = {**TIMING, "timings": [_timing("diloco-H20", 0.1, sync_every=20, bits=32e6 / 20, messages=4 / 20)]}
    training = {**TRAINING, "runs": [_run("diloco-H20", 100, 0.05)]}
    from experiments.network.run import records_decomposed

    (row,) = summarize(records_decomposed(training, timing), [timing])
    want = (8 * 2 * 3 * 4e6 / 1e7 + 2 * 3 * 1 * 1e-4) / 20
    assert row["comm_predicted_s"] == pytest.approx(want) and row["sync_every"] == 20
    assert row["predicted_MB_per_step"] == pytest.approx(2 * 3 * 4e6 / 20 / 1e6)
    assert math.isnan(row["speedup_vs_fp32"]) and math.isnan(row["speedup_vs_16bit"])


def test_predicted_time_to_target_closed_form():
    """A link not timed: steps x (compute + one period's ring all-reduce over H steps)."""
    from experiments.network.run import records_predicted

    training = {**TRAINING, "runs": [_run("diloco-H20", 100, 0.05, bits=32e6 / 20, sync_every=20), _run("x", None, 1)]}
    training["runs"][0]["messages_per_step"] = 4 / 20
    (rec,) = records_predicted(training, 1e9, 1e-4)  # the run that did not reach the target has none
    comm = (8 * 2 * 3 * 4e6 / 1e9 + 2 * 3 * 1 * 1e-4) / 20  # 4 MB per worker every 20 steps, 4 workers
    assert rec["comm_predicted_s"] == pytest.approx(comm)
    assert rec["time_predicted_s"] == pytest.approx(100 * (0.05 + comm)) and rec["steps_to_target"] == 100


def test_end_to_end_records_and_agreement():
    from experiments.network.run import agreement, records_decomposed, records_end_to_end, summarize

    e2e = {**TRAINING, "bandwidth": "10mbit"}
    records = records_end_to_end(e2e)
    rec = {(r["method"], r["seed"]): r for r in records}
    assert rec[("none", 1)]["route"] == "end_to_end" and rec[("none", 1)]["time_to_target_s"] == pytest.approx(13.0)
    assert rec[("none", 1)]["utilization"] == pytest.approx(120 * 0.05 / 13.0)
    rows = {r["method"]: r for r in summarize(records, [e2e])}
    assert rows["none"]["speedup_vs_16bit"] == pytest.approx(9.0 / 12.5)
    both = records + records_decomposed(TRAINING, TIMING)
    agree = {a["method"]: a for a in agreement(both)}
    assert agree["none"]["agreement"] == pytest.approx(110.0 / 12.5)
    assert agree["topk-1%+EF"]["seeds"] == 1 and agree["topk-1%+EF"]["agreement"] == pytest.approx(22.0 / 30.0)


def test_sweep_records():
    from experiments.network.run import sweep_records

    sweep = [
        {**_run("none", 100, 0.05, reached_s=1.0), "learning_rate": 0.05},
        {**_run("none", None, 0.05), "learning_rate": 0.5},
    ]
    got = sweep_records({"sweep": sweep})
    assert [(g["learning_rate"], g["reached"], g["steps_to_target"]) for g in got] == [
        (0.05, True, 100),
        (0.5, False, None),
    ]
    assert got[0]["final_accuracy"] == pytest.approx(0.1) and sweep_records({}) == []


def test_the_sweep_chooses_the_rate_with_the_fewest_steps():
    from experiments.network.worker import choose_learning_rates

    def run(method, lr, step, last_accuracy=0.1):
        r = {**_run(method, step, 0.01), "learning_rate": lr}
        r["curve"][-1]["accuracy"] = last_accuracy
        return r

    sweep = [
        run("none", 0.01, 300),
        run("none", 0.05, 120),
        run("none", 0.1, 120),  # a tie in steps: the smaller rate
        run("bf16", 0.01, None, 0.6),  # none reached: the highest last accuracy
        run("bf16", 0.05, None, 0.7),
        run("fp16", 0.01, 200),
        run("fp16", 0.05, 100),
    ]
    assert choose_learning_rates(sweep) == {"none": 0.05, "bf16": 0.05, "fp16": 0.05}


@pytest.mark.mpi
def test_smoke_run_on_an_emulated_link(namespaces, tmp_path):
    from experiments.network.run import RECORD_KEYS
    from jaxcomm.netem._link import link_settings

    cfg = EXP.config(smoke=True)
    assert cfg.route == "decomposed" and not cfg.gather_metrics
    res = EXP.run(cfg, tmp_path)
    n, target, every = cfg.procs, cfg.target_accuracy, cfg.eval_every
    job = res["training"]
    assert job["bandwidth"] == "unlimited" and job["procs"] == n and job["mode"] == "train"
    assert job["launch"]["drops"] == 0
    assert [r["method"] for r in job["runs"]] == list(cfg.methods)
    for r in job["runs"]:
        curve = r["curve"]
        steps = [p["step"] for p in curve]
        assert steps == list(range(every, r["steps"] + 1, every)) and r["steps"] <= cfg.max_steps
        assert np.all(np.diff([0.0] + [p["time_s"] for p in curve]) > 0)
        assert np.all(np.diff([0] + [p["link_bytes"] for p in curve]) > 0)
        hits = [p for p in curve if p["accuracy"] >= target]
        if r["reached"] is None:
            assert not hits and r["steps"] == cfg.max_steps
        else:
            assert hits[0]["step"] == r["reached"]["step"] == r["steps"]
            assert r["reached"]["time_s"] == curve[-1]["time_s"]
        # The kernel's byte count against the cost model's formula for the pipeline's count:
        # headers and Open MPI's protocol add at most 1 KiB per message on the wire, and each
        # evaluation window holds two barriers (at most 4 KiB). Below, nothing is missing: the
        # window's counter read is fenced by barriers on both sides (docs/network.md, "What the
        # counters mean"), so no rank's first message of a window passes uncounted.
        predicted = float(cost_model.step_bytes(r["strategy"], r["wire_bits_per_step"] / 8, n))
        per_worker = r["messages_per_step"] / n  # the trainer's metric counts all workers
        wire_messages = (2 if r["strategy"] in ("allreduce", "rounds") else 1) * n * (n - 1) * per_worker
        measured = r["link_bytes_per_step"]
        # With gather_metrics, each step also runs the trainer's two metric collectives (a packed
        # all-gather of the wire-bit counts, an all-reduce of the metrics): 3 n (n - 1) small messages
        # more; without, one all-reduce of the counts per evaluation window (within its 4 KiB).
        metric_messages = 3 * n * (n - 1) if cfg.gather_metrics else 0
        upper = predicted + 1024 * (wire_messages + metric_messages) + 4096 / every
        assert predicted <= measured <= upper, (r["method"], measured, predicted)
        assert r["compute_s"] > 0 and r["step_s"] > 0 and r["sync_every"] == 1
    # The sweep: every method at each rate for the first seed; the run at the chosen rate is reused.
    assert [(s["method"], s["learning_rate"]) for s in res["sweep"]] == [
        (m, lr) for lr in cfg.lr_sweep for m in cfg.methods
    ]
    for r in job["runs"]:
        assert r["learning_rate"] == res["learning_rates"][r["method"]] in cfg.lr_sweep
        assert r in job["sweep"]
    # One job timed both links after training (its link reshaped between them), with the chosen rates.
    links = [netem.parse_rate(bw) for bw in cfg.bandwidths]
    assert [tj["bandwidth"] for tj in res["timing_jobs"]] == list(cfg.bandwidths)
    for tj, rate in zip(res["timing_jobs"], links):
        assert tj["mode"] == "time" and tj["launch"]["drops"] == 0
        assert [(t["method"], t["learning_rate"]) for t in tj["timings"]] == list(res["learning_rates"].items())
        # the link was given this rate before its steps were timed (the unshaped link counts with pfifo)
        assert tj["shape"]["bandwidth_bps"] == rate and {t["qdisc"] for t in tj["timings"]} == {"tbf"}
        # with the configured bucket (1 ms of the rate, at least one packet) at the MTU the launcher set
        burst = link_settings(tj["bandwidth"], "0", cfg.burst, cfg.mtu).burst_bytes
        assert tj["shape"]["mtu"] == cfg.mtu and tj["shape"]["burst_bytes"] == burst == max(cfg.mtu + 14, rate / 8e3)
        for t in tj["timings"]:
            # timing_steps, or more where the token bucket would carry over a tenth of the window's bytes
            assert len(t["step_times"]) >= cfg.timing_steps and t["warmup_steps"] == 0
            assert len(t["step_times"]) == cfg.timing_steps or t["bucket_share"] <= 0.1 * 1.5
            # A token bucket passes at most burst + rate · t / 8 bytes in t seconds (the window's wall clock,
            # which also holds the closing barrier and the ranks' lag behind rank 0's step clock).
            assert sum(t["step_times"]) <= t["window_s"]
            assert t["link_bytes_per_step"] * len(t["step_times"]) <= burst + rate * t["window_s"] / 8
    # The records: one per link, method and seed, with these keys and types.
    records = res["records"]
    assert [(r["link"], r["method"], r["seed"]) for r in records] == [
        (bw, m, 0) for bw in cfg.bandwidths for m in cfg.methods
    ]
    for rec in records:
        assert tuple(rec) == RECORD_KEYS and rec["route"] == "decomposed" and isinstance(rec["reached"], bool)
        if rec["reached"]:
            assert isinstance(rec["steps_to_target"], int) and isinstance(rec["bytes_to_target"], int)
            for key in ("time_to_target_s", "compute_only_s", "utilization"):
                assert isinstance(rec[key], float) and rec[key] > 0
        else:
            assert all(rec[k] is None for k in RECORD_KEYS[5:])
    prov = res["provenance"]
    assert set(prov) == {"jax", "jaxlib", "jaxcomm", "git_commit", "hostname", "cpu_count", "date_utc"}
    assert prov["cpu_count"] >= 1 and prov["jax"]
    rows = [(row["link"], row["method"]) for row in res["summary"]]
    assert rows == [(bw, m) for bw in cfg.bandwidths for m in cfg.methods]
    head = EXP.summary(res)
    assert [(h["link"], h["method"]) for h in head] == rows
    assert list(head[0]) == [
        "link", "route", "method", "reached", "time to target (s)", "×16-bit", "×fp32", "MB to target", "utilization"
    ]  # fmt: skip
    job_file = json.loads((tmp_path / "train" / "results.json").read_text())
    assert job_file["complete"] and len(job_file["runs"]) == len(cfg.methods)
    for name in ("accuracy_vs_time.png", "accuracy_vs_bytes.png", "step_time_model.png"):
        assert (tmp_path / name).stat().st_size > 10_000


def test_the_default_learning_rates_are_the_committed_sweeps_choices():
    """``SWEPT_LEARNING_RATES`` is what :func:`choose_learning_rates` picks from the sweeps committed
    with the main job's results, method by method, and every default method has its swept rate."""
    from pathlib import Path

    from experiments.network.config import SWEPT_LEARNING_RATES, TimeToAccuracyConfig
    from experiments.network.worker import choose_learning_rates

    results = Path(__file__).resolve().parents[1] / "experiments/benchmarks/results"
    chosen: dict[str, float] = {}
    for name in ("time_to_accuracy_main_lr_sweep.json", "time_to_accuracy_main_sparseloco_dgc_variants.json"):
        picked = choose_learning_rates(json.loads((results / name).read_text())["training"]["sweep"])
        chosen.update({m: lr for m, lr in picked.items() if m in SWEPT_LEARNING_RATES})
    assert chosen == SWEPT_LEARNING_RATES
    assert set(TimeToAccuracyConfig.default().methods) <= set(SWEPT_LEARNING_RATES)


def test_the_network_page_quotes_the_cost_model_of_its_results():
    """Every "comm predicted" of the end-to-end table in docs/network.md is the cost model's
    prediction (per worker's messages) recomputed from the committed results it was measured
    in, and so are the JSON summary's."""
    import re
    from pathlib import Path

    from experiments.network._records import _predicted_comm_s, _rate_bps

    root = Path(__file__).resolve().parents[1]
    results = json.loads((root / "experiments/benchmarks/results/time_to_accuracy.json").read_text())
    predicted = {}
    for job in results["jobs"]:
        rate = _rate_bps(job["bandwidth"], job["link"])
        for r in job["runs"]:
            predicted[job["bandwidth"], r["method"]] = _predicted_comm_s(
                r, job["procs"], rate, job["link"]["latency_s"]
            )
    rows = re.findall(
        r"^\| (100mbit|1gbit|unlimited) \| `([^`]+)` \|(.*)\|$", (root / "docs/network.md").read_text(), re.M
    )
    assert len(rows) == len(predicted) == 18
    for link, method, rest in rows:
        assert float(rest.split("|")[7]) == pytest.approx(predicted[link, method], abs=5e-4), (link, method)
    for row in results["summary"]:
        assert row["comm_predicted_s"] == pytest.approx(predicted[row["bandwidth"], row["method"]])


def test_a_study_on_the_unshaped_link_alone_plots_its_training_job():
    from experiments.network.run import _panels

    panels = _panels(TRAINING, [], [], ["unlimited"])
    assert [title for title, _ in panels] == ["link unlimited (measured end to end)"]
    assert len(panels[0][1]) == len(TRAINING["runs"])
    assert _panels(TRAINING, [], [], ["10mbit"]) == []  # a shaped link alone: its timing job's panel only


def test_the_compute_only_step_is_timed_after_the_methods_warm_up():
    """timed_steps_alone runs two steps and ``skip`` more (DGC's warm-up stages) untimed, then times
    exactly the next ``steps``: the median (or ``reduce``) over whole periods of those steps' own times only."""
    from experiments.network import worker

    class Step:
        def lower(self, state, batch):
            return self

        def compile(self):
            return self

    class Batches:
        position = 0

        def batch_at(self, position):
            return None

    class Trainer:
        step_fn = Step()

        def init_state(self):
            return 0

        def worker_batch(self, batch):
            return batch

        def fit(self, state, batches, until, progress):
            # step t takes t² seconds, so the result names the steps timed, and median ≠ mean
            return until, [{"step_time": float(t * t)} for t in range(state, until)]

    periods = [np.mean([12**2, 13**2]), np.mean([14**2, 15**2]), np.mean([16**2, 17**2])]
    assert worker.timed_steps_alone(Trainer(), Batches(), steps=6, sync_every=2, skip=10) == np.median(periods)
    got = worker.timed_steps_alone(Trainer(), Batches(), steps=6, sync_every=2, skip=10, reduce=np.mean)
    assert got == pytest.approx(np.mean(periods)) and got != np.median(periods)
    assert worker.timed_steps_alone(Trainer(), Batches(), steps=2, sync_every=1) == 6.5  # steps 2 and 3


def test_the_compute_only_step_is_timed_as_the_window_it_divides(monkeypatch):
    """_compute_s times the step over at least the window's steps (``_window_least``) with the
    training's ``gather_metrics``, and keeps the slowest rank's figure."""
    from experiments.network import worker
    from jaxcomm.studies import config_to_dict

    seen = []

    def fake(**kwargs):
        seen.append(kwargs)
        return 0.5

    class World:
        def Barrier(self):
            pass

        def allgather(self, x):
            return [x, 2 * x]

    monkeypatch.setattr(worker, "compute_step_time", fake)
    cfg = {**config_to_dict(EXP.config(smoke=True)), "timing_least": {"none": 640}}
    assert worker._window_least(cfg, "none") == 640 and worker._window_least(cfg, "bf16") == cfg["timing_steps"]
    own = {**cfg, "method_timing_steps": {"none": 800, "bf16": 30}}
    assert worker._window_least(own, "none") == 800 and worker._window_least(own, "bf16") == 30
    got = worker._compute_s("none", 0, 0.1, cfg, None, World(), {}, worker._window_least(cfg, "none"))
    assert got == 1.0 and seen[-1]["steps"] == 640 and seen[-1]["gather_metrics"] is False
    worker._compute_s("bf16", 0, 0.1, {**cfg, "gather_metrics": True}, None, World(), {})
    assert seen[-1]["steps"] == cfg["compute_steps"] and seen[-1]["gather_metrics"] is True


def test_a_timed_window_is_long_enough_for_the_token_bucket():
    """bucket_steps: the steps whose bytes reach burst / share at the smallest per-step rate of the
    runs after the warm-up (closed form); the cap where nothing was sent."""
    from experiments.network.worker import TIMING_STEPS_MAX, bucket_steps

    def run(points):
        return {"curve": [{"step": s, "link_bytes": b} for s, b in points]}

    # after a 40-step warm-up: 4,000 and 2,000 bytes a step; the warm-up's 1 MB is not counted
    runs = [run([(20, 900_000), (40, 1_000_000), (140, 1_400_000)]), run([(40, 1_000_000), (240, 1_400_000)])]
    assert bucket_steps(runs, 40, 262_144, share=0.1) == math.ceil(262_144 / (0.1 * 2_000))
    # no warm-up: from the run's start (0 bytes), also where the target came at the first evaluation
    assert bucket_steps([run([(20, 5e6), (40, 10e6)])], 0, 262_144) == math.ceil(262_144 / 0.1 / 250_000)
    assert bucket_steps([run([(10, 2e5)])], 0, 262_144) == math.ceil(262_144 / 0.1 / 2e4)
    assert bucket_steps([run([(20, 0), (40, 0)])], 0, 262_144) == TIMING_STEPS_MAX
