"""Code a reviewer can hold in their head: no function in src/archlab over 120 lines, no import circle between
archlab's modules (layers read downward only), and tests/ laid out as the rooms are."""
from __future__ import annotations

import ast
import functools
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
    assert len(suites.BUILTIN) == 28          # 25 trained or counted, 3 on a real model
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


@functools.cache
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


# --------------------------------------------------------------------------- layers
# Rooms by layer, top first: a module imports its own room, rooms of lower layers and the leaves (config.py,
# errors.py, units.py, progress.py, paths.py, faults.py). docs/architecture.md draws the same picture.
LAYERS = [("cli",), ("demo", "lab", "serve"), ("training", "eval"), ("runs", "interop"),
          ("models", "generation", "data"), ("nn", "tokenizer")]
LEAVES = ("config", "errors", "units", "progress", "paths", "faults")
# Rooms of one layer that read each other: the trainer's validation and DPO's held-out pairs are eval's one
# evaluation, which runs under training's precision and unwraps its DDP/FSDP model; the one loader of any model
# folder (runs) reads HF folders and PEFT adapters (interop), which read safetensors through runs' checkpoint code.
PEERS = {("training", "eval"), ("eval", "training"), ("runs", "interop"), ("interop", "runs")}
# The imports that read upward today, each with its reason; a new one fails the test below, and one that goes
# away must leave this list (the last test).
LAYER_EXCEPTIONS = {
    ("archlab.data.corpora", "archlab.runs.hub"): "a corpus named hf:NAME resolves through the hub ids",
    ("archlab.data.seq2seq", "archlab.runs.outputs"): "prepared folders are one-shot outputs, replaced atomically",
    ("archlab.data.prepare", "archlab.runs.outputs"): "the same",
    ("archlab.generation.drafts", "archlab.eval.ngram"): "the n-gram draft is eval's Kneser-Ney model",
    ("archlab.nn.tiled_attention", "archlab.training.precision"): "whether the CPU has bf16 units",
    ("archlab.runs.model_folder", "archlab.eval.fill_mask"): "the loader refuses a model fill-mask cannot use",
    ("archlab.runs.provenance", "archlab.training.precision"): "provenance records the CPU's precision flags",
}


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _layer(room: str) -> int:
    """0 for the leaves and the package itself, 1 for nn/tokenizer, ... 6 for cli."""
    for depth, rooms in enumerate(LAYERS):
        if room in rooms:
            return len(LAYERS) - depth
    return 0


def layer_breaches(graph: dict[str, dict[str, int]]) -> dict[tuple[str, str], int]:
    """{(module, imported module): line} for each import of a room in the same layer (but PEERS) or a higher one."""
    out = {}
    for module, targets in graph.items():
        room = _room(module)
        for target, line in targets.items():
            other = _room(target)
            up = _layer(other) > _layer(room) or (_layer(other) == _layer(room) > 0)     # leaves use leaves
            if other != room and up and room != "__main__" and (room, other) not in PEERS:
                out[(module, target)] = line
    return out


def test_the_layers_name_every_room_and_the_rule_catches_a_planted_breach():
    rooms = {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert rooms == {room for layer in LAYERS for room in layer}, "a room missing from LAYERS (or gone)"
    leaves = {p.stem for p in SRC.glob("*.py")} - {"__init__", "__main__"}
    assert leaves == set(LEAVES)
    planted = {"archlab.data.x": {"archlab.training.trainer": 3, "archlab.nn.norms": 4, "archlab.data.y": 5},
               "archlab.lab.x": {"archlab.demo.run": 6}, "archlab.config": {"archlab.errors": 7},
               "archlab.eval.x": {"archlab.training.precision": 8}}
    assert layer_breaches(planted) == {("archlab.data.x", "archlab.training.trainer"): 3,
                                       ("archlab.lab.x", "archlab.demo.run"): 6}


def test_modules_import_downward_only_but_for_the_listed_exceptions():
    """Function-level imports count: a lazy import upward is still a dependency upward."""
    breaches = layer_breaches(import_graph(lazy=True))
    new = {f"{a}:{line} -> {b}" for (a, b), line in breaches.items() if (a, b) not in LAYER_EXCEPTIONS}
    assert not new, f"imports that read sideways or upward (see LAYERS, PEERS): {sorted(new)}"
    gone = set(LAYER_EXCEPTIONS) - set(breaches)
    assert not gone, f"listed exceptions that no longer exist: drop them from LAYER_EXCEPTIONS: {sorted(gone)}"


# --------------------------------------------------------------------------- tests/ layout
TESTS = Path(__file__).resolve().parent
PROJECT_WIDE = {"test_hygiene.py", "test_docs_names.py", "test_docs_no_history.py", "test_public_api.py",
                "test_readme_examples.py", "test_readme_first_hour.py"}       # about the whole project, not a room


def test_tests_mirror_the_source_rooms():
    """A test of a room lives in tests/<room>/ (config.py's in tests/config/), so a reader finds a module's tests
    where the module is; only the project-wide tests sit at the top."""
    rooms = {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    leaves = {p.stem for p in SRC.glob("*.py")} - {"__init__", "__main__"}
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and any(p.glob("test_*.py"))}
    assert not rooms - folders, f"rooms without a tests/<room>/ folder of tests: {sorted(rooms - folders)}"
    assert folders <= rooms | leaves, f"test folders named after no room: {sorted(folders - rooms - leaves)}"
    top = {p.name for p in TESTS.glob("test_*.py")}
    assert top <= PROJECT_WIDE, f"room tests at the top of tests/ (move them down): {sorted(top - PROJECT_WIDE)}"


BENCHMARKS = SRC.parents[1] / "benchmarks"


def _top_level_names(path: Path) -> set[str]:
    """What a module defines or imports at its top level (what `from module import name` can find)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _missing_benchmark_imports(folder: Path) -> list[str]:
    """`from SCRIPT import NAME` lines between the benchmark scripts whose NAME the script does not define."""
    scripts = {p.stem: p for p in folder.glob("*.py")}
    missing = []
    for path in sorted(scripts.values()):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in scripts:
                have = _top_level_names(scripts[node.module])
                missing += [f"{path.name}: {node.module}.{a.name}" for a in node.names if a.name not in have]
    return missing


def test_benchmark_scripts_import_only_what_their_siblings_define(tmp_path):
    # the scripts run by hand, outside the test run: a helper moved from one to another breaks them silently
    assert _missing_benchmark_imports(BENCHMARKS) == []
    (tmp_path / "shared.py").write_text("def timed():\n    pass\n")
    (tmp_path / "user.py").write_text("from shared import timed, interleaved\n")
    assert _missing_benchmark_imports(tmp_path) == ["user.py: shared.interleaved"]
