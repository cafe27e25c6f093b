"""The machine plan="auto" plans for: its capacities, a fingerprint that says whether it is the same machine, the
measured CPU compute rate, and the plan cache (a JSON file keyed by fingerprint, model shape and zerogpt version).

Device memory: torch.cuda.mem_get_info on a GPU (total, as a run starts alone on its device); on a CPU run a
simulated capacity, ZEROGPT_DEVICE_MEM (bytes or a size such as 2GiB, for tests and benches), else the host RAM.
Host RAM and disk: zerogpt/preflight_memory.py's available_host_bytes and free_disk_bytes.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from zerogpt.atomic_write import write_json_atomic
from zerogpt.planner.plan import Machine, Plan, PlanError, Workload

__all__ = ["DEVICE_MEM_ENV", "CACHE_ENV", "detect_machine", "fingerprint", "cpu_flops_per_s", "PlanCache",
           "parse_bytes", "saved_plan"]

DEVICE_MEM_ENV = "ZEROGPT_DEVICE_MEM"
CACHE_ENV = "ZEROGPT_PLAN_CACHE"
_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "kb": 10**3, "m": 2**20, "mib": 2**20, "mb": 10**6,
          "g": 2**30, "gib": 2**30, "gb": 10**9, "t": 2**40, "tib": 2**40, "tb": 10**12}


def parse_bytes(text: str, name: str = DEVICE_MEM_ENV) -> int:
    """'2GiB', '512MB', '1073741824' -> bytes; anything else is one line naming `name`."""
    raw = text.strip().lower()
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(number):].strip()
    try:
        value = float(number) * _UNITS[unit]
    except (ValueError, KeyError):
        raise PlanError(f"${name}={text!r} is not a size; give bytes or e.g. 2GiB, 512MB") from None
    return int(value)


def _mem_total() -> int:
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    except (OSError, StopIteration):
        return 0


def detect_machine(local_ranks: int = 1, disk_path: str | None = None, device_bytes: int | None = None,
                   margin: float = 0.1) -> Machine:
    """This machine's capacities. `device_bytes` overrides the device's (a simulated capacity), as does
    $ZEROGPT_DEVICE_MEM."""
    import torch

    from zerogpt.preflight_memory import available_host_bytes, free_disk_bytes

    on_gpu = torch.cuda.is_available()
    host, _ = available_host_bytes()
    if on_gpu:
        name = torch.cuda.get_device_name()
        total = torch.cuda.mem_get_info()[1]
    else:
        name, total = f"cpu x{os.cpu_count()}", host // max(local_ranks, 1)
    env = os.environ.get(DEVICE_MEM_ENV)
    if device_bytes is None and env:
        device_bytes = parse_bytes(env)
    disk = free_disk_bytes(disk_path) if disk_path else None
    return Machine(device_bytes=device_bytes or total, host_bytes=host, disk_bytes=disk, local_ranks=local_ranks,
                   on_gpu=on_gpu, name=name, margin=margin, gpu_overhead=2**30 if on_gpu else 0)


def fingerprint(machine: Machine) -> str:
    """What makes two machines the same for a plan: the device's name and capacity, the host's RAM and cores,
    the ranks on it, the torch version (not the free memory of the moment, which moves)."""
    import torch

    parts = dict(device=machine.name, device_bytes=machine.device_bytes, on_gpu=machine.on_gpu,
                 mem_total=_mem_total(), cpus=os.cpu_count(), ranks=machine.local_ranks, torch=torch.__version__,
                 host=platform.node())
    return json.dumps(parts, sort_keys=True)


def cpu_flops_per_s(size: int = 512, repeats: int = 3) -> float:
    """The CPU's fp32 matmul rate, measured (the compute rate of a CPU run's speed model before calibration)."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / max(best, 1e-9)


def saved_plan(entry: Any) -> tuple[Plan, dict] | None:
    """(plan, speed factors) of a plan saved as JSON (a cache entry, a run directory's plan.json), or None where the
    JSON is not one (hand-edited, another layout): then it is planned again, not a crash."""
    try:
        plan = Plan(**entry["plan"])
        factors = {str(term): float(f) for term, f in dict(entry.get("factors") or {}).items()}
    except (TypeError, KeyError, ValueError, AttributeError):
        return None
    return (plan, factors) if all(f > 0 for f in factors.values()) else None  # a factor divides a rate


class PlanCache:
    """The chosen plan and the calibrated speed factors, per (machine fingerprint, workload, zerogpt version).

    One JSON file ($ZEROGPT_PLAN_CACHE, else ~/.cache/zerogpt/plans.json), written atomically. An entry written
    by another zerogpt version or on another machine is not used, and `lookup` says so (`note`)."""

    def __init__(self, path: str | None = None):
        default = Path.home() / ".cache" / "zerogpt" / "plans.json"
        self.path = Path(path or os.environ.get(CACHE_ENV) or default)

    @staticmethod
    def key(work: Workload) -> str:
        w = asdict(work)
        w["fixed"] = sorted((k, repr(v)) for k, v in work.fixed.items())
        return hashlib.sha256(json.dumps(w, sort_keys=True, default=repr).encode()).hexdigest()[:16]

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def lookup(self, work: Workload, machine_print: str, version: str) -> tuple[tuple[Plan, dict] | None, str]:
        """((plan, speed factors) chosen for this workload on this machine and version, or None; a note on what was
        reused or ignored)."""
        entry = self._read().get(self.key(work))
        if entry is None:
            return None, ""
        found = saved_plan(entry) if isinstance(entry, dict) else None
        if found is None:
            return None, f"plan cache {self.path}: this workload's entry is not a plan; ignored, planning again"
        if entry.get("version") != version:
            return None, (f"plan cache {self.path}: written by zerogpt {entry.get('version')}, this is {version}; "
                          f"ignored, planning again")
        if entry.get("machine") != machine_print:
            return None, f"plan cache {self.path}: written on another machine; ignored, planning again"
        return found, f"plan cache {self.path}: reusing the plan chosen on this machine at {entry.get('when')}"

    def store(self, work: Workload, machine_print: str, version: str, plan: Plan, factors: dict) -> None:
        data = self._read()
        data[self.key(work)] = dict(version=version, machine=machine_print, plan=plan.to_dict(), factors=factors,
                                    when=time.strftime("%Y-%m-%d %H:%M:%S"))
        write_json_atomic(self.path, data, sort_keys=True)


