"""Record the tensor ops on this thread that would make the host wait for the device on a GPU.

tests/trainer/host_sync.py patches the Python reads (`.item()`, `bool()`) made from zerogpt's files; a blocking call
can also come from torch itself, called by zerogpt: `torch.unique` reads its output's size back (the tied
embedding's gradient, two syncs per step on an H200 before it was rewritten), as do `nonzero`, `masked_select`
and boolean-mask indexing. A TorchDispatchMode sees every op the training thread dispatches, whoever calls it,
and only that thread's (torch keeps the mode stack per thread), so what the host step's worker reads on its own
thread, which is where those reads belong, is not counted.

On a CPU a device-to-host copy cannot be told from a host copy: those are left to gpu_check's count on a GPU
(torch.cuda.set_sync_debug_mode), and this catches the rest before a GPU is lent.
"""
from __future__ import annotations

import os
import traceback
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import model_zoo
import zerogpt

# Ops whose result the host must have: a value (`.item()`, `bool(t)`, `torch.equal`) or an output size that depends
# on the data. Each is a cudaStreamSynchronize on a GPU.
BLOCKING = {"aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::equal", "aten::nonzero",
            "aten::_unique", "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive",
            "aten::unique_dim_consecutive", "aten::masked_select", "aten::repeat_interleave", "aten::bincount"}
ROOTS = tuple(os.path.dirname(os.path.abspath(m.__file__)) for m in (zerogpt, model_zoo))


class BlockingOps(TorchDispatchMode):
    """Within the block, `sites` counts each blocking op by the project line that led to it."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name in BLOCKING or (name == "aten::index" and _has_mask(args)):
            self.sites[f"{name.removeprefix('aten::')} from {_project_line()}"] += 1
        return func(*args, **kwargs)


def _has_mask(args) -> bool:
    """aten::index with a boolean mask among its indices: its output size is the mask's count."""
    indices = args[1] if len(args) > 1 else []
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)


def _project_line() -> str:
    """The innermost frame in zerogpt or model_zoo on the stack: the project's call that led to the op."""
    for frame in reversed(traceback.extract_stack()):
        path = os.path.abspath(frame.filename)
        if path.startswith(ROOTS):
            return f"{os.path.relpath(path, os.path.dirname(ROOTS[0]))}:{frame.lineno}"
    return "outside the project"
