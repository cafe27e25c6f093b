"""The Colossal-AI form of the `zero` section (the seed tutorial's config), and its mapping onto ZeroConfig.

A `zero` dict may mix this form (`model_config`, `optimizer_config`) with zerogpt's own keys (ZeroConfig's
fields). **A `zero` dict without `stage` means stage 3**: Colossal-AI's `zero = dict(...)` always meant
sharded parameters, so the tutorial config keeps its meaning unchanged.
"""
from __future__ import annotations

import typing
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from zerogpt.config.schema import (LossScaleConfig, OptimizerOffloadConfig, ParamOffloadConfig, ZeroConfig,
                                   section_types)
from zerogpt.config.strategy import ShardStrategy

SEED_STAGE = 3
"""The stage of a `zero` dict that does not name one (Colossal-AI's ZeRO is stage 3)."""


@dataclass
class ColossalOffloadConfig:
    """`zero.model_config.offload_config`: where parameters rest."""

    device: Literal["cpu", "cuda", "none"] = "none"
    """"cpu" offloads parameter shards (zero.offload_param.device='cpu'); "cuda"/"none" keep them."""


@dataclass
class ColossalModelConfig:
    """`zero.model_config`: Colossal-AI's ShardedModelV2 arguments."""

    offload_config: ColossalOffloadConfig = field(default_factory=ColossalOffloadConfig)
    shard_strategy: ShardStrategy | None = None
    """Same as zero.shard_strategy (set only one)."""
    tensor_placement_policy: Literal["cpu", "cuda", "auto"] | None = None
    """"cpu" offloads parameter shards; "cuda" and "auto" (dynamic placement) keep them on the device."""
    reuse_fp16_shard: bool = False
    """Accepted and ignored: zerogpt keeps one compute-dtype shard per chunk either way."""
    prefetch: int | None = None
    """Same as zero.prefetch."""


@dataclass
class ColossalOptimizerConfig(LossScaleConfig):
    """`zero.optimizer_config`: Colossal-AI's ShardedOptimizerV2 arguments (loss-scale keys included)."""

    cpu_offload: bool = False
    """True offloads the optimizer state (zero.offload_optimizer.device='cpu')."""
    gpu_margin_mem_ratio: float = 0.0
    """Accepted and ignored: zerogpt places the optimizer state statically."""


@dataclass
class ColossalZeroConfig:
    """The keys of the Colossal-AI form that a `zero` dict accepts beside ZeroConfig's."""

    model_config: ColossalModelConfig = field(default_factory=ColossalModelConfig)
    optimizer_config: ColossalOptimizerConfig = field(default_factory=ColossalOptimizerConfig)


def zero_config(z: dict) -> ZeroConfig:
    """ZeroConfig from a raw `zero` dict in either form (or both, when they agree)."""
    hints = typing.get_type_hints(ZeroConfig)
    kwargs: dict[str, Any] = {}
    for f in fields(ZeroConfig):                       # zerogpt's own keys; nested sections become dataclasses
        if f.name in z:
            sections = section_types(hints[f.name])
            kwargs[f.name] = sections[0](**z[f.name]) if sections else z[f.name]
    model_cfg = dict(z.get("model_config", {}))
    optim_cfg = dict(z.get("optimizer_config", {}))
    kwargs.setdefault("stage", SEED_STAGE)

    if model_cfg.get("shard_strategy") is not None:
        if "shard_strategy" in kwargs and kwargs["shard_strategy"] != model_cfg["shard_strategy"]:
            raise ValueError(f"zero.shard_strategy={kwargs['shard_strategy']!r} and zero.model_config.shard_strategy="
                             f"{model_cfg['shard_strategy']!r} disagree; set only one")
        kwargs["shard_strategy"] = model_cfg["shard_strategy"]
    if model_cfg.get("prefetch") is not None:
        kwargs.setdefault("prefetch", model_cfg["prefetch"])

    param = kwargs.setdefault("offload_param", ParamOffloadConfig())
    if model_cfg.get("offload_config", {}).get("device") == "cpu" or model_cfg.get("tensor_placement_policy") == "cpu":
        if "offload_param" in z and param.device == "none":
            raise ValueError("zero.offload_param.device='none' contradicts zero.model_config "
                             "(offload_config.device / tensor_placement_policy = 'cpu'); set only one")
        param.device = "cpu"

    optimizer = kwargs.setdefault("offload_optimizer", OptimizerOffloadConfig())
    if optim_cfg.get("cpu_offload"):
        if "offload_optimizer" in z and optimizer.device == "none":
            raise ValueError("zero.offload_optimizer.device='none' contradicts "
                             "zero.optimizer_config.cpu_offload=True; set only one")
        if optimizer.device == "none":
            optimizer.device = "cpu"

    seed_scale = {k: v for k, v in optim_cfg.items() if k in {f.name for f in fields(LossScaleConfig)}}
    direct_scale = dict(z.get("loss_scale", {}))
    both = set(seed_scale) & set(direct_scale)
    if both:
        raise ValueError(f"loss-scale keys {sorted(both)} are set in both zero.optimizer_config and "
                         f"zero.loss_scale; set them in one place")
    kwargs["loss_scale"] = LossScaleConfig(**seed_scale, **direct_scale)
    return ZeroConfig(**kwargs)
