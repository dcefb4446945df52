"""Error-feedback memories: the compensation φ and update ψ of GRACE Algorithm 1.

GRACE (Sec. IV-A, Algorithm 1, lines 5-6) runs, on every worker ``i`` and for
every tensor,

    g̃ = Q(φ(m, g))                       (compensate, then compress)
    m ← ψ(m, g, g̃)                       (update the memory)

and its default memory (Eq. 4) is

    φ(m, g)    = β m + γ g
    ψ(m, g, g̃) = φ(m, g) − Q⁻¹(g̃).

A :class:`Memory` is the pair (φ, ψ) acting on one array, plus the state it
keeps for that array. The transforms :func:`jaxcomm.error_feedback` and
:func:`jaxcomm.compressed_mean` apply it leaf by leaf. Memories here:

* :func:`none` -- no memory (GRACE footnote 6: φ = g, ψ = 0).
* :func:`residual` -- Eq. 4 (β = γ = 1 is EF-SGD / MEM-SGD error feedback).
* :func:`dgc` -- Deep Gradient Compression's momentum correction and factor
  masking (Lin et al. 2018, Sec. 3.2, Algorithm 1 lines 8-13).
* :func:`efsignsgd` -- the memory of EF-SignSGD (Karimireddy et al. 2019,
  Algorithm 1): the learning rate scales the gradient *before* compression.

>>> import jax.numpy as jnp, jaxcomm as jc
>>> mem = jc.memory.residual()
>>> m = mem.init(jnp.zeros(3))
>>> phi = mem.compensate(m, jnp.array([1.0, -2.0, 3.0]))
>>> g_hat = jnp.array([0.0, 0.0, 3.0])          # e.g. top-1 of phi
>>> mem.update(m, jnp.array([1.0, -2.0, 3.0]), phi, g_hat).tolist()
[1.0, -2.0, 0.0]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from ._validate import check_bool, check_finite_scalar, lookup

__all__ = [
    "Memory",
    "none",
    "residual",
    "dgc",
    "efsignsgd",
    "make",
    "names",
]

Array = jax.Array


class Memory(NamedTuple):
    """An error-feedback memory acting on one array (GRACE Eq. 4's φ and ψ).

    Attributes:
      name: registry name (``"none"``, ``"residual"``, ``"dgc"``, ``"efsignsgd"``).
      init: ``x -> state``: the memory state for an array shaped like ``x``
        (zeros; ``()`` when stateless).
      compensate: ``(state, g) -> phi``: φ, the tensor that is compressed
        (same shape and dtype as the gradient ``g``).
      update: ``(state, g, phi, g_hat) -> new_state``: ψ, where ``g_hat`` is
        ``Q⁻¹(Q(phi))``, this worker's own lossy reconstruction of ``phi``.
      output_scale: Python float the aggregated reconstruction is multiplied
        by before it leaves the transform (``1/lr`` for :func:`efsignsgd`,
        which compresses ``lr·g``; ``1`` otherwise).
      params: the hyper-parameters the factory was called with.
      from_error: optional ``(state, error) -> new_state`` for memories whose
        ψ is the compression error itself, ``error = phi − g_hat``
        (:func:`residual`, :func:`efsignsgd`): equal to
        ``update(state, g, phi, phi − error)``. Transforms then take the error
        from the compressor's ``compression_error`` hook when it has one (a
        sparse compressor zeroes the sent entries of ``phi`` in place instead
        of building a dense ``g_hat``). ``None``: only ``update`` is used.
      needs_contraction: whether the memory stays bounded only for a compressor
        that is a contraction (every memory that feeds the error back: the
        error ``e' = v − Q(v)`` of an expanding ``Q`` grows the memory by a factor
        per step). The transforms then refuse an unbiased compressor with
        ``ω ≥ 1`` and one that declares ``no_contraction``. ``False`` for
        :func:`none`, and for ``residual(needs_contraction=False)``, which
        accepts any compressor (to measure what error feedback does to one).
    """

    name: str
    init: Callable[[Array], Any]
    compensate: Callable[[Any, Array], Array]
    update: Callable[[Any, Array, Array, Array], Any]
    output_scale: float
    params: dict
    from_error: Callable[[Any, Array], Any] | None = None
    needs_contraction: bool = True

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"jaxcomm.memory.{self.name}({args})"


def _error_state(m, error):
    """``from_error`` of the residual memories: the new state is the compression error, in the state's dtype."""
    return error.astype(m.dtype)


class DGCMemoryState(NamedTuple):
    """Per-array state of :func:`dgc`.

    Attributes:
      momentum: ``u``, the locally accumulated momentum (DGC Alg. 1 line 9), shape of the gradient.
      accumulation: ``v``, the accumulated velocity not yet sent (line 10), shape of the gradient.
    """

    momentum: Array
    accumulation: Array


def _check_shape(state_array, g, what: str) -> None:
    if tuple(state_array.shape) != tuple(jnp.shape(g)):
        raise ValueError(
            f"updates: a gradient leaf has shape {tuple(jnp.shape(g))} but the {what} was initialised "
            f"for shape {tuple(state_array.shape)}; init and update must see the same tree"
        )


# --------------------------------------------------------------------------- #
# none
# --------------------------------------------------------------------------- #
def none() -> Memory:
    """No memory: ``φ(m, g) = g`` and ``ψ = 0`` (GRACE, footnote 6).

    The state is ``()``; the gradient is compressed as it is and the
    compression error is discarded.
    """

    def init(x):
        del x
        return ()

    def compensate(state, g):
        del state
        return g

    def update(state, g, phi, g_hat):
        del g, phi, g_hat
        return state

    return Memory("none", init, compensate, update, 1.0, {}, needs_contraction=False)


# --------------------------------------------------------------------------- #
# residual (GRACE Eq. 4)
# --------------------------------------------------------------------------- #
def residual(beta: float = 1.0, gamma: float = 1.0, *, needs_contraction: bool = True) -> Memory:
    """Residual error feedback, GRACE Eq. 4.

    ``φ(m, g) = β m + γ g`` and ``ψ(m, g, g̃) = φ − Q⁻¹(g̃)``: the part of the
    compensated gradient that compression dropped is kept and added back at the
    next step. With ``β = γ = 1`` this is the error feedback of EF-SGD and
    MEM-SGD, and it *conserves gradient mass*: after ``T`` steps,
    ``Σ_t Q⁻¹(g̃_t) + m_T = Σ_t g_t`` exactly in real arithmetic.

    Args:
      beta: memory decay ``β > 0`` (GRACE uses 1).
      gamma: weight ``γ > 0`` of the new gradient (GRACE uses 1).
      needs_contraction: ``True`` (the default): the transforms refuse a
        compressor that is not a contraction (:attr:`Memory.needs_contraction`).
        ``False`` accepts any compressor, e.g. to reproduce GRACE's measurement
        that error feedback harms signSGD, whose memory then has no bound.
    Returns:
      A :class:`Memory` whose per-array state is an array of zeros shaped and
      typed like the parameter.
    Raises:
      ValueError: ``beta`` or ``gamma`` not a finite number > 0.
      TypeError: ``needs_contraction`` not a bool.
    """
    beta = check_finite_scalar(beta, "beta", positive=True)
    gamma = check_finite_scalar(gamma, "gamma", positive=True)
    needs_contraction = check_bool(needs_contraction, "needs_contraction")
    params: dict = {"beta": beta, "gamma": gamma}
    if not needs_contraction:
        params["needs_contraction"] = False

    def init(x):
        return jnp.zeros(jnp.shape(x), jnp.result_type(x))

    def compensate(m, g):
        _check_shape(m, g, "residual memory")
        dtype = jnp.result_type(g)
        return (beta * m.astype(dtype) + gamma * g).astype(dtype)

    def update(m, g, phi, g_hat):
        del g
        return (phi - g_hat.astype(phi.dtype)).astype(m.dtype)

    return Memory("residual", init, compensate, update, 1.0, params, _error_state, needs_contraction)


# --------------------------------------------------------------------------- #
# DGC: momentum correction + factor masking
# --------------------------------------------------------------------------- #
def dgc(momentum: float = 0.9) -> Memory:
    """Deep Gradient Compression's momentum correction and factor masking.

    Lin et al. (2018), Sec. 3.2 and Algorithm 1 (lines 9-13), per worker:

        u ← μ u + g            (momentum correction: accumulate the momentum ...)
        v ← v + u              (... not the gradient)
        φ = v                  (what is sparsified and sent)
        mask = entries sent;   u ← u ⊙ ¬mask;   v ← v ⊙ ¬mask   (factor masking)

    Because the momentum is applied here, chain the transform with a plain
    ``optax.sgd(lr)`` (no momentum), as DGC does. The sent entries are those
    where the worker's own reconstruction ``Q⁻¹(Q(φ))`` is non-zero, i.e. the
    selected set of a sparsifier (a selected entry whose value is exactly 0
    carries no information and is treated as not sent). Intended for
    sparsifiers (top-k, random-k, threshold, DGC): with a dense compressor every
    entry is "sent" each step and both buffers are cleared.

    Args:
      momentum: ``μ`` in ``[0, 1)``.
    Returns:
      A :class:`Memory` whose per-array state is :class:`DGCMemoryState`.
    Raises:
      ValueError: ``momentum`` outside ``[0, 1)``.
    """
    momentum = check_finite_scalar(momentum, "momentum", nonnegative=True)
    if momentum >= 1.0:
        raise ValueError(f"momentum must be in [0, 1); got {momentum}")

    def init(x):
        # Two arrays, not one twice: a jitted step that donates its state would donate the same buffer twice.
        return DGCMemoryState(
            momentum=jnp.zeros(jnp.shape(x), jnp.result_type(x)),
            accumulation=jnp.zeros(jnp.shape(x), jnp.result_type(x)),
        )

    def corrected(state, g):
        _check_shape(state.momentum, g, "dgc memory")
        dtype = jnp.result_type(g)
        u = (momentum * state.momentum.astype(dtype) + g).astype(dtype)
        v = (state.accumulation.astype(dtype) + u).astype(dtype)
        return u, v

    def compensate(state, g):
        return corrected(state, g)[1]

    def update(state, g, phi, g_hat):
        del phi
        u, v = corrected(state, g)
        sent = g_hat != 0
        return DGCMemoryState(
            momentum=jnp.where(sent, 0, u).astype(state.momentum.dtype),
            accumulation=jnp.where(sent, 0, v).astype(state.accumulation.dtype),
        )

    return Memory("dgc", init, compensate, update, 1.0, {"momentum": momentum})


# --------------------------------------------------------------------------- #
# EF-SignSGD
# --------------------------------------------------------------------------- #
def efsignsgd(learning_rate: float) -> Memory:
    """The error-feedback memory of EF-SignSGD (Karimireddy et al. 2019, Algorithm 1).

    EF-SignSGD compresses the *step* rather than the gradient:

        p = γ g + e;   Δ = Q(p) = (‖p‖₁ / d) sign(p);   x ← x − Δ;   e ← p − Δ

    with step size ``γ``. Here ``φ(m, g) = m + γ g`` and ``ψ = φ − Q⁻¹(g̃)``
    (GRACE's ``EFSignSGDMemory``), and the aggregated reconstruction is divided
    by ``γ`` on the way out (``output_scale = 1/γ``, GRACE's EF-SignSGD
    aggregate), so that ``optax.chain(compressed_mean(signsgd-like, memory=
    efsignsgd(γ)), optax.sgd(γ))`` applies exactly ``x ← x − mean_i Δ_i``.

    Args:
      learning_rate: ``γ > 0``, the constant step size of the optimizer that
        follows. (With a schedule use :func:`residual`: for positively
        homogeneous compressors such as scaled sign, EF-SignSGD with a constant
        ``γ`` equals residual feedback on ``g`` with memory ``e/γ``.)
    Returns:
      A :class:`Memory` whose per-array state is an array of zeros like the parameter.
    Raises:
      ValueError: ``learning_rate`` not a finite number > 0.
    """
    lr = check_finite_scalar(learning_rate, "learning_rate", positive=True)

    def init(x):
        return jnp.zeros(jnp.shape(x), jnp.result_type(x))

    def compensate(m, g):
        _check_shape(m, g, "efsignsgd memory")
        dtype = jnp.result_type(g)
        return (m.astype(dtype) + lr * g).astype(dtype)

    def update(m, g, phi, g_hat):
        del g
        return (phi - g_hat.astype(phi.dtype)).astype(m.dtype)

    return Memory("efsignsgd", init, compensate, update, 1.0 / lr, {"learning_rate": lr}, _error_state)


# --------------------------------------------------------------------------- #
# Registry (for configuration files: memory: residual)
# --------------------------------------------------------------------------- #
_FACTORIES: dict[str, Callable[..., Memory]] = {
    "none": none,
    "residual": residual,
    "dgc": dgc,
    "efsignsgd": efsignsgd,
}


def make(name: str, **kwargs) -> Memory:
    """Build a memory by name: ``make("residual", beta=0.9)``.

    ``name`` is one of :func:`names` (``none``, ``residual``, ``dgc``, ``efsignsgd``); ``kwargs`` go
    to the factory of that name, whose docstring lists them.

    Raises:
      ValueError: unknown name (the message lists the valid ones).
    """
    return lookup(_FACTORIES, name, "memory")(**kwargs)


def names() -> list[str]:
    """Sorted names of the memories :func:`make` knows."""
    return sorted(_FACTORIES)
