"""DoubleSqueeze: error-compensated compression on the workers *and* the server.

Tang, Lian, Yu, Zhang, Liu (2019), "DoubleSqueeze: Parallel Stochastic
Gradient Descent with Double-Pass Error-Compensated Compression", Algorithm 1.
At step t, with compressor Q and learning rate γ:

    worker i:  v_t^(i) = g_t^(i) + δ_{t-1}^(i);   send Q[v_t^(i)];   δ_t^(i) = v_t^(i) − Q[v_t^(i)]
    server:    v_t = δ_{t-1} + (1/n) Σ_i Q[v_t^(i)];   send Q[v_t];   δ_t = v_t − Q[v_t]
    update:    x_{t+1} = x_t − γ Q[v_t]

No unbiasedness is required of Q: 1-bit with the scale ‖v‖₂/‖sign(v)‖₂
(:func:`jaxcomm.compressors.scaled_sign`), top-k, clipping, stochastic rounding
and random sparsification all converge.

There is no separate server process. Two placements of the server step:

* ``server="replicated"``: the worker half is exactly
  :func:`~jaxcomm.transforms.compressed_mean` with residual memory (the
  workers' payloads are summed or all-gathered and averaged), and every worker
  then runs the server half, :func:`~jaxcomm.transforms.error_feedback` of the
  average, itself: identical inputs and an identical PRNG key, so the server
  error δ is the same on every worker and nothing more is sent.
* ``server="sharded"`` (DeepSpeed's compressed allreduce): each worker owns one
  of n chunks of every tensor. The workers compress their n chunks and send
  each to its owner (n − 1 permutation rounds: an all-to-all, i.e. a
  compressed reduce-scatter); the owner averages its chunk, compensates it with
  its part of the server error, compresses, and the compressed chunks are
  all-gathered.

The transform emits ``Q[v_t]`` (identical on every worker); chain an optimizer
after it, e.g. ``optax.chain(doublesqueeze(...), optax.sgd(γ))`` for the paper's
update. Both placements are the pipeline of :mod:`jaxcomm.transforms` (the
sharded one is its ``"reduce_scatter"`` strategy with the server's error
feedback at the chunk owners).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from .. import memory as memory_lib
from .._bitcount import BitCount
from .._keys import step_keys
from .._validate import check_choice
from ..comm import resolve
from ..compressors import Compressor
from ._checks import (
    check_compressor,
    check_memory,
    check_served,
    check_skip_nonfinite,
    check_stateless,
    choose_strategy,
)
from ._collectives import LOCAL
from ._pipeline import compress_step, if_finite
from ._state import CompressionState, flatten_updates, init_state
from ._strategies import Owner

__all__ = ["DoubleSqueezeState", "doublesqueeze"]

SERVER_MODES = ("replicated", "sharded")


class DoubleSqueezeState(NamedTuple):
    """State of :func:`doublesqueeze` (one worker's view; same layout for both server modes).

    Attributes:
      worker: :class:`~jaxcomm.transforms.CompressionState` of the worker
        half. ``worker.memory`` holds the worker errors ``δ^(i)`` (a tree like
        the parameters) and is **per worker**: it differs between workers.
        ``worker.wire_bits[l]``: bits this worker sent for leaf ``l`` (its
        payload; sharded: its n − 1 chunk payloads).
      server: :class:`~jaxcomm.transforms.CompressionState` of the server
        half. ``server.memory`` holds the server error ``δ`` (a tree like the
        parameters). ``server="replicated"``: **identical on every worker**,
        and ``server.wire_bits`` is zero (the server step is recomputed, not
        sent). ``server="sharded"``: each worker holds the entries of the
        chunks it owns and zeros elsewhere, and ``server.wire_bits[l]`` is its
        compressed chunk's size.

    Both halves count the steps with a gradient that was not finite in ``notfinite_count``
    (the skipped steps with ``skip_nonfinite=True``).
    """

    worker: CompressionState
    server: CompressionState


def doublesqueeze(
    compressor: Compressor,
    *,
    axis_name: str | None = None,
    comm=None,
    server_compressor: Compressor | None = None,
    server: str = "replicated",
    worker_memory: memory_lib.Memory | None = None,
    server_memory: memory_lib.Memory | None = None,
    skip_nonfinite: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """DoubleSqueeze (Tang et al. 2019, Algorithm 1): error-compensated compression on both passes.

    Long because an optax factory's closures share the validated hyper-parameters; each inner function is short.

    Per leaf, on worker i of n (``v``, ``δ`` have the leaf's shape and dtype)::

        v_i = g_i + δ_i;  δ_i ← v_i − Q(v_i)                    (worker_memory: residual)
        v = δ + (1/n) Σ_i Q(v_i);  δ ← v − Q_s(v)               (server_memory: residual)
        output Q_s(v)                                            (identical on every worker)

    Randomness: the worker half follows
    :func:`~jaxcomm.transforms.compressed_mean`'s key schedule (key
    ``PRNGKey(compressor.seed)``, folded with the worker index unless the
    payload is summable); the server half follows
    :func:`~jaxcomm.transforms.error_feedback`'s, from
    ``fold_in(PRNGKey(server_compressor.seed), 1)`` so that it is independent
    of the workers' draws (sharded: also folded with the chunk owner's index).

    Args:
      compressor: the workers' compressor ``Q``: any single-round
        :class:`~jaxcomm.compressors.Compressor`; biased ones are fine (e.g.
        ``scaled_sign()``, ``topk(ratio=...)``).
      axis_name: mesh axis to communicate over (inside ``jax.shard_map`` or
        ``jax.vmap(..., axis_name=...)``).
      comm: any :class:`~jaxcomm.comm.Communicator` instead (e.g. MPI). With
        neither, the ambient communicator of :func:`jaxcomm.comm.use`.
      server_compressor: the server's ``Q_s`` (default: ``compressor``).
      server: ``"replicated"`` (every worker runs the server step on the
        gathered average; one collective per leaf) or ``"sharded"`` (each
        worker owns a ``ceil(d/n)``-entry chunk of every ``d``-entry tensor:
        compressed reduce-scatter in n − 1 permutation rounds, server step on
        the chunk, compressed all-gather; the compressors then act on each
        zero-padded chunk and must be stateless).
      worker_memory: worker error feedback (default
        :func:`jaxcomm.memory.residual`: ``v_i = g_i + δ_i``).
      server_memory: server error feedback (default ``residual()``).
      skip_nonfinite: when some worker's gradient has a NaN or Inf, every worker skips the
        step (one extra int32 all-reduce per step): the output is zeros and both halves'
        states stay as they were, each counting the step in ``notfinite_count``. ``False``
        (default): the step runs as it is, and the worker and server errors keep the
        non-finite entries (see :func:`~jaxcomm.transforms.compressed_mean`).

    Returns:
      An optax transformation with state :class:`DoubleSqueezeState`; ``update``
      maps each worker's gradient tree to ``Q_s(v)``.

    Raises:

      ValueError: at ``init``, a memory that needs a contraction (``Memory.needs_contraction``)
        around an unbiased compressor whose variance factor is ``ω ≥ 1`` at a tensor's size (it
        would diverge; :func:`jaxcomm.compressors.contractive` scales it into a contraction),
        or around one that declares ``no_contraction`` (signsgd, signum).
      TypeError: ``compressor``/``server_compressor`` not a Compressor, a
        memory not a Memory, ``comm`` not a Communicator, ``skip_nonfinite`` not a bool.
      ValueError: a compressor strategy the communicator cannot serve, a
        multi-round compressor (``rounds``), a stateful compressor
        with ``server="sharded"``, an unknown ``server``; at trace time, a
        gradient tree that differs from the one ``init`` saw.
    """
    compressor = _single_round(check_compressor(compressor), "compressor")
    server_c = compressor if server_compressor is None else check_compressor(server_compressor, "server_compressor")
    server_c = _single_round(server_c, "server_compressor")
    worker_mem = memory_lib.residual() if worker_memory is None else check_memory(worker_memory, "worker_memory")
    server_mem = memory_lib.residual() if server_memory is None else check_memory(server_memory, "server_memory")
    check_choice(server, "server", SERVER_MODES)
    skip = check_skip_nonfinite(skip_nonfinite)
    if server == "sharded":
        for c, name in ((compressor, "compressor"), (server_c, "server_compressor")):
            check_stateless(c, name, "server='sharded'")
    communicator = resolve(axis_name=axis_name, comm=comm)
    worker_strategy = "reduce_scatter" if server == "sharded" else choose_strategy(compressor, "auto")
    if axis_name is not None or comm is not None:
        check_served(communicator, worker_strategy, compressor)
    worker_scale, server_scale = float(worker_mem.output_scale), float(server_mem.output_scale)

    def init(params):
        server_state = init_state(params, server_c, server_mem)
        return DoubleSqueezeState(
            worker=init_state(params, compressor, worker_mem),
            server=server_state._replace(key=jax.random.fold_in(server_state.key, 1)),
        )

    def update(updates, state, params=None, **extra_args):
        del params, extra_args
        if not isinstance(state, DoubleSqueezeState):
            raise TypeError(f"state must be a DoubleSqueezeState (from init); got {type(state).__name__}")
        check_served(communicator, worker_strategy, compressor)
        return if_finite(communicator, updates, state, _sharded if server == "sharded" else _replicated, skip=skip)

    def _replicated(updates, state):
        # Worker half: the compressed mean of the v_i.
        worker = compress_step(
            communicator, updates, state.worker, compressor=compressor, memory=worker_mem, strategy=worker_strategy
        )
        mean = worker.output(worker_scale)
        # Server half, recomputed identically on every worker: error feedback of the mean (nothing sent).
        server = compress_step(
            LOCAL, mean, state.server, compressor=server_c, memory=server_mem, strategy=server_c.strategy
        )
        server_state = server.state._replace(
            wire_bits=BitCount.zeros(server.state.wire_bits.shape), messages=jnp.zeros((), jnp.int32)
        )
        return server.output(server_scale), DoubleSqueezeState(worker.state, server_state)

    def _sharded(updates, state):
        s_leaves, _, s_mem = flatten_updates(updates, state.server)
        s_key, s_keys = step_keys(state.server.key, len(s_leaves))

        def owner_step(keys):
            del keys
            return Owner(server_c, server_mem, s_mem, list(s_keys[: len(s_leaves)]))

        worker = compress_step(
            communicator,
            updates,
            state.worker,
            compressor=compressor,
            memory=worker_mem,
            strategy="reduce_scatter",
            owner_step=owner_step,
        )
        assert worker.owner is not None  # "reduce_scatter" always has the owners' part
        server_state = CompressionState(
            count=state.server.count + 1,
            key=s_key,
            memory=worker.treedef.unflatten(worker.owner.memory),
            compressor_states=state.server.compressor_states,
            wire_bits=worker.owner.wire_bits(),
            messages=jnp.zeros((), jnp.int32),
            notfinite_count=state.server.notfinite_count,
        )
        return worker.output(worker_scale * server_scale), DoubleSqueezeState(worker.state, server_state)

    return optax.GradientTransformationExtraArgs(init, update)


def _single_round(c: Compressor, name: str) -> Compressor:
    if c.rounds is not None:
        raise ValueError(
            f"{name} {c.name!r} is a multi-round method (it has rounds); DoubleSqueeze needs every "
            "worker's own single-round payload Q(v_i) and its error v_i - Q(v_i)"
        )
    return c
