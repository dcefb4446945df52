"""The tree passes ruff (lint and format) and mypy, with the configuration in pyproject.toml.

The tools come with the ``test`` extra; a missing tool fails here (it is not skipped).
Fix with ``ruff check --fix jaxcomm tests experiments scripts`` then
``ruff format jaxcomm tests experiments scripts``; mypy's errors need hand fixes.
"""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATHS = ["jaxcomm", "tests", "experiments", "scripts"]

pytestmark = pytest.mark.lint


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )
    if "No module named" in proc.stderr and proc.returncode != 0:
        pytest.fail(f"{args[0]} is not installed (pip install -e '.[test]'):\n{proc.stderr}")
    return proc


def test_ruff_check():
    proc = _run("ruff", "check", "--no-cache", *PATHS, timeout=120)
    assert proc.returncode == 0, f"ruff check found problems:\n{proc.stdout}{proc.stderr}"


def test_ruff_format():
    proc = _run("ruff", "format", "--check", "--no-cache", *PATHS, timeout=120)
    assert proc.returncode == 0, f"ruff format would reformat:\n{proc.stdout}{proc.stderr}"


def test_mypy():
    # Packages and options come from [tool.mypy] in pyproject.toml.
    proc = _run("mypy", "--no-incremental", timeout=900)
    assert proc.returncode == 0, f"mypy found type errors:\n{proc.stdout}{proc.stderr}"


# House rule: no module of the package over MAX_MODULE_LINES lines (split it along its seams),
# and no function over MAX_FUNCTION_LINES lines (docstring included) unless its own docstring
# says why it stays whole, in a line starting with LONG_REASON.
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
LONG_REASON = "Long because"


def size_problems(source: str, name: str) -> list[str]:
    """The house rule's violations in one module's ``source`` (``name`` labels them)."""
    import ast

    problems = []
    lines = source.count("\n") + (not source.endswith("\n"))
    if lines > MAX_MODULE_LINES:
        problems.append(f"{name}: {lines} lines > {MAX_MODULE_LINES} (split it along its seams)")
    # Only statements hold function definitions: descend through statement lists, not expressions.
    stack: list = [ast.parse(source)]
    while stack:
        node = stack.pop()
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            stack.extend(
                x for x in getattr(node, field, ()) if isinstance(x, (ast.stmt, ast.excepthandler, ast.match_case))
            )
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES and LONG_REASON not in (ast.get_docstring(node) or ""):
                problems.append(
                    f"{name}:{node.lineno}: {node.name} has {length} lines > {MAX_FUNCTION_LINES}: split it, or "
                    f"add a docstring line '{LONG_REASON} ...' saying why it stays whole"
                )
    return problems


def _function(lines: int, doc: str) -> str:
    """A function of exactly ``lines`` lines with docstring ``doc``."""
    return f'def f():\n    """{doc}"""\n' + "    x = 0\n" * (lines - 3) + "    return x\n"


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ("x = 1\n" * MAX_MODULE_LINES, []),
        ("x = 1\n" * (MAX_MODULE_LINES + 1), ["601 lines"]),
        (_function(MAX_FUNCTION_LINES, "Short."), []),
        (_function(MAX_FUNCTION_LINES + 1, "No reason."), ["f has 81 lines"]),
        (_function(MAX_FUNCTION_LINES + 1, f"Why.\n\n    {LONG_REASON} its closures share state.\n    "), []),
        ("class A:\n    " + _function(MAX_FUNCTION_LINES + 1, "Nested.").replace("\n", "\n    "), ["f has 81"]),
    ],
)
def test_size_rule_catches(source, found):
    problems = size_problems(source, "m.py")
    assert len(problems) == len(found) and all(f in p for f, p in zip(found, problems)), problems


def test_package_modules_and_functions_within_size():
    problems = [
        p
        for path in sorted((ROOT / "jaxcomm").rglob("*.py"))
        for p in size_problems(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    ]
    assert not problems, "\n".join(problems)
