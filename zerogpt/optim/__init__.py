"""Optimizers and LR schedules for zerogpt.

CPUAdam / HybridAdam: fused Adam(W) over fp32 masters on the host (DeepSpeed's cpu_adam op or torch's
fused Adam as fallback; `cpu_adam_backend()` says which). build_lr_scheduler: warmup + cosine/linear/constant.
"""
from zerogpt.optim.cpu_adam import CPUAdam, HybridAdam, cpu_adam_backend
from zerogpt.optim.lr_scheduler import build_lr_scheduler

__all__ = ["CPUAdam", "HybridAdam", "cpu_adam_backend", "build_lr_scheduler"]
