"""Render a resolved config tree back into a loadable config.py (the run directory's record of the run).

Classes and functions become imports; objects whose repr is not valid Python are written as None with a
comment (e.g. hook instances without a repr), since the file is a record, not a pickle.
"""
from __future__ import annotations

import ast
import inspect
import math
from typing import Any


def to_python(tree: dict, source: str, overrides: list[str]) -> str:
    """The text of a config file that `Config.from_file` loads back into `tree`.

    Args:
        tree: the config's top-level keys (nested dicts, literals, classes, objects with a Python repr).
        source: where the tree was loaded from, recorded in the header.
        overrides: the `--set` items applied after loading, recorded in the header.
    """
    imports: dict[str, str] = {}  # local name -> import line
    notes: list[str] = []

    def name_of(obj: Any) -> str:
        module, qual = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
        if not module or not qual or "<" in qual or module == "__zerogpt_config__":
            notes.append(repr(obj))
            return "None"
        top = qual.split(".")[0]
        local = top
        line = f"from {module} import {top}"
        if imports.get(local, line) != line:
            local = f"{top}_{len(imports)}"
            line = f"from {module} import {top} as {local}"
        imports[local] = line
        return local + qual[len(top):]

    def render(value: Any, indent: int) -> str:
        pad, inner = " " * indent, " " * (indent + 4)
        if value is None or isinstance(value, (bool, int, str, bytes)):
            return repr(value)
        if isinstance(value, float):
            return repr(value) if math.isfinite(value) else f"float({str(value)!r})"
        if isinstance(value, dict):
            if not value:
                return "dict()"
            if all(isinstance(k, str) and k.isidentifier() for k in value):
                body = ",\n".join(f"{inner}{k}={render(v, indent + 4)}" for k, v in value.items())
                return f"dict(\n{body},\n{pad})"
            body = ",\n".join(f"{inner}{k!r}: {render(v, indent + 4)}" for k, v in value.items())
            return "{\n" + body + ",\n" + pad + "}"
        if isinstance(value, (list, tuple)):
            items = [render(v, indent + 4) for v in value]
            open_, close = ("[", "]") if isinstance(value, list) else ("(", ",)" if len(items) == 1 else ")")
            return open_ + ", ".join(items) + close
        if inspect.isclass(value) or inspect.isroutine(value):
            return name_of(value)
        text = repr(value)
        try:
            ast.parse(text, mode="eval")
            ok = "<" not in text
        except SyntaxError:
            ok = False
        if not ok:
            notes.append(text)
            return "None"
        cls_name = name_of(type(value))
        return cls_name + text[len(type(value).__name__):] if text.startswith(type(value).__name__) else text

    body = [f"{key} = {render(value, 0)}" for key, value in tree.items()]
    header = ["# Resolved zerogpt config (zerogpt.config.Config.to_python); load with Config.from_file.",
              f"# source: {source}"]
    header += [f"# override: --set {o}" for o in overrides]
    header += [f"# not reproducible (written as None): {n}" for n in notes]
    return "\n".join(header + sorted(set(imports.values())) + [""] + body) + "\n"
