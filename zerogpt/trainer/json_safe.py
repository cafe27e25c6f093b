"""json_safe: the JSON-safe part of a state_dict, for the trainer's checkpoint state (saved as JSON).

An LR scheduler's state_dict may hold objects (a config, a lambda) next to its numbers; the numbers are what
a resumed run needs, and the rest would not survive `json.dumps`.
"""
from __future__ import annotations

from typing import Any


def json_safe(obj: Any) -> Any:
    """Keep numbers, strings, lists and dicts (a scheduler's state_dict may hold a config object)."""
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items() if _is_plain(v)}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def _is_plain(v: Any) -> bool:
    if isinstance(v, (dict, list, tuple)):
        return all(_is_plain(x) for x in (v.values() if isinstance(v, dict) else v))
    return v is None or isinstance(v, (bool, int, float, str))
