"""The config schema: one dataclass per section; its fields are the valid keys, their types and defaults.

Key checking, "did you mean" suggestions and type checks are derived from `dataclasses.fields()` here, so a
new field is a new key everywhere (files, `--set`, rendering) with no second table to update. Value ranges
and cross-field rules live in each dataclass's `__post_init__`. Loading files is `load.py`'s job.
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Iterable, Literal

from zerogpt.config.dtypes import Precision, StateDtype
from zerogpt.config.strategy import BucketTensorShardStrategy, ShardStrategy

OPTIMIZER_NAMES = ("AdamW", "Adam", "SGD", "HybridAdam", "CPUAdam")
"""Optimizer names a config may give as a string (torch.optim or zerogpt.optim classes)."""


# ----------------------------------------------------------------------------------------------------------
# Checks derived from annotations.

def suggest(word: str, candidates: Iterable[str], quote: bool = False) -> str:
    """'; did you mean X?' for the closest candidate (case-insensitive), or ''."""
    lower = {c.lower(): c for c in candidates}
    match = difflib.get_close_matches(word.lower(), list(lower), n=1, cutoff=0.6)
    if not match:
        return ""
    return f"; did you mean {lower[match[0]]!r}?" if quote else f"; did you mean '{lower[match[0]]}'?"


def _options(hint: Any) -> list[Any]:
    """The alternatives of a `X | Y` annotation (one element for a plain type)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return list(typing.get_args(hint))
    return [hint]


def section_types(hint: Any) -> tuple[type, ...]:
    """The dataclasses a `dict(...)` value of this annotation is checked against (empty: not a section)."""
    return tuple(h for h in _options(hint) if dataclasses.is_dataclass(h))


def _matches(value: Any, kind: Any) -> bool:
    if kind is Any or kind is object:
        return True
    if kind is None or kind is type(None):
        return value is None
    if isinstance(value, bool):
        return kind is bool
    if kind is float and isinstance(value, int):  # an int is a fine float (lr=1, min_scale=1)
        return True
    return isinstance(kind, type) and isinstance(value, kind)


def check_value(path: str, value: Any, hint: Any) -> None:
    """Check one value against its field annotation (types, `X | None`, `Literal[...]` choices, classes).

    Raises TypeError for a value of the wrong type, ValueError for a value outside a Literal's choices.
    """
    options = _options(hint)
    choices = [c for h in options if typing.get_origin(h) is Literal for c in typing.get_args(h)]
    plain = [h for h in options if typing.get_origin(h) is not Literal]
    if any(_matches(value, h) for h in plain):
        return
    if any(type(value) is type(c) and value == c for c in choices):
        return
    if choices and any(type(value) is type(c) for c in choices):
        shown = ", ".join(map(repr, choices))
        raise ValueError(f"{path} must be one of {shown}, got {value!r}"
                         f"{suggest(str(value), map(str, choices), quote=True)}")
    names = [("None" if h in (None, type(None)) else getattr(h, "__name__", str(h))) for h in plain]
    names += sorted({type(c).__name__ for c in choices})
    raise TypeError(f"{path} must be {' | '.join(names)}, got {value!r} ({type(value).__name__})")


def check_fields(obj: Any, section: str) -> None:
    """Check every non-section field of a dataclass instance against its annotation."""
    hints = typing.get_type_hints(type(obj))
    for f in fields(obj):
        if not section_types(hints[f.name]):
            check_value(f"{section}.{f.name}" if section else f.name, getattr(obj, f.name), hints[f.name])


def field_hints(classes: tuple[type, ...]) -> dict[str, Any]:
    """Key -> annotation over the fields of one or more dataclasses (a section may accept two forms)."""
    out: dict[str, Any] = {}
    for cls in classes:
        hints = typing.get_type_hints(cls)
        out.update({f.name: hints[f.name] for f in fields(cls)})
    return out


def all_paths(classes: tuple[type, ...], prefix: str = "") -> list[str]:
    """Every dotted key path under these dataclasses, for suggestions."""
    out = []
    for key, hint in field_hints(classes).items():
        out.append(prefix + key)
        if section_types(hint):
            out += all_paths(section_types(hint), prefix + key + ".")
    return out


def check_tree(node: dict, classes: tuple[type, ...], prefix: str, unknown: Callable[[str, list[str]], None],
               where: Callable[[str], str]) -> None:
    """Check the keys and value types of a raw `dict(...)` tree against the dataclasses of its section.

    Args:
        unknown: called with (path, valid keys of the section) for a key no dataclass declares; it raises.
        where: path -> where the value was set (the file, or the `--set` that set it), for messages.
    """
    hints = field_hints(classes)
    for key, value in node.items():
        path = prefix + key
        if key not in hints:
            unknown(path, list(hints))
        sections = section_types(hints[key])
        if sections:
            if not isinstance(value, dict):
                raise TypeError(f"{path} must be a dict(...), got {value!r} (in {where(path)})")
            check_tree(value, sections, path + ".", unknown, where)
            continue
        try:
            check_value(path, value, hints[key])
        except (TypeError, ValueError) as e:
            raise type(e)(f"{e} (in {where(path)})") from None


def optimizer_class(kind: Any) -> type:
    """The optimizer class named by `optimizer.type` (a class, or one of OPTIMIZER_NAMES)."""
    import torch

    if isinstance(kind, type) and issubclass(kind, torch.optim.Optimizer):
        return kind
    if isinstance(kind, str) and kind in OPTIMIZER_NAMES:
        import zerogpt.optim as zoptim

        return getattr(torch.optim, kind, None) or getattr(zoptim, kind)
    if isinstance(kind, str):
        raise ValueError(f"optimizer.type {kind!r} is not one of {', '.join(OPTIMIZER_NAMES)}"
                         f"{suggest(kind, OPTIMIZER_NAMES, quote=True)} Or pass the class itself, "
                         f"e.g. type=torch.optim.AdamW")
    raise TypeError(f"optimizer.type must be an optimizer class or one of {', '.join(OPTIMIZER_NAMES)}, "
                    f"got {kind!r}")


# ----------------------------------------------------------------------------------------------------------
# Typed sections: what library code receives. Each field's docstring gives its meaning and unit.

@dataclass
class OffloadConfig:
    """Where a kind of model state rests between uses (`zero.offload_optimizer` / `zero.offload_param`)."""

    device: Literal["none", "cpu", "disk"] = "none"
    """"none" (stay on the compute device), "cpu" (pinned host RAM) or "disk" (optimizer state only)."""
    path: str | None = None
    """Directory for memory-mapped state files; required when device == "disk"."""
    pin_memory: bool = True
    """Pin host buffers so H2D/D2H copies are asynchronous (ignored on CPU-only runs)."""

    def __post_init__(self) -> None:
        check_fields(self, "zero.offload")


@dataclass
class OptimizerOffloadConfig(OffloadConfig):
    """`zero.offload_optimizer`: OffloadConfig, plus the dtype of Adam's moments at their home."""

    state_dtype: StateDtype = "fp32"
    """Adam's exp_avg and exp_avg_sq: "fp32", or "bf16" (host/disk homes with CPUAdam/HybridAdam: 4 bytes/param
    instead of 8, stochastically rounded so that small updates of v are not lost; the master stays fp32)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.state_dtype not in typing.get_args(StateDtype):
            raise ValueError(f"zero.offload_optimizer.state_dtype must be one of {typing.get_args(StateDtype)}, got "
                             f"{self.state_dtype!r}")


@dataclass
class ParamOffloadConfig(OffloadConfig):
    """`zero.offload_param`: OffloadConfig, plus how many parameter shards stay on the device anyway."""

    device_budget: int | Literal["auto"] = 0
    """Bytes of device memory for parameter shards kept on the device across micro-steps (whole chunks, in
    order, compute dtype): those chunks are not streamed from the host at every gather, only written once per
    step. 0 = stream every chunk; "auto" = half the device memory free at build (CUDA; on a CPU-only run host
    and device are one memory, so every chunk)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.device_budget, str) and self.device_budget < 0:
            raise ValueError(f"zero.offload_param.device_budget must be bytes >= 0 or 'auto', got "
                             f"{self.device_budget!r}")


@dataclass
class LossScaleConfig:
    """Dynamic loss scaling for fp16 (ignored for fp32/bf16)."""

    initial_scale: float = 2.0**16
    """Scale applied to the loss at step 0."""
    growth_factor: float = 2.0
    """Multiply the scale by this after `growth_interval` overflow-free steps."""
    backoff_factor: float = 0.5
    """Multiply the scale by this on overflow (after `hysteresis` overflows)."""
    growth_interval: int = 1000
    """Overflow-free optimizer steps before the scale grows."""
    hysteresis: int = 2
    """Overflows tolerated before the scale backs off."""
    min_scale: float = 1.0
    """Lower bound of the scale."""
    max_scale: float = 2.0**32
    """Upper bound of the scale."""

    def __post_init__(self) -> None:
        check_fields(self, "zero.loss_scale")
        if not 0 < self.min_scale <= self.initial_scale <= self.max_scale:
            raise ValueError(
                f"loss scale needs 0 < min_scale <= initial_scale <= max_scale, got min_scale={self.min_scale}, "
                f"initial_scale={self.initial_scale}, max_scale={self.max_scale}")
        if not self.growth_factor > 1.0:
            raise ValueError(f"zero.loss_scale.growth_factor must be > 1, got {self.growth_factor}")
        if not 0.0 < self.backoff_factor < 1.0:
            raise ValueError(f"zero.loss_scale.backoff_factor must be in (0, 1), got {self.backoff_factor}")
        if self.growth_interval < 1 or self.hysteresis < 1:
            raise ValueError(f"zero.loss_scale.growth_interval and hysteresis must be >= 1, got "
                             f"{self.growth_interval} and {self.hysteresis}")


@dataclass
class ZeroConfig:
    """How model state is sharded across ranks and where it rests (DESIGN §2): the `zero = dict(...)` keys."""

    stage: Literal[0, 1, 2, 3] = 0
    """0: replicate everything (DDP); 1: shard optimizer state; 2: + gradients; 3: + parameters."""
    shard_strategy: ShardStrategy = field(default_factory=BucketTensorShardStrategy)
    """How parameters are grouped into chunks (config/strategy.py): TensorShardStrategy() or
    BucketTensorShardStrategy(bucket_mb=25)."""
    offload_optimizer: OptimizerOffloadConfig = field(default_factory=OptimizerOffloadConfig)
    """Where fp32 master + Adam state rest: "none" | "cpu" | "disk", and the moments' dtype."""
    offload_param: ParamOffloadConfig = field(default_factory=ParamOffloadConfig)
    """Where parameter shards rest between uses: "none" | "cpu" (stage 3 only); `device_budget` keeps some on the
    device."""
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    """fp16 dynamic loss scaling."""
    prefetch: int = 2
    """Stage 3: how far ahead of the running module to gather, in the recorded order (0 = no prefetch): chunks
    in eager runs; whole hooked modules (blocks, embeddings, ln_f, head) with `compile = True`, which gathers each
    block whole."""

    def __post_init__(self) -> None:
        check_fields(self, "zero")
        if self.offload_optimizer.device == "disk" and not self.offload_optimizer.path:
            raise ValueError("zero.offload_optimizer.device='disk' needs a directory for the state files; "
                             "pass --set zero.offload_optimizer.path=/fast/nvme/dir")
        if self.offload_optimizer.state_dtype == "bf16" and self.offload_optimizer.device == "none":
            raise ValueError("zero.offload_optimizer.state_dtype='bf16' is for optimizer state on the host or disk "
                             "(the fused host Adam step keeps it); set zero.offload_optimizer.device='cpu' or 'disk'")
        if self.offload_param.device not in ("none", "cpu"):
            raise ValueError(f"zero.offload_param.device must be 'none' or 'cpu', got {self.offload_param.device!r}")
        if self.offload_param.device != "none" and self.stage != 3:
            raise ValueError(f"offload_param needs zero.stage=3, got {self.stage}; pass --set zero.stage=3 "
                             f"(or drop the parameter offload: zero.offload_param / "
                             f"zero.model_config.offload_config / tensor_placement_policy)")
        if self.prefetch < 0:
            raise ValueError(f"zero.prefetch must be an int >= 0, got {self.prefetch!r}")


@dataclass
class HostConfig:
    """Process-wide host settings: `initialize()` applies them and `engine.describe()` prints them.

    Each has an environment variable that overrides the key when set (ZEROGPT_KEEP_HOST_MEMORY,
    ZEROGPT_SHM_COMM: 0 or 1; ZEROGPT_CPU_ADAM: a kernel name; ZEROGPT_HOST_STEP_THREADS: a count), for runs
    launched by scripts one cannot edit.
    """

    keep_freed_memory: bool = True
    """glibc malloc keeps freed memory, so steps reuse pages instead of faulting them in (zerogpt/host_memory.py)."""
    shm_collectives: bool = True
    """Ranks on one host exchange CPU tensors through /dev/shm instead of gloo's sockets (zerogpt/zero/shm.py)."""
    cpu_adam: Literal["auto", "deepspeed", "torch"] = "auto"
    """CPUAdam/HybridAdam host kernel: "auto" (DeepSpeed's op if it builds) | "deepspeed" | "torch"."""
    step_threads: int | None = None
    """Threads of the host step where it runs beside forward and backward (a GPU run's offloaded optimizer,
    zerogpt/zero/host_step.py); None: this rank's torch threads, every core it has. Fewer leave cores to the
    training thread, which launches the GPU's work (DeepSpeed's SuperOffload steps on 80% of them)."""

    def __post_init__(self) -> None:
        check_fields(self, "host")
        if self.step_threads is not None and self.step_threads < 1:
            raise ValueError(f"host.step_threads={self.step_threads}: expected a count of threads >= 1, or None "
                             f"(every core of the rank)")

    def with_env_overrides(self, environ: Any = None) -> "HostConfig":
        """These settings with the environment's overrides applied."""
        import os

        env = os.environ if environ is None else environ

        def flag(name: str, value: bool) -> bool:
            raw = env.get(name)
            if raw is None or raw == "":
                return value
            if raw not in ("0", "1"):
                raise ValueError(f"${name}={raw!r}: expected 0 or 1 (it overrides a host.* config key)")
            return raw == "1"

        kernel = env.get("ZEROGPT_CPU_ADAM") or self.cpu_adam
        kernel = {"fused": "torch", "torch-fused": "torch"}.get(kernel.lower(), kernel.lower())
        if kernel not in ("auto", "deepspeed", "torch"):
            raise ValueError(f"$ZEROGPT_CPU_ADAM={kernel!r} is not a CPU Adam kernel; valid: auto, deepspeed, torch")
        threads = env.get("ZEROGPT_HOST_STEP_THREADS") or None
        if threads is not None and not (threads.isdigit() and int(threads) >= 1):
            raise ValueError(f"$ZEROGPT_HOST_STEP_THREADS={threads!r}: expected a count of threads >= 1 (it overrides "
                             f"host.step_threads)")
        return HostConfig(keep_freed_memory=flag("ZEROGPT_KEEP_HOST_MEMORY", self.keep_freed_memory),
                          shm_collectives=flag("ZEROGPT_SHM_COMM", self.shm_collectives), cpu_adam=kernel,
                          step_threads=self.step_threads if threads is None else int(threads))


@dataclass
class TensorParallelConfig:
    """`parallel.tensor`: Megatron-style tensor parallelism (zerogpt.parallel.tensor)."""

    size: int = 1
    """Ranks that split each layer's matmuls (heads, MLP width and vocabulary are divided by it)."""
    mode: Literal["1d"] = "1d"
    """Megatron's 1-D layout (Colossal-AI's name for it); the only mode."""
    sequence_parallel: bool = False
    """Also split LayerNorm and dropout activations along the sequence (Megatron's sequence parallelism)."""

    def __post_init__(self) -> None:
        check_fields(self, "parallel.tensor")
        if self.size < 1:
            raise ValueError(f"parallel.tensor.size must be >= 1, got {self.size}")


@dataclass
class ParallelConfig:
    """`parallel = dict(tensor=dict(size=T), pipeline=P)`: model parallelism around ZeRO's data parallelism.

    The data-parallel size is world / (T * P); ZeRO shards over the data-parallel ranks (zerogpt.parallel.mesh).
    """

    tensor: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    pipeline: int = 1
    """Pipeline stages: contiguous blocks of layers, embedding on the first, head on the last (1F1B schedule)."""

    def __post_init__(self) -> None:
        check_fields(self, "parallel")
        if self.pipeline < 1:
            raise ValueError(f"parallel.pipeline must be >= 1, got {self.pipeline}")


FP8_NEEDS_COMPILE = ("precision='fp8' runs only compiled (eager, its float8 casts cost more than its matmuls save); "
                     "set compile=True (--set compile=true) or precision='bf16'")
"""The refusal of precision='fp8' with compile=False: eager FP8 ran at 15.6% MFU against bf16's 42.7% (H200,
GPT-2 XL, bench/results/gpu_h200_2026-11-28_compute.json); torchtitan likewise requires compile for float8."""


@dataclass
class EngineKeys:
    """The top-level config keys the engine takes as written, declared once: RunConfig (a file's keys, load.py)
    and EngineConfig (the engine's view) both inherit them."""

    precision: Precision = "fp32"
    """Compute dtype of params/activations: "fp32", "bf16" (fp32 master) or "fp16" (fp32 master + loss scale).
    "fp8": Linear layers compute in float8 via torchao's float8 training (CUDA sm89+, `pip install
    'zerogpt[fp8]'`; the LM head and layers too small to gain stay bf16, zerogpt/fp8.py), everything else bf16,
    fp32 master weights, ZeRO all-gathers bf16. Needs compile=True (refused otherwise: eager float8 is slower)."""
    compile: bool = False
    """Compile each transformer block with torch.compile (zerogpt/compile.py; every stage, stage 3 gathering each
    block's parameters as a whole; with pipeline and tensor parallelism too). Off by default: not yet measured
    faster on a GPU."""
    clip_grad_norm: float | None = None
    """Global L2 grad-norm clip; None = off (a file's 0 is off too: engine_config passes it on as None)."""
    host: HostConfig = field(default_factory=HostConfig)
    """Process-wide host settings (malloc, shared-memory collectives, CPU Adam kernel); environment variables
    override them (HostConfig.with_env_overrides)."""


@dataclass
class EngineConfig(EngineKeys):
    """Everything `zerogpt.initialize` needs from the config, resolved for one world size."""

    zero: ZeroConfig = field(default_factory=ZeroConfig)
    gradient_accumulation: int = 1
    """Micro-batches per optimizer step."""

    def __post_init__(self) -> None:
        check_fields(self, "")
        if self.gradient_accumulation < 1:
            raise ValueError(f"GRADIENT_ACCUMULATION must be >= 1, got {self.gradient_accumulation}")
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise ValueError(f"clip_grad_norm must be > 0 or None (off), got {self.clip_grad_norm!r}")
        if self.precision == "fp8" and not self.compile:
            raise ValueError(FP8_NEEDS_COMPILE)


@dataclass
class WandbConfig:
    """`train.wandb = dict(project=...)`: the run's scalars and config in Weights & Biases, from rank 0
    (zerogpt/trainer/hooks/wandb.py; needs `pip install 'zerogpt[wandb]'`)."""

    project: str = "zerogpt"
    """W&B project of the run."""
    name: str | None = None
    """Run name shown in W&B; None = the basename of train.output_dir."""
    entity: str | None = None
    """W&B team or user; None = your default entity."""
    group: str | None = None
    """Run group (runs of one experiment); None = none."""
    tags: list | tuple = ()
    """Tags of the run (strings)."""
    mode: Literal["online", "offline", "disabled"] = "online"
    """"online" (stream to the server), "offline" (write <output_dir>/wandb/ for a later `wandb sync`) or
    "disabled" (log nothing)."""

    def __post_init__(self) -> None:
        check_fields(self, "train.wandb")


@dataclass
class TrainConfig:
    """The `train = dict(...)` section: loop length, logging, eval and checkpoint cadence."""

    max_steps: int | None = None
    """Optimizer steps to run; None = run NUM_EPOCHS over the data."""
    log_interval: int = 10
    """Optimizer steps between log lines (the only steps that read numbers back from the device)."""
    eval_interval: int | None = None
    """Optimizer steps between evaluations; None = only at the end (if there is eval data)."""
    eval_iters: int = 10
    """Global batches per evaluation (each rank reads eval_iters x accumulation micro-batches)."""
    save_interval: int | None = None
    """Optimizer steps between checkpoints; None = only at the end."""
    keep_last: int = 3
    """Checkpoints kept on disk (older ones are deleted)."""
    save_on_interrupt: bool = True
    """On SIGINT/SIGTERM (Ctrl-C) every rank stops after its current step; True saves that step's checkpoint."""
    output_dir: str = "runs/default"
    """Run directory: config.py, metrics.jsonl, tensorboard/, checkpoints/."""
    seed: int = 42
    """Seed for python/numpy/torch RNGs (launch_from_torch)."""
    cpu_threads: int | None = None
    """Torch threads per rank on CPU; None = OMP_NUM_THREADS if set, else the cores available / ranks on this host."""
    wandb: WandbConfig | None = None
    """Log to Weights & Biases too (WandbConfig); None = not at all."""

    def __post_init__(self) -> None:
        if isinstance(self.wandb, dict):
            self.wandb = WandbConfig(**self.wandb)
        check_fields(self, "train")
        for name in ("max_steps", "log_interval", "eval_interval", "eval_iters", "save_interval", "keep_last",
                     "cpu_threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"train.{name} must be >= 1, got {value}")


@dataclass
class LRSchedulerConfig:
    """The `lr_scheduler = dict(...)` section: linear warmup, then decay to `min_lr`."""

    type: Literal["cosine", "linear", "constant"] = "constant"
    """"cosine", "linear" or "constant" (after warmup)."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to the optimizer's lr."""
    min_lr: float = 0.0
    """LR reached at the end of the decay."""
    total_steps: int | None = None
    """Length of the schedule in optimizer steps; None = the run's total steps."""

    def __post_init__(self) -> None:
        check_fields(self, "lr_scheduler")
        if self.warmup_steps < 0 or self.min_lr < 0:
            raise ValueError(f"lr_scheduler.warmup_steps and min_lr must be >= 0, got {self.warmup_steps}, "
                             f"{self.min_lr}")
        if self.total_steps is not None and self.total_steps < 1:
            raise ValueError(f"lr_scheduler.total_steps must be >= 1 or None, got {self.total_steps}")


@dataclass
class DataConfig:
    """The `data = dict(...)` section: where tokens come from."""

    path: str | None = None
    """Prefix of a tokenized .bin/.idx dataset (data_pipeline tokenize); None needs mock=True."""
    tokenizer: str | None = None
    """Tokenizer directory or file (data_pipeline train-tokenizer)."""
    split: str = "969,30,1"
    """train,valid,test weights of the document split."""
    mock: bool = False
    """Random tokens instead of a dataset (smoke tests, benchmarks)."""
    vocab_size: int | None = None
    """Vocabulary size for mock data / the model; None = from the tokenizer."""
    num_workers: int = 0
    """DataLoader worker processes."""
    seed: int | None = None
    """Shuffle seed; None = train.seed."""

    def __post_init__(self) -> None:
        check_fields(self, "data")
        try:
            weights = [float(p) for p in self.split.split(",")]
        except ValueError:
            weights = []
        if len(weights) != 3 or min(weights) < 0 or sum(weights) <= 0:
            raise ValueError(f"data.split must be three comma-separated weights 'train,valid,test' such as "
                             f"'969,30,1', got {self.split!r}")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"data.vocab_size must be >= 1, got {self.vocab_size}")
        if self.num_workers < 0:
            raise ValueError(f"data.num_workers must be >= 0, got {self.num_workers}")
