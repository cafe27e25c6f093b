"""Load a Python config file into a checked `Config`, apply `--set` overrides, and hand out typed sections.

`Config` is the raw tree (a dict with attribute access) exactly as the user wrote it. Its keys are checked
against `RunConfig`, the dataclass of a file's top-level keys, whose sections are schema.py's dataclasses.
Library code never reads the tree: it asks for its typed section (`engine_config`, `train_config`,
`lr_scheduler_config`, `data_config`), which fills in defaults.
"""
from __future__ import annotations

import ast
import inspect
import re
import traceback
import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable, Literal

from zerogpt.config.colossalai import ColossalZeroConfig, zero_config
from zerogpt.config.render import to_python
from zerogpt.config.schema import (OPTIMIZER_NAMES, DataConfig, EngineConfig, EngineKeys, HostConfig, LRSchedulerConfig,
                                   ParallelConfig, TensorParallelConfig, TrainConfig, ZeroConfig, all_paths,
                                   check_fields, check_tree, field_hints, section_types, suggest)


@dataclass
class RunConfig(EngineKeys):
    """The top-level keys of a config file (upper-case ones are the Colossal-AI tutorial's names); precision,
    compile, clip_grad_norm and host are EngineKeys' (schema.py), declared once for this and EngineConfig."""

    BATCH_SIZE: int = 1
    """Samples per micro-batch, per rank."""
    GLOBAL_BATCH_SIZE: int | None = None
    """Samples per optimizer step over all ranks; sets GRADIENT_ACCUMULATION for the world size."""
    GRADIENT_ACCUMULATION: int = 1
    """Micro-batches per optimizer step (use GLOBAL_BATCH_SIZE to keep it right across world sizes)."""
    SEQ_LEN: int = 1024
    """Tokens per sample."""
    NUM_EPOCHS: int | None = None
    """Passes over the training data when train.max_steps is None."""
    plan: Literal["manual", "auto"] = "manual"
    """"manual": the memory keys as written. "auto": zerogpt chooses stage, offload, state dtype, micro-batch x
    accumulation, checkpointing, the chunked loss, bucket size, prefetch and device_budget for the machine it finds
    (zerogpt/planner/); the keys a file sets stay fixed and the rest is chosen around them."""
    TOKENS_PER_STEP: int | None = None
    """plan="auto": tokens per optimizer step over all ranks, a multiple of world x SEQ_LEN (None: GLOBAL_BATCH_SIZE
    x SEQ_LEN, else BATCH_SIZE x GRADIENT_ACCUMULATION x world x SEQ_LEN)."""
    zero: ZeroConfig | ColossalZeroConfig = field(default_factory=ZeroConfig)
    """zerogpt's keys and/or the Colossal-AI form (colossalai.py: without `stage` it means stage 3)."""
    model: dict = field(default_factory=dict)
    """dict(type=builder, **kwargs) or dict(type="hf", path=DIR); model_zoo.build_model reads it."""
    optimizer: dict = field(default_factory=dict)
    """dict(type=class or name, **kwargs), the kwargs going to the optimizer class."""
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Tensor and pipeline parallelism (schema.ParallelConfig); data parallelism is what is left of the world."""
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    hooks: list | tuple = field(default_factory=list)
    """Extra Hook instances appended to train_gpt.py's hooks."""

    def __post_init__(self) -> None:
        check_fields(self, "")
        for name in ("BATCH_SIZE", "GLOBAL_BATCH_SIZE", "GRADIENT_ACCUMULATION", "SEQ_LEN", "NUM_EPOCHS",
                     "TOKENS_PER_STEP"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.clip_grad_norm is not None and self.clip_grad_norm < 0:
            raise ValueError(f"clip_grad_norm must be >= 0 (0 or None = off), got {self.clip_grad_norm}")
        if self.TOKENS_PER_STEP is not None and self.plan != "auto":
            raise ValueError(f"TOKENS_PER_STEP={self.TOKENS_PER_STEP} is plan='auto''s target; set plan='auto' "
                             f"(--plan auto), or give GLOBAL_BATCH_SIZE for a hand-set plan")


_HINTS = typing.get_type_hints(RunConfig)
_SCALARS = {f.name: f for f in fields(RunConfig) if not section_types(_HINTS[f.name]) and _HINTS[f.name] is not dict}
_ALL_PATHS = all_paths((RunConfig,))

# Keys of other frameworks' configs that people will paste in; the hint says what to write instead.
_FOREIGN_KEYS = {
    "fp16": "use precision='fp16' (or 'bf16')",
    "gradient_accumulation": "use GRADIENT_ACCUMULATION (upper case)",
    "clip_grad": "use clip_grad_norm",
}


_NAME_HINT = "; a name a config uses is imported at its top, e.g. from model_zoo.gpt import gpt2_small"


def _failing_line(e: BaseException, filename: str) -> int | str:
    """The line of `filename` (the config) that raised `e`: the innermost of its frames in the traceback."""
    lines = [frame.lineno for frame in traceback.extract_tb(e.__traceback__) if frame.filename == filename]
    return lines[-1] if lines else "?"


def _default(name: str) -> Any:
    f = _SCALARS[name]
    return f.default_factory() if f.default is MISSING else f.default


def _takes_text(parts: list[str], value: Any) -> bool:
    """Whether the key at `parts` is a text field (str, str | None) and `value`, what `--set` parsed, is a number,
    tuple or list it refuses: then the text as typed is meant (None and bools keep their meaning and checks)."""
    if not isinstance(value, (int, float, tuple, list)) or isinstance(value, bool):
        return False
    classes, hint = (RunConfig,), None
    for part in parts:
        hints = field_hints(classes) if classes else {}
        if part not in hints:
            return False
        hint = hints[part]
        classes = section_types(hint)
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    return str in options and type(value) not in options and not (float in options and type(value) is int)


class Config(dict):
    """A config tree: a dict with attribute access whose nested dicts are Configs.

    Build with `Config.from_file("configs/x.py")` (validated) or `Config({...})` (call `.validate()`;
    the typed builders such as `engine_config(cfg)` validate it either way). On the root, a top-level
    scalar that the file did not set reads as its RunConfig default (`cfg.BATCH_SIZE` -> 1) while
    `"BATCH_SIZE" in cfg` stays False.

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
        if self.__dict__.get("_is_root") and name in _SCALARS:
            return _default(name)
        raise AttributeError(f"config has no key {name!r}{suggest(name, self.keys())}")

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

    def to_python(self) -> str:
        """Render as a loadable config.py (keys as set, overrides applied) for the run directory."""
        return to_python(self, self._source, self._overrides)

    # --- loading -----------------------------------------------------------------------------------------
    @classmethod
    def from_file(cls, path: str | Path) -> "Config":
        """Execute a Python config file and return its validated keys.

        Keys are the module-level names that do not start with `_` and are not modules, functions or
        classes (so `from zerogpt.optim import HybridAdam` is not a key, while `type=HybridAdam` inside a
        dict is kept as the class).

        Raises:
            FileNotFoundError: no such file.
            ValueError: a syntax error or an exception while it runs (file:line), an unknown key (with the
                closest valid key), a bad value.
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
        try:
            exec(code, namespace)
        except Exception as e:  # a misspelt import, an undefined name: the config's line, not zerogpt's traceback
            raise ValueError(f"config {path}:{_failing_line(e, str(path))}: {type(e).__name__}: {e}"
                             + (_NAME_HINT if isinstance(e, NameError) else "")) from None
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
        that is not a Python literal is taken as a bare string (`precision=bf16`, `data.path=/d/x`), except
        `true`/`false` in any case, which are bools (`compile=true`), and a text key that would get a number, tuple or
        list takes the text as typed (`data.split=949,50,1`, `train.output_dir=2024`). Missing intermediate dicts
        are created.

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
                value = {"true": True, "false": False}.get(raw.lower(), raw)  # shell habit: compile=true
            parts = key.split(".")
            if _takes_text(parts, value):   # data.split=949,50,1 or train.output_dir=2024: the text as typed
                value = raw
            node = self
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
    def where(self, path: str) -> str:
        """Where the value at dotted `path` (or under it) was set: the last `--set` that set it, else the file."""
        for item in reversed(self._overrides):
            key = item.split("=", 1)[0].strip()
            if key == path or key.startswith(path + "."):
                return f"--set {item}"
        return self._source

    def _origin(self, message: str) -> str:
        """Where the value a check's `message` names was set: each `--set` whose key (or a key under it) the
        message names, else the file. A value check names its key (`train.max_steps must be >= 1, got -1`)."""
        named = [f"--set {item}" for item in self._overrides
                 if re.search(rf"(?<![\w.]){re.escape(item.split('=', 1)[0].strip())}(?!\w)", message)]
        return ", ".join(dict.fromkeys(named)) or self._source

    def validate(self) -> "Config":
        """Check every key and type against RunConfig, then build every typed section once (value checks).

        Raises ValueError / TypeError naming the key, the file (or the --set), the value, and the fix.
        """
        self.check_keys()
        try:
            RunConfig(**{k: v for k, v in self.items() if k in _SCALARS})
            for build in (_engine_config, _train_config, _lr_scheduler_config, _data_config):
                build(self)
        except (ValueError, TypeError) as e:
            raise type(e)(f"{e} (in {self._origin(str(e))})") from None
        return self

    def check_keys(self) -> None:
        """Keys and value types only (no value ranges): every key is a RunConfig field, recursively."""
        check_tree(self, (RunConfig,), "", self._unknown, self.where)
        for name in ("model", "optimizer"):
            if name in self:
                self._check_typed_dict(name, self[name])

    def _unknown(self, path: str, valid: list[str]) -> None:
        hint = _FOREIGN_KEYS.get(path)
        if hint:
            raise ValueError(f"unknown key '{path}' in {self.where(path)}; {hint}")
        prefix, _, key = path.rpartition(".")
        prefix = prefix + "." if prefix else ""
        # A misplaced key (zero.cpu_offload -> zero.optimizer_config.cpu_offload) beats a fuzzy sibling match.
        matches = [p for p in _ALL_PATHS if p.rsplit(".", 1)[-1].lower() == key.lower()]
        suggestion = f"; did you mean '{matches[0]}'?" if matches else ""
        suggestion = suggestion or suggest(path, [prefix + k for k in valid]) or suggest(path, _ALL_PATHS)
        helper = "; a helper variable in a config file must start with '_'" if not prefix and not suggestion else ""
        raise ValueError(f"unknown key '{path}' in {self.where(path)}{suggestion} "
                         f"(valid keys{' in ' + prefix[:-1] if prefix else ''}: {', '.join(valid)}){helper}")

    def _check_typed_dict(self, name: str, node: dict) -> None:
        where = self.where(name)
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
        elif isinstance(kind, str) and kind not in OPTIMIZER_NAMES:
            raise ValueError(f"optimizer.type {kind!r} is not one of {', '.join(OPTIMIZER_NAMES)} "
                             f"(in {where}){suggest(kind, OPTIMIZER_NAMES, quote=True)} Or pass the "
                             f"class itself, e.g. type=torch.optim.AdamW")
        elif not isinstance(kind, str) and not callable(kind):
            raise TypeError(f"optimizer.type must be an optimizer class or one of {', '.join(OPTIMIZER_NAMES)}, "
                            f"got {kind!r} (in {where})")


# ----------------------------------------------------------------------------------------------------------
# Typed sections: the only way library code reads the config.

def _as_config(cfg: Config | dict) -> Config:
    cfg = cfg if isinstance(cfg, Config) else Config(cfg)
    cfg.check_keys()
    return cfg


def engine_config(cfg: Config | dict, world_size: int = 1) -> EngineConfig:
    """The engine's view of the config, with GLOBAL_BATCH_SIZE resolved into gradient accumulation.

    Args:
        cfg: a Config (its keys are checked here too).
        world_size: data-parallel ranks (D); GRADIENT_ACCUMULATION = GLOBAL_BATCH_SIZE // (BATCH_SIZE * world_size).
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
                             f"({cfg.BATCH_SIZE}) x data-parallel size ({world_size}) = {per_step}; pick a "
                             f"multiple of {per_step} or change BATCH_SIZE")
        resolved = cfg.GLOBAL_BATCH_SIZE // per_step
        if "GRADIENT_ACCUMULATION" in cfg and accumulation != resolved:
            raise ValueError(f"GRADIENT_ACCUMULATION={accumulation} contradicts GLOBAL_BATCH_SIZE="
                             f"{cfg.GLOBAL_BATCH_SIZE} / (BATCH_SIZE {cfg.BATCH_SIZE} x world {world_size}) = "
                             f"{resolved}; set only one of them")
        accumulation = resolved
    clip = cfg.clip_grad_norm
    zero = zero_config(cfg["zero"]) if "zero" in cfg else ZeroConfig()
    return EngineConfig(zero=zero, precision=cfg.precision, gradient_accumulation=accumulation,
                        clip_grad_norm=float(clip) if clip else None, host=HostConfig(**cfg.get("host", {})),
                        compile=cfg.compile)


def _train_config(cfg: Config) -> TrainConfig:
    return TrainConfig(**cfg.get("train", {}))


def _lr_scheduler_config(cfg: Config) -> LRSchedulerConfig:
    return LRSchedulerConfig(**cfg.get("lr_scheduler", {}))


def _data_config(cfg: Config) -> DataConfig:
    return DataConfig(**cfg.get("data", {}))


def parallel_config(cfg: Config | dict) -> ParallelConfig:
    """The `parallel` section with defaults filled in (absent -> tensor and pipeline size 1)."""
    node = dict(_as_config(cfg).get("parallel", {}))
    if "tensor" in node:
        node["tensor"] = TensorParallelConfig(**node["tensor"])
    return ParallelConfig(**node)
