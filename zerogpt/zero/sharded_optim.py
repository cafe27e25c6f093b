"""The optimizer side of ZeRO: one `ChunkState` per trainable chunk, and the step over them.

A chunk's optimizer side has one owner, its `ChunkState`: the fp32 master shard, the reduced fp32 gradient
shard, the optimizer state and where they live. Its step is an optimizer of the user's class built over
that chunk's master alone, so a step of one chunk reads and writes only that chunk's tensors. The user's
optimizer's param groups are the one owner of the hyperparameters (LR schedulers write there): a chunk
optimizer's param group is a view that reads them from its user group in place, nothing is copied.

A step is: one all-reduce of the local sum of squared gradients (it carries both the global grad norm and
the fp16 overflow flag, since inf/nan survive a sum) -> unscale and clip by one coefficient computed on
the device -> step chunk by chunk, each chunk cast into its param shard and all-gathered (stages 0-2)
while the next chunk steps. A non-finite norm skips the step on the device (bf16/fp32: `found_inf` goes into
each chunk's step). Nothing here reads a tensor back to the host, except fp16's overflow check.
"""
from __future__ import annotations

import time
from collections import ChainMap
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from zerogpt.amp import DynamicLossScaler
from zerogpt.optim.cpu_adam import CPUAdam, decay_slices
from zerogpt.optim.host_adam import HOST_ADAM_DTYPES, seed_of
from zerogpt.zero.chunk import Chunk
from zerogpt.zero.offload import Placement, Traffic

ADAM_STATE_KEYS = ("exp_avg", "exp_avg_sq")
CLIP_EPS = 1e-6


def _is_cpu_adam(optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(optimizer, CPUAdam)


def _is_adam_family(optimizer: torch.optim.Optimizer) -> bool:
    names = {c.__name__ for c in type(optimizer).__mro__}
    return bool(names & {"Adam", "AdamW", "CPUAdam", "HybridAdam"})


def _decay_is_decoupled(optimizer: torch.optim.Optimizer, group: dict) -> bool:
    """AdamW-style decay (param *= 1 - lr * wd) rather than L2 added to the gradient."""
    return bool(group.get("decoupled_weight_decay") or group.get("adamw_mode")
                or isinstance(optimizer, torch.optim.AdamW))


def _takes_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's own kernel skips a step on a device flag: CPUAdam / HybridAdam (`found_inf=`) and
    torch's fused optimizers (the `found_inf` GradScaler sets on them for one step)."""
    if _is_cpu_adam(optimizer):
        return True
    return type(optimizer).__module__.startswith("torch.optim") and bool(optimizer.param_groups[0].get("fused"))


def _hyperparameters(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


def chunk_optimizer(template: torch.optim.Optimizer, group: dict, master: torch.Tensor,
                    decay_ranges: list[tuple[int, int]] | None = None,
                    rounding_seed: int = 0) -> torch.optim.Optimizer:
    """An optimizer of `template`'s class over `master` alone, reading its hyperparameters from `group`.

    Its one param group is a ChainMap: its own `params` ([master]), then `group` itself, read at each lookup: an
    LR scheduler's change is seen with no copy. Torch's optimizers only read their groups with `group[key]` while
    stepping. When only `decay_ranges` of the shard take weight decay, CPUAdam is given them (`decay_ranges`: its
    fused op decays in the update's own pass); any other optimizer gets weight_decay 0 and `ChunkState.step`
    decays the ranges. CPUAdam reads `rounding_seed`, the seed of its bf16 moments' stochastic rounding,
    distinct per chunk shard.
    """
    kwargs = {"backend": template.backend} if isinstance(template, CPUAdam) else {}  # the kernel chosen once
    try:
        optimizer = type(template)([{"params": [master], **_hyperparameters(group)}], **kwargs)
    except TypeError as e:
        raise TypeError(f"the engine steps each chunk with its own {type(template).__name__} built as "
                        f"{type(template).__name__}([{{'params': [...], **param_group}}]), which failed ({e}); "
                        f"give the optimizer's constructor defaults for every argument") from None
    if isinstance(template, CPUAdam):  # the kernel is named now; whether the fused op may take the step is not
        optimizer.fuses_copies = template.fuses_copies
    built = optimizer.param_groups[0]
    own = {k: v for k, v in built.items() if k == "params" or k not in group}  # + defaults the user's group lacks
    if decay_ranges is not None and isinstance(template, CPUAdam):
        own["decay_ranges"] = decay_ranges
    elif decay_ranges is not None:
        own["weight_decay"] = 0.0
    own["rounding_seed"] = rounding_seed
    optimizer.param_groups[0] = ChainMap(own, group)
    return optimizer


@dataclass
class ChunkState:
    """Everything the optimizer side keeps for one trainable chunk on this rank."""

    chunk: Chunk
    master: torch.Tensor  # fp32 shard; `chunk.shard` itself when `master_is_param_shard`
    optimizer: torch.optim.Optimizer  # the user's optimizer class over [master] alone
    group_index: int  # the user's param group whose hyperparameters this chunk follows
    home: str  # where master and optimizer state live: "device" | "host" | "disk"
    grad_home: str  # where the reduced gradient shard lives: "device" | "host"
    master_is_param_shard: bool
    # Shard-local (start, end) ranges of the slots that take weight decay, when the chunk mixes decayed and
    # undecayed slots (biases, LayerNorm); None when every slot follows the group's weight_decay.
    decay_ranges: list[tuple[int, int]] | None = None
    # Shard-local ranges of the slots counted in the global grad norm; None: the whole shard. A slot is left
    # out where another rank holds the same gradient (a tensor-parallel replica, the tied head of the last
    # pipeline stage), so the norm counts every distinct gradient once.
    norm_ranges: list[tuple[int, int]] | None = None
    # reduced grad shard: fp32, summed over micro-steps, or the step's one crossing as it crossed
    # (keeps_as_crossed); None between steps
    grad: torch.Tensor | None = None
    # The squared norm of `grad` (its norm ranges), taken from the gradient on the device before it crossed
    # to the host, when that one hand-over was the step's whole gradient; None: the step reads `grad`.
    grad_sumsq: torch.Tensor | None = None

    @property
    def index(self) -> int:
        return self.chunk.plan.index

    @property
    def state(self) -> dict[str, Any]:
        """The optimizer state of this chunk ("exp_avg", "exp_avg_sq", "step", ...)."""
        return self.optimizer.state[self.master]

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The shard-sized state tensors (scalars such as Adam's step excluded)."""
        return {k: v for k, v in self.state.items() if isinstance(v, torch.Tensor) and v.dim() > 0}

    @property
    def steps_on_host(self) -> bool:
        """Whether this chunk's step is CPUAdam's host step (a host master): the one pass that takes the clip
        factor as it reads and writes a compute copy, and the only step the overlap's worker runs."""
        return _is_cpu_adam(self.optimizer) and self.master.device.type == "cpu"

    def tensors(self) -> list[torch.Tensor]:
        """Master and state: what a disk-offloaded step reads ahead and evicts."""
        return [self.master, *self.state_tensors().values()]

    def keeps_as_crossed(self) -> bool:
        """Whether a reduced shard handed over now, as the step's whole gradient of this chunk, is kept for the
        step as it crossed to the host (the compute dtype: 2 bytes/param in bf16) instead of being added into
        an fp32 shard.

        The fp32 shard would hold the same values, so the step is the same bit for bit; what goes is 2
        bytes/param of host RAM held from backward to the step (issue 30 point 1) and the pass that converted
        the gradient into it. CPUAdam's host step reads bf16 as it is; other optimizers get a chunk's fp32
        copy at the step (`step`).
        """
        return self.grad is None and self.grad_home == "host"

    def take_crossed_grad(self, reduced: torch.Tensor, crossed: torch.Tensor) -> None:
        """Keep `crossed`, the host copy of `reduced` (`reduced` itself on a CPU run), as this step's gradient.

        Its squared norm is taken from `reduced`, where it is, so an offloaded step does not read the host
        gradient once more for the clip norm (on a GPU: at device bandwidth, on the copy stream, before the
        device->host copy)."""
        self.grad_sumsq = self.sumsq(reduced)
        self.grad = crossed

    def add_grad(self, reduced: torch.Tensor, placement: Placement) -> torch.Tensor:
        """Sum a reduced gradient shard into this chunk's fp32 grad shard (allocated on first use).

        The first shard of a step becomes the grad shard itself when it already is one (fp32, this chunk's size,
        at the grad home, nothing to pin): no second buffer beside it and no copy (at one rank, the chunk's whole
        local gradient buffer). The step reads a gradient summed here for its norm; a step's one offloaded
        crossing goes to `take_crossed_grad` instead.
        """
        if self.grad is None and reduced.dtype == torch.float32 and reduced.numel() == self.master.numel() \
                and reduced.device == placement.torch_device(self.grad_home) \
                and not (self.grad_home == "host" and placement.device.type == "cuda"):
            self.grad = reduced
            return self.grad
        if self.grad is None:
            self.grad = placement.empty(self.master.numel(), torch.float32, self.grad_home, f"grad{self.index}")
        if reduced.device == self.grad.device:
            self.grad.add_(reduced)
        return self.grad

    def sumsq(self, grad: torch.Tensor) -> torch.Tensor:
        """The squared L2 norm of this chunk's slots in the global grad norm (`norm_ranges`), as a 0-dim fp32
        tensor on `grad`'s device: one pass, no squared temporary."""
        total = torch.zeros((), dtype=torch.float32, device=grad.device)
        for a, b in self.norm_ranges if self.norm_ranges is not None else [(0, grad.numel())]:
            g = grad[a:b] if grad.dtype == torch.float32 else grad[a:b].float()
            total += torch.dot(g, g)
        return total

    def step(self, group: dict, factor: torch.Tensor | None, found_inf: torch.Tensor | None = None,
             grad: torch.Tensor | None = None, out: torch.Tensor | None = None) -> bool:
        """Unscale/clip this chunk's gradient by `factor`, then one optimizer step of this chunk alone, with the
        hyperparameters of `group` (the user's param group this chunk follows). Returns whether the step also
        wrote the compute copy (then `write_back` has nothing to do).

        A host master stepped by CPUAdam/HybridAdam goes through one pass (zerogpt/optim/host_adam.py): the
        gradient is unscaled and clipped as it is read and the new master is written into the param shard when
        that shard is host memory (param offload; every shard of a CPU run), so neither gets a pass of its own.

        `found_inf` (bf16/fp32: a 0-dim device tensor, 1.0 when the global gradient norm is not finite) skips the
        step: the master, the optimizer state and its step count stay bit for bit. torch's fused optimizers and
        CPUAdam/HybridAdam take the flag into their kernel, on the device, with no host sync (initialize makes a
        GPU run's torch Adam/AdamW/SGD fused when the user left the implementation to torch). Any other optimizer
        has the flag read on the host first (ShardedOptimizer.step, once per step), as torch's GradScaler does for
        it, and gets `found_inf` only when it is set: free when the step runs on the CPU, a sync on a GPU.
        """
        flag = None
        if found_inf is not None:
            if not _takes_found_inf(self.optimizer):
                return False
            # to a host master: a blocking copy, since non_blocking would return pinned memory still being
            # written (the host step waits for the gradients anyway); to the device: no wait
            flag = found_inf.to(self.master.device, non_blocking=self.master.device.type != "cpu")
        grad = grad if grad is not None else self.grad  # an overlapped step passes the one it captured
        grad = grad if grad is not None else torch.zeros_like(self.master)  # decay, momentum still act
        host_step = self.steps_on_host
        if grad.dtype != self.master.dtype:  # kept as it crossed (keeps_as_crossed)
            if host_step and grad.dtype in HOST_ADAM_DTYPES and _grad_dtype_settable():
                self.master.grad_dtype = None  # CPUAdam reads it as it is, on the fp32 master
            else:
                grad = grad.to(self.master.dtype)  # one chunk's temporary, for the step alone
        scale = 1.0
        if factor is not None and host_step:  # read once; the update multiplies each gradient as it reads it
            scale = float(factor)
        elif factor is not None:  # to a host gradient: blocking, for the reason the flag's copy above is
            grad.mul_(factor.to(grad.device, non_blocking=grad.device.type != "cpu"))
        # Read `group` in place (chunk_optimizer): rebinding the view is not a copy, and follows a group dict that
        # torch's own optimizer.load_state_dict replaced.
        self.optimizer.param_groups[0].maps[-1] = group
        if self.decay_ranges is not None and not _is_cpu_adam(self.optimizer):  # its weight_decay is 0: here
            decay_slices(self.master, grad, self.decay_ranges, lr=group["lr"],
                         weight_decay=group.get("weight_decay", 0.0),
                         decoupled=_decay_is_decoupled(self.optimizer, group), found_inf=flag)
        self.master.grad = grad
        if out is None and host_step:  # `out`: a staging buffer of the caller's, for a shard on the device
            out = self._host_compute_copy()
        if host_step:
            self.optimizer.step(found_inf=flag, grad_scale=scale,
                                copy_to=None if out is None else {self.master: out})
        elif flag is None:
            self.optimizer.step()
        else:  # torch's fused optimizers read the flag GradScaler sets on them for one step (torch.amp)
            self.optimizer.found_inf = flag
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.found_inf
        self.master.grad = None
        return out is not None

    def _host_compute_copy(self) -> torch.Tensor | None:
        """The param shard, when the host step may write the new master straight into it (it is host memory)."""
        shard = self.chunk.shard
        return None if self.master_is_param_shard or shard.device.type != "cpu" else shard

    def write_back(self) -> None:
        """Cast the updated master into its param shard (compute dtype, the shard's home)."""
        if not self.master_is_param_shard:
            self.chunk.shard.copy_(self.master, non_blocking=True)


class ShardedOptimizer:
    """The chunks' `ChunkState`s, the step over them, and their state for checkpoints."""

    def __init__(self, optimizer: torch.optim.Optimizer, chunks: list[Chunk], *, placement: Placement,
                 optim_home: str, precision: str, stage: int, group: dist.ProcessGroup | None,
                 loss_scaler: DynamicLossScaler, clip_grad_norm: float | None,
                 no_decay: set[str] | None = None, norm_duplicates: set[str] | None = None,
                 model_parallel_group: dist.ProcessGroup | None = None, traffic: Traffic | None = None,
                 state_dtype: torch.dtype = torch.float32, overlap_next_forward: bool = False) -> None:
        self.optimizer = optimizer  # holds the hyperparameters; LR schedulers bind to it
        self.chunks = chunks
        self.placement = placement
        self.traffic = traffic or Traffic()  # the write-backs that cross between host and device
        self.optim_home = optim_home
        self.grad_home = "host" if optim_home == "disk" else optim_home
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
        # fp32 with the param shards resting where the optimizer lives (both on the device, or both on the host:
        # stage 3 with param and optimizer offload): the param shard is the master, no second fp32 copy (4 B/param
        # of host RAM saved). Not when they rest apart (a host master would get a device grad, or the reverse).
        self.master_is_param_shard = precision == "fp32" and optim_home != "disk" and all(
            c.shard_home == optim_home for c in chunks if c.plan.trainable)
        # Adam's moments at their home: fp32, or bf16 (host/disk homes, stepped by CPUAdam's fused op)
        self.state_dtype = state_dtype
        if state_dtype != torch.float32 and (optim_home == "device" or not _is_cpu_adam(optimizer)):
            raise ValueError(f"zero.offload_optimizer.state_dtype='bf16' keeps Adam's moments in bf16 on the host, "
                             f"stepped by zerogpt.optim.CPUAdam/HybridAdam's fused op; this run has "
                             f"{type(optimizer).__name__} with the optimizer state on the "
                             f"{'device' if optim_home == 'device' else optim_home}: use optimizer type HybridAdam "
                             f"and zero.offload_optimizer.device='cpu' or 'disk', or state_dtype='fp32'")
        if optim_home == "disk" and not _is_adam_family(optimizer):
            raise ValueError(f"disk offload keeps Adam state (exp_avg, exp_avg_sq) in memory-mapped files; "
                             f"{type(optimizer).__name__} is not an Adam-family optimizer. Use "
                             f"zero.offload_optimizer=dict(device='cpu') or an Adam/AdamW/CPUAdam optimizer")
        # Host masters: the step may run behind the next forward (`_overlaps`); the engine asks for it where the
        # compute is a GPU (on a CPU run, forward and host step would share the same cores).
        self.overlap_next_forward = overlap_next_forward
        self.step_waits: Any = None  # stages 1-2: the modules' hooks that wait for their chunks (StepWaitHooks)
        self._worker: ThreadPoolExecutor | None = None
        self._staging: HostStaging | None = None  # made on first use (a GPU run, params on the device)
        self.force_staging = False  # stage compute copies as a GPU run does, where the shards are host memory (tests)
        self._h2d_stream: Any = None  # an overlapped step's compute copies to the device (the worker's stream)
        # Seconds the chunks' steps took in the last step that has finished (an overlapped step finishes behind the
        # next forward, so right after step() this is the previous one's): the host step, where it is offloaded.
        self.last_chunk_step_s = 0.0
        self._chunk_step_s = 0.0  # summed by the worker as an overlapped step's chunks finish
        self._pending: dict[int, Future] = {}
        self.states: dict[int, ChunkState] = {}
        for chunk in chunks:
            if chunk.plan.trainable:
                self.states[chunk.plan.index] = self._chunk_state(chunk, no_decay or set())
        for group_ in optimizer.param_groups:
            group_["params"] = []  # the chunk optimizers own the masters; this one keeps hyperparameters
        optimizer.state.clear()

    def _chunk_state(self, chunk: Chunk, no_decay: set[str]) -> ChunkState:
        plan = chunk.plan
        if self.master_is_param_shard:
            master = chunk.shard
        else:
            master = self.placement.empty(plan.shard_numel, torch.float32, self.optim_home, f"master{plan.index}")
            master.copy_(chunk.shard)
            self.placement.evict(master)  # a disk master's pages leave RAM until its chunk's step reads them
        group = self.optimizer.param_groups[plan.group_index]
        decay_ranges = _slot_ranges(chunk, no_decay)
        rank = dist.get_rank(self.group) if dist.is_initialized() else 0
        optimizer = chunk_optimizer(self.optimizer, group, master, decay_ranges,
                                    rounding_seed=seed_of(plan.index, rank))
        state = ChunkState(chunk, master, optimizer,
                           plan.group_index, self.optim_home, self.grad_home, self.master_is_param_shard,
                           decay_ranges, _slot_ranges(chunk, self.norm_duplicates))
        if _is_adam_family(self.optimizer) and self.optim_home != "device":
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
        # an overlapped step holds its own reference to each gradient it has yet to read
        for state in self.states.values():
            state.grad = state.grad_sumsq = None

    # -- step ---------------------------------------------------------------------------------

    def _global_sumsq(self) -> torch.Tensor:
        local = torch.zeros((), dtype=torch.float32, device=self.placement.device)
        for state in self.states.values():
            if state.grad is not None:
                sumsq = state.grad_sumsq if state.grad_sumsq is not None else state.sumsq(state.grad)
                local += sumsq.to(local.device)
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
        self.finish_step()
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
        if found_inf is not None and not all(_takes_found_inf(s.optimizer) for s in self.states.values()):
            found_inf = found_inf if found_inf.item() else None  # one read per step, GradScaler's way for these
        factor = None
        if self.clip_grad_norm is not None:
            factor = torch.clamp(self.clip_grad_norm / (grad_norm + CLIP_EPS), max=1.0) / scale
        elif scale != 1.0:
            factor = torch.tensor(1.0 / scale, device=grad_norm.device)
        if self._overlaps():
            self._launch_chunks(factor, found_inf)
        else:
            self._step_chunks(factor, found_inf)
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
            staged = self._staging_for(state)
            wrote = state.step(self.optimizer.param_groups[state.group_index], factor, found_inf, out=staged)
            # Copy the updated master into its param shard now, while its pages are in RAM (disk)
            # and so the host->device copy overlaps the next chunk's CPU step.
            if staged is not None and wrote:
                self._send_staged(state.chunk.shard, staged)
            elif not wrote:
                state.write_back()
            self._count_compute_copy(state)
            if state.chunk.persistent_full:
                gathers.append(state.chunk.all_gather_full(async_op=True))
            for t in state.tensors():
                self.placement.evict(t)
        self.last_chunk_step_s = time.perf_counter() - start
        for work in gathers:
            if work is not None:
                work.wait()

    def _count_compute_copy(self, state: ChunkState) -> None:
        """The step's new master written into its param shard: traffic where the two rest on either side."""
        if not state.master_is_param_shard:
            self.traffic.copied(state.home, state.chunk.shard_home, state.chunk.shard)

    def _staging_for(self, state: ChunkState) -> torch.Tensor | None:
        """A pinned buffer for the compute copy of a host master whose param shard is on the device (CUDA,
        optimizer offloaded without the params): the host step writes the copy there in the compute dtype, so
        2 bytes/param cross the bus instead of the fp32 master's 4, and the cast needs no pass of its own."""
        shard = state.chunk.shard
        if state.master_is_param_shard or not (shard.device.type == "cuda" or self.force_staging) \
                or not state.steps_on_host or shard.dtype not in HOST_ADAM_DTYPES:
            return None
        if self._staging is None:
            largest = max(s.master.numel() for s in self.states.values())
            self._staging = HostStaging(largest, shard.dtype)
        return self._staging.take(shard.numel())

    # -- the step behind the next forward ------------------------------------------------------------

    def _overlaps(self) -> bool:
        """Whether this step runs behind the next forward: every master on the host stepped by CPUAdam's host
        step (the worker only computes on the host; device copies and collectives stay on this thread, in the
        same order on every rank), and a chunk's first use in forward waits for its own step: stage 3 gathers
        each chunk, stages 1-2 have `step_waits` hooks."""
        return self.overlap_next_forward and (self.stage == 3 or self.step_waits is not None) and all(
            s.home == "host" and s.steps_on_host for s in self.states.values())

    def _launch_chunks(self, factor: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        """Queue each chunk's step on a worker thread, in chunk (forward) order, and return.

        The norm, the non-finite flag and the clip factor are known already (this thread computed them, and
        reads the factor and flag to the host here, which the host step needs anyway): the result is the plain
        step's bit for bit. A chunk's first use in the next forward waits for its own step
        (`Chunk.pending_step`: stage 3's gather, stages 1-2's StepWaitHooks), so the next forward's first blocks
        start while later chunks still step; `finish_step()` waits for all.
        """
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerogpt-host-step")
        factor = None if factor is None else factor.to("cpu")
        found_inf = None if found_inf is None else found_inf.to("cpu")
        # the device work queued so far (backward's last reads of the param shards) comes before their overwrite
        ready = None
        if self.placement.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.placement.device))
        for state in self.states.values():
            group = self.optimizer.param_groups[state.group_index]
            self._pending[state.index] = self._worker.submit(self._timed_step, state, group, factor, found_inf,
                                                             state.grad, ready)
            state.chunk.pending_step = lambda index=state.index: self._finish_chunk(index)
            self._count_compute_copy(state)

    def _timed_step(self, state: ChunkState, group: dict, factor: torch.Tensor | None,
                    found_inf: torch.Tensor | None, grad: torch.Tensor | None, ready: Any) -> tuple[bool, Any]:
        """One chunk's step on the worker thread, its seconds added to this step's host time. Returns whether the
        step wrote the compute copy, and the event of its copy to the device when it went through the staging
        buffers (issued here, on the worker's own stream, so it overlaps the next chunk's step as in the plain
        step; the main stream waits for it in `_finish_chunk`)."""
        start = time.perf_counter()
        staged = self._staging_for(state)
        wrote = state.step(group, factor, found_inf, grad, out=staged)
        copied = self._send_staged(state.chunk.shard, staged, ready) if staged is not None and wrote else None
        self._chunk_step_s += time.perf_counter() - start  # one worker thread: no other writer
        return wrote, copied

    def _send_staged(self, shard: torch.Tensor, staged: torch.Tensor, ready: Any = None) -> Any:
        """Copy a staged compute copy into its param shard. With `ready` (an overlapped step on a GPU: the device
        work queued at its launch), from the worker thread on the worker's own stream after it, returning the
        copy's event; without, on the current stream (the plain step; the CPU, where staging is forced)."""
        if ready is None:
            shard.copy_(staged, non_blocking=True)
            self._staging.sent()
            return None
        if self._h2d_stream is None:
            self._h2d_stream = torch.cuda.Stream(shard.device)
        with torch.cuda.device(shard.device), torch.cuda.stream(self._h2d_stream):  # both are per thread
            self._h2d_stream.wait_event(ready)
            shard.copy_(staged, non_blocking=True)
            self._staging.sent()  # recorded on this stream: the buffer is free once the copy has read it
            copied = torch.cuda.Event()
            copied.record(self._h2d_stream)
        return copied

    def _finish_chunk(self, index: int) -> None:
        """Wait for one chunk's overlapped step (re-raising its error here) and finish its write-back."""
        state = self.states[index]
        state.chunk.pending_step = None
        wrote, copied = self._pending.pop(index).result()
        if copied is not None:  # the new shard, copied on the worker's stream: the compute waits for it alone
            torch.cuda.current_stream(state.chunk.shard.device).wait_event(copied)
        elif not wrote:
            state.write_back()
        if state.chunk.persistent_full:  # stages 1-2: every rank's new shard into `full`
            state.chunk.all_gather_full()
        if not self._pending:  # the last chunk: the step is complete
            self.last_chunk_step_s, self._chunk_step_s = self._chunk_step_s, 0.0

    def finish_step(self) -> None:
        """Wait for every chunk of an overlapped step; a no-op when none is pending. Anything that reads the
        masters, the state or every shard (the next step, backward, checkpoints) calls this first."""
        for index in list(self._pending):
            self._finish_chunk(index)

    def close(self) -> None:
        """Finish a pending step, stop the worker thread and take the stages 1-2 wait hooks off."""
        self.finish_step()
        if self.step_waits is not None:
            self.step_waits.remove()
            self.step_waits = None
        if self._worker is not None:
            self._worker.shutdown()
            self._worker = None

    # -- state (torch's Stateful protocol) -------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Hyperparameters, loss scaler and, per trainable chunk, this rank's shard tensors (live, not copies).
        Finishes an overlapped step first.

        {"param_groups": [hyperparameters], "loss_scaler": {...},
         "chunks": {index: {"master": shard, "exp_avg": shard, ..., "step": 0-dim}}}
        """
        self.finish_step()
        return {
            "param_groups": [_hyperparameters(g) for g in self.optimizer.param_groups],
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


class HostStaging:
    """Two pinned host buffers, used in turn: the host step writes one chunk's compute copy into one while the
    other's copy to the device may still be in flight; taking a buffer waits for its last copy (an event)."""

    def __init__(self, numel: int, dtype: torch.dtype) -> None:
        pin = torch.cuda.is_available()
        self.buffers = [torch.empty(numel, dtype=dtype, pin_memory=pin) for _ in range(2)]
        self.events: list[Any] = [None, None]
        self.turn = 0

    def take(self, numel: int) -> torch.Tensor:
        """The next buffer's first `numel` elements, once the copy that last read it has finished."""
        self.turn ^= 1
        if self.events[self.turn] is not None:
            self.events[self.turn].synchronize()
            self.events[self.turn] = None
        return self.buffers[self.turn][:numel]

    def sent(self) -> None:
        """The copy out of the buffer last taken is queued: record when it will have read it."""
        if torch.cuda.is_available():
            self.events[self.turn] = torch.cuda.Event()
            self.events[self.turn].record()


def _grad_dtype_settable() -> bool:
    """Whether this torch lets a gradient's dtype differ from its tensor's (`Tensor.grad_dtype`, torch 2.10+)."""
    return hasattr(torch.Tensor, "grad_dtype")


def _slot_ranges(chunk: Chunk, excluded: set[str]) -> list[tuple[int, int]] | None:
    """This rank's shard-local ranges of the slots not in `excluded`; None when no slot is excluded.

    For weight decay (excluded: biases and norms) and the grad norm (excluded: gradients another rank holds).
    """
    plan = chunk.plan
    skipped = [slot.name in excluded for slot in plan.slots]
    if not any(skipped):
        return None
    lo, _ = plan.shard_range(chunk.shard_index)
    ranges: list[tuple[int, int]] = []
    for slot, skip in zip(plan.slots, skipped):
        overlap = plan.slot_overlap(slot, chunk.shard_index)
        if skip or overlap is None:
            continue
        start, end = overlap[0] - lo, overlap[1] - lo
        if ranges and ranges[-1][1] == start:
            ranges[-1] = (ranges[-1][0], end)  # adjacent decayed slots: one range
        else:
            ranges.append((start, end))
    return ranges
