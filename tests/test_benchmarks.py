"""The speed benchmarks in experiments/benchmarks/ run end to end in a tiny configuration.

Not timings (those are noise at this size): the scripts' plumbing -- the
registry sweep, the reference, the target bookkeeping, JSON out -- so that
they cannot rot between the runs whose tables are in docs/benchmarks.md.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import jaxcomm as jc

BENCH = Path(__file__).resolve().parents[1] / "experiments" / "benchmarks"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_compressor_benchmark_tiny(tmp_path, capsys):
    bench = _load("compressors")
    out = tmp_path / "compressors.json"
    # One compressor of each target group and PowerSGD (1-D sweep and matrix). One matrix shape is
    # measured (every rank, cold and warm, is a compiled program of its own); the tables and targets
    # of several shapes are checked below from the JSON, with a second shape's rows added to it.
    result = bench.main(
        [
            "--sizes",
            "2000",
            "--repeats",
            "1",
            "--only",
            "fp16,qsgd,topk,powersgd",
            "--powersgd-shape",
            "16x40",
            "--in-process",
            "--out",
            str(out),
        ]
    )
    saved = json.loads(out.read_text())
    assert saved["sizes"] == [2000] and saved["repeats"] == 1
    rows = {r["name"]: r for r in saved["results"]}
    assert set(rows) == {"fp16", "qsgd", "topk", "powersgd"}
    for r in rows.values():
        assert "error" not in r, r
        assert r["median_s"] > 0 and r["ref_median_s"] > 0 and r["ratio"] > 0 and r["wire_bits"] > 0
    assert rows["topk"]["wire_bits"] == 20 * (32 + 16)  # k = 1% of 2000, float32 values + uint16 indices
    # The PowerSGD shape at ranks 1, 2, 4, cold and warm, against the reference on the same matrix.
    assert [(r["shape"], r["kwargs"]["matrix_approximation_rank"], r["start"]) for r in saved["powersgd_matrix"]] == [
        ([16, 40], rank, start) for rank in (1, 2, 4) for start in ("cold", "warm")
    ]
    for r in saved["powersgd_matrix"]:
        assert "error" not in r, r
        assert r["size"] == r["shape"][0] * r["shape"][1] and r["ratio"] > 0
        assert r["wire_bits"] == 32 * sum(r["shape"]) * r["kwargs"]["matrix_approximation_rank"]
    # Targets are evaluated only at 10 and 100 MB (not measured here), and for the PowerSGD matrices.
    assert sorted(saved["targets"]) == sorted(f"powersgd_r{r}@16x40{w}" for r in (1, 2, 4) for w in ("", "_warm"))
    assert result["targets"] == saved["targets"]
    text = capsys.readouterr().out
    assert "| topk |" in text and "targets:" in text
    # The docs' tables, from the JSON, with the rows of a second shape (12x30) beside the measured
    # ones: one table and one target per (shape, rank, start), the shapes kept apart.
    second = [
        dict(r, shape=[12, 30], size=360, wire_bits=32 * 42 * r["kwargs"]["matrix_approximation_rank"])
        for r in saved["powersgd_matrix"]
    ]
    two = tmp_path / "two_shapes.json"
    two.write_text(json.dumps(dict(saved, powersgd_matrix=saved["powersgd_matrix"] + second)))
    bench.main(["--markdown", str(two)])
    text = capsys.readouterr().out
    assert "| PowerSGD on 16x40 |" in text and "| PowerSGD on 12x30 |" in text
    assert text.count("| rank 4 | cold |") == 2 and text.count("| rank 4 | warm |") == 2
    assert sorted(bench.evaluate_targets(saved["results"], saved["powersgd_matrix"] + second)) == sorted(
        f"powersgd_r{r}@{s}{w}" for s in ("16x40", "12x30") for r in (1, 2, 4) for w in ("", "_warm")
    )


def test_compressor_benchmark_targets_cover_issue_list():
    bench = _load("compressors")
    groups = {g: set(names) for g, (names, _) in bench.TARGETS.items()}
    assert groups["elementwise"] == {
        "fp16",
        "bf16",
        "signsgd",
        "onebit",
        "efsignsgd",
        "terngrad",
        "qsgd",
        "natural",
        "eightbit",
    }
    assert groups["sparsifier"] == {"topk", "dgc", "qsparse"}
    assert set().union(*groups.values()) <= set(jc.compressors.names())
    rows = [dict(name=n, size=s, ratio=5.0) for n in ("qsgd", "topk") for s in bench.TARGET_SIZES]
    rows.append(dict(name="dgc", size=bench.TARGET_SIZES[0], error="boom"))
    t = bench.evaluate_targets(rows, [])
    assert not t["qsgd@10MB"]["met"] and t["topk@100MB"]["met"] and not t["dgc@10MB"]["met"]
    # Issue 16: rank 1 on 1280x2048 within 4x; other ranks and shapes keep issue 2's 10x.
    psgd = [
        dict(name="powersgd", kwargs=dict(matrix_approximation_rank=r), shape=list(s), ratio=5.0)
        for s in ((1280, 2048), (1024, 2560))
        for r in (1, 2)
    ]
    psgd.append(dict(name="powersgd", kwargs=dict(matrix_approximation_rank=4), shape=[1280, 2048], error="boom"))
    psgd.append(dict(psgd[0], start="warm", ratio=3.0))
    t = bench.evaluate_targets([], psgd)
    assert t["powersgd_r1@1280x2048"]["limit"] == 4.0 and not t["powersgd_r1@1280x2048"]["met"]
    assert t["powersgd_r1@1280x2048_warm"]["limit"] == 4.0 and t["powersgd_r1@1280x2048_warm"]["met"]
    assert t["powersgd_r2@1280x2048"]["met"] and t["powersgd_r1@1024x2560"]["met"]
    assert not t["powersgd_r4@1280x2048"]["met"]
    assert bench.parse_shapes("1280x2048, 5120X5120") == [(1280, 2048), (5120, 5120)]
    for bad in ("1280", "0x5", "12x3x4", "axb", "12x30,"):
        with pytest.raises(ValueError, match="powersgd-shape"):
            bench.parse_shapes(bad)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 simulated devices (tests/conftest.py)")
def test_step_overhead_benchmark_tiny(tmp_path):
    bench = _load("step_overhead")
    out = tmp_path / "step.json"
    result = bench.main(
        [
            "--trees",
            "tiny",
            "--compressors",
            "signsgd,topk,topk_floor,topk_reuse",
            "--repeats",
            "1",
            "--in-process",
            "--out",
            str(out),
        ]
    )
    saved = json.loads(out.read_text())
    res = saved["trees"]["tiny"]["results"]
    assert set(res) == {"signsgd", "topk", "topk_floor", "topk_reuse"} and saved["trees"]["tiny"]["num_tensors"] == 3
    # The floor sends exactly what top-k sends (same k, value and index dtypes per tensor).
    assert res["topk_floor"]["wire_bits_per_worker"] == res["topk"]["wire_bits_per_worker"]
    assert res["topk_reuse"]["wire_bits_per_worker"] == res["topk"]["wire_bits_per_worker"]
    d = saved["trees"]["tiny"]["num_params"]
    for r in res.values():
        assert "error" not in r, r
        assert r["ratio"] > 0 and r["memory"] == "residual"
        assert r["dense_bits_per_worker"] == 32 * d
    assert res["signsgd"]["wire_bits_per_worker"] < d + 32 * 3 + 1  # 1 bit per entry + a scale per tensor
    assert result["trees"] == saved["trees"]
    # --memory grace: GRACE's Table I choice (no error feedback for signSGD, residual for top-k). The
    # run carries the choice into the row (signSGD: none); the choice per compressor is checked below.
    grace = bench.main(
        [
            "--trees",
            "tiny",
            "--compressors",
            "signsgd",
            "--repeats",
            "1",
            "--in-process",
            "--memory",
            "grace",
            "--out",
            str(tmp_path / "grace.json"),
        ]
    )
    res = grace["trees"]["tiny"]["results"]
    assert set(res) == {"signsgd"} and res["signsgd"]["memory"] == "none" and "error" not in res["signsgd"]
    assert bench.memory_for("signsgd", "grace").name == "none" and bench.memory_for("topk", "grace").name == "residual"
    assert bench.memory_for("signsgd").name == "residual"
    assert bench.memory_for("qsgd", "grace").name == "none" and bench.memory_for("qsgd").name == "none"  # unbiased
    assert bench.memory_for("topk").name == "residual"
    with pytest.raises(ValueError, match="memory must be one of"):
        bench.memory_for("qsgd", "sometimes")
    assert "topk_floor" not in jc.compressors.names()  # a benchmark row, not a registered compressor
    assert bench.memory_for("qsgd_floor", "grace").name == "none"  # a floor runs with its compressor's memory
    assert bench.memory_for("topk_floor", "grace").name == "residual"
    # --batch: the gradient of a real network (a 3-conv VGG on 8x8 images) instead of g = a * x.
    model = bench.main(
        [
            "--trees",
            "vgg_tiny",
            "--batch",
            "2",
            "--compressors",
            "topk",
            "--repeats",
            "1",
            "--in-process",
            "--no-fuse",
            "--out",
            str(tmp_path / "model.json"),
        ]
    )
    r = model["trees"]["vgg_tiny"]["results"]["topk"]
    assert "error" not in r, r
    assert model["meta"]["batch_per_worker"] == 2 and model["meta"]["fuse"] is False
    assert r["dense_bits_per_worker"] == 32 * model["trees"]["vgg_tiny"]["num_params"]
    with pytest.raises(SystemExit):
        bench.main(["--trees", "tiny", "--batch", "2", "--out", str(tmp_path / "bad.json")])
    params = {k: jax.numpy.zeros(s) for k, s in bench.vgg_tiny_shapes().items()}
    loss = bench.vgg_loss(params, jax.numpy.zeros((1, 8, 8, 3)), jax.numpy.zeros((1,), int), bench.VGG_TINY_POOL_AFTER)
    assert abs(float(loss) - float(jax.numpy.log(10.0))) < 1e-5  # zero weights: uniform softmax over 10 classes
    assert bench.vgg16_shapes() == bench.vgg_shapes(bench.VGG16_CONVS, 512)  # 5 pools: 32x32 -> 1x1x512
    # The documented trees have the sizes the issue names.
    for tree, lo, hi, n in (("resnet20", 260_000, 280_000, 59), ("vgg16", 14_500_000, 15_500_000, 30)):
        shapes = bench.TREES[tree]()
        assert len(shapes) == n and lo <= sum(int(jax.numpy.prod(jax.numpy.array(s))) for s in shapes.values()) <= hi


def test_topk_reuse_benchmark_tiny(tmp_path):
    bench = _load("topk_reuse")
    out = tmp_path / "reuse.json"
    result = bench.main(["--sizes", "5000", "--steps", "4", "--warmup", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert [r["gradients"] for r in result["results"]] == ["fresh", "fixed"]
    for r in result["results"]:
        assert r["mismatches"] == 0 and sum(r["paths"].values()) == 4 and r["k"] == 50
        assert len(r["plain_steps_ms"]) == len(r["reuse_steps_ms"]) == 4
    with pytest.raises(SystemExit):
        bench.main(["--gradients", "stale", "--out", str(out)])


def test_kernels_benchmark_selection_tiny(tmp_path):
    """The top-k comparison of kernels.py: both bodies checked equal (check() raises otherwise), timed,
    and their ratio recorded per ratio of k; the other comparisons are not run."""
    bench = _load("kernels")
    out = tmp_path / "kernels.json"
    result = bench.main(["--comparisons", "top_k", "--select-sizes", "4096", "--repeats", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert {r["comparison"] for r in result["results"]} == {"top_k 0.1%", "top_k 1%"}
    assert {(r["kernel"], r["n"]) for r in result["results"]} == {("float view", 4096), ("sampled threshold", 4096)}
    assert [(c["comparison"], c["n"]) for c in result["ratios"]] == [("top_k 0.1%", 4096), ("top_k 1%", 4096)]
    with pytest.raises(SystemExit):
        bench.main(["--select-sizes", "2048", "--out", str(out)])  # at most SMALL: a sort, not compared
    with pytest.raises(SystemExit):
        bench.main(["--comparisons", "top", "--out", str(out)])


def test_floor_rows_send_what_their_compressor_sends():
    """topk_floor's payload is top-k's at positions 0, s, 2s, ...: same sizes, top-k's
    decompress, sum and error hooks; qsgd_floor's is QSGD's payload and decoder."""
    bench = _load("step_overhead")
    floor, topk = bench.make_compressor("topk_floor"), bench.make_compressor("topk")
    x = jax.random.normal(jax.random.key(0), (3, 3, 4, 20))  # d = 720, k = 7, s = 102
    key = jax.random.key(1)
    p, q = floor.compress(x, key)[0], topk.compress(x, key)[0]
    assert p.values.shape == q.values.shape and p.indices.dtype == q.indices.dtype
    assert p.wire_bits() == q.wire_bits()
    assert list(map(int, p.indices)) == [102 * i for i in range(7)]
    dense = jax.numpy.zeros(720).at[p.indices].set(x.ravel()[p.indices]).reshape(x.shape)
    assert bool((floor.decompress(p) == dense).all())
    # Top-k's own hooks on the floor's payload: the sum of the stacked payloads and the error in place.
    stacked = jax.tree.map(lambda *v: jax.numpy.stack(v), p, floor.compress(-x, key)[0])
    assert bool((floor.decompress_sum(stacked, jax.numpy.float32) == 0).all())  # x + (-x) at the same positions
    assert bool((floor.compression_error(x, p) == x - dense).all())
    # QSGD's floor: QSGD's payload size and decoder, codes s + sign(x) with norm 1.
    floor, qsgd = bench.make_compressor("qsgd_floor"), bench.make_compressor("qsgd")
    p, q = floor.compress(x, key)[0], qsgd.compress(x, key)[0]
    assert p.wire_bits() == q.wire_bits()
    assert bool((floor.decompress(p) == jax.numpy.sign(x) / 64).all())


def test_fusion_mpi_benchmark_tiny(tmp_path):
    """fusion_mpi.py under mpirun -n 2 on the tiny tree: fused, unfused and none() steps, rank 0's JSON."""
    bench = _load("fusion_mpi")
    out = tmp_path / "fusion.json"
    assert (
        bench.main(["--procs", "2", "--trees", "tiny", "--compressors", "topk", "--repeats", "1", "--out", str(out)])
        == 0
    )
    saved = json.loads(out.read_text())
    r = saved["trees"]["tiny"]["results"]["topk"]
    assert saved["meta"]["processes"] == 2 and saved["meta"]["devices_per_process"] == 1
    assert saved["trees"]["tiny"]["num_tensors"] == 3
    assert all(r[k] > 0 for k in ("none_ms", "fused_ms", "unfused_ms"))
    assert r["fused_ratio"] == pytest.approx(r["fused_ms"] / r["none_ms"])
    with pytest.raises(SystemExit):
        bench.main(["--procs", "1"])


def test_watchdog_mpi_benchmark_tiny(tmp_path):
    """watchdog_mpi.py under mpirun -n 2 on the tiny tree: the three variants timed, paired ratios
    formed from the per-round times, rank 0's JSON."""
    bench = _load("watchdog_mpi")
    out = tmp_path / "watchdog.json"
    argv = ["--procs", "2", "--trees", "tiny", "--steps", "2", "--repeats", "2", "--out", str(out)]
    assert bench.main(argv) == 0
    r = json.loads(out.read_text())["trees"]["tiny"]
    times = {v: np.asarray(r["step_ms"][v]) for v in ("async", "sync", "watched")}
    assert all(t.shape == (2,) and (t > 0).all() for t in times.values())
    assert r["watched_ms"] == pytest.approx(float(np.median(times["watched"])))
    assert r["watched_over_sync_paired"] == pytest.approx(float(np.median(times["watched"] / times["sync"])))
    with pytest.raises(SystemExit):
        bench.main(["--procs", "1"])


def test_mpi_step_breakdown_tiny(tmp_path):
    """fusion_mpi.py --breakdown under mpirun -n 2 on the tiny tree (none(): the fewest programs to
    compile; the parts of the compressors run on a Loopback below): every program timed on both
    ranks, the ratios computed from the saved medians, and --markdown's table."""
    bench = _load("fusion_mpi")
    out = tmp_path / "breakdown.json"
    argv = ["--breakdown", "--procs", "2", "--trees", "tiny", "--compressors", "none", "--repeats", "2"]
    assert bench.main([*argv, "--out", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert saved["meta"]["processes"] == 2 and saved["meta"]["complete"]
    r = saved["trees"]["tiny"]["results"]["none"]
    assert r["memory"] == "none" and r["strategy"] == "allreduce"
    ms = r["ms"]
    assert set(ms) == set(bench.STEPS) | set(bench.PARTS) and all(v > 0 for v in ms.values())
    assert all(len(v) == 2 for v in r["steps_ms"].values())
    assert r["step_ratio"] == pytest.approx(ms["step"] / ms["dense_step"])
    assert r["compute_ratio"] == pytest.approx(ms["compute"] / ms["dense_compute"])
    added = (ms["compressor"] + ms["memory"] + ms["decode"]) / ms["dense_compute"]
    assert r["added_compute_ratio"] == pytest.approx(added)
    table = bench.markdown_table(saved)
    assert table.count("\n") == 2 and "| tiny | none | none |" in table


def test_mpi_step_breakdown_summary():
    """The breakdown's medians are over repeats of the slowest rank's time (closed form)."""
    bench = _load("fusion_mpi")
    labels = (*bench.STEPS, *bench.PARTS)
    # 2 ranks x 3 repeats; rank 1 is slower in repeat 0 only.
    times = {
        k: [[(i + 1) * t for t in (1.0, 2.0, 3.0)], [(i + 1) * t for t in (5.0, 1.0, 1.0)]]
        for i, k in enumerate(labels)
    }
    r = bench.summarize(times)
    for i, k in enumerate(labels):
        assert r["ms"][k] == pytest.approx(1e3 * (i + 1) * 3.0)  # median of (5, 2, 3)
        assert r["rank0_ms"][k] == pytest.approx(1e3 * (i + 1) * 2.0)
        assert r["steps_ms"][k] == pytest.approx([1e3 * (i + 1) * t for t in (5.0, 2.0, 3.0)])
    step, dense = labels.index("step") + 1, labels.index("dense_step") + 1
    assert r["step_ratio"] == pytest.approx(step / dense) and r["step_ratio_paired"] == pytest.approx(step / dense)
    assert r["network_ms"] == pytest.approx(r["ms"]["step"] - r["ms"]["compute"])


@pytest.mark.parametrize("name", ["none", "topk", "powersgd"])
def test_mpi_step_breakdown_parts_on_loopback(name):
    """The parts' programs on a 3-worker Loopback (no MPI): the decode sums n copies of this worker's
    payload for the all-gather strategy, the all-reduce's sum is this worker's own fields, and the
    rounds' payload decodes once; every part runs and returns a time."""
    pytest.importorskip("mpi4jax")  # Loopback's copies are MPI calls on MPI_COMM_SELF
    bench = _load("fusion_mpi")
    step = _load("step_overhead")
    n, rank = 3, 1
    loop = bench.Loopback(n, rank)
    c, memory = step.make_compressor(name), step.memory_for(name, "grace")
    calls, arrays = bench.part_runners(c, memory, loop, loop, step.TREES["tiny"](), True, rank)
    assert set(calls) == set(bench.PARTS) and all(f() > 0 for f in calls.values())
    for i, (p, total) in enumerate(zip(arrays["payloads"], arrays["totals"])):
        if c.rounds is not None:  # (payload, messages): the rounds' sums are the identity here
            assert jax.numpy.allclose(total, c.decompress(p[0]), rtol=1e-6, atol=1e-6)
        elif c.strategy == "allgather":
            assert all(v.shape[0] == n for v in jax.tree.leaves(arrays["received"][i]))
            assert jax.numpy.allclose(total, n * c.decompress(p), rtol=1e-5, atol=1e-5)
        else:  # none(): the summed fields are this worker's gradient
            assert bool((total == arrays["g"][i]).all())


@pytest.mark.mpi
def test_scaling_benchmark_smoke(namespaces, tmp_path):
    """scaling.py --smoke on the emulated link (n = 2, 4): every case's bytes within the protocol's
    overhead of the cost model, the projection's closed forms, and the figure."""
    from jaxcomm import cost_model

    bench = _load("scaling")
    out = tmp_path / "scaling.json"
    assert bench.main(["--smoke", "--out", str(out)]) == 0
    saved = json.loads(out.read_text())
    measured = saved["measured"]
    assert sorted({(r["n"], r["case"]) for r in measured}) == sorted((n, c) for n in (2, 4) for c in bench.CASES)
    for r in measured:
        assert r["predicted_bytes"] == cost_model.step_bytes(r["strategy"], r["wire_bytes_per_worker"], r["n"])
        # headers are taken off; Open MPI's own headers stay: at most 128 bytes per message
        wire_messages = 2 * r["n"] * (r["n"] - 1) * r["messages"]
        assert r["predicted_bytes"] <= r["measured_bytes"] <= r["predicted_bytes"] + 256 * wire_messages, r
    dense = {r["n"]: r for r in saved["projected"] if r["case"] == "none"}
    topk = {r["n"]: r for r in saved["projected"] if r["case"] == "topk"}
    assert sorted(dense) == list(bench.PROJECT_N)
    # switched ring all-reduce: 2 (n − 1)/n of the gradient per worker and 2 (n − 1) latencies;
    # the all-gather's bytes and latencies both grow with n − 1
    args = saved["args"]
    B, alpha = 1e9 * args["project_gbps"], args["project_latency"]
    for n, row in dense.items():
        P = row["payload_bytes"]
        assert pytest.approx(4 * args["project_params"]) == P
        assert row["predicted_s"] == pytest.approx(8 * 2 * (n - 1) * P / (n * B) + 2 * (n - 1) * alpha)
    assert topk[1024]["predicted_s"] / topk[2]["predicted_s"] == pytest.approx(1023)
    assert Path(saved["figure"]).stat().st_size > 10_000


@pytest.mark.mpi
def test_payload_bytes_benchmark_smoke(namespaces, tmp_path, capsys):
    """payload_bytes.py --smoke on the emulated link (root): per compressor, the link's bytes are
    the cost model's prediction from state.wire_bits plus Open MPI's protocol bytes (at most
    128 + 64 per message of at most 64 KiB, n (n - 1) messages per all-gather; the all-reduce of
    none: 2 n (n - 1)), and the table comes out of the JSON."""
    bench = _load("payload_bytes")
    out = tmp_path / "payload.json"
    assert bench.main(["--smoke", "--out", str(out)]) == 0
    saved = json.loads(out.read_text())
    n = saved["meta"]["processes"]
    assert n == 2 and saved["meta"]["shape"] == [64, 32]
    rows = saved["results"]
    assert set(rows) == {"none", "topk", "threshold", "inceptionn"}
    for name, r in rows.items():
        per_message = 2 if name == "none" else 1
        bound = 192 * per_message * n * (n - 1) * r["messages"]
        assert r["predicted_bytes"] <= r["measured_bytes"] <= r["predicted_bytes"] + bound, (name, r)
        assert r["window"]["retransmitted"] == 0 and r["window"]["drops"] == 0
    assert rows["threshold"]["messages"] == 2 and rows["threshold"]["format_bytes"] < rows["threshold"]["whole_bytes"]
    assert rows["none"]["predicted_bytes"] == 2 * (n - 1) * 64 * 32 * 4
    text = capsys.readouterr().out
    assert "| `threshold` | allgather |" in text
    bench.main(["--markdown", str(out)])
    assert "measured / predicted" in capsys.readouterr().out


@pytest.mark.mpi
def test_token_bucket_benchmark_smoke(namespaces, tmp_path):
    """token_bucket.py --smoke (2 processes, 100 Mbit/s, 4 kB per rank): one row per shape, each
    with its bucket in closed form (256 KiB; 1 ms of the rate, over one 9,014-byte packet), the
    all-gather's n (n − 1) payloads on the link plus at most 4 kB of protocol and barrier bytes,
    and nothing dropped."""
    bench = _load("token_bucket")
    out = tmp_path / "bucket.json"
    bench.main(["--smoke", "--procs", "2", "--iters", "3", "--compute-ms", "10", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["burst"], r["mtu"], r["burst_bytes"]) for r in rows] == [("256kb", 65536, 262144), ("1ms", 9000, 12500)]
    for r in rows:
        assert r["link"] == "100mbit" and r["drops"] == 0
        assert 4096 * 2 <= r["link_bytes_per_iteration"] <= 4096 * 2 + 4096, r
        assert r["wire_ms"] == pytest.approx(8e3 * r["link_bytes_per_iteration"] / 1e8)


def _grace_rows(speedups: dict, size: int) -> list[dict]:
    """Rows as grace_compare.py writes them, with the given (GRACE / torch pass) / (jaxcomm / jax pass)."""
    rows = []
    for m, s in speedups.items():
        rows.append(
            dict(method=m, size=size, shape=[size], grace_ms=2.0 * s, jax_ms=2.0, speedup=s, speedup_raw=2.0 * s)
        )
    return rows


def test_grace_compare_jaxcomm_only_tiny(tmp_path, capsys, monkeypatch):
    """--grace none: jaxcomm and the jax memory pass only, torch never imported, GRACE columns absent."""
    bench = _load("grace_compare")
    monkeypatch.setitem(sys.modules, "torch", None)  # any `import torch` now raises ImportError
    out = tmp_path / "grace.json"
    result = bench.main(
        ["--grace", "none", "--sizes", "2048", "--repeats", "1", "--only", "fp16,topk,powersgd", "--out", str(out)]
    )
    saved = json.loads(out.read_text())
    assert result["results"] == saved["results"] and saved["sizes"] == [2048] and saved["grace_path"] is None
    rows = {r["method"]: r for r in saved["results"]}
    assert set(rows) == {"fp16", "topk", "powersgd"}
    for r in rows.values():
        assert "jax_error" not in r and "error" not in r, r
        assert r["jax_ms"] > 0 and r["jax_ref_ms"] > 0
        assert r["jax_ratio"] == pytest.approx(r["jax_ms"] / r["jax_ref_ms"])
        assert r["jax_ref_gbps"] == pytest.approx(8 * 2048 / (r["jax_ref_ms"] * 1e-3) / 1e9)
        assert not any(k.startswith(("grace_ms", "torch_ref", "speedup")) for k in r), r
    assert rows["powersgd"]["shape"] == [32, 64] and rows["topk"]["shape"] == [2048]
    assert rows["topk"]["wire_bits"] == 20 * (32 + 16)  # k = 1% of 2048, float32 values + uint16 indices
    assert rows["powersgd"]["wire_bits"] == 32 * (32 + 64)  # rank 1: P (32 x 1) and Q (64 x 1) in float32
    assert rows["topk"]["kwargs"] == {"ratio": 0.01} and rows["powersgd"]["kwargs"] == {"matrix_approximation_rank": 1}
    assert saved["targets"] == {}  # 2048 entries: none of issue 16's sizes or shapes
    assert "torch" not in saved["machine"] and saved["machine"]["device"] == "cpu"
    capsys.readouterr()
    bench.main(["--markdown", str(out)])
    text = capsys.readouterr().out
    assert "| TopK 1% | absent |" in text and "jax pass 2x+1" in text


def test_grace_compare_clear_errors(tmp_path, monkeypatch, capsys):
    """--grace pointing nowhere, a checkout without torch, no --grace at all: one line, exit status 2."""
    bench = _load("grace_compare")
    nowhere = tmp_path / "no-grace-here"
    with pytest.raises(SystemExit) as e:
        bench.main(["--grace", str(nowhere), "--sizes", "64", "--out", str(tmp_path / "x.json")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(nowhere) in err[0] and "grace_dl" in err[0]
    checkout = tmp_path / "grace"
    (checkout / "grace_dl" / "dist" / "compressor").mkdir(parents=True)
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(SystemExit) as e:
        bench.main(["--grace", str(checkout), "--sizes", "64", "--out", str(tmp_path / "x.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "needs PyTorch" in err[0]
    monkeypatch.delenv("GRACE_PATH", raising=False)
    with pytest.raises(SystemExit) as e:
        bench.main(["--sizes", "64", "--out", str(tmp_path / "x.json")])
    assert e.value.code == 2 and "--grace none" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_grace_compare_targets():
    """Issue 16's targets from the rows: geometric mean >= 5x and none slower, at 10 and 100 MiB, and
    PowerSGD rank 1 on 1280 x 2048 within 4x the memory pass; unmeasured inputs give met=None."""
    bench = _load("grace_compare")
    assert bench.matrix_shape(2_621_440) == (1280, 2048) and bench.matrix_shape(26_214_400) == (5120, 5120)
    assert bench.matrix_shape(7) == (1, 7) and bench.matrix_shape(12) == (3, 4)
    small, large = bench.TARGET_SIZES
    methods = list(bench.TARGET_METHODS)
    assert "randomk" not in methods and "randomk_replacement" in methods  # GRACE's sampling, like for like
    assert bench.jax_kwargs("randomk_replacement") == dict(ratio=0.01, replacement=True)
    assert bench.jax_kwargs("randomk") == dict(ratio=0.01)
    fast = {m: 2.0 ** (i % 5 + 1) for i, m in enumerate(methods)}  # 2, 4, 8, 16, 32, 2, ...: gmean 8
    slow = dict(fast, fp16=0.5)
    rows = _grace_rows(fast, small) + _grace_rows(slow, large) + _grace_rows({"randomk": 0.1}, small)
    rows[methods.index("powersgd")].update(shape=[1280, 2048], jax_ratio=3.5)  # PowerSGD runs on the matrix
    t = bench.evaluate_targets(rows)
    assert t["gmean_speedup@10MiB"]["value"] == pytest.approx(8.0) and t["gmean_speedup@10MiB"]["met"]
    assert t["gmean_speedup@10MiB"]["raw"] == pytest.approx(16.0)
    assert t["none_slower@10MiB"]["met"] and t["none_slower@10MiB"]["value"] == pytest.approx(2.0)
    want = 8.0 * (0.5 / fast["fp16"]) ** (1 / len(methods))
    assert t["gmean_speedup@100MiB"]["value"] == pytest.approx(want) and t["gmean_speedup@100MiB"]["met"] == (want >= 5)
    assert not t["none_slower@100MiB"]["met"] and t["none_slower@100MiB"]["slower"] == ["fp16"]
    assert t["powersgd_r1@1280x2048"] == dict(value=3.5, limit=4.0, met=True, error=None)
    # A failed method counts as missed; a method not run, or no GRACE, leaves the target open.
    failed = _grace_rows({m: 10.0 for m in methods if m != "qsgd"}, small)
    failed.append(dict(method="qsgd", size=small, shape=[small], jax_ms=1.0, grace_error="RuntimeError: boom"))
    t = bench.evaluate_targets(failed)
    assert t["gmean_speedup@10MiB"]["met"] is False and t["gmean_speedup@10MiB"]["failed"] == ["qsgd"]
    t = bench.evaluate_targets(_grace_rows(dict.fromkeys(methods[1:], 10.0), small))
    assert t["gmean_speedup@10MiB"]["met"] is None and methods[0] in t["gmean_speedup@10MiB"]["why"]
    t = bench.evaluate_targets([dict(method=m, size=large, shape=[large], jax_ms=1.0) for m in methods])
    assert t["none_slower@100MiB"]["met"] is None and "10MiB" not in str(t)
    t = bench.evaluate_targets([dict(method="powersgd", size=small, shape=[1280, 2048], jax_error="E: x")])
    assert t["powersgd_r1@1280x2048"]["met"] is False


def test_grace_compare_with_grace(tmp_path):
    """With torch and a GRACE checkout ($GRACE_PATH; skipped in CI, which has neither): both sides
    timed, GRACE's FP16 round trip equal to jaxcomm's on the same data."""
    torch = pytest.importorskip("torch")
    grace = os.environ.get("GRACE_PATH")
    if not grace:
        pytest.skip("GRACE_PATH not set")
    bench = _load("grace_compare")
    res = bench.main(["--grace", grace, "--sizes", "4096", "--repeats", "1", "--out", str(tmp_path / "g.json")])
    rows = {r["method"]: r for r in res["results"]}
    assert set(rows) == set(bench.METHODS)
    for r in rows.values():
        assert not any(k.endswith("error") for k in r), r
        assert r["speedup"] == pytest.approx((r["grace_ms"] / r["torch_ref_ms"]) / (r["jax_ms"] / r["jax_ref_ms"]))
    assert res["machine"]["torch"] == torch.__version__ and res["machine"]["torch_num_threads"] >= 1
    x = np.random.default_rng(0).standard_normal(4096, dtype=np.float32)
    side = bench.Torch(torch, "cpu")
    got = side.roundtrip("fp16")(side.tensor(x)).numpy()
    want = jc.compressors.make("fp16").decompress(jc.compressors.make("fp16").compress(jax.numpy.asarray(x))[0])
    np.testing.assert_array_equal(got, np.asarray(want))
    np.testing.assert_array_equal(side.reference(side.tensor(x)).numpy(), 2 * x + 1)


# StableHLO characters of each compressor's jitted decompress(compress(x, key)) on a 1024 x 1024 float32 tensor
# lowered for cuda (tpu gives the same text), at compressors.py's settings: measured by
# `python experiments/benchmarks/lowering.py` (experiments/benchmarks/results/lowering.json, jax 0.10.2). The bound
# is LOWERED_MARGIN times the measurement: room for ordinary changes, while a return of the CPU-tuned selection
# kernels on these platforms (top-k: 185,702 characters, 3.7x the measurement) fails at once. The selecting
# compressors' sizes include the accelerator's sampled top-k (select.top_by_threshold, used from 1,048,576
# keys up): threefry for the sample, the counting pass, jnp.nonzero, two lax.top_k and a lax.cond.
LOWERED_CHARS = {
    "adaptive": 117006, "bf16": 418, "clipping": 1657, "dgc": 94037, "efsignsgd": 9231, "eightbit": 15295,
    "fp16": 416, "inceptionn": 41669, "natural": 22801, "none": 254, "onebit": 13046, "powersgd": 35330,
    "qsgd": 33675, "qsparse": 101498, "random_sparsification": 36337, "randomk": 133313, "scaled_sign": 8664,
    "signsgd": 3249, "signum": 3969, "sketchml": 17929, "stochastic_rounding": 27328, "terngrad": 24384,
    "threshold": 16864, "topk": 50034,
}  # fmt: skip
LOWERED_MARGIN = 2.0


@pytest.fixture(scope="module")
def lowering():
    return _load("lowering")


@pytest.mark.parametrize("name", jc.compressors.names())
def test_every_compressor_lowers_for_gpu_and_tpu_within_its_bound(name, lowering):
    """Cross-platform lowering from this CPU: every registered compressor lowers for cuda and tpu (nothing
    compiled), and each module stays within LOWERED_MARGIN x its measured size, so that a regression in
    compile cost on those platforms shows in CI without a GPU."""
    assert name in LOWERED_CHARS, f"{name}: measure it with experiments/benchmarks/lowering.py and add its bound"
    c = jc.compressors.make(name, **lowering.bench.KWARGS.get(name, {}))
    texts = lowering.lowered_texts(c, (1024, 1024), ("cuda", "tpu"))
    for platform, text in texts.items():
        bound = LOWERED_MARGIN * LOWERED_CHARS[name]
        assert len(text) <= bound, f"{name} lowered for {platform}: {len(text):,} characters > bound {bound:,.0f}"
        assert "stablehlo.while" not in text or name == "dgc", f"{name}: a loop in the {platform} module"


def test_lowering_benchmark_tiny(lowering, tmp_path, capsys):
    """The lowering benchmark's JSON and its before -> after table (one trace per compressor and size)."""
    out = tmp_path / "lowering.json"
    res = lowering.main(["--only", "fp16,topk", "--sizes", "4096", "--large-sizes", "8192", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["results"] == res["results"] and saved["platforms"] == ["cuda", "tpu"]
    got = {(r["name"], r["size"], r["platform"]) for r in saved["results"]}
    assert got == {(n, d, p) for n, d in (("fp16", 4096), ("topk", 4096), ("topk", 8192)) for p in ("cuda", "tpu")}
    for r in saved["results"]:
        assert "error" not in r, r
        assert r["ops"] == sum(r["op_counts"].values()) > 0 and r["chars"] > 0
    topk = next(r for r in saved["results"] if r["name"] == "topk" and r["platform"] == "cuda")
    assert topk["op_counts"]["chlo.top_k"] == 1 and topk["shape"] == [64, 64]
    capsys.readouterr()
    lowering.main(["--markdown", str(out), "--before", str(out)])
    text = capsys.readouterr().out
    fp16 = next(r for r in saved["results"] if r["name"] == "fp16" and r["platform"] == "cuda")
    assert f"| fp16 | 4,096 | {fp16['chars']:,} -> {fp16['chars']:,} |" in text


def test_device_check_smoke(tmp_path):
    """scripts/device_check.sh --smoke on this CPU: every part runs in its own process and device_check.json
    records the backend, each part's rows and status, and targets judged on those rows."""
    check = _load("device_check")
    env = {**os.environ, "PYTHON": sys.executable}
    root = BENCH.parents[1]
    cmd = ["bash", "scripts/device_check.sh", "--smoke", "--out", str(tmp_path)]
    subprocess.run(cmd, cwd=root, env=env, check=True)
    res = json.loads((tmp_path / "device_check.json").read_text())
    assert res["smoke"] and res["env"]["backend"] == "cpu" and res["env"]["hbm_gbps"] is None
    assert {p: part["status"] for p, part in res["parts"].items()} == dict.fromkeys(check.PARTS, "done")
    d = check.SMOKE_SIZE
    compiled = res["parts"]["compile"]["rows"]
    assert [r["name"] for r in compiled] == list(check.SMOKE["compile"])
    assert all(r["size"] == d and r["lower_s"] > 0 and r["compile_s"] > 0 for r in compiled)
    met = all(r["compile_s"] <= check.COMPILE_TARGET_S for r in compiled)
    assert res["targets"]["compile_s <= 10 for every compressor"]["met"] == met
    ref, *rows = res["parts"]["bandwidth"]["rows"]
    assert ref["name"] == "memory pass 2x+1" and [r["name"] for r in rows] == list(check.SMOKE["bandwidth"])
    for r in (ref, *rows):
        assert r["gbps"] == pytest.approx(8 * d / r["s_per_call"] / 1e9) and r["queue"] == 20
    assert rows[0]["of_memory_pass"] == pytest.approx(rows[0]["gbps"] / ref["gbps"])
    grace = res["parts"]["grace"]["results"]
    assert [r["method"] for r in grace["results"]] == ["fp16"] and grace["machine"]["device"] == "cpu"
    assert res["parts"]["step"]["results"]["trees"]["tiny"]["results"]["signsgd"]["ratio"] > 0
    select = res["parts"]["select"]["results"]
    assert select["meta"]["smoke"] and select["identical"] and select["select"] and select["compressors"]
    assert res["targets"]["selection bodies give identical indices"] == dict(met=True)
    assert "python:" in res["setup_log"]
    text = check.markdown_tables(res)
    assert "| fp16 | " in text and "| memory pass 2x+1 | " in text and "| tiny step |" in text
    assert "| select | 4,096 |" in text and "| topk | 2,048 | 0.01 |" in text
    # The committed GPU run: the page shows exactly the tables --markdown prints from its JSON.
    saved = json.loads((BENCH / "results" / "device_check_h200.json").read_text())
    tables = check.markdown_tables(saved).split("\n\n")[1:]
    page = (root / "docs" / "benchmarks.md").read_text()
    assert len(tables) == 4 and all(t in page for t in tables)
    # The bandwidth target, judged on the card's nominal HBM bandwidth.
    assert check.hbm_gbps("NVIDIA H100 80GB HBM3") == 3350 and check.hbm_gbps("NVIDIA H100 PCIe") == 2000
    assert check.hbm_gbps("NVIDIA H200") == 4800 and check.hbm_gbps("cpu") is None
    rows = [dict(name="fp16", kwargs={}, of_hbm=0.6), dict(name="qsgd", kwargs={}, of_hbm=0.4)]
    parts = {"bandwidth": {"rows": rows}}
    assert check.evaluate(parts)["elementwise bandwidth >= 50 % of HBM"] == dict(met=False, below=["qsgd"])


def test_mpi_inner_step_summary_closed_form():
    """Inner steps are every step but each period's last; times in s, summaries in ms."""
    bench = _load("mpi_inner_step")
    times = [0.001, 0.003, 0.010, 0.002, 0.004, 0.020]  # two periods of 3: the last of each is the sync
    got = bench.summary(times, 3)
    assert got["inner_median_ms"] == pytest.approx(2.5) and got["inner_mean_ms"] == pytest.approx(2.5)
    assert got["last_step_mean_ms"] == pytest.approx(15.0) and got["mean_ms"] == pytest.approx(40 / 6)


@pytest.mark.mpi
def test_mpi_inner_step_benchmark_tiny(tmp_path):
    """mpi_inner_step.py under mpirun -n 2, one round of two 2-step periods of each trainer: rank
    0's JSON holds every rank's summaries of both communicators. Of the 6 steps (2 to compile, 4
    timed) of period 2, the odd ones after the first send nothing and ran the quiet program, which
    carries no JAX effect, where the MPI step's full program carries mpi4jax's ordered one (the
    effect that sends a program through JAX's Python dispatch)."""
    from mpirun import run_mpi

    out = tmp_path / "inner.json"
    run_mpi(2, BENCH / "mpi_inner_step.py", "--every", "2", "--repeats", "1", "--out", str(out), timeout=300)
    saved = json.loads(out.read_text())
    assert saved["procs"] == 2 and saved["every"] == 2 and len(saved["ranks"]) == 2
    for rank in saved["ranks"]:
        for name in ("local", "mpi"):
            s = rank[name]
            assert all(s[k] > 0 for k in ("inner_median_ms", "inner_mean_ms", "last_step_mean_ms"))
            # 4 timed steps of a 2-step period: the mean is the inner and last steps' mean, half each
            assert s["mean_ms"] == pytest.approx((s["inner_mean_ms"] + s["last_step_mean_ms"]) / 2)
            assert s["calls"] == {"full": 4, "quiet": 2} and s["effects"]["quiet"] == []
        assert rank["local"]["effects"]["full"] == [] and rank["mpi"]["effects"]["full"] != []
