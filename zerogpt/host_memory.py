"""Keep freed host memory in the process, so a training step reuses pages instead of faulting in new ones.

Torch's CPU allocator is plain `malloc`, and glibc serves large blocks (over 128 KiB at first, over 32 MiB
once its threshold has adapted) with a fresh `mmap` and returns them with `munmap` on free. A training
step frees and reallocates the same large activations and gradient buffers every step, so each step
page-faults them in again and the kernel zeroes every page:
about 2 GB per step per rank on GPT-2 small (500k minor faults), a fifth of the step on a 2-core VM,
and zeroing is memory-bandwidth work that ranks sharing a host fight over. CUDA's caching allocator
keeps device memory for the same reason; this does it for the host (what PyTorch CPU tuning guides do
by preloading jemalloc or tcmalloc), with glibc's own knobs: blocks come from the heap
(no per-block mmap) and the heap is never trimmed. The process keeps its peak host memory (what it
already needed once) until it exits, which is what a training process wants.

`initialize()` applies it when the config key `host.keep_freed_memory` is on (the default; ZEROGPT_KEEP_HOST_MEMORY=0
overrides it) and the compute runs on the host; turn it off for a process that must hand memory back to the OS
between phases. Nothing changes at import. Only glibc has these knobs; elsewhere this is a no-op.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

# glibc <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_NEVER_TRIM = -1  # mallopt(3): -1 disables trimming completely

_applied = False


def keep_freed_host_memory() -> bool:
    """Switch glibc malloc to heap-only, never-trimmed allocation (once per process).

    Returns True if the setting is in force, False where it is not available or turned off.
    """
    global _applied
    if _applied:
        return True
    if not sys.platform.startswith("linux"):
        return False
    libc = _glibc()
    if libc is None:
        return False
    # mallopt returns 1 on success. Trim first: M_MMAP_MAX=0 alone would still hand the heap top back.
    _applied = bool(libc.mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM)) and bool(libc.mallopt(_M_MMAP_MAX, 0))
    return _applied


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()  # only glibc has it (musl does not): its mallopt codes differ
    except (OSError, AttributeError):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return libc
