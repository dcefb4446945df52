"""The documentation stays complete and true.

- Every public module of ``jaxcomm`` defines ``__all__``, every exported name has a docstring of
  its own, and every public module has an API page (``::: jaxcomm.<name>`` under docs/).
- ``mkdocs build --strict`` succeeds, and the docstrings' Sphinx roles and doctest blocks were
  turned into links and console sessions (scripts/griffe_docstrings.py).
- Every ``python`` code block in docs/ and README.md runs (unless its fence says
  ``not run``), and every docstring example (``>>>``) in the package passes as a doctest.
"""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import inspect
import json
import os
import pkgutil
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

import jaxcomm

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


# --------------------------------------------------------------------------- #
# Public surface
# --------------------------------------------------------------------------- #
def public_modules() -> list[str]:
    """Top-level public modules: jaxcomm/<name>(.py) not starting with "_", plus modules in __all__."""
    found = {m.name for m in pkgutil.iter_modules(jaxcomm.__path__) if not m.name.startswith("_")}
    found |= {n for n in jaxcomm.__all__ if isinstance(getattr(jaxcomm, n, None), types.ModuleType)}
    return sorted(found)


PUBLIC_MODULES = public_modules()

# The public surface: every (module, name) pair of the ``__all__`` of every public module, one whose
# dotted path has no part after ``jaxcomm`` starting with "_". A name a package re-exports from a
# public submodule counts twice. The studies' package (``jaxcomm.experiments``) is not counted.
SURFACE_LIMIT = 200
NOT_COUNTED = ("jaxcomm.experiments",)


def surface_modules() -> list[str]:
    """Every public module of jaxcomm, at any depth, outside :data:`NOT_COUNTED` (no import needed)."""
    found, todo = [], [("jaxcomm", list(jaxcomm.__path__))]
    while todo:
        name, path = todo.pop()
        found.append(name)
        for info in pkgutil.iter_modules(path):
            child = f"{name}.{info.name}"
            if info.name.startswith("_") or child in NOT_COUNTED:
                continue
            if info.ispkg:
                todo.append((child, [os.path.join(p, info.name) for p in path]))
            else:
                found.append(child)
    return sorted(found)


SURFACE_MODULES = surface_modules()


def test_surface_walk_sees_nested_modules_and_skips_private_ones():
    # The walk must reach public modules below the top level and leave private ones out.
    assert {"jaxcomm", "jaxcomm.compressors.payloads", "jaxcomm.data.fetch", "jaxcomm.comm"} <= set(SURFACE_MODULES)
    assert not [m for m in SURFACE_MODULES if any(p.startswith("_") for p in m.split(".")[1:])]
    assert not [m for m in SURFACE_MODULES if m.startswith(NOT_COUNTED)]


def test_public_surface_stays_readable():
    """At most SURFACE_LIMIT (module, name) pairs in the public modules' ``__all__``."""
    counts = {m: len(importlib.import_module(m).__all__) for m in SURFACE_MODULES}
    total = sum(counts.values())
    per_module = ", ".join(f"{m} {n}" for m, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    assert total <= SURFACE_LIMIT, (
        f"the public surface has {total} names > {SURFACE_LIMIT} ({per_module}): make internals private "
        "(drop them from __all__ and import them from the private module that defines them)"
    )


def test_public_modules_are_discovered():
    # The walk must see the package's core modules; an empty walk would make the checks vacuous.
    assert {"compressors", "comm", "studies"} <= set(PUBLIC_MODULES)


def _own_docstring(obj) -> str | None:
    """The docstring written for ``obj`` itself, or ``None`` (auto-generated or inherited)."""
    if inspect.isclass(obj):
        doc = obj.__dict__.get("__doc__")
        # NamedTuple and dataclass without a docstring get "Name(field, ...)".
        if doc and re.fullmatch(rf"{re.escape(obj.__name__)}\(.*\)", doc.strip(), flags=re.S):
            return None
        return doc
    doc = getattr(obj, "__doc__", None)
    # A callable object (functools.partial, a wrapper instance) without its own docstring shows
    # its class's.
    return None if doc == type(obj).__doc__ else doc


def _is_function_like(obj) -> bool:
    import functools

    return inspect.isroutine(obj) or isinstance(obj, functools.partial) or hasattr(obj, "__wrapped__")


def undocumented(module: types.ModuleType) -> list[str]:
    """Names in ``module.__all__`` without a docstring of their own (constants: the module's)."""
    missing = []
    for name in module.__all__:
        obj = getattr(module, name)
        if inspect.isclass(obj) or _is_function_like(obj) or isinstance(obj, types.ModuleType):
            doc = _own_docstring(obj)
        else:  # a constant: documented by the module that exports it
            doc = module.__doc__
        if not (doc and doc.strip()):
            missing.append(name)
    return missing


def test_top_level_names_have_docstrings():
    assert jaxcomm.__doc__ and jaxcomm.__doc__.strip()
    assert undocumented(jaxcomm) == []


@pytest.mark.parametrize(
    "name", sorted({*PUBLIC_MODULES, *(m.removeprefix("jaxcomm.") for m in SURFACE_MODULES if m != "jaxcomm")})
)
def test_public_module_exports_documented_names(name):
    module = importlib.import_module(f"jaxcomm.{name}")
    assert module.__doc__ and module.__doc__.strip(), f"jaxcomm.{name} has no module docstring"
    assert isinstance(getattr(module, "__all__", None), (list, tuple)), (
        f"jaxcomm.{name} must define __all__ (the public names its API page documents)"
    )
    absent = [n for n in module.__all__ if not hasattr(module, n)]
    assert absent == [], f"jaxcomm.{name}.__all__ names missing attributes: {absent}"
    assert undocumented(module) == [], f"jaxcomm.{name}: public names without a docstring"


def test_docstring_check_detects_missing_docs():
    # The checker itself: an undocumented function, partial and NamedTuple are reported,
    # documented ones and constants of a documented module are not.
    import functools
    from typing import NamedTuple

    def bare(x):
        return x

    def documented(x):
        """Identity."""
        return x

    class Bare(NamedTuple):
        a: int

    class Documented(NamedTuple):
        """A record."""

        a: int

    mod = types.ModuleType("fake", "A module.")
    mod.bare, mod.documented, mod.Bare, mod.Documented = bare, documented, Bare, Documented
    mod.part, mod.CONSTANT = functools.partial(documented), 3
    mod.__all__ = ["bare", "documented", "Bare", "Documented", "part", "CONSTANT"]
    assert undocumented(mod) == ["bare", "Bare", "part"]


def api_pages() -> dict[str, list[Path]]:
    """``module path -> pages`` for every ``::: jaxcomm...`` directive under docs/."""
    pages: dict[str, list[Path]] = {}
    for page in DOCS.rglob("*.md"):
        for match in re.finditer(r"^:::\s+(jaxcomm(?:\.\w+)*)\s*$", page.read_text(), flags=re.M):
            pages.setdefault(match.group(1), []).append(page)
    return pages


@pytest.mark.parametrize("name", ["jaxcomm", *(f"jaxcomm.{m}" for m in PUBLIC_MODULES)])
def test_public_module_has_api_page(name):
    pages = api_pages()
    assert name in pages, (
        f"{name} has no API page: create docs/api/{name.split('.')[-1] if '.' in name else 'jaxcomm'}.md "
        f"containing the line '::: {name}' and list it in the nav of mkdocs.yml"
    )
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in pages[name]:
        rel = page.relative_to(DOCS).as_posix()
        assert rel in nav, f"{rel} (API page of {name}) is not in the nav of mkdocs.yml"


# --------------------------------------------------------------------------- #
# The module map of docs/design.md matches the tree
# --------------------------------------------------------------------------- #
# An entry of the map: a module "name.py" or a folder "name/", standing alone (not "a/b" inside a word).
_MAP_ENTRY = re.compile(r"(?:^|(?<=[\s(,]))(\w+(?:\.py|/))(?=[\s,):]|$)")


def module_map_entries(block: str) -> dict[str, int]:
    """``path -> line`` for every module and folder a module-map block names (paths relative to the
    repository root, folders ending in ``/``).

    A line's entries belong to the folder opened by the nearest line above it that is less indented;
    a line that starts with a folder opens it, for the entries after it on the same line and for the
    more indented lines below (continuation lines included).
    """
    entries: dict[str, int] = {}
    stack = [(-1, "")]
    for number, line in enumerate(block.split("\n"), 1):
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        while stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1]
        for i, match in enumerate(_MAP_ENTRY.finditer(line)):
            path = parent + match.group(1)
            entries.setdefault(path, number)
            if i == 0 and match.start() == indent and path.endswith("/"):
                stack.append((indent, path))
                parent = path
    return entries


def test_module_map_parser():
    block = (
        "pkg/\n"
        "  a.py            one (cond/switch/loop carries)\n"
        "  sub/            b.py (x), c.py\n"
        "                  d.py, continued\n"
        "    e.py f.py\n"
        "  g.py h.py\n"
        "top/\n"
        "  x/              y.py: z\n"
    )
    assert module_map_entries(block) == {
        "pkg/": 1,
        "pkg/a.py": 2,
        "pkg/sub/": 3,
        "pkg/sub/b.py": 3,
        "pkg/sub/c.py": 3,
        "pkg/sub/d.py": 4,
        "pkg/sub/e.py": 5,
        "pkg/sub/f.py": 5,
        "pkg/g.py": 6,
        "pkg/h.py": 6,
        "top/": 7,
        "top/x/": 8,
        "top/x/y.py": 8,
    }


def design_module_map() -> dict[str, int]:
    """``path -> line of docs/design.md`` for the ``text`` block of its "## Module map" section."""
    text = (DOCS / "design.md").read_text()
    section = re.search(r"^## Module map\n(.*?)(?=^## )", text, flags=re.M | re.S)
    assert section, "docs/design.md has no '## Module map' section"
    blocks = [(line, code) for line, info, code in code_blocks(section.group(1)) if info == "text"]
    assert blocks, "the '## Module map' section of docs/design.md has no ```text block"
    first, code = blocks[0]
    offset = text[: section.start(1)].count("\n") + first - 1  # page line of the block's line 1, minus 1
    return {path: offset + line for path, line in module_map_entries(code).items()}


def tree_modules() -> list[str]:
    """Every module of ``jaxcomm/`` and ``experiments/`` (a subpackage's ``__init__.py`` as its folder)."""
    found = []
    for top in ("jaxcomm", "experiments"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if "__pycache__" in rel.parts:
                continue
            if rel.name == "__init__.py" and rel.parent != Path("jaxcomm"):
                found.append(rel.parent.as_posix() + "/")
            else:
                found.append(rel.as_posix())
    return found


def test_module_map_lists_every_module():
    modules = tree_modules()
    assert "jaxcomm/compressors/_base.py" in modules and "jaxcomm/comm/" in modules  # the walk sees the tree
    entries = design_module_map()
    missing = []
    for module in modules:
        if module not in entries:
            folder, name = module.rstrip("/").rpartition("/")[::2]
            name += "/" if module.endswith("/") else ""
            missing.append(
                f"{module}: add `{name}` with a few words on what it holds to the module map of docs/design.md "
                f"(the ```text block under '## Module map'), on a line indented under `{folder}/`"
            )
    assert not missing, "modules missing from the module map:\n" + "\n".join(missing)


def test_module_map_names_only_existing_modules():
    stale = [
        f"docs/design.md:{line} (module map): {path} does not exist (remove it, or indent it under its folder)"
        for path, line in design_module_map().items()
        if not (ROOT / path).exists()
    ]
    assert not stale, "\n".join(stale)


def test_cli_help_points_at_the_method_spec_page():
    """The ``jaxcomm`` help names no private module; the page it points to documents the grammar,
    and the page's example specs parse."""
    import jaxcomm.cli as cli
    from experiments._common import parse_method
    from jaxcomm.studies import _split_top

    doc = cli.__doc__ or ""
    assert re.findall(r"jaxcomm(?:\.\w+)*\._\w+", doc) == [], "the CLI help points at a private module"
    pointers = re.findall(r'section "([^"]+)" \(``(docs/[\w/.-]+)``\)', doc)
    assert pointers, 'the CLI help must name its docs page: section "TITLE" (``docs/PAGE.md``)'
    for title, page in pointers:
        text = (ROOT / page).read_text()
        assert re.search(rf"^## {re.escape(title)}$", text, flags=re.M), f"{page} has no section '## {title}'"
    page = (DOCS / "api" / "cli.md").read_text()
    specs = [s for _, info, code in code_blocks(page) if info == "bash" for s in re.findall(r"methods=([^'\n]+)", code)]
    assert specs, "docs/api/cli.md shows no example --set methods=..."
    for spec in specs:
        for method in _split_top(spec):  # as `--set methods=...` splits it
            parse_method(method)  # raises ValueError, naming the part, if the documented example is wrong


# --------------------------------------------------------------------------- #
# No tracker words in what users read
# --------------------------------------------------------------------------- #
# Words that belong to an issue tracker or a work log, not to a user's documentation. Links (an
# upstream project's GitHub issue) are allowed: URLs are removed before matching.
TRACKER_WORDS = re.compile(
    r"\bissues?\s*#?\d+|\bthis session\b|\bin the time available\b|\blab notebook\b",
    flags=re.I,
)


def tracker_words(text: str) -> list[tuple[int, str]]:
    """``(line number, matched words)`` for each tracker word in ``text``, URLs excepted."""
    hits = []
    for number, line in enumerate(text.split("\n"), 1):
        for match in TRACKER_WORDS.finditer(re.sub(r"https?://\S+", "", line)):
            hits.append((number, match.group(0)))
    return hits


def test_tracker_words_are_found():
    text = "Target (issue 4): at most 1.05.\nsee [jax#1](https://github.com/jax-ml/jax/issues/123)\nIssues #12"
    assert tracker_words(text) == [(1, "issue 4"), (3, "Issues #12")]


def user_facing_texts() -> list[tuple[str, int, str]]:
    """``(file, first line, text)``: README.md, CHANGELOG.md, the pages under docs/, and every
    docstring of the package and of the benchmark and study scripts (their ``--help``)."""
    import ast

    texts = [(p.relative_to(ROOT).as_posix(), 1, p.read_text()) for p in [ROOT / "README.md", ROOT / "CHANGELOG.md"]]
    texts += [(p.relative_to(ROOT).as_posix(), 1, p.read_text()) for p in sorted(DOCS.rglob("*.md"))]
    for path in sorted([*(ROOT / "jaxcomm").rglob("*.py"), *(ROOT / "experiments").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc:
                    line = node.body[0].lineno
                    texts.append((path.relative_to(ROOT).as_posix(), line, doc))
    return texts


def test_no_tracker_words_in_user_facing_docs():
    found = [
        f"{name}:{first + number - 1}: {words!r}"
        for name, first, text in user_facing_texts()
        for number, words in tracker_words(text)
    ]
    assert not found, (
        "tracker or work-log words in user-facing text (say what the library does and what was "
        "measured, not which issue or run it came from):\n" + "\n".join(found)
    )


# --------------------------------------------------------------------------- #
# Results files: the ones the docs cite exist, and each is named by what it measures
# --------------------------------------------------------------------------- #
BENCH_RESULTS = ROOT / "experiments" / "benchmarks" / "results"
_CITED_JSON = re.compile(r"(?<![\w/.-])((?:experiments/[\w-]+/results|docs/img|results|history)/[\w./{},-]+?\.json)")
# Words that say when or how a run was made rather than what it measures.
RUN_HISTORY_WORDS = re.compile(r"(?:^|[_.-])(before|after|rerun|run\d*|quiet|old|pair\d*)(?=$|[_.-])", flags=re.I)


def cited_results(text: str) -> list[str]:
    """Results-file paths cited in ``text``, relative to the repository root: ``results/X`` and
    ``history/X`` are the benchmarks' (``experiments/benchmarks/results/``); ``{1,2}`` expands."""
    found = []
    for path in _CITED_JSON.findall(text):
        brace = re.search(r"\{([^}]*)\}", path)
        paths = [path[: brace.start()] + p + path[brace.end() :] for p in brace[1].split(",")] if brace else [path]
        for p in paths:
            if p.startswith("history/"):
                p = "results/" + p
            found.append("experiments/benchmarks/" + p if p.startswith("results/") else p)
    return found


def test_cited_results_parser():
    text = "(`results/a_{1,2}.json`, `history/b.json`) and experiments/x/results/c.json, docs/img/d/e.json; OUT.json"
    assert cited_results(text) == [
        "experiments/benchmarks/results/a_1.json",
        "experiments/benchmarks/results/a_2.json",
        "experiments/benchmarks/results/history/b.json",
        "experiments/x/results/c.json",
        "docs/img/d/e.json",
    ]
    names = ["step_before_fusion", "topk_run1", "x_rerun", "quiet", "y_old", "z_pair2", "a-after"]
    assert all(RUN_HISTORY_WORDS.search(n) for n in names)
    assert not any(RUN_HISTORY_WORDS.search(n) for n in ["fold_runtime", "bold", "threshold", "powersgd_fused"])


def test_cited_results_files_exist():
    pages = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted(DOCS.rglob("*.md"))]
    missing = [
        f"{page.relative_to(ROOT)}: {path}"
        for page in pages
        for path in cited_results(page.read_text())
        if not (ROOT / path).is_file()
    ]
    assert not missing, "results files cited in the docs but not in the repository:\n" + "\n".join(missing)


def test_results_files_are_named_by_what_they_measure():
    files = [*ROOT.glob("experiments/*/results/**/*.*"), *(ROOT / "docs" / "img").rglob("*.json")]
    assert any(f.parent == BENCH_RESULTS for f in files)
    named = [f.relative_to(ROOT).as_posix() for f in files if RUN_HISTORY_WORDS.search(f.stem)]
    assert not named, "results files named by when or how they ran, not by what they measure:\n" + "\n".join(named)


# --------------------------------------------------------------------------- #
# The site builds, strictly
# --------------------------------------------------------------------------- #
@pytest.mark.docs
def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra is not installed (pip install -e .[docs])")
    pytest.importorskip("mkdocstrings_handlers.python", reason="the docs extra is not installed")
    site = tmp_path / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"

    # Every public module's API page was rendered with its members.
    for name in PUBLIC_MODULES:
        page = site / "api" / name / "index.html"
        assert page.exists(), f"no rendered API page for jaxcomm.{name}"
        assert f'id="jaxcomm.{name}"' in page.read_text(), f"{page} does not document jaxcomm.{name}"

    # The griffe extension ran: no raw Sphinx role or bare doctest prompt reached the HTML.
    compressors = (site / "api" / "compressors" / "index.html").read_text()
    assert 'class="gp"' in compressors  # the module docstring's >>> example is a console block
    for page in (site / "api").rglob("*.html"):
        text = page.read_text()
        raw = re.findall(r":(?:class|func|meth|mod|attr|data|obj|exc):`", text)
        assert raw == [], f"{page}: unconverted Sphinx roles {raw[:3]}"
    # Only the public API: PartialAllreduce's private base class is not shown.
    comm = (site / "api" / "comm" / "index.html").read_text()
    assert 'id="jaxcomm.comm.PartialAllreduce"' in comm and "_ProgressThread" not in comm


# --------------------------------------------------------------------------- #
# Examples in the docs run
# --------------------------------------------------------------------------- #
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^\n`]*)$")


def code_blocks(text: str) -> list[tuple[int, str, str]]:
    """Fenced blocks of a Markdown page as ``(first code line number, info string, code)``."""
    blocks, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = m["indent"], m["fence"], m["info"].strip()
        body, start = [], i + 2
        i += 1
        while i < len(lines) and not re.match(rf"^{re.escape(indent)}{fence[0]}{{{len(fence)},}}\s*$", lines[i]):
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        blocks.append((start, info, "\n".join(body)))
        i += 1
    return blocks


def runnable(info: str) -> bool:
    """A ``python``/``py`` block runs unless its fence's info string says ``not run``."""
    words = re.split(r"[\s{}.]+", info.strip())
    return bool(words) and words[0] in ("python", "py") and "not run" not in info.lower()


def test_code_block_parser():
    page = (
        'Text\n\n```python\nx = 1\n```\n\n```python title="a (not run here)"\ny = 2\n```\n'
        "\n- item\n\n    ```py\n    z = 3\n    ```\n\n```bash\nls\n```\n"
    )
    blocks = code_blocks(page)
    assert [(info, code) for _, info, code in blocks] == [
        ("python", "x = 1"),
        ('python title="a (not run here)"', "y = 2"),
        ("py", "z = 3"),
        ("bash", "ls"),
    ]
    assert [runnable(info) for _, info, _ in blocks] == [True, False, True, False]
    assert blocks[0][0] == 4  # line number of "x = 1" in the page


# Pages (relative to the repository root) with runnable examples: docs/ and the README.
DOC_PAGES = sorted(
    p.relative_to(ROOT).as_posix()
    for p in [ROOT / "README.md", *DOCS.rglob("*.md")]
    if any(runnable(info) for _, info, _ in code_blocks(p.read_text()))
)


def free_names(code: str) -> list[str]:
    """Names a block reads but never binds (imports, assignments, defs, arguments) nor gets from builtins."""
    import ast
    import builtins

    loads, bound = set(), set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Name):
            (loads if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return sorted(loads - bound - set(dir(builtins)))


def test_free_names_finds_what_a_block_borrows():
    assert free_names("import numpy as np\nx = np.ones(3)\nprint(len(x), y)") == ["y"]
    assert free_names("def f(a):\n    return [b for b in a]\ntry:\n    f(1)\nexcept E as e:\n    e") == ["E"]


@pytest.mark.parametrize("page", DOC_PAGES)
def test_blocks_that_continue_an_earlier_one_say_so(page):
    """A runnable block that reads names it does not define continues an earlier block: its fence
    title or the three lines before it must say so ("continu..."), so a reader who copies one
    block knows what else to copy."""
    lines = (ROOT / page).read_text().split("\n")
    silent = []
    for line, info, code in code_blocks("\n".join(lines)):
        if runnable(info) and free_names(code):
            lead = " ".join([info, *lines[max(0, line - 5) : line - 2]]).lower()
            if "continu" not in lead:
                silent.append(f"{page}:{line} reads {free_names(code)}")
    assert not silent, "blocks continuing an earlier one without saying so:\n" + "\n".join(silent)


# Runs a page's blocks, in order, as one script: in __main__'s namespace, compiled with the
# page's line numbers so that a traceback points into the Markdown file.
_RUNNER = """
import json, sys
_page, _blocks = sys.argv[1], json.load(sys.stdin)
for _line, _code in _blocks:
    exec(compile("\\n" * (_line - 1) + _code, _page, "exec"), vars(sys.modules["__main__"]))
"""


@pytest.mark.docs
@pytest.mark.parametrize("page", DOC_PAGES)
def test_docs_examples_run(page):
    """The page's runnable blocks run as one fresh script, as a reader would run them.

    A fresh process per page: a page may set XLA_FLAGS or jax.config for itself, and a crash
    in one example cannot take the test worker down. Eight simulated CPU devices, as in the
    rest of the suite, unless the page sets XLA_FLAGS itself before importing jax.
    """
    path = ROOT / page
    blocks = [(line, code) for line, info, code in code_blocks(path.read_text()) if runnable(info)]
    env = dict(os.environ, JAX_PLATFORMS="cpu", OMPI_MCA_osc="^ucx")
    env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    proc = subprocess.run(
        [sys.executable, "-c", _RUNNER, str(path)],
        input=json.dumps(blocks),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, (
        f"examples of {page} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"
    )


# --------------------------------------------------------------------------- #
# Docstring examples run
# --------------------------------------------------------------------------- #
def modules_with_doctests() -> list[str]:
    """Modules of the package with at least one ``>>>`` example that is not only a comment."""
    names = []
    for path in sorted([*(ROOT / "jaxcomm").rglob("*.py"), *(ROOT / "experiments").rglob("*.py")]):
        rel = path.relative_to(ROOT).with_suffix("")
        if rel.name == "__main__" or not re.search(r"^\s*>>> *[^\s#]", path.read_text(), flags=re.M):
            continue
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        names.append(".".join(parts))
    return names


@pytest.mark.docs
@pytest.mark.parametrize("module_name", modules_with_doctests())
def test_docstring_examples(module_name):
    module = importlib.import_module(module_name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    tests = [t for t in finder.find(module, module_name) if t.examples]
    assert tests, f"{module_name} contains '>>>' examples but doctest found none in its docstrings"
    failures = []
    for test in tests:
        out: list[str] = []
        result = runner.run(test, out=out.append, clear_globs=True)
        if result.failed:
            failures.append("".join(out))
    assert not failures, "\n".join(failures)


# --------------------------------------------------------------------------- #
# The docs build's docstring rewriting (scripts/griffe_docstrings.py)
# --------------------------------------------------------------------------- #
def _griffe_extension():
    pytest.importorskip("griffe", reason="the docs extra is not installed (pip install -e .[docs])")
    spec = importlib.util.spec_from_file_location("griffe_docstrings", ROOT / "scripts" / "griffe_docstrings.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_doctest_blocks_are_fenced():
    ext = _griffe_extension()
    text = "Intro::\n\n    code\n\n>>> x = 1  # doctest: +SKIP\n>>> x + 1\n2\n\nAfter.\n\n```python\n>>> kept\n```"
    out = ext.literal_markers(ext.fence_doctests(text))
    assert out == ("Intro:\n\n    code\n\n```pycon\n>>> x = 1\n>>> x + 1\n2\n```\n\nAfter.\n\n```python\n>>> kept\n```")
    assert ext.fence_doctests(out) == out  # idempotent


def test_sphinx_roles_become_optional_autorefs():
    ext = _griffe_extension()
    import griffe

    module = griffe.Module("pkg")
    module.set_member("Thing", griffe.Class("Thing"))
    func = griffe.Function("f")
    module.set_member("f", func)
    out = ext.convert_roles("See :class:`Thing`, :func:`~pkg.sub.g` and :meth:`x <Thing.run>`; :class:`Nowhere`.", func)
    assert out == (
        'See <autoref identifier="pkg.Thing" optional><code>Thing</code></autoref>, '
        '<autoref identifier="pkg.sub.g" optional><code>g</code></autoref> and '
        '<autoref identifier="pkg.Thing.run" optional><code>x</code></autoref>; <code>Nowhere</code>.'
    )


def test_private_bases_are_dropped():
    ext = _griffe_extension()
    import griffe

    module = griffe.Module("pkg")
    cls = griffe.Class("Public", bases=["_Private", "pkg._sub._Hidden", "Base", "typing.Generic[T]"])
    module.set_member("Public", cls)
    ext.public_bases(module)
    assert [str(b) for b in cls.bases] == ["Base", "typing.Generic[T]"]
