"""The core's shape, read from its source: no import circles (imports inside functions
included, which hide a circle from Python but not from a reader), and no trainer or
framework imported by it (trainers register themselves where they live)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FRAMEWORKS = ("torch", "tensorflow", "keras", "xgboost", "lightgbm", "trainers")


def core_imports() -> dict[str, set[str]]:
    """{module: the modules it imports}, for every module of orchestrator/."""
    modules = {}
    for path in (REPO / "orchestrator").rglob("*.py"):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported.add(node.module)
            elif isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
        modules[name] = imported
    return modules


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, found = {}, {}, [], []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v] & graph.keys():
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(group)

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_core_has_no_import_circles():
    assert circles(core_imports()) == []


def test_the_circle_finder_finds_one():  # the test above would pass if it never found any
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


def test_the_core_imports_no_trainer_and_no_framework():
    wrong = {module: sorted(i for i in imported if i.split(".")[0] in FRAMEWORKS)
             for module, imported in core_imports().items()}
    assert {m: i for m, i in wrong.items() if i} == {}


def test_no_function_in_the_core_is_longer_than_a_screen():
    long = []
    for path in (REPO / "orchestrator").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                    node.end_lineno - node.lineno + 1 > 60:
                long.append(f"{path.relative_to(REPO)}:{node.name}")
    assert long == []
