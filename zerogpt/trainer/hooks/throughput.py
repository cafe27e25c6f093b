"""ThroughputHook: step time, tokens/s, samples/s, achieved TFLOPS per rank and MFU.

FLOPs per token follow the PaLM paper, appendix B: 6N for the matmuls of forward + backward plus
12·L·C·T for attention scores (N = parameters that take part in matmuls, so GPT-2's position embedding
is left out while the tied token embedding counts once, as the LM head; L layers, width C, T tokens of
context). Activation recomputation is not counted (model FLOPs, not hardware FLOPs), as in PaLM's MFU.
"""
from __future__ import annotations

import time

import torch

from zerogpt.trainer.hooks.base import Hook

# Dense peak TFLOPS per device for 16-bit matmuls (vendor datasheets; SXM parts). MFU is reported only
# when the device's name contains one of these keys; fp32 runs use the same table (TF32 tensor cores
# would make their honest peak lower, so fp32 MFU reads low, not high).
PEAK_TFLOPS_16BIT = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0,
                     "L4": 121.0, "V100": 125.0, "T4": 65.0, "4090": 165.0, "3090": 71.0}


def flops_per_token(num_params: int, n_layer: int, n_embd: int, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward) of a decoder-only transformer, PaLM appendix B."""
    return 6.0 * num_params + 12.0 * n_layer * n_embd * seq_len


def device_peak_tflops(device: torch.device) -> float | None:
    """The 16-bit dense peak of a CUDA device from PEAK_TFLOPS_16BIT, None when unknown (CPU included)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS_16BIT.items() if k in name), None)


class ThroughputHook(Hook):
    """Adds step_ms, tokens_per_s, samples_per_s (all ranks), tflops (per rank) and mfu to the metrics.

    The timer runs from before_step to after_step, so eval and checkpoint time are not counted.

    Args:
        flops_per_token: from `flops_per_token(...)`; None leaves tflops and mfu out.
        peak_tflops: the device's peak per rank; None looks it up by device name.
    """

    priority = 30

    def __init__(self, flops_per_token: float | None = None, peak_tflops: float | None = None):
        self.flops_per_token = flops_per_token
        self.peak_tflops = peak_tflops
        self._t0 = 0.0
        self._samples0 = self._tokens0 = 0

    def before_train(self, trainer) -> None:
        if self.peak_tflops is None:
            self.peak_tflops = device_peak_tflops(trainer.device)

    def before_step(self, trainer) -> None:
        self._sync(trainer)
        self._t0 = time.perf_counter()
        self._samples0, self._tokens0 = trainer.state.consumed_samples, trainer.state.tokens_seen

    def after_step(self, trainer) -> None:
        self._sync(trainer)
        dt = max(time.perf_counter() - self._t0, 1e-9)
        s = trainer.state
        tokens_per_s = (s.tokens_seen - self._tokens0) / dt
        m = s.metrics
        m["step_ms"] = dt * 1e3
        m["tokens_per_s"] = tokens_per_s
        m["samples_per_s"] = (s.consumed_samples - self._samples0) / dt
        if self.flops_per_token:
            m["tflops"] = self.flops_per_token * tokens_per_s / trainer.world_size / 1e12
            if self.peak_tflops:
                m["mfu"] = m["tflops"] / self.peak_tflops

    @staticmethod
    def _sync(trainer) -> None:
        # Kernels are asynchronous: read the clock only after the device has finished the step.
        if trainer.device.type == "cuda":
            torch.cuda.synchronize(trainer.device)
