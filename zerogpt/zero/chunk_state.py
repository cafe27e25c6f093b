"""One trainable chunk's optimizer side on this rank: its `ChunkState`, and the optimizer that steps it alone.

A `ChunkState` holds the fp32 master shard, this step's reduced gradient shard (given by zero/grad_path.py), the
optimizer state and where they live. Its step is an optimizer of the user's class built over that chunk's master
alone (`chunk_optimizer`), so a step of one chunk reads and writes only that chunk's tensors. The user's
optimizer's param groups are the one owner of the hyperparameters (LR schedulers write there): a chunk
optimizer's param group is a view that reads them from its user group in place, nothing is copied. The step over
all chunks (norm, clip, order) is zero/sharded_optim.py's; how gradients arrive is zero/grad_path.py's.
"""
from __future__ import annotations

from collections import ChainMap
from dataclasses import dataclass
from typing import Any

import torch

from zerogpt.optim.cpu_adam import CPUAdam, decay_slices
from zerogpt.optim.host_adam import HOST_ADAM_DTYPES, load_host_adam
from zerogpt.zero.chunk import Chunk


def is_cpu_adam(optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(optimizer, CPUAdam)


def is_adam_family(optimizer: torch.optim.Optimizer) -> bool:
    names = {c.__name__ for c in type(optimizer).__mro__}
    return bool(names & {"Adam", "AdamW", "CPUAdam", "HybridAdam"})


def _decay_is_decoupled(optimizer: torch.optim.Optimizer, group: dict) -> bool:
    """AdamW-style decay (param *= 1 - lr * wd) rather than L2 added to the gradient."""
    return bool(group.get("decoupled_weight_decay") or group.get("adamw_mode")
                or isinstance(optimizer, torch.optim.AdamW))


def takes_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's own kernel skips a step on a device flag: CPUAdam / HybridAdam (`found_inf=`) and
    torch's fused optimizers (the `found_inf` GradScaler sets on them for one step)."""
    if is_cpu_adam(optimizer):
        return True
    return type(optimizer).__module__.startswith("torch.optim") and bool(optimizer.param_groups[0].get("fused"))


def hyperparameters(group: dict) -> dict:
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
    distinct per chunk shard. A CPUAdam keeps the user's kernel choice through its constructor: "auto" (the fused
    op may take a step that writes a compute copy), else the kernel the user named.
    """
    kwargs = {}
    if isinstance(template, CPUAdam):  # "auto" resolves to the kernel the template resolved (chosen once per process)
        kwargs = {"backend": "auto" if template.fuses_copies else template.backend}
    try:
        optimizer = type(template)([{"params": [master], **hyperparameters(group)}], **kwargs)
    except TypeError as e:
        raise TypeError(f"the engine steps each chunk with its own {type(template).__name__} built as "
                        f"{type(template).__name__}([{{'params': [...], **param_group}}]), which failed ({e}); "
                        f"give the optimizer's constructor defaults for every argument") from None
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
    # This step's reduced grad shard, from its first hand-over (zero/grad_path.py, the one writer; final once the
    # path has finished): fp32, summed over micro-steps, or the step's one crossing as it crossed. None between steps.
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
        return is_cpu_adam(self.optimizer) and self.master.device.type == "cpu"

    def tensors(self) -> list[torch.Tensor]:
        """Master and state: what a disk-offloaded step reads ahead and evicts."""
        return [self.master, *self.state_tensors().values()]

    def take_grad(self, grad: torch.Tensor, sumsq: torch.Tensor | None = None) -> None:
        """This step's gradient shard, and its squared norm (`sumsq`) when it was taken before the shard crossed
        to the host (zero/grad_path.py)."""
        self.grad, self.grad_sumsq = grad, sumsq

    def drop_grad(self) -> None:
        """Between steps there is no gradient (an overlapped step holds its own reference to each it has yet to
        read)."""
        self.grad = self.grad_sumsq = None

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
            if not takes_found_inf(self.optimizer):
                return False
            # to a host master: a blocking copy, since non_blocking would return pinned memory still being
            # written (the host step waits for the gradients anyway); to the device: no wait
            flag = found_inf.to(self.master.device, non_blocking=self.master.device.type != "cpu")
        grad = grad if grad is not None else self.grad  # an overlapped step passes the one it captured
        grad = grad if grad is not None else torch.zeros_like(self.master)  # decay, momentum still act
        host_step = self.steps_on_host
        grad = self._as_master_grad(grad, host_step)
        scale, unscale = 1.0, None
        if factor is not None and host_step:  # read once; the update multiplies each gradient as it reads it
            scale = float(factor)
        elif factor is not None:  # to a host gradient: blocking, for the reason the flag's copy above is
            factor = factor.to(grad.device, non_blocking=grad.device.type != "cpu")
            if self._kernel_unscales(group):  # its grad_scale: the kernel divides each gradient as it reads it
                unscale = torch.reciprocal(factor)
            else:
                grad.mul_(factor)
        # Read `group` in place (chunk_optimizer): rebinding the view is not a copy, and follows a group dict that
        # torch's own optimizer.load_state_dict replaced.
        self.optimizer.param_groups[0].maps[-1] = group
        if self.decay_ranges is not None and not is_cpu_adam(self.optimizer):  # its weight_decay is 0: here
            decay_slices(self.master, grad, self.decay_ranges, lr=group["lr"],
                         weight_decay=group.get("weight_decay", 0.0),
                         decoupled=_decay_is_decoupled(self.optimizer, group), found_inf=flag)
        self.master.grad = grad
        if out is None and host_step:  # `out`: a staging buffer of the caller's, for a shard on the device
            out = self._host_compute_copy()
        if host_step:
            self.optimizer.step(found_inf=flag, grad_scale=scale,
                                copy_to=None if out is None else {self.master: out})
        elif is_cpu_adam(self.optimizer):  # HybridAdam over a device master: flag and divisor are its arguments
            self.optimizer.step(found_inf=flag, unscale=unscale)
        elif flag is None and unscale is None:
            self.optimizer.step()
        else:
            _fused_step(self.optimizer, found_inf=flag, grad_scale=unscale)
        self.master.grad = None
        return out is not None

    def _kernel_unscales(self, group: dict) -> bool:
        """Whether torch's fused kernel (a torch fused optimizer's, or HybridAdam's over a device master) takes the
        clip/unscale factor as its `grad_scale`, dividing each gradient as it reads it (before its own weight
        decay), so the gradient needs no pass of its own (issue 46.2: 12.5 GB of a GPT-2 XL step's traffic). Not
        where L2 decay of some ranges was added to the gradient before the kernel (`decay_slices`, ours or
        CPUAdam's): the kernel would divide that too. (A host master never comes here: CPUAdam's host step.)"""
        return (takes_found_inf(self.optimizer)
                and (self.decay_ranges is None or not group.get("weight_decay")
                     or _decay_is_decoupled(self.optimizer, group)))

    # -- a step taken before the global norm is known (zerogpt/zero/host_step.py) ----------------------------------

    @property
    def can_speculate(self) -> bool:
        """Whether this chunk's step can be taken into a spare set as its gradient arrives: a host master stepped by
        zerogpt's fused op with Adam state, apart from its param shard (whose storage the commit would swap)."""
        return (self.steps_on_host and self.home == "host" and not self.master_is_param_shard
                and self.optimizer.fuses_copies and load_host_adam()[0] is not None
                and all(isinstance(self.state.get(k), torch.Tensor) for k in ("exp_avg", "exp_avg_sq"))
                and "max_exp_avg_sq" not in self.state)

    def speculate(self, group: dict, grad_scale: float, grad: torch.Tensor,
                  spare: tuple[torch.Tensor, torch.Tensor, torch.Tensor], out: torch.Tensor | None) -> bool:
        """This chunk's step with `grad` unscaled by `grad_scale` alone (no clip, no non-finite check), written into
        `spare` (master, exp_avg, exp_avg_sq) and the compute copy, the state left as it is. `commit(spare)` makes it
        the step taken: the bits `step()` with that factor would leave. Returns whether it wrote the compute copy."""
        self.optimizer.param_groups[0].maps[-1] = group
        grad = self._as_master_grad(grad, host_step=True)
        out = out if out is not None else self._host_compute_copy()
        self.master.grad = grad
        try:
            self.optimizer.step_into(self.master, spare, grad_scale, out)
        finally:
            self.master.grad = None
        return out is not None

    def _as_master_grad(self, grad: torch.Tensor, host_step: bool) -> torch.Tensor:
        """A gradient kept as it crossed (zero/grad_path.py, GradPath.keeps_as_crossed) in another dtype than the
        master: CPUAdam's host step reads it as it is, on the fp32 master; any other step gets an fp32 copy (one
        chunk's temporary, for the step alone)."""
        if grad.dtype == self.master.dtype:
            return grad
        if host_step and grad.dtype in HOST_ADAM_DTYPES and _grad_dtype_settable():
            self.master.grad_dtype = None
            return grad
        return grad.to(self.master.dtype)

    def commit(self, spare: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """The speculative step into `spare` stands: master and moments take its storage, `spare` theirs."""
        self.optimizer.commit_into(self.master, spare)

    def _host_compute_copy(self) -> torch.Tensor | None:
        """The param shard, when the host step may write the new master straight into it (it is host memory)."""
        shard = self.chunk.shard
        return None if self.master_is_param_shard or shard.device.type != "cpu" else shard

    def write_back(self) -> None:
        """Cast the updated master into its param shard (compute dtype, the shard's home)."""
        if not self.master_is_param_shard:
            self.chunk.shard.copy_(self.master, non_blocking=True)


def _fused_step(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor | None,
                grad_scale: torch.Tensor | None) -> None:
    """One step of a torch fused optimizer, on the device: it changes nothing where `found_inf` is 1.0, and
    divides each gradient by `grad_scale` as it reads it.

    torch's fused kernels take both only as GradScaler hands them over: attributes `found_inf` and `grad_scale`
    on the optimizer, read by its step() (torch/optim/adam.py, sgd.py, adagrad.py) and deleted after it, as
    torch.amp.GradScaler.step does. No other public path reaches the kernel's; the attributes live for this one
    call and nowhere else in zerogpt.
    """
    given = {k: v for k, v in dict(found_inf=found_inf, grad_scale=grad_scale).items() if v is not None}
    for name, value in given.items():
        setattr(optimizer, name, value)
    try:
        optimizer.step()
    finally:
        for name in given:
            delattr(optimizer, name)


def _grad_dtype_settable() -> bool:
    """Whether this torch lets a gradient's dtype differ from its tensor's (`Tensor.grad_dtype`, torch 2.10+)."""
    return hasattr(torch.Tensor, "grad_dtype")


def slot_ranges(chunk: Chunk, excluded: set[str]) -> list[tuple[int, int]] | None:
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
