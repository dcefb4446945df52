"""The MPI watchdog (jaxcomm.comm.MPIWatchdog) around a jitted compressed_mean step under mpirun.

Worker script: tests/mpi_scripts/watchdog_faults.py (3 processes, a 2 s timeout, the last
rank at fault, and in the fault scenarios a healthy rank 0 whose heartbeats are late by more
than the timeout, as on a busy machine). The assertions are here, on what the job printed and
its exit status; no verdict depends on how busy the machine is.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from mpirun import ROOT, mpirun_env, mpirun_path

pytest.importorskip("mpi4py")
from jaxcomm.comm import MPIWatchdog, MPIWatchdogError
from jaxcomm.comm import _watchdog as wdm
from jaxcomm.comm._watchdog import WATCHDOG_ABORT_CODE

SCRIPT = Path(__file__).resolve().parent / "mpi_scripts" / "watchdog_faults.py"
TIMEOUT_S = 2.0
SIZE = 3
CULPRIT = SIZE - 1


def run_job(scenario: str) -> tuple[subprocess.CompletedProcess, str]:
    cmd = [mpirun_path(), "-n", str(SIZE), "--oversubscribe", sys.executable, str(SCRIPT), scenario, str(TIMEOUT_S)]
    env = mpirun_env()
    env["PYTHONPATH"] = str(ROOT)
    # Backstop only: a job that does not end by itself fails the test, never hangs the suite.
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=90, cwd=ROOT)
    text = (proc.stdout + proc.stderr).replace("\0", "")
    fault = re.search(rf"rank {CULPRIT} fault at ([0-9.]+)", text)
    if fault is not None and scenario != "slow":
        # Bounded: the job ends within the timeout plus the watchdog's and mpirun's reaction
        # (seconds), not at the backstop. Generous, since the machine is shared.
        elapsed = time.time() - float(fault.group(1))
        print(f"{scenario}: the job ended {elapsed:.1f} s after the fault")
        assert elapsed < 30, text[-3000:]
    return proc, text


def verdicts(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("jaxcomm: rank ")]


def finals(text: str) -> list[str]:
    return [line.split(" done ")[1] for line in text.splitlines() if " done " in line]


@pytest.mark.mpi
def test_documented_usage_exits_cleanly_and_a_slow_rank_only_slows_the_job():
    # The culprit sleeps TIMEOUT/3 before step 3; nobody may be named. (A job without the sleep
    # shows nothing more, so it is not run too.)
    proc, text = run_job("slow")
    assert proc.returncode == 0, text[-3000:]
    assert not verdicts(text), text[-3000:]
    done = finals(text)
    assert len(done) == SIZE and len(set(done)) == 1, text[-3000:]  # identical parameters everywhere
    assert not np.allclose(np.array(json.loads(done[0])), 1.0)  # the steps moved the parameters


@pytest.mark.mpi
@pytest.mark.parametrize(
    "scenario, cause",
    [
        ("hang", f"rank {CULPRIT} is alive but its application has not entered step 3 for"),
        ("stop", f"ranks [{CULPRIT}] sent no heartbeat for"),
        ("fewer", "ranks [2] differ from the most common count"),
    ],
)
def test_a_rank_that_holds_up_the_step_is_named_and_the_job_ends(scenario, cause):
    """hang: the culprit's application sleeps between steps (its heartbeats go on); stop: it
    stops itself (SIGSTOP) inside step 3; fewer: it closes after 7 steps while the others wait
    inside their 8th. Meanwhile rank 0 holds its GIL for 1.25 timeouts in that step (its
    heartbeats stop as long). Every verdict names the culprit and only it, after at least the
    timeout; a verdict from silence alone (stop: every rank is inside step 3) after twice it."""
    proc, text = run_job(scenario)
    assert proc.returncode == WATCHDOG_ABORT_CODE, text[-3000:]
    lines = verdicts(text)
    assert lines, text[-3000:]
    for line in lines:
        assert "MPI watchdog: culprit ranks [2]:" in line and cause in line and "aborting the job" in line, line
        waited = float(re.search(r"waited ([0-9.]+) s", line).group(1))
        assert waited >= (2 * TIMEOUT_S if scenario == "stop" else TIMEOUT_S), line  # never before the timeout
    judges = {int(re.match(r"jaxcomm: rank (\d+):", line).group(1)) for line in lines}
    if scenario != "fewer":
        assert CULPRIT not in judges  # the hung or stopped rank itself is not waiting
    assert not finals(text)


@pytest.mark.mpi
def test_raise_mode_reaches_every_callers_except_when_the_late_rank_arrives():
    """on_verdict="raise": ranks 0 and 1 wait in the last step for rank 2, which arrives only once
    both have reached their verdict; their step then raises the verdict, and rank 2's close raises
    that they reached one. Every rank's except runs and the job exits 0, never aborted."""
    proc, text = run_job("late")
    assert proc.returncode == 0, text[-3000:]
    lines = verdicts(text)
    assert len(lines) == SIZE - 1, text[-3000:]
    for line in lines:
        assert "MPI watchdog: culprit ranks [2]:" in line and "raising MPIWatchdogError in the caller" in line, line
        assert "rank 2 is alive but its application has not entered step 7" in line, line
    caught = sorted(line for line in text.splitlines() if " caught " in line)
    assert len(caught) == SIZE, text[-3000:]
    for r in range(CULPRIT):
        assert caught[r].startswith(f"rank {r} caught rank {r}: MPI watchdog: culprit ranks [2]:"), caught[r]
    assert caught[CULPRIT].startswith(f"rank {CULPRIT} caught rank {CULPRIT}: MPI watchdog: ranks [0, 1] reached"), (
        caught
    )
    assert not finals(text)


@pytest.mark.mpi
def test_exception_on_one_rank_aborts_the_job_naming_it():
    # Without the watchdog this job hangs: the culprit blocks in MPI_Finalize, the others in the step.
    proc, text = run_job("raise")
    assert proc.returncode == WATCHDOG_ABORT_CODE, text[-3000:]
    lines = verdicts(text)
    assert lines == [
        f"jaxcomm: rank {CULPRIT}: RuntimeError left the MPI watchdog block: the culprit's step failed; "
        "aborting the job"
    ], text[-3000:]


@pytest.mark.mpi
def test_call_count_mismatch_without_collectives_is_an_error_at_close():
    proc, text = run_job("fewer_local")
    assert proc.returncode == WATCHDOG_ABORT_CODE, text[-3000:]
    lines = verdicts(text)
    assert len(lines) == SIZE, text[-3000:]  # every rank gathers the counts and raises
    for line in lines:
        assert "MPIWatchdogError left the MPI watchdog block" in line, line
        assert "call-count mismatch, ranks [2] made a different number of steps" in line, line
        assert "(steps per rank {0: 8, 1: 8, 2: 7})" in line, line


@pytest.mark.mpi
@pytest.mark.parametrize(
    "scenario, named",
    [
        ("exit", r"exited with non-zero status.*Process name: *\[[^\]]*,2\].*Exit code: *3"),
        ("kill", r"process rank 2 with PID \d+ on node \S+ exited on\s+signal 9"),
    ],
)
def test_a_rank_that_dies_mid_step_ends_the_job_named_by_mpirun(scenario, named):
    # No watchdog verdict is needed: mpirun notices the exit and ends the job itself.
    proc, text = run_job(scenario)
    assert proc.returncode != 0
    assert re.search(named, text, re.S), text[-3000:]
    assert not verdicts(text) and not finals(text)


def test_single_process_watch_counts_steps_and_closes():
    import jax
    import jax.numpy as jnp

    before = threading.active_count()
    step = jax.jit(lambda x: 2 * x)
    with MPIWatchdog(5.0) as wd:
        watched = wd.watch(step)
        x = jnp.arange(3.0)
        for _ in range(3):
            x = watched(x)
        assert wd.steps == 3 and wd.size == 1
    np.testing.assert_array_equal(np.asarray(x), 8 * np.arange(3.0))
    assert threading.active_count() == before
    with pytest.raises(MPIWatchdogError, match="closed"):
        watched(x)
    # on_verdict="raise": a verdict the thread records while a call waits is raised when the
    # call returns (the step did run), then again before any further step and at close.
    wd = MPIWatchdog(5.0, on_verdict="raise")
    assert wd.abort_on_fault is False
    calls = []
    watched = wd.watch(lambda x: calls.append(1) or wd.__setattr__("_verdict", "culprit ranks [1]: test") or x)
    with pytest.raises(MPIWatchdogError, match=r"rank 0: MPI watchdog: culprit ranks \[1\]: test"):
        watched(jnp.ones(2))
    with pytest.raises(MPIWatchdogError, match="culprit ranks"):
        watched(jnp.ones(2))
    assert len(calls) == 1 and wd.steps == 1
    with pytest.raises(MPIWatchdogError, match="culprit ranks"):
        wd.close()


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"timeout_s": 0.0}, ValueError, "timeout_s"),
        ({"timeout_s": float("inf")}, ValueError, "timeout_s"),
        ({"timeout_s": 1.0, "poll_s": 2.0}, ValueError, "poll_s"),
        ({"timeout_s": 1.0, "comm": 3}, TypeError, "comm"),
        ({"timeout_s": 1.0, "abort_on_fault": 1}, TypeError, "abort_on_fault"),
        ({"timeout_s": 1.0, "on_verdict": "exit"}, ValueError, "on_verdict"),
        ({"timeout_s": 1.0, "on_verdict": None}, ValueError, "on_verdict"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        MPIWatchdog(**kwargs)


def judge(mine: tuple, peers: dict, now: float = 100.0, timeout: float = 2.0, late: float = 0.0, resumed=-np.inf):
    """Run the verdict rule on a fake 4-process state: ``mine = (entered, left, closing, since)``,
    ``peers[q] = (entered, left, closing, idle_s, heard_s_ago)``; ``late``: the longest silence
    seen from a peer that then spoke again; ``resumed``: when this thread last ran again after
    not running."""
    wd = MPIWatchdog.__new__(MPIWatchdog)
    wd.rank, wd.size, wd.timeout_s, wd._late_s, wd._resumed = 0, 4, timeout, late, resumed
    wd._entered, wd._left, wd._closing, wd._changed = mine[0], mine[1], mine[2], now - mine[3]
    wd._peers = sorted(peers)
    wd._state = {q: np.array([q, e, l, int(1e3 * idle), c, 0], np.int64) for q, (e, l, c, idle, _) in peers.items()}
    wd._heard = {q: now - ago for q, (*_, ago) in peers.items()}
    return wdm.MPIWatchdog._judge(wd, now)


def test_verdict_rule_names_only_who_holds_the_step_up():
    # In step 3 (entered 4) for 3 s. Peers in step 3 too, alive: a long step, nobody named.
    assert judge((4, 3, 0, 3.0), {1: (4, 3, 0, 3.0, 0.1), 2: (4, 3, 0, 3.0, 0.1), 3: (4, 3, 0, 3.0, 0.1)}) is None
    # Not waiting long enough yet: nobody named even if a peer is far behind.
    assert judge((4, 3, 0, 1.0), {1: (4, 3, 0, 1.0, 0.1), 2: (4, 3, 0, 1.0, 0.1), 3: (1, 1, 0, 9.0, 0.1)}) is None
    # Rank 3 has not entered step 3 and has been idle 2.5 s: hung; rank 2, behind but progressing, is not.
    v = judge((4, 3, 0, 3.0), {1: (4, 3, 0, 3.0, 0.1), 2: (3, 3, 0, 0.5, 0.1), 3: (3, 3, 0, 2.5, 0.1)})
    assert v.startswith("culprit ranks [3]:") and "(hung)" in v
    # Rank 2 is stuck inside step 2 behind rank 3, which has not entered step 2: only rank 3.
    v = judge((4, 3, 0, 3.0), {1: (4, 3, 0, 3.0, 0.1), 2: (3, 2, 0, 3.0, 0.1), 3: (2, 2, 0, 3.0, 0.1)})
    assert v.startswith("culprit ranks [3]:")
    # Every rank inside the same step: only silence can name one, and only past twice the timeout
    # (a healthy rank's heartbeat 2.4 s late is not enough), or past the timeout plus the longest
    # silence seen from a peer that then spoke again, if longer. A stale peer already past this
    # step is not holding it up.
    same = {2: (4, 3, 0, 5.0, 0.1), 3: (4, 3, 0, 5.0, 0.1)}
    assert judge((4, 3, 0, 5.0), {1: (4, 3, 0, 5.0, 2.4), **same}) is None
    v = judge((4, 3, 0, 5.0), {1: (4, 3, 0, 5.0, 4.5), **same})
    assert v.startswith("culprit ranks [1]:") and "ranks [1] sent no heartbeat for {1: 4.5} s (dead or stopped" in v
    assert judge((4, 3, 0, 5.0), {1: (4, 3, 0, 5.0, 4.5), **same}, late=3.0) is None
    assert judge((4, 3, 0, 6.0), {1: (4, 3, 0, 6.0, 5.5), **same}, late=3.0).startswith("culprit ranks [1]:")
    assert judge((4, 3, 0, 5.0), {1: (5, 4, 0, 5.0, 4.5), **same}) is None
    # A rank behind is the culprit however late the heartbeats of a rank that reached this step:
    # rank 1, silent for 9 s inside step 3, is not named while rank 3 has not entered it.
    v = judge((4, 3, 0, 9.0), {1: (4, 3, 0, 9.0, 9.0), 2: (4, 3, 0, 9.0, 0.1), 3: (3, 3, 0, 2.5, 0.1)})
    assert v.startswith("culprit ranks [3]:") and "rank 3 is alive but its application has not entered step 3" in v
    # ... nor while rank 3 is behind but still progressing: nobody is named yet.
    assert judge((4, 3, 0, 9.0), {1: (4, 3, 0, 9.0, 9.0), 2: (4, 3, 0, 9.0, 0.1), 3: (3, 3, 0, 0.5, 0.1)}) is None
    # Idleness is what a rank reports, not the age of its last heartbeat: rank 1's, 1.9 s old (its
    # GIL held), still shows it inside step 6, busy; it is not named beside hung rank 2, nor alone.
    stale = {1: (7, 6, 0, 0.2, 1.9), 3: (8, 7, 0, 2.1, 0.1)}
    assert judge((8, 7, 0, 2.1), {**stale, 2: (7, 7, 0, 2.5, 0.1)}).startswith("culprit ranks [2]: ")
    assert judge((8, 7, 0, 2.1), {**stale, 2: (8, 7, 0, 2.1, 0.1)}) is None
    # What a silent rank reached is as old as its silence (a healthy rank's last heartbeat may show
    # it steps behind): it is judged by silence, past twice the timeout, not as behind.
    assert judge((4, 3, 0, 2.5), {1: (4, 3, 0, 2.5, 0.1), 2: (1, 1, 0, 0.2, 2.3), 3: (4, 3, 0, 2.5, 0.1)}) is None
    v = judge((4, 3, 0, 4.5), {1: (4, 3, 0, 4.5, 0.1), 2: (1, 1, 0, 0.2, 4.3), 3: (4, 3, 0, 4.5, 0.1)})
    assert v.startswith("culprit ranks [2]:") and "ranks [2] sent no heartbeat for {2: 4.3} s" in v
    # This process's own thread did not run until 1 s ago (itself stopped or starved): rank 2's
    # heartbeats since are unread, not silence; its silence counts from then.
    late_me = {1: (4, 3, 0, 9.0, 0.1), 2: (1, 1, 0, 0.2, 9.0), 3: (4, 3, 0, 9.0, 0.1)}
    assert judge((4, 3, 0, 9.0), late_me).startswith("culprit ranks [2]:")
    assert judge((4, 3, 0, 9.0), late_me, resumed=99.0) is None
    assert judge((4, 3, 0, 9.0), late_me, now=104.5, resumed=99.0).startswith("culprit ranks [2]:")
    # Rank 2 waits inside step 2 for silent rank 3 (last heard before step 2): rank 3, by silence.
    v = judge((4, 3, 0, 4.5), {1: (4, 3, 0, 4.5, 0.1), 2: (3, 2, 0, 4.5, 0.1), 3: (2, 2, 0, 0.2, 4.3)})
    assert v.startswith("culprit ranks [3]:")
    # At close after 8 steps: a rank still stepping past 8 is the odd one; if three ranks
    # stepped to 9 while this one closed at 8, this one is.
    v = judge((8, 8, 1, 3.0), {1: (8, 8, 1, 3.0, 0.1), 2: (8, 8, 1, 3.0, 0.1), 3: (9, 8, 0, 3.0, 0.1)})
    assert v.startswith("culprit ranks [3]:") and "call-count mismatch" in v
    v = judge((8, 8, 1, 3.0), {1: (9, 8, 0, 3.0, 0.1), 2: (9, 8, 0, 3.0, 0.1), 3: (9, 8, 0, 3.0, 0.1)})
    assert v.startswith("culprit ranks [0]:")
    # A mismatch names the odd count even when another rank's heartbeats are late, or predate its
    # last step (rank 1 reports 7 steps: a lower bound, so it does not vote).
    v = judge((8, 7, 0, 3.0), {1: (8, 7, 0, 3.0, 2.9), 2: (7, 7, 1, 3.0, 0.1), 3: (8, 7, 0, 3.0, 0.1)})
    assert v.startswith("culprit ranks [2]:") and "call-count mismatch" in v
    v = judge((8, 7, 0, 3.0), {1: (7, 7, 0, 0.1, 0.1), 2: (7, 7, 1, 3.0, 0.1), 3: (8, 7, 0, 3.0, 0.1)})
    assert v.startswith("culprit ranks [2]:") and "steps per rank {0: 8, 2: 7, 3: 8}" in v
    # Not waiting (between steps): never a verdict.
    assert judge((4, 4, 0, 30.0), {1: (1, 1, 0, 30.0, 30.0), 2: (4, 4, 0, 0, 0), 3: (4, 4, 0, 0, 0)}) is None
