"""A flat, deterministic description of what a transformation computes, for checkpoint identity.

An optax transformation is a pair of closures; what it computes is fixed by the
functions in the chain and the values they captured: the compressor records
(name, hyper-parameters), the memory, the strategy, the optimizer's learning rate
and momentum, the schedules. :func:`describe` walks that graph -- a function's
closure cells (named by the variables they bind) and defaults, dataclasses,
named tuples, containers, object attributes -- and writes one entry per node::

    tx.update.transforms[1].update.step_size  ->  "-0.1"

Functions are named by module and qualified name (their code is not hashed),
arrays by dtype, shape and, up to ``ARRAY_DIGEST_MAX`` entries, a SHA-256 of
their bytes. An object the walk cannot open (a C extension type) is named by its
type only. Nothing depends on object identity or memory addresses, so the same
construction gives the same description in another process. What it does not
see: the body of a function (an edited ``lambda`` with the same name and
captures), module-level globals a function reads, and arrays of more than
``ARRAY_DIGEST_MAX`` entries beyond their shape.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import types
from typing import Any

import jax
import numpy as np

__all__ = ["describe", "ARRAY_DIGEST_MAX", "MAX_ENTRIES"]

ARRAY_DIGEST_MAX = 1 << 16
"""Arrays of at most this many entries are described by a digest of their bytes, larger ones by shape."""

MAX_ENTRIES = 20_000
"""The walk stops after this many entries (the last one says so)."""

_SCALARS = (type(None), bool, int, float, complex, str, bytes)


def describe(obj, root: str = "tx") -> dict[str, str]:
    """``{path: description}`` of ``obj`` and everything it holds (see the module docstring).

    Long because its recursive ``visit`` shares the output and the cycle guard; ``visit`` is one short case
    per kind of value.

    Args:
      obj: an optax transformation, a loss function, or any Python value.
      root: the name of ``obj`` in the paths.
    Returns:
      An insertion-ordered ``dict`` of strings (JSON-serialisable), equal for equal
      constructions in any process.
    """
    out: dict[str, str] = {}
    seen: dict[int, str] = {}

    def put(path: str, text: str) -> bool:
        if len(out) >= MAX_ENTRIES:
            out.setdefault("<truncated>", f"more than {MAX_ENTRIES} entries")
            return False
        out[path] = text
        return True

    def visit(x: Any, path: str, depth: int) -> None:
        """Describe ``x`` at ``path`` and, recursively, what it holds (a shared object once; ``depth`` guards
        the recursion).

        Long because it is one short case per kind of value (scalars, arrays, functions, partials,
        dataclasses, containers), tried in order.
        """
        if isinstance(x, _SCALARS):
            put(path, repr(x))
            return
        if isinstance(x, np.generic):
            put(path, f"{type(x).__name__}({x.item()!r})")
            return
        if isinstance(x, enum.Enum):
            put(path, f"{type(x).__qualname__}.{x.name}")
            return
        if isinstance(x, (np.ndarray, jax.Array)):
            put(path, _describe_array(x))
            return
        if isinstance(x, (types.ModuleType, type)):
            put(path, f"{'module' if isinstance(x, types.ModuleType) else 'class'} {_name(x)}")
            return
        if id(x) in seen:  # shared (the init and update of one transformation) or a cycle
            put(path, f"same as {seen[id(x)]}")
            return
        seen[id(x)] = path
        if depth > 48:
            put(path, f"{type(x).__qualname__} (not described deeper)")
            return
        d = depth + 1
        if isinstance(x, types.FunctionType):
            if not put(path, f"function {_name(x)}"):
                return
            for name, cell in zip(x.__code__.co_freevars, x.__closure__ or ()):
                try:
                    value = cell.cell_contents
                except ValueError:  # a cell not yet bound
                    continue
                visit(value, f"{path}.{name}", d)
            for i, value in enumerate(x.__defaults__ or ()):
                visit(value, f"{path}.defaults[{i}]", d)
            for name, value in sorted((x.__kwdefaults__ or {}).items()):
                visit(value, f"{path}.{name}=", d)
            return
        if isinstance(x, types.MethodType):
            put(path, f"method {_name(x.__func__)}")
            visit(x.__self__, f"{path}.self", d)
            return
        if isinstance(x, functools.partial):
            put(path, "functools.partial")
            visit(x.func, f"{path}.func", d)
            for i, value in enumerate(x.args):
                visit(value, f"{path}.args[{i}]", d)
            for name, value in sorted(x.keywords.items()):
                visit(value, f"{path}.{name}=", d)
            return
        if isinstance(x, (types.BuiltinFunctionType, types.BuiltinMethodType)):
            put(path, f"builtin {_name(x)}")
            return
        if dataclasses.is_dataclass(x):
            put(path, _name(type(x)))
            for f in dataclasses.fields(x):
                visit(getattr(x, f.name, None), f"{path}.{f.name}", d)
            return
        if isinstance(x, tuple) and hasattr(x, "_fields"):  # a NamedTuple (optax's transformations)
            put(path, _name(type(x)))
            for name, value in zip(x._fields, x):
                visit(value, f"{path}.{name}", d)
            return
        if isinstance(x, (list, tuple)):
            put(path, f"{type(x).__name__} of {len(x)}")
            for i, value in enumerate(x):
                visit(value, f"{path}[{i}]", d)
            return
        if isinstance(x, dict):
            put(path, f"{type(x).__name__} of {len(x)}")
            for key in sorted(x, key=repr):
                visit(x[key], f"{path}[{key!r}]", d)
            return
        if isinstance(x, (set, frozenset)):
            put(path, f"{type(x).__name__} {sorted(repr(v) for v in x)}")
            return
        wrapped = getattr(x, "__wrapped__", None)  # jax.jit, functools.wraps
        put(path, f"object {_name(type(x))}")
        if callable(wrapped):
            visit(wrapped, f"{path}.wrapped", d)
        attrs = getattr(x, "__dict__", None)
        if isinstance(attrs, dict):
            for name in sorted(attrs):
                if not name.startswith("__"):  # __wrapped__ above; __annotations__, __doc__...: no computation
                    visit(attrs[name], f"{path}.{name}", d)

    visit(obj, root, 0)
    return out


def _name(x) -> str:
    return f"{getattr(x, '__module__', None) or '?'}.{getattr(x, '__qualname__', None) or type(x).__qualname__}"


def _describe_array(x) -> str:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return f"{x.dtype}{list(x.shape)} (not addressable here)"
    shape = list(np.shape(x))
    if int(np.prod(shape, dtype=np.int64)) > ARRAY_DIGEST_MAX:
        return f"{x.dtype}{shape}"
    a = np.ascontiguousarray(np.asarray(x))
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):  # typed keys: their key data
        a = np.asarray(jax.random.key_data(x))
    return f"{x.dtype}{shape} sha256:{hashlib.sha256(a.tobytes()).hexdigest()[:16]}"
