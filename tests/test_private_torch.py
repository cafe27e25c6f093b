"""zerogpt/private_torch.py: every private torch API it lists exists in the installed torch (one test per entry,
named by it), and no zerogpt module imports or names a private torch attribute the list lacks."""
from __future__ import annotations

import ast
import importlib
import pathlib

import pytest
import torch

from zerogpt.private_torch import PRIVATE_TORCH_APIS

ZEROGPT = pathlib.Path(__file__).resolve().parents[1] / "zerogpt"


def _resolve(owner: str) -> object:
    """The module, class or object a dotted path names: the longest importable module, then attributes."""
    parts = owner.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            found = getattr(found, attr)
        return found
    raise ImportError(owner)


@pytest.mark.parametrize("owner,name,used_for", PRIVATE_TORCH_APIS,
                         ids=[f"{owner}.{name}" for owner, name, _ in PRIVATE_TORCH_APIS])
def test_private_torch_api_exists(owner, name, used_for):
    try:
        found = hasattr(_resolve(owner), name)
    except (ImportError, AttributeError):
        found = False
    assert found, (f"torch {torch.__version__} no longer has {owner}.{name}, used in {used_for}. Find its "
                   f"replacement in that torch's source, then update the code and zerogpt/private_torch.py")


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))  # __get__ is Python's


def _private_names_used(path: pathlib.Path) -> set[tuple[str, str]]:
    """(owner, name) for `from torch.x._y import name`, `from torch.x import _name` and maximal `torch._a.b`
    attribute chains: the forms a private torch API can be reached by without a variable in between."""
    tree = ast.parse(path.read_text(), str(path))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            for alias in node.names:
                if any(_private(part) for part in [*node.module.split("."), alias.name]):
                    used.add((node.module, alias.name))
        elif isinstance(node, ast.Attribute) and not isinstance(parents.get(node), ast.Attribute):
            chain, inner = [], node
            while isinstance(inner, ast.Attribute):
                chain.insert(0, inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id == "torch" and any(_private(p) for p in chain):
                used.add((".".join(["torch", *chain[:-1]]), chain[-1]))
    return used


def test_every_private_torch_name_zerogpt_uses_is_listed():
    listed = {(owner, name) for owner, name, _ in PRIVATE_TORCH_APIS}
    unlisted = sorted(f"{path.relative_to(ZEROGPT.parent)}: {owner}.{name}"
                      for path in ZEROGPT.rglob("*.py") for owner, name in _private_names_used(path)
                      if (owner, name) not in listed)
    assert not unlisted, ("private torch APIs missing from zerogpt/private_torch.py (add each, with where it is "
                          "used and why no public API does it): " + "; ".join(unlisted))


def test_private_torch_comes_from_at_most_eight_owners():
    """Each owner (a private module or class) is one more place a torch upgrade can break zerogpt: keep them few,
    and reach for a public API or a few lines of our own before adding one."""
    owners = sorted({owner for owner, _, _ in PRIVATE_TORCH_APIS})
    assert len(owners) <= 8, f"{len(owners)} owners of private torch APIs, at most 8 allowed: {owners}"
