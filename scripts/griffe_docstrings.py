"""Griffe extension used by the docs build: Sphinx-flavoured docstrings to mkdocstrings Markdown.

jaxcomm's docstrings are written to read well in ``help()`` and in the source: they use Sphinx
cross-reference roles (``:class:`Compressor```, ``:func:`~jaxcomm.wire_bits```) and bare doctest
blocks (``>>>`` lines). mkdocstrings renders docstrings as Markdown, where both would show up as
literal text. Before rendering, this extension rewrites every docstring of the package:

- each role becomes an *optional* cross-reference: a link when the target is rendered on some
  page of the site, plain code otherwise (so it never produces a build warning). Names are
  resolved in the object's scope the way Python would see them (members, imports, parents);
  ``~`` shows the last component only, ``:role:`title <target>``` shows ``title``;
- each run of doctest lines (``>>>``/``...`` and the expected output after them) is wrapped in a
  fenced ``pycon`` block, so it renders as a console session, without ``# doctest:`` directives;
- a reStructuredText literal-block marker (a line ending in ``::``) loses one colon: the indented
  block after it is already a Markdown code block.

It also drops a class's private bases (a name starting with ``_``, such as ``PartialAllreduce``'s
progress-thread base), so that an API page shows the public API only.

mkdocs.yml loads it with ``plugins.mkdocstrings.handlers.python.options.extensions``.
"""

from __future__ import annotations

import html
import re
from typing import Any

import griffe

__all__ = ["SphinxDocstrings", "convert_roles", "fence_doctests", "literal_markers", "public_bases"]

_ROLE = re.compile(
    r":(?:py:)?(?:class|func|meth|mod|attr|data|obj|exc|const|type)"
    r":`(?P<tilde>~?)(?P<body>[^`<]+?)(?:\s*<(?P<target>[^>`]+)>)?`"
)
_FENCE = re.compile(r"^\s*(```|~~~)")
_DOCTEST_FLAGS = re.compile(r"\s*#\s*doctest:.*$")


def _resolve(obj: griffe.Object, name: str) -> str | None:
    """Full path of ``name`` (possibly dotted) seen from ``obj``'s scope, or ``None``."""
    head, _, rest = name.partition(".")
    try:
        path = obj.resolve(head)
    except (griffe.NameResolutionError, AttributeError, KeyError):
        # Fully qualified names (jaxcomm.comm.MeshAxis) need no scope.
        return name if "." in name else None
    return f"{path}.{rest}" if rest else path


def convert_roles(text: str, obj: griffe.Object) -> str:
    """Replace Sphinx roles in ``text`` (outside code fences) by optional autorefs."""

    def one(match: re.Match) -> str:
        target = (match["target"] or match["body"]).strip().lstrip("~")
        if match["target"]:
            title = match["body"].strip()
        elif match["tilde"]:
            title = target.rsplit(".", 1)[-1]
        else:
            title = target
        path = _resolve(obj, target)
        code = f"<code>{html.escape(title)}</code>"
        if path is None:
            return code
        return f'<autoref identifier="{html.escape(path)}" optional>{code}</autoref>'

    out, in_fence = [], False
    for line in text.split("\n"):
        if _FENCE.match(line):
            in_fence = not in_fence
        out.append(line if in_fence else _ROLE.sub(one, line))
    return "\n".join(out)


def fence_doctests(text: str) -> str:
    """Wrap runs of ``>>>`` lines (with their continuation and output lines) in pycon fences."""
    lines = text.split("\n")
    out: list[str] = []
    i, in_fence = 0, False
    while i < len(lines):
        line = lines[i]
        if _FENCE.match(line):
            in_fence = not in_fence
        if in_fence or not line.lstrip().startswith(">>>"):
            out.append(line)
            i += 1
            continue
        indent = line[: len(line) - len(line.lstrip())]
        block = []
        while i < len(lines) and lines[i].strip() and lines[i].startswith(indent):
            block.append(_DOCTEST_FLAGS.sub("", lines[i][len(indent) :]))
            i += 1
        out.extend([f"{indent}```pycon", *(f"{indent}{b}" for b in block), f"{indent}```"])
    return "\n".join(out)


def literal_markers(text: str) -> str:
    """``text::`` at the end of a line (outside fences) becomes ``text:``; a bare ``::`` line goes."""
    out, in_fence = [], False
    for line in text.split("\n"):
        if _FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence and line.rstrip().endswith("::"):
            line = line.rstrip()[:-1]
            if line.strip() == ":":
                line = ""
        out.append(line)
    return "\n".join(out)


def _walk(obj: griffe.Object, seen: set[int]) -> None:
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if obj.docstring is not None:
        value = literal_markers(fence_doctests(convert_roles(obj.docstring.value, obj)))
        if value != obj.docstring.value:
            obj.docstring.value = value
            obj.docstring.__dict__.pop("parsed", None)  # drop a cached parse, if any
    for member in obj.members.values():
        if not member.is_alias:
            _walk(member, seen)


def public_bases(obj: griffe.Object, seen: set[int] | None = None) -> None:
    """Drop every class's private bases (last dotted component starting with ``_``) under ``obj``.

    Runs after the docstrings are rewritten, whose cross-references may resolve through a base.
    """
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if obj.is_class:
        obj.bases = [b for b in obj.bases if not str(b).split("[")[0].rsplit(".", 1)[-1].startswith("_")]
    for member in obj.members.values():
        if not member.is_alias:
            public_bases(member, seen)


class SphinxDocstrings(griffe.Extension):
    """Rewrite every docstring of a loaded package and drop private bases (see the module docstring)."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:  # griffe >= 2
        _walk(pkg, set())
        public_bases(pkg)

    def on_package_loaded(self, *, pkg: griffe.Module, **kwargs: Any) -> None:  # griffe 1.x
        _walk(pkg, set())
        public_bases(pkg)
