"""The checks every compressing transformation shares, run when it is built or traced: the
compressor, the memory, the strategy and its collectives, and a gradient that is really per worker."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import memory as memory_lib
from .._validate import check_bool, check_choice
from .._vma import varying_axes
from ..comm import require
from ..compressors import Compressor
from ._strategies import STRATEGIES, TABLE

__all__ = [
    "check_compressor",
    "check_feedback",
    "check_memory",
    "check_per_worker",
    "check_served",
    "check_skip_nonfinite",
    "check_stateless",
    "choose_strategy",
    "sums_in_16_bits",
]


def check_compressor(compressor, name: str = "compressor", *, dense_warmup: bool = False) -> Compressor:
    """``compressor`` if it is a :class:`Compressor`; a transform that does not run a dense
    warm-up (``dense_warmup=False``) refuses one that asks for it."""
    if not isinstance(compressor, Compressor):
        raise TypeError(
            f"{name} must be a jaxcomm.compressors.Compressor (e.g. jaxcomm.compressors.topk(ratio=0.01)); "
            f"got {type(compressor).__name__}"
        )
    if compressor.dense_warmup and not dense_warmup:
        raise ValueError(
            f"{name} {compressor!r} asks for {compressor.dense_warmup} dense warm-up steps (dense_warmup / "
            "start_powerSGD_iter), which only jaxcomm.compressed_mean runs; build it without them here"
        )
    return compressor


def check_feedback(compressor: Compressor, memory: memory_lib.Memory, sizes) -> None:
    """Refuse error feedback around a compressor that is not a contraction: an unbiased one whose
    variance factor is ``ω ≥ 1``, or one that declares ``no_contraction``.

    With a memory that needs a contraction (``memory.needs_contraction``: every memory that
    feeds the error back, unless built to accept any compressor), the error ``e' = v − Q(v)``
    of an unbiased compressor has ``E‖e'‖² = ω ‖v‖²`` (random sparsification: exactly), so
    once the memory dominates ``v = g + e`` it grows by a factor ``ω`` per step; a compressor
    with no contraction has no such factor at all. ``sizes`` are the entries of each compressed
    tensor.

    Raises:
      ValueError: naming the compressor, why it is not a contraction (``ω`` and the tensor
        size, or its ``no_contraction`` reason) and the fix
        (:func:`jaxcomm.compressors.contractive`, a scaled variant, or no memory).
    """
    if not memory.needs_contraction:
        return
    if compressor.no_contraction:
        raise ValueError(
            f"error feedback ({memory!r}) needs a contraction, E‖Q(x) − x‖² ≤ (1 − δ)‖x‖², but {compressor!r} "
            f"declares none: {compressor.no_contraction}. Use a compressor that scales its output into a "
            "contraction, or no memory (memory=jaxcomm.memory.none()); to measure error feedback on it anyway, "
            "jaxcomm.memory.residual(needs_contraction=False)"
        )
    if compressor.variance_factor is None:
        return
    for d in sizes:
        omega = compressor.omega(d)
        if omega is not None and omega >= 1.0:
            raise ValueError(
                f"error feedback ({memory!r}) needs a contraction, E‖Q(x) − x‖² ≤ (1 − δ)‖x‖² with δ > 0, but "
                f"{compressor!r} is unbiased with variance factor ω = {omega:.4g} ≥ 1 on a tensor of {d} entries "
                f"({compressor.bound}); its memory would grow by a factor ω per step. Use "
                f"jaxcomm.compressors.contractive({compressor!r}), which scales it by 1/(1 + ω), or no memory"
            )


def check_memory(memory, name: str = "memory") -> memory_lib.Memory:
    if not isinstance(memory, memory_lib.Memory):
        raise TypeError(
            f"{name} must be a jaxcomm.memory.Memory (e.g. jaxcomm.memory.residual()); got {type(memory).__name__}"
        )
    return memory


def choose_strategy(compressor: Compressor, strategy: str) -> str:
    """The strategy a step uses: ``compressor.strategy`` for ``"auto"``; ``ValueError`` if it cannot serve."""
    check_choice(strategy, "strategy", ("auto", *STRATEGIES))
    chosen = compressor.strategy if strategy == "auto" else strategy
    if chosen == "allreduce" and compressor.strategy != "allreduce" and compressor.rounds is None:
        raise ValueError(
            f"strategy='allreduce' was requested but compressor {compressor.name!r} has strategy "
            f"{compressor.strategy!r}: its payloads cannot be summed as they are (and it has no rounds); "
            f"use strategy='allgather', 'reduce_scatter' or 'broadcast' (or 'auto')"
        )
    if chosen == "reduce_scatter":
        check_stateless(compressor, "compressor", "strategy='reduce_scatter'")
    return chosen


def sums_in_16_bits(compressor: Compressor) -> bool:
    """Whether ``compressor``'s ``"allreduce"`` sums 16-bit floats (fp16/bf16 payload fields), whose
    rounding in the sum no worker's memory sees. Probed on a small float32 array at build time."""
    if compressor.strategy != "allreduce" or compressor.rounds is not None:
        return False
    payload, _ = compressor.compress(jnp.zeros((4,), jnp.float32), jax.random.PRNGKey(0))
    fields = [getattr(payload, f) for f in getattr(type(payload), "summable", ())]
    return any(jnp.result_type(v) in (jnp.float16, jnp.bfloat16) for v in fields)


def check_stateless(compressor: Compressor, name: str, why: str) -> None:
    """``ValueError`` unless ``compressor`` keeps no per-array state (chunks change shape with ``n``)."""
    if jax.tree.leaves(compressor.init_state(jnp.zeros((2,), jnp.float32))):
        raise ValueError(
            f"{why} compresses chunks whose size depends on the number of workers, so {name} "
            f"{compressor.name!r} must be stateless"
        )
    if compressor.rounds is not None:
        raise ValueError(f"{why} needs a single-round compressor; {name} {compressor.name!r} has rounds")


def check_served(comm, chosen: str, compressor: Compressor) -> None:
    """``ValueError`` (from :func:`jaxcomm.comm.require`) if ``comm`` cannot run strategy ``chosen``."""
    require(comm, *TABLE[chosen].needs, for_what=f"strategy {chosen!r} for compressor {compressor.name!r}")


def check_per_worker(comm, leaves) -> None:
    """``ValueError`` if a gradient was already summed over the axis (the shard_map pitfall).

    Inside ``jax.shard_map`` (``check_vma=True``), ``jax.grad`` with respect to
    replicated parameters returns the gradient *summed over the axis*, an
    invariant value: compressing it would compress the already-communicated
    dense sum. The axis index varies over the axis and such a gradient does
    not; under ``jax.vmap`` nothing is tracked and the check passes.
    """
    axis = getattr(comm, "axis_name", None)
    if not isinstance(axis, str) or axis not in varying_axes(comm.index()):
        return
    for i, g in enumerate(leaves):
        if axis not in varying_axes(g):
            raise ValueError(
                f"updates: gradient leaf {i} (shape {tuple(jnp.shape(g))}) is not device-varying over axis "
                f"{axis!r}: inside jax.shard_map, jax.grad of replicated parameters has already summed it "
                f"across devices, which would bypass compression. Make the parameters per-device before "
                f"jax.grad: params = jax.lax.pcast(params, {axis!r}, to='varying') "
                f"(or jaxcomm.comm.MeshAxis({axis!r}).varying(params))."
            )


def check_skip_nonfinite(skip_nonfinite) -> bool:
    """``skip_nonfinite`` if it is a bool; ``TypeError`` naming it otherwise."""
    return check_bool(skip_nonfinite, "skip_nonfinite")
