"""The package layout the architecture describes (docs/architecture.md) holds: the protocol adapters depend on the
serving core and never on each other, the serving core on no adapter, and models/ has no import cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.helpers import REPO

RTXCORE = REPO / "rtxcore"


def imported_modules(path: Path) -> set[str]:
    """Every rtxcore module ``path`` imports, at any depth of the file (imports inside functions count too)."""
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {n for n in names if n.startswith("rtxcore.")}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_imports(package: str) -> dict[str, set[str]]:
    folder = REPO.joinpath(*package.split("."))
    return {module_name(p): imported_modules(p) for p in folder.rglob("*.py")}


@pytest.mark.parametrize("package, forbidden", [
    ("rtxcore.server.grpc", "rtxcore.server.http"),
    ("rtxcore.server.http", "rtxcore.server.grpc"),
    ("rtxcore.server.serving", "rtxcore.server.http"),
    ("rtxcore.server.serving", "rtxcore.server.grpc"),
    ("rtxcore.engine", "rtxcore.server"),
])
def test_a_package_does_not_import_another(package, forbidden):
    offending = {module: sorted(n for n in names if n == forbidden or n.startswith(forbidden + "."))
                 for module, names in package_imports(package).items()}
    assert {m: n for m, n in offending.items() if n} == {}


def test_models_has_no_import_cycle():
    graph = {module: {n for n in names if n.startswith("rtxcore.models.")}
             for module, names in package_imports("rtxcore.models").items()}
    graph = {m: {n for n in deps if n in graph} for m, deps in graph.items()}

    def cycle_from(start: str) -> list[str] | None:
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for dep in graph[node]:
                if dep == start:
                    return path + [dep]
                if dep not in path:
                    stack.append((dep, path + [dep]))
        return None

    cycles = {m: c for m in graph if (c := cycle_from(m)) is not None}
    assert cycles == {}


def test_the_check_sees_imports():
    """The walk finds real imports (so the tests above cannot pass on an empty graph)."""
    servicer = imported_modules(RTXCORE / "server" / "grpc" / "servicer.py")
    assert "rtxcore.server.serving.lifecycle" in servicer
    resolve = imported_modules(RTXCORE / "models" / "resolve.py")
    assert "rtxcore.models.gguf" in resolve
