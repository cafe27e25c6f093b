"""ProgressBarHook: a rank-0 tqdm bar over optimizer steps with the ETA and the latest loss."""
from __future__ import annotations

from zerogpt.trainer.hooks.base import Hook


class ProgressBarHook(Hook):
    """Shows step/max_steps, steps/s, ETA, and the loss and lr of the latest log step on rank 0 (tqdm)."""

    def __init__(self, desc: str = "train"):
        self.desc = desc
        self._bar = None

    def before_train(self, trainer) -> None:
        if trainer.is_main:
            from tqdm.auto import tqdm
            s = trainer.state
            self._bar = tqdm(total=s.max_steps, initial=s.step, desc=self.desc, unit="step",
                             dynamic_ncols=True)

    def after_step(self, trainer) -> None:
        if self._bar is not None:
            m = trainer.state.metrics
            if m.logged:
                post = {"loss": f"{m.loss:.4f}"}
                if m.lr is not None:
                    post["lr"] = f"{m.lr:.2e}"
                self._bar.set_postfix(post, refresh=False)
            self._bar.update(1)

    def after_train(self, trainer) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
