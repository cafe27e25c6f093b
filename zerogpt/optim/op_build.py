"""The CPU Adam ops' builds: whether one is due, the two lines a build at first use prints, the build at install.

torch.utils.cpp_extension JIT-builds an op with ninja into torch's extension cache the first time a process loads
it, and afterwards only loads it. A build is a silent half-minute or more per op (about 25 s for zerogpt's host
Adam and 45 s for DeepSpeed's cpu_adam on a 2-core machine, minutes on a busy one), so a build at first use says
so before it starts and when it is done, from rank 0 (`announced_build`), and `make install` builds both ahead
(`zerogpt build-ops`, launcher.py). A machine that cannot build is told so there, and runs fall back at run time as
before (cpu_adam.py: torch's fused Adam). It does not own the loading: host_adam.py and cpu_adam.py do.
"""
from __future__ import annotations

import contextlib
import glob
import os
import sys
import time
from typing import Iterator, Sequence

from zerogpt.logging import rank_logger

__all__ = ["extension_dir", "needs_build", "announced_build"]

HOST_ADAM = "zerogpt's host Adam op"
DEEPSPEED_ADAM = "DeepSpeed's cpu_adam op"
# what a build took on the 2-core CI machine (g++ -O3, one translation unit each): the "about" of the first line
BUILD_SECONDS = {HOST_ADAM: 25, DEEPSPEED_ADAM: 45}


def extension_dir(name: str) -> str:
    """Where torch.utils.cpp_extension.load builds the op `name`: $TORCH_EXTENSIONS_DIR/name, else torch's cache
    root/py<XY>_<cpu|cuXYZ|rocmXYZ>/name (cpp_extension's rule, which only a private function computes)."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        if torch.version.hip is not None:
            accelerator = f"rocm{torch.version.hip.replace('.', '')}"
        elif torch.version.cuda is not None:
            accelerator = f"cu{torch.version.cuda.replace('.', '')}"
        else:
            accelerator = "cpu"
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(get_default_build_root(), f"{python}_{accelerator}")
    return os.path.join(root, name)


def needs_build(name: str, sources: Sequence[str]) -> bool:
    """Whether loading op `name` will compile: no built library of it, or one older than a source (what ninja
    rebuilds for; a change of compiler flags alone is not seen, and then the build goes unannounced)."""
    built = glob.glob(os.path.join(extension_dir(name), f"{name}*.so"))
    if not built:
        return True
    newest_source = max((os.path.getmtime(s) for s in sources if os.path.exists(s)), default=0.0)
    return max(os.path.getmtime(path) for path in built) < newest_source


@contextlib.contextmanager
def announced_build(what: str, name: str, sources: Sequence[str]) -> Iterator[None]:
    """Around the load of op `name`: when it will compile, one line before ("building ... (first run only, about
    N s)") and one after it built. Rank 0 prints (every rank waits on the one build: torch's lock file)."""
    if not needs_build(name, sources):
        yield
        return
    log = rank_logger()
    log.info(f"building {what} into {extension_dir(name)} (first run only, about {BUILD_SECONDS[what]} s)")
    started = time.monotonic()
    yield  # a failed build raises through here: the loader's fallback says what happens instead
    log.info(f"built {what} in {time.monotonic() - started:.0f} s")
