"""Hook: the base class of every trainer hook (one level deep, no registry).

A hook overrides the events it cares about; each gets the trainer and reads/writes `trainer.state`.
Hooks do side effects (log, eval, checkpoint, plot), never the computation of a step.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zerogpt.trainer.trainer import Trainer


class Hook:
    """Base hook: every event is a no-op; lower `priority` runs first (ties keep list order).

    Built-in priorities: LossHook 10, LRSchedulerHook 20, Throughput/Memory 30, LogMetricByStep and
    Tensorboard 50, NaNGuard 55, ProgressBar 60, Eval 70, SaveCheckpoint 80, Plot 90. A user hook
    defaults to 50, so it sees this step's complete metrics.

    Example:
        class PrintLoss(Hook):
            def after_step(self, trainer):
                print(trainer.state.step, trainer.state.metrics["loss"])
    """

    priority: int = 50

    def before_train(self, trainer: Trainer) -> None: ...
    def after_train(self, trainer: Trainer) -> None: ...
    def before_epoch(self, trainer: Trainer) -> None: ...
    def after_epoch(self, trainer: Trainer) -> None: ...
    def before_step(self, trainer: Trainer) -> None: ...
    def after_step(self, trainer: Trainer) -> None: ...
    def before_eval(self, trainer: Trainer) -> None: ...
    def after_eval(self, trainer: Trainer) -> None: ...
    def on_checkpoint(self, trainer: Trainer, path: str) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe state a resumed run needs (saved in the checkpoint's extra_state); {} if none."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def __repr__(self) -> str:
        return f"{type(self).__name__}(priority={self.priority})"


def every(step: int, interval: int | None, last_step: int | None = None) -> bool:
    """True on multiples of `interval` (None or 0 = never) and on the last step."""
    return bool(interval) and step % interval == 0 or step == last_step
