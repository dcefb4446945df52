"""D-PSGD: decentralized parallel SGD with neighbour averaging (Lian et al. 2017).

EventGraD Eq. 2 / Algorithm A. Every iteration ``k`` each worker ``i`` computes a
stochastic gradient at its own parameters, averages its parameters with its
neighbours' by the mixing weights, and takes the local step:

    x_{k+1,i} = sum_j W[i, j] x_{k,j}  -  alpha * grad F_i(x_{k,i}; xi_{k,i})      (Eq. 2)

(with a general optax optimizer the last term is its update computed from the
same gradient). The final model is the average of the workers' models.

Everything here is per worker and pure: ``params`` is one worker's pytree, and
the neighbour exchange goes through a :class:`~jaxcomm.comm.Communicator`
(``permute`` per neighbour permutation of the topology): ``jax.lax.ppermute``
on a mesh axis (inside ``jax.shard_map`` or ``jax.vmap(axis_name=...)``), or
mpi4jax ``sendrecv`` with :class:`~jaxcomm.comm.MPIComm`. :func:`per_worker`
runs a per-worker function over stacked (leading worker axis) pytrees.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from .._validate import check_int
from ..comm import resolve
from ..topology import Topology, as_topology

__all__ = [
    "DecentralizedAlgorithm",
    "DPSGDState",
    "dpsgd",
    "neighbor_exchange",
    "mix",
    "combine",
    "per_worker",
    "replicate",
    "average_model",
    "consensus_distance",
    "simulate_decentralized",
]

PyTree = Any


class DecentralizedAlgorithm(NamedTuple):
    """A decentralized algorithm as a pair of pure per-worker functions.

    Attributes:
      init: ``params -> state`` (one worker's parameters, no worker axis).
      step: ``(params, grads, state) -> (new_params, new_state)``; ``grads`` is the
        stochastic gradient evaluated at ``params`` (before mixing). Must run where
        the communicator is bound (inside ``shard_map``/``vmap`` over the axis, or
        under MPI).
    """

    init: Callable[[PyTree], Any]
    step: Callable[[PyTree, PyTree, Any], tuple]


class DPSGDState(NamedTuple):
    """Per-worker D-PSGD state.

    Attributes:
      step: ``int32 []``, iterations done (each exchanged every tensor once).
      opt_state: the local optimizer's state.
    """

    step: jax.Array
    opt_state: optax.OptState


def _as_optimizer(optimizer) -> optax.GradientTransformation:
    if isinstance(optimizer, optax.GradientTransformation):
        return optimizer
    if isinstance(optimizer, (int, float)) and not isinstance(optimizer, bool):
        if not optimizer > 0:
            raise ValueError(f"learning rate (optimizer) must be > 0; got {optimizer}")
        return optax.sgd(float(optimizer))
    raise TypeError(
        f"optimizer must be an optax.GradientTransformation or a learning rate (float); got {type(optimizer).__name__}"
    )


def _weights_here(topology: Topology, index, dtype):
    """``(W[i, i], receive_weights[:, i])`` of worker ``index`` (traced int), cast to ``dtype``."""
    self_w = jnp.asarray(topology.self_weights, dtype=dtype)[index]
    if topology.num_permutations == 0:
        return self_w, jnp.zeros((0,), dtype)
    recv_w = jnp.asarray(topology.receive_weights, dtype=dtype)[:, index]
    return self_w, recv_w


def neighbor_exchange(tree: PyTree, topology: Topology, comm) -> list:
    """One ``comm.permute`` per neighbour permutation of ``topology``.

    Args:
      tree: this worker's pytree.
      topology: its :class:`~jaxcomm.topology.Topology` (``n`` must equal ``comm.size``).
      comm: a bound :class:`~jaxcomm.comm.Communicator`.

    Returns:
      ``K`` pytrees like ``tree``: entry ``k`` is the value of ``src_k(i)``.

    Raises:
      ValueError: the topology does not match the number of workers.
    """
    topology.check_workers(comm.size)
    return [comm.permute(tree, [tuple(p) for p in perm]) for perm in topology.permutations]


def combine(own: PyTree, received: Sequence[PyTree], topology: Topology, index) -> PyTree:
    """``W[i, i] * own + sum_k receive_weights[k, i] * received[k]`` (the mixing of Eq. 2/5).

    Args:
      own: worker ``i``'s pytree.
      received: ``K`` pytrees (one per permutation), e.g. from :func:`neighbor_exchange`
        (D-PSGD) or the last received copies (EventGraD Eq. 5).
      topology: the topology; ``index``: worker ``i`` (int or traced int32).
    """
    if len(received) != topology.num_permutations:
        raise ValueError(
            f"received must hold {topology.num_permutations} pytrees (one per permutation); got {len(received)}"
        )

    def one(x, *rs):
        self_w, recv_w = _weights_here(topology, index, x.dtype)
        out = self_w * x
        for k, r in enumerate(rs):
            out = out + recv_w[k] * r
        return out

    return jax.tree.map(one, own, *received)


def mix(tree: PyTree, topology: Topology, comm) -> PyTree:
    """``sum_j W[i, j] x_j`` for this worker ``i``: the neighbour averaging of D-PSGD (Eq. 2)."""
    return combine(tree, neighbor_exchange(tree, topology, comm), topology, comm.index())


def dpsgd(
    topology: Topology | str,
    optimizer: optax.GradientTransformation | float,
    *,
    num_workers: int | None = None,
    axis_name: str | None = None,
    comm=None,
) -> DecentralizedAlgorithm:
    """D-PSGD (Lian et al. 2017; EventGraD Eq. 2, Algorithm A).

    ``step(params, grads, state)`` returns ``mix(params) + optimizer_update(grads)``:
    with ``optimizer = alpha`` (plain SGD) that is exactly Eq. 2,
    ``x_{k+1,i} = sum_j W_ij x_{k,j} - alpha g_i(x_{k,i})``.

    Args:
      topology: a :class:`~jaxcomm.topology.Topology` (or a name with ``num_workers``).
      optimizer: the local optimizer, or a learning rate for plain SGD.
      num_workers: needed only when ``topology`` is a name.
      axis_name / comm: the communicator (at most one; neither means the ambient one
        of :func:`jaxcomm.comm.use`).

    Raises:
      ValueError: at trace time, if the topology does not match the worker count.
    """
    topo = as_topology(topology, num_workers)
    tx = _as_optimizer(optimizer)
    communicator = resolve(axis_name, comm)

    def init(params):
        return DPSGDState(step=jnp.zeros((), jnp.int32), opt_state=tx.init(params))

    def step(params, grads, state):
        mixed = mix(params, topo, communicator)
        updates, opt_state = tx.update(grads, state.opt_state, params)
        return optax.apply_updates(mixed, updates), DPSGDState(state.step + 1, opt_state)

    return DecentralizedAlgorithm(init, step)


# --------------------------------------------------------------------------- #
# running per-worker functions over stacked pytrees
# --------------------------------------------------------------------------- #
def per_worker(fn: Callable, *, axis_name: str = "data", mesh: jax.sharding.Mesh | None = None) -> Callable:
    """Lift a per-worker function to stacked pytrees (leading worker axis of size ``n``).

    With ``mesh=None`` it is ``jax.vmap(fn, axis_name=axis_name)`` (one device; cheap
    tests and many simulated workers). With a mesh it is ``jax.shard_map`` over
    ``mesh``'s ``axis_name``: every argument and result is sharded ``P(axis_name)``
    on its leading axis, and ``fn`` sees one worker's slice without the axis. The
    arguments are placed there first (``jax.device_put(x, NamedSharding(mesh,
    P(axis_name)))``; a no-op for arrays already placed so), so the errors users see
    are the library's (a topology of the wrong size, ...), not jax's ``in_specs`` one.

    Raises:
      ValueError: ``axis_name`` is not an axis of ``mesh``; (when called) an argument
        leaf whose leading axis is not the mesh axis' size ``n``.
    """
    if mesh is None:
        return jax.vmap(fn, axis_name=axis_name)
    if axis_name not in mesh.axis_names:
        raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh {tuple(mesh.axis_names)}")
    spec = jax.sharding.PartitionSpec(axis_name)
    sharding = jax.sharding.NamedSharding(mesh, spec)
    n = int(mesh.shape[axis_name])

    def body(*args):
        squeezed = jax.tree.map(lambda a: a[0], args)
        out = fn(*squeezed)
        return jax.tree.map(lambda a: jnp.expand_dims(a, 0), out)

    mapped = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)

    def run(*args):
        for path, leaf in jax.tree_util.tree_leaves_with_path(args):
            shape = jnp.shape(leaf)
            if not shape or shape[0] != n:
                raise ValueError(
                    f"per_worker: argument leaf {jax.tree_util.keystr(path)} has shape {tuple(shape)}; every leaf "
                    f"needs a leading worker axis of length {n} (the size of mesh axis {axis_name!r}), e.g. "
                    f"jaxcomm.algorithms.replicate(tree, {n})"
                )
        return mapped(*jax.device_put(args, sharding))

    return run


def replicate(tree: PyTree, num_workers: int) -> PyTree:
    """Stack ``num_workers`` copies of ``tree`` on a new leading axis (same initialisation everywhere)."""
    num_workers = check_int(num_workers, "num_workers")
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (num_workers,) + jnp.shape(x)), tree)


def average_model(stacked: PyTree) -> PyTree:
    """The average of the workers' models: mean over the leading worker axis (final model of D-PSGD)."""
    return jax.tree.map(lambda x: jnp.mean(x, axis=0), stacked)


def consensus_distance(stacked: PyTree) -> jax.Array:
    """``(1/n) sum_i ||x_i - x_bar||^2`` over all leaves (the consensus error bounded in Lian et al.)."""
    n = jax.tree.leaves(stacked)[0].shape[0]
    sq = [jnp.sum((x - jnp.mean(x, axis=0, keepdims=True)) ** 2) for x in jax.tree.leaves(stacked)]
    return sum(sq) / n


# --------------------------------------------------------------------------- #
# training with simulated workers (D-PSGD, EventGraD)
# --------------------------------------------------------------------------- #
def simulate_decentralized(
    algorithm: DecentralizedAlgorithm,
    loss_fn: Callable,
    params: PyTree,
    model_state: PyTree,
    batches,
    num_rounds: int,
    *,
    num_workers: int,
    key,
    key_offset: int = 0,
    axis_name: str = "workers",
    record: Callable[[PyTree, Any], Any] | None = None,
    eval_fn: Callable[[PyTree, PyTree], dict] | None = None,
    eval_every: int = 0,
    on_eval: Callable[[dict], None] | None = None,
    progress: bool = False,
    desc: str = "decentralized",
) -> dict:
    """Train ``P`` simulated workers with a decentralized algorithm (:func:`jaxcomm.train.simulate`).

    Long because the argument checks come first, then the one round function handed to ``simulate``; the round is short.

    Round ``t``: worker ``w`` evaluates ``loss_fn`` and its gradient at its own
    parameters on its batch ``batches[t][w]`` with key ``split(fold_in(key, key_offset + t), P)[w]``,
    then ``algorithm.step`` mixes with the neighbours and applies the update
    (Eq. 2 / Eq. 5), every worker under ``jax.vmap(axis_name=axis_name)``.

    Args:
      algorithm: e.g. :func:`dpsgd` or :func:`~jaxcomm.algorithms.eventgrad`,
        built with ``axis_name=axis_name`` (or the ambient communicator unset).
      loss_fn: one worker's ``(params, model_state, batch, key) -> (loss, (model_state, metrics))``,
        e.g. :func:`jaxcomm.train.classification_loss` of :func:`jaxcomm.train.split_model`.
      params, model_state: the initial point, one worker's (every worker starts there).
      batches: iterator of global batches, every leaf ``[P, b, ...]`` (e.g.
        :class:`jaxcomm.data.WorkerBatches`); one is drawn per round.
      num_rounds: iterations ``T >= 1``.
      num_workers: ``P``.
      key, key_offset: PRNG key (dropout) and the offset of the rounds' ``fold_in``.
      record: optional ``(params, alg_state) -> pytree`` of the stacked (``[P, ...]``)
        state after each round, traced inside the round; collected as ``records``.
      eval_fn: optional ``(params, model_state) -> dict`` of floats on the stacked
        state, run every ``eval_every`` rounds and at the end.
      on_eval, progress, desc: see :func:`jaxcomm.train.simulate`.
    Returns:
      dict: ``params``, ``model_state``, ``state`` (stacked ``[P, ...]``), ``loss``
      (``float32[T, P]``, each worker's loss before its step), ``metrics`` (the loss
      function's, ``[T, P]`` each), ``records`` (``record``'s, leading axis ``T``, or
      ``None``), ``history``, ``wall_s`` and ``first_call_s`` (see
      :class:`jaxcomm.train._simulate.SimulationResult`).
    """
    from ..train import simulate

    num_workers = check_int(num_workers, "num_workers")
    if not hasattr(batches, "__next__"):
        raise TypeError(f"batches must be an iterator of worker-stacked batches; got {type(batches).__name__}")
    p = int(num_workers)
    key_offset = check_int(key_offset, "key_offset", 0)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def worker(prm, mstate, alg_state, batch, k):
        (loss, (mstate, metrics)), grads = grad_fn(prm, mstate, batch, k)
        prm, alg_state = algorithm.step(prm, grads, alg_state)
        return prm, mstate, alg_state, loss, metrics

    workers = jax.vmap(worker, axis_name=axis_name)

    def round_fn(carry, t, batch):
        prm, mstate, alg_state = carry
        keys = jax.random.split(jax.random.fold_in(key, key_offset + t), p)
        prm, mstate, alg_state, loss, metrics = workers(prm, mstate, alg_state, batch, keys)
        out = {"loss": loss, "metrics": metrics, "records": None if record is None else record(prm, alg_state)}
        return (prm, mstate, alg_state), out

    stacked = jax.tree.map(jnp.asarray, replicate(params, p))
    carry = (stacked, replicate(model_state, p), jax.vmap(algorithm.init)(stacked))
    evaluate = None if eval_fn is None else (lambda c: eval_fn(c[0], c[1]))
    (prm, mstate, alg_state), result = simulate(
        round_fn,
        carry,
        num_rounds,
        inputs=lambda _: jax.tree.map(jnp.asarray, next(batches)),
        eval_fn=evaluate,
        eval_every=eval_every,
        on_eval=on_eval,
        progress=progress,
        desc=desc,
    )
    out = result.outputs
    return {
        "params": prm,
        "model_state": mstate,
        "state": alg_state,
        "loss": out["loss"],
        "metrics": out["metrics"],
        "records": out.get("records"),
        "history": result.history,
        "wall_s": result.wall_s,
        "first_call_s": result.first_call_s,
    }
