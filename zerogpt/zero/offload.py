"""Where a chunk's tensors live: the accelerator, (pinned) host RAM, or memory-mapped files on disk.

`Placement` allocates; each owner (Chunk, ChunkState) records where its own tensors live. It owns the
disk files of optimizer-state offload: one file per tensor under `<path>/zerogpt-rank<r>-<pid>-<random>/`,
memory-mapped so the OS streams pages through RAM, with `prefetch()` (read-ahead via madvise WILLNEED) and
`evict()` (unmap after use) so a step touches one chunk's state at a time and optimizer state can exceed
host RAM.
"""
from __future__ import annotations

import mmap
import multiprocessing.util
import os
import shutil
import stat
import tempfile
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from zerogpt.memory_model import HOMES


def check_disk_path(path: str | None, bytes_needed: int, local_ranks: int = 1) -> None:
    """Fail early, with the fix, when the disk-offload directory can't hold the optimizer state.

    `bytes_needed` is one rank's state; the `local_ranks` ranks of this node write theirs to the same
    path, so each checks for all of them (each passing alone would not stop the disk filling mid-run).
    """
    if not path:
        raise ValueError("zero.offload_optimizer.device='disk' needs a path: "
                         "set zero.offload_optimizer=dict(device='disk', path='/fast/nvme/dir')")
    try:
        is_dir = stat.S_ISDIR(os.stat(path).st_mode)
    except FileNotFoundError:
        raise ValueError(f"disk offload directory {path!r} does not exist; create it (mkdir -p {path}) "
                         f"or point zero.offload_optimizer.path at an existing directory") from None
    except OSError as e:  # e.g. a parent directory this user may not enter: not "missing"
        raise ValueError(f"disk offload directory {path!r} cannot be reached by this user ({e.strerror}); "
                         f"fix the permissions of its parents or point zero.offload_optimizer.path "
                         f"elsewhere") from None
    if not is_dir:
        raise ValueError(f"disk offload path {path!r} is not a directory; point zero.offload_optimizer.path "
                         f"at a directory")
    # Create a file rather than ask os.access(): access() answers from mode bits, which root always
    # passes, and misses refusals that only show on write (sysfs-like mounts, ACLs, NFS root-squash).
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise ValueError(f"disk offload directory {path!r} is not writable by this user ({e.strerror}); "
                         f"fix its permissions or point zero.offload_optimizer.path at a writable "
                         f"directory") from None
    free = shutil.disk_usage(path).free
    if free < bytes_needed * local_ranks:
        whose = "this rank" if local_ranks == 1 else f"the {local_ranks} ranks on this node"
        raise ValueError(f"disk offload directory {path!r} has {free / 2**30:.2f} GiB free but the "
                         f"optimizer state of {whose} needs {bytes_needed * local_ranks / 2**30:.2f} GiB; free "
                         f"space there, choose a larger disk, or use zero.offload_optimizer=dict(device='cpu')")


def start_d2h(tensor: torch.Tensor) -> tuple[torch.Tensor, "torch.cuda.Event | None"]:
    """Start copying a device tensor into pinned host memory; returns (host copy, event or None).

    Host code must not read the copy before `event.synchronize()`: a non-blocking device->host copy
    returns at once while the bytes are still in flight. On a CPU-only run there is nothing to copy.
    """
    if tensor.device.type != "cuda":
        return tensor, None
    staging = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)  # cached by torch's host allocator
    staging.copy_(tensor, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return staging, event


@dataclass
class Traffic:
    """Bytes copied between the host (RAM or disk-backed pages) and the compute device, by direction.

    Counted where the copy is made (a stage-3 gather of a host shard, a reduced gradient handed to the host, a
    master written back into a param shard on the other side), from the homes the owners record, not from the
    tensors' devices: on a CPU-only run host and "device" are the same memory and the same copies are counted,
    so tests can assert on them. 0-dim control scalars (the clip factor, found_inf) are not counted.
    """

    h2d_bytes: int = 0
    d2h_bytes: int = 0
    counting: bool = True
    """False while the engine is in eval mode: evaluation is not part of an optimizer step's traffic."""

    def copied(self, src_home: str, dst_home: str, tensor: torch.Tensor) -> None:
        """Count `tensor`'s bytes (as written to `dst_home`) when the copy crosses between host/disk and device."""
        if not self.counting or (src_home == "device") == (dst_home == "device"):
            return
        nbytes = tensor.numel() * tensor.element_size()
        if dst_home == "device":
            self.h2d_bytes += nbytes
        else:
            self.d2h_bytes += nbytes

    def take(self) -> "Traffic":
        """The bytes counted since the last take(), as a new Traffic; the counters restart from zero."""
        out = Traffic(self.h2d_bytes, self.d2h_bytes)
        self.h2d_bytes = self.d2h_bytes = 0
        return out


@dataclass
class _DiskTensor:
    path: str
    mm: mmap.mmap
    array: np.ndarray


@dataclass
class Placement:
    """Allocates tensors at a home: the accelerator, (pinned) host RAM, or memory-mapped files it owns."""

    device: torch.device
    pin_memory: bool = False
    """Host tensors are pinned (the engine plan's `pins_host_state`: a GPU run's choice)."""
    disk_path: str | None = None
    rank: int = 0
    _disk: dict[int, _DiskTensor] = field(default_factory=dict)
    _disk_dir: str | None = None
    _cleanup: Any = None  # weakref.finalize that removes _disk_dir
    _mp_cleanup: Any = None  # the same for fork-started multiprocessing workers

    @property
    def disk_dir(self) -> str | None:
        """This rank's directory of memory-mapped state files (None before the first disk tensor)."""
        return self._disk_dir

    def torch_device(self, home: str) -> torch.device:
        return self.device if home == "device" else torch.device("cpu")

    def empty(self, numel: int, dtype: torch.dtype, home: str, name: str = "t") -> torch.Tensor:
        """A zero-filled 1-D tensor at `home` ('device' | 'host' | 'disk')."""
        assert home in HOMES, home
        if home == "disk":
            tensor = self._disk_tensor(numel, dtype, name)
        else:  # pinned in place: .pin_memory() on a pageable tensor would hold two copies for a moment
            tensor = torch.zeros(numel, dtype=dtype, device=self.torch_device(home),
                                 pin_memory=home == "host" and self.pin_memory)
        return tensor

    def is_disk_backed(self, tensor: torch.Tensor) -> bool:
        """True when the tensor's storage is one of our memory-mapped files."""
        ptr = tensor.untyped_storage().data_ptr()
        return ptr in self._disk and self._disk[ptr].array.ctypes.data == ptr

    # -- disk -------------------------------------------------------------------------------

    def _disk_tensor(self, numel: int, dtype: torch.dtype, name: str) -> torch.Tensor:
        if self._disk_dir is None:
            # A fresh directory per Placement: two engines of one process (a fixed rank+pid name) would
            # truncate each other's mapped files (SIGBUS) and remove each other's directory on close.
            self._disk_dir = tempfile.mkdtemp(prefix=f"zerogpt-rank{self.rank}-{os.getpid()}-", dir=self.disk_path)
            # Remove the files on close(), when this Placement is collected, or at interpreter exit
            # (finalize registers with atexit: a script, torchrun or spawn worker that returns or
            # raises runs it). A fork-started multiprocessing worker ends in os._exit, which skips
            # atexit, so multiprocessing's own exit finalizers remove them there. Neither may
            # reference self (it would keep self alive); a killed process can run neither.
            self._cleanup = weakref.finalize(self, shutil.rmtree, self._disk_dir, ignore_errors=True)
            self._mp_cleanup = multiprocessing.util.Finalize(
                self, shutil.rmtree, args=(self._disk_dir,), kwargs={"ignore_errors": True}, exitpriority=0)
        path = os.path.join(self._disk_dir, f"{name}-{len(self._disk)}.bin")
        nbytes = max(numel * torch.empty(0, dtype=dtype).element_size(), 1)
        with open(path, "wb") as f:
            f.truncate(nbytes)  # sparse file: zeros without writing them
        with open(path, "r+b") as f:
            mm = mmap.mmap(f.fileno(), nbytes)
        # numpy has no bfloat16: map its bytes as int16 and view them as bfloat16 (same size, same storage)
        stored = torch.int16 if dtype == torch.bfloat16 else dtype
        array = np.frombuffer(mm, dtype=torch.empty(0, dtype=stored).numpy().dtype, count=numel)
        tensor = torch.from_numpy(array).view(dtype)
        self._disk[tensor.untyped_storage().data_ptr()] = _DiskTensor(path, mm, array)
        return tensor

    def prefetch(self, tensor: torch.Tensor) -> None:
        """Ask the OS to read a disk-backed tensor ahead of its use (no-op otherwise)."""
        entry = self._disk.get(tensor.untyped_storage().data_ptr())
        if entry is not None and hasattr(entry.mm, "madvise"):
            entry.mm.madvise(mmap.MADV_WILLNEED)

    def evict(self, tensor: torch.Tensor) -> None:
        """Unmap a disk-backed tensor's pages from this process once its chunk is done for the step.

        The state is read cyclically, chunk after chunk, which is the worst case for the kernel's LRU
        when it exceeds RAM; dropping each chunk right after use keeps the pages still ahead resident.
        Dirty pages stay in the page cache and the kernel writes them back in the background (dirty
        throttling bounds them). No msync: these are scratch files removed at exit, so durability buys
        nothing, and a synchronous msync put the whole disk write inside the step (about a fifth of
        the disk-offload optimizer step on the 2-core CI VM).
        """
        entry = self._disk.get(tensor.untyped_storage().data_ptr())
        if entry is not None and hasattr(entry.mm, "madvise"):
            entry.mm.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        """Remove this rank's offload files (engine.close(); also runs on collection and at exit)."""
        self._disk.clear()
        if self._cleanup is not None:
            self._cleanup()  # runs rmtree once, then detaches from atexit
            self._mp_cleanup()  # a no-op rmtree now, then detaches from multiprocessing's exit
            self._cleanup = self._mp_cleanup = None
        self._disk_dir = None
