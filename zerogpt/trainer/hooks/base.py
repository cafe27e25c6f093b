"""Hook: the base class of every trainer hook (one level deep, no registry).

A hook overrides the events it cares about; each gets the `zerogpt.trainer.Trainer` running the loop and
reads `trainer.state` (unannotated: trainer.py imports this module, so this one does not import trainer.py).
Hooks do side effects (log, eval, checkpoint, plot), never the computation of a step, and run in the order
they are listed.
"""
from __future__ import annotations

from typing import Any


class Hook:
    """Base hook: every event is a no-op, and no step's numbers are needed on the host.

    A hook that reads a step's numbers says on which steps through `logs_at`; the loop copies them to the
    host (one sync) only on steps where some hook asks, so `trainer.state.metrics.logged` is True there.

    Example:
        class PrintLoss(Hook):
            def logs_at(self, step, max_steps):
                return step % 100 == 0
            def after_step(self, trainer):
                if trainer.state.metrics.logged:
                    print(trainer.state.step, trainer.state.metrics.loss)
    """

    def logs_at(self, step: int, max_steps: int | None) -> bool:
        """True on the steps whose numbers this hook reads; must give the same answer on every rank."""
        return False

    def before_train(self, trainer) -> None: ...
    def after_train(self, trainer) -> None: ...
    def before_epoch(self, trainer) -> None: ...
    def after_epoch(self, trainer) -> None: ...
    def before_step(self, trainer) -> None: ...
    def after_step(self, trainer) -> None: ...
    def before_eval(self, trainer) -> None: ...
    def after_eval(self, trainer) -> None: ...
    def on_checkpoint(self, trainer, path: str) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe state a resumed run needs (saved in the checkpoint's extra_state); {} if none."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def every(step: int, interval: int | None, last_step: int | None = None) -> bool:
    """True on multiples of `interval` (None or 0 = never) and on the last step."""
    return bool(interval) and step % interval == 0 or step == last_step
