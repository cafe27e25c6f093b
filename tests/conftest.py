"""pytest configuration for zerogpt (there is no pytest.ini): markers and GPU skipping.

Markers: `gpu` (needs CUDA; skipped without it, never faked), `slow` (longer tests; still part of the suite).
"""
from __future__ import annotations

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped when none is present")
    config.addinivalue_line("markers", "slow: a longer test (seconds, not milliseconds)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (no GPU on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
