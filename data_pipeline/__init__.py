"""zerogpt's data pipeline: webtext CLI stages (`python -m data_pipeline <stage>`) and the training-side readers.

Exports are lazy, so `import data_pipeline` (and the CLI) stay fast and do not import torch or
transformers until a name is used:

    from data_pipeline import GPTDataset, DistributedBatchSampler, load_tokenizer
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "GPTDataset": "data_pipeline.dataset",
    "WebtextDataset": "data_pipeline.dataset",
    "DistributedBatchSampler": "data_pipeline.sampler",
    "load_tokenizer": "data_pipeline.tokenizer",
    "eod_id": "data_pipeline.tokenizer",
    "IndexedDataset": "data_pipeline.indexed",
    "IndexedDatasetWriter": "data_pipeline.indexed",
    "tokenize_file": "data_pipeline.tokenize_stage",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'data_pipeline' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
