"""The Engine: forward, backward, step and zero_grad over a ZeRO-sharded model.

It owns the training-step protocol (gradient accumulation, loss scaling, when to reduce, when to step) and the
accounting. The byte movement lives in `zero/` (chunks, hooks, the gradient's path, sharded optimizer); checkpoint
files in `checkpoint.py`. Built by `zerogpt.initialize()`, never directly, and complete when built: every field
is set in __init__ from what initialize resolved (the model's parallel layout included).
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Any, Callable, ContextManager, Iterator

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from zerogpt.config import EngineConfig
from zerogpt.context import DistContext
from zerogpt.memory_model import CATEGORIES, HOMES
from zerogpt.planner.engine_plan import EnginePlan
from zerogpt.parallel.layout import ParamLayout, as_layout
from zerogpt.parallel.parallel_model import ParallelModel
from zerogpt.zero.chunk import Chunk
from zerogpt.zero.comm import all_gather_flat
from zerogpt.zero.gather_hooks import Stage3GatherHooks
from zerogpt.zero.grad_hooks import GradReduceHooks
from zerogpt.zero.grad_path import GradPath
from zerogpt.zero.offload import Placement, Traffic
from zerogpt.zero.shard_map import ShardMap
from zerogpt.zero.sharded_optim import ShardedOptimizer


class Engine:
    """A model trained with ZeRO. Call it like the model; then backward(loss), step(), zero_grad()."""

    def __init__(self, module: nn.Module, sharded_optim: ShardedOptimizer, chunks: list[Chunk],
                 grad_hooks: GradReduceHooks, gather_hooks: Stage3GatherHooks | None, grad_path: GradPath,
                 placement: Placement, plan: EnginePlan, ctx: DistContext, *, criterion: Callable | None = None,
                 parallel: ParallelModel | None = None, transport: Any = None, run_config: Any = None,
                 keeps_freed_memory: bool = False, traffic: Traffic | None = None) -> None:
        parallel = parallel or ParallelModel(module)
        self.plan = plan
        """The EnginePlan this engine was built from (zerogpt/planner/engine_plan.py): every build decision, printable
        with `plan.describe()`; train_gpt.py writes it to the run directory as engine_plan.txt."""
        self.module = module
        self.sharded_optim = sharded_optim
        self._step_reads = _reads_around_the_step(module, sharded_optim) if sharded_optim.host_step.overlaps else []
        self.optimizer = sharded_optim.optimizer
        self.grad_hooks = grad_hooks
        self.gather_hooks = gather_hooks  # stage 3 only
        self.grad_path = grad_path
        """Reduced gradient shards on their way to the optimizer's chunk states (zero/grad_path.py)."""
        self.chunks = chunks
        self.placement = placement
        self.config: EngineConfig = plan.config
        self.ctx = ctx
        self.logger = ctx.logger
        self.criterion = criterion
        """loss(logits, labels) as this rank computes it (under tensor parallelism: the local loss)."""
        self.model_computes_loss = plan.model_computes_loss
        """The model computes its loss from the labels itself (`module(inputs, labels=labels).loss`; model_zoo's
        chunked_loss, where the (B, T, vocab) logits never exist): the Trainer calls it so, not `criterion`."""
        self.run_config = run_config
        """The whole Config when built from one: checkpoints record it as config.py."""
        self.param_layouts: dict[str, ParamLayout] = dict(parallel.layouts)
        """Where each local tensor lies in the unsharded parameter (checkpoints); absent = the whole parameter."""
        self.tied_copies: dict[str, str] = dict(parallel.tied_copies)
        """alias -> canonical: a parameter this rank holds as a copy of another (a last pipeline stage's head)."""
        self.loss_context: Callable[[], ContextManager] = parallel.loss_context
        """What a loss and its backward run inside (tensor parallelism's vocab-parallel loss)."""
        self.transport = transport
        """The shared-memory transport of the chunks' collectives (host.shm_collectives), closed by close()."""
        # what initialize() applied to the process (host.* keys after their environment overrides)
        self.host_settings = dict(keep_freed_memory=keeps_freed_memory, shm_collectives=transport is not None)
        self.gradient_accumulation = self.config.gradient_accumulation
        self.stage = self.config.zero.stage
        self.micro_step = 0  # backward() calls since the last optimizer step
        self.global_step = 0  # optimizer steps taken (skipped fp16 steps included)
        self.last_step_skipped = False  # the last optimizer step was an fp16 overflow, skipped
        self._pending_backward = False
        self.traffic = traffic or Traffic()
        """Host<->device bytes counted so far in the current step (zero/offload.py Traffic)."""
        self.last_step_traffic = Traffic()
        """The bytes the last optimizer step moved between host (or disk) and device: its micro-steps' gathers and
        gradient hand-overs, and the step's write-backs."""

    # -- forward / backward / step ------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    forward = __call__

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        self.traffic.counting = mode  # evaluation's gathers are no optimizer step's traffic
        return self

    def eval(self) -> "Engine":
        return self.train(False)

    @property
    def is_accumulation_boundary(self) -> bool:
        """True when the next backward() completes an optimizer step's worth of micro-batches."""
        return (self.micro_step + 1) % self.gradient_accumulation == 0

    @property
    def accumulate_on_device(self) -> bool:
        """Offloaded gradients are summed over the micro-steps on the device and cross to the host once per step
        (EnginePlan.accumulate_on_device)."""
        return self.grad_path.accumulate_on_device

    @property
    def loss_scale(self) -> float:
        """fp16's current dynamic loss scale (1.0 for fp32 and bf16)."""
        return self.sharded_optim.loss_scaler.scale

    @property
    def last_step_found_inf(self) -> torch.Tensor:
        """1.0 when the last optimizer step was skipped (a non-finite gradient; fp16: an overflow), else 0.0:
        a 0-dim device tensor, not read back to the host (bf16/fp32 skip on the device)."""
        return self.sharded_optim.found_inf

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate `loss` (a scalar), scaled for fp16 and averaged over accumulation steps.

        Stage 0/1 reduce gradients only on the micro-step that completes the accumulation (one
        collective per optimizer step); stages 2/3 reduce every micro-step into the fp32 shard.
        """
        if loss.dim() != 0:
            raise ValueError(f"engine.backward expects a scalar loss, got shape {tuple(loss.shape)}; "
                             f"reduce it first (e.g. loss.mean())")
        self.sharded_optim.finish_step()  # the gradient buffers are an overlapped step's input until it ends
        reduce = self.stage >= 2 or self.is_accumulation_boundary
        self.grad_path.begin(last_reduce=self.is_accumulation_boundary)
        self.grad_hooks.begin_backward(reduce, self.grad_path.hand_over, at_launch=self.grad_path.hand_over_at_launch)
        if self.gather_hooks is not None:
            self.gather_hooks.in_backward = True
        try:
            self.scale_loss(loss).backward()
        finally:
            self.grad_hooks.end_backward()
            if self.gather_hooks is not None:
                self.gather_hooks.end_backward()
        self.micro_step += 1
        self._pending_backward = True

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss whose gradient backward computes: averaged over the accumulation, times fp16's scale."""
        return loss.float() * (self.loss_scale / self.gradient_accumulation)

    @contextmanager
    def scheduled_backward(self, before_reduce: Callable[[], None] | None = None) -> Iterator[None]:
        """One optimizer step's micro-batches, forward and backward, run inside the block by a schedule.

        For a pipeline schedule (parallel/pipeline.py), which calls autograd itself on every micro-batch:
        the grad hooks only collect each gradient into its chunk meanwhile; at the end of the block
        `before_reduce()` runs (the tied embedding's gradient summed across stages), then every chunk is
        reduced once (ZeRO-1 and ZeRO-2 alike) and `step()` may follow. The schedule's loss function must
        return `scale_loss(loss)`.
        """
        if self.micro_step != 0:
            raise RuntimeError(f"scheduled_backward() runs a whole optimizer step, but {self.micro_step} "
                               f"micro-step(s) of the current one were already taken with backward()")
        self.grad_hooks.begin_backward(False, self.grad_path.hand_over)
        try:
            yield
        finally:
            self.grad_hooks.end_backward()
        if before_reduce is not None:
            before_reduce()
        self.grad_path.begin(last_reduce=True)
        self.grad_hooks.begin_backward(True, self.grad_path.hand_over, at_launch=self.grad_path.hand_over_at_launch)
        self.grad_hooks.end_backward()  # every chunk reduced and handed over
        self.micro_step = self.gradient_accumulation
        self._pending_backward = True

    def local_grad(self, param: nn.Parameter) -> torch.Tensor:
        """`param`'s gradient summed over this step's micro-batches on this rank, not yet reduced: a view
        into its chunk, valid inside `scheduled_backward`'s `before_reduce` (zeros if it got none)."""
        index, slot_index = self.grad_hooks.param_to_chunk[id(param)]
        return self.chunks[index].local_grad(slot_index)

    # -- step -----------------------------------------------------------------------------------

    def step(self) -> torch.Tensor | None:
        """Optimizer step at the accumulation boundary; None on other micro-steps.

        Returns the global gradient norm (before clipping, unscaled) as a 0-dim tensor on the device, not
        read back to the host: a caller that logs it pays the sync then. An fp16 step skipped on overflow
        returns a nan norm and sets `last_step_skipped` (the loss scale has backed off).
        """
        if not self._pending_backward:
            raise RuntimeError("engine.step() called without engine.backward(loss) since the last step; "
                               "call engine.backward(loss) first (loss.backward() bypasses the engine's "
                               "gradient reduction)")
        if self.micro_step % self.gradient_accumulation != 0:
            return None
        self.grad_path.finish()  # every gradient final, the norms taken at hand-over included
        grad_norm, self.last_step_skipped = self.sharded_optim.step()
        self.last_step_traffic = self.traffic.take()
        self.global_step += 1
        self.micro_step = 0
        self._pending_backward = False
        if self.last_step_skipped:
            self.logger.warning(f"step {self.global_step}: fp16 gradient overflow, step skipped; "
                                f"loss scale now {self.loss_scale:g}")
        return grad_norm

    @property
    def last_host_step_s(self) -> float:
        """Seconds the chunks' optimizer steps took in the last step that has finished: the host step where the
        optimizer is offloaded. With the step behind the next forward (stage 3 on a GPU), right after `step()`
        that is the previous step's."""
        return self.sharded_optim.last_chunk_step_s

    @property
    def lr(self) -> float:
        """The first param group's learning rate (what the LR schedule sets)."""
        groups = self.optimizer.param_groups
        return groups[0]["lr"] if groups else 0.0

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
        self.grad_path.clear()
        self.sharded_optim.zero_grad()

    # -- accounting ---------------------------------------------------------------------------

    def memory_stats(self) -> dict[str, dict[str, int]]:
        """Bytes of model state on this rank, by category and home, measured from the live tensors.

        Returns {"params"|"grads"|"master"|"optimizer": {"device"|"host"|"disk": bytes}}. A tensor
        that serves two roles (fp32 master aliasing the param shard) is counted once, as params.
        """
        stats = {c: {h: 0 for h in HOMES} for c in CATEGORIES}
        seen: set[int] = set()
        for category, tensor, home in self.held_tensors():
            ptr = tensor.untyped_storage().data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                stats[category][home] += tensor.untyped_storage().nbytes()
        return stats

    def held_tensors(self) -> Iterator[tuple[str, torch.Tensor, str]]:
        """(category, tensor, home) of the model state on this rank, in memory_stats' order (the first role of a
        storage is the one it counts under); empty and absent tensors left out."""
        def held():
            for chunk in self.chunks:
                yield "params", chunk.full_buffer, "device"  # in-flight prefetches included
                yield "params", chunk.shard, chunk.shard_home
                yield "grads", chunk.grad_full, "device"
            for grad in self.grad_path.device_sums():
                yield "grads", grad, "device"
            yield from self.sharded_optim.held_tensors()
        return ((c, t, h) for c, t, h in held() if t is not None and t.numel())

    def num_params(self) -> int:
        return sum(chunk.plan.numel for chunk in self.chunks)

    def host_bytes(self) -> int:
        """Host RAM this rank holds while it trains, in bytes (what the build line states; issue 30 point 1).

        The model state in host memory now (`memory_stats()`; on a CPU run every home but disk is host memory),
        the gradient shards each step holds there not allocated now (fp32, or as they crossed:
        `GradPath.unallocated_grad_bytes`), and on a CPU
        run the compute's own largest buffers.
        Sharded chunks: the largest chunk twice (its local gradient buffer, and a parameter's gradient as
        autograd makes it beside that buffer), at stage 3 once more (its gathered copy). One shard per chunk:
        the gathered chunk is the shard and the local gradient buffer the gradient shard (Chunk.gather,
        add_param_grad), leaving the largest parameter's gradient beside its chunk's buffer, unless that
        parameter is its chunk's only one (its gradient becomes the buffer); a tied embedding adds none
        (grad_hooks.py). Not counted: activations, the interpreter and libraries, freed heap not returned.
        """
        stats = self.memory_stats()
        homes = ("device", "host") if self.ctx.device.type == "cpu" else ("host",)
        held = sum(stats[c][h] for c in CATEGORIES for h in homes)
        held += self.grad_path.unallocated_grad_bytes(homes)
        if self.ctx.device.type == "cpu":
            if any(c.plan.num_shards > 1 for c in self.chunks):
                largest = max(c.plan.padded_numel * c.dtype.itemsize for c in self.chunks)
                held += (3 if self.stage == 3 else 2) * largest
            else:
                held += max((s.numel * c.dtype.itemsize for c in self.chunks if len(c.plan.slots) > 1
                             for s in c.plan.slots), default=0)
        return held

    def describe(self) -> str:
        """One startup line: stage, chunks, this rank's model-state bytes, and the process-wide host settings."""
        stats = self.memory_stats()
        total = {h: sum(stats[c][h] for c in CATEGORIES) for h in HOMES}
        on = {True: "on", False: "off"}
        kernel = getattr(self.optimizer, "backend", None)  # CPUAdam/HybridAdam's host kernel
        return (f"zerogpt engine: stage {self.stage}, precision {self.config.precision}, "
                f"{len(self.chunks)} chunks, {self.num_params() / 1e6:.2f}M params, world {self.ctx.dp_size}, "
                f"accumulation {self.gradient_accumulation}; model state on this rank: "
                + ", ".join(f"{h} {total[h] / 2**20:.1f} MiB" for h in HOMES if total[h])
                + f"; host RAM held while training {self.host_bytes() / 2**30:.2f} GiB "
                f"({self.host_bytes() / max(self.num_params(), 1):.1f} bytes/param)"
                + f"; host: keep_freed_memory {on[self.host_settings['keep_freed_memory']]}, "
                f"shm_collectives {on[self.host_settings['shm_collectives']]}"
                + (f", cpu_adam {kernel}" if kernel else "")
                + (f", host step on {host_step.threads} threads beside forward and backward"
                   if (host_step := self.sharded_optim.host_step).overlaps else ""))

    # -- consolidated state -------------------------------------------------------------------

    def full_chunk_values(self, chunk: Chunk, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole chunk (numel, unpadded) on every rank: masters if trainable, else params.

        Every rank must call this (it all-gathers when the chunk is sharded).
        """
        master = self.sharded_optim.master(chunk.plan.index)
        shard = master if master is not None else chunk.shard
        shard = shard.to(self.ctx.device, torch.float32)
        if chunk.plan.num_shards == 1:
            full = shard
        else:
            full = torch.empty(chunk.plan.padded_numel, dtype=torch.float32, device=self.ctx.device)
            all_gather_flat(full, shard.contiguous(), group=self.ctx.dp_group, transport=self.transport)
        return full[: chunk.plan.numel].to(dtype)

    def finish_step(self) -> None:
        """Wait for the host step behind the next forward (a GPU run, optimizer offloaded): until then, or until
        the next forward's first use of each chunk, the module's parameters are the previous step's or being
        written. Call it before reading them yourself between step() and the next forward (an EMA of the weights);
        `engine.module.state_dict()`, checkpoints and `state_dict_full` wait on their own."""
        self.sharded_optim.finish_step()

    def state_dict_full(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """Consolidated parameters (from the fp32 masters) and buffers, on rank 0 (CPU); {} elsewhere.

        Streams chunk by chunk, so peak extra memory is one chunk, not a second model.
        """
        self.sharded_optim.finish_step()
        out: dict[str, torch.Tensor] = {}
        for chunk in self.chunks:
            full = self.full_chunk_values(chunk, dtype)
            if self.ctx.dp_rank == 0:
                for slot in chunk.plan.slots:
                    out[slot.name] = full[slot.offset : slot.end].view(slot.shape).cpu().clone()
        if self.ctx.dp_rank == 0:
            for name, buf in self.module.named_buffers():
                out[name] = buf.detach().cpu().clone()
        return out

    # -- state (torch's Stateful protocol) -----------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's training state as live tensors (not copies), with what a checkpoint needs to map it to
        parameters: each shard's ShardMap, each parameter's layout in the unsharded model, and the tied names.

        {"global_step": int, "optimizer": ShardedOptimizer.state_dict() (shards by chunk index),
         "frozen": {chunk index: param shard}, "buffers": {name: tensor},
         "shards": {chunk index: ShardMap}, "layouts": {name: ParamLayout}, "tied": {alias: canonical}}
        The last three describe the tensors; load_state_dict reads the first four.
        """
        state_keys = set(self.module.state_dict(keep_vars=True))
        return {
            "global_step": self.global_step,
            "optimizer": self.sharded_optim.state_dict(),
            "frozen": {c.plan.index: c.shard for c in self.chunks if not c.plan.trainable},
            "buffers": {n: b for n, b in self.module.named_buffers() if n in state_keys},
            "shards": {c.plan.index: ShardMap.of(c.plan, c.shard_index) for c in self.chunks},
            "layouts": self._layouts(),
            "tied": {**tied_aliases(self.module), **self.tied_copies},
        }

    def _layouts(self) -> dict[str, ParamLayout]:
        """{name: where this rank's local tensor lies in the unsharded parameter}, each checked against the shape
        its chunk holds (`param_layouts`, absent = the whole parameter)."""
        return {slot.name: as_layout(self.param_layouts.get(slot.name), slot.shape, slot.name)
                for chunk in self.chunks for slot in chunk.plan.slots}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a `state_dict()` (tensors may be the live ones, filled in place); all ranks call."""
        with torch.no_grad():
            self.sharded_optim.load_state_dict(state["optimizer"])  # masters -> param shards
            for index, shard in state["frozen"].items():
                if shard is not self.chunks[index].shard:
                    self.chunks[index].shard.copy_(shard)
            for chunk in self.chunks:  # param shards -> (stages 0-2) the full chunks
                if chunk.persistent_full:
                    chunk.all_gather_full()
            buffers = dict(self.module.named_buffers())
            for name, value in state["buffers"].items():
                if value is not buffers[name]:
                    buffers[name].copy_(value)
        self.global_step = int(state["global_step"])
        self.micro_step = 0
        self._pending_backward = False
        self.zero_grad()
        self.traffic.take()  # the load's copies are no step's traffic

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
        """Remove hooks and any disk-offload files; close the shared-memory transport (and its thread), and the
        host step's worker thread."""
        self.sharded_optim.close()
        self.grad_hooks.remove()
        for handle in self._step_reads:
            handle.remove()
        if self.gather_hooks is not None:
            self.gather_hooks.remove()
        self.placement.close()
        if self.transport is not None:
            self.transport.close()
            self.transport = None
            self.host_settings["shm_collectives"] = False


def _reads_around_the_step(module: nn.Module, sharded_optim: ShardedOptimizer) -> list[RemovableHandle]:
    """Module hooks that make a read of the parameters, by whatever path a loop takes (`engine(x)`,
    `engine.module(x)`, `engine.module.state_dict()`), see the plain step's values where the host step runs ahead
    or behind.

    - A forward between the step's last backward and step() (an evaluation of the batch, say) sees the params as they
      were: the chunk steps taken ahead during that backward, which wrote them, are dropped first (before the
      engine's own forward pre-hooks, which wait for the chunks).
    - `torch.save(engine.module.state_dict())` right after step() saves the new parameters, not the previous step's
      or half-written ones: the host step behind the next forward finishes first.

    Weakly held: the module, which may outlive this engine, does not keep its optimizer state alive.
    """
    optim = weakref.ref(sharded_optim)

    def drop_steps_ahead(*_: Any) -> None:
        if (live := optim()) is not None:
            live.host_step.abandon()

    def finish_step(*_: Any) -> None:
        if (live := optim()) is not None:
            live.finish_step()
    return [module.register_forward_pre_hook(drop_steps_ahead, prepend=True),
            module.register_state_dict_pre_hook(finish_step)]


def tied_aliases(module: nn.Module) -> dict[str, str]:
    """{alias: canonical} for parameters reachable under two names (GPT-2's lm_head.weight = wte.weight)."""
    canonical: dict[int, str] = {}
    aliases = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in canonical:
            aliases[name] = canonical[id(p)]
        else:
            canonical[id(p)] = name
    return aliases
