"""The keyword arguments a model_zoo factory takes: its config's fields, and a misspelt one named with the nearest."""
from __future__ import annotations

import difflib
from dataclasses import fields
from typing import Any

__all__ = ["check_overrides"]


def check_overrides(config_cls: type, overrides: dict[str, Any], where: str) -> None:
    """TypeError naming each key of `overrides` that is not a field of dataclass `config_cls`, with the closest
    field, e.g. "llama_tiny() got unknown keyword(s) 'hiden_size' (did you mean 'hidden_size'?); valid: ..."."""
    names = {f.name for f in fields(config_cls)}
    unknown = set(overrides) - names
    if unknown:
        hints = {k: difflib.get_close_matches(k, names, n=1) for k in unknown}
        raise TypeError(f"{where} got unknown keyword(s) " + ", ".join(
            f"{k!r}" + (f" (did you mean {hints[k][0]!r}?)" if hints[k] else "") for k in sorted(unknown))
            + f"; valid: {', '.join(sorted(names))}")
