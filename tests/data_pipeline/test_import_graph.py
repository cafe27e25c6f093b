"""data_pipeline's modules import each other without a cycle: the CLI (__main__), `all` (run_all)
and the task runner (dist_stages) meet in stages.py, and io.py's parts (cli_args, files, jsonl,
stats, workers) import only downwards. Imports inside functions count: a lazy import cycle is still
a cycle, it only fails later."""
from __future__ import annotations

import ast
import os
import subprocess
import sys

import data_pipeline

PACKAGE = os.path.dirname(data_pipeline.__file__)


def import_graph() -> dict[str, set[str]]:
    """module -> the data_pipeline modules it imports anywhere in its source."""
    modules = {name[:-3] for name in os.listdir(PACKAGE) if name.endswith(".py")}
    graph = {}
    for module in modules:
        with open(os.path.join(PACKAGE, module + ".py"), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "data_pipeline":
                imported |= {alias.name for alias in node.names if alias.name in modules}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("data_pipeline."):
                imported.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                imported |= {a.name.split(".")[1] for a in node.names if a.name.startswith("data_pipeline.")}
        graph[module] = imported - {module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, str] = {}  # "open" while on the path, "done" after

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = "open"
        for dep in sorted(graph.get(module, ())):
            if state.get(dep) == "open":  # on the path: back to where it started
                return path[path.index(dep):] + [dep]
            if dep not in state:
                cycle = visit(dep, path + [dep])
                if cycle:
                    return cycle
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module, [module])
            if cycle:
                return cycle
    return None


def test_no_import_cycle_among_data_pipeline_modules():
    graph = import_graph()
    assert {"__main__", "run_all", "dist_stages", "stages", "stats", "files"} <= set(graph)
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))
    assert graph["stages"] == set() and graph["files"] == set()  # the bottom: they import no data_pipeline module


def test_the_cycle_finder_finds_the_loop_this_file_guards_against():
    looped = {"__main__": {"run_all", "stages"}, "run_all": {"__main__"}, "dist_stages": {"__main__"},
              "stages": set()}
    assert find_cycle(looped) == ["__main__", "run_all", "__main__"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_each_entry_point_imports_first_in_a_fresh_interpreter():
    """The orders that the loop made fragile: the task runner or `all` before the CLI."""
    for first in ("data_pipeline.dist_stages", "data_pipeline.run_all", "data_pipeline.stages"):
        code = f"import {first}; from data_pipeline.__main__ import main, build_parser; build_parser('all')"
        subprocess.run([sys.executable, "-c", code], check=True, timeout=120, capture_output=True)
