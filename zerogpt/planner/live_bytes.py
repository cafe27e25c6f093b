"""A CPU run's stand-in for torch.cuda.max_memory_allocated: the bytes of the tensors the ops on this thread make,
alive at once, and their peak.

A CPU has no allocator statistics a trial can reset and read, and a process's resident set is its history (glibc
keeps freed memory). So every op's outputs are seen as they are made (a dispatch mode), each new storage counted
until it is freed (a finalizer on it). That sees what sampling the engine's state between micro-steps missed:
activations (stage 3's own saved-tensor hooks included), gathered chunks, gradient buffers in flight and the
temporaries of the loss and the step.

Counted: storages made on this thread while the mode is on, that alias none of the op's inputs (a view or an
in-place op makes nothing new). Not counted: what other threads make (the host step's worker: host memory), and
what existed before the mode (the caller adds the model state it started from).
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["LiveBytes"]


def _storages(tree: Any) -> list[torch.UntypedStorage]:
    return [t.untyped_storage() for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


class LiveBytes(TorchDispatchMode):
    """`live`: bytes made under the mode and not yet freed; `peak`: the most of them at once."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._alive: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {s.data_ptr() for s in _storages((args, kwargs))}
        for storage in _storages(out):
            key = storage.data_ptr()
            if key and key not in inputs and key not in self._alive:
                self._count(storage, key)
        return out

    def _count(self, storage: torch.UntypedStorage, key: int) -> None:
        nbytes = storage.nbytes()
        self._alive.add(key)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, nbytes)

    def _free(self, key: int, nbytes: int) -> None:
        self._alive.discard(key)
        self.live -= nbytes
