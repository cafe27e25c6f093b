"""Count the places where zerogpt code reads a tensor's value on the host (a device sync on a GPU).

On a CPU every read is cheap, so the count is what is tested: `.item()`, `.tolist()`, `bool()`, `float()`,
`int()` of a tensor and `torch.cuda.synchronize()` called from a file under one of `roots`. Reads inside
torch itself are left out (e.g. torch.optim's step counters, which live on the host by design).
"""
from __future__ import annotations

import os
import sys

import torch

READS = ("item", "tolist", "__bool__", "__float__", "__int__")


class HostSyncCounter:
    """Patches the tensor reads through pytest's monkeypatch; `count` and `sites` grow as code runs."""

    def __init__(self, monkeypatch, roots: list[str]):
        self.roots = [os.path.abspath(r) for r in roots]
        self.count = 0
        self.sites: list[str] = []
        for name in READS:
            monkeypatch.setattr(torch.Tensor, name, self._counting(getattr(torch.Tensor, name), name))
        monkeypatch.setattr(torch.cuda, "synchronize", self._counting(torch.cuda.synchronize, "cuda.synchronize"))

    def _counting(self, original, name):
        def read(*args, **kwargs):
            caller = sys._getframe(1)
            path = os.path.abspath(caller.f_code.co_filename)
            if any(path.startswith(root) for root in self.roots):
                self.count += 1
                self.sites.append(f"{name} at {os.path.basename(path)}:{caller.f_lineno}")
            return original(*args, **kwargs)
        return read
