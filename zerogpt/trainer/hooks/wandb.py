"""WandbHook: the run in Weights & Biases: the scalars TensorboardHook writes, the skipped-step count and the
resolved config, from global rank 0 (train_gpt.py builds it from `train.wandb = dict(project=..., mode=...)`).

wandb is imported when the run starts, on rank 0 only, so it stays an optional dependency (`pip install
'zerogpt[wandb]'`); `check_installed` is the one-line error train_gpt.py gives before launch when it is
missing. The W&B run id is this hook's state, so every checkpoint carries it and `--resume` continues the same
W&B run. Files go to <output_dir>/wandb/ (an offline run stays there for `wandb sync`).
"""
from __future__ import annotations

import importlib.util
import math
import os
from typing import Any

from zerogpt.trainer.hooks.base import Hook, every
from zerogpt.trainer.hooks.tensorboard import SCALARS

MODES = ("online", "offline", "disabled")
# TensorboardHook's train scalars, and the run's count of skipped updates (StepMetrics.skipped_steps)
TRAIN_SCALARS = SCALARS + tuple(n for n in ("skipped_steps",) if n not in SCALARS)


def check_installed(mode: str = "online") -> None:
    """ValueError (one line, before launch) when W&B is asked for and wandb is not installed."""
    if mode != "disabled" and importlib.util.find_spec("wandb") is None:
        raise ValueError("train.wandb is set but wandb is not installed: pip install 'zerogpt[wandb]' "
                         "(or remove train.wandb, or set train.wandb.mode='disabled')")


class WandbHook(Hook):
    """Logs train/<scalar> and mem/<name> every `log_interval` steps and valid/loss, valid/ppl at each evaluation,
    at the run's step, from rank 0; the config goes to the run's config.

    Args:
        output_dir: W&B writes <output_dir>/wandb/; the run is named after the folder unless `name` is given.
        log_interval: steps between train scalars (the loop reads numbers on those steps only).
        project, name, entity, group, tags: the W&B run's (see zerogpt.config.WandbConfig).
        mode: "online", "offline" (no network: <output_dir>/wandb/offline-run-*) or "disabled".
        config: the run's config (train_gpt.py: the tree config.py holds); classes and objects are
            written by name.

    Example:
        hooks = [WandbHook("runs/x", log_interval=10, project="gpt2", mode="offline", config=cfg.to_dict())]
    """

    def __init__(self, output_dir: str, log_interval: int = 10, project: str = "zerogpt", name: str | None = None,
                 entity: str | None = None, group: str | None = None, tags: list | tuple = (),
                 mode: str = "online", config: dict | None = None):
        if mode not in MODES:
            raise ValueError(f"WandbHook(mode={mode!r}): must be one of {', '.join(MODES)}")
        self.output_dir, self.log_interval = output_dir, log_interval
        self.init_args = dict(project=project, name=name or os.path.basename(os.path.abspath(output_dir)),
                              entity=entity, group=group, tags=list(tags), mode=mode)
        self.config = plain_config(config or {})
        self.run_id: str | None = None  # set on rank 0 when the run starts, or by load_state_dict on resume
        self._run = None

    def logs_at(self, step: int, max_steps: int | None) -> bool:
        return every(step, self.log_interval, max_steps)

    def before_train(self, trainer) -> None:
        if trainer.is_main and self._run is None:
            self._start()

    def _start(self) -> None:
        import wandb

        os.makedirs(self.output_dir, exist_ok=True)
        try:
            # a resumed run's id is in its checkpoint: resume="allow" continues that W&B run; a fresh one gets a new id
            self._run = wandb.init(dir=self.output_dir, id=self.run_id, resume="allow" if self.run_id else None,
                                   config=self.config, **self.init_args)
        except Exception as e:  # no API key, no network: say what to change
            raise RuntimeError(f"W&B could not start the run ({type(e).__name__}: {e}); log in with `wandb login`, "
                               f"or set train.wandb.mode='offline' and `wandb sync` later") from e
        self.run_id = self._run.id

    def after_step(self, trainer) -> None:
        s = trainer.state
        if self._run is None or not self.logs_at(s.step, s.max_steps):
            return
        data = {}
        for name in TRAIN_SCALARS:
            v = getattr(s.metrics, name, None)
            if v is not None and math.isfinite(float(v)):
                data[f"train/{name}"] = float(v)
        for name, v in (s.metrics.mem or {}).items():
            if v is not None:
                data[f"mem/{name}"] = v
        # W&B keeps the first values of a step: a resumed run's replayed steps (the same numbers) are dropped
        self._run.log(data, step=s.step)

    def after_eval(self, trainer) -> None:
        if not trainer.is_main:
            return
        restarted = self._run is None  # an evaluation after after_train (training ended early)
        if restarted:
            self._start()
        r = trainer.state.eval_results
        data = {"valid/loss": r["loss"]}
        if math.isfinite(r["ppl"]):
            data["valid/ppl"] = r["ppl"]
        self._run.log(data, step=r["step"])
        if restarted:
            self.after_train(trainer)

    def after_train(self, trainer) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None

    def state_dict(self) -> dict[str, Any]:
        """The W&B run id (rank 0's, the one a checkpoint saves), so a resumed run logs into the same run."""
        return {"run_id": self.run_id} if self.run_id else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.run_id = state.get("run_id")

    def __repr__(self) -> str:
        return f"WandbHook(project={self.init_args['project']!r}, mode={self.init_args['mode']!r})"


def plain_config(tree: Any) -> Any:
    """The config as W&B stores it: numbers, strings, lists and dicts; a class or function by its import path,
    any other object by its repr (a hook instance, a shard strategy)."""
    if isinstance(tree, dict):
        return {str(k): plain_config(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [plain_config(v) for v in tree]
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return tree
    if isinstance(tree, type) or callable(tree) and hasattr(tree, "__qualname__"):
        return f"{tree.__module__}.{tree.__qualname__}"
    return repr(tree)
