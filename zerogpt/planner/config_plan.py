"""plan="auto" and the run config: the `Workload` a config asks for (tokens per step, the keys it fixed) and the
config with a chosen `Plan` written into it, so `initialize` builds exactly what a hand-set file with those keys
would (no torch here; the model's shape comes in as a ModelShape)."""
from __future__ import annotations

from dataclasses import fields
from typing import Any

from zerogpt.config import BucketTensorShardStrategy, Config, TensorShardStrategy, ZeroConfig
from zerogpt.config.dtypes import compute_dtype_name
from zerogpt.memory_model import ModelShape
from zerogpt.planner.plan import CONFIG_KEYS, Plan, PlanError, Workload

__all__ = ["workload_from_config", "apply_plan", "fixed_keys_line", "HOST_ADAM_OPTIMIZERS"]

HOST_ADAM_OPTIMIZERS = ("CPUAdam", "HybridAdam")
"""Optimizers whose host step is our fused kernel: the only ones that keep Adam's moments in bf16."""
_ZERO_KEYS = {f.name for f in fields(ZeroConfig)}


def _fixed_zero(zero: dict) -> dict[str, Any]:
    """The Plan fields a raw `zero` dict sets (zerogpt's keys; the Colossal-AI form is refused)."""
    foreign = sorted(set(zero) - _ZERO_KEYS)
    if foreign:
        raise PlanError(f"plan='auto' reads zerogpt's zero keys; zero.{foreign[0]} (the Colossal-AI form) fixes the "
                        f"plan by hand: write it as zero.stage / zero.offload_optimizer / zero.offload_param, or drop "
                        f"it and let plan='auto' choose")
    fixed: dict[str, Any] = {}
    if "stage" in zero:
        fixed["stage"] = zero["stage"]
    if "prefetch" in zero:
        fixed["prefetch"] = zero["prefetch"]
    if "shard_strategy" in zero:
        strategy = zero["shard_strategy"]
        fixed["bucket_mb"] = 0.0 if isinstance(strategy, TensorShardStrategy) else float(strategy.bucket_mb)
    optim, param = dict(zero.get("offload_optimizer", {})), dict(zero.get("offload_param", {}))
    for key, node, name in (("offload_optimizer", optim, "device"), ("state_dtype", optim, "state_dtype"),
                            ("offload_param", param, "device"), ("device_budget", param, "device_budget")):
        if name in node:
            fixed[key] = node[name]
    if fixed.get("device_budget") == "auto":
        raise PlanError("zero.offload_param.device_budget='auto' with plan='auto': the planner sizes it; drop the key "
                        "or give bytes")
    return fixed


def workload_from_config(cfg: Config, shape: ModelShape, dp: int, model_config: Any = None) -> Workload:
    """What a plan="auto" config asks for at `dp` data-parallel ranks.

    Tokens per step: TOKENS_PER_STEP, else GLOBAL_BATCH_SIZE x SEQ_LEN, else BATCH_SIZE x GRADIENT_ACCUMULATION x dp
    x SEQ_LEN (then those two define the target and are not fixed). Fixed: every memory key the config sets
    (CONFIG_KEYS). `model_config`: the built model's config, whose checkpoint/chunked_loss fields say whether the
    model takes them."""
    zero = dict(cfg.get("zero", {}))
    fixed = _fixed_zero(zero)
    target_given = cfg.get("TOKENS_PER_STEP") is not None or cfg.get("GLOBAL_BATCH_SIZE") is not None
    if cfg.get("TOKENS_PER_STEP") is not None:
        tokens = cfg.TOKENS_PER_STEP
    elif cfg.get("GLOBAL_BATCH_SIZE") is not None:
        tokens = cfg.GLOBAL_BATCH_SIZE * cfg.SEQ_LEN
    else:
        tokens = cfg.BATCH_SIZE * cfg.GRADIENT_ACCUMULATION * dp * cfg.SEQ_LEN
    if target_given:
        for key, name in (("micro_batch", "BATCH_SIZE"), ("accumulation", "GRADIENT_ACCUMULATION")):
            if name in cfg:
                fixed[key] = cfg[name]
    model = dict(cfg.get("model", {}))
    can_checkpoint = model_config is not None and all(hasattr(model_config, k) for k in ("checkpoint",
                                                                                         "chunked_loss"))
    for key in ("checkpoint", "chunked_loss"):
        if key in model:
            fixed[key] = bool(model[key])
        elif not can_checkpoint:
            fixed[key] = False
    optimizer = dict(cfg.get("optimizer", {})).get("type")
    name = optimizer if isinstance(optimizer, str) else getattr(optimizer, "__name__", "")
    disk_path = dict(zero.get("offload_optimizer", {})).get("path")
    loss_chunk = getattr(model_config, "loss_chunk_size", 256) or 256
    return Workload(shape=shape, seq_len=cfg.SEQ_LEN, tokens_per_step=tokens, world=dp,
                    precision=compute_dtype_name(cfg.precision), fixed=fixed, disk_path=disk_path,
                    host_adam=name in HOST_ADAM_OPTIMIZERS, can_checkpoint=can_checkpoint, compile=bool(cfg.compile),
                    loss_chunk=int(loss_chunk))


def apply_plan(cfg: Config, plan: Plan) -> Config:
    """A copy of `cfg` with the plan's keys written in and plan="manual": the hand-set config of this plan
    (what config.py in the run directory records, and what `initialize` executes)."""
    out = Config(cfg.to_dict())  # new dicts at every level; the values shared
    object.__setattr__(out, "_source", cfg._source)
    object.__setattr__(out, "_overrides", list(cfg._overrides))
    zero = dict(out.get("zero", {}))
    optim = dict(zero.get("offload_optimizer", {}), device=plan.offload_optimizer, state_dtype=plan.state_dtype)
    param = dict(zero.get("offload_param", {}), device=plan.offload_param, device_budget=plan.device_budget)
    strategy = TensorShardStrategy() if plan.bucket_mb == 0 else BucketTensorShardStrategy(bucket_mb=plan.bucket_mb)
    out["zero"] = dict(zero, stage=plan.stage, shard_strategy=strategy, prefetch=plan.prefetch,
                       offload_optimizer=optim, offload_param=param)
    for name in ("TOKENS_PER_STEP", "GLOBAL_BATCH_SIZE"):
        out.pop(name, None)
    out["BATCH_SIZE"], out["GRADIENT_ACCUMULATION"], out["plan"] = plan.micro_batch, plan.accumulation, "manual"
    model = dict(out.get("model", {}))
    if plan.checkpoint or "checkpoint" in model:
        model["checkpoint"] = plan.checkpoint
    if plan.chunked_loss or "chunked_loss" in model:
        model["chunked_loss"] = plan.chunked_loss
    out["model"] = model
    return out.validate()


def fixed_keys_line(work: Workload) -> str:
    """The fixed keys as the config names them (for the table's note)."""
    return ", ".join(f"{CONFIG_KEYS[k]}={v!r}" for k, v in work.fixed.items()) or "none"
