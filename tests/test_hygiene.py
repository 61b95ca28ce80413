"""Code a reviewer can hold in their head: no function in src/archlab over 120 lines, and no import
circle between archlab's modules (layers read downward only)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "archlab"


def test_no_function_is_longer_than_120_lines():
    long = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > 120:
                    long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({length} lines)")
    assert not long, long


def test_each_builtin_suite_is_its_own_registered_function():
    from archlab.lab import suites
    assert len(suites.BUILTIN) == 21
    names = [build.__name__.lstrip("_") for build in suites._BUILTIN_FUNCTIONS]
    assert names == list(suites.BUILTIN)


# --------------------------------------------------------------------------- import circles
def _module_names() -> dict[str, Path]:
    """{"archlab.lab.runner": path, "archlab.lab": .../lab/__init__.py, ...} for every module under SRC."""
    out = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(nodes, lazy: bool, in_function: bool = False):
    """Import statements among `nodes` and everything inside them (blocks, except handlers, classes);
    those inside a function only when `lazy`; never those under `if TYPE_CHECKING:` (not run)."""
    for node in nodes:
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            yield from _imports(node.orelse, lazy, in_function)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if lazy or not in_function:
                yield node
        else:
            inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            yield from _imports(ast.iter_child_nodes(node), lazy, inner)


def _targets(node: ast.Import | ast.ImportFrom, module: str, modules: dict[str, Path]) -> list[str]:
    """The archlab modules an import runs: `from archlab.pkg import sub` is the submodule when `sub`
    is one, else the package (its __init__)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name in modules]
    base = node.module or ""
    if node.level:   # relative: resolved from this module's package
        package = module if modules[module].name == "__init__.py" else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}".rstrip(".")
    out = []
    for alias in node.names:
        if f"{base}.{alias.name}" in modules:
            out.append(f"{base}.{alias.name}")
        elif base in modules:
            out.append(base)
    return out


def import_graph(lazy: bool) -> dict[str, dict[str, int]]:
    """{module: {imported archlab module: line}}; function-level imports count when `lazy`."""
    modules = _module_names()
    graph: dict[str, dict[str, int]] = {m: {} for m in modules}
    for module, path in modules.items():
        for node in _imports(ast.parse(path.read_text()).body, lazy):
            for target in _targets(node, module, modules):
                if target != module:
                    graph[module].setdefault(target, node.lineno)
    return graph


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One import circle [a, b, ..., a] (depth-first search, modules in sorted order), or None."""
    state: dict[str, str] = {}   # "open" while on the search path, "done" once fully explored
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph.get(node, {})):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_find_cycle_reports_a_planted_circle_and_passes_a_chain():
    assert find_cycle({"a": {"b": 1}, "b": {"c": 2}, "c": {}}) is None
    assert find_cycle({"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}}) == ["a", "b", "c", "a"]


@pytest.mark.parametrize("lazy", [False, True], ids=["module_level", "with_function_level"])
def test_archlab_modules_import_each_other_without_a_circle(lazy):
    """Module-level circles break at import time; a function-level import that closes a circle is one
    dodged, not removed (both executors <-> runner and the tokenizer kinds <-> their loader were)."""
    graph = import_graph(lazy)
    assert sum(map(len, graph.values())) > 100          # the graph was really built
    cycle = find_cycle(graph)
    assert cycle is None, "import circle (module:line of the import): " + " -> ".join(
        f"{a}:{graph[a][b]}" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"
