"""Method specs ``COMPRESSOR[(k=v, ...)][+MEMORY[(k=v, ...)]][@STRATEGY]``, parsed without JAX.

:func:`parse_method` checks a spec's grammar, its names and its keyword names against the
factories' signatures, and the kind of every value, importing neither JAX nor the
compressors: a bad spec is refused in the time Python takes to start. The signatures come
from a table built once, on first use, from the source of ``jaxcomm/compressors``
(functions decorated ``@register("name")``), ``jaxcomm/memory.py`` (its ``_FACTORIES``)
and ``jaxcomm/transforms/_strategies.py`` (the keys of ``TABLE``), read with :mod:`ast`; where
``jaxcomm.compressors`` is already imported, the live registry (compressors registered at
run time included) is read instead, with :func:`inspect.signature`.

:func:`check_methods` then builds each compressor and memory, so that the factories check
the values (``topk(ratio=5)``); that imports JAX.

Bounds: a spec has at most :data:`MAX_SPEC_CHARS` characters and brackets nested at most
:data:`MAX_DEPTH` deep; a value is one literal -- a number (finite, integers within 64 bits),
a string, ``True``, ``False`` or ``None``.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import math
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

__all__ = ["MAX_DEPTH", "MAX_SPEC_CHARS", "Signature", "check_methods", "parse_method", "signatures"]

MAX_SPEC_CHARS = 1000
"""The longest method spec accepted, in characters."""
MAX_DEPTH = 2
"""The deepest bracket nesting accepted in a spec (a call's parentheses are depth 1)."""

_PACKAGE = Path(__file__).resolve().parent
_SYNTAX = "expected NAME or NAME(key=value, ...), e.g. topk(ratio=0.01)"


@dataclasses.dataclass(frozen=True)
class Signature:
    """What a factory accepts as keywords.

    Attributes:
      params: the names it takes as keywords, in order.
      required: those without a default.
      var_keyword: it also takes any other keyword (``**kwargs``).
    """

    params: tuple[str, ...]
    required: tuple[str, ...]
    var_keyword: bool = False

    @classmethod
    def of_function(cls, fn: Callable) -> Signature:
        """The signature of a live function (:func:`inspect.signature`, through ``functools.wraps``)."""
        params, required, var_kw = [], [], False
        for p in inspect.signature(fn).parameters.values():
            if p.kind is p.VAR_KEYWORD:
                var_kw = True
            elif p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                params.append(p.name)
                if p.default is p.empty:
                    required.append(p.name)
        return cls(tuple(params), tuple(required), var_kw)

    @classmethod
    def of_source(cls, fn: ast.FunctionDef) -> Signature:
        """The signature of a function definition read with :mod:`ast` (the same fields as :meth:`of_function`)."""
        a = fn.args
        positional = a.args  # positional-only parameters (a.posonlyargs) cannot be keywords
        with_default = {arg.arg for arg in positional[len(positional) - len(a.defaults) :]}
        with_default |= {arg.arg for arg, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None}
        params = [arg.arg for arg in (*positional, *a.kwonlyargs)]
        return cls(tuple(params), tuple(p for p in params if p not in with_default), a.kwarg is not None)


def _module_tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


@functools.cache
def _source_compressors() -> dict[str, Signature]:
    """Registry name -> signature of every ``@register("name")`` factory under ``jaxcomm/compressors``."""
    table = {}
    for path in sorted((_PACKAGE / "compressors").glob("*.py")):
        if "@register(" not in path.read_text(encoding="utf-8"):
            continue
        for node in _module_tree(path).body:
            if not isinstance(node, ast.FunctionDef):
                continue
            for deco in node.decorator_list:
                if (
                    isinstance(deco, ast.Call)
                    and isinstance(deco.func, ast.Name)
                    and deco.func.id == "register"
                    and deco.args
                    and isinstance(deco.args[0], ast.Constant)
                ):
                    table[str(deco.args[0].value)] = Signature.of_source(node)
    return table


@functools.cache
def _source_memories() -> dict[str, Signature]:
    """Name -> signature of every factory in ``jaxcomm/memory.py``'s ``_FACTORIES``."""
    tree = _module_tree(_PACKAGE / "memory.py")
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    for node in tree.body:
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or not isinstance(node.value, ast.Dict):
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        if any(isinstance(t, ast.Name) and t.id == "_FACTORIES" for t in targets):
            return {
                str(k.value): Signature.of_source(functions[v.id])
                for k, v in zip(node.value.keys, node.value.values)
                if isinstance(k, ast.Constant) and isinstance(v, ast.Name)
            }
    raise RuntimeError("jaxcomm/memory.py defines no _FACTORIES dict")  # pragma: no cover - a broken checkout


@functools.cache
def _source_strategies() -> tuple[str, ...]:
    """``STRATEGIES`` of ``jaxcomm/transforms/_strategies.py``: the keys of its ``TABLE`` dict, in order."""
    for node in _module_tree(_PACKAGE / "transforms" / "_strategies.py").body:
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Dict)
            and any(isinstance(t, ast.Name) and t.id == "TABLE" for t in node.targets)
        ):
            return tuple(ast.literal_eval(k) for k in node.value.keys if k is not None)
    raise RuntimeError("jaxcomm/transforms/_strategies.py defines no TABLE dict")  # pragma: no cover


def signatures() -> tuple[dict[str, Signature], dict[str, Signature], tuple[str, ...]]:
    """``(compressors, memories, strategies)``: name -> :class:`Signature`, and the strategy names.

    Read from the live modules where they are imported, else from their source (no import).
    """
    base = sys.modules.get("jaxcomm.compressors._base")
    if base is not None:
        comps = {name: Signature.of_function(base._REGISTRY[name]) for name in base.names()}
    else:
        comps = _source_compressors()
    mem = sys.modules.get("jaxcomm.memory")
    if mem is not None:
        mems = {name: Signature.of_function(f) for name, f in mem._FACTORIES.items()}
    else:
        mems = _source_memories()
    table = sys.modules.get("jaxcomm.transforms._strategies")
    strategies = tuple(table.STRATEGIES) if table is not None else _source_strategies()
    return comps, mems, strategies


def _depth(text: str) -> int:
    """The deepest nesting of ``( [ {`` in ``text`` outside string literals."""
    depth = deepest = 0
    quote = ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in ")]}":
            depth -= 1
    return deepest


def _literal(node: ast.expr, where: str):
    """The value of a scalar literal node: a finite number, a string, ``True``/``False``/``None``."""
    kinds = f"{where} must be one literal: a number, a string, True, False or None"
    negate = isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        node = node.operand
        if not (isinstance(node, ast.Constant) and type(node.value) in (int, float)):
            raise ValueError(kinds)
    if not isinstance(node, ast.Constant):
        raise ValueError(kinds)
    value = node.value
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        value = -value if negate else value
        if not -(2**63) <= value < 2**63:
            raise ValueError(f"{where} must be an integer within 64 bits; got one of {len(str(abs(value)))} digits")
        return value
    if isinstance(value, float):
        value = -value if negate else value
        if not math.isfinite(value):
            raise ValueError(f"{where} must be a finite number; got {value}")
        return value
    raise ValueError(kinds)  # bytes, complex, Ellipsis


def _call(text: str, spec: str, kind: str) -> tuple[str, list[ast.keyword], str]:
    """``"name(k=v, ...)"`` or ``"name"`` (the ``kind`` part of ``spec``): ``(name, keywords, where)``."""
    text = text.strip()
    where = f"method {spec!r}" + ("" if text == spec.strip() else f": {kind} {text!r}")
    try:
        node = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        raise ValueError(f"{where}: {_SYNTAX}") from None
    if isinstance(node, ast.Name):
        return node.id, [], where
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args:
        return node.func.id, node.keywords, where
    raise ValueError(f"{where}: {_SYNTAX}, with keywords only")


def _arguments(name: str, keywords: list[ast.keyword], where: str, kind: str, sig: Signature) -> dict:
    """The keyword arguments of a call, checked against the factory's signature ``sig``."""
    kwargs: dict = {}
    for kw in keywords:
        if kw.arg is None:
            raise ValueError(f"{where}: write each argument as key=value (no **)")
        if kw.arg in kwargs:
            raise ValueError(f"{where}: argument {kw.arg!r} given twice")
        if kw.arg not in sig.params and not sig.var_keyword:
            raise ValueError(
                f"{where}: bad arguments for {kind} {name!r}: unknown argument {kw.arg!r}; "
                f"valid: {', '.join(sig.params) or 'none'}"
            )
        kwargs[kw.arg] = _literal(kw.value, f"{where}: the value of {kw.arg}")
    missing = [p for p in sig.required if p not in kwargs]
    if missing:
        raise ValueError(f"{where}: bad arguments for {kind} {name!r}: give {', '.join(p + '=...' for p in missing)}")
    return kwargs


def parse_method(spec: str) -> tuple[tuple[str, dict], tuple[str, dict], str]:
    """Parse a method spec ``COMPRESSOR[(k=v,...)][+MEMORY[(k=v,...)]][@STRATEGY]`` (no JAX import).

    Examples: ``topk(ratio=0.01)+residual``, ``qsgd(levels=16)@allgather``,
    ``randomk(ratio=0.1)+residual(beta=0.9)@allgather``, ``none``. ``+EF`` is a synonym of
    ``+residual``. Returns ``((compressor, kwargs), (memory, kwargs), strategy)``; memory
    defaults to ``none``, strategy to ``auto``. Names and keyword names are checked against
    the factories' signatures (:func:`signatures`), each keyword at most once and every
    required one given; values are single literals. The values themselves are checked by
    the factories (:func:`check_methods`).

    Raises:
      ValueError: naming the part of the spec that is wrong and the valid choices, or the bound
        (:data:`MAX_SPEC_CHARS`, :data:`MAX_DEPTH`) it exceeds.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"method spec must be a non-empty string; got {spec!r}")
    if len(spec) > MAX_SPEC_CHARS:
        raise ValueError(f"method spec {spec[:40]!r}...: at most {MAX_SPEC_CHARS} characters; got {len(spec)}")
    if _depth(spec) > MAX_DEPTH:
        raise ValueError(f"method {spec!r}: brackets nested {_depth(spec)} deep; at most {MAX_DEPTH}")
    comps, mems, strategies = signatures()
    body, _, strategy = spec.partition("@")
    strategy = strategy.strip() or "auto"
    if strategy not in ("auto", *strategies):
        raise ValueError(f"method {spec!r}: unknown strategy {strategy!r}; valid: auto, {', '.join(strategies)}")
    depth, cut = 0, -1
    for i, ch in enumerate(body):  # the top-level '+' (not one inside a call's parentheses)
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "+" and depth == 0:
            cut = i
            break
    comp_text, mem_text = (body, "none") if cut < 0 else (body[:cut], body[cut + 1 :])
    mems = {**mems, "EF": mems["residual"]}
    calls = [
        (*_call(comp_text, spec, "compressor"), "compressor", comps),
        (*_call(mem_text, spec, "memory"), "memory", mems),
    ]
    for name, _, _, kind, table in calls:  # both names, then their arguments
        if name not in table:
            raise ValueError(f"method {spec!r}: unknown {kind} {name!r}; valid: {', '.join(sorted(table))}")
    (comp, comp_kw), (mem, mem_kw) = [(n, _arguments(n, kws, where, k, t[n])) for n, kws, where, k, t in calls]
    return (comp, comp_kw), ("residual" if mem == "EF" else mem, mem_kw), strategy


def check_methods(specs: Iterable[str]) -> None:
    """Parse every spec (:func:`parse_method`, no JAX), then build each one's compressor and memory.

    The factories check the values (``topk(ratio=5)``: ratio outside (0, 1]); building imports
    JAX, so a spec that does not parse is refused before it.

    Raises:
      ValueError: naming the spec and what is wrong with it.
    """
    parsed = [(spec, parse_method(spec)) for spec in specs]
    if not parsed:
        return
    from . import compressors, memory

    for spec, (comp, mem, _) in parsed:
        for make, (name, kwargs), what in ((compressors.make, comp, "compressor"), (memory.make, mem, "memory")):
            try:
                make(name, **kwargs)
            except (TypeError, ValueError, OverflowError) as e:
                raise ValueError(f"method {spec!r}: bad arguments for {what} {name!r}: {e}") from None
