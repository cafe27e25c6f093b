"""The step over the trainable chunks' `ChunkState`s (zero/chunk_state.py), and their state for checkpoints.

A step is: one all-reduce of the local sum of squared gradients (it carries both the global grad norm and
the fp16 overflow flag, since inf/nan survive a sum) -> unscale and clip by one coefficient computed on
the device -> step chunk by chunk, each chunk cast into its param shard and all-gathered (stages 0-2)
while the next chunk steps. A non-finite norm skips the step on the device (bf16/fp32: `found_inf` goes into
each chunk's step). Nothing here reads a tensor back to the host, except fp16's overflow check. Where the
chunks' host steps run (in place, or behind the next forward) and how their compute copies reach the device is
zero/host_step.py's; how the gradients arrive, zero/grad_path.py's.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from zerogpt.amp import DynamicLossScaler
from zerogpt.optim.host_adam import seed_of
from zerogpt.zero.chunk import Chunk
from zerogpt.zero.chunk_state import (ChunkState, chunk_optimizer, hyperparameters, is_adam_family, is_cpu_adam,
                                      slot_ranges, takes_found_inf)
from zerogpt.zero.host_step import HostStep
from zerogpt.zero.offload import Placement, Traffic

if TYPE_CHECKING:  # the wait hooks are given, and only removed at close: no import of the hooks
    from zerogpt.zero.step_wait_hooks import StepWaitHooks

ADAM_STATE_KEYS = ("exp_avg", "exp_avg_sq")
CLIP_EPS = 1e-6


class ShardedOptimizer:
    """The chunks' `ChunkState`s, the step over them, and their state for checkpoints.

    Complete when built. `overlap_next_forward`: the host step may run behind the next forward (zero/host_step.py;
    the build asks for it where the compute is a GPU); `stage_compute_copies`: host masters' compute copies bound
    for param shards on the device go through pinned staging (a GPU run); `step_waits`: stages 0-2 with host
    masters, the modules' hooks that make the next forward wait for their chunks' step.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, chunks: list[Chunk], *, placement: Placement,
                 optim_home: str, grad_home: str, master_is_param_shard: bool, precision: str, stage: int,
                 group: dist.ProcessGroup | None,
                 loss_scaler: DynamicLossScaler, clip_grad_norm: float | None,
                 no_decay: set[str] | None = None, norm_duplicates: set[str] | None = None,
                 model_parallel_group: dist.ProcessGroup | None = None, traffic: Traffic | None = None,
                 state_dtype: torch.dtype = torch.float32, overlap_next_forward: bool = False,
                 stage_compute_copies: bool = False, step_waits: StepWaitHooks | None = None,
                 speculate: bool = False, host_step_threads: int | None = None) -> None:
        self.optimizer = optimizer  # holds the hyperparameters; LR schedulers bind to it
        self.chunks = chunks
        self.placement = placement
        self.traffic = traffic or Traffic()  # the write-backs that cross between host and device
        self.optim_home = optim_home
        self.grad_home = grad_home  # the plan's (zerogpt/planner/engine_plan.py), as the next one
        self.stage = stage
        self.group = group
        # The ranks with this rank's data-parallel coordinate (tensor x pipeline): they hold different parts of
        # the model, so the squared-norm sums of their parts add up to the model's.
        self.model_parallel_group = model_parallel_group
        self.norm_duplicates = norm_duplicates or set()  # counted by another model-parallel rank
        self.loss_scaler = loss_scaler
        self.clip_grad_norm = clip_grad_norm or None
        # 1.0 when the last step was skipped (a non-finite gradient; fp16: an overflow), else 0.0: a 0-dim device
        # tensor the trainer counts without reading it
        self.found_inf = torch.zeros((), device=placement.device)
        self.precision = precision
        # fp32 with the param shards resting where the optimizer lives: the param shard is the master
        self.master_is_param_shard = master_is_param_shard
        # Adam's moments at their home: fp32, or bf16 (host/disk homes, stepped by CPUAdam's fused op)
        self.state_dtype = state_dtype
        if state_dtype != torch.float32 and (optim_home == "device" or not is_cpu_adam(optimizer)):
            raise ValueError(f"zero.offload_optimizer.state_dtype='bf16' keeps Adam's moments in bf16 on the host, "
                             f"stepped by zerogpt.optim.CPUAdam/HybridAdam's fused op; this run has "
                             f"{type(optimizer).__name__} with the optimizer state on the "
                             f"{'device' if optim_home == 'device' else optim_home}: use optimizer type HybridAdam "
                             f"and zero.offload_optimizer.device='cpu' or 'disk', or state_dtype='fp32'")
        if optim_home == "disk" and not is_adam_family(optimizer):
            raise ValueError(f"disk offload keeps Adam state (exp_avg, exp_avg_sq) in memory-mapped files; "
                             f"{type(optimizer).__name__} is not an Adam-family optimizer. Use "
                             f"zero.offload_optimizer=dict(device='cpu') or an Adam/AdamW/CPUAdam optimizer")
        self._in_place_step_s = 0.0  # the last plain step's chunk steps (see last_chunk_step_s)
        self.states: dict[int, ChunkState] = {}
        for chunk in chunks:
            if chunk.plan.trainable:
                self.states[chunk.plan.index] = self._chunk_state(chunk, no_decay or set())
        for group_ in optimizer.param_groups:
            group_["params"] = []  # the chunk optimizers own the masters; this one keeps hyperparameters
        optimizer.state.clear()
        # Host masters: the step may run behind the next forward; on a CPU run forward and host step would share
        # the same cores, so the build asks for it only where the compute is a GPU.
        # The step may also start as each gradient arrives, before the norm (speculate; not fp16, whose overflow
        # check would discard it every time the scale grows).
        self.host_step = HostStep(self.states, placement, stage=stage, behind_forward=overlap_next_forward,
                                  stage_copies=stage_compute_copies, step_waits=step_waits,
                                  speculate=speculate and not loss_scaler.enabled,
                                  param_groups=lambda: self.optimizer.param_groups, threads=host_step_threads)

    def _chunk_state(self, chunk: Chunk, no_decay: set[str]) -> ChunkState:
        plan = chunk.plan
        if self.master_is_param_shard:
            master = chunk.shard
        else:
            master = self.placement.empty(plan.shard_numel, torch.float32, self.optim_home, f"master{plan.index}")
            master.copy_(chunk.shard)
            self.placement.evict(master)  # a disk master's pages leave RAM until its chunk's step reads them
        group = self.optimizer.param_groups[plan.group_index]
        decay_ranges = slot_ranges(chunk, no_decay)
        rank = dist.get_rank(self.group) if dist.is_initialized() else 0
        optimizer = chunk_optimizer(self.optimizer, group, master, decay_ranges,
                                    rounding_seed=seed_of(plan.index, rank))
        state = ChunkState(chunk, master, optimizer,
                           plan.group_index, self.optim_home, self.grad_home, self.master_is_param_shard,
                           decay_ranges, slot_ranges(chunk, self.norm_duplicates))
        if is_adam_family(self.optimizer) and self.optim_home != "device":
            self._preallocate_adam_state(state, group)
        return state

    def _preallocate_adam_state(self, state: ChunkState, group: dict) -> None:
        """Allocate Adam state where the optimizer lives (pinned host RAM or memory-mapped files).

        Torch and CPUAdam use state tensors they find in place, so allocating them here puts them at
        their home from the start (and in the accounting before the first step).
        """
        slots = state.state
        slots["step"] = torch.tensor(0.0)
        keys = ADAM_STATE_KEYS + (("max_exp_avg_sq",) if group.get("amsgrad") else ())
        for key in keys:  # torch reads max_exp_avg_sq from pre-filled state, never creates it
            slots[key] = self.placement.empty(state.master.numel(), self.state_dtype, self.optim_home,
                                              f"{key}{state.index}")

    # -- gradients ----------------------------------------------------------------------------

    def zero_grad(self) -> None:
        self.host_step.abandon()  # a speculative step whose step() was not taken (fp16's skipped step, ...)
        for state in self.states.values():
            state.drop_grad()

    # -- step ---------------------------------------------------------------------------------

    def _global_sumsq(self) -> torch.Tensor:
        """The squared norm of every chunk's gradient, summed over the ranks: a 0-dim tensor on the device.

        Squared norms taken on the device add there; those of gradients summed on the host (param offload) add on
        the host and reach the device in one copy from pinned memory, queued without a wait: copying a pageable
        host scalar would block this thread until the device is idle.
        """
        device = self.placement.device
        local = torch.zeros((), dtype=torch.float32, device=device)
        on_host = torch.zeros((), dtype=torch.float32)
        for state in self.states.values():
            if state.grad is not None:
                sumsq = state.grad_sumsq if state.grad_sumsq is not None else state.sumsq(state.grad)
                if sumsq.device == local.device:
                    local += sumsq
                else:
                    on_host += sumsq
        if local.device.type != "cpu":
            pinned = on_host.pin_memory()
            local += pinned.to(device, non_blocking=True)
        else:
            local += on_host
        world = dist.get_world_size(self.group) if dist.is_initialized() else 1
        if world > 1 and self.stage > 0:  # stage 0: every rank already holds the full, reduced grads
            dist.all_reduce(local, group=self.group)
        if self.model_parallel_group is not None:
            dist.all_reduce(local, group=self.model_parallel_group)
        return local

    def step(self) -> tuple[torch.Tensor, bool]:
        """One optimizer step on the shards. Returns (grad norm as a 0-dim device tensor, skipped); nan if skipped.

        `skipped` is fp16's overflow verdict, the one read on the host (to back off the scale). bf16/fp32 skip
        a non-finite step on the device instead (`self.found_inf`, not read here). Clipping multiplies by
        min(1, max_norm / (norm + eps)) computed on the device: no branch on the norm's value.
        """
        self.host_step.finish()  # the previous step's (this backward's speculative steps are settled below)
        scale = self.loss_scaler.scale
        grad_norm = self._global_sumsq().sqrt_() / scale
        if self.loss_scaler.enabled and not torch.isfinite(grad_norm).item():
            self.loss_scaler.update(True)
            self.zero_grad()
            self.found_inf = torch.ones_like(grad_norm)
            return torch.full_like(grad_norm, float("nan")), True
        # bf16/fp32: a non-finite gradient (inf/nan survive the sum) skips the step on the device, chunk by chunk,
        # with no host sync: one bad batch reaches neither the weights nor the optimizer state.
        found_inf = None if self.loss_scaler.enabled else (~torch.isfinite(grad_norm)).float()
        self.found_inf = found_inf if found_inf is not None else torch.zeros_like(grad_norm)
        if found_inf is not None and not all(takes_found_inf(s.optimizer) for s in self.states.values()):
            found_inf = found_inf if found_inf.item() else None  # one read per step, GradScaler's way for these
        factor = None
        if self.clip_grad_norm is not None:
            factor = torch.clamp(self.clip_grad_norm / (grad_norm + CLIP_EPS), max=1.0) / scale
        elif scale != 1.0:
            factor = torch.tensor(1.0 / scale, device=grad_norm.device)
        if self.host_step.overlaps:
            self.host_step.launch(self.optimizer.param_groups, factor, found_inf, self.placement.device)
        else:
            self._step_chunks(factor, found_inf)
        for state in self.states.values():
            self._count_compute_copy(state)
        # The user's optimizer holds no tensors: this step moves nothing, but runs its step hooks once and
        # tells LR schedulers bound to it that a step happened.
        self.optimizer.step()
        self.loss_scaler.update(False)
        self.zero_grad()
        return grad_norm, False

    def _step_chunks(self, factor: torch.Tensor | None, found_inf: torch.Tensor | None = None) -> None:
        """Step chunk by chunk; each chunk's all-gather (stages 0-2) runs behind the next chunk's step.

        Chunk by chunk also bounds the host RAM a disk-offloaded step touches and lets the next chunk's
        state be read ahead. A chunk with no gradient this step still steps (weight decay, momentum), as
        in DeepSpeed.
        """
        order = list(self.states.values())
        gathers = []
        start = time.perf_counter()
        for i, state in enumerate(order):
            if i + 1 < len(order):
                for t in order[i + 1].tensors():
                    self.placement.prefetch(t)
            staged = self.host_step.staging_for(state)
            wrote = state.step(self.optimizer.param_groups[state.group_index], factor, found_inf, out=staged)
            # Copy the updated master into its param shard now, while its pages are in RAM (disk)
            # and so the host->device copy overlaps the next chunk's CPU step.
            if staged is not None and wrote:
                self.host_step.send(state.chunk.shard, staged)
            elif not wrote:
                state.write_back()
            if state.chunk.persistent_full:
                gathers.append(state.chunk.all_gather_full(async_op=True))
            for t in state.tensors():
                self.placement.evict(t)
        self._in_place_step_s = time.perf_counter() - start
        for work in gathers:
            if work is not None:
                work.wait()

    def _count_compute_copy(self, state: ChunkState) -> None:
        """The step's new master written into its param shard: traffic where the two rest on either side."""
        if not state.master_is_param_shard:
            self.traffic.copied(state.home, state.chunk.shard_home, state.chunk.shard)

    # -- where the host step runs (zero/host_step.py) -----------------------------------------------------

    @property
    def last_chunk_step_s(self) -> float:
        """Seconds the chunks' steps took in the last step that has finished (an overlapped step finishes behind
        the next forward, so right after step() this is the previous one's): the host step, where it is offloaded."""
        return self.host_step.last_step_s if self.host_step.overlaps else self._in_place_step_s

    def finish_step(self) -> None:
        """Wait for every chunk of an overlapped step; a no-op when none is pending. Anything that reads the
        masters, the state or every shard (the next step, backward, checkpoints) calls this first. Speculative
        steps no step() settled are dropped first (their param shards written again from the state)."""
        self.host_step.abandon()
        self.host_step.finish()

    def close(self) -> None:
        """Finish a pending step, stop the worker thread and take the stages 0-2 wait hooks off."""
        self.host_step.close()

    def held_tensors(self) -> list[tuple[str, torch.Tensor | None, str]]:
        """(category, tensor, home) of every tensor the states hold, for the engine's memory accounting: each
        chunk's gradient shard ("grads"), master ("master") and optimizer state ("optimizer"), in chunk order."""
        out: list[tuple[str, torch.Tensor | None, str]] = []
        for state in self.states.values():
            out.append(("grads", state.grad, state.grad_home))
            out.append(("master", state.master, state.home))
            out.extend(("optimizer", tensor, state.home) for tensor in state.state_tensors().values())
            out.extend(("optimizer", tensor, state.home) for tensor in self.host_step.spares.get(state.index, ()))
        return out

    def master(self, index: int) -> torch.Tensor | None:
        """Chunk `index`'s fp32 master shard; None for a frozen chunk."""
        state = self.states.get(index)
        return None if state is None else state.master

    # -- state (torch's Stateful protocol) -------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Hyperparameters, loss scaler and, per trainable chunk, this rank's shard tensors (not copies: read or
        save them before the next step, whose commit of a speculative step swaps the moments' storage with their
        spares'). Finishes an overlapped step first.

        {"class": the torch optimizer's dotted name, "param_groups": [hyperparameters], "loss_scaler": {...},
         "chunks": {index: {"master": shard, "exp_avg": shard, ..., "step": 0-dim}}}
        """
        self.finish_step()
        return {
            "class": f"{type(self.optimizer).__module__}.{type(self.optimizer).__qualname__}",
            "param_groups": [hyperparameters(g) for g in self.optimizer.param_groups],
            "loss_scaler": self.loss_scaler.state_dict(),
            "chunks": {index: {"master": s.master, **s.state} for index, s in self.states.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a `state_dict()`: shard tensors are copied into place (their home: pinned, memory-mapped)."""
        self.finish_step()
        groups = self.optimizer.param_groups
        if len(state["param_groups"]) != len(groups):
            raise ValueError(f"the state has {len(state['param_groups'])} optimizer param groups, the optimizer "
                             f"has {len(groups)}; build the optimizer as the run did")
        for group, hyper in zip(groups, state["param_groups"]):
            for key, value in hyper.items():
                group[key] = tuple(value) if isinstance(group.get(key), tuple) else value
        self.loss_scaler.load_state_dict(state["loss_scaler"])
        with torch.no_grad():
            for index, saved in state["chunks"].items():
                chunk_state = self.states[index]
                if saved["master"] is not chunk_state.master:
                    chunk_state.master.copy_(saved["master"])
                live = chunk_state.state
                group = groups[chunk_state.group_index]
                on_device = group.get("fused") or group.get("capturable")  # torch keeps their step on the device
                for key, value in saved.items():
                    if key == "master":
                        continue
                    if value.dim() == 0:
                        live[key] = torch.tensor(float(value), dtype=torch.float32,
                                                 device=chunk_state.master.device if on_device else "cpu")
                    elif key in live and isinstance(live[key], torch.Tensor) and live[key].shape == value.shape:
                        if live[key] is not value:
                            live[key].copy_(value)
                    else:
                        live[key] = self.placement.empty(value.numel(), self.state_dtype, self.optim_home,
                                                         f"{key}{index}")
                        live[key].copy_(value)
                chunk_state.write_back()
        self.zero_grad()
