"""What the Trainer and its hooks need of an engine, as one typed surface (`TrainingEngine`).

`zerogpt.Engine` (what `initialize` returns) satisfies it, and so does the trainer tests' stand-in
(tests/trainer/engine_double.py); tests/trainer/test_engine_surface.py checks both. The Trainer and the hooks use
nothing else of an engine and probe for nothing: a member an engine lacks is an error here, not a default there.
Checkpoint files are `zerogpt/checkpoint.py`'s, which reads the engine's own state (DESIGN §3).
"""
from __future__ import annotations

from typing import Any, Callable, ContextManager, Protocol, runtime_checkable

import torch

from zerogpt.context import DistContext
from zerogpt.zero.offload import Traffic


class StepConfig(Protocol):
    """The engine config's keys the NaN guard's advice reads (EngineConfig)."""

    precision: str
    clip_grad_norm: float | None


@runtime_checkable
class TrainingEngine(Protocol):
    """An engine as the Trainer drives it: forward, backward, step, zero_grad, and the numbers of the last step."""

    ctx: DistContext
    """This rank's place in the run (device, groups, logger)."""
    config: StepConfig
    gradient_accumulation: int
    """Micro-batches per optimizer step: `step()` acts on the last of each."""
    criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None
    """loss(logits, labels), when the model does not compute its own loss."""
    model_computes_loss: bool
    """The model takes `labels=` and returns its own `.loss` (no logits exist): `criterion` is not called."""
    loss_context: Callable[[], ContextManager]
    """What a loss and its backward run inside (tensor parallelism's vocab-parallel loss)."""
    last_step_skipped: bool
    """The last optimizer step was skipped on an fp16 overflow (a Python bool)."""
    last_step_traffic: Traffic
    """Host<->device bytes the last optimizer step moved."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward."""

    def train(self) -> Any:
        """Training mode (dropout on, traffic counted)."""

    def eval(self) -> Any:
        """Evaluation mode."""

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate a micro-batch's scalar loss (the engine scales it)."""

    def step(self) -> torch.Tensor | None:
        """The optimizer step at the accumulation boundary: the grad norm as a 0-dim device tensor; else None."""

    def zero_grad(self) -> None:
        """Clear gradients at the accumulation boundary (a no-op mid-accumulation)."""

    @property
    def last_step_found_inf(self) -> torch.Tensor:
        """1.0 when the last step was skipped for a non-finite gradient, else 0.0: a 0-dim device tensor."""

    @property
    def lr(self) -> float:
        """The learning rate the last step used (the first param group's)."""

    @property
    def loss_scale(self) -> float | None:
        """fp16's dynamic loss scale (1.0 for fp32 and bf16)."""

    @property
    def last_host_step_s(self) -> float:
        """Seconds the last finished step's host (offloaded) optimizer step took."""

    def memory_stats(self) -> dict[str, dict[str, int]]:
        """Model-state bytes on this rank: {category: {home: bytes}} (the memory hook's numbers)."""

    def save_checkpoint(self, directory: str, extra_state: dict | None = None) -> str:
        """Write a checkpoint with the Trainer's `extra_state` (all ranks call)."""

    def load_checkpoint(self, directory: str) -> dict:
        """Load a checkpoint; returns the `extra_state` saved with it."""
