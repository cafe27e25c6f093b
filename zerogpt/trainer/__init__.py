"""Trainer: the training loop (`Trainer.fit`), its typed state and the hooks that log, evaluate and save."""
from zerogpt.trainer.hooks import (EvalHook, Hook, LogMetricByStepHook, LossHook, LRSchedulerHook, MemoryHook,
                                   NaNGuardHook, PlotHook, ProgressBarHook, SaveCheckpointHook, TensorboardHook,
                                   ThroughputHook, flops_per_token, latest_checkpoint, plot_losses)
from zerogpt.trainer.trainer import EVENTS, Trainer, TrainerState, split_batch

__all__ = ["Trainer", "TrainerState", "EVENTS", "split_batch", "Hook", "LossHook", "LRSchedulerHook",
           "ThroughputHook", "MemoryHook", "LogMetricByStepHook", "TensorboardHook", "EvalHook",
           "SaveCheckpointHook", "ProgressBarHook", "NaNGuardHook", "PlotHook", "flops_per_token",
           "latest_checkpoint", "plot_losses"]
