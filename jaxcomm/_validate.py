"""Argument checks shared by every package, made before any work starts.

Each check raises ``TypeError`` (wrong kind of value) or ``ValueError`` (right kind, out of
range) with a message that names the argument and what it got, and returns the value in the
form the caller uses (``int``, ``float``, ``bool``). Hyper-parameters whose value Python needs
(an array shape, a bit width, a branch) are *static*: a JAX array or tracer is refused with a
message naming ``optax.inject_hyperparams``'s ``static_args`` (:func:`check_static`).

The module imports NumPy only: a value cannot be a JAX array unless JAX is imported, so the
static checks look for JAX in ``sys.modules``, and the checks of arrays and keys import it when
called. A JAX-free module (``jaxcomm.topology``) can use the checks and stay light.

The checks tied to one package stay with it (a compressor's state shapes:
``jaxcomm.compressors``; a communicator's capabilities: ``jaxcomm.comm``).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Collection, Mapping
from typing import Any, TypeVar

import numpy as np

__all__ = [
    "SEED_LIMIT",
    "as_count",
    "check_bool",
    "check_choice",
    "check_finite_scalar",
    "check_float_input",
    "check_int",
    "check_key",
    "check_ratio",
    "check_same_tree",
    "check_seed",
    "check_static",
    "lookup",
]

_T = TypeVar("_T")

_STATIC_INT = "its value is needed in Python: an array shape, a count, a bit width or a number of levels"
_STATIC_FLOAT = "its value is used in Python when the object is built"


def _is_jax(value) -> bool:
    """Whether ``value`` is a JAX array or tracer (never, while JAX is not imported)."""
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(value, (jax.Array, jax.core.Tracer))


def check_static(name: str, value, why: str) -> None:
    """Raise ``TypeError`` if a static hyper-parameter is a JAX array (traced or injected).

    A hyper-parameter is static when Python needs its value while the object is
    built or traced (``why``: it fixes an array shape, a bit width, a number of
    levels, a branch). ``optax.inject_hyperparams`` turns every numeric argument
    into a JAX array unless it is named in ``static_args``; the error says so.
    """
    if _is_jax(value):
        raise TypeError(
            f"{name} is a static hyper-parameter ({why}), so it must be a Python number, not a JAX array or "
            f"tracer ({type(value).__name__}); with optax.inject_hyperparams pass it in static_args, e.g. "
            f"optax.inject_hyperparams(factory, static_args=({name!r},))"
        )


def check_int(value, name: str, minimum: int = 1, *, maximum: int | None = None, why: str = _STATIC_INT) -> int:
    """``value`` as an ``int`` in ``[minimum, maximum]`` (``maximum=None``: no upper end).

    Python and NumPy integers are accepted, ``bool`` is not; a JAX array is refused as
    static (:func:`check_static`, with ``why``).

    Raises:
      TypeError: ``value`` is not an integer.
      ValueError: ``value`` is outside the range.
    """
    check_static(name, value, why)
    span = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer {span}; got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        raise ValueError(f"{name} must be {span}; got {value}")
    return int(value)


def as_count(value, name: str) -> int:
    """A count held as a number of any type (``float32`` sums of whole numbers, NumPy or
    Python floats, a 0-d array) as the exact Python ``int`` it holds.

    Raises:
      TypeError: ``value`` is not a real number (``bool`` included).
      ValueError: ``value`` is negative, not finite or not a whole number: it is no count.
    """
    if _is_jax(value) or isinstance(value, np.ndarray):
        value = np.asarray(value)
        if value.shape != ():
            raise TypeError(f"{name} must be a single count; got an array of shape {value.shape}")
        value = value.item()
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a count (a whole number >= 0); got {value!r}")
    if isinstance(value, (float, np.floating)) and not (math.isfinite(value) and float(value).is_integer()):
        raise ValueError(f"{name} must be a count (a whole number >= 0); got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be a count (a whole number >= 0); got {value!r}")
    return int(value)


def check_bool(value, name: str) -> bool:
    """``value`` as a ``bool``: ``True``/``False`` or a NumPy bool; anything else (``0``, ``"yes"``) is refused.

    Raises:
      TypeError: ``value`` is not a bool.
    """
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool (True or False); got {value!r}")
    return bool(value)


def check_choice(value, name: str, choices: Collection) -> Any:
    """``value`` if it is one of ``choices``.

    Raises:
      ValueError: ``value`` is not one of ``choices`` (the message lists them).
    """
    try:
        ok = value in choices
    except TypeError:  # an unhashable value looked up in a set
        ok = False
    if not ok:
        raise ValueError(f"{name} must be one of {tuple(choices)}; got {value!r}")
    return value


def lookup(table: Mapping[str, _T], name, what: str) -> _T:
    """``table[name]``: the entry a name picks from a table of named choices (a registry of factories).

    Raises:
      ValueError: ``name`` is not a key of ``table``; the message calls it an unknown ``what`` and
        lists the keys, sorted.
    """
    try:
        return table[name]
    except (KeyError, TypeError):  # TypeError: an unhashable name
        raise ValueError(f"unknown {what} {name!r}; valid names: {', '.join(sorted(table))}") from None


def _concrete_scalar(value, name: str):
    """A traced real scalar in float32, a concrete 0-d real JAX array as a Python number, anything else unchanged."""
    if not _is_jax(value):
        return value
    import jax
    import jax.numpy as jnp

    dtype = jnp.result_type(value)
    if jnp.ndim(value) != 0 or not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
        raise TypeError(f"{name} must be a real scalar; got a {dtype} array of shape {jnp.shape(value)}")
    if isinstance(value, jax.core.Tracer):  # float32, the compressors' arithmetic (inject may give bf16, f64)
        return value.astype(jnp.float32)
    return value.item()


def check_finite_scalar(
    value,
    name: str,
    positive: bool = False,
    nonnegative: bool = False,
    *,
    traceable: bool = False,
    why: str = _STATIC_FLOAT,
):
    """``value`` as a finite ``float`` (``> 0`` with ``positive``, ``>= 0`` with ``nonnegative``).

    ``traceable``: the value is used only in array arithmetic, so a traced scalar
    (``optax.inject_hyperparams`` under ``jax.jit``) is returned as float32,
    unchecked (its value is unknown at trace time), and a concrete 0-d JAX array is
    checked like a Python number. Otherwise the value is static
    (:func:`check_static`, with ``why``).

    Raises:
      TypeError: ``value`` is not a real number (``bool`` included).
      ValueError: ``value`` is not finite, or outside the sign asked for.
    """
    if traceable:
        value = _concrete_scalar(value, name)
        if _is_jax(value):  # a tracer
            return value
    else:
        check_static(name, value, why)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"{name} must be a real number; got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite; got {value}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0; got {value}")
    if nonnegative and value < 0:
        raise ValueError(f"{name} must be >= 0; got {value}")
    return value


def check_ratio(ratio, name: str = "ratio", why: str = "it fixes a buffer or selection size, an array shape") -> float:
    """``ratio`` as a ``float`` in ``(0, 1]`` (static: see :func:`check_static`).

    Raises:
      TypeError: ``ratio`` is not a real number.
      ValueError: ``ratio`` is not in ``(0, 1]``.
    """
    check_static(name, ratio, why)
    if isinstance(ratio, (bool, np.bool_)) or not isinstance(ratio, (int, float, np.floating, np.integer)):
        raise TypeError(f"{name} must be a real number in (0, 1]; got {type(ratio).__name__}")
    ratio = float(ratio)
    if not math.isfinite(ratio) or not 0.0 < ratio <= 1.0:
        raise ValueError(f"{name} must be in (0, 1]; got {ratio}")
    return ratio


SEED_LIMIT = 2**32
"""Seeds are integers in ``[0, 2**32)``: ``jax.random.PRNGKey`` keeps the low 32 bits without x64,
so larger seeds would alias smaller ones (``PRNGKey(2**32) == PRNGKey(0)``)."""


def check_seed(seed, name: str = "seed") -> Any:
    """Validate a seed: an integer in ``[0, 2**32)`` (:data:`SEED_LIMIT`), or a traced integer scalar.

    The seed is read once, by ``init`` (``PRNGKey(seed)``); the key then lives in
    the optax state. ``optax.inject_hyperparams`` injects it like any number, so a
    traced seed is accepted (changing it after ``init`` has no effect).
    """
    if not _is_jax(seed):
        return _check_seed_value(check_int(seed, name, minimum=0), name)
    import jax
    import jax.numpy as jnp

    if isinstance(seed, jax.core.Tracer):
        if jnp.ndim(seed) != 0 or not jnp.issubdtype(jnp.result_type(seed), jnp.integer):
            raise TypeError(f"{name} must be an integer scalar; got a traced {jnp.result_type(seed)}{jnp.shape(seed)}")
        return seed
    if isinstance(seed, jax.Array) and jnp.ndim(seed) == 0 and jnp.issubdtype(seed.dtype, jnp.integer):
        seed = seed.item()
    return _check_seed_value(check_int(seed, name, minimum=0), name)


def _check_seed_value(seed: int, name: str) -> int:
    if seed >= SEED_LIMIT:
        raise ValueError(
            f"{name} must be below 2**32 = {SEED_LIMIT}; got {seed}: PRNGKey keeps 32 bits of it without x64, "
            f"so {seed} would give the same key as {seed % SEED_LIMIT}"
        )
    return seed


def check_key(key, name: str = "key") -> None:
    """Raise ``TypeError`` unless ``key`` is a JAX PRNG key: a raw ``uint32[2]`` array
    (``jax.random.PRNGKey``) or a scalar typed key (``jax.random.key``); traced keys are checked by shape and dtype."""
    import jax
    import jax.numpy as jnp

    if isinstance(key, (jax.Array, jax.core.Tracer, np.ndarray)):
        dtype = jnp.result_type(key)
        if jnp.issubdtype(dtype, jax.dtypes.prng_key) and jnp.ndim(key) == 0:
            return
        if dtype == jnp.uint32 and jnp.shape(key) == (2,):
            return
        what = f"a {dtype} array of shape {tuple(jnp.shape(key))}"
    else:
        what = type(key).__name__
    raise TypeError(
        f"{name} must be a single JAX PRNG key (jax.random.PRNGKey(seed), uint32[2], or jax.random.key(seed)); "
        f"got {what}"
    )


def check_float_input(x, name: str = "x", *, nonempty: bool = False) -> None:
    """Raise ``TypeError`` unless ``x`` is an array with a real floating dtype; with ``nonempty``,
    ``ValueError`` if it has no entries (a size-0 array has no scale, norm or selection to compute)."""
    import jax.numpy as jnp

    try:
        dtype = jnp.result_type(x)
    except TypeError:
        raise TypeError(
            f"{name} must be a JAX or NumPy array with a real floating dtype; got {type(x).__name__} "
            "(wrap a list with jnp.asarray(..., jnp.float32))"
        ) from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"{name} must have a real floating dtype (float16/bfloat16/float32/float64); got {dtype}. "
            "Compressors act on gradients, which are real floating point."
        )
    if nonempty and np.size(x) == 0:
        raise ValueError(
            f"{name} has no entries (shape {tuple(np.shape(x))}); compressors act on non-empty arrays: "
            "leave size-0 leaves out of the compressed tree (e.g. with optax.masked)"
        )


def check_same_tree(updates, reference, what: str, name: str = "updates") -> None:
    """Raise ``ValueError`` unless ``updates`` has ``reference``'s tree structure and leaf shapes
    (``reference``: a state tree built by ``init`` from the parameters, described by ``what``)."""
    import jax
    import jax.numpy as jnp

    got: Any = jax.tree_util.tree_structure(updates)
    want: Any = jax.tree_util.tree_structure(reference)
    if got != want:
        raise ValueError(
            f"{name} has tree structure {got} but {what} was initialised for {want}; "
            "init and update must see the same tree"
        )
    for i, (g, r) in enumerate(zip(jax.tree_util.tree_leaves(updates), jax.tree_util.tree_leaves(reference))):
        if tuple(jnp.shape(g)) != tuple(jnp.shape(r)):
            raise ValueError(
                f"{name}: leaf {i} has shape {tuple(jnp.shape(g))} but {what} was initialised for shape "
                f"{tuple(jnp.shape(r))}; init and update must see the same leaf shapes"
            )
