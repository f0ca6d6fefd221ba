"""The k31deploy module graph has no cycle (docs/architecture.md, Layers).

Every `import` / `from ... import` of a k31deploy module counts, wherever it stands: at module top, inside a
function, or under `if TYPE_CHECKING:` (an import moved into a function or a type-checking block hides a
cycle; it does not remove it). An edge goes to the module named: `from k31deploy.recipe import hosts` is an
edge to k31deploy.recipe.hosts when that is a module, else to the package's __init__; and, as Python runs a
package's __init__ before any module in it, also to every package above the module named (importing
k31deploy.recipe.hosts runs k31deploy/recipe/__init__.py, which imports the resolver), except the packages
the importer itself is in: those have started before it runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "k31deploy"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _targets(node: ast.AST, here: str, is_package: bool, modules: set[str]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name.split(".")[0] == "k31deploy"]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:    # relative: from the package this module is in
        package = here.split(".") if is_package else here.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join([*package, *([base] if base else [])])
    if base.split(".")[0] != "k31deploy":
        return []
    found = []
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        found.append(sub if sub in modules else base)
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the k31deploy modules it imports (module top, functions and TYPE_CHECKING alike)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        edges = set()
        for node in ast.walk(tree):
            for target in _targets(node, name, path.name == "__init__.py", set(modules)):
                # `import k31deploy.a.b` names a module; keep the longest prefix that is one
                while target not in modules and "." in target:
                    target = target.rsplit(".", 1)[0]
                while target:    # the module, then each package above it but the importer's own
                    if target in modules and target != name and not name.startswith(f"{target}."):
                        edges.add(target)
                    target = target.rpartition(".")[0]
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}    # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_graph_sees_function_level_and_type_checking_imports():
    graph = import_graph()
    assert "k31deploy.recipe.resolver" in graph["k31deploy.recipe"]
    assert "k31deploy.errors" in graph["k31deploy.recipe.resolver"]
    assert "k31deploy.recipe" in graph["k31deploy.commands.recipe"]    # the package above recipe.catalog
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_k31deploy_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph of k31deploy's folders and top-level modules: each module stands for the first name below
    k31deploy it is in (k31deploy.recipe.argv -> k31deploy.recipe); an edge joins two different ones."""
    def top(name: str) -> str:
        return ".".join(name.split(".")[:2])
    folders: dict[str, set[str]] = {}
    for name, edges in graph.items():
        if name != "k31deploy":
            here = top(name)
            folders.setdefault(here, set()).update(top(e) for e in edges if e != "k31deploy" and top(e) != here)
    return folders


def test_no_folder_imports_one_that_imports_it_back():
    # A folder holds one layer's modules (docs/architecture.md, Layers): the engine lane's case list, which
    # resolves every case, once sat in engine/ beside the build data the resolver reads.
    assert find_cycle(folder_graph({"k31deploy.recipe.resolver": {"k31deploy.engine.lane"},
                                    "k31deploy.engine.cases": {"k31deploy.recipe"}}))
    cycle = find_cycle(folder_graph(import_graph()))
    assert cycle is None, "folders that import each other: " + " -> ".join(cycle or [])


def test_every_k31deploy_import_stands_at_module_top():
    # One place to read what a module depends on; an import inside a function once hid a cycle.
    late = []
    for name, path in _modules().items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for func in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            late += [f"{name}:{node.lineno}" for node in ast.walk(func)
                     if _targets(node, name, path.name == "__init__.py", set())]
    assert sorted(set(late)) == []    # a nested function's import is walked twice: named once
