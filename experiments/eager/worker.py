"""MPI worker of the eager-SGD experiments, one process per rank under ``mpirun``.

``python -m experiments.eager.worker {microbench|hyperplane-modes} DIR`` (started
by :func:`experiments.eager.run.launch_mpi`, or on an emulated link by
:mod:`experiments.eager.quality`) reads ``DIR/config.json``
and the load-imbalance table ``DIR/schedule.npy`` (``[steps, P]`` ms, computed
once by the launcher: the same random stream on all ranks) and writes
``DIR/micro_rank{r}.npz`` or ``DIR/hyper_{mode}_rank{r}.npz``. It needs NumPy, mpi4py
and :class:`jaxcomm.comm.PartialAllreduce`; ``import jaxcomm`` itself imports
no submodule, so the experiments, Flax and Orbax stay out of the workers.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["hyperplane_data", "main"]


def _microbench(cfg: dict, out: Path) -> None:
    """Fig. 8: skew, then time one collective; repeat per collective and iteration."""
    from mpi4py import MPI

    from jaxcomm.comm import PartialAllreduce

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    skew = np.load(out / "schedule.npy")[:, rank] / 1000.0  # seconds, [iterations]
    iters, warmup, count = int(cfg["iterations"]), int(cfg["warmup"]), int(cfg["count"])
    x = np.full(count, float(rank + 1), np.float32)
    y = np.empty_like(x)
    results = {}
    for name in ("mpi_allreduce", "solo", "majority"):
        pa = None
        if name != "mpi_allreduce":
            pa = PartialAllreduce(
                count,
                np.float32,
                mode=name,
                seed=int(cfg["seed"]),
                timeout=float(cfg["timeout_s"]),
                poll_s=float(cfg["poll_s"]),
            )
        lat = np.zeros(iters)
        nap = np.zeros(iters, np.int64)
        included = np.zeros(iters, bool)
        for it in range(warmup + iters):
            comm.Barrier()
            time.sleep(float(skew[it % len(skew)]))
            t0 = time.perf_counter()
            if pa is None:
                comm.Allreduce(x, y, op=MPI.SUM)
                n_active, inc = size, True
            else:
                res = pa(x)
                n_active, inc = res.nap, res.included
            dt = time.perf_counter() - t0
            if it >= warmup:
                lat[it - warmup], nap[it - warmup], included[it - warmup] = dt, n_active, inc
        if pa is not None:
            pa.close()
        results[name] = (lat, nap, included)
    arrays: dict[str, Any] = {
        f"{k}_{f}": v[i] for k, v in results.items() for i, f in enumerate(("latency", "nap", "included"))
    }
    np.savez(out / f"micro_rank{rank}.npz", **arrays)


def hyperplane_data(seed: int, rows: int, features: int, noise: float, stream: int):
    """``(x, y)`` rows of the hyperplane ``y = x . w* + noise`` (float32), deterministic per stream."""
    w_star = np.random.default_rng([seed, 0]).standard_normal(features, dtype=np.float32)
    rng = np.random.default_rng([seed, 1, stream])
    x = rng.standard_normal((rows, features), dtype=np.float32)
    y = x @ w_star + noise * rng.standard_normal(rows, dtype=np.float32)
    return x, y.astype(np.float32)


def _hyperplane(cfg: dict, out: Path, name: str) -> None:
    """Sec. 7.2.1: one-layer linear model, local batch B/P, sleep-emulated compute + injected delay.

    Writes ``out/{name}_rank{r}.npz``: the model after every ``steps_per_epoch /
    snapshots_per_epoch`` steps (``snaps``, ``snap_steps``, ``times`` in s from the start
    barrier), per step NAP and whether this process's gradient was fresh, the total time, the
    undelivered gradient and the final model. With ``count_link`` (the job runs on an emulated
    link, :func:`jaxcomm.netem.launch`) rank 0 also saves the link's counters over the training
    (:func:`jaxcomm.netem.measure_window`: ``link_bytes``, ``link_packets``, ``link_drops``,
    ``link_retransmitted``).

    Long because the training loop is a closure over this process's data, model and collective,
    run whole inside the link's measurement window.
    """
    from mpi4py import MPI

    from jaxcomm.comm import PartialAllreduce

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    mode = cfg["mode"]
    delays = (np.load(out / "schedule.npy")[:, rank] / 1000.0).astype(float)  # [steps] seconds
    d, b = int(cfg["features"]), int(cfg["batch_total"]) // size
    shard_rows = int(cfg["train_points"]) // size
    x, y = hyperplane_data(int(cfg["seed"]), shard_rows, d, float(cfg["noise_std"]), stream=2 + rank)
    steps_per_epoch = shard_rows // b
    snap_every = steps_per_epoch // int(cfg.get("snapshots_per_epoch", 1))
    epochs = int(cfg["epochs"])
    lr, base = float(cfg["lr"]), float(cfg["base_compute_ms"]) / 1000.0
    w = np.zeros(d + 1, np.float32)  # weights and bias (the paper's 8,193 parameters)
    grad = np.zeros(d + 1, np.float32)
    pa = PartialAllreduce(
        d + 1,
        np.float32,
        mode=mode,
        seed=int(cfg["seed"]),
        timeout=float(cfg["timeout_s"]),
        poll_s=float(cfg["poll_s"]),
    )
    snaps, snap_steps, times, nap, included = [], [], [], [], []
    total = [0.0]

    def train() -> None:
        t_start = time.perf_counter()
        step = 0
        for epoch in range(epochs):
            order = np.random.default_rng([int(cfg["seed"]), 3, rank, epoch]).permutation(shard_rows)
            for s in range(steps_per_epoch):
                t0 = time.perf_counter()
                idx = order[s * b : (s + 1) * b]
                xb, yb = x[idx], y[idx]
                err = xb @ w[:d] + w[d] - yb  # d(1/2 mean err^2)/dw
                grad[:d] = xb.T @ err / b
                grad[d] = err.mean()
                target = base + float(delays[step])  # emulated accelerator time plus the injected delay
                left = target - (time.perf_counter() - t0)
                if left > 0:
                    time.sleep(left)
                res = pa(grad)
                w[:] -= lr * res.data / size  # Algorithm 2: G = partial_allreduce(G_local) / P
                nap.append(res.nap)
                included.append(res.included)
                step += 1
                if (s + 1) % snap_every == 0:
                    times.append(time.perf_counter() - t_start)
                    snaps.append(w.copy())
                    snap_steps.append(step)
        total[0] = time.perf_counter() - t_start
        pa.close()

    link = {}
    if cfg.get("count_link"):
        from jaxcomm.netem import measure_window

        window = measure_window(train, comm)
        if window is not None:
            link = {f"link_{k}": getattr(window, k) for k in ("bytes", "packets", "drops", "retransmitted")}
    else:
        comm.Barrier()
        train()
    np.savez(
        out / f"{name}_rank{rank}.npz",
        snaps=np.array(snaps),
        snap_steps=np.array(snap_steps),
        times=np.array(times),
        nap=np.array(nap),
        included=np.array(included),
        total=total[0],
        leftover=pa.leftover(),
        final=w,
        **link,
    )


def _hyperplane_modes(cfg: dict, out: Path) -> None:
    """:func:`_hyperplane` once per mode of ``cfg["modes"]`` in turn, on the same data and delay
    table (one job per delay table, not one per mode): ``out/hyper_{mode}_rank{r}.npz``."""
    for mode in cfg["modes"]:
        _hyperplane({**cfg, "mode": mode}, out, name=f"hyper_{mode}")


_KINDS = {"microbench": _microbench, "hyperplane-modes": _hyperplane_modes}


def main(argv: list[str]) -> None:
    """``argv = [KIND, DIR]``: run the ``KIND`` worker on ``DIR/config.json`` and ``DIR/schedule.npy``."""
    if len(argv) != 2 or argv[0] not in _KINDS:
        raise SystemExit(
            "usage: python -m experiments.eager.worker {microbench|hyperplane-modes} DIR "
            f"(launched under mpirun by jaxcomm run eager-*); got {argv}"
        )
    kind, out = argv[0], Path(argv[1])
    cfg = json.loads((out / "config.json").read_text())
    _KINDS[kind](cfg, out)


if __name__ == "__main__":
    main(sys.argv[1:])
