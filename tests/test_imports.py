"""Importing zerogpt, model_zoo or data_pipeline changes nothing process-wide: no umask, no malloc setting,
no threads. Those happen in `initialize()` from config keys, where `engine.describe()` reports them."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent("""
    import json, os, resource, threading
    os.umask(0o027)
    import data_pipeline.files, data_pipeline.run_all, model_zoo, zerogpt, zerogpt.build_engine, zerogpt.engine
    import zerogpt.trainer, zerogpt.zero.comm, zerogpt.optim
    umask = os.umask(0o027)
    print(json.dumps({"umask": umask, "threads": [t.name for t in threading.enumerate()]}))
""")


@pytest.mark.timeout(120)
def test_imports_leave_the_process_alone():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=110, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["umask"] == 0o027, oct(result["umask"])
    assert result["threads"] == ["MainThread"], result["threads"]


def test_atomic_write_creates_files_with_the_umask_mode(tmp_path):
    from data_pipeline.files import atomic_write

    old = os.umask(0o027)
    try:
        with atomic_write(str(tmp_path / "out.txt")) as f:
            f.write("x")
    finally:
        os.umask(old)
    assert (tmp_path / "out.txt").read_text() == "x"
    assert (tmp_path / "out.txt").stat().st_mode & 0o777 == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


# ----------------------------------------------------------------------------------------------------------
# no import cycles among zerogpt's modules, nor among its subpackages


def _zerogpt_imports(package: str = "zerogpt") -> dict[str, dict[str, int]]:
    """module -> {`package` module it imports: line}, from every import statement in the source (inside functions
    and `if TYPE_CHECKING:` too): a cycle is a design loop even when a deferred import keeps it from failing."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    paths = {}
    for path in (root / package).rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def known(name: str) -> str | None:  # the module a dotted name lives in (`a.b.f` -> `a.b`)
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for module, path in paths.items():
        parent = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges = graph.setdefault(module, {})
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # from . import x / from ..a import x, relative to this module's package
                    up = parent.split(".")[: len(parent.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names]
            else:
                continue
            for name in names:
                target = known(name) if name.split(".")[0] == package else None
                if target is not None and target != module:
                    edges.setdefault(target, node.lineno)
    return graph


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _describe(cycles: list[list[str]], graph: dict[str, dict[str, int]], node_of=lambda m: m) -> str:
    lines = []
    for cycle in cycles:
        lines.append(" <-> ".join(cycle))
        lines += [f"    {m} line {line} imports {t}" for m in sorted(graph) for t, line in sorted(graph[m].items())
                  if node_of(m) in cycle and node_of(t) in cycle and node_of(m) != node_of(t)]
    return "\n".join(lines)


def test_no_import_cycles_among_zerogpt_modules():
    graph = _zerogpt_imports()
    assert "zerogpt.zero.chunk" in graph and graph["zerogpt.zero.chunk"], "the import graph came out empty"
    cycles = _cycles(graph)
    assert not cycles, "import cycles (break each by moving what both sides need down a level):\n" + _describe(
        cycles, graph)


def test_no_import_cycles_among_model_zoo_modules():
    """A family's model imports its adapter (the checkpoint mappings), never the other way; the loader imports both;
    the shared layers import neither."""
    graph = _zerogpt_imports("model_zoo")
    assert graph["model_zoo.gpt"] and graph["model_zoo.llama"], "the import graph came out empty"
    # __init__ re-exports everything; a module importing `from model_zoo import X` of a re-export would loop
    graph = {m: {t: line for t, line in edges.items() if t != "model_zoo"} for m, edges in graph.items()
             if m != "model_zoo"}
    cycles = _cycles(graph)
    assert not cycles, "import cycles in model_zoo:\n" + _describe(cycles, graph)


def test_no_import_cycles_among_zerogpt_subpackages():
    """Collapsed to zerogpt.<subpackage> (config, zero, optim, parallel, trainer; a top-level module is its own
    node): e.g. zero/init_ctx.py importing zerogpt.config while config/schema.py imports zerogpt.zero.strategy
    is a loop between the two packages even though no module imports itself."""
    graph = _zerogpt_imports()

    def node_of(module: str) -> str:
        return ".".join(module.split(".")[:2])

    packages: dict[str, dict[str, int]] = {}
    for module, edges in graph.items():
        for target, line in edges.items():
            if node_of(target) != node_of(module):
                packages.setdefault(node_of(module), {}).setdefault(node_of(target), line)
    cycles = _cycles(packages)
    assert not cycles, "import cycles between zerogpt's packages:\n" + _describe(cycles, graph, node_of)


def test_no_import_cycles_among_zerogpt_tools_modules():
    """What both exporters share (the model plugin, the dtype names) lives below both (zerogpt_tools/model_plugin.py),
    and a run's tokenizer in run_tokenizer.py: export.py may hand --format megatron to export_megatron.py, which
    never imports export.py back."""
    graph = _zerogpt_imports("zerogpt_tools")
    assert "zerogpt_tools.export_megatron" in graph["zerogpt_tools.export"], "the import graph came out empty"
    cycles = _cycles(graph)
    assert not cycles, "import cycles in zerogpt_tools:\n" + _describe(cycles, graph)
