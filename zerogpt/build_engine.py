"""`initialize()`: turn a model + optimizer + config into a ZeRO `Engine`, in one stated order.

Order and why:
  1. resolve the config and distributed context (everything below depends on stage and world size), and
     apply the process-wide `host.*` settings (malloc);
  2. resolve the optimizer and map every parameter to its param group (chunks never mix groups; a dict
     optimizer's no-decay parameters share chunks with the weights, see sharded_optim.py);
  3. plan chunks (pure: sizes only) and pack the parameters into them, in the compute dtype (a meta model:
     each rank fills only its shards, from the model's init_param_range or ZeroInitContext's record);
  4. register hooks (grad hooks at every stage; gather/release/prefetch at stage 3) - after packing,
     because hooks refer to chunk slots;
  5. place state (device / host / disk) and build the sharded optimizer: one ChunkState per chunk;
  6. the loss scaler (fp16 only), then the shared-memory transport (host.shm_collectives) and the Engine.
"""
from __future__ import annotations

import os
import zlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zerogpt.amp import DynamicLossScaler, compute_dtype
from zerogpt.config import Config, EngineConfig, engine_config, optimizer_class
from zerogpt.engine import Engine
from zerogpt.host_memory import keep_freed_host_memory
from zerogpt.parallel.context import EngineContext
from zerogpt.zero.chunk import Chunk, plan_chunks, to_local
from zerogpt.zero.comm import all_gather_flat
from zerogpt.zero.init_ctx import recorded_init, swap_meta_for_empty
from zerogpt.zero.meta_init import range_init
from zerogpt.zero.offload import Placement, check_disk_path
from zerogpt.zero.shm import open_transport
from zerogpt.zero.gather_hooks import Stage3GatherHooks
from zerogpt.zero.grad_hooks import GradReduceHooks
from zerogpt.zero.sharded_optim import ShardedOptimizer


def _default_context() -> EngineContext:
    """Without a ctx: the whole world is the data-parallel group (EngineContext says what a ctx holds)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    else:
        device = torch.device("cpu")
    return EngineContext(rank, world, device, group=None)


def _logger(ctx: Any):
    if getattr(ctx, "logger", None) is not None:
        return ctx.logger
    from zerogpt.logging import get_logger

    return get_logger(ctx.rank)


def _resolve_optimizer(optimizer: Any, model: nn.Module, cpu_adam: str = "auto"
                       ) -> tuple[torch.optim.Optimizer, set[str]]:
    """The optimizer, and the names of the parameters that take no weight decay whatever their group says.

    With dict(type=..., weight_decay=w), parameters under 2 dimensions (biases, LayerNorm) take no decay, as
    in nanoGPT, Megatron and Hugging Face; `no_decay_1d=False` in the dict decays them too. They stay in the
    one param group (and share chunks with the weights): the step skips their decay slot by slot. An
    optimizer object is used as built.
    """
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer, set()
    if isinstance(optimizer, dict):
        kwargs = dict(optimizer)
        no_decay_1d = kwargs.pop("no_decay_1d", True)
        if not isinstance(no_decay_1d, bool):
            raise TypeError(f"optimizer.no_decay_1d must be True (biases and norms take no weight decay) or "
                            f"False (every parameter decays), got {no_decay_1d!r}")
        cls = optimizer_class(kwargs.pop("type", None))
        from zerogpt.optim import CPUAdam

        if issubclass(cls, CPUAdam):
            kwargs.setdefault("backend", cpu_adam)
        built = cls([p for p in model.parameters() if p.requires_grad], **kwargs)
        under_2d = {n for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2}
        return built, under_2d if no_decay_1d else set()
    raise TypeError(f"optimizer must be a torch.optim.Optimizer built on model.parameters() or a "
                    f"dict(type=..., **kwargs), got {type(optimizer).__name__}")


def _param_groups(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[str, nn.Parameter, int]]:
    """(name, param, group index) for each unique parameter; -1 marks a frozen one."""
    owner = {}
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            owner[id(p)] = g
    named = list(model.named_parameters())  # unique: a tied parameter appears once
    model_ids = {id(p) for _, p in named}
    foreign = [i for i in owner if i not in model_ids]
    if foreign:
        raise ValueError(f"the optimizer holds {len(foreign)} tensor(s) that are not parameters of the model; "
                         f"build it on model.parameters() of the model you pass to initialize()")
    out = []
    for name, p in named:
        if p.requires_grad and id(p) not in owner:
            raise ValueError(f"parameter {name!r} requires grad but is in no optimizer param group; "
                             f"add it to the optimizer or set requires_grad=False")
        out.append((name, p, owner.get(id(p), -1) if p.requires_grad else -1))
    return out


def _check_devices(params: list[tuple[str, nn.Parameter, int]]) -> None:
    devices = {p.device.type for _, p, _ in params if p.device.type != "meta"}
    if len(devices) > 1:
        where = {d: next(n for n, p, _ in params if p.device.type == d) for d in devices}
        raise ValueError(f"parameters are on mixed devices {where}; build the model on one device "
                         f"(the engine moves it to ctx.device)")


def _check_same_plan(plans, ecfg: EngineConfig, ctx) -> None:
    """Fail fast when ranks disagree on the chunk layout (different model or zero config per rank).

    Every later collective assumes the same chunks and sizes on every rank; a mismatch would
    otherwise surface mid-step as a hang or an opaque transport error. One tiny all-gather at init.
    """
    if not dist.is_initialized() or ctx.world_size == 1:
        return
    layout = "|".join(f"{s.name}{s.shape}:{p.group_index}" for p in plans for s in p.slots)
    fields = ("zero.stage", "chunks", "padded elements", "precision + parameter layout hash")
    mine = torch.tensor([ecfg.zero.stage, len(plans), sum(p.padded_numel for p in plans),
                         zlib.crc32(f"{ecfg.precision}|{layout}".encode())], dtype=torch.int64, device=ctx.device)
    every = torch.empty(ctx.world_size * len(fields), dtype=torch.int64, device=ctx.device)
    all_gather_flat(every, mine, group=ctx.group)
    rows = every.view(ctx.world_size, len(fields)).tolist()
    for rank, row in enumerate(rows):
        if row != rows[0]:
            diffs = ", ".join(f"{f}: {a} vs {b}" for f, a, b in zip(fields, rows[0], row) if a != b)
            raise ValueError(f"rank 0 and rank {rank} built different ZeRO layouts ({diffs}); every rank must "
                             f"build the same model with the same zero/precision config before initialize()")


def _build_chunks(params, plans, ecfg: EngineConfig, ctx, placement: Placement, init_values) -> list[Chunk]:
    dtype = compute_dtype(ecfg.precision)
    stage = ecfg.zero.stage
    param_home = "host" if ecfg.zero.offload_param.device == "cpu" else "device"
    by_name = {name: p for name, p, _ in params}
    chunks = []
    for plan in plans:
        chunk_params = [by_name[s.name] for s in plan.slots]
        chunk = Chunk(plan, chunk_params, dtype=dtype, device=ctx.device, rank=ctx.rank, group=ctx.group,
                      persistent_full=stage < 3, shard_device=placement.torch_device(param_home),
                      pin_memory=ecfg.zero.offload_param.pin_memory, shard_home=param_home)
        if init_values is not None:  # meta model: this rank fills only its shard; params leave meta
            chunk.load_shard(init_values.chunk_shard(plan, chunk.shard_index, dtype))
            swap_meta_for_empty(chunk_params)
        else:
            chunk.load_full(torch.cat([to_local(p).detach().reshape(-1).to(ctx.device, dtype)
                                        for p in chunk_params]))
        chunk.bind_params()
        chunks.append(chunk)
    return chunks


def initialize(model: nn.Module, optimizer: Any, criterion: Any = None, train_dataloader: Any = None,
               eval_dataloader: Any = None, lr_scheduler: Any = None, config: Any = None, ctx: Any = None):
    """Wrap `model` and `optimizer` in a ZeRO engine configured by `config`.

    Args:
        model: any nn.Module (model_zoo GPT, HF GPT2LMHeadModel, ...); its parameters become views
            into chunk buffers (stage 3: empty between uses). Its parameters may be on the meta device if it
            has `init_param_range(name, start, end)` (model_zoo GPT built under torch.device("meta")) or was
            built inside zerogpt.ZeroInitContext: each rank then fills only its own shards.
        optimizer: a torch optimizer built on model.parameters() (class, hyperparameters and param
            groups are kept; its state will exist only for this rank's shard), or dict(type=..., **kw).
        config: a zerogpt.Config (or dict) with `zero`, `precision`, `GRADIENT_ACCUMULATION`,
            `clip_grad_norm`, or an EngineConfig.
        ctx: the context from launch_from_torch (default: from torch.distributed and LOCAL_RANK).
    Returns:
        (engine, train_dataloader, eval_dataloader, lr_scheduler)

    Example:
        >>> engine, _, _, _ = zerogpt.initialize(model, torch.optim.AdamW(model.parameters()), config=cfg)
    """
    ctx = ctx or _default_context()
    if isinstance(config, EngineConfig):
        ecfg, run_config = config, None
    else:
        run_config = config if isinstance(config, Config) else Config(config or {})
        ecfg = engine_config(run_config, ctx.world_size)
    if dist.is_initialized() and dist.get_world_size(ctx.group) != ctx.world_size:
        raise ValueError(f"ctx.world_size={ctx.world_size} but the process group has "
                         f"{dist.get_world_size(ctx.group)} ranks; pass the context from launch_from_torch")
    zero = ecfg.zero
    logger = _logger(ctx)
    host = ecfg.host.with_env_overrides()
    # compute on the host: see host_memory.py (a device run's host holds little that is freed every step)
    keeps_freed_memory = ctx.device.type == "cpu" and host.keep_freed_memory and keep_freed_host_memory()

    optimizer, no_decay = _resolve_optimizer(optimizer, model, host.cpu_adam)
    params = _param_groups(model, optimizer)
    _check_devices(params)

    # A meta model: values per shard from its init_param_range (model_zoo GPT built on meta, meta_init.py) or
    # replayed from what ZeroInitContext recorded (any model, init_ctx.py); None for a model with real weights.
    init_values = range_init(model) or recorded_init(model)
    num_shards = 1 if zero.stage == 0 else ctx.world_size
    element_size = torch.empty(0, dtype=compute_dtype(ecfg.precision)).element_size()
    # the local shapes: with tensor parallelism a chunk holds this rank's shard of a DTensor parameter
    shapes = [(n, tuple(to_local(p).shape), g) for n, p, g in params]
    plans = plan_chunks(shapes, zero.shard_strategy, num_shards, element_size)
    _check_same_plan(plans, ecfg, ctx)
    optim_home = {"none": "device", "cpu": "host", "disk": "disk"}[zero.offload_optimizer.device]
    if optim_home == "disk":
        state_bytes = sum(p.shard_numel for p in plans if p.trainable) * 4 * 3
        # torchrun sets LOCAL_WORLD_SIZE: the ranks of this node, whose files share the path
        check_disk_path(zero.offload_optimizer.path, state_bytes, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    placement = Placement(ctx.device, pin_memory=zero.offload_optimizer.pin_memory,
                          disk_path=zero.offload_optimizer.path, rank=ctx.rank)
    chunks = _build_chunks(params, plans, ecfg, ctx, placement, init_values)
    for b_name, value in (init_values.buffer_values() if init_values is not None else {}).items():
        _set_buffer(model, b_name, value)
    for b_name, buf in model.named_buffers():
        if buf.device != ctx.device:
            _set_buffer(model, b_name, buf.to(ctx.device))

    param_to_chunk = {}
    for chunk in chunks:
        for slot_index, p in enumerate(chunk.params):
            param_to_chunk[id(p)] = (chunk.plan.index, slot_index)
    grad_hooks = GradReduceHooks(model, chunks, param_to_chunk, stage=zero.stage)
    gather_hooks = Stage3GatherHooks(model, chunks, param_to_chunk, prefetch=zero.prefetch) if zero.stage == 3 else None

    scaler_cfg = zero.loss_scale
    loss_scaler = DynamicLossScaler(scaler_cfg.initial_scale, scaler_cfg.growth_factor, scaler_cfg.backoff_factor,
                                    scaler_cfg.growth_interval, scaler_cfg.hysteresis, scaler_cfg.min_scale,
                                    scaler_cfg.max_scale, enabled=ecfg.precision == "fp16")
    sharded_optim = ShardedOptimizer(optimizer, chunks, placement=placement, optim_home=optim_home,
                                     precision=ecfg.precision, stage=zero.stage, group=ctx.group,
                                     loss_scaler=loss_scaler, clip_grad_norm=ecfg.clip_grad_norm,
                                     no_decay=no_decay, norm_skip=set(getattr(ctx, "norm_skip", ())),
                                     model_parallel_group=getattr(ctx, "model_parallel_group", None))
    shm = open_transport(ctx.group) if host.shm_collectives and _shares_host_memory(ctx) else None
    engine = Engine(model, sharded_optim, chunks, grad_hooks, gather_hooks, placement, ecfg, ctx, logger, criterion,
                    run_config, host_settings=dict(keep_freed_memory=keeps_freed_memory,
                                                   shm_collectives=shm is not None))
    logger.info(engine.describe())
    return engine, train_dataloader, eval_dataloader, lr_scheduler


def _shares_host_memory(ctx: Any) -> bool:
    """Whether the shared-memory transport could carry this run's collectives (gloo on CPU tensors)."""
    if not dist.is_initialized() or ctx.world_size < 2 or ctx.device.type != "cpu":
        return False
    backend = str(dist.get_backend(ctx.group))
    return backend == "gloo" or "cpu:gloo" in backend


def _set_buffer(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, buf_name = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    module._buffers[buf_name] = value
