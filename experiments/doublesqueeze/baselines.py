"""DoubleSqueeze's baselines (Tang et al. 2019, Sec. 5), each one ``jaxcomm.compressed_mean``.

With ``n`` workers, worker gradients ``g_i`` and compressor ``Q``, each returns
the optax transformation whose update is ``(1/n) Σ_i Q(v_i)``, the server
sending that average uncompressed:

* :func:`memsgd`: ``v_i = g_i + δ_i``, ``δ_i ← v_i − Q(v_i)`` (worker error feedback only);
* :func:`qsgd_no_feedback`: ``v_i = g_i``, ``Q`` = QSGD with ``levels`` levels;
* :func:`topk_no_feedback`: ``v_i = g_i``, ``Q`` = top-k keeping the fraction ``ratio``.

``axis_name``/``comm`` choose the communicator as in :func:`jaxcomm.compressed_mean`.
"""

from __future__ import annotations

import jaxcomm

__all__ = ["memsgd", "qsgd_no_feedback", "topk_no_feedback"]


def memsgd(compressor, *, axis_name: str | None = None, comm=None):
    """MEM-SGD, DoubleSqueeze's baseline: worker error feedback, uncompressed server.

    ``v_i = g_i + δ_i``; ``δ_i ← v_i − Q(v_i)``; output ``(1/n) Σ_i Q(v_i)``:
    the server sends the average as it is, so it keeps no error. Exactly
    ``compressed_mean(compressor, memory=jaxcomm.memory.residual())``.
    """
    return jaxcomm.compressed_mean(compressor, axis_name=axis_name, comm=comm, memory=jaxcomm.memory.residual())


def qsgd_no_feedback(levels: int = 1, *, axis_name: str | None = None, comm=None, seed: int = 0):
    """DoubleSqueeze's "QSGD" baseline: ``(1/n) Σ_i Q(g_i)``, no error feedback, uncompressed server.

    ``Q = jaxcomm.compressors.make("qsgd", levels=levels, seed=seed)`` (``levels=1``:
    a norm times ternary codes in {−1, 0, 1}, as in the paper's comparison), an
    unbiased quantiser, so it converges without feedback.
    """
    return jaxcomm.compressed_mean(
        jaxcomm.compressors.make("qsgd", levels=levels, seed=seed), axis_name=axis_name, comm=comm
    )


def topk_no_feedback(ratio: float = 0.01, *, axis_name: str | None = None, comm=None):
    """DoubleSqueeze's "Top-k SGD" baseline: ``(1/n) Σ_i topk(g_i)`` without error feedback.

    The dropped entries are discarded and the server sends the average
    uncompressed. ``ratio`` is the kept fraction, as in ``jaxcomm.compressors.topk``.
    """
    return jaxcomm.compressed_mean(jaxcomm.compressors.make("topk", ratio=ratio), axis_name=axis_name, comm=comm)
