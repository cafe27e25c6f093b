"""EvalHook: validation loss and perplexity every `eval_interval` steps over `eval_iters` global batches, and at the end.

The evaluation itself is `Trainer.evaluate` (it fires before_eval/after_eval); this hook decides when.
Each evaluation restarts the validation loader, so every point of the curve is measured on the same
batches and the curve moves only because the model does. An eval iteration is one global batch (as in
Megatron-LM): `eval_iters * gradient_accumulation` micro-batches per rank, so a run resumed at another world
size with the same GLOBAL_BATCH_SIZE evaluates the same samples.
"""
from __future__ import annotations

from zerogpt.trainer.hooks.base import Hook, every


class EvalHook(Hook):
    """Runs `trainer.evaluate` on multiples of `eval_interval` and after the last step.

    Args:
        eval_interval: steps between evaluations (None: only at the end).
        eval_iters: global batches per evaluation (micro-batches per rank x accumulation steps).
        eval_dataloader: defaults to the one passed to `fit`.
        at_start: also evaluate before the first step (the untrained baseline).
    """


    def __init__(self, eval_interval: int | None = None, eval_iters: int = 10, eval_dataloader=None,
                 at_start: bool = False):
        self.eval_interval = eval_interval
        self.eval_iters = eval_iters
        self.eval_dataloader = eval_dataloader
        self.at_start = at_start
        self._last_eval_step: int | None = None

    def _run(self, trainer) -> None:
        if (self.eval_dataloader or trainer.eval_dataloader) is None:
            return
        trainer.evaluate(self.eval_dataloader, num_batches=self.eval_iters * trainer.engine.gradient_accumulation)
        self._last_eval_step = trainer.state.step

    def before_train(self, trainer) -> None:
        if trainer.state.step > 0:          # resumed: the run being continued evaluated up to here
            self._last_eval_step = trainer.state.step
        elif self.at_start:
            self._run(trainer)

    def after_step(self, trainer) -> None:
        # The last step is evaluated here rather than in after_train, so loggers still see it in order.
        if every(trainer.state.step, self.eval_interval, trainer.state.max_steps):
            self._run(trainer)

    def after_train(self, trainer) -> None:
        # Only when training ended early (data exhausted, a hook set should_stop) or had nothing to do; not when
        # a signal stopped it (whoever pressed Ctrl-C wants out, and a resumed run evaluates on schedule).
        if self._last_eval_step != trainer.state.step and trainer.state.interrupted is None:
            self._run(trainer)
