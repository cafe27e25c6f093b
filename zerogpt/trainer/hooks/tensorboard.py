"""TensorboardHook: the train and valid numbers of metrics.jsonl as TensorBoard scalars (rank 0).

View with `tensorboard --logdir <output_dir>/tensorboard`. tensorboard is imported when the hook starts,
so it stays an optional dependency of the library.
"""
from __future__ import annotations

import math

from zerogpt.trainer.hooks.base import Hook, every

SCALARS = ("loss", "lr", "grad_norm", "loss_scale", "tokens_per_s", "tflops", "mfu", "step_ms")


class TensorboardHook(Hook):
    """Writes train/<name> every `log_interval` steps and valid/loss, valid/ppl at each evaluation.

    Args:
        log_dir: event files go here (train_gpt.py uses <output_dir>/tensorboard).
        log_interval: steps between train scalars.
        ranks: the ranks that write (Colossal-AI's argument); only rank 0 is supported.
    """

    def __init__(self, log_dir: str, log_interval: int = 10, ranks: tuple[int, ...] = (0,)):
        if tuple(ranks) != (0,):
            raise ValueError(f"TensorboardHook(ranks={ranks!r}): only rank 0 writes (every rank logs the same "
                             "global numbers); pass ranks=[0] or leave it out")
        self.log_dir = log_dir
        self.log_interval = log_interval
        self._writer = None

    def logs_at(self, step: int, max_steps: int | None) -> bool:
        return every(step, self.log_interval, max_steps)

    def before_train(self, trainer) -> None:
        if trainer.is_main:
            from torch.utils.tensorboard import SummaryWriter
            self._writer = SummaryWriter(self.log_dir, purge_step=trainer.state.step + 1)

    def after_step(self, trainer) -> None:
        s = trainer.state
        if self._writer is None or not self.logs_at(s.step, s.max_steps):
            return
        for name in SCALARS:
            v = getattr(s.metrics, name)
            if v is not None and math.isfinite(float(v)):
                self._writer.add_scalar(f"train/{name}", float(v), s.step)
        for name, v in (s.metrics.mem or {}).items():
            if v is not None:
                self._writer.add_scalar(f"mem/{name}", v, s.step)

    def after_eval(self, trainer) -> None:
        if not trainer.is_main:
            return
        if self._writer is None:   # an evaluation after after_train (training ended early)
            self.before_train(trainer)
        r = trainer.state.eval_results
        self._writer.add_scalar("valid/loss", r["loss"], r["step"])
        if math.isfinite(r["ppl"]):
            self._writer.add_scalar("valid/ppl", r["ppl"], r["step"])
        self._writer.flush()

    def after_train(self, trainer) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
