"""The eager-SGD experiments' smoke configurations (jaxcomm run eager-microbench / eager-hyperplane --smoke).

Both launch ``mpirun`` themselves (4 processes). The assertions check what the
runs must get right whatever the machine's load: the per-process results agree,
the synchronous baselines see every process, the partial collectives respect
their quorum, and the models of all processes stay identical.
"""

import dataclasses
import json

import numpy as np
import pytest

from jaxcomm.studies import get_experiment

pytestmark = pytest.mark.strict_promotion

pytest.importorskip("mpi4py")


@pytest.mark.mpi
def test_microbench_smoke(tmp_path):
    exp = get_experiment("eager-microbench")
    cfg = exp.config(smoke=True)
    res = exp.run(cfg, tmp_path)
    p, iters = cfg.num_procs, cfg.iterations
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["config"]["num_procs"] == p and (tmp_path / "microbench.png").stat().st_size > 0
    per = res["collectives"]
    for name in ("mpi_allreduce", "solo", "majority"):
        c = per[name]
        assert c["nap_identical_on_all_ranks"]  # every process saw the same contributor set
        assert len(c["nap_by_iteration"]) == iters and len(c["latency_ms_by_rank"]) == p
        assert all(np.isfinite(c["latency_ms_by_rank"])) and min(c["latency_ms_by_rank"]) >= 0
        assert all(1 <= n <= p for n in c["nap_by_iteration"])  # quorum: at least the initiator
    assert per["mpi_allreduce"]["nap_mean"] == p
    # Under linear skew the slowest rank (skew P ms) can only be fresh in a solo round if it
    # arrived before the activation; the fastest always is. Majority: NAP = initiator + 1 at most
    # P, its analytic mean (P+1)/2 is recorded.
    assert res["analytic"]["nap_majority"] == (p + 1) / 2 and res["analytic"]["nap_solo"] == 1.0
    assert res["speedup_solo"] > 0 and res["speedup_majority"] > 0
    assert [r["collective"] for r in res["summary"]] == ["mpi_allreduce", "solo", "majority"]


@pytest.mark.mpi
def test_hyperplane_smoke(tmp_path):
    exp = get_experiment("eager-hyperplane")
    cfg = exp.config(smoke=True)
    res = exp.run(cfg, tmp_path)
    assert (tmp_path / "hyperplane.png").stat().st_size > 0 and (tmp_path / "severe.png").stat().st_size > 0
    assert json.loads((tmp_path / "results.json").read_text())["config"]["epochs"] == cfg.epochs
    runs = res["hyperplane"]["runs"]
    p, delay = cfg.num_procs, cfg.delays_ms[0]
    assert set(runs) == {f"{m}-{delay:g}" for m in ("sync", "solo", "majority")}
    for key, r in runs.items():
        assert r["models_identical"], key  # every process applied every round's result
        assert len(r["val_mse"]) == cfg.epochs
        # Starting from w = 0 the validation MSE is |w*|^2 + noise^2 ~ features + 4; training lowers it.
        assert r["val_mse"][-1] < 0.5 * cfg.features, key
        assert 1 <= r["nap_mean"] <= p
    assert runs[f"sync-{delay:g}"]["nap_mean"] == p and runs[f"sync-{delay:g}"]["fresh_fraction"] == 1.0
    # Partial collectives leave some processes out some of the time under an injected delay.
    assert runs[f"solo-{delay:g}"]["nap_mean"] < p
    sv = res["severe"]["runs"]
    assert set(sv) == set(cfg.severe_modes)
    # The partial results written after every epoch hold the whole history at the end.
    partial = json.loads((tmp_path / "severe_partial.json").read_text())["history"]
    assert partial == {mode: r["history"] for mode, r in sv.items()}
    assert all(n == p for n in sv["sync"]["nap"]) and min(sv["solo"]["nap"]) == 1
    assert np.mean(sv["solo"]["nap"]) < np.mean(sv["majority"]["nap"]) < p
    for mode, r in sv.items():
        assert r["history"][-1]["test_acc"] > 0.3, mode  # digits: chance is 0.1
        # The staleness replay sees the training's rounds: its fresh gradients are the NAPs.
        st = r["staleness"]
        assert st["counts"][0] == sum(r["nap"]), mode
        assert sum(st["counts"]) + st["undelivered"] == p * len(r["nap"]), mode
        assert all(type(c) is int for c in [*st["counts"], st["undelivered"]]), mode  # counts as ints
    assert sv["sync"]["staleness"]["fresh_fraction"] == 1.0 and sv["sync"]["staleness"]["max_staleness"] == 0
    assert sv["solo"]["staleness"]["mean_staleness"] > sv["majority"]["staleness"]["mean_staleness"] > 0
    # Simulated time: solo rounds end at the first arrival, sync ones at the last.
    assert (
        sv["solo"]["history"][-1]["sim_time_s"]
        < sv["majority"]["history"][-1]["sim_time_s"]
        < sv["sync"]["history"][-1]["sim_time_s"]
    )


def test_severe_learning_rate_schedules():
    """severe_lr_schedule: the constant rate, or a cosine decay from severe_lr to 0 over all rounds;
    severe_warmup_epochs: a linear ramp from 0 first, the decay over the rounds after it."""
    from experiments.eager.config import HyperplaneConfig
    from experiments.eager.run import severe_learning_rate

    def cfg(**changes):
        return dataclasses.replace(HyperplaneConfig.default(), severe_lr=0.05, **changes)

    def at(schedule, rounds):
        return [float(schedule(r)) for r in rounds]

    assert severe_learning_rate(cfg(), 10, rounds_per_epoch=10) == 0.05  # default: constant
    cos = severe_learning_rate(cfg(severe_lr_schedule="cosine"), 10, rounds_per_epoch=10)
    assert np.allclose(at(cos, [0, 50, 100]), [0.05, 0.025, 0.0], atol=1e-7)
    # 2 warm-up epochs of 10 rounds: 0 at round 0, half at 10, the full rate at 20; then the schedule.
    warm = {"severe_warmup_epochs": 2.0}
    assert np.allclose(
        at(severe_learning_rate(cfg(**warm), 8, 10), [0, 10, 20, 50, 80]), [0, 0.025, 0.05, 0.05, 0.05], atol=1e-7
    )
    warm_cos = severe_learning_rate(cfg(**warm, severe_lr_schedule="cosine"), 8, 10)
    assert np.allclose(at(warm_cos, [0, 10, 20, 50, 80]), [0, 0.025, 0.05, 0.025, 0.0], atol=1e-7)
    with pytest.raises(ValueError, match="severe_lr_schedule"):
        severe_learning_rate(cfg(severe_lr_schedule="step"), 10, rounds_per_epoch=10)
    for bad in (-1.0, 8.0):  # -1: refused by the configuration's range; 8: no shorter than the run
        with pytest.raises(ValueError, match="severe_warmup_epochs"):
            severe_learning_rate(cfg(severe_warmup_epochs=bad), 8, 10)
