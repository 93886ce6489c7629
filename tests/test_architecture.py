"""Rules of the package graph and the command line that import-linter cannot check (docs/architecture.md)."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "maskkv_cli"

# Flags that name two different options in two commands, so that one declaration cannot serve both:
# `bench speed --limit/--no-limit` (a switch) and `eval --limit N` (a count of documents).
DIFFERENT_OPTIONS_ONE_FLAG = {"--limit": 2}


def _private_imports() -> list[str]:
    """``from maskkv_cli.x import _name`` anywhere in the package (function-level imports too), and imports of a
    private maskkv module (``maskkv_cli._x``); dunder names (``__version__``) are public."""

    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__")

    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE.parent)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("maskkv_cli")):
                names = [a.name for a in node.names if private(a.name)]
                names += [part for part in (node.module or "").split(".") if private(part)]
                found += [f"{where}:{node.lineno} {name}" for name in names]
            elif isinstance(node, ast.Import):
                found += [f"{where}:{node.lineno} {a.name}" for a in node.names
                          if a.name.startswith("maskkv_cli") and any(private(p) for p in a.name.split("."))]
    return found


def test_no_private_name_is_imported_across_modules() -> None:
    # ruff's import-private-name (PLC2701) skips imports within the same top-level package, so it cannot see
    # these; a helper two modules share is public (no underscore), one module's own stays private.
    assert _private_imports() == []


def _declared_flags() -> Counter[str]:
    """How often each long flag is declared: ``typer.Option("--flag", ...)`` or ``declare("--flag")`` calls."""
    found: Counter[str] = Counter()
    for path in (PACKAGE / "cli").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            first = node.args[0]
            if name in ("Option", "declare") and isinstance(first, ast.Constant) and isinstance(first.value, str):
                found[first.value.split("/")[0]] += 1
    return found


def test_every_option_is_declared_once() -> None:
    # An option several commands take is declared once in cli/options.py (``declare``), each command giving its
    # own help text; an option only one command takes is declared in that command's module.
    twice = {flag: n for flag, n in _declared_flags().items() if n > DIFFERENT_OPTIONS_ONE_FLAG.get(flag, 1)}
    assert not twice, f"declared more than once (use cli/options.py's declaration): {twice}"
    assert {"--seed", "--policies", "--out", "--questions", "--tasks"} <= set(_declared_flags())


def test_the_root_holds_the_entry_points_and_a_few_foundations() -> None:
    """The package's root: ``__init__``, ``__main__`` and at most four foundations; the rest lives in packages."""
    modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert {"__init__.py", "__main__.py"} <= set(modules)
    assert len(modules) <= 6, f"{len(modules)} modules at the root of maskkv_cli: {', '.join(modules)}"
