"""A CPU run's stand-in for torch.cuda.max_memory_allocated: the bytes of the tensors the ops on this thread make,
alive at once, and their peak.

A CPU has no allocator statistics a trial can reset and read, and a process's resident set is its history (glibc
keeps freed memory). So every op's outputs are seen as they are made (a dispatch mode), each new storage counted
until it is freed (a finalizer on it). That sees what sampling the engine's state between micro-steps missed:
activations (stage 3's own saved-tensor hooks included), gathered chunks, gradient buffers in flight and the
temporaries of the loss and the step.

Counted: storages made on this thread while the mode is on, that alias none of the op's inputs (a view or an
in-place op makes nothing new). Not counted: what other threads make (the host step's worker: host memory), what
existed before the mode (the caller adds the model state it started from), and, while they are, the storages
`elsewhere()` names: what the training thread made that has become another home's (at one rank the engine takes a
reduced gradient buffer as the host's grad shard, where a GPU run copies it out and frees the device's).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["LiveBytes"]


def _storages(tree: Any) -> list[torch.UntypedStorage]:
    return [t.untyped_storage() for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


class LiveBytes(TorchDispatchMode):
    """`live`: bytes made under the mode and not yet freed; `peak`: the most of them at once, less what `elsewhere()`
    (the data pointers of storages held in another home) named at that moment."""

    def __init__(self, elsewhere: Callable[[], set[int]] | None = None) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._alive: dict[int, int] = {}  # data pointer -> bytes
        self._elsewhere = elsewhere
        self._finalizers: list[weakref.finalize] = []

    def __exit__(self, *exc: Any) -> Any:
        """The measure ends with the mode: its finalizers go (weakref.finalize's registry is global, and a storage
        that outlives the mode, an optimizer state made in the measured step, would hold this object and through
        `elsewhere` the engine it names: a trial's whole engine, kept to the process's end)."""
        try:
            return super().__exit__(*exc)
        finally:
            for finalizer in self._finalizers:
                finalizer.detach()
            self._finalizers.clear()
            self._elsewhere = None

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
        self._alive[key] = nbytes
        self.live += nbytes
        if self.live > self.peak:  # what is elsewhere only lowers it: nothing to ask otherwise
            away = 0 if self._elsewhere is None else sum(self._alive.get(k, 0) for k in self._elsewhere())
            self.peak = max(self.peak, self.live - away)
        self._finalizers.append(weakref.finalize(storage, self._free, key, nbytes))

    def _free(self, key: int, nbytes: int) -> None:
        self._alive.pop(key, None)
        self.live -= nbytes
