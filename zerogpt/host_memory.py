"""Keep freed host memory in the process, so a training step reuses pages instead of faulting in new ones.

Torch's CPU allocator is plain `malloc`, and glibc serves large blocks with a fresh `mmap` and returns them
with `munmap` on free. A step frees and reallocates the same large activations and gradient buffers every
step, so each step page-faults them in again and the kernel zeroes every page: memory-bandwidth work that
ranks sharing a host fight over. CUDA's caching allocator keeps device memory for the same reason; this
does it for the host with glibc's own knobs (blocks from the heap, heap never trimmed), as PyTorch's CPU
tuning guides do by preloading jemalloc or tcmalloc. The process keeps its peak host memory until it exits.

`initialize()` applies it when `host.keep_freed_memory` is on (the default; ZEROGPT_KEEP_HOST_MEMORY=0
overrides it) and the compute runs on the host. Nothing changes at import. Elsewhere than glibc: a no-op.
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


def release_freed_host_memory() -> bool:
    """Hand the pages that are free in the heap right now back to the kernel (glibc's malloc_trim).

    Called once, when the build is done: it frees what only it needed (init values, each shard's staging), and in a
    heap that is never trimmed those pages stayed resident beside training's own, 0.7-1.3 bytes/param at 531M
    parameters (tests/zero/test_host_bytes.py). Blocks in use and the settings above stay as they are; a page
    handed back faults in again when training reuses it, once. Returns whether anything was handed back.
    """
    libc = _glibc() if sys.platform.startswith("linux") else None
    return bool(libc.malloc_trim(0)) if libc is not None else False


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()  # only glibc has it (musl does not): its mallopt codes differ
    except (OSError, AttributeError):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_trim.restype = ctypes.c_int
    return libc
