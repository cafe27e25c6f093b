"""The optimizer side of ZeRO: fp32 master shards, gradient shards, and the step on them.

The user's torch optimizer is kept (class, hyperparameters, param groups, LR schedulers bound to
it) but its param groups are rewired to this rank's fp32 master shards, one per chunk, so its state
exists only for the shard this rank owns. A step is: one all-reduce of the local sum of squared
gradients (it carries both the global grad norm and the fp16 overflow flag, since inf/nan survive a
sum) -> unscale and clip in one multiply -> optimizer step chunk by chunk, each chunk cast into its
param shard and all-gathered (stages 0-2) while the next chunk steps.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from zerogpt.amp import DynamicLossScaler
from zerogpt.zero.chunk import Chunk
from zerogpt.zero.offload import Placement, start_d2h

ADAM_STATE_KEYS = ("exp_avg", "exp_avg_sq")


def _is_adam_family(optimizer: torch.optim.Optimizer) -> bool:
    names = {c.__name__ for c in type(optimizer).__mro__}
    return bool(names & {"Adam", "AdamW", "CPUAdam", "HybridAdam"})


class ShardedOptimizer:
    """Owns masters, grad shards and the step; drives chunk write-back and all-gather."""

    def __init__(self, optimizer: torch.optim.Optimizer, chunks: list[Chunk], *, placement: Placement,
                 optim_home: str, precision: str, stage: int, group: dist.ProcessGroup | None,
                 loss_scaler: DynamicLossScaler, clip_grad_norm: float | None) -> None:
        self.optimizer = optimizer
        self.chunks = chunks
        self.placement = placement
        self.optim_home = optim_home
        self.grad_home = "host" if optim_home == "disk" else optim_home
        self.stage = stage
        self.group = group
        self.loss_scaler = loss_scaler
        self.clip_grad_norm = clip_grad_norm or None
        self.masters: dict[int, torch.Tensor] = {}
        self.grad_shards: dict[int, torch.Tensor] = {}
        # Reduced grad shards still being copied device->host: (fp32 host shard, staging copy, event).
        self._pending_d2h: list[tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None]] = []
        # Offloaded grads on CUDA: each chunk's reduced shard is copied to the host on a side stream as
        # soon as its reduction is launched, so the copies run under the rest of backward.
        offload_grads = placement.device.type == "cuda" and self.grad_home != "device"
        self._copy_stream = torch.cuda.Stream(placement.device) if offload_grads else None
        self.receive_eagerly = offload_grads
        # fp32 with the optimizer on the device: the param shard is the master. Not when param shards
        # rest on the host (stage-3 param offload): the master must live with the optimizer and grad
        # shards on the device (an aliased host master would get a device grad).
        aliased = precision == "fp32" and optim_home == "device" and all(
            placement.home_of(c.shard) == "device" for c in chunks if c.plan.trainable)
        for chunk in chunks:
            if not chunk.plan.trainable:
                continue
            if aliased:  # fp32 on the device: the param shard is the master, no second copy
                master = chunk.shard
                placement.record(master, "device" if chunk.shard.device == placement.device else "host")
            else:
                master = placement.empty(chunk.plan.shard_numel, torch.float32, optim_home, f"master{chunk.plan.index}")
                master.copy_(chunk.shard)
            self.masters[chunk.plan.index] = master
        self.aliased = aliased
        self._rewire_param_groups()
        if optim_home != "device":
            self._preallocate_state()

    # -- setup --------------------------------------------------------------------------------

    def _rewire_param_groups(self) -> None:
        by_group: dict[int, list[torch.Tensor]] = {}
        for chunk in self.chunks:
            if chunk.plan.trainable:
                by_group.setdefault(chunk.plan.group_index, []).append(self.masters[chunk.plan.index])
        for g, group in enumerate(self.optimizer.param_groups):
            group["params"] = by_group.get(g, [])
        self.optimizer.state.clear()

    def _preallocate_state(self) -> None:
        """Allocate Adam state where the optimizer lives (pinned host RAM or memory-mapped files).

        Torch and CPUAdam use state tensors they find in place, so allocating them here puts them at
        their home from the start (and in the accounting before the first step). Other optimizers
        create their state lazily on the host; `_optimizer_step` records it there.
        """
        adam = _is_adam_family(self.optimizer)
        if not adam and self.optim_home == "disk":
            raise ValueError(f"disk offload keeps Adam state (exp_avg, exp_avg_sq) in memory-mapped files; "
                             f"{type(self.optimizer).__name__} is not an Adam-family optimizer. Use "
                             f"zero.offload_optimizer=dict(device='cpu') or an Adam/AdamW/CPUAdam optimizer")
        if not adam:
            return
        for chunk in self.chunks:
            if not chunk.plan.trainable:
                continue
            index, master = chunk.plan.index, self.masters[chunk.plan.index]
            state = self.optimizer.state[master]
            state["step"] = torch.tensor(0.0)
            keys = ADAM_STATE_KEYS
            if self.optimizer.param_groups[chunk.plan.group_index].get("amsgrad"):
                keys += ("max_exp_avg_sq",)  # torch reads it from pre-filled state, never creates it
            for key in keys:
                state[key] = self.placement.empty(master.numel(), torch.float32, self.optim_home, f"{key}{index}")

    # -- gradients ----------------------------------------------------------------------------

    def receive(self, chunk: Chunk) -> None:
        """Finish a chunk's launched reduction and accumulate the result into its fp32 grad shard.

        On CUDA with offloaded grads this runs on the copy stream: waiting for the collective makes that
        stream (not the host) wait, and the device->host copy is queued behind it.
        """
        if self._copy_stream is None:
            self.accumulate_grad(chunk, chunk.finish_reduce())
            return
        self._copy_stream.wait_stream(torch.cuda.current_stream())  # grads written by backward (world 1)
        with torch.cuda.stream(self._copy_stream):
            reduced = chunk.finish_reduce()
            reduced.record_stream(self._copy_stream)  # not reused by backward until the copy has read it
            self.accumulate_grad(chunk, reduced)

    def accumulate_grad(self, chunk: Chunk, reduced: torch.Tensor) -> None:
        """Add a chunk's reduced gradient shard into its fp32 grad shard (where the optimizer lives)."""
        index = chunk.plan.index
        if index not in self.grad_shards:
            self.grad_shards[index] = self.placement.empty(chunk.plan.shard_numel, torch.float32,
                                                           self.grad_home, f"grad{index}")
        shard = self.grad_shards[index]
        if reduced.device == shard.device:
            shard.add_(reduced)
            return
        # Offload: start this chunk's device->host copy, then add the copies that have landed into
        # their host shards, never blocking the host on one still in flight (backward keeps queueing
        # work meanwhile). A plain non-blocking .to('cpu') followed by add_ would read the host bytes
        # before the copy lands.
        self._pending_d2h.append((shard, *start_d2h(reduced)))
        self._finish_d2h(landed_only=True)

    def _finish_d2h(self, landed_only: bool = False) -> None:
        """Add pending grad copies into their shards, in order: all of them (waiting), or those landed."""
        while self._pending_d2h:
            shard, staging, event = self._pending_d2h[0]
            if event is not None:
                if landed_only and not event.query():
                    return
                event.synchronize()
            shard.add_(staging)
            self._pending_d2h.pop(0)

    def zero_grad(self) -> None:
        self._pending_d2h.clear()
        self.grad_shards.clear()

    # -- step ---------------------------------------------------------------------------------

    def _global_sumsq(self) -> float:
        local = torch.zeros((), dtype=torch.float32, device=self.placement.device)
        for g in self.grad_shards.values():
            local += torch.dot(g, g).to(local.device)  # fp32 shard: one pass, no squared temporary
        world = dist.get_world_size(self.group) if dist.is_initialized() else 1
        if world > 1 and self.stage > 0:  # stage 0: every rank already holds the full, reduced grads
            dist.all_reduce(local, group=self.group)
        return local.item()

    def step(self) -> dict:
        """One optimizer step on the shards. Returns dict(grad_norm, skipped, loss_scale, lr)."""
        scale = self.loss_scaler.scale
        self._finish_d2h()
        sumsq = self._global_sumsq()
        overflow = not math.isfinite(sumsq)
        lr = self.optimizer.param_groups[0]["lr"] if self.optimizer.param_groups else 0.0
        if overflow:
            self.loss_scaler.update(True)
            self.zero_grad()
            return {"grad_norm": float("nan"), "skipped": True, "loss_scale": self.loss_scaler.scale, "lr": lr}
        grad_norm = math.sqrt(sumsq) / scale
        factor = 1.0 / scale
        if self.clip_grad_norm is not None:
            clip_coef = self.clip_grad_norm / (grad_norm + 1e-6)
            factor *= min(clip_coef, 1.0)
        for g in self.grad_shards.values():
            if factor != 1.0:
                g.mul_(factor)
        self._optimizer_step()
        self.loss_scaler.update(False)
        self.zero_grad()
        return {"grad_norm": grad_norm, "skipped": False, "loss_scale": self.loss_scaler.scale, "lr": lr}

    def _optimizer_step(self) -> None:
        """Step chunk by chunk; each chunk's all-gather (stages 0-2) runs behind the next chunk's step.

        Chunk by chunk also bounds the host RAM a disk-offloaded step touches and lets the next chunk's
        state be read ahead. Torch optimizers skip parameters whose grad is None, so each call steps
        only the chunk whose grad is set (a user's optimizer step hooks run once per chunk).
        """
        order = list(self.masters)
        gathers = []
        for i, index in enumerate(order):
            if i + 1 < len(order):
                self._prefetch_state(order[i + 1])
            master = self.masters[index]
            # A chunk with no gradient this step still steps (weight decay, momentum), as in DeepSpeed.
            master.grad = self.grad_shards[index] if index in self.grad_shards else torch.zeros_like(master)
            self.optimizer.step()
            master.grad = None
            # Copy the updated master into its param shard now, while its pages are in RAM (disk)
            # and so the host->device copy overlaps the next chunk's CPU step.
            self._write_back(index)
            if self.chunks[index].persistent_full:
                gathers.append(self.chunks[index].all_gather_full(async_op=True))
            self._record_state(index)
            self._evict_state(index)
        for work in gathers:
            if work is not None:
                work.wait()

    def _record_state(self, index: int) -> None:
        """Record lazily created state (non-Adam optimizers) at the optimizer's home, for the accounting."""
        if self.optim_home == "host":
            for t in self._state_tensors(index)[1:]:
                self.placement.record(t, "host")

    def _state_tensors(self, index: int) -> list[torch.Tensor]:
        master = self.masters[index]
        state = self.optimizer.state.get(master, {})
        return [master] + [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]

    def _prefetch_state(self, index: int) -> None:
        for t in self._state_tensors(index):
            self.placement.prefetch(t)

    def _evict_state(self, index: int) -> None:
        for t in self._state_tensors(index):
            self.placement.evict(t)

    def _write_back(self, index: int) -> None:
        """Cast an updated master into its param shard (compute dtype, the shard's home)."""
        if not self.aliased:
            self.chunks[index].shard.copy_(self.masters[index], non_blocking=True)

    # -- state ----------------------------------------------------------------------------------

    def state_tensors_by_chunk(self) -> dict[int, dict[str, torch.Tensor]]:
        """This rank's optimizer-state shards per chunk: {"master", "exp_avg", ...} (for checkpoints)."""
        out: dict[int, dict[str, torch.Tensor]] = {}
        for index, master in self.masters.items():
            entry = {"master": master}
            for key, value in self.optimizer.state.get(master, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    entry[key] = value
            out[index] = entry
        return out
