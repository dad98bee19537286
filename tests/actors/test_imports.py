"""The actors' modules import one another one way: no circle, type-only imports included
(an agent imports its envelope, its mailbox, its state and its turns, never the reverse)."""

from __future__ import annotations

import ast
from pathlib import Path

import mlx_actors.actors

ACTORS = Path(mlx_actors.actors.__file__).parent


def imports(path: Path) -> set[str]:
    """The sibling modules ``path`` imports (``from ._x import ...``), wherever it does."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            found.add(node.module)
    return found


def test_the_actors_modules_import_one_another_one_way() -> None:
    graph = {p.stem: imports(p) for p in ACTORS.glob("_*.py") if p.stem != "__init__"}
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, f"an import circle: {' -> '.join((*path, module))}"
        if module not in done:
            for imported in graph.get(module, ()):
                visit(imported, (*path, module))
            done.add(module)

    for module in graph:
        visit(module, ())
    assert "_agent" not in set().union(*graph.values())  # the caller's handle is on top
