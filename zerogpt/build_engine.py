"""`initialize()`: a model + optimizer + config -> a complete ZeRO `Engine`.

Two phases. The planner (`zerogpt/planner/engine_plan.py`, `plan_engine`) first makes every decision of the build
into one frozen `EnginePlan`: the chunk layout, the homes and dtypes of parameters, gradients, masters and optimizer
state, and what a GPU computing changes. Nothing is built yet, and the plan is checked to be the same on every rank.
Then this file executes the plan in named steps and decides nothing: pack the parameters into chunks (a meta
model: each rank fills only its shards), place the buffers, register the hooks (after packing: they refer to chunk
slots), build the sharded optimizer, then the gradient's path to it. The Engine is complete when initialize
returns; nothing is set on it afterwards.
"""
from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zerogpt.amp import DynamicLossScaler
from zerogpt.compile import find_blocks
from zerogpt.config import Config, EngineConfig, engine_config, optimizer_class
from zerogpt.context import DistContext
from zerogpt.engine import Engine
from zerogpt.host_memory import keep_freed_host_memory, release_freed_host_memory
from zerogpt.parallel.parallel_model import ParallelModel
from zerogpt.planner.engine_plan import EnginePlan, model_computes_loss, plan_engine
from zerogpt.zero.chunk import Chunk, to_local
from zerogpt.zero.comm import all_gather_flat
from zerogpt.zero.gather_hooks import Stage3GatherHooks
from zerogpt.zero.grad_hooks import GradReduceHooks
from zerogpt.zero.grad_path import GradPath
from zerogpt.zero.init_ctx import recorded_init, swap_meta_for_empty
from zerogpt.zero.meta_init import range_init
from zerogpt.zero.offload import Placement, Traffic, check_disk_path
from zerogpt.zero.shard_map import ShardMap
from zerogpt.zero.sharded_optim import ShardedOptimizer
from zerogpt.zero.shm import open_transport
from zerogpt.zero.step_wait_hooks import StepWaitHooks

__all__ = ["initialize", "colossalai_initialize", "EnginePlan", "plan_engine"]


def initialize(model: nn.Module | ParallelModel, optimizer: Any, criterion: Any = None, *, config: Any,
               ctx: DistContext) -> Engine:
    """Wrap `model` and `optimizer` in a ZeRO engine configured by `config`, on this rank of `ctx`.

    Args:
        model: any nn.Module (model_zoo GPT, HF GPT2LMHeadModel, ...), or the ParallelModel that
            `zerogpt.parallel.plan.parallelize` made of one (then `ctx` must be on its mesh). Its parameters become
            views into chunk buffers (stage 3: empty between uses). They may be on the meta device if the model has
            `init_param_range(name, start, end)` (model_zoo GPT built under torch.device("meta")) or was built
            inside zerogpt.ZeroInitContext: each rank then fills only its own shards.
        optimizer: a torch optimizer built on model.parameters() (class, hyperparameters and param groups are
            kept; its state will exist only for this rank's shard), or dict(type=..., **kw).
        criterion: loss(logits, labels), kept as `engine.criterion` (the Trainer calls it).
        config: a zerogpt.Config (or dict) with `zero`, `precision`, `GRADIENT_ACCUMULATION`, `clip_grad_norm`,
            or an EngineConfig.
        ctx: this process's DistContext (`zerogpt.launch_from_torch`, or `DistContext.current()`).

    Example:
        >>> engine = zerogpt.initialize(model, torch.optim.AdamW(model.parameters()), config=cfg, ctx=ctx)
    """
    parallel = model if isinstance(model, ParallelModel) else ParallelModel(model)
    module = parallel.module
    if dist.is_initialized() and dist.get_world_size(ctx.dp_group) != ctx.dp_size:
        raise ValueError(f"ctx.dp_size={ctx.dp_size} but its process group has {dist.get_world_size(ctx.dp_group)} "
                         f"ranks; pass the context from launch_from_torch (or DistContext.current())")
    ecfg, run_config = _engine_config(config, ctx)
    host = ecfg.host.with_env_overrides()  # the config resolved whole (sections, then the environment) first
    parallel.dims.check_zero_stage(ecfg.zero.stage)
    if parallel.dims.model_parallel and ctx.mesh is None:
        raise ValueError("a parallelized model needs its mesh in the context: initialize(parallel, ..., "
                         "ctx=ctx.with_mesh(mesh)) with the mesh parallelize() was given")

    if ecfg.precision == "fp8":  # before chunking: Float8Linear keeps each weight Parameter (zerogpt/fp8.py)
        from zerogpt.fp8 import convert_for_device

        convert_for_device(module, ctx.device)
    optimizer, no_decay = _resolve_optimizer(optimizer, module, host.cpu_adam)
    params = _param_groups(module, optimizer)
    _check_devices(params)
    plan = plan_engine(ecfg, params, ctx, frozenset(no_decay), host, _device_free_bytes(ctx.device),
                       optimizer_type=type(optimizer), computes_loss=model_computes_loss(module))
    _check_same_plan(plan, ctx)
    _log_offload_plan(plan, ctx)
    if plan.disk_bytes:
        check_disk_path(plan.config.zero.offload_optimizer.path, plan.disk_bytes, ctx.local_world_size)

    # compute on the host: see host_memory.py (a device run's host holds little that is freed every step)
    keeps_freed_memory = plan.keep_freed_memory and keep_freed_host_memory()
    transport = open_transport(ctx.dp_group) if plan.shm_collectives else None
    placement = Placement(ctx.device, pin_memory=plan.pins_host_state,
                          disk_path=plan.config.zero.offload_optimizer.path, rank=ctx.dp_rank)
    # A meta model: values per shard from its init_param_range (model_zoo GPT built on meta, meta_init.py) or
    # replayed from what ZeroInitContext recorded (any model, init_ctx.py); None for a model with real weights.
    init_values = range_init(module) or recorded_init(module)
    traffic = Traffic()  # host<->device bytes, counted by the chunks, the optimizer's write-back and the engine
    chunks = _build_chunks(params, plan, ctx, placement, transport, init_values, traffic)
    _place_buffers(module, ctx.device, init_values.buffer_values() if init_values is not None else {})
    grad_hooks, gather_hooks = _register_hooks(module, chunks, plan)
    if plan.config.compile:  # after the hooks: they stay outside the compiled blocks (stage 3: one pair per block)
        from zerogpt.compile import compile_blocks

        compile_blocks(module, gather_hooks=gather_hooks, logger=ctx.logger)
    step_waits = None
    if plan.forward_waits_for_step:  # the host step may run behind the next forward
        step_waits = StepWaitHooks(module, chunks, grad_hooks.param_to_chunk, find_blocks(module))
    sharded_optim = _build_optimizer(optimizer, chunks, plan, ctx, placement, parallel, traffic, step_waits)
    host_step = sharded_optim.host_step
    grad_path = GradPath(sharded_optim.states, placement, traffic, hand_over_at_launch=plan.hand_over_at_launch,
                         accumulate_on_device=plan.accumulate_on_device, stage=plan.stage,
                         accumulation=plan.config.gradient_accumulation, host_step_waits=host_step.overlaps,
                         on_final=host_step.speculate_chunk if host_step.spares else None)
    if keeps_freed_memory:  # the build's own garbage goes; training's heap is kept from here on
        release_freed_host_memory()
    engine = Engine(module, sharded_optim, chunks, grad_hooks, gather_hooks, grad_path, placement, plan, ctx,
                    criterion=parallel.criterion(criterion), parallel=parallel, transport=transport,
                    run_config=run_config, keeps_freed_memory=keeps_freed_memory, traffic=traffic)
    ctx.logger.info(engine.describe())
    return engine


def colossalai_initialize(model: nn.Module | ParallelModel, optimizer: Any, criterion: Any = None,
                          train_dataloader: Any = None, test_dataloader: Any = None, lr_scheduler: Any = None, *,
                          config: Any, ctx: DistContext) -> tuple[Engine, Any, Any, Any]:
    """Colossal-AI's `initialize` call as its GPT-2 tutorial writes it: (engine, train_dataloader,
    test_dataloader, lr_scheduler), the last three handed back unchanged."""
    engine = initialize(model, optimizer, criterion, config=config, ctx=ctx)
    return engine, train_dataloader, test_dataloader, lr_scheduler


# -- plan --------------------------------------------------------------------------------------------------------

def _engine_config(config: Any, ctx: DistContext) -> tuple[EngineConfig, Config | None]:
    """The engine's config at this data-parallel size, and the whole run config when there is one (checkpoints
    record it as config.py)."""
    if config is None:
        raise TypeError("initialize() needs config=: a zerogpt.Config, a dict or an EngineConfig")
    if isinstance(config, EngineConfig):
        return config, None
    run_config = config if isinstance(config, Config) else Config(config)
    return engine_config(run_config, ctx.dp_size), run_config


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


def _check_same_plan(plan: EnginePlan, ctx: DistContext) -> None:
    """Fail fast when ranks disagree on the chunk layout (different model or zero config per rank).

    Every later collective assumes the same chunks and sizes on every rank; a mismatch would
    otherwise surface mid-step as a hang or an opaque transport error. One tiny all-gather at init.
    """
    if not dist.is_initialized() or ctx.dp_size == 1:
        return
    layout = "|".join(f"{s.name}{s.shape}:{p.group_index}" for p in plan.chunks for s in p.slots)
    fields = ("zero.stage", "chunks", "padded elements", "precision + parameter layout hash")
    mine = torch.tensor([plan.stage, len(plan.chunks), sum(p.padded_numel for p in plan.chunks),
                         zlib.crc32(f"{plan.config.precision}|{layout}".encode())], dtype=torch.int64,
                        device=ctx.device)
    every = torch.empty(ctx.dp_size * len(fields), dtype=torch.int64, device=ctx.device)
    all_gather_flat(every, mine, group=ctx.dp_group)
    rows = every.view(ctx.dp_size, len(fields)).tolist()
    for rank, row in enumerate(rows):
        if row != rows[0]:
            diffs = ", ".join(f"{f}: {a} vs {b}" for f, a, b in zip(fields, rows[0], row) if a != b)
            raise ValueError(f"data-parallel rank 0 and rank {rank} built different ZeRO layouts ({diffs}); every "
                             f"rank must build the same model with the same zero/precision config before "
                             f"initialize()")


def _device_free_bytes(device: torch.device) -> int | None:
    """Free memory of the compute device now (None on a CPU-only run: host and device are one memory)."""
    if device.type != "cuda":
        return None
    return torch.cuda.mem_get_info(device)[0]


def _log_offload_plan(plan: EnginePlan, ctx: DistContext) -> None:
    """Say at build where offloaded gradients accumulate and which param chunks stay on the device."""
    mib = plan.grad_accum_bytes / 2**20
    if plan.accumulate_on_device:
        ctx.logger.info(f"gradients accumulate on the device over {plan.config.gradient_accumulation} micro-steps "
                        f"({mib:,.1f} MiB of fp32 shards) and cross to the host once per step")
    elif plan.grad_accum_bytes:
        ctx.logger.warning(f"gradients cross to the host at every micro-step: accumulating them on the device "
                           f"needs {mib:,.1f} MiB of fp32 shards, more than the device's free memory at build "
                           f"(more data-parallel ranks shrink the shards)")
    if plan.param_home == "host" and plan.resident_chunks:
        ctx.logger.info(f"zero.offload_param.device_budget: {len(plan.resident_chunks)} of {len(plan.chunks)} "
                        f"chunks' param shards stay on the device")


# -- build -------------------------------------------------------------------------------------------------------

def _build_chunks(params, plan: EnginePlan, ctx: DistContext, placement: Placement, transport: Any,
                  init_values: Any, traffic: Traffic | None = None) -> list[Chunk]:
    """Pack the parameters into chunks in the compute dtype; every parameter becomes a view of its slot."""
    by_name = {name: p for name, p, _ in params}
    chunks = []
    for chunk_plan in plan.chunks:
        chunk_params = [by_name[s.name] for s in chunk_plan.slots]
        home = plan.chunk_homes[chunk_plan.index]
        chunk = Chunk(chunk_plan, chunk_params, dtype=plan.compute_dtype, device=ctx.device, rank=ctx.dp_rank,
                      group=ctx.dp_group, persistent_full=plan.keeps_full_params,
                      shard_device=placement.torch_device(home),
                      pin_memory=plan.pins_param_shards, shard_home=home,
                      transport=transport, traffic=traffic)
        if init_values is not None:  # meta model: this rank fills only its shard, in place; params leave meta
            _fill_shard(chunk, init_values)
            swap_meta_for_empty(chunk_params)
        else:
            chunk.load_full(torch.cat([to_local(p).detach().reshape(-1).to(ctx.device, plan.compute_dtype)
                                       for p in chunk_params]))
        chunk.bind_params()
        chunks.append(chunk)
    return chunks


def _fill_shard(chunk: Chunk, init_values: Any) -> None:
    """Write this rank's shard of a meta model's chunk from `init_values.range_values(name, start, end)` (RangeInit,
    RecordedInit), straight into the chunk's own shard, casting while copying (no staging copy); stages 0-2 then
    all-gather the rest of the chunk."""
    with torch.no_grad():
        for piece in ShardMap.of(chunk.plan, chunk.shard_index).pieces:
            chunk.shard[piece.shard_slice].copy_(init_values.range_values(piece.name, piece.start, piece.end))
    chunk.all_gather_full()


def _place_buffers(model: nn.Module, device: torch.device, init: dict[str, torch.Tensor]) -> None:
    """Buffers onto the compute device: a meta model's from their recorded init values, the others moved."""
    persistent = set(model.state_dict(keep_vars=True))
    for name, buf in list(model.named_buffers()):
        value = init.get(name, buf)
        if value is buf and buf.device == device:
            continue
        module_name, _, buf_name = name.rpartition(".")
        module = model.get_submodule(module_name) if module_name else model
        module.register_buffer(buf_name, value.to(device), persistent=name in persistent)


def _register_hooks(model: nn.Module, chunks: list[Chunk], plan: EnginePlan
                    ) -> tuple[GradReduceHooks, Stage3GatherHooks | None]:
    """Grad hooks at every stage; gather/release/prefetch at stage 3."""
    param_to_chunk = {id(p): (chunk.plan.index, slot) for chunk in chunks for slot, p in enumerate(chunk.params)}
    grad_hooks = GradReduceHooks(model, chunks, param_to_chunk, stage=plan.stage)
    gather_hooks = None
    if plan.stage == 3:
        gather_hooks = Stage3GatherHooks(model, chunks, param_to_chunk, prefetch=plan.config.zero.prefetch)
    return grad_hooks, gather_hooks


def _build_optimizer(optimizer: torch.optim.Optimizer, chunks: list[Chunk], plan: EnginePlan, ctx: DistContext,
                     placement: Placement, parallel: ParallelModel, traffic: Traffic,
                     step_waits: StepWaitHooks | None) -> ShardedOptimizer:
    """One ChunkState per trainable chunk at its home, and the fp16 loss scaler."""
    if plan.fused_device_step:
        _step_fused(optimizer)
    loss_scaler = DynamicLossScaler(plan.config.zero.loss_scale, enabled=plan.scales_loss)
    # On a GPU the host step runs behind the next forward (host masters); on a CPU run the two would share the
    # same cores, so it runs in place (the plan's host_step_overlaps).
    return ShardedOptimizer(optimizer, chunks, placement=placement, optim_home=plan.optim_home,
                            grad_home=plan.grad_home, master_is_param_shard=plan.master_is_param_shard,
                            precision=plan.config.precision, stage=plan.stage, group=ctx.dp_group,
                            loss_scaler=loss_scaler, clip_grad_norm=plan.config.clip_grad_norm,
                            no_decay=set(plan.no_decay), norm_duplicates=set(parallel.norm_duplicates),
                            model_parallel_group=ctx.model_parallel_group, traffic=traffic,
                            state_dtype=plan.state_dtype,
                            overlap_next_forward=plan.host_step_overlaps,
                            stage_compute_copies=plan.stages_compute_copies, step_waits=step_waits,
                            speculate=plan.host_step_speculates, host_step_threads=plan.host.step_threads)


def _step_fused(optimizer: torch.optim.Optimizer) -> None:
    """The plan's `fused_device_step`: each param group that leaves the implementation to torch (fused and foreach
    unset) steps with torch's fused kernel, the one that takes the step's non-finite flag (found_inf) on the device,
    so skipping such a step costs no host sync. A group where the user chose keeps the choice."""
    for group in optimizer.param_groups:
        if group.get("fused") is None and not group.get("foreach") and not group.get("capturable") \
                and not group.get("differentiable"):
            group["fused"] = True
