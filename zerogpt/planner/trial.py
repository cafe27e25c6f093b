"""Trial steps: a candidate plan built for real and run for a few optimizer steps on random tokens, measuring its
seconds per step and its peaks; the engine is closed after and the RNG states put back, so the run that follows
starts exactly as a hand-set run of the chosen plan would (its model is built again from the same seed).

Memory measured: on CUDA, torch.cuda.max_memory_allocated over the trial's steps. On a CPU run, whose device is
simulated: the device home's model state at the step's start plus the peak of the bytes the step's ops on the
training thread make and hold at once (live_bytes.py: activations, gathered chunks, gradient buffers, the loss's and
the step's temporaries), plus the host-homed shards a CPU run computes on in place where a GPU would copy them to the
device (stage 3, parameters offloaded, one rank). On a CPU run an offloaded plan's homes are otherwise one memory:
what the training thread makes and the engine then holds in the host home (held_elsewhere: at one rank the reduced
gradient buffer taken as the host's grad shard) is left out while it is held there.
Host: the process's peak resident set over the build and the steps above what it held before (VmHWM after
resetting it through /proc/self/clear_refs, less VmRSS then): on a CPU run that includes the device home.
A trial that runs out of memory (torch.OutOfMemoryError, or on CPU a device peak over the simulated capacity) is
a lost candidate, not a crash.
"""
from __future__ import annotations

import functools
import gc
import random
import time
from typing import Any, Callable

import numpy as np
import torch

from zerogpt.planner.live_bytes import LiveBytes
from zerogpt.trainer import Trainer
from zerogpt.trainer.hooks.base import Hook

__all__ = ["run_trial", "StepClock", "TrialOutOfMemory", "rng_states", "restore_rng_states"]


class TrialOutOfMemory(RuntimeError):
    """A trial's measured device peak is over the (simulated) device capacity."""


def _reset_host_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


def _status(field: str) -> int | None:
    """A /proc/self/status field in bytes (VmHWM: peak resident set; VmRSS: resident now)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
    except (OSError, StopIteration):
        return None


class StepClock(Hook):
    """Seconds and device peaks of each step of a trial.

    On CUDA every step is timed and measured. On a CPU the measure (a Python call per op) would slow the step it
    watches, unevenly across plans (a plan of many small ops pays most): steps before `measured_step` are timed,
    from it on they are measured."""

    def __init__(self, device: torch.device, engine: Any, measured_step: int = 0):
        self.device, self.engine, self.seconds, self.device_peaks = device, engine, [], []
        self.measured_step = 0 if device.type == "cuda" else measured_step
        self.live: LiveBytes | None = None  # on while a CPU step is measured
        self.start_state = self.computed_in_place = 0
        self._sampler = None

    def _sample_in_place(self, module: Any, args: Any) -> None:
        self.computed_in_place = max(self.computed_in_place, _host_shards_computed_in_place(self.engine))

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def before_step(self, trainer) -> None:
        self._sync()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif trainer.state.step >= self.measured_step:  # steps done before this one
            self.start_state = sum(home["device"] for home in self.engine.memory_stats().values())
            self.live = LiveBytes(functools.partial(held_elsewhere, self.engine)).__enter__()
            self.computed_in_place = 0
            self._sampler = torch.nn.modules.module.register_module_forward_pre_hook(self._sample_in_place)
        self.start = time.perf_counter()

    def after_step(self, trainer) -> None:
        self._sync()
        seconds = time.perf_counter() - self.start
        if self.device.type == "cuda":
            self.seconds.append(seconds)
            self.device_peaks.append(torch.cuda.max_memory_allocated(self.device))
        elif self.live is None:
            self.seconds.append(seconds)
        else:
            self.device_peaks.append(self.start_state + self.live.peak + self.computed_in_place)
            self.close()

    def close(self) -> None:
        """Stop measuring (also when a step raised: the mode and the hook must not outlive the trial)."""
        if self.live is not None:
            self.live.__exit__(None, None, None)
            self._sampler.remove()
            self.live = None


def held_elsewhere(engine: Any) -> set[int]:
    """Data pointers of the storages the engine holds in the host or disk home and not in the device's."""
    homes: dict[int, set[str]] = {}
    for _, tensor, home in engine.held_tensors():
        homes.setdefault(tensor.untyped_storage().data_ptr(), set()).add(home)
    return {ptr for ptr, held in homes.items() if "device" not in held}


def _host_shards_computed_in_place(engine: Any) -> int:
    """Bytes of the gathered chunks that are host-homed shards used where they lie: a CPU run at one shard per chunk
    computes on them in place (Chunk.gather copies nothing), where a GPU run holds a device copy of each."""
    def storage(t: torch.Tensor) -> int:
        return t.untyped_storage().data_ptr()
    return sum(c.full.untyped_storage().nbytes() for c in engine.chunks
               if c.full is not None and c.shard_home != "device" and storage(c.full) == storage(c.shard))


def rng_states() -> dict:
    """Every RNG a step may draw from (Python, numpy, torch CPU and CUDA)."""
    return dict(python=random.getstate(), numpy=np.random.get_state(), torch=torch.random.get_rng_state(),
                cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)


def restore_rng_states(states: dict) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.random.set_rng_state(states["torch"])
    if states["cuda"] is not None:
        torch.cuda.set_rng_state_all(states["cuda"])


def run_trial(build_engine: Callable[[], Any], micro_batch: int, accumulation: int, seq_len: int, vocab: int,
              steps: int = 2, device_capacity: int | None = None) -> dict:
    """Build an engine (`build_engine()`), run `steps` optimizer steps on random tokens and measure them (on a CPU,
    one more step measures the device peak: see StepClock).

    Returns {"seconds": the fastest step after the first, "device_peak", "host_peak"} or {"error": why} when it ran
    out of memory (CUDA's error or, on CPU, a measured device peak over `device_capacity`). RNG states are restored
    either way; the engine is closed and dropped."""
    states = rng_states()
    engine = clock = None
    gc.collect()
    _reset_host_peak()
    before = _status("VmRSS")  # what the process held already: the trial's host peak is above it
    try:
        engine = build_engine()
        clock = StepClock(engine.ctx.device, engine, measured_step=steps)
        total = steps + (engine.ctx.device.type != "cuda")
        g = torch.Generator().manual_seed(0)
        batches = [torch.randint(0, vocab, (micro_batch, seq_len + 1), generator=g)
                   for _ in range(total * accumulation)]
        Trainer(engine, hooks=[clock]).fit(batches, max_steps=total)
        device_peak = max(clock.device_peaks)
        if engine.ctx.device.type != "cuda" and device_capacity is not None and device_peak > device_capacity:
            raise TrialOutOfMemory(f"device peak {device_peak / 2**30:.2f} GiB > simulated capacity "
                                   f"{device_capacity / 2**30:.2f} GiB")
        peak = _status("VmHWM")
        # RSS can fall below what it was before (pages freed): a trial that added nothing is 0, not negative
        host_peak = None if peak is None or before is None else max(0, peak - before)
        timed = clock.seconds[1:] or clock.seconds  # the first step pays for warm-up (allocations, recorded orders)
        return dict(seconds=min(timed), device_peak=device_peak, host_peak=host_peak)
    except (torch.OutOfMemoryError, TrialOutOfMemory) as e:
        return dict(error=f"out of memory ({str(e).splitlines()[0][:120]})")
    finally:
        if clock is not None:
            clock.close()
        if engine is not None:
            engine.close()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        restore_rng_states(states)
