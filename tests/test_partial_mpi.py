"""The real asynchronous partial allreduce (jaxcomm.comm.PartialAllreduce) under mpirun.

Worker scripts: tests/mpi_scripts/eager_exactly_once.py and eager_failure.py. The
assertions are here, on the arrays the ranks saved.
"""

import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from mpirun import ROOT, mpirun_env, mpirun_path, run_mpi

pytest.importorskip("mpi4py")
import jaxcomm.comm._partial_mpi as pm

SCRIPTS = Path(__file__).resolve().parent / "mpi_scripts"


def load_ranks(out: Path, cfg: int, size: int) -> list:
    return [dict(np.load(out / f"cfg{cfg}_rank{r}.npz")) for r in range(size)]


def check_exactly_once(ranks: list, size: int, steps: int) -> None:
    """Lemma 6.1 on what the ranks received, with gradient (i, t) = unit vector e_{i*T+t}."""
    mode = str(ranks[0]["mode"])
    sync_every = int(ranks[0]["sync_every"])
    data, mask = ranks[0]["data"], ranks[0]["mask"]
    for r in ranks:  # safety (3): identical output everywhere, bit for bit
        np.testing.assert_array_equal(r["data"], data)
        np.testing.assert_array_equal(r["mask"], mask)
        np.testing.assert_array_equal(r["rounds"], np.arange(steps))
        assert int(r["threads"]) == 1 and int(r["pending"]) == 0  # shutdown left nothing behind
    # Exactly once: every (rank, step) code appears once over all results plus the leftovers.
    total = data.sum(0) + sum(r["leftover"] for r in ranks)
    np.testing.assert_array_equal(total, np.ones(size * steps, np.float32))
    codes = data.reshape(steps, size, steps)  # [round, rank, step]
    assert set(np.unique(codes)) <= {0.0, 1.0}
    for t in range(steps):
        fresh = codes[t, :, t].astype(bool)
        np.testing.assert_array_equal(fresh, mask[t])  # safety (2): the bits say what is in it
        assert not codes[t, :, t + 1 :].any()  # nothing from the future
        for i, r in enumerate(ranks):
            assert bool(r["included"][t]) == bool(mask[t, i])
            assert int(r["nap"][t]) == int(mask[t].sum())
        assert mask[t].sum() >= 1  # quorum (3): at least the initiator
        if mode == "majority" and not (sync_every and (t + 1) % sync_every == 0):
            assert mask[t, int(ranks[0]["initiators"][t])]  # the designated initiator is in it
        if mode == "sync" or (sync_every and (t + 1) % sync_every == 0):
            assert mask[t].all()
            # A synchronous round flushes: nothing produced up to t is left for later rounds.
            assert codes[t + 1 :, :, : t + 1].sum() == 0
    if sync_every:
        rounds, _, made = np.nonzero(codes)
        assert np.all(rounds - made <= sync_every - 1)  # staleness bound (4)


@pytest.mark.mpi
@pytest.mark.parametrize("size, steps", [(4, 16), (3, 12)])
def test_exactly_once_and_identical_under_random_delays(tmp_path, size, steps):
    run_mpi(size, SCRIPTS / "eager_exactly_once.py", str(tmp_path), str(steps), "11", timeout=240)
    names = []
    for cfg in range(4):  # solo, majority, sync, solo with a synchronous round every 4
        ranks = load_ranks(tmp_path, cfg, size)
        check_exactly_once(ranks, size, steps)
        names.append(str(ranks[0]["mode"]))
    assert names == ["solo", "majority", "sync", "solo"]


def run_failure(tmp_path: Path, scenario: str, size: int = 4, timeout_s: float = 2.0) -> list:
    env = mpirun_env()
    cmd = [
        mpirun_path(),
        "-n",
        str(size),
        "--oversubscribe",
        sys.executable,
        str(SCRIPTS / "eager_failure.py"),
        str(tmp_path),
        scenario,
        str(timeout_s),
    ]
    # Backstop: the job must end by itself well before this; a hang fails the test, never the suite.
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=90, cwd=ROOT)
    assert proc.returncode != 0  # the survivors exit with status 3 and mpirun ends the job
    found = {int(p.stem[len("rank") :]): json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")}
    return [found.get(r) for r in range(size)]


@pytest.mark.mpi
@pytest.mark.parametrize("scenario", ["hang", "initiator", "absent"])
def test_missing_process_raises_timeout_naming_it(tmp_path, scenario):
    reports = run_failure(tmp_path, scenario)
    culprit = next(rep["culprit"] for rep in reports if rep is not None)
    # Every survivor reported. The culprit's own file is left out: when the survivors exit, mpirun
    # may wake the stopped process (SIGCONT before its SIGTERM) and it can write before it is killed.
    reports = [rep for r, rep in enumerate(reports) if r != culprit]
    assert len(reports) == 3 and all(rep is not None for rep in reports), reports
    for rep in reports:
        assert rep["error"] == "PartialCollectiveTimeout" and rep["is_timeout"]
        assert rep["missing"] == [culprit], rep["message"]
        assert f"missing ranks [{culprit}]" in rep["message"]
        if scenario == "absent":
            assert rep["round"] == -1  # the construction handshake
        elif scenario == "initiator":
            assert rep["round"] == 3  # round 3 can only start when its initiator arrives
        else:
            # Solo: the culprit's progress thread keeps serving rounds while its application
            # lags, so it may have finished round 3 (or later) before SIGSTOP; the survivors
            # then stall in the first round it never served, the same round for all of them.
            assert rep["round"] >= 3
            assert rep["round"] == reports[0]["round"]
        # Fails fast: the 2 s timeout plus the liveness probe, not a hang.
        assert rep["seconds"] < 30


def test_binomial_activation_trees_reach_every_rank_once():
    # Every initiator's tree (relative ranks, any P) spans all ranks with no repeats.
    for size in range(1, 41):
        for root in range(size):
            reached, frontier = {root}, [root]
            while frontier:
                nxt = []
                for node in frontier:
                    for child in pm._children(node, root, size):
                        assert child not in reached
                        reached.add(child)
                        nxt.append(child)
                frontier = nxt
            assert reached == set(range(size))
            # Depth: ceil(log2 P) hops, the recursive-doubling broadcast of Sec. 4.1.


def test_majority_initiator_is_shared_and_uniform():
    # Deterministic in (seed, round): every process computes the same initiator.
    assert [pm.majority_initiator(5, r, 8) for r in range(50)] == [pm.majority_initiator(5, r, 8) for r in range(50)]
    # Uniform over 8 ranks: 4000 rounds, counts ~ Binomial(4000, 1/8): mean 500, sd 20.9; 5 sd.
    counts = np.bincount([pm.majority_initiator(1, r, 8) for r in range(4000)], minlength=8)
    assert np.all(np.abs(counts - 500) < 5 * 20.9)
    with pytest.raises(ValueError, match="size"):
        pm.majority_initiator(0, 0, 0)


def test_single_process_round_trip_and_clean_shutdown():
    # With one process (the pytest process, MPI singleton) every round is trivially complete.
    before = threading.active_count()
    with pm.PartialAllreduce((2, 3), np.float32, mode="solo", timeout=10.0) as pa:
        for k in range(3):
            res = pa(np.full((2, 3), k + 1.0, np.float32))
            np.testing.assert_array_equal(res.data, np.full((2, 3), k + 1.0))
            assert res.included and res.nap == 1 and res.round == k and res.contributors.tolist() == [True]
        assert not pa.leftover().any()
    assert threading.active_count() == before and pa.pending_requests() == 0
    with pytest.raises(pm.PartialCollectiveError, match="closed"):
        pa(np.zeros((2, 3), np.float32))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"mode": "eager"}, ValueError, "mode"),
        ({"dtype": np.int32}, TypeError, "dtype"),
        ({"timeout": 0.0}, ValueError, "timeout"),
        ({"sync_every": -1}, ValueError, "sync_every"),
        ({"poll_s": float("inf")}, ValueError, "poll_s"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        pm.PartialAllreduce(4, **kwargs)


def test_wrong_shape_is_rejected():
    with pm.PartialAllreduce(4, np.float32, timeout=10.0) as pa, pytest.raises(ValueError, match="shape"):
        pa(np.zeros(5, np.float32))


def run_faults(scenario: str, mode: str, size: int = 3, timeout_s: float = 2.0) -> subprocess.CompletedProcess:
    """Run eager_faults.py (documented ``with`` usage, nothing caught); the culprit is the last rank."""
    env = mpirun_env()
    cmd = [mpirun_path(), "-n", str(size), "--oversubscribe", sys.executable, str(SCRIPTS / "eager_faults.py")]
    cmd += [scenario, mode, str(timeout_s)]
    # Backstop only: a job that does not end by itself fails the test, never hangs the suite.
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)


def fault_lines(proc: subprocess.CompletedProcess) -> list:
    """The ``jaxcomm: rank r: ...; aborting the job`` lines the surviving ranks printed."""
    text = (proc.stdout + proc.stderr).replace("\0", "")
    return [line for line in text.splitlines() if line.startswith("jaxcomm: rank ")]


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["solo", "majority"])
@pytest.mark.parametrize("scenario", ["ok", "slow"])
def test_with_usage_exits_cleanly_and_slow_rank_is_not_accused(scenario, mode):
    # "slow": the last rank sleeps timeout/3 before a call; it must only slow the job.
    proc = run_faults(scenario, mode)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not fault_lines(proc)
    finals = {line.split(" done ")[1] for line in proc.stdout.splitlines() if " done " in line}
    assert len(finals) == 1  # three ranks finished with identical parameters
    assert sum(" done " in line for line in proc.stdout.splitlines()) == 3


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["solo", "majority"])
def test_hung_application_is_named_and_ends_the_job(mode):
    # The last rank's application sleeps forever; its progress thread stays alive and
    # answers probes, so it must be named as hung (and no healthy rank named).
    proc = run_faults("hang", mode, size=3, timeout_s=2.0)
    assert proc.returncode != 0
    lines = fault_lines(proc)
    assert lines, proc.stderr[-3000:]
    for line in lines:
        assert "PartialCollectiveTimeout" in line and "missing ranks [2]:" in line, line
        assert "ranks [2] are alive but their application has not called" in line and "(hung)" in line, line
        assert "did not answer a liveness probe" not in line, line


@pytest.mark.mpi
def test_call_count_mismatch_is_an_error_naming_the_odd_rank():
    proc = run_faults("fewer", "solo", size=3)
    assert proc.returncode != 0
    lines = fault_lines(proc)
    assert lines, proc.stderr[-3000:]
    for line in lines:
        assert "call-count mismatch" in line and "ranks [2]" in line, line
        assert "missing ranks [0" not in line and "missing ranks [1" not in line, line


@pytest.mark.mpi
@pytest.mark.parametrize("scenario", ["shape", "dtype"])
def test_argument_mismatch_is_rejected_at_construction_naming_the_odd_rank(scenario):
    proc = run_faults(scenario, "solo", size=3)
    assert proc.returncode != 0
    text = proc.stderr.replace("\0", "")
    errors = [line for line in text.splitlines() if line.startswith("ValueError: rank ")]
    assert len(errors) == 3, text[-3000:]  # every rank raises, before any round
    for line in errors:
        assert "ranks [2] constructed the PartialAllreduce with a different shape, dtype" in line, line


def test_odd_ones_names_the_minority():
    assert pm._odd_ones({0: 5, 1: 5, 2: 4}) == [2]
    assert pm._odd_ones({0: 5, 1: 6, 2: 5, 3: 5}) == [1]
    assert pm._odd_ones({0: 4, 1: 5}) == [0]  # tie: the larger count wins, the early stopper is named
