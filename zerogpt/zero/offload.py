"""Where a chunk's tensors live: the accelerator, (pinned) host RAM, or memory-mapped files on disk.

`Placement` allocates and records. It owns the disk files of optimizer-state offload: one file per
tensor under `<path>/zerogpt-rank<r>-<pid>/`, memory-mapped so the OS streams pages through RAM,
with `prefetch()` (read-ahead via madvise WILLNEED) and `evict()` (write back, drop from RAM) so a
step touches one chunk's state at a time and optimizer state can exceed host RAM.
"""
from __future__ import annotations

import mmap
import os
import shutil
from dataclasses import dataclass, field

import numpy as np
import torch

HOMES = ("device", "host", "disk")


def check_disk_path(path: str | None, bytes_needed: int) -> None:
    """Fail early, with the fix, when the disk-offload directory can't hold the optimizer state."""
    if not path:
        raise ValueError("zero.offload_optimizer.device='disk' needs a path: "
                         "set zero.offload_optimizer=dict(device='disk', path='/fast/nvme/dir')")
    if not os.path.isdir(path):
        raise ValueError(f"disk offload directory {path!r} does not exist; create it (mkdir -p {path}) "
                         f"or point zero.offload_optimizer.path at an existing directory")
    if not os.access(path, os.W_OK):
        raise ValueError(f"disk offload directory {path!r} is not writable by this user")
    free = shutil.disk_usage(path).free
    if free < bytes_needed:
        raise ValueError(f"disk offload directory {path!r} has {free / 2**30:.2f} GiB free but the "
                         f"optimizer state of this rank needs {bytes_needed / 2**30:.2f} GiB")


@dataclass
class _DiskTensor:
    path: str
    mm: mmap.mmap
    array: np.ndarray


@dataclass
class Placement:
    """Allocates tensors at a home and remembers each tensor's home (for memory accounting)."""

    device: torch.device
    pin_memory: bool = True
    disk_path: str | None = None
    rank: int = 0
    _homes: dict[int, str] = field(default_factory=dict)
    _disk: dict[int, _DiskTensor] = field(default_factory=dict)
    _disk_dir: str | None = None

    def torch_device(self, home: str) -> torch.device:
        return self.device if home == "device" else torch.device("cpu")

    def empty(self, numel: int, dtype: torch.dtype, home: str, name: str = "t") -> torch.Tensor:
        """A zero-filled 1-D tensor at `home` ('device' | 'host' | 'disk')."""
        assert home in HOMES, home
        if home == "disk":
            tensor = self._disk_tensor(numel, dtype, name)
        else:
            tensor = torch.zeros(numel, dtype=dtype, device=self.torch_device(home))
            if home == "host" and self.pin_memory and self.device.type == "cuda":
                tensor = tensor.pin_memory()
        self.record(tensor, home)
        return tensor

    def record(self, tensor: torch.Tensor, home: str) -> None:
        self._homes[tensor.untyped_storage().data_ptr()] = home

    def home_of(self, tensor: torch.Tensor) -> str:
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in self._homes:
            return self._homes[ptr]
        return "device" if tensor.device == self.device else "host"

    def is_disk_backed(self, tensor: torch.Tensor) -> bool:
        """True when the tensor's storage is one of our memory-mapped files."""
        ptr = tensor.untyped_storage().data_ptr()
        return ptr in self._disk and self._disk[ptr].array.ctypes.data == ptr

    # -- disk -------------------------------------------------------------------------------

    def _disk_tensor(self, numel: int, dtype: torch.dtype, name: str) -> torch.Tensor:
        if self._disk_dir is None:
            self._disk_dir = os.path.join(self.disk_path, f"zerogpt-rank{self.rank}-{os.getpid()}")
            os.makedirs(self._disk_dir, exist_ok=True)
        path = os.path.join(self._disk_dir, f"{name}-{len(self._disk)}.bin")
        nbytes = max(numel * torch.empty(0, dtype=dtype).element_size(), 1)
        with open(path, "wb") as f:
            f.truncate(nbytes)  # sparse file: zeros without writing them
        with open(path, "r+b") as f:
            mm = mmap.mmap(f.fileno(), nbytes)
        np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
        array = np.frombuffer(mm, dtype=np_dtype, count=numel)
        tensor = torch.from_numpy(array)
        self._disk[tensor.untyped_storage().data_ptr()] = _DiskTensor(path, mm, array)
        return tensor

    def prefetch(self, tensor: torch.Tensor) -> None:
        """Ask the OS to read a disk-backed tensor ahead of its use (no-op otherwise)."""
        entry = self._disk.get(tensor.untyped_storage().data_ptr())
        if entry is not None and hasattr(entry.mm, "madvise"):
            entry.mm.madvise(mmap.MADV_WILLNEED)

    def evict(self, tensor: torch.Tensor) -> None:
        """Write a disk-backed tensor back and let the OS drop its pages from RAM."""
        entry = self._disk.get(tensor.untyped_storage().data_ptr())
        if entry is not None:
            entry.mm.flush()
            if hasattr(entry.mm, "madvise"):
                entry.mm.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        """Remove this rank's offload files (called when the engine is closed or collected)."""
        self._disk.clear()
        if self._disk_dir is not None:
            shutil.rmtree(self._disk_dir, ignore_errors=True)
            self._disk_dir = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
