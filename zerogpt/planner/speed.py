"""How fast a plan runs, from a model written down here: seconds per optimizer step as a sum of terms.

    compute     tokens x FLOPs/token (PaLM: 6N + 12 L q s; x 4/3 with checkpointing, which reruns the forward)
                / (flops_per_s x m / (m + half_rate_tokens)), m the tokens of one micro-batch: small micro-batches
                leave the device underused (the measured 7.6x of 4 x 16 against 64 x 1 on an H100)
    link        bytes over PCIe (the host link) / link_bytes_per_s: gradients down and compute copies up with the
                optimizer offloaded (the gradient once per step when it crosses once or sums on the device, else
                fp32 at every micro-step), every non-resident param shard up at each forward and backward with
                param offload
    collective  bytes among ranks / collective_bytes_per_s: all-reduce (stages 0-1, once per step), reduce-scatter
                per micro-step (stages 2-3), all-gather per forward and backward (stage 3), x (N-1)/N
    step        the optimizer step: host_step_s_per_param x params/N on the host (bf16 moments: 0.8 of it, fewer
                bytes), + 2 x 12 bytes/param/N / disk_bytes_per_s on disk; device_step_s_per_param on the device
    overhead    micro_step_s per micro-step (launches, hooks, the data), per_chunk_s per chunk gathered or reduced

Calibration (`calibrate`): the trial steps measure seconds per step for a few candidates; each term's constant is
scaled by a least-squares fit of measured = sum_k a_k x term_k (a_k >= 0, one factor per term that varies among
the trials; with one trial, or terms that do not vary, a single factor for the whole step). The fitted factors
multiply the rates, so the next prediction on this machine uses them; they are cached with the plan.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from zerogpt.config.dtypes import DTYPES
from zerogpt.memory_model import ModelShape, chunk_of_params, grad_crosses_once
from zerogpt.planner.plan import Machine, Plan, Workload

__all__ = ["SpeedConstants", "TERMS", "default_constants", "step_terms", "tokens_per_s", "calibrate",
           "flops_per_token"]

TERMS = ("compute", "link", "collective", "step", "overhead")

# Dense bf16 peak FLOP/s of GPUs by name (vendor sheets, no sparsity); a GPU not listed gets the last entry
_GPU_PEAK = (("H200", 989e12), ("H100", 989e12), ("A100", 312e12), ("L40", 181e12), ("A6000", 155e12),
             ("4090", 165e12), ("3090", 71e12), ("", 100e12))


@dataclass(frozen=True)
class SpeedConstants:
    """The machine's rates. Defaults are typical; `calibrate` fits them to trial steps measured here."""

    flops_per_s: float
    half_rate_tokens: int
    link_bytes_per_s: float
    collective_bytes_per_s: float
    host_step_s_per_param: float
    device_step_s_per_param: float
    disk_bytes_per_s: float
    micro_step_s: float
    per_chunk_s: float

    def scaled(self, factors: dict[str, float]) -> "SpeedConstants":
        """These constants with each term's time multiplied by its factor (rates divided by it)."""
        f = {t: factors.get(t, 1.0) for t in TERMS}
        return replace(self, flops_per_s=self.flops_per_s / f["compute"],
                       link_bytes_per_s=self.link_bytes_per_s / f["link"],
                       collective_bytes_per_s=self.collective_bytes_per_s / f["collective"],
                       host_step_s_per_param=self.host_step_s_per_param * f["step"],
                       device_step_s_per_param=self.device_step_s_per_param * f["step"],
                       disk_bytes_per_s=self.disk_bytes_per_s / f["step"],
                       micro_step_s=self.micro_step_s * f["overhead"], per_chunk_s=self.per_chunk_s * f["overhead"])


def default_constants(machine: Machine, cpu_flops_per_s: float | None = None) -> SpeedConstants:
    """Uncalibrated rates: a GPU's from its name (40% of its dense peak, PCIe 4 x16 at 20 GB/s, the fused host Adam
    at ~1 ns/param on 16 cores); a CPU run's from `cpu_flops_per_s` (measured by the caller, a matmul), memcpy
    speed for its "link" and the host step on the same cores."""
    if machine.on_gpu:
        peak = next(p for name, p in _GPU_PEAK if name in machine.name)
        return SpeedConstants(flops_per_s=0.4 * peak, half_rate_tokens=4096, link_bytes_per_s=20e9,
                              collective_bytes_per_s=100e9, host_step_s_per_param=1.0e-9,
                              device_step_s_per_param=2e-11, disk_bytes_per_s=2e9, micro_step_s=2e-3,
                              per_chunk_s=5e-5)
    rate = cpu_flops_per_s or 5e10
    return SpeedConstants(flops_per_s=rate, half_rate_tokens=128, link_bytes_per_s=5e9,
                          collective_bytes_per_s=2e9, host_step_s_per_param=3e-9, device_step_s_per_param=3e-9,
                          disk_bytes_per_s=1e9, micro_step_s=2e-3, per_chunk_s=1e-4)


def flops_per_token(shape: ModelShape, seq_len: int) -> int:
    """Training FLOPs per token, PaLM appendix B: 6 x non-embedding params + 12 x layers x q width x seq."""
    embedding = shape.padded_vocab * shape.hidden + shape.position_rows * shape.hidden
    head = shape.padded_vocab * shape.hidden if shape.tied else 0  # a tied head is the embedding's matrix
    return 6 * (shape.num_params - embedding + head) + 12 * shape.layers * shape.q_width * seq_len


def _chunks(shape: ModelShape, precision: str, bucket_mb: float) -> int:
    numels = [n for _, n in shape.param_numels()]
    return max(chunk_of_params(numels, DTYPES[precision].itemsize, bucket_mb)) + 1


def step_terms(plan: Plan, work: Workload, k: SpeedConstants) -> dict[str, float]:
    """Seconds per optimizer step of each of TERMS for this plan."""
    shape, n = work.shape, work.world
    c = DTYPES[work.precision].itemsize
    psi = shape.num_params
    shard = math.ceil(psi / n)
    micro_tokens = plan.micro_batch * work.seq_len
    rank_tokens = micro_tokens * plan.accumulation
    flops = rank_tokens * flops_per_token(shape, work.seq_len) * (4 / 3 if plan.checkpoint else 1)
    compute = flops / (k.flops_per_s * micro_tokens / (micro_tokens + k.half_rate_tokens))

    link = 0.0
    if plan.offload_optimizer != "none":
        resident = min(plan.device_budget, shard * c) if plan.offload_param != "none" else 0
        sums_on_device = plan.stage >= 2 and (plan.offload_param == "none" or resident == shard * c)
        if grad_crosses_once(plan.stage, plan.accumulation) or sums_on_device:
            down = shard * c
        else:
            down = shard * 4 * plan.accumulation
        link += down + shard * c  # gradients down, compute copies up
    if plan.offload_param != "none":
        resident = min(plan.device_budget, shard * c)
        link += 2 * plan.accumulation * (shard * c - resident)  # forward and backward gathers from the host
    link /= k.link_bytes_per_s

    collective = 0.0
    if n > 1:
        ring = (n - 1) / n
        if plan.stage <= 1:
            moved = 2 * psi * c
        else:
            moved = plan.accumulation * psi * c + (2 * plan.accumulation * psi * c if plan.stage == 3 else psi * c)
        collective = ring * moved / k.collective_bytes_per_s

    if plan.offload_optimizer == "none":
        step = k.device_step_s_per_param * shard
    else:
        step = k.host_step_s_per_param * shard * (0.8 if plan.state_dtype == "bf16" else 1.0)
        if plan.offload_optimizer == "disk":
            step += 2 * 12 * shard / k.disk_bytes_per_s
    gathers = (3 if plan.stage == 3 else 1) * _chunks(shape, work.precision, plan.bucket_mb)
    overhead = plan.accumulation * (k.micro_step_s + gathers * k.per_chunk_s)
    return dict(compute=compute, link=link, collective=collective, step=step, overhead=overhead)


def tokens_per_s(plan: Plan, work: Workload, k: SpeedConstants) -> float:
    """Predicted tokens per second over all ranks."""
    return work.tokens_per_step / sum(step_terms(plan, work, k).values())


def calibrate(k: SpeedConstants, trials: list[tuple[dict[str, float], float]]) -> tuple[SpeedConstants, dict]:
    """Constants fitted to measured steps: `trials` = [(step_terms under k, measured seconds per step)].

    Least squares of measured = sum_k a_k term_k over the terms that vary between trials (a_k >= 0; a term
    fitted to <= 0 keeps its factor 1 and is dropped, and the fit is redone); the rest share one factor, as does
    everything when one trial is all there is. Returns (the scaled constants, the factors)."""
    import numpy as np

    if not trials:
        return k, {}
    predicted = np.array([sum(t.values()) for t, _ in trials])
    measured = np.array([m for _, m in trials])
    overall = float(np.median(measured / predicted))
    factors = dict.fromkeys(TERMS, overall)
    if len(trials) < 2:
        return k.scaled(factors), factors
    matrix = np.array([[t[name] for name in TERMS] for t, _ in trials])
    varying = [i for i, name in enumerate(TERMS) if np.ptp(matrix[:, i]) > 1e-3 * matrix[:, i].max(initial=0)]
    while varying and len(varying) <= len(trials):
        fixed = [i for i in range(len(TERMS)) if i not in varying]
        rest = measured - overall * matrix[:, fixed].sum(axis=1)
        solution, *_ = np.linalg.lstsq(matrix[:, varying], rest, rcond=None)
        if (solution > 0).all():
            factors.update({TERMS[i]: float(a) for i, a in zip(varying, solution)})
            break
        varying = [i for i, a in zip(varying, solution) if a > 0]
    return k.scaled(factors), factors
