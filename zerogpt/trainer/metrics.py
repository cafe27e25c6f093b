"""The typed numbers of one optimizer step and of one epoch, as Trainer.fit hands them to hooks.

A step's numbers stay on the device (0-dim tensors) until the loop reads them on a log step, so a step
that logs nothing makes no host sync. `StepMetrics.logged` says whether the fields are host floats.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class StepMetrics:
    """One optimizer step. Read the numbers only when `logged` is True: until then they are device tensors."""

    step: int
    """The optimizer step these numbers belong to (1-based: state.step after the update)."""
    loss: torch.Tensor | float
    """Mean loss over the step's micro-batches; on a log step, also averaged over ranks."""
    grad_norm: torch.Tensor | float | None = None
    """Global L2 norm of the gradients before clipping (NaN on an fp16 step skipped on overflow)."""
    lr: float | None = None
    """Learning rate of param group 0 used by this step."""
    skipped: bool = False
    """fp16 only: the loss scaler found an overflow and the update was skipped."""
    loss_scale: float | None = None
    """fp16 only: the loss scale after this step."""
    skipped_steps: torch.Tensor | int | None = None
    """Steps of the run whose update was skipped so far (a non-finite gradient, skipped on the device; fp16: an
    overflow), this one included."""
    h2d_bytes: int | None = None
    """Bytes this step copied from host (or disk) to the compute device on this rank: stage-3 gathers of host
    param shards, masters written into device param shards (engine.last_step_traffic). Counted on CPU too."""
    d2h_bytes: int | None = None
    """Bytes this step copied from the compute device to the host on this rank: reduced gradient shards handed to
    an offloaded optimizer, masters written into host param shards."""
    host_step_s: float | None = None
    """Seconds of the last finished optimizer step's chunk steps on this rank (engine.last_host_step_s): with the
    optimizer offloaded, the host step (CPU Adam and the compute copies); behind the next forward (stage 3 on a
    GPU), the previous step's."""
    logged: bool = False
    """True on a log step: the loop has copied every number to the host (one sync for the whole step)."""
    step_ms: float | None = None
    """Mean wall time per step over the steps since the previous log step (hook time excluded)."""
    tokens_per_s: float | None = None
    """Input tokens of all ranks per second over the same window."""
    samples_per_s: float | None = None
    """Samples of all ranks per second over the same window."""
    tflops: float | None = None
    """Achieved model TFLOPS per rank over the window (ThroughputHook, given FLOPs per token)."""
    mfu: float | None = None
    """tflops / the device's peak (ThroughputHook, when the peak is known)."""
    mem: dict[str, float | None] | None = None
    """Memory in MiB (MemoryHook): states per place, device peak, host RSS."""


@dataclass
class EpochMetrics:
    """One finished epoch, read on the host once at its end."""

    epoch: int
    """The epoch that ended (0-based)."""
    loss: float | None
    """Mean step loss over the epoch's steps and all ranks; None if no step finished in it."""
    steps: int
    """Optimizer steps that finished in this epoch."""


def host_float(value: Any) -> float | None:
    """A float from a Python number or a 0-dim tensor (a host sync for a device tensor)."""
    if value is None:
        return None
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)
