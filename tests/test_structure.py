"""The house's shape, checked from the source: no import circle in the core or the adapters
(imports made only for type checking, and those inside functions, counted too), serving code
that imports no tooling at run time, and each module within the line budget of its room."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import layergraph
import layergraph_adapters

PACKAGES = {
    "layergraph": Path(layergraph.__file__).parent,
    "layergraph_adapters": Path(layergraph_adapters.__file__).parent,
}

TOOLING = (
    "layergraph.bench",
    "layergraph.cli",
    "layergraph.demo",
    "layergraph.testing",
    "layergraph.reference",
    "layergraph_adapters.example_models",
)
"""The tooling rooms: benchmarks, the command line, the demo, test and reference helpers, the
example models. Serving code (everything else) never imports them at run time."""

TYPE_ONLY_TOOLING = {"layergraph.bench.example_model"}
"""Tooling modules serving code may name in type annotations only (imports under
``TYPE_CHECKING``): the example model type, the return type of a hook the core declares."""

DEPRECATED_BRIDGES = {
    ("layergraph.adapter", "layergraph.bench.example_model"): "layergraph.ExampleModel, 0.3",
    ("layergraph_adapters.kit.packed_examples", "layergraph.bench.example_model"): (
        "PackedTowerAdapter.examples, 0.3"
    ),
    ("layergraph_adapters.kit.tower_specs", "layergraph.bench.example_model"): (
        "TowerSpec.examples, 0.3"
    ),
}
"""Run-time imports of tooling kept for a deprecated interface, with what and until when."""


@dataclass(frozen=True)
class Import:
    target: str
    type_only: bool


def _modules() -> dict[str, Path]:
    found = {}
    for package, root in PACKAGES.items():
        for path in root.rglob("*.py"):
            parts = [package, *path.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _type_checking_lines(tree: ast.Module) -> set[int]:
    """The lines of the ``if TYPE_CHECKING:`` blocks of a module."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[Import]:
    """The modules of either package that ``name`` imports anywhere in its text."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    tree = ast.parse(path.read_text())
    type_only = _type_checking_lines(tree)
    found = set()
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            for alias in node.names:
                child = f"{target}.{alias.name}"
                targets.append(child if child in modules else target)
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        found.update(Import(target, node.lineno in type_only) for target in targets)
    return {found for found in found if found.target in modules and found.target != name}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return circles


def _graph() -> dict[str, set[Import]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_the_core_and_the_adapters_have_no_import_circle() -> None:
    graph = {name: {i.target for i in found} for name, found in _graph().items()}
    assert "layergraph.serving.engine" in graph["layergraph.runner"]  # the reader finds imports
    assert "layergraph_adapters.kit.hf_vision" in graph["layergraph_adapters.towers"]
    assert _circles(graph) == []


def test_a_circle_is_found() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _tooling(name: str) -> bool:
    return any(name == room or name.startswith(room + ".") for room in TOOLING)


def test_serving_code_imports_no_tooling_at_run_time() -> None:
    found = {}
    for name, imports in _graph().items():
        if _tooling(name):
            continue
        for imported in imports:
            if not _tooling(imported.target):
                continue
            if imported.type_only and imported.target in TYPE_ONLY_TOOLING:
                continue
            if (name, imported.target) not in DEPRECATED_BRIDGES:
                found[name] = imported.target
    assert found == {}


LINE_BUDGETS = {"layergraph": 600, "layergraph_adapters.kit": 600}
"""The most lines a module of each room may have: the core's and the kit's."""


def test_every_module_is_within_the_line_budget_of_its_room() -> None:
    long = {}
    for name, path in _modules().items():
        rooms = [room for room in LINE_BUDGETS if name == room or name.startswith(room + ".")]
        if not rooms:
            continue
        budget = LINE_BUDGETS[max(rooms, key=len)]
        if (lines := len(path.read_text().splitlines())) > budget:
            long[name] = lines
    assert long == {}


PRIVATE_USES = {
    ("test_budgets.py", "budgets._fill_level"): "the planner's fill rule, checked alone",
    ("test_capture_streams.py", "capture_streams._free_streams"): "an empty free list per test",
    ("test_cli.py", "cli._console"): "the console width the CLI picks for a pipe",
    ("test_cuda_cudnn_ragged.py", "backend._graphs"): "one cuDNN graph per room",
    ("test_cudnn_ragged.py", "backend._frontend"): "skips where cuDNN's frontend is absent",
    ("test_cudnn_ragged.py", "backend._offsets"): "the ragged offsets, against a hand count",
    ("test_cudnn_ragged.py", "cudnn_ragged._heads_contiguous"): "no copy of a contiguous q",
    ("test_hooks.py", "graphed._runner"): "the runner's hook baseline",
    ("test_faithful_replay.py", "recorder.tape()._steps"): "the operators a capture records",
    ("test_ledger.py", "module._undo_quietly"): "the collected wrapper's undo, called directly",
    ("test_policy.py", "graphed._plan"): "a plan made batch-dependent after wrapping",
    ("test_qwen2_vl_dense_attention.py", "graphed.plan._backends"): "backends offered to auto",
    ("test_qwen2_vl_eager.py", "qwen2_vl._grid_beside_pixels"): "an eager call's grid moved",
    ("test_qwen2_vl_eager.py", "qwen2_vl.Qwen2VLPlan._compute_host_call"): (
        "counts metadata computations"
    ),
    ("test_qwen2_vl_staging.py", "plan._compute_host_call"): "counts metadata computations",
    ("test_qwen2_vl_staging.py", "entry.buffers.staged.staging._hosts"): "the host buffers pinned",
    ("test_siglip_clip_adapters.py", "feature_outputs._Rest"): "counts whole-tower runs",
}
"""The tests that read or patch a private name of layergraph's code, each with why: anything
else a test needs is public API, or the API lacks it."""


def _private_names() -> set[str]:
    """The private names layergraph's and its adapters' code defines: functions, classes,
    module-level names and attributes set on ``self``."""
    names = set()
    for path in _modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Name):
                        names.add(target.id)
                    elif isinstance(target, ast.Attribute) and ast.unparse(target.value) == "self":
                        names.add(target.attr)
    return {name for name in names if name.startswith("_") and not name.startswith("__")}


def test_tests_touch_private_names_only_where_listed() -> None:
    private = _private_names()
    tests = Path(__file__).parent
    found = set()
    for path in sorted(tests.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in private:
                owner = ast.unparse(node.value)
                if owner not in ("self", "cls", "torch", "super()"):
                    found.add((path.name, f"{owner}.{node.attr}"))
    assert found == set(PRIVATE_USES)


ARCHITECTURE = Path(__file__).parent.parent / "docs" / "architecture.md"


def test_the_architecture_page_names_every_core_module_and_the_line_budgets() -> None:
    """The page's table lists each module of the core by its path, and its sentence on the
    line budgets says the budgets this file holds the rooms to."""
    page = ARCHITECTURE.read_text()
    root = PACKAGES["layergraph"]
    modules = [*root.glob("*.py"), *root.glob("serving/*.py"), *root.glob("service/*.py")]
    unnamed = [
        path.relative_to(root).as_posix()
        for path in modules
        if path.name != "__init__.py" and f"`{path.relative_to(root).as_posix()}`" not in page
    ]
    assert unnamed == []
    budgets = set(LINE_BUDGETS.values())
    assert len(budgets) == 1
    assert f"no core or kit module is over {budgets.pop()} lines" in page


def test_the_graph_cache_is_the_engines_alone() -> None:
    """Lanes and the façade read the graphs held through ``engine.held`` (``HeldGraphs``);
    no module but the engine imports the cache that changes them."""
    importers = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and any(a.name == "GraphCache" for a in node.names):
                importers.append(name)
    assert importers == ["layergraph.serving.engine"]


PACKED_FAMILY_LINES = 600
"""The most lines a packed family's own files may have, on average over the families: what
the kit holds is written once."""


def _packed_family_files() -> tuple[dict[str, int], int]:
    """The packed families' own modules with their lines (the plugin module of every
    first-party :class:`PackedTowerAdapter` subclass and the kit modules it names as its own,
    ``family_modules``), and how many such adapters there are."""
    import importlib

    from layergraph_adapters.kit.packed_tower import PackedTowerAdapter

    modules = _modules()
    for name in modules:
        if name.count(".") == 1 and name.startswith("layergraph_adapters."):
            importlib.import_module(name)
    found, todo, adapters = set(), [PackedTowerAdapter], 0
    while todo:
        for cls in todo.pop().__subclasses__():
            todo.append(cls)
            if cls.__module__ in modules:
                found.update((cls.__module__, *cls.family_modules))
                adapters += 1
    return {name: len(modules[name].read_text().splitlines()) for name in found}, adapters


def test_the_packed_families_own_files_are_within_their_line_budget() -> None:
    files, adapters = _packed_family_files()
    assert {"layergraph_adapters.qwen2_vl", "layergraph_adapters.kit.naflex"} <= set(files)
    assert sum(files.values()) <= PACKED_FAMILY_LINES * adapters, (files, adapters)
