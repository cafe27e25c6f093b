"""keep_freed_host_memory (config key host.keep_freed_memory): a training-like loop stops page-faulting once warm; the opt-out leaves malloc as is.

Each case runs in a fresh interpreter: the malloc setting is process-wide and cannot be undone.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc knobs")

# A "step" allocates blocks of several sizes far above glibc's mmap threshold (as activations, logits and
# gradient buffers are), touches every page and frees them. Faults are counted over steps 4-6: the first
# steps may still grow the heap (torch asks posix_memalign for a little more than a freed block of the same
# size, so which free block fits depends on where the heap happened to start), the steady state must not.
PROBE = textwrap.dedent("""
    import json, resource, torch
    from zerogpt.config import HostConfig
    from zerogpt.host_memory import keep_freed_host_memory
    applied = HostConfig().with_env_overrides().keep_freed_memory and keep_freed_host_memory()
    sizes = [64 * 2**20, 16 * 2**20, 40 * 2**20, 9 * 2**20]  # fp32 elements: 256, 64, 160, 36 MiB
    def step():
        blocks = [torch.empty(n).fill_(1.0) for n in sizes]  # allocate and touch every page, all alive at once
        del blocks
    for _ in range(3):
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        step()
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 3
    print(json.dumps({"applied": applied, "faults": faults, "pages": sum(sizes) * 4 // 4096}))
""")


def probe(**env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, **env}, capture_output=True,
                         text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_warm_steps_reuse_pages():
    result = probe()
    assert result["applied"] is True
    assert result["faults"] < result["pages"] // 10, result


def test_opt_out_leaves_malloc_alone():
    result = probe(ZEROGPT_KEEP_HOST_MEMORY="0")
    assert result["applied"] is False
    assert result["faults"] > result["pages"] // 2, result  # glibc's default: mmap + munmap every time


RELEASE = textwrap.dedent("""
    import json, torch
    from zerogpt.host_memory import keep_freed_host_memory, release_freed_host_memory
    def rss():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))
    assert keep_freed_host_memory()
    keep = torch.ones(2**20)  # in use below the freed block: its pages stay
    freed = torch.ones(64 * 2**20)  # 256 MiB, as the build's init values: freed, kept resident by the setting
    keep_above = torch.ones(2**20)  # in use above it, so it is a hole in the heap, not its top
    del freed
    held = rss()
    released = release_freed_host_memory()
    print(json.dumps({"released": released, "dropped": held - rss(), "kept": float(keep.sum() + keep_above.sum())}))
""")


def test_the_builds_freed_heap_is_handed_back():
    """The build calls release_freed_host_memory once it is done: pages free in the never-trimmed heap go back to
    the kernel, blocks in use stay."""
    out = subprocess.run([sys.executable, "-c", RELEASE], capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["released"] is True
    assert result["dropped"] > 200 * 2**20, result
    assert result["kept"] == 2 * 2**20
