"""Trainer hooks, one file per family; all are importable from `zerogpt.trainer`."""
from zerogpt.trainer.hooks.base import Hook
from zerogpt.trainer.hooks.checkpoint import SaveCheckpointHook, latest_checkpoint
from zerogpt.trainer.hooks.eval import EvalHook
from zerogpt.trainer.hooks.logging import LogMetricByEpochHook, LogMetricByStepHook
from zerogpt.trainer.hooks.loss import LossHook
from zerogpt.trainer.hooks.lr import LRSchedulerHook
from zerogpt.trainer.hooks.memory import MemoryHook
from zerogpt.trainer.hooks.nan_guard import NaNGuardHook
from zerogpt.trainer.hooks.plot import PlotHook, plot_losses
from zerogpt.trainer.hooks.progress import ProgressBarHook
from zerogpt.trainer.hooks.tensorboard import TensorboardHook
from zerogpt.trainer.hooks.throughput import ThroughputHook
from zerogpt.trainer.hooks.wandb import WandbHook

__all__ = ["Hook", "LossHook", "LRSchedulerHook", "ThroughputHook", "MemoryHook", "LogMetricByStepHook",
           "LogMetricByEpochHook", "TensorboardHook", "EvalHook", "SaveCheckpointHook", "ProgressBarHook",
           "NaNGuardHook", "PlotHook", "WandbHook", "latest_checkpoint", "plot_losses"]
