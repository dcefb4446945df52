"""Where each leaf of an optax state lives when the parameters are one replicated copy.

A hand-written ``jax.shard_map`` step may keep the parameters replicated (``P()``, as PyTorch DDP
keeps one replica per process) and make only the gradient per worker
(``jax.lax.pcast(params, axis, to="varying")``). The compressed mean is the same on every worker
and jax types it device-invariant, so everything an optimizer chained after it computes (adam's
moments, a momentum trace, schedule counts) is one replicated copy too; the compressing
transformations' own state (error-feedback memories, wire counters) differs between workers.
:func:`state_layout` gives every leaf of a chain's state its ``PartitionSpec``, decided by the
type of the state it belongs to, and the conversions a step needs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ._accumulate import AccumulateState
from ._diloco import DiLoCoState
from ._doublesqueeze import DoubleSqueezeState
from ._gradient_dropping import PeriodicAverageState
from ._state import CompressionState

__all__ = ["StateLayout", "state_layout", "map_per_worker"]

_LOCAL_STEPS = (DiLoCoState, PeriodicAverageState)
"""States of transformations whose updates differ between workers (local steps between
synchronisations): their parameters cannot be one replicated copy."""

_LIBRARY_STATES = (CompressionState, DoubleSqueezeState, AccumulateState, *_LOCAL_STEPS)


def _is_spec(x) -> bool:
    return isinstance(x, P)


def map_per_worker(fn: Callable, specs, tree, axis: str):
    """``tree`` with ``fn`` applied to every leaf that ``specs`` places on the worker axis.

    ``specs`` is a pytree prefix of ``tree`` whose leaves are ``PartitionSpec``: a ``P(axis)``
    spec covers every leaf of the subtree it stands for, any other spec leaves its subtree as it is.
    """
    return jax.tree.map(
        lambda spec, sub: jax.tree.map(fn, sub) if spec == P(axis) else sub, specs, tree, is_leaf=_is_spec
    )


def _fields_on_worker(node, axis: str, **given):
    """The NamedTuple ``node`` as specs: every leaf of every field ``P(axis)``, except the fields in
    ``given``, which take the spec (tree) given."""
    specs = {f: given[f] if f in given else jax.tree.map(lambda _: P(axis), getattr(node, f)) for f in node._fields}
    return type(node)(**specs)


# A compressing transformation's key is identical on every worker by the key schedule, and typed so:
# a payload field decoded from it and not summed (random-k's indices under "allreduce") must be
# device-invariant to decode the summed values into a device-invariant mean.
_SHARED_KEY = {"key": P()}


def _specs(state, axis: str):
    """The ``PartitionSpec`` of every leaf of ``state`` (a tree of the same structure)."""

    def each(node):
        if isinstance(node, CompressionState):
            return _fields_on_worker(node, axis, **_SHARED_KEY)
        if isinstance(node, DoubleSqueezeState):
            # server="replicated" (the default): every worker runs the server's error feedback of the
            # invariant mean with the same key, so the server error is one replicated copy.
            server_memory = jax.tree.map(lambda _: P(), node.server.memory)
            return DoubleSqueezeState(
                worker=_fields_on_worker(node.worker, axis, **_SHARED_KEY),
                server=_fields_on_worker(node.server, axis, memory=server_memory, **_SHARED_KEY),
            )
        if isinstance(node, AccumulateState):
            return _fields_on_worker(node, axis, inner_state=_specs(node.inner_state, axis))
        if isinstance(node, _LOCAL_STEPS):
            raise ValueError(
                f"the state holds a {type(node).__name__}: that transformation takes local steps, so its "
                "updates differ between workers and the parameters cannot be one replicated copy; keep the "
                "parameters per worker (jaxcomm.train.Trainer does)"
            )
        return P()  # an optimizer's leaf: computed from the replicated mean and parameters

    return jax.tree.map(each, state, is_leaf=lambda x: isinstance(x, _LIBRARY_STATES))


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """Where the leaves of an optax state live in a ``jax.shard_map`` step with replicated parameters.

    Built by :func:`state_layout`. A leaf under ``P(axis_name)`` has a leading worker dimension of
    size ``n`` outside the step (worker ``i``'s value at index ``i``) and of size 1 inside it; a
    leaf under ``P()`` is one copy, the same on every worker, without a worker dimension.

    Attributes:
      specs: a tree with the structure of ``tx.init(params)`` whose leaves are ``PartitionSpec``:
        pass it as the state's ``in_specs`` and ``out_specs``.
      axis_name: the mesh axis the workers are on.
      tx_init: the transformation's ``init``.
    """

    specs: Any
    axis_name: str
    tx_init: Callable

    def init(self, params, mesh: Mesh):
        """``tx.init(params)`` laid out on ``mesh``: per-worker leaves broadcast to ``(n, *shape)``
        (``n = mesh.shape[axis_name]``, every worker starting from the same value) and sharded over
        the axis, replicated leaves placed whole on every device of the mesh.

        Raises:
          TypeError: ``mesh`` is not a ``jax.sharding.Mesh``.
          ValueError: ``mesh`` has no axis ``axis_name``; ``params`` give a state of another structure
            than the one the layout was built for.
        """
        if not isinstance(mesh, Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh (e.g. jax.make_mesh); got {type(mesh).__name__}")
        if self.axis_name not in mesh.axis_names:
            raise ValueError(f"mesh has axes {mesh.axis_names}, not the layout's axis_name {self.axis_name!r}")
        state = self.tx_init(params)
        want = jax.tree.structure(self.specs, is_leaf=_is_spec)
        if jax.tree.structure(state) != want:
            raise ValueError(
                f"params give a state of structure {jax.tree.structure(state)}, but the layout was built for "
                f"{want}; build the layout (state_layout) from the same parameters"
            )
        n = int(mesh.shape[self.axis_name])
        per_worker = lambda x: jnp.broadcast_to(jnp.asarray(x), (n, *jnp.shape(x)))
        state = map_per_worker(per_worker, self.specs, state, self.axis_name)
        place = lambda spec, x: jax.device_put(x, NamedSharding(mesh, spec))
        return jax.tree.map(place, self.specs, state, is_leaf=_is_spec)

    def local(self, state):
        """Inside the step: this worker's state, the size-1 worker dimension of per-worker leaves removed.

        Raises:
          ValueError: a per-worker leaf whose leading dimension is not 1 (the state was not passed
            through ``jax.shard_map`` with ``in_specs`` ``specs``).
        """

        def drop(x):
            if jnp.ndim(x) == 0 or jnp.shape(x)[0] != 1:
                raise ValueError(
                    f"a per-worker state leaf has shape {jnp.shape(x)} inside the step; with in_specs "
                    f"layout.specs every worker sees a leading dimension of 1 (is the state passed through "
                    f"jax.shard_map over {self.axis_name!r} with those specs?)"
                )
            return x[0]

        return map_per_worker(drop, self.specs, state, self.axis_name)

    def stacked(self, state):
        """Inside the step: the updated state with the size-1 worker dimension put back (what
        ``out_specs`` ``specs`` expects)."""
        return map_per_worker(lambda x: x[None], self.specs, state, self.axis_name)


def state_layout(tx, params, axis_name: str) -> StateLayout:
    """The ``PartitionSpec`` of every leaf of ``tx``'s state for a step whose parameters are replicated.

    For a ``jax.shard_map`` step (``check_vma=True``) that keeps one replicated copy of the
    parameters (``P()``), casts them per worker before ``jax.grad`` and chains an optimizer after a
    compressed mean, e.g. ``optax.chain(compressed_mean(c, axis_name), optax.adam(1e-3))``. The spec
    of a leaf is decided by the type of the state that holds it, wherever that state is nested
    (``optax.chain``, ``optax.inject_hyperparams``, ``optax.masked``, ``optax.multi_transform``,
    :func:`accumulate`):

    * :class:`CompressionState` (:func:`compressed_mean`, :func:`deep_gradient_compression`,
      :func:`gradient_dropping`): ``P(axis_name)``, one slice per worker (memories, compressor
      states, wire counters, step counts), except ``key``: ``P()``, identical on every worker.
    * :class:`DoubleSqueezeState`: the worker half as above; the server half as above with its
      error memory ``P()`` (``server="replicated"``, the default: every worker computes the same
      server error). ``server="sharded"`` keeps per-owner server errors that this layout does not
      describe; jax then refuses the step when it is traced ("could not infer replication").
    * :class:`AccumulateState`: count and gradient sum ``P(axis_name)``, its inner state by these rules.
    * every other leaf (adam's ``mu``/``nu``, a momentum ``trace``, ``count``s, injected
      hyper-parameters): ``P()``, one replicated copy. That holds for transformations chained
      *after* the mean; a stateful transformation before it (local momentum) keeps per-worker
      state, and jax refuses the step when it is traced.

    A step whose update is not the same on every worker (``broadcast`` strategy, whose mean jax
    types device-varying; :func:`gradient_dropping` in modes ``"sum"``, ``"partial"`` and
    ``"error"``, which add the local gradient) cannot return replicated parameters whatever the
    state's layout: jax refuses it when the step is traced.

    Args:
      tx: an optax transformation (``init``/``update``).
      params: the parameters (a pytree of arrays, or of ``jax.ShapeDtypeStruct``), without a worker
        dimension; only their shapes and dtypes are read (``jax.eval_shape(tx.init, params)``).
      axis_name: the mesh axis the workers are on.
    Returns:
      A :class:`StateLayout`: ``specs`` for ``in_specs``/``out_specs``, ``init(params, mesh)``
      for the initial state, ``local``/``stacked`` inside the step.
    Raises:
      TypeError: ``tx`` without ``init``/``update``; ``axis_name`` not a non-empty string.
      ValueError: the state holds a :class:`DiLoCoState` or :class:`PeriodicAverageState`
        (local steps: the parameters differ between workers).
    """
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise TypeError(f"tx must be an optax GradientTransformation; got {type(tx).__name__}")
    if not isinstance(axis_name, str) or not axis_name:
        raise TypeError(f"axis_name must be a non-empty string (the mesh axis); got {axis_name!r}")
    specs = _specs(jax.eval_shape(tx.init, params), axis_name)
    return StateLayout(specs=specs, axis_name=axis_name, tx_init=tx.init)
