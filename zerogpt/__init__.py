"""zerogpt: ZeRO-sharded GPT pretraining with CPU/disk offload, driven by Python config files.

Public API (DESIGN §3): Config, launch_from_torch, DistContext, initialize (colossalai_initialize: the Colossal-AI
tutorial's tuple form), ZeroInitContext, Engine, Trainer. Everything
except Config is imported on first use, so `import zerogpt` stays fast and never imports transformers.
"""
from __future__ import annotations

import importlib
from typing import Any

from zerogpt.config import Config

__version__ = "0.1.0"

_LAZY = {
    "launch_from_torch": "zerogpt.launch",
    "DistContext": "zerogpt.context",
    "get_logger": "zerogpt.logging",
    "initialize": "zerogpt.build_engine",
    "colossalai_initialize": "zerogpt.build_engine",
    "ZeroInitContext": "zerogpt.zero.init_ctx",
    "Engine": "zerogpt.engine",
    "Trainer": "zerogpt.trainer",
}

__all__ = ["Config", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'zerogpt' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
