"""ThroughputHook: achieved TFLOPS per rank and MFU, from the loop's tokens/s over each logging window.

FLOPs per token come from the model (model_zoo's `GPT.flops_per_token`, PaLM appendix B). Activation
recomputation is not counted (model FLOPs, not hardware FLOPs), as in PaLM's MFU. The loop itself times
the window (step_ms, tokens_per_s, samples_per_s in `state.metrics`).
"""
from __future__ import annotations

import torch

from zerogpt.trainer.hooks.base import Hook

# Dense peak TFLOPS per device for 16-bit matmuls (vendor datasheets; SXM parts). MFU is reported only
# when the device's name contains one of these keys; fp32 runs use the same table (TF32 tensor cores
# would make their honest peak lower, so fp32 MFU reads low, not high).
PEAK_TFLOPS_16BIT = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0,
                     "L4": 121.0, "V100": 125.0, "T4": 65.0, "4090": 165.0, "3090": 71.0}


def device_peak_tflops(device: torch.device) -> float | None:
    """The 16-bit dense peak of a CUDA device from PEAK_TFLOPS_16BIT, None when unknown (CPU included)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS_16BIT.items() if k in name), None)


class ThroughputHook(Hook):
    """Adds tflops (per rank) and mfu to the metrics of log steps.

    Args:
        flops_per_token: training FLOPs per token (e.g. `model.flops_per_token(seq_len)`); None leaves
            tflops and mfu out.
        peak_tflops: the device's peak per rank; None looks it up by device name.
    """

    def __init__(self, flops_per_token: float | None = None, peak_tflops: float | None = None):
        self.flops_per_token = flops_per_token
        self.peak_tflops = peak_tflops

    def before_train(self, trainer) -> None:
        if self.peak_tflops is None:
            self.peak_tflops = device_peak_tflops(trainer.device)

    def after_step(self, trainer) -> None:
        m = trainer.state.metrics
        if not m.logged or not self.flops_per_token:
            return
        # per device: the model's FLOPs of every token trained, shared by all T x P x D ranks of the run
        m.tflops = self.flops_per_token * m.tokens_per_s / trainer.world_size / 1e12
        if self.peak_tflops:
            m.mfu = m.tflops / self.peak_tflops
