"""The one config schema: load a Python config file into a validated `Config`, apply `--set` overrides.

`Config` is the raw tree (a dict with attribute access) exactly as the user wrote it; library code never
reads it directly but asks for the typed section it needs (`engine_config`, `train_config`,
`lr_scheduler_config`, `data_config`), which fill in defaults and check values. This module knows
nothing about models, data or the engine beyond the shape of their config sections.
"""
from __future__ import annotations

import ast
import difflib
import inspect
import math
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable

from zerogpt.zero.strategy import BucketTensorShardStrategy, ShardStrategy

__all__ = [
    "Config", "OffloadConfig", "LossScaleConfig", "ZeroConfig", "HostConfig", "EngineConfig", "TrainConfig",
    "LRSchedulerConfig", "DataConfig", "engine_config", "train_config", "lr_scheduler_config", "data_config",
]


# ----------------------------------------------------------------------------------------------------------
# Typed sections: what library code receives. Each field's comment gives its meaning and unit.

@dataclass
class OffloadConfig:
    """Where a kind of model state rests between uses (`zero.offload_optimizer` / `zero.offload_param`)."""

    device: str = "none"
    """"none" (stay on the compute device), "cpu" (pinned host RAM) or "disk" (optimizer state only)."""
    path: str | None = None
    """Directory for memory-mapped state files; required when device == "disk"."""
    pin_memory: bool = True
    """Pin host buffers so H2D/D2H copies are asynchronous (ignored on CPU-only runs)."""

    def __post_init__(self) -> None:
        _check_types(self, "zero.offload")


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
        _check_types(self, "zero.loss_scale")
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
    """How model state is sharded across ranks and where it rests (DESIGN §2)."""

    stage: int = 0
    """0: replicate everything (DDP); 1: shard optimizer state; 2: + gradients; 3: + parameters."""
    shard_strategy: ShardStrategy = field(default_factory=BucketTensorShardStrategy)
    """How parameters are grouped into chunks (zerogpt.zero.strategy)."""
    offload_optimizer: OffloadConfig = field(default_factory=OffloadConfig)
    """Where fp32 master + Adam state rest: "none" | "cpu" | "disk"."""
    offload_param: OffloadConfig = field(default_factory=OffloadConfig)
    """Where parameter shards rest between uses: "none" | "cpu" (stage 3 only)."""
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    """fp16 dynamic loss scaling."""
    prefetch: int = 2
    """Stage 3: how many chunks ahead to gather (0 = no prefetch)."""

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3) or isinstance(self.stage, bool):
            raise ValueError(f"zero.stage must be one of 0, 1, 2, 3, got {self.stage!r}")
        if not isinstance(self.shard_strategy, ShardStrategy):
            raise TypeError(f"zero.shard_strategy must be a ShardStrategy instance such as TensorShardStrategy() or "
                            f"BucketTensorShardStrategy(bucket_mb=25), got {self.shard_strategy!r}")
        if self.offload_optimizer.device not in ("none", "cpu", "disk"):
            raise ValueError(f"zero.offload_optimizer.device must be 'none', 'cpu' or 'disk', "
                             f"got {self.offload_optimizer.device!r}")
        if self.offload_optimizer.device == "disk" and not self.offload_optimizer.path:
            raise ValueError("zero.offload_optimizer.device='disk' needs a directory for the state files; "
                             "pass --set zero.offload_optimizer.path=/fast/nvme/dir")
        if self.offload_param.device not in ("none", "cpu"):
            raise ValueError(f"zero.offload_param.device must be 'none' or 'cpu', got {self.offload_param.device!r}")
        if self.offload_param.device != "none" and self.stage != 3:
            raise ValueError(f"offload_param needs zero.stage=3, got {self.stage}; pass --set zero.stage=3 "
                             f"(or drop the parameter offload: zero.offload_param / "
                             f"zero.model_config.offload_config / tensor_placement_policy)")
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"zero.prefetch must be an int >= 0, got {self.prefetch!r}")


@dataclass
class HostConfig:
    """Process-wide host settings: `initialize()` applies them and `engine.describe()` prints them.

    Each has an environment variable that overrides the key when set (ZEROGPT_KEEP_HOST_MEMORY,
    ZEROGPT_SHM_COMM: 0 or 1; ZEROGPT_CPU_ADAM: a kernel name), for runs launched by scripts one cannot edit.
    """

    keep_freed_memory: bool = True
    """glibc malloc keeps freed memory, so steps reuse pages instead of faulting them in (zerogpt/host_memory.py)."""
    shm_collectives: bool = True
    """Ranks on one host exchange CPU tensors through /dev/shm instead of gloo's sockets (zerogpt/zero/shm.py)."""
    cpu_adam: str = "auto"
    """CPUAdam/HybridAdam host kernel: "auto" (DeepSpeed's op if it builds) | "deepspeed" | "torch"."""

    def __post_init__(self) -> None:
        if self.cpu_adam not in ("auto", "deepspeed", "torch"):
            raise ValueError(f"host.cpu_adam must be 'auto', 'deepspeed' or 'torch', got {self.cpu_adam!r}")

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
        return HostConfig(keep_freed_memory=flag("ZEROGPT_KEEP_HOST_MEMORY", self.keep_freed_memory),
                          shm_collectives=flag("ZEROGPT_SHM_COMM", self.shm_collectives), cpu_adam=kernel)


@dataclass
class EngineConfig:
    """Everything `zerogpt.initialize` needs from the config, resolved for one world size."""

    zero: ZeroConfig = field(default_factory=ZeroConfig)
    precision: str = "fp32"
    """Compute dtype of params/activations: "fp32", "bf16" (fp32 master) or "fp16" (fp32 master + loss scale)."""
    gradient_accumulation: int = 1
    """Micro-batches per optimizer step."""
    clip_grad_norm: float | None = None
    """Global L2 grad-norm clip; None = off."""
    host: HostConfig = field(default_factory=HostConfig)
    """Process-wide host settings (malloc, shared-memory collectives, CPU Adam kernel)."""

    def __post_init__(self) -> None:
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"precision must be 'fp32', 'bf16' or 'fp16', got {self.precision!r}")
        if self.gradient_accumulation < 1:
            raise ValueError(f"GRADIENT_ACCUMULATION must be >= 1, got {self.gradient_accumulation}")
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise ValueError(f"clip_grad_norm must be > 0 or None (off), got {self.clip_grad_norm!r}")


@dataclass
class TrainConfig:
    """The `train = dict(...)` section: loop length, logging, eval and checkpoint cadence."""

    max_steps: int | None = None
    """Optimizer steps to run; None = run NUM_EPOCHS over the data."""
    log_interval: int = 10
    """Optimizer steps between log lines."""
    eval_interval: int | None = None
    """Optimizer steps between evaluations; None = only at the end (if there is eval data)."""
    eval_iters: int = 10
    """Global batches per evaluation (each rank reads eval_iters x accumulation micro-batches)."""
    save_interval: int | None = None
    """Optimizer steps between checkpoints; None = only at the end."""
    keep_last: int = 3
    """Checkpoints kept on disk (older ones are deleted)."""
    output_dir: str = "runs/default"
    """Run directory: config.py, metrics.jsonl, tensorboard/, checkpoints/."""
    seed: int = 42
    """Seed for python/numpy/torch RNGs (launch_from_torch)."""

    def __post_init__(self) -> None:
        _check_types(self, "train")
        for name in ("max_steps", "log_interval", "eval_interval", "eval_iters", "save_interval", "keep_last"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"train.{name} must be >= 1, got {value}")


@dataclass
class LRSchedulerConfig:
    """The `lr_scheduler = dict(...)` section: linear warmup, then decay to `min_lr`."""

    type: str = "constant"
    """"cosine", "linear" or "constant" (after warmup)."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to the optimizer's lr."""
    min_lr: float = 0.0
    """LR reached at the end of the decay."""
    total_steps: int | None = None
    """Length of the schedule in optimizer steps; None = the run's total steps."""

    def __post_init__(self) -> None:
        _check_types(self, "lr_scheduler")
        if self.type not in ("cosine", "linear", "constant"):
            raise ValueError(f"lr_scheduler.type must be 'cosine', 'linear' or 'constant', got {self.type!r}"
                             + _suggest(str(self.type), ("cosine", "linear", "constant"), quote=True))
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
        _check_types(self, "data")
        parts = self.split.split(",")
        try:
            weights = [float(p) for p in parts]
        except ValueError:
            weights = []
        if len(weights) != 3 or min(weights) < 0 or sum(weights) <= 0:
            raise ValueError(f"data.split must be three comma-separated weights 'train,valid,test' such as "
                             f"'969,30,1', got {self.split!r}")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"data.vocab_size must be >= 1, got {self.vocab_size}")
        if self.num_workers < 0:
            raise ValueError(f"data.num_workers must be >= 0, got {self.num_workers}")


def _check_types(obj: Any, section: str) -> None:
    """Check each field of a dataclass against its annotation (int, float, str, bool, X | None)."""
    hints = typing.get_type_hints(type(obj))
    for f in fields(obj):
        allowed = _allowed_types(hints[f.name])
        if allowed is None:
            continue
        value = getattr(obj, f.name)
        if not _is_instance(value, allowed):
            names = " | ".join("None" if t is type(None) else t.__name__ for t in allowed)
            raise TypeError(f"{section}.{f.name} must be {names}, got {value!r} ({type(value).__name__})")


def _allowed_types(hint: Any) -> tuple[type, ...] | None:
    if hint in (int, float, str, bool):
        return (hint,)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = typing.get_args(hint)
        if all(a in (int, float, str, bool, type(None)) for a in args):
            return args
    return None


def _is_instance(value: Any, allowed: tuple[type, ...]) -> bool:
    if isinstance(value, bool):
        return bool in allowed
    if isinstance(value, int) and float in allowed:  # an int is a fine float (lr=1, min_scale=1)
        return True
    return isinstance(value, allowed)


# ----------------------------------------------------------------------------------------------------------
# The raw tree and its schema.

class Leaf:
    """Schema of one scalar key: allowed types and (optionally) allowed values."""

    def __init__(self, types_: tuple[type, ...], default: Any = None, choices: tuple | None = None,
                 minimum: float | None = None):
        self.types, self.default, self.choices, self.minimum = types_, default, choices, minimum


class Section:
    """Schema of a dict key: its known sub-keys; `free` sections accept any extra kwargs."""

    def __init__(self, keys: dict[str, Any], free: bool = False):
        self.keys, self.free = keys, free


def _leaves_of(dc: type) -> dict[str, Leaf]:
    hints = typing.get_type_hints(dc)
    return {f.name: Leaf(_allowed_types(hints[f.name]) or (object,)) for f in fields(dc)}


_NUM, _OPT_INT, _OPT_NUM = (int, float), (int, type(None)), (int, float, type(None))
_OFFLOAD_PARAM = Section({"device": Leaf((str,), choices=("none", "cpu")), "pin_memory": Leaf((bool,))})
_SCALE_KEYS = {k: Leaf(v.types) for k, v in _leaves_of(LossScaleConfig).items()}

SCHEMA = Section({
    "BATCH_SIZE": Leaf((int,), 1, minimum=1),
    "GLOBAL_BATCH_SIZE": Leaf(_OPT_INT, None, minimum=1),
    "GRADIENT_ACCUMULATION": Leaf((int,), 1, minimum=1),
    "SEQ_LEN": Leaf((int,), 1024, minimum=1),
    "NUM_EPOCHS": Leaf(_OPT_INT, None, minimum=1),
    "precision": Leaf((str,), "fp32", choices=("fp32", "bf16", "fp16")),
    "clip_grad_norm": Leaf(_OPT_NUM, None, minimum=0),
    "zero": Section({
        "stage": Leaf((int,), choices=(0, 1, 2, 3)),
        "model_config": Section({
            "offload_config": Section({"device": Leaf((str,), choices=("cpu", "cuda", "none"))}),
            "shard_strategy": Leaf((ShardStrategy,)),
            "tensor_placement_policy": Leaf((str,), choices=("cpu", "cuda", "auto")),
            "reuse_fp16_shard": Leaf((bool,)),
            "prefetch": Leaf((int,), minimum=0),
        }),
        "optimizer_config": Section({
            "cpu_offload": Leaf((bool,)),
            **_SCALE_KEYS,
            "gpu_margin_mem_ratio": Leaf(_NUM),
        }),
        "offload_optimizer": Section({"device": Leaf((str,), choices=("none", "cpu", "disk")),
                                      "path": Leaf((str, type(None))), "pin_memory": Leaf((bool,))}),
        "offload_param": _OFFLOAD_PARAM,
        "shard_strategy": Leaf((ShardStrategy,)),
        "loss_scale": Section(dict(_SCALE_KEYS)),
        "prefetch": Leaf((int,), minimum=0),
    }),
    "model": Section({"type": Leaf((object,))}, free=True),
    "optimizer": Section({"type": Leaf((object,))}, free=True),
    "lr_scheduler": Section(_leaves_of(LRSchedulerConfig)),
    "host": Section(_leaves_of(HostConfig)),
    "data": Section(_leaves_of(DataConfig)),
    "train": Section(_leaves_of(TrainConfig)),
    "hooks": Leaf((list, tuple), []),
})

OPTIMIZER_NAMES = ("AdamW", "Adam", "SGD", "HybridAdam", "CPUAdam")

# Keys of other frameworks' configs that people will paste in; the hint says what to write instead.
_FOREIGN_KEYS = {
    "fp16": "use precision='fp16' (or 'bf16')",
    "parallel": "zerogpt has no tensor/pipeline parallelism; data parallelism comes from torchrun --nproc_per_node",
    "gradient_accumulation": "use GRADIENT_ACCUMULATION (upper case)",
    "clip_grad": "use clip_grad_norm",
}


def _all_paths(section: Section, prefix: str = "") -> list[str]:
    out = []
    for key, sub in section.keys.items():
        out.append(prefix + key)
        if isinstance(sub, Section):
            out += _all_paths(sub, prefix + key + ".")
    return out


_ALL_PATHS = _all_paths(SCHEMA)


def _suggest(word: str, candidates: Iterable[str], quote: bool = False) -> str:
    candidates = list(candidates)
    lower = {c.lower(): c for c in candidates}
    match = difflib.get_close_matches(word.lower(), list(lower), n=1, cutoff=0.6)
    if not match:
        return ""
    return f"; did you mean {lower[match[0]]!r}?" if quote else f"; did you mean '{lower[match[0]]}'?"


class Config(dict):
    """A config tree: a dict with attribute access whose nested dicts are Configs.

    Build with `Config.from_file("configs/x.py")` (validated) or `Config({...})` (call `.validate()`;
    the typed builders such as `engine_config(cfg)` validate the section they read either way).
    On the root, a known top-level scalar that the file did not set reads as its schema default
    (`cfg.BATCH_SIZE` -> 1) while `"BATCH_SIZE" in cfg` stays False.

    Example:
        >>> cfg = Config({"zero": {"stage": 2}, "BATCH_SIZE": 4})
        >>> cfg.zero.stage, cfg.SEQ_LEN
        (2, 1024)
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__()
        object.__setattr__(self, "_source", "<dict>")
        object.__setattr__(self, "_overrides", [])
        object.__setattr__(self, "_is_root", True)
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    # --- dict with attribute access -------------------------------------------------------------------
    def __setitem__(self, key: str, value: Any) -> None:
        if isinstance(value, dict) and not isinstance(value, Config):
            value = Config._nested(value)
        elif isinstance(value, Config):
            object.__setattr__(value, "_is_root", False)
        super().__setitem__(key, value)

    @classmethod
    def _nested(cls, d: dict) -> "Config":
        c = cls(d)
        object.__setattr__(c, "_is_root", False)
        return c

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name in self:
            return self[name]
        if self.__dict__.get("_is_root") and isinstance(SCHEMA.keys.get(name), Leaf):
            default = SCHEMA.keys[name].default
            return list(default) if isinstance(default, list) else default
        raise AttributeError(f"config has no key {name!r}{_suggest(name, self.keys())}")

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value

    def __delattr__(self, name: str) -> None:
        try:
            del self[name]
        except KeyError:
            raise AttributeError(name) from None

    def update(self, *args: Any, **kwargs: Any) -> None:  # keep nested dicts as Configs
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def to_dict(self) -> dict:
        """Plain nested dicts (objects such as shard strategies are kept as they are)."""
        return {k: v.to_dict() if isinstance(v, Config) else v for k, v in self.items()}

    # --- loading -----------------------------------------------------------------------------------------
    @classmethod
    def from_file(cls, path: str | Path) -> "Config":
        """Execute a Python config file and return its validated keys.

        Keys are the module-level names that do not start with `_` and are not modules, functions or
        classes (so `from zerogpt.optim import HybridAdam` is not a key, while `type=HybridAdam` inside a
        dict is kept as the class).

        Raises:
            FileNotFoundError: no such file.
            ValueError: a syntax error (file:line), an unknown key (with the closest valid key), a bad value.
            TypeError: a value of the wrong type.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file {str(path)!r} does not exist")
        source = path.read_text()
        try:
            code = compile(source, str(path), "exec")
        except SyntaxError as e:
            line = (e.text or "").rstrip("\n")
            raise ValueError(f"syntax error in config {path}:{e.lineno}: {e.msg}\n    {line}") from None
        namespace: dict[str, Any] = {"__file__": str(path), "__name__": "__zerogpt_config__"}
        exec(code, namespace)
        keys = {k: v for k, v in namespace.items()
                if not k.startswith("_") and not inspect.ismodule(v) and not inspect.isroutine(v)
                and not inspect.isclass(v)}
        cfg = cls(keys)
        object.__setattr__(cfg, "_source", str(path))
        cfg.validate()
        return cfg

    def apply_overrides(self, overrides: Iterable[str]) -> "Config":
        """Apply `key.sub=VALUE` strings (from `--set`), then validate.

        VALUE is parsed with `ast.literal_eval` (`2`, `1e-4`, `None`, `True`, `'x'`, `[1, 2]`); anything
        that is not a Python literal is taken as a bare string (`precision=bf16`, `data.path=/d/x`).
        Missing intermediate dicts are created.

        Example:
            >>> Config().apply_overrides(["zero.stage=2", "precision=bf16"]).zero.stage
            2
        """
        for item in overrides:
            if "=" not in item:
                raise ValueError(f"override {item!r} must look like KEY=VALUE, e.g. --set zero.stage=2")
            key, raw = item.split("=", 1)
            key, raw = key.strip(), raw.strip()
            if not key or any(not part.isidentifier() for part in key.split(".")):
                raise ValueError(f"override {item!r}: {key!r} is not a dotted key like zero.stage")
            try:
                value = ast.literal_eval(raw)
            except (ValueError, SyntaxError):
                value = raw
            node = self
            parts = key.split(".")
            for depth, part in enumerate(parts[:-1]):
                if part not in node:
                    node[part] = Config._nested({})
                elif not isinstance(node[part], Config):
                    raise ValueError(f"override {item!r}: {'.'.join(parts[:depth + 1])} is "
                                     f"{node[part]!r}, not a dict, so it has no key {parts[depth + 1]!r}")
                node = node[part]
            node[parts[-1]] = value
            self._overrides.append(item)
        self.validate()
        return self

    # --- validation --------------------------------------------------------------------------------------
    def _where(self, path: str) -> str:
        for item in reversed(self._overrides):
            if item.split("=", 1)[0].strip() == path or item.split("=", 1)[0].strip().startswith(path + "."):
                return f"--set {item}"
        return self._source

    def validate(self) -> "Config":
        """Check every key against the schema and build every typed section once (value and cross-field checks).

        Raises ValueError / TypeError naming the key, the file (or the --set), the value, and the fix.
        """
        self._validate_section(self, SCHEMA, "")
        for build in (_engine_config, _train_config, _lr_scheduler_config, _data_config):
            try:
                build(self)
            except (ValueError, TypeError) as e:
                raise type(e)(f"{e} (in {self._source})") from None
        return self

    def _validate_section(self, node: dict, schema: Section, prefix: str) -> None:
        for key, value in node.items():
            path = prefix + key
            sub = schema.keys.get(key)
            if sub is None:
                if schema.free:
                    continue
                self._unknown(path, key, schema, prefix)
            elif isinstance(sub, Section):
                if not isinstance(value, dict):
                    raise TypeError(f"{path} must be a dict(...), got {value!r} (in {self._where(path)})")
                self._validate_section(value, sub, path + ".")
            else:
                self._check_leaf(path, value, sub)
        if prefix in ("model.", "optimizer."):
            self._check_typed_dict(prefix[:-1], node)

    def _unknown(self, path: str, key: str, schema: Section, prefix: str) -> None:
        hint = _FOREIGN_KEYS.get(path)
        if hint:
            raise ValueError(f"unknown key '{path}' in {self._where(path)}; {hint}")
        siblings = [prefix + k for k in schema.keys]
        # A misplaced key (zero.cpu_offload -> zero.optimizer_config.cpu_offload) beats a fuzzy sibling match.
        matches = [p for p in _ALL_PATHS if p.rsplit(".", 1)[-1].lower() == key.lower()]
        suggestion = f"; did you mean '{matches[0]}'?" if matches else ""
        suggestion = suggestion or _suggest(path, siblings) or _suggest(path, _ALL_PATHS)
        valid = ", ".join(schema.keys)
        helper = "; a helper variable in a config file must start with '_'" if not prefix and not suggestion else ""
        raise ValueError(f"unknown key '{path}' in {self._where(path)}{suggestion} "
                         f"(valid keys{' in ' + prefix[:-1] if prefix else ''}: {valid}){helper}")

    def _check_leaf(self, path: str, value: Any, leaf: Leaf) -> None:
        where = self._where(path)
        if leaf.types != (object,) and not _is_instance(value, leaf.types):
            names = " | ".join("None" if t is type(None) else t.__name__ for t in leaf.types)
            raise TypeError(f"{path} must be {names}, got {value!r} ({type(value).__name__}) (in {where})")
        if leaf.choices is not None and value not in leaf.choices:
            raise ValueError(f"{path} must be one of {', '.join(map(repr, leaf.choices))}, got {value!r} "
                             f"(in {where}){_suggest(str(value), map(str, leaf.choices), quote=True)}")
        if leaf.minimum is not None and value is not None and value < leaf.minimum:
            raise ValueError(f"{path} must be >= {leaf.minimum}, got {value!r} (in {where})")

    def _check_typed_dict(self, name: str, node: dict) -> None:
        where = self._where(name)
        if "type" not in node:
            example = "gpt2_small" if name == "model" else "HybridAdam"
            raise ValueError(f"{name} needs a 'type' (in {where}), e.g. {name} = dict(type={example}, ...)")
        kind = node["type"]
        if name == "model":
            if kind == "hf":
                if not isinstance(node.get("path"), str):
                    raise ValueError(f"model = dict(type='hf') needs path=DIR of a local Hugging Face model "
                                     f"(in {where}), got path={node.get('path')!r}")
            elif not callable(kind):
                raise TypeError(f"model.type must be a callable that builds the model (e.g. gpt2_small, imported "
                                f"at the top of the config) or 'hf', got {kind!r} (in {where})")
        else:
            if isinstance(kind, str):
                if kind not in OPTIMIZER_NAMES:
                    raise ValueError(f"optimizer.type {kind!r} is not one of {', '.join(OPTIMIZER_NAMES)} "
                                     f"(in {where}){_suggest(kind, OPTIMIZER_NAMES, quote=True)} Or pass the "
                                     f"class itself, e.g. type=torch.optim.AdamW")
            elif not callable(kind):
                raise TypeError(f"optimizer.type must be an optimizer class or one of {', '.join(OPTIMIZER_NAMES)}, "
                                f"got {kind!r} (in {where})")

    # --- writing -------------------------------------------------------------------------------------------
    def to_python(self) -> str:
        """Render as a loadable config.py (keys as set, overrides applied) for the run directory.

        Classes and functions become imports; objects whose repr is not valid Python are written as None
        with a comment (e.g. hook instances without a repr), since the file is a record, not a pickle.
        """
        imports: dict[str, str] = {}  # local name -> import line
        notes: list[str] = []

        def name_of(obj: Any) -> str:
            module, qual = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
            if not module or not qual or "<" in qual or module == "__zerogpt_config__":
                notes.append(repr(obj))
                return "None"
            top = qual.split(".")[0]
            local = top
            line = f"from {module} import {top}"
            if imports.get(local, line) != line:
                local = f"{top}_{len(imports)}"
                line = f"from {module} import {top} as {local}"
            imports[local] = line
            return local + qual[len(top):]

        def render(value: Any, indent: int) -> str:
            pad, inner = " " * indent, " " * (indent + 4)
            if value is None or isinstance(value, (bool, int, str, bytes)):
                return repr(value)
            if isinstance(value, float):
                return repr(value) if math.isfinite(value) else f"float({str(value)!r})"
            if isinstance(value, dict):
                if not value:
                    return "dict()"
                if all(isinstance(k, str) and k.isidentifier() for k in value):
                    body = ",\n".join(f"{inner}{k}={render(v, indent + 4)}" for k, v in value.items())
                    return f"dict(\n{body},\n{pad})"
                body = ",\n".join(f"{inner}{k!r}: {render(v, indent + 4)}" for k, v in value.items())
                return "{\n" + body + ",\n" + pad + "}"
            if isinstance(value, (list, tuple)):
                items = [render(v, indent + 4) for v in value]
                open_, close = ("[", "]") if isinstance(value, list) else ("(", ",)" if len(items) == 1 else ")")
                return open_ + ", ".join(items) + close
            if inspect.isclass(value) or inspect.isroutine(value):
                return name_of(value)
            text = repr(value)
            try:
                ast.parse(text, mode="eval")
                ok = "<" not in text
            except SyntaxError:
                ok = False
            if not ok:
                notes.append(text)
                return "None"
            cls_name = name_of(type(value))
            return cls_name + text[len(type(value).__name__):] if text.startswith(type(value).__name__) else text

        body = [f"{key} = {render(value, 0)}" for key, value in self.items()]
        header = ["# Resolved zerogpt config (zerogpt.config.Config.to_python); load with Config.from_file.",
                  f"# source: {self._source}"]
        header += [f"# override: --set {o}" for o in self._overrides]
        header += [f"# not reproducible (written as None): {n}" for n in notes]
        return "\n".join(header + sorted(set(imports.values())) + [""] + body) + "\n"


# ----------------------------------------------------------------------------------------------------------
# Typed builders: the only way library code reads the config.

def _section(cfg: Config, name: str) -> dict:
    value = cfg[name] if name in cfg else {}
    return dict(value)


def _zero_config(cfg: Config) -> ZeroConfig:
    """Map both the seed (Colossal-AI) form and the direct form of `zero` onto ZeroConfig."""
    if "zero" not in cfg:
        return ZeroConfig()
    z = cfg["zero"]
    model_cfg = z.get("model_config", {})
    optim_cfg = z.get("optimizer_config", {})
    # The seed tutorial form (a zero dict with no stage) is Colossal-AI's ZeRO-3.
    stage = z.get("stage", 3)

    strategies = [s for s in (z.get("shard_strategy"), model_cfg.get("shard_strategy")) if s is not None]
    if len(strategies) == 2 and strategies[0] != strategies[1]:
        raise ValueError(f"zero.shard_strategy={strategies[0]!r} and zero.model_config.shard_strategy="
                         f"{strategies[1]!r} disagree; set only one")
    prefetch = z.get("prefetch", model_cfg.get("prefetch", 2))

    param = OffloadConfig(**z.get("offload_param", {}))
    seed_device = model_cfg.get("offload_config", {}).get("device", "none")
    # "auto" placement (Colossal-AI's dynamic policy) keeps params on the device here; "cuda" means no offload.
    if seed_device == "cpu" or model_cfg.get("tensor_placement_policy") == "cpu":
        if "offload_param" in z and param.device == "none":
            raise ValueError("zero.offload_param.device='none' contradicts zero.model_config "
                             "(offload_config.device / tensor_placement_policy = 'cpu'); set only one")
        param.device = "cpu"

    optimizer = OffloadConfig(**z.get("offload_optimizer", {}))
    if optim_cfg.get("cpu_offload"):
        if "offload_optimizer" in z and optimizer.device == "none":
            raise ValueError("zero.offload_optimizer.device='none' contradicts "
                             "zero.optimizer_config.cpu_offload=True; set only one")
        if optimizer.device == "none":
            optimizer.device = "cpu"

    scale_keys = {f.name for f in fields(LossScaleConfig)}
    seed_scale = {k: v for k, v in optim_cfg.items() if k in scale_keys}
    direct_scale = dict(z.get("loss_scale", {}))
    both = set(seed_scale) & set(direct_scale)
    if both:
        raise ValueError(f"loss-scale keys {sorted(both)} are set in both zero.optimizer_config and "
                         f"zero.loss_scale; set them in one place")
    loss_scale = LossScaleConfig(**seed_scale, **direct_scale)

    kwargs: dict[str, Any] = dict(stage=stage, offload_optimizer=optimizer, offload_param=param,
                                  loss_scale=loss_scale, prefetch=prefetch)
    if strategies:
        kwargs["shard_strategy"] = strategies[0]
    return ZeroConfig(**kwargs)


def _as_config(cfg: Config | dict) -> Config:
    cfg = cfg if isinstance(cfg, Config) else Config(cfg)
    cfg._validate_section(cfg, SCHEMA, "")
    return cfg


def engine_config(cfg: Config | dict, world_size: int = 1) -> EngineConfig:
    """The engine's view of the config, with GLOBAL_BATCH_SIZE resolved into gradient accumulation.

    Args:
        cfg: a Config (its keys are checked against the schema here too).
        world_size: data-parallel ranks; GRADIENT_ACCUMULATION = GLOBAL_BATCH_SIZE // (BATCH_SIZE * world_size).
    Example:
        >>> engine_config(Config(BATCH_SIZE=2, GLOBAL_BATCH_SIZE=16), world_size=2).gradient_accumulation
        4
    """
    return _engine_config(_as_config(cfg), world_size)


def train_config(cfg: Config | dict) -> TrainConfig:
    """The `train` section with defaults filled in."""
    return _train_config(_as_config(cfg))


def lr_scheduler_config(cfg: Config | dict) -> LRSchedulerConfig:
    """The `lr_scheduler` section with defaults filled in (absent -> constant LR, no warmup)."""
    return _lr_scheduler_config(_as_config(cfg))


def data_config(cfg: Config | dict) -> DataConfig:
    """The `data` section with defaults filled in."""
    return _data_config(_as_config(cfg))


def _engine_config(cfg: Config, world_size: int = 1) -> EngineConfig:
    accumulation = cfg.GRADIENT_ACCUMULATION
    if cfg.GLOBAL_BATCH_SIZE is not None:
        per_step = cfg.BATCH_SIZE * world_size
        if cfg.GLOBAL_BATCH_SIZE % per_step:
            raise ValueError(f"GLOBAL_BATCH_SIZE={cfg.GLOBAL_BATCH_SIZE} is not divisible by BATCH_SIZE "
                             f"({cfg.BATCH_SIZE}) x world size ({world_size}) = {per_step}; pick a multiple of "
                             f"{per_step} or change BATCH_SIZE")
        resolved = cfg.GLOBAL_BATCH_SIZE // per_step
        if "GRADIENT_ACCUMULATION" in cfg and accumulation != resolved:
            raise ValueError(f"GRADIENT_ACCUMULATION={accumulation} contradicts GLOBAL_BATCH_SIZE="
                             f"{cfg.GLOBAL_BATCH_SIZE} / (BATCH_SIZE {cfg.BATCH_SIZE} x world {world_size}) = "
                             f"{resolved}; set only one of them")
        accumulation = resolved
    clip = cfg.clip_grad_norm
    return EngineConfig(zero=_zero_config(cfg), precision=cfg.precision, gradient_accumulation=accumulation,
                        clip_grad_norm=float(clip) if clip else None, host=HostConfig(**_section(cfg, "host")))


def _train_config(cfg: Config) -> TrainConfig:
    return TrainConfig(**_section(cfg, "train"))


def _lr_scheduler_config(cfg: Config) -> LRSchedulerConfig:
    return LRSchedulerConfig(**_section(cfg, "lr_scheduler"))


def _data_config(cfg: Config) -> DataConfig:
    return DataConfig(**_section(cfg, "data"))
