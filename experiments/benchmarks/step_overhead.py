"""Step overhead of compressed communication: a jitted data-parallel step on 8 simulated devices.

For a ResNet-20-shaped parameter tree (CIFAR ResNet-20: 19 conv kernels, 19
BatchNorm scales and biases, the classifier; 269,722 parameters in 59 tensors)
and a VGG16-shaped one (CIFAR VGG16: 13 conv kernels and biases, two dense
layers; 14,982,474 parameters in 30 tensors), and for every registered
compressor, this times one jitted step

    g_i = a_i ⊙ x_i   (a per-worker elementwise stand-in for back-propagation)
    ḡ  = compressed_mean(compressor, axis_name="data", memory=...)(g_i)
    x_i ← x_i − 0.01 ḡ

inside ``jax.shard_map`` over 8 simulated CPU devices, and reports
``ratio = median step time with the compressor / median step time with none()``
and the exact wire bits one worker sends per step (``state.wire_bits``).
With ``--memory residual`` (the default) every compressor runs with
``memory.residual()`` (GRACE's error feedback, as in ``compressed_mean(c,
"data", memory=jaxcomm.memory.residual())``); with ``--memory grace`` each runs
with the memory of GRACE's own experiments (Table I, column "EF-On"): none for
signSGD, SIGNUM, QSGD, TernGrad and INCEPTIONN, whose convergence GRACE found
error feedback to harm (Sec. V), residual for the others. The baseline is
``none()`` with ``memory.none()``: the plain uncompressed mean (one all-reduce
per tensor), so the ratio includes the memory's own passes. Each compressor is timed
interleaved with the ``none()`` baseline (none, c, none, c, ...) so drifts in
machine load hit both alike; the ratio is median(c) / median(none) (``--repeats``
pairs, fewer -- at least 3 -- for compressors slower than 120 s per ``--repeats``
steps; the count used is recorded). Every
(tree, compressor) pair runs in its own subprocess (``--in-process`` turns this
off), so a compiler crash in one compressor is recorded as an error instead of
ending the run. ``--trees tiny`` (three small tensors) is the smoke
configuration the test suite runs. The shard_map is
built with ``check_vma=False`` by default (``--check-vma`` turns jax's
trace-time varying-axes type check on): the check changes no compiled
operation, and a compressor whose code fails it is still timed.

The step has no model compute, so the ratios are an upper bound of the overhead
a training step would see (a forward/backward pass only adds to both times).
``--batch B`` measures that training step instead (GRACE measures training
throughput, Sec. V-A): ``g_i`` is the gradient of the tree's own network --
CIFAR VGG16 for ``vgg16`` (13 ReLU convs, five 2x2 max-pools, two dense
layers, no BatchNorm), a 3-conv VGG on 8x8 images for ``vgg_tiny``, the
smoke configuration -- on ``B`` random CIFAR-shaped images per worker. On 2
CPU cores that compute is slow (VGG16, B = 32: about 36 s a step), so such
ratios say little about an accelerator, where the compute is far faster
relative to memory passes; the compute-free ratio is the figure to improve.
``compressed_mean`` packs the payloads of up to 1 MiB of all tensors into one
all-gather by default (``fuse=True``); ``--no-fuse`` measures one all-gather per
tensor and payload field.
Target: sign, 1-bit, QSGD and top-k at most 1.3x the
uncompressed step on the VGG16-shaped tree.

``--compressors topk_floor`` (not a registered compressor, never in the
default sweep; likewise ``qsgd_floor``, see :func:`qsgd_floor`) measures a
lower bound for top-k: the same pipeline as
``topk`` -- ``k = 1%`` values in float32 and int32 indices per tensor, the
same all-gather, :func:`~jaxcomm.compressors._kernels.scatter.sum_scatter` of the
``n k`` received entries, the in-place error ``phi - sent`` -- but with the
selection replaced by fixed, evenly spaced positions that cost nothing to
find. Any exact top-k with error feedback does at least this work, so its
ratio bounds what a faster selection could reach.

``--devices N`` sets the number of workers (one device each; default 8). On
one GPU (``JAX_PLATFORMS=cuda ... --devices 1 --batch B``) the collectives
move nothing, so the ratio is the compressor's and memory's compute beside the
network's forward/backward pass on that accelerator.

usage: python experiments/benchmarks/step_overhead.py [--repeats 7] [--trees resnet20,vgg16]
       [--compressors topk,qsgd,topk_floor,...] [--memory residual|grace] [--batch 0] [--no-fuse]
       [--check-vma] [--in-process] [--devices 8] [--out experiments/benchmarks/results/step_overhead.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm as jc
from jaxcomm import memory as mem
from jaxcomm.transforms import compressed_mean

DEVICES = 8  # workers by default: simulated CPU devices (XLA_FLAGS above)

# Hyper-parameters for the benchmark (1% density for sparsifiers, GRACE's usual setting).
KWARGS = {
    "topk": dict(ratio=0.01),
    "randomk": dict(ratio=0.01),
    "dgc": dict(ratio=0.01),
    "adaptive": dict(ratio=0.01),
    "qsparse": dict(ratio=0.01, levels=64),
    "threshold": dict(v=2.576),  # |N(0,1)| >= 2.576: about 1% of entries (gradients are ~N(0,1) here)
    "random_sparsification": dict(p=0.01),
    "powersgd": dict(matrix_approximation_rank=4),
    "qsgd": dict(levels=64),
}
# The compressors the 1.3x target names: sign (signsgd, signum, efsignsgd, scaled_sign), 1-bit, QSGD, top-k.
TARGET_NAMES = ("signsgd", "signum", "efsignsgd", "scaled_sign", "onebit", "qsgd", "topk")
TARGET_RATIO = 1.3
# GRACE Table I, column "EF-On": the compressors GRACE ran *without* error feedback
# (Sec. V: "EF harms the convergence of several quantization methods (SignSGD,
# SIGNUM, QSGD and Terngrad)"; INCEPTIONN is also marked off). All others: residual.
GRACE_NO_MEMORY = ("signsgd", "signum", "qsgd", "terngrad", "inceptionn")
MEMORIES = ("residual", "grace")
TIME_BUDGET_S = 120.0  # per compressor and tree: timed compressed steps beyond 3 pairs stop here


def resnet20_shapes(num_classes: int = 10, in_channels: int = 3):
    """CIFAR ResNet-20 (He et al. 2016, option-A shortcuts): conv kernels HWIO, BN scale/bias, dense."""
    shapes = {"conv0": (3, 3, in_channels, 16), "bn0_scale": (16,), "bn0_bias": (16,)}
    c_in = 16
    for stage, c in enumerate((16, 32, 64)):
        for block in range(3):
            for j in range(2):
                name = f"s{stage}b{block}c{j}"
                shapes[name] = (3, 3, c_in, c)
                shapes[name + "_bn_scale"] = (c,)
                shapes[name + "_bn_bias"] = (c,)
                c_in = c
    shapes["dense_kernel"] = (64, num_classes)
    shapes["dense_bias"] = (num_classes,)
    return shapes


VGG16_CONVS = (64, 64, 128, 128, 256, 256, 256, 512, 512, 512, 512, 512, 512)
VGG16_POOL_AFTER = (1, 3, 6, 9, 12)  # 2x2 max-pool after these convs: 32x32 -> 1x1
VGG_TINY_CONVS, VGG_TINY_POOL_AFTER = (8, 16, 16), (0, 2)  # 8x8 -> 2x2: the --batch smoke configuration


def vgg_shapes(convs, width: int, num_classes: int = 10, in_channels: int = 3):
    """A VGG: 3x3 conv kernels (HWIO) and biases for ``convs``, then ``width -> width -> num_classes`` dense."""
    shapes, c_in = {}, in_channels
    for i, c in enumerate(convs):
        shapes[f"conv{i:02d}_kernel"] = (3, 3, c_in, c)
        shapes[f"conv{i:02d}_bias"] = (c,)
        c_in = c
    shapes["fc0_kernel"], shapes["fc0_bias"] = (width, width), (width,)
    shapes["fc1_kernel"], shapes["fc1_bias"] = (width, num_classes), (num_classes,)
    return shapes


def vgg16_shapes(num_classes: int = 10, in_channels: int = 3):
    """CIFAR VGG16 (Simonyan & Zisserman 2015, configuration D, 32x32 input): 13 convs, 2 dense layers."""
    return vgg_shapes(VGG16_CONVS, 512, num_classes, in_channels)


def vgg_tiny_shapes():
    """A 3-conv VGG on 8x8 images (6,554 parameters): the smoke configuration of ``--batch``."""
    return vgg_shapes(VGG_TINY_CONVS, 64)


def vgg_loss(params, images, labels, pool_after):
    """Mean softmax cross-entropy of a VGG (ReLU after every conv and the first dense layer; no BatchNorm).

    ``images``: ``(B, H, W, 3)`` float32; ``labels``: ``(B,)`` int32 class indices;
    ``pool_after``: indices of the convs followed by a 2x2 max-pool (the spatial size
    after the last pool times the last conv's channels must equal ``fc0``'s fan-in).
    """
    h = images
    for i in range(sum(1 for k in params if k.endswith("_kernel") and k.startswith("conv"))):
        h = jax.lax.conv_general_dilated(
            h, params[f"conv{i:02d}_kernel"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
        h = jax.nn.relu(h + params[f"conv{i:02d}_bias"])
        if i in pool_after:
            h = jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    h = h.reshape(h.shape[0], -1)
    h = jax.nn.relu(h @ params["fc0_kernel"] + params["fc0_bias"])
    logits = h @ params["fc1_kernel"] + params["fc1_bias"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))


def tiny_shapes():
    """Three small tensors: the smoke configuration of the test suite (not a model)."""
    return {"kernel": (3, 3, 4, 8), "bias": (8,), "dense": (16, 300)}


TREES = {"resnet20": resnet20_shapes, "vgg16": vgg16_shapes, "tiny": tiny_shapes, "vgg_tiny": vgg_tiny_shapes}
# --batch B > 0: the trees with a network, as (input height/width, pool_after).
MODELS = {"vgg16": (32, VGG16_POOL_AFTER), "vgg_tiny": (8, VGG_TINY_POOL_AFTER)}


def topk_floor(ratio: float = 0.01):
    """Top-k's pipeline without the selection: ``k = max(1, round(ratio d))`` fixed positions
    ``0, s, 2s, ...`` (``s = d // k``) per tensor, otherwise exactly :func:`jaxcomm.compressors.topk`.

    Same :class:`~jaxcomm.compressors._sparse.SparsePayload` (``k`` values in the input dtype and
    :func:`~jaxcomm.compressors.index_dtype` indices, so the same wire bits), same
    ``decompress_sum`` (one scatter-add of all ``n k`` entries) and ``compression_error``
    (``x - decompress(payload)`` in place) hooks. Not a compressor anyone should train
    with (it ignores the gradient's magnitudes): the benchmark's lower bound for top-k.
    """
    from jaxcomm.compressors import _sparse as sp

    def compress(x, key, state):
        d = int(np.size(x))
        k = sp.num_selected(ratio, d)
        idx = jnp.arange(k, dtype=jnp.int32) * (d // max(k, 1))
        vals, idx = sp._sparse_payload(x, idx)
        return sp.SparsePayload(values=vals, indices=idx, shape=tuple(np.shape(x)), dtype=x.dtype), state

    return sp.sparse_compressor("topk_floor", compress, sp.sparse_hooks(), seed=0, params=dict(ratio=ratio))


def qsgd_floor(levels: int = 64):
    """QSGD's payload, communication and decoder with the cheapest encoder that reads ``x``:
    code ``s + sign(x_i)`` (levels 0 and 1), norm 1 -- no norm pass, no random numbers.

    Same :class:`~jaxcomm.compressors._stochastic.QSGDPayload` (``ceil(log2(2s+1))``-bit codes and a
    float32 norm, so the same wire bits) and the same ``decompress`` as
    :func:`jaxcomm.compressors.qsgd`, which ``compressed_mean`` runs on all ``n`` gathered
    payloads. The benchmark's lower bound for QSGD under the all-gather strategy.
    """
    from jaxcomm.compressors import _stochastic as qz

    q = jc.compressors.qsgd(levels=levels)
    width = qz.code_width(2 * levels + 1)

    def compress(x, key, state):
        code = (levels + jnp.sign(jnp.ravel(x))).astype(jnp.int32)
        payload = qz.QSGDPayload(
            codes=qz.pack_codes(code, width), norm=jnp.float32(1.0), levels=levels, shape=x.shape, dtype=x.dtype
        )
        return payload, state

    return jc.compressors.Compressor(
        name="qsgd_floor",
        compress_fn=compress,
        decompress_fn=q.decompress,
        unbiased=False,
        strategy="allgather",
        params=dict(levels=levels),
    )


def topk_reuse(ratio: float = 0.01):
    """:func:`jaxcomm.compressors.topk` with ``reuse_threshold=True`` (the same payloads; the
    selection tries the threshold carried from the previous step first)."""
    return jc.compressors.topk(ratio=ratio, reuse_threshold=True)


# Benchmark-only rows, timed like compressors but not in the registry (nor in the default sweep).
# Each maps to (factory, the registered compressor whose hyper-parameters and memory it takes).
PSEUDO = {
    "topk_floor": (topk_floor, "topk"),
    "qsgd_floor": (qsgd_floor, "qsgd"),
    "topk_reuse": (topk_reuse, "topk"),
}


def compressor_of(name: str) -> str:
    """The registered compressor a row stands for: itself, or a :data:`PSEUDO` row's compressor."""
    return PSEUDO[name][1] if name in PSEUDO else name


def make_compressor(name: str):
    """A registered compressor with the benchmark's hyper-parameters (:data:`KWARGS`), or a :data:`PSEUDO`
    row with its compressor's (``topk_floor`` with top-k's ratio, ``qsgd_floor`` with QSGD's levels)."""
    if name in PSEUDO:
        return PSEUDO[name][0](**KWARGS.get(compressor_of(name), {}))
    return jc.compressors.make(name, **KWARGS.get(name, {}))


def memory_for(name: str, memory: str = "residual"):
    """The memory a compressor runs with: ``none()`` for the baseline, for unbiased
    compressors (error feedback refuses those whose variance factor is ω ≥ 1) and,
    under ``memory="grace"``, for :data:`GRACE_NO_MEMORY`; else ``residual()`` (accepting the
    compressors that declare no contraction, signsgd and signum: this times the step, whatever the
    memory does to training)."""
    if memory not in MEMORIES:
        raise ValueError(f"memory must be one of {MEMORIES}; got {memory!r}")
    name = compressor_of(name)  # a floor row runs with its compressor's memory
    c = make_compressor(name)
    if name == "none" or (memory == "grace" and name in GRACE_NO_MEMORY) or c.unbiased:
        return mem.none()
    return mem.residual(needs_contraction=not c.no_contraction)


def build_step(
    compressor, n: int, mesh, check_vma: bool = False, memory: str = "residual", pool_after=None, fuse: bool = True
):
    """The jitted step ``(inputs, x, state) -> (x, state)`` over the mesh's ``"data"`` axis.

    ``pool_after=None``: ``inputs = (a,)`` and ``g = a * x`` (no model compute);
    else ``inputs = (images, labels)`` and ``g`` is the gradient of :func:`vgg_loss`.
    """
    memory = memory_for(compressor.name, memory)
    tx = compressed_mean(compressor, "data", memory=memory, fuse=fuse)

    def worker(inputs, x, state):
        inputs, x, state = jax.tree.map(lambda v: v[0], (inputs, x, state))
        if pool_after is None:
            g = jax.tree.map(lambda p, s: p * s, x, inputs[0])
        else:
            g = jax.grad(vgg_loss)(x, *inputs, pool_after)
        u, state = tx.update(g, state, x)
        x = jax.tree.map(lambda p, d: p - 0.01 * d, x, u)
        return jax.tree.map(lambda v: v[None], (x, state))

    f = jax.shard_map(worker, mesh=mesh, in_specs=(P("data"),) * 3, out_specs=P("data"), check_vma=check_vma)
    return tx, memory, jax.jit(f, donate_argnums=(1, 2))


class Runner:
    """Holds one compressor's compiled step and its (donated) buffers."""

    def __init__(
        self, compressor, shapes, n, mesh, check_vma=False, seed=0, memory="residual", batch=0, model=None, fuse=True
    ):
        pool_after = None if not batch else MODELS[model][1]
        self.tx, self.memory, self.step = build_step(compressor, n, mesh, check_vma, memory, pool_after, fuse)
        put = lambda t: jax.device_put(t, NamedSharding(mesh, P("data")))
        rng = np.random.default_rng(seed)
        if not batch:
            params = {k: (rng.standard_normal(s) * 0.05).astype(np.float32) for k, s in shapes.items()}
            # a_i ~ N(0, 1)/0.05 per worker and entry: gradients ~ N(0, 1), distinct per worker.
            self.inputs = put(
                ({k: (rng.standard_normal((n, *s)) / 0.05).astype(np.float32) for k, s in shapes.items()},)
            )
        else:
            # He initialisation (kernels N(0, 2 / fan_in), zero biases), so 13 ReLU layers stay finite;
            # per worker a batch of N(0, 1) CIFAR-shaped images with random labels (the cost of a
            # step does not depend on the pixel values).
            params = {
                k: ((rng.standard_normal(s) * np.sqrt(2.0 / np.prod(s[:-1]))) if len(s) > 1 else np.zeros(s)).astype(
                    np.float32
                )
                for k, s in shapes.items()
            }
            hw = MODELS[model][0]
            self.inputs = put(
                (
                    rng.standard_normal((n, batch, hw, hw, 3)).astype(np.float32),
                    rng.integers(0, 10, (n, batch)).astype(np.int32),
                )
            )
        stack = lambda t: jax.tree.map(lambda v: np.broadcast_to(np.asarray(v), (n, *np.shape(v))).copy(), t)
        self.x = put(stack(params))
        self.state = put(stack(self.tx.init(params)))
        t0 = time.perf_counter()
        self.call()  # compile + first run
        self.compile_s = time.perf_counter() - t0
        self.call()

    def call(self) -> float:
        t0 = time.perf_counter()
        self.x, self.state = self.step(self.inputs, self.x, self.state)
        jax.block_until_ready((self.x, self.state))
        return time.perf_counter() - t0

    def wire_bits(self) -> int:
        return int(np.asarray(self.state.wire_bits[0], np.int64).sum())


def measure(
    tree: str,
    name: str,
    repeats: int,
    check_vma: bool,
    memory: str = "residual",
    batch: int = 0,
    fuse: bool = True,
    n: int = DEVICES,
) -> dict:
    """Time one compressor against none() on one tree (in this process) on ``n`` workers (one device
    each); ``batch > 0``: with the tree's network's forward/backward pass on ``batch`` images per worker."""
    devices = jax.devices()
    if len(devices) < n:
        raise SystemExit(f"need {n} devices (XLA_FLAGS=--xla_force_host_platform_device_count={n})")
    mesh = Mesh(np.array(devices[:n]), ("data",))
    shapes = TREES[tree]()
    c = make_compressor(name)
    base = Runner(jc.compressors.none(), shapes, n, mesh, check_vma, batch=batch, model=tree, fuse=fuse)
    runner = Runner(c, shapes, n, mesh, check_vma, memory=memory, batch=batch, model=tree, fuse=fuse)
    t_base, t_c = [base.call()], [runner.call()]
    requested = repeats
    # Slow compressors (seconds per step on the large tree) get fewer pairs, at least 3:
    # about TIME_BUDGET_S of timed compressed steps each.
    repeats = max(1, min(repeats, max(3, int(TIME_BUDGET_S / max(t_c[0], 1e-9)))))
    for _ in range(repeats - 1):
        t_base.append(base.call())
        t_c.append(runner.call())
    med_b, med_c = float(np.median(t_base)), float(np.median(t_c))
    bits, dense_bits = runner.wire_bits(), base.wire_bits()
    return {
        "ratio": med_c / med_b,
        "paired_ratio": float(np.median(np.asarray(t_c) / np.asarray(t_base))),
        "step_ms": 1e3 * med_c,
        "baseline_step_ms": 1e3 * med_b,
        "wire_bits_per_worker": bits,
        "dense_bits_per_worker": dense_bits,
        "compression": dense_bits / bits,
        "strategy": c.strategy + (" (rounds)" if c.rounds is not None else ""),
        "memory": runner.memory.name,
        "params": c.params,
        "compile_s": runner.compile_s,
        "repeats": repeats,
        "repeats_requested": requested,
        "steps_ms": [1e3 * v for v in t_c],
        "baseline_steps_ms": [1e3 * v for v in t_base],
    }


def paired_ratio(r: dict):
    """Median over the interleaved pairs of (compressed step / the none() step timed beside it), or None."""
    c, b = r.get("steps_ms"), r.get("baseline_steps_ms")
    if not c or not b or len(c) != len(b):
        return None
    return float(np.median(np.asarray(c) / np.asarray(b)))


def markdown_table(out: dict) -> str:
    """The results as a Markdown table: one row per compressor, ratio and wire bits per tree."""
    trees = list(out["trees"])
    names = sorted({n for t in trees for n in out["trees"][t]["results"]})
    head = (
        "| compressor | strategy | memory | "
        + " | ".join(f"{t}: step / none() (paired) | {t}: Mbit/worker/step (x smaller)" for t in trees)
        + " |"
    )
    rows = [head, "|" + "---|" * (3 + 2 * len(trees))]
    for name in names:
        cells, meta = [], None
        for t in trees:
            r = out["trees"][t]["results"].get(name)
            if r is None or "error" in r:
                cells += ["failed" if r else "not measured", ""]
                continue
            meta = meta or r
            mark = " **>1.3**" if t == "vgg16" and name in TARGET_NAMES and r["ratio"] > TARGET_RATIO else ""
            paired = paired_ratio(r)
            paired = f" ({paired:.2f}x)" if paired is not None else ""
            cells += [
                f"{r['ratio']:.2f}x{paired}{mark}",
                f"{r['wire_bits_per_worker'] / 1e6:.3f} (x{r['compression']:.1f})",
            ]
        strategy = meta["strategy"] if meta else ""
        memory = meta["memory"] if meta else ""
        rows.append(f"| {name} | {strategy} | {memory} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def save(out: dict, path) -> Path:
    """Write ``out`` as JSON (with the load average now) to ``path``."""
    out["meta"]["load_average_at_end"] = list(os.getloadavg())
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2, default=str) + "\n")
    return path


def run_one(
    tree: str,
    name: str,
    repeats: int,
    check_vma: bool,
    in_process: bool,
    memory: str = "residual",
    batch: int = 0,
    fuse: bool = True,
    n: int = DEVICES,
) -> dict:
    """One (tree, compressor) measurement, in a subprocess unless ``in_process``; a failure becomes an error row."""
    if in_process:
        try:
            return measure(tree, name, repeats, check_vma, memory, batch, fuse, n)
        except Exception as e:  # record and go on
            return {"error": f"{type(e).__name__}: {str(e)[:400]}"}
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--one",
        tree,
        name,
        "--repeats",
        str(repeats),
        "--memory",
        memory,
        "--batch",
        str(batch),
    ]
    cmd += [] if fuse else ["--no-fuse"]
    cmd += ["--check-vma"] if check_vma else []
    cmd += ["--devices", str(n)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        why = next((ln for ln in err if "Check failed" in ln or "Error" in ln), err[-1] if err else "")
        return {"error": f"exit {proc.returncode}: {why.strip()[:400]}"}
    return json.loads(line[len("RESULT ") :])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--trees", default="resnet20,vgg16")
    ap.add_argument("--compressors", default="", help="comma-separated names (default: every registered one)")
    ap.add_argument(
        "--memory",
        choices=MEMORIES,
        default="residual",
        help="residual for every compressor, or GRACE's Table I choice (none for signsgd, signum, "
        "qsgd, terngrad, inceptionn)",
    )
    ap.add_argument(
        "--batch",
        type=int,
        default=0,
        help="images per worker for a real forward/backward pass of the tree's network "
        f"(trees {', '.join(MODELS)}); 0 (default): g = a * x, no model compute",
    )
    ap.add_argument(
        "--no-fuse",
        action="store_true",
        help="compressed_mean(fuse=False): one all-gather per tensor instead of one per step",
    )
    ap.add_argument("--check-vma", action="store_true", help="build the shard_map with check_vma=True")
    ap.add_argument(
        "--devices",
        type=int,
        default=DEVICES,
        help=f"workers, one device each (default {DEVICES} simulated CPU devices; 1 on a single GPU "
        "with JAX_PLATFORMS=cuda: the compressor's compute beside the model's, no communication)",
    )
    ap.add_argument("--in-process", action="store_true", help="no subprocess per (tree, compressor)")
    ap.add_argument("--markdown", metavar="JSON", help="print the table of a results file and exit")
    ap.add_argument("--one", nargs=2, metavar=("TREE", "NAME"), help=argparse.SUPPRESS)
    ap.add_argument("--out", default="experiments/benchmarks/results/step_overhead.json")
    args = ap.parse_args(argv)
    if args.markdown:
        print(markdown_table(json.loads(Path(args.markdown).read_text())))
        return {}
    if args.one:  # child process: one measurement, one JSON line
        r = measure(*args.one, args.repeats, args.check_vma, args.memory, args.batch, not args.no_fuse, args.devices)
        print("RESULT " + json.dumps(r, default=str), flush=True)
        return r
    names = [c for c in args.compressors.split(",") if c] or [c for c in jc.compressors.names() if c != "none"]
    unknown = [c for c in names if c not in jc.compressors.names() and c not in PSEUDO]
    trees = [t for t in args.trees.split(",") if t]
    if unknown or set(trees) - set(TREES):
        ap.error(f"unknown compressor(s) {unknown} or tree(s) {sorted(set(trees) - set(TREES))}")
    if args.devices < 1:
        ap.error(f"--devices must be >= 1; got {args.devices}")
    if args.batch < 0:
        ap.error(f"--batch must be >= 0; got {args.batch}")
    if args.batch and set(trees) - set(MODELS):
        ap.error(f"--batch needs a tree with a network ({', '.join(MODELS)}); got {', '.join(trees)}")
    n = args.devices
    out = {
        "meta": {
            "benchmark": "step_overhead",
            "devices": f"{n} of {[str(d) for d in jax.devices()][:n]}",
            "host_cpus": os.cpu_count(),
            "load_average_at_start": list(os.getloadavg()),
            "platform": platform.platform(),
            "jax": jax.__version__,
            "repeats": args.repeats,
            "check_vma": args.check_vma,
            "timing": "median of --repeats steps per compressor, interleaved with the none() baseline, "
            + ("in one process" if args.in_process else "one subprocess per (tree, compressor)"),
            "memory": (
                "residual() for every compressor"
                if args.memory == "residual"
                else f"GRACE Table I: none() for {', '.join(GRACE_NO_MEMORY)}, residual() for the others"
            )
            + "; none() baseline with memory none()",
            "complete": False,
            "command": " ".join(["python", "experiments/benchmarks/step_overhead.py", *(argv or sys.argv[1:])]),
            "step": (
                "g_i = a_i * x_i; compressed_mean over 'data'; x_i -= 0.01 * mean (no model compute)"
                if not args.batch
                else f"g_i = grad of the tree's VGG's cross-entropy on {args.batch} images per worker; "
                "compressed_mean over 'data'; x_i -= 0.01 * mean"
            ),
            "batch_per_worker": args.batch,
            "fuse": not args.no_fuse,
            "target": f"{'/'.join(TARGET_NAMES)} <= {TARGET_RATIO}x none() on vgg16",
        },
        "trees": {},
    }
    for tree in trees:
        shapes = TREES[tree]()
        num_params = int(sum(np.prod(s) for s in shapes.values()))
        print(f"== {tree}: {num_params:,} parameters in {len(shapes)} tensors", flush=True)
        results = {}
        out["trees"][tree] = {"num_params": num_params, "num_tensors": len(shapes), "results": results}
        for name in names:
            r = run_one(
                tree,
                name,
                args.repeats,
                args.check_vma,
                args.in_process,
                args.memory,
                args.batch,
                not args.no_fuse,
                args.devices,
            )
            results[name] = r
            save(out, args.out)  # after every measurement: an interrupted run keeps what it measured
            if "error" in r:
                print(f"   {name:22s} FAILED: {r['error'][:160]}", flush=True)
                continue
            print(
                f"   {name:22s} {r['ratio']:6.2f}x  {r['step_ms']:9.1f} ms (none {r['baseline_step_ms']:8.1f} ms)  "
                f"{r['wire_bits_per_worker']:>12,d} bits  x{r['compression']:7.1f}",
                flush=True,
            )
    if "vgg16" in out["trees"]:
        res = out["trees"]["vgg16"]["results"]
        out["target_met"] = {k: res[k].get("ratio", float("inf")) <= TARGET_RATIO for k in TARGET_NAMES if k in res}
    out["meta"]["complete"] = True
    path = save(out, args.out)
    print(markdown_table(out))
    for k, met in out.get("target_met", {}).items():
        print(
            f"target {k}@vgg16: {res[k].get('ratio', float('nan')):.2f}x {'met' if met else 'MISSED'} "
            f"(<= {TARGET_RATIO}x)"
        )
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
