"""Trainer hooks, one file per family; all are importable from `zerogpt.trainer`."""
from zerogpt.trainer.hooks.base import Hook
from zerogpt.trainer.hooks.checkpoint import SaveCheckpointHook, latest_checkpoint
from zerogpt.trainer.hooks.eval import EvalHook
from zerogpt.trainer.hooks.logging import LogMetricByStepHook
from zerogpt.trainer.hooks.loss import LossHook
from zerogpt.trainer.hooks.lr import LRSchedulerHook
from zerogpt.trainer.hooks.memory import MemoryHook
from zerogpt.trainer.hooks.nan_guard import NaNGuardHook
from zerogpt.trainer.hooks.plot import PlotHook, plot_losses
from zerogpt.trainer.hooks.progress import ProgressBarHook
from zerogpt.trainer.hooks.tensorboard import TensorboardHook
from zerogpt.trainer.hooks.throughput import ThroughputHook, flops_per_token

__all__ = ["Hook", "LossHook", "LRSchedulerHook", "ThroughputHook", "MemoryHook", "LogMetricByStepHook",
           "TensorboardHook", "EvalHook", "SaveCheckpointHook", "ProgressBarHook", "NaNGuardHook", "PlotHook",
           "flops_per_token", "latest_checkpoint", "plot_losses"]
