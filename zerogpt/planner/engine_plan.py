"""The engine plan: every decision of `initialize`'s build, made in one place before anything is allocated.

`plan_engine` reads the engine config, the parameters' local shapes and the facts of this rank's place (its device,
the device's free memory, whether the ranks share host memory) and returns one frozen `EnginePlan`:
the chunk layout, where parameter shards, gradients, masters and optimizer state live, their dtypes, and what a GPU
computing changes. `EnginePlan.describe()` prints every decision. `zerogpt/build_engine.py` only executes the plan;
nothing else in the build reads the config to decide. No allocation, no collective: tests/planner/test_engine_plan.py
checks plans without an engine.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zerogpt.amp import TORCH_DTYPES, compute_dtype
from zerogpt.config import EngineConfig, HostConfig
from zerogpt.context import DistContext
from zerogpt.memory_model import OFFLOAD_HOMES, grad_crosses_once
from zerogpt.zero.chunk import to_local
from zerogpt.zero.chunk_plan import ChunkPlan, plan_chunks

__all__ = ["EnginePlan", "plan_engine", "model_computes_loss"]

# torch optimizers with a fused kernel that takes the step's non-finite flag on the device (found_inf)
FUSED_KINDS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)


@dataclass(frozen=True)
class EnginePlan:
    """Every decision of the build, made before anything is allocated."""

    config: EngineConfig
    stage: int
    """zero.stage."""
    host: HostConfig
    """The host.* settings after their environment overrides."""
    compute_dtype: torch.dtype
    """Parameters and activations (precision); masters are fp32."""
    param_home: str
    """Where stage-3 parameter shards rest: "device" or "host" (zero.offload_param)."""
    optim_home: str
    """Where masters and optimizer state live: "device", "host" or "disk" (zero.offload_optimizer)."""
    chunks: tuple[ChunkPlan, ...]
    disk_bytes: int
    """Optimizer state this rank writes to zero.offload_optimizer.path (0 unless optim_home is "disk")."""
    no_decay: frozenset[str]
    """Parameters that take no weight decay whatever their group says (a dict optimizer's biases and norms)."""
    resident_chunks: frozenset[int] = frozenset()
    """With param offload: the chunks whose shards stay on the device anyway (zero.offload_param.device_budget)."""
    keeps_full_params: bool = True
    """Stages 0-2: every rank keeps the whole chunk in the compute dtype (stage 3 gathers it at each use)."""
    chunk_homes: tuple[str, ...] = ()
    """Where each chunk's param shard rests between uses, by chunk index: "device" or "host"."""
    grad_home: str = "device"
    """Where each chunk's reduced gradient shard is handed to its master: the optimizer's home, the host for disk."""
    master_is_param_shard: bool = False
    """fp32 with the param shards resting where the optimizer lives: the param shard is the master (no fp32 copy)."""
    state_dtype: torch.dtype = torch.float32
    """Adam's moments (zero.offload_optimizer.state_dtype)."""
    scales_loss: bool = False
    """fp16: the dynamic loss scaler is on (the zero.loss_scale section)."""
    pins_host_state: bool = False
    """Masters and optimizer state in host RAM are pinned (a GPU run with zero.offload_optimizer.pin_memory)."""
    pins_param_shards: bool = False
    """Param shards resting on the host are pinned (a GPU run with zero.offload_param.pin_memory)."""
    forward_waits_for_step: bool = False
    """Stages 0-2 with host masters: each module's pre-forward hook waits for its chunks' step (the host step may
    run behind the next forward)."""
    fused_device_step: bool = False
    """A GPU run's torch Adam/AdamW/SGD/Adagrad on the device: groups that leave the implementation to torch step
    fused (the kernel takes found_inf on the device: skipping a step costs no host sync)."""
    keep_freed_memory: bool = False
    """Compute on the host with host.keep_freed_memory: glibc keeps freed memory once the build is done."""
    shm_collectives: bool = False
    """Ranks sharing host memory over gloo with host.shm_collectives: collectives go through shared memory."""
    model_computes_loss: bool = False
    """The model computes its loss from the labels itself (model_zoo's `chunked_loss`)."""
    accumulate_on_device: bool = False
    """Offloaded gradients summed over the micro-steps in an fp32 shard on the device, which crosses to the host
    once per step (stages 2-3 with optimizer offload, no param offload or every trainable chunk kept on the device
    by its device_budget, accumulation > 1, and room on the device)."""
    grad_accum_bytes: int = 0
    """The device memory that accumulation needs (fp32 gradient shards), whether or not it was granted."""
    # What a GPU computing changes (False on a CPU run, where host and device are one memory and share the cores):
    hand_over_at_launch: bool = False
    """Offloaded gradients: each chunk's reduced shard is handed over right after its reduction is launched, its
    copy to the host on a copy stream under the rest of backward (zero/grad_path.py)."""
    host_step_overlaps: bool = False
    """Host masters stepped by CPUAdam run their step behind the next forward (zero/host_step.py)."""
    stages_compute_copies: bool = False
    """Host masters' compute copies bound for param shards on the device go through pinned staging buffers."""
    host_step_speculates: bool = False
    """Host masters step as each chunk's whole gradient leaves for the host, into a spare master and moments, kept
    where the norm shows no clip and no non-finite gradient (zero/host_step.py): the host step under backward.
    Where a step's gradient crosses to the host once (summed on the device, or one micro-step's) and host RAM has
    room for the spare set (checked at build: the spare set is a speed-up the preflight does not count)."""

    def describe(self) -> str:
        """Every decision of the plan, one `name: value` line each (the chunk layout as counts and sizes)."""
        zero = self.config.zero
        lines = [f"precision: {self.config.precision}",
                 f"gradient_accumulation: {self.config.gradient_accumulation}",
                 f"clip_grad_norm: {self.config.clip_grad_norm}", f"compile: {self.config.compile}",
                 f"shard_strategy: {zero.shard_strategy!r}", f"prefetch: {zero.prefetch}",
                 f"device_budget: {zero.offload_param.device_budget}",
                 f"offload_optimizer.path: {zero.offload_optimizer.path}"]
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("config", "no_decay"):
                continue
            if f.name == "chunks":
                numels = [p.shard_numel for p in value]
                value = (f"{len(value)} chunks, {sum(numels):,} elements per rank, the largest shard "
                         f"{max(numels, default=0):,}")
            elif f.name == "chunk_homes":
                value = ", ".join(f"{i}:{home}" for i, home in enumerate(value))
            elif f.name == "resident_chunks":
                value = ", ".join(map(str, sorted(value))) or "none"
            lines.append(f"{f.name}: {value}")
        lines.append(f"no_decay: {len(self.no_decay)} parameters")
        return "\n".join(lines)


def plan_engine(config: EngineConfig, params: list[tuple[str, nn.Parameter, int]], ctx: DistContext,
                no_decay: frozenset[str] = frozenset(), host: HostConfig | None = None,
                device_free_bytes: int | None = None, *, optimizer_type: type | None = None,
                computes_loss: bool = False) -> EnginePlan:
    """The frozen plan for these (name, param, group) at this rank's place; pure (no allocation, no collective).

    Args:
        host: the host.* settings already resolved (default: the config's, with the environment's overrides).
        device_free_bytes: the device's free memory at build (None: a CPU-only run, where host and device are
            one memory); it decides whether gradients can accumulate on the device and what device_budget="auto" is.
        optimizer_type: the user's optimizer class (whether a GPU run may step it fused).
        computes_loss: the model computes its loss from the labels (`model_computes_loss(module)`).
    """
    zero = config.zero
    dtype = compute_dtype(config.precision)
    num_shards = 1 if zero.stage == 0 else ctx.dp_size
    # the local shapes: with tensor parallelism a chunk holds this rank's shard of a DTensor parameter
    shapes = [(n, tuple(to_local(p).shape), g) for n, p, g in params]
    element_size = torch.empty(0, dtype=dtype).element_size()
    chunks = plan_chunks(shapes, zero.shard_strategy, num_shards, element_size)
    trainable_shard = sum(p.shard_numel for p in chunks if p.trainable)  # elements this rank steps
    optim_home = OFFLOAD_HOMES[zero.offload_optimizer.device]
    disk_bytes = trainable_shard * 4 * 3 if optim_home == "disk" else 0  # fp32 master, exp_avg, exp_avg_sq
    host = host or config.host.with_env_overrides()
    param_home = OFFLOAD_HOMES[zero.offload_param.device]
    resident: frozenset[int] = frozenset()
    if param_home == "host":
        budget = zero.offload_param.device_budget
        if budget == "auto":  # half the free memory: the rest is for gathered chunks and activations
            budget = None if device_free_bytes is None else device_free_bytes // 2
        resident = _resident_chunks(chunks, element_size, budget)
    # stages 0-2 keep the whole chunk on the device (offload_param needs stage 3)
    homes = tuple("device" if zero.stage < 3 or p.index in resident else param_home for p in chunks)
    # One fp32 gradient shard per trainable chunk on the device, instead of a copy to the host every micro-step
    # (stages 0-1 reduce once per step already; with param offload the device memory is what is short, unless
    # device_budget kept every trainable chunk on the device).
    grad_accum_bytes = trainable_shard * 4
    params_on_device = param_home == "device" or all(p.index in resident for p in chunks if p.trainable)
    accumulate = (zero.stage >= 2 and optim_home != "device" and params_on_device
                  and config.gradient_accumulation > 1)
    resident_bytes = sum(p.shard_numel for p in chunks if p.index in resident) * element_size
    fits = device_free_bytes is None or grad_accum_bytes + resident_bytes <= device_free_bytes
    gpu = ctx.device.type == "cuda"
    # fp32 with the param shards resting where the optimizer lives (both on the device, or both on the host:
    # stage 3 with param and optimizer offload): no second fp32 copy. Not when they rest apart (a host master
    # would get a device grad, or the reverse), nor on disk.
    master_is_param_shard = config.precision == "fp32" and optim_home != "disk" and all(
        homes[p.index] == optim_home for p in chunks if p.trainable)
    return EnginePlan(
        config, zero.stage, host, dtype, param_home, optim_home, tuple(chunks), disk_bytes, no_decay, resident,
        keeps_full_params=zero.stage < 3, chunk_homes=homes, grad_home="host" if optim_home == "disk" else optim_home,
        master_is_param_shard=master_is_param_shard,
        state_dtype=TORCH_DTYPES[zero.offload_optimizer.state_dtype], scales_loss=config.precision == "fp16",
        pins_host_state=gpu and zero.offload_optimizer.pin_memory,
        pins_param_shards=gpu and zero.offload_param.pin_memory,
        forward_waits_for_step=zero.stage < 3 and optim_home != "device",
        fused_device_step=gpu and optim_home == "device" and optimizer_type in FUSED_KINDS,
        keep_freed_memory=ctx.device.type == "cpu" and host.keep_freed_memory,
        shm_collectives=host.shm_collectives and _shares_host_memory(ctx), model_computes_loss=computes_loss,
        accumulate_on_device=accumulate and fits, grad_accum_bytes=grad_accum_bytes if accumulate else 0,
        hand_over_at_launch=gpu and optim_home != "device", host_step_overlaps=gpu, stages_compute_copies=gpu,
        host_step_speculates=gpu and optim_home == "host" and config.precision != "fp16"
        and (grad_crosses_once(zero.stage, config.gradient_accumulation) or (accumulate and fits)))


def _resident_chunks(chunks: list[ChunkPlan], element_size: int, budget: int | None) -> frozenset[int]:
    """The chunks, in order, whose param shards fit `budget` bytes of device memory (None: all of them)."""
    out, used = [], 0
    for plan in chunks:
        size = plan.shard_numel * element_size
        if budget is None or used + size <= budget:
            out.append(plan.index)
            used += size
    return frozenset(out)


def _shares_host_memory(ctx: DistContext) -> bool:
    """Whether the shared-memory transport could carry this run's collectives (gloo on CPU tensors)."""
    if not dist.is_initialized() or ctx.dp_size < 2 or ctx.device.type != "cpu":
        return False
    backend = str(dist.get_backend(ctx.dp_group))
    return backend == "gloo" or "cpu:gloo" in backend


def model_computes_loss(module: nn.Module) -> bool:
    """Whether the model computes its loss from the labels itself (`module(inputs, labels=labels).loss`): model_zoo's
    GPTConfig and LlamaConfig declare it as `chunked_loss` (the (B, T, vocab) logits never exist). Read here once, at
    build: the one place that knows this part of the model's interface (Engine.model_computes_loss carries it)."""
    config: Any = getattr(module, "config", None)
    return bool(getattr(config, "chunked_loss", False))
