"""What plan="auto" decides and what it decides from: a `Plan` (the memory keys of one run), the `Workload` the
user asked for (model shape, tokens per step, world, precision, the keys they fixed) and the `Machine` it runs on
(device, host RAM and disk capacities). Plain data, no torch: the planner's pure part reads only these.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from zerogpt.memory_model import ModelShape

__all__ = ["Plan", "Workload", "Machine", "PlanError", "CONFIG_KEYS", "GIB"]

GIB = 2**30


class PlanError(ValueError):
    """plan="auto" cannot proceed: bad input, a fixed key that leaves nothing, or nothing fits (one line)."""


CONFIG_KEYS = {
    "stage": "zero.stage",
    "offload_optimizer": "zero.offload_optimizer.device",
    "state_dtype": "zero.offload_optimizer.state_dtype",
    "offload_param": "zero.offload_param.device",
    "device_budget": "zero.offload_param.device_budget",
    "prefetch": "zero.prefetch",
    "bucket_mb": "zero.shard_strategy",
    "micro_batch": "BATCH_SIZE",
    "accumulation": "GRADIENT_ACCUMULATION",
    "checkpoint": "model.checkpoint",
    "chunked_loss": "model.chunked_loss",
}
"""Each Plan field -> the config key that sets it (what a fixed key is called in messages)."""


@dataclass(frozen=True)
class Plan:
    """One complete set of the memory decisions of a run, per data-parallel rank."""

    stage: int
    offload_optimizer: str  # "none" | "cpu" | "disk"
    offload_param: str  # "none" | "cpu"
    state_dtype: str  # Adam's moments: "fp32" | "bf16" (offloaded only)
    micro_batch: int  # sequences per micro-batch per rank (BATCH_SIZE)
    accumulation: int  # micro-batches per optimizer step
    checkpoint: bool  # activation checkpointing per block
    chunked_loss: bool  # the loss a chunk of tokens at a time
    bucket_mb: float = 25.0  # chunk size (BucketTensorShardStrategy)
    prefetch: int = 2  # stage 3: chunks gathered ahead
    device_budget: int = 0  # param offload: bytes of param shards kept on the device

    def describe(self) -> str:
        """The plan in one short line, the table's first column."""
        off = "" if self.offload_optimizer == "none" else f" opt->{self.offload_optimizer}({self.state_dtype})"
        par = ""
        if self.offload_param != "none":
            par = " param->cpu" + (f"(keep {self.device_budget / GIB:.1f}G)" if self.device_budget else "")
        flags = "".join(f" {name}" for name, on in (("ckpt", self.checkpoint), ("chunked-loss", self.chunked_loss))
                        if on)
        return (f"z{self.stage}{off}{par} {self.micro_batch}x{self.accumulation}{flags} "
                f"bucket {self.bucket_mb:g}MB" + (f" prefetch {self.prefetch}" if self.stage == 3 else ""))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Workload:
    """What the user asked for: the model, the tokens per optimizer step over all ranks, how they run it.

    `fixed`: Plan field -> value the config set (kept as is; the rest is chosen around it).
    `disk_path`: where disk offload would write (zero.offload_optimizer.path); None = disk offload not offered.
    `host_adam`: the optimizer steps on the host with our fused kernel (CPUAdam/HybridAdam): bf16 moments allowed.
    `can_checkpoint`: the model takes checkpoint / chunked_loss keywords (model_zoo's families).
    """

    shape: ModelShape
    seq_len: int
    tokens_per_step: int
    world: int = 1
    precision: str = "bf16"
    fixed: dict = field(default_factory=dict)
    disk_path: str | None = None
    host_adam: bool = True
    can_checkpoint: bool = True
    compile: bool = False
    loss_chunk: int = 256

    def __hash__(self) -> int:  # fixed is a dict: hash what identifies the search
        return hash((self.shape, self.seq_len, self.tokens_per_step, self.world, self.precision,
                     tuple(sorted(self.fixed.items())), self.disk_path, self.host_adam, self.can_checkpoint,
                     self.compile, self.loss_chunk))

    @property
    def samples_per_rank(self) -> int:
        """Sequences each rank runs per optimizer step (micro_batch x accumulation)."""
        return self.tokens_per_step // (self.world * self.seq_len)

    def check(self) -> None:
        """Refuse (PlanError, one line) a tokens per step the world and sequence cannot split, and a fixed
        micro-batch or accumulation that does not split a rank's sequences (the plan would miss the target)."""
        per = self.world * self.seq_len
        if self.tokens_per_step < per or self.tokens_per_step % per:
            below = max(per, self.tokens_per_step // per * per)
            raise PlanError(f"tokens per step {self.tokens_per_step:,} is not a multiple of world {self.world} x "
                            f"SEQ_LEN {self.seq_len} = {per:,}; use {below:,} or {below + per:,}")
        samples = self.samples_per_rank  # a fixed micro-batch or accumulation must split them exactly
        split = [(k, self.fixed[k]) for k in ("micro_batch", "accumulation") if k in self.fixed]
        product = math.prod(v for _, v in split)
        if split and (samples % product or (len(split) == 2 and product != samples)):
            keys = " x ".join(f"{CONFIG_KEYS[k]}={v}" for k, v in split)
            raise PlanError(f"{keys} (fixed in the config) does not split the {samples} sequences per rank of "
                            f"tokens per step {self.tokens_per_step:,} (world {self.world} x SEQ_LEN "
                            f"{self.seq_len}); use a divisor of {samples}: "
                            f"{', '.join(str(d) for d in range(1, samples + 1) if samples % d == 0)}")


@dataclass(frozen=True)
class Machine:
    """The capacities a plan must fit, per rank for the device and per host for RAM and disk.

    `on_gpu`: False on a CPU run, whose "device" is host RAM too (its device capacity is then simulated:
    ZEROGPT_DEVICE_MEM or a device_budget) and whose host need counts both homes.
    `margin`: the fraction of each capacity left free (allocator fragmentation, the OS, the data loader).
    """

    device_bytes: int
    host_bytes: int
    disk_bytes: int | None = None
    local_ranks: int = 1
    on_gpu: bool = True
    name: str = "unknown"
    margin: float = 0.1
    gpu_overhead: int = 2**30  # CUDA context and workspaces (0 on CPU)

    def describe(self) -> str:
        disk = "" if self.disk_bytes is None else f", disk {_gib(self.disk_bytes)} free"
        kind = "device" if self.on_gpu else "device (simulated)"
        return (f"{self.name}: {kind} {_gib(self.device_bytes)} per rank, host RAM "
                f"{_gib(self.host_bytes)} for {self.local_ranks} rank(s){disk}")


UNBOUNDED = 2**62
"""A capacity nobody gave (estimate without --host-mem): no limit, said as such."""


def _gib(nbytes: int) -> str:
    return "unbounded" if nbytes >= UNBOUNDED else f"{nbytes / GIB:.1f} GiB"
