"""MemoryHook: model-state bytes from the engine's own accounting, device peak, host RSS.

Numbers go to `state.metrics.mem` in MiB: the engine's params/grads/master/optimizer bytes summed
per place (device / host / disk), the device's peak allocation since the last report, and the
process's resident host memory.
"""
from __future__ import annotations

import os

import torch

from zerogpt.trainer.hooks.base import Hook, every

MIB = 2.0**20


class MemoryHook(Hook):
    """Adds `mem = {states_device_mb, states_host_mb, states_disk_mb, device_peak_mb, host_rss_mb}`.

    Args:
        interval: measure every `interval` steps (and on the last); the peak counter is reset after
            each measurement, so device_peak_mb is the peak over the interval. Reading allocator
            counters and RSS is host-side: it does not wait for the device.
    """

    def __init__(self, interval: int = 1):
        self.interval = interval

    def after_step(self, trainer) -> None:
        s = trainer.state
        if not every(s.step, self.interval, s.max_steps):
            return
        mem: dict[str, float | None] = {}
        stats = trainer.engine.memory_stats()
        for place in ("device", "host", "disk"):
            mem[f"states_{place}_mb"] = sum(kind.get(place, 0) for kind in stats.values()) / MIB
        mem["device_peak_mb"] = None
        if trainer.device.type == "cuda":
            mem["device_peak_mb"] = torch.cuda.max_memory_allocated(trainer.device) / MIB
            torch.cuda.reset_peak_memory_stats(trainer.device)
        mem["host_rss_mb"] = host_rss_bytes() / MIB
        s.metrics.mem = mem


def host_rss_bytes() -> int:
    """Resident set size of this process (psutil, else /proc; 0 if neither is available)."""
    try:
        import psutil
        return psutil.Process(os.getpid()).memory_info().rss
    except ImportError:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            return 0
