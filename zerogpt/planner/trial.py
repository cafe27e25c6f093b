"""Trial steps: a candidate plan built for real and run for a few optimizer steps on random tokens, measuring its
seconds per step and its peaks; the engine is closed after and the RNG states put back, so the run that follows
starts exactly as a hand-set run of the chosen plan would (its model is built again from the same seed).

Memory measured: on CUDA, torch.cuda.max_memory_allocated over the trial's steps. On a CPU run, whose device is
simulated: the model state in the device home (Engine.memory_stats at every engine.step() call, after each
micro-step's backward, and at the step's end) plus the peak of the
activations saved for backward that are alive at once (autograd's saved-tensor hooks, parameters excluded). Known
gaps of the CPU measure: at stage 3 the engine's own saved-tensor hooks (zero/gather_hooks.py) take precedence over
these, so the activations are not seen there, and buffers freed inside a micro-step (gathered chunks, gradient
chunks in flight) are not either; the simulated out-of-memory is then decided on less than was used.
Host: the process's peak resident set over the build and the steps above what it held before (VmHWM after
resetting it through /proc/self/clear_refs, less VmRSS then): on a CPU run that includes the device home.
A trial that runs out of memory (torch.OutOfMemoryError, or on CPU a device peak over the simulated capacity) is
a lost candidate, not a crash.
"""
from __future__ import annotations

import gc
import random
import time
import weakref
from typing import Any, Callable

import numpy as np
import torch

from zerogpt.trainer import Trainer
from zerogpt.trainer.hooks.base import Hook

__all__ = ["run_trial", "TrialOutOfMemory", "rng_states", "restore_rng_states"]


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


class _SavedActivations:
    """The bytes autograd keeps for backward alive at once (parameters excluded), and their peak."""

    def __init__(self) -> None:
        self.live = self.peak = 0
        self._seen: set[int] = set()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, torch.nn.Parameter) or t.device.type == "meta":
            return t
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key and key not in self._seen:
            self._seen.add(key)
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._free, key, storage.nbytes())
        return t

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes

    def __enter__(self) -> "_SavedActivations":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


class _StepClock(Hook):
    """Seconds and device peaks of each step of a trial."""

    def __init__(self, device: torch.device):
        self.device, self.seconds, self.device_peaks = device, [], []
        self.saved: _SavedActivations | None = None
        self.state_peak = 0

    def watch_states(self, engine: Any) -> None:
        """CPU: the device home's model state sampled at every engine.step() call, after each micro-step's backward,
        while its gradients are held (the step's end has dropped them)."""
        step = engine.step

        def sampled() -> Any:
            stats = engine.memory_stats()
            self.state_peak = max(self.state_peak, sum(home["device"] for home in stats.values()))
            return step()
        engine.step = sampled

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def before_step(self, trainer) -> None:
        self._sync()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.saved = _SavedActivations().__enter__()
        self.start = time.perf_counter()

    def after_step(self, trainer) -> None:
        self._sync()
        self.seconds.append(time.perf_counter() - self.start)
        if self.device.type == "cuda":
            self.device_peaks.append(torch.cuda.max_memory_allocated(self.device))
        else:
            self.saved.__exit__(None, None, None)
            stats = trainer.engine.memory_stats()
            state = max(self.state_peak, sum(home["device"] for home in stats.values()))
            self.device_peaks.append(state + self.saved.peak)
            self.state_peak = 0


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
    """Build an engine (`build_engine()`), run `steps` optimizer steps on random tokens and measure them.

    Returns {"seconds": the fastest step after the first, "device_peak", "host_peak"} or {"error": why} when it ran
    out of memory (CUDA's error or, on CPU, a measured device peak over `device_capacity`). RNG states are restored
    either way; the engine is closed and dropped."""
    states = rng_states()
    engine = None
    gc.collect()
    _reset_host_peak()
    before = _status("VmRSS")  # what the process held already: the trial's host peak is above it
    try:
        engine = build_engine()
        clock = _StepClock(engine.ctx.device)
        if engine.ctx.device.type != "cuda":
            clock.watch_states(engine)
        g = torch.Generator().manual_seed(0)
        batches = [torch.randint(0, vocab, (micro_batch, seq_len + 1), generator=g)
                   for _ in range(steps * accumulation)]
        Trainer(engine, hooks=[clock]).fit(batches, max_steps=steps)
        device_peak = max(clock.device_peaks)
        if engine.ctx.device.type != "cuda" and device_capacity is not None and device_peak > device_capacity:
            raise TrialOutOfMemory(f"device peak {device_peak / 2**30:.2f} GiB > simulated capacity "
                                   f"{device_capacity / 2**30:.2f} GiB")
        peak = _status("VmHWM")
        host_peak = None if peak is None or before is None else peak - before
        timed = clock.seconds[1:] or clock.seconds  # the first step pays for warm-up (allocations, recorded orders)
        return dict(seconds=min(timed), device_peak=device_peak, host_peak=host_peak)
    except (torch.OutOfMemoryError, TrialOutOfMemory) as e:
        return dict(error=f"out of memory ({str(e).splitlines()[0][:120]})")
    finally:
        if engine is not None:
            engine.close()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        restore_rng_states(states)
