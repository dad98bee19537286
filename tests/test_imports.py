"""The package's modules import one another one way, type-only imports included: no
circle anywhere, the layers point down ((server, cluster) -> runtime -> actors ->
scheduler) and so do the scheduler's own (service -> residency -> engine -> kv -> caches).
Read from the source, so a new import that breaks the layering fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import mlx_actors

ROOT = Path(mlx_actors.__file__).parent

#: A module may import from its own layer or a lower one (a higher number is higher).
LAYERS = {"scheduler": 1, "actors": 2, "runtime": 3, "server": 4, "cluster": 4}
SCHEDULER = {"caches": 1, "kv": 2, "engine": 3, "residency": 4, "service": 5}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def imports(name: str) -> set[str]:
    """The package's modules ``name`` imports, wherever it does (a name imported from a
    package counts as that package's ``__init__`` unless it is a module itself)."""
    path = MODULES[name]
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            source = ".".join([*base, node.module] if node.module else base)
            targets = [
                f"{source}.{alias.name}" if f"{source}.{alias.name}" in MODULES else source
                for alias in node.names
            ]
        else:
            continue
        found.update(t for t in targets if t in MODULES and t != name)
    return found


GRAPH = {name: imports(name) for name in MODULES}


def rank(name: str) -> tuple[int, int] | None:
    parts = name.split(".")
    if len(parts) < 2 or parts[1] not in LAYERS:
        return None
    inner = SCHEDULER.get(parts[2], 0) if parts[1] == "scheduler" and len(parts) > 2 else 0
    return LAYERS[parts[1]], inner


def test_no_module_imports_itself_back() -> None:
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, f"an import circle: {' -> '.join((*path, module))}"
        if module not in done:
            for imported in sorted(GRAPH[module]):
                visit(imported, (*path, module))
            done.add(module)

    for module in GRAPH:
        visit(module, ())


def test_the_layers_import_downwards() -> None:
    wrong = []
    for module, imported in GRAPH.items():
        here = rank(module)
        for target in imported:
            there = rank(target)
            if here is None or there is None:
                continue  # outside the layers (errors, testing, the command line)
            if module.startswith(target + ".") or target.startswith(module + "."):
                continue  # a package and its own modules
            beside = there[0] == here[0] > 1 and target.split(".")[1] != module.split(".")[1]
            if there > here or beside:
                wrong.append(f"{module} -> {target}")
    assert wrong == []


def test_the_actors_handle_is_on_top_of_its_package() -> None:
    actors = {m: t for m, t in GRAPH.items() if m.startswith("mlx_actors.actors._")}
    assert "mlx_actors.actors._agent" not in set().union(*actors.values())
