"""The Engine: forward, backward, step and zero_grad over a ZeRO-sharded model.

It owns the training-step protocol (gradient accumulation, loss scaling, when to reduce) and the
accounting. The byte movement lives in `zero/` (chunks, hooks, sharded optimizer); checkpoint
files in `checkpoint.py`. Built by `zerogpt.initialize()`, never directly.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zerogpt.config import EngineConfig
from zerogpt.zero.chunk import Chunk
from zerogpt.zero.comm import all_gather_flat
from zerogpt.zero.offload import HOMES, Placement
from zerogpt.zero.sharded_model import ZeroHooks
from zerogpt.zero.sharded_optim import ShardedOptimizer

CATEGORIES = ("params", "grads", "master", "optimizer")


class Engine:
    """A model trained with ZeRO. Call it like the model; then backward(loss), step(), zero_grad()."""

    def __init__(self, module: nn.Module, sharded_optim: ShardedOptimizer, hooks: ZeroHooks, chunks: list[Chunk],
                 placement: Placement, config: EngineConfig, ctx: Any, logger: Any, criterion: Any = None,
                 run_config: Any = None) -> None:
        self.module = module
        self.sharded_optim = sharded_optim
        self.optimizer = sharded_optim.optimizer
        self.hooks = hooks
        self.chunks = chunks
        self.placement = placement
        self.config = config
        self.ctx = ctx
        self.logger = logger
        self.criterion = criterion
        self.run_config = run_config  # the whole Config when built from one: checkpoints record it as config.py
        self.gradient_accumulation = config.gradient_accumulation
        self.stage = config.zero.stage
        self.micro_step = 0  # backward() calls since the last optimizer step
        self.global_step = 0  # optimizer steps taken (skipped fp16 steps included)
        self._pending_backward = False

    # -- forward / backward / step ------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    forward = __call__

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        return self.train(False)

    @property
    def is_accumulation_boundary(self) -> bool:
        """True when the next backward() completes an optimizer step's worth of micro-batches."""
        return (self.micro_step + 1) % self.gradient_accumulation == 0

    @property
    def loss_scale(self) -> float:
        return self.sharded_optim.loss_scaler.scale

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate `loss` (a scalar), scaled for fp16 and averaged over accumulation steps.

        Stage 0/1 reduce gradients only on the micro-step that completes the accumulation (one
        collective per optimizer step); stages 2/3 reduce every micro-step into the fp32 shard.
        """
        if loss.dim() != 0:
            raise ValueError(f"engine.backward expects a scalar loss, got shape {tuple(loss.shape)}; "
                             f"reduce it first (e.g. loss.mean())")
        reduce = self.stage >= 2 or self.is_accumulation_boundary
        self.hooks.begin_backward(reduce, self.sharded_optim.receive, eagerly=self.sharded_optim.receive_eagerly)
        try:
            scaled = loss.float() * (self.loss_scale / self.gradient_accumulation)
            scaled.backward()
        finally:
            self.hooks.end_backward()
        self.hooks.end_backward_pass_order()
        self.micro_step += 1
        self._pending_backward = True

    def step(self) -> dict:
        """Optimizer step at the accumulation boundary; {} on other micro-steps.

        Returns dict(grad_norm, skipped, loss_scale, lr); a skipped (fp16 overflow) step is logged
        with the new scale.
        """
        if not self._pending_backward:
            raise RuntimeError("engine.step() called without engine.backward(loss) since the last step; "
                               "call engine.backward(loss) first (loss.backward() bypasses the engine's "
                               "gradient reduction)")
        if self.micro_step % self.gradient_accumulation != 0:
            return {}
        stats = self.sharded_optim.step()
        self.global_step += 1
        self.micro_step = 0
        self._pending_backward = False
        if stats["skipped"]:
            self.logger.warning(f"step {self.global_step}: fp16 gradient overflow, step skipped; "
                                f"loss scale now {stats['loss_scale']:g}")
        return stats

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients at the accumulation boundary; a no-op mid-accumulation.

        This keeps the canonical loop (forward, backward, step, zero_grad every micro-batch)
        correct for any GRADIENT_ACCUMULATION, as DeepSpeed's engine does.
        """
        if self.micro_step % self.gradient_accumulation != 0:
            return
        for p in self.module.parameters():
            p.grad = None
        for chunk in self.chunks:
            chunk.reset_grads()
        self.sharded_optim.zero_grad()

    # -- accounting ---------------------------------------------------------------------------

    def memory_stats(self) -> dict[str, dict[str, int]]:
        """Bytes of model state on this rank, by category and home, measured from the live tensors.

        Returns {"params"|"grads"|"master"|"optimizer": {"device"|"host"|"disk": bytes}}. A tensor
        that serves two roles (fp32 master aliasing the param shard) is counted once, as params.
        """
        stats = {c: {h: 0 for h in HOMES} for c in CATEGORIES}
        seen: set[int] = set()

        def add(category: str, tensor: torch.Tensor | None) -> None:
            if tensor is None or tensor.numel() == 0:
                return
            ptr = tensor.untyped_storage().data_ptr()
            if ptr in seen:
                return
            seen.add(ptr)
            stats[category][self.placement.home_of(tensor)] += tensor.untyped_storage().nbytes()

        for chunk in self.chunks:
            add("params", chunk.full_buffer)  # in-flight prefetches included
            add("params", chunk.shard)
            add("grads", chunk.grad_full)
        for index, grad in self.sharded_optim.grad_shards.items():
            add("grads", grad)
        for index, entry in self.sharded_optim.state_tensors_by_chunk().items():
            add("master", entry.pop("master"))
            for tensor in entry.values():
                add("optimizer", tensor)
        return stats

    def num_params(self) -> int:
        return sum(chunk.plan.numel for chunk in self.chunks)

    def describe(self) -> str:
        """One startup line: stage, chunks, and this rank's model-state bytes."""
        stats = self.memory_stats()
        total = {h: sum(stats[c][h] for c in CATEGORIES) for h in HOMES}
        return (f"zerogpt engine: stage {self.stage}, precision {self.config.precision}, "
                f"{len(self.chunks)} chunks, {self.num_params() / 1e6:.2f}M params, world {self.ctx.world_size}, "
                f"accumulation {self.gradient_accumulation}; model state on this rank: "
                + ", ".join(f"{h} {total[h] / 2**20:.1f} MiB" for h in HOMES if total[h]))

    # -- consolidated state -------------------------------------------------------------------

    def full_chunk_values(self, chunk: Chunk, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole chunk (numel, unpadded) on every rank: masters if trainable, else params.

        Every rank must call this (it all-gathers when the chunk is sharded).
        """
        master = self.sharded_optim.masters.get(chunk.plan.index)
        shard = master if master is not None else chunk.shard
        shard = shard.to(self.ctx.device, torch.float32)
        if chunk.plan.num_shards == 1:
            full = shard
        else:
            full = torch.empty(chunk.plan.padded_numel, dtype=torch.float32, device=self.ctx.device)
            all_gather_flat(full, shard.contiguous(), group=self.ctx.group)
        return full[: chunk.plan.numel].to(dtype)

    def state_dict_full(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """Consolidated parameters (from the fp32 masters) and buffers, on rank 0 (CPU); {} elsewhere.

        Streams chunk by chunk, so peak extra memory is one chunk, not a second model.
        """
        out: dict[str, torch.Tensor] = {}
        for chunk in self.chunks:
            full = self.full_chunk_values(chunk, dtype)
            if self.ctx.rank == 0:
                for slot in chunk.plan.slots:
                    out[slot.name] = full[slot.offset : slot.end].view(slot.shape).cpu().clone()
        if self.ctx.rank == 0:
            for name, buf in self.module.named_buffers():
                out[name] = buf.detach().cpu().clone()
        return out

    # -- checkpoints --------------------------------------------------------------------------

    def save_checkpoint(self, directory: str, extra_state: dict | None = None) -> str:
        """Write a world-size-independent checkpoint (all ranks call). Returns the directory."""
        from zerogpt.checkpoint import save_engine

        return save_engine(self, directory, extra_state)

    def load_checkpoint(self, directory: str) -> dict:
        """Load a checkpoint written at any world size/stage (all ranks call). Returns extra_state."""
        from zerogpt.checkpoint import load_engine

        return load_engine(self, directory)

    def close(self) -> None:
        """Remove hooks and any disk-offload files."""
        self.hooks.remove()
        self.placement.close()
