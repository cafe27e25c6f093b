"""Small real-English corpora the tests can build offline (nothing is downloaded)."""
from __future__ import annotations

import argparse
import ast
import collections
import inspect
import json
import textwrap


def stdlib_docstrings() -> list[str]:
    """Docstrings of a few stdlib modules (module, class and function level), in source order."""
    docs = []
    for module in (json, argparse, collections, textwrap, inspect):
        tree = ast.parse(inspect.getsource(module))
        docs += [d for d in (ast.get_docstring(n) for n in ast.walk(tree)
                             if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef))) if d]
    return docs


def prose_and_code() -> tuple[list[str], list[str]]:
    """Two real, offline corpora with different statistics: stdlib docstrings (prose) and source (code)."""
    code = [inspect.getsource(module) for module in (json, argparse, collections, textwrap, inspect)]
    return stdlib_docstrings(), code
