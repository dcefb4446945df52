"""The speed benchmarks in experiments/benchmarks/ run end to end in a tiny configuration.

Not timings (those are noise at this size): the scripts' plumbing -- the
registry sweep, the reference, the target bookkeeping, JSON out -- so that
they cannot rot between the runs whose tables are in docs/benchmarks.md.
"""

import importlib.util
import json
from pathlib import Path

import jax
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
    # One compressor of each target group and PowerSGD (1-D sweep and matrix).
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
    assert [r["kwargs"]["matrix_approximation_rank"] for r in saved["powersgd_matrix"]] == [1, 2, 4]
    # Targets are evaluated only at 10 and 100 MB (not measured here), and for the PowerSGD matrix.
    assert sorted(saved["targets"]) == ["powersgd_r1@16x40", "powersgd_r2@16x40", "powersgd_r4@16x40"]
    assert result["targets"] == saved["targets"]
    text = capsys.readouterr().out
    assert "| topk |" in text and "targets:" in text
    bench.main(["--markdown", str(out)])  # the docs' tables, from the JSON
    assert "| rank 4 |" in capsys.readouterr().out


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


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 simulated devices (tests/conftest.py)")
def test_step_overhead_benchmark_tiny(tmp_path):
    bench = _load("step_overhead")
    out = tmp_path / "step.json"
    result = bench.main(
        [
            "--trees",
            "tiny",
            "--compressors",
            "signsgd,topk,topk_floor",
            "--repeats",
            "1",
            "--in-process",
            "--out",
            str(out),
        ]
    )
    saved = json.loads(out.read_text())
    res = saved["trees"]["tiny"]["results"]
    assert set(res) == {"signsgd", "topk", "topk_floor"} and saved["trees"]["tiny"]["num_tensors"] == 3
    # The floor sends exactly what top-k sends (same k, value and index dtypes per tensor).
    assert res["topk_floor"]["wire_bits_per_worker"] == res["topk"]["wire_bits_per_worker"]
    d = saved["trees"]["tiny"]["num_params"]
    for r in res.values():
        assert "error" not in r, r
        assert r["ratio"] > 0 and r["memory"] == "residual"
        assert r["dense_bits_per_worker"] == 32 * d
    assert res["signsgd"]["wire_bits_per_worker"] < d + 32 * 3 + 1  # 1 bit per entry + a scale per tensor
    assert result["trees"] == saved["trees"]
    # --memory grace: GRACE's Table I choice (no error feedback for signSGD, residual for top-k).
    grace = bench.main(
        [
            "--trees",
            "tiny",
            "--compressors",
            "signsgd,topk",
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
    assert res["signsgd"]["memory"] == "none" and res["topk"]["memory"] == "residual"
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
