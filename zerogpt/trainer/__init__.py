"""Trainer: the training loop (`Trainer.fit`), its typed state and the hooks that log, evaluate and save."""
from zerogpt.trainer.hooks import (EvalHook, Hook, LogMetricByEpochHook, LogMetricByStepHook, LossHook,
                                   LRSchedulerHook, MemoryHook, NaNGuardHook, PlotHook, ProgressBarHook,
                                   SaveCheckpointHook, TensorboardHook, ThroughputHook, WandbHook,
                                   latest_checkpoint, plot_losses)
from zerogpt.trainer.metrics import EpochMetrics, StepMetrics
from zerogpt.trainer.trainer import EVENTS, Trainer, TrainerState, epoch_steps, split_batch

__all__ = ["Trainer", "TrainerState", "StepMetrics", "EpochMetrics", "EVENTS", "epoch_steps", "split_batch", "Hook",
           "LossHook", "LRSchedulerHook", "ThroughputHook", "MemoryHook", "LogMetricByStepHook", "LogMetricByEpochHook",
           "TensorboardHook", "EvalHook", "SaveCheckpointHook", "ProgressBarHook", "NaNGuardHook", "PlotHook",
           "WandbHook", "latest_checkpoint", "plot_losses"]
