"""Preflight for memory: refuse, before anything is built, a run whose model state cannot fit this host or disk.

The bytes come from zerogpt/memory_model.py (the ZeRO accounting the engine holds, per rank, by home) applied to
the model's shape on the meta device; what is available from the kernel (MemAvailable, the cgroup's limit) and
the disk-offload directory's free space. A run that cannot fit ends in seconds with one line giving both numbers
and the fix, instead of being killed by the OOM killer minutes into the build (issue 30 point 5).
"""
from __future__ import annotations

import math
import os
import shutil
from typing import Any, Callable

from zerogpt.preflight import PreflightError

__all__ = ["available_host_bytes", "free_disk_bytes", "check_memory", "HOMES_ON_HOST"]

GIB = 2**30
HOMES_ON_HOST = ("host",)
"""Homes whose bytes are host RAM on a GPU run; a CPU run computes on the host, so every home but disk is."""


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            raw = f.read().strip()
    except OSError:
        return None
    return int(raw) if raw.isdigit() else None   # cgroup v2 "max" = no limit


def available_host_bytes() -> tuple[int, str]:
    """(bytes this process may still allocate, where the number comes from): the smaller of the kernel's
    MemAvailable and the room left under this cgroup's memory limit (v2 memory.max, v1 limit_in_bytes)."""
    best, source = None, "unknown"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    best, source = int(line.split()[1]) * 1024, "MemAvailable"
    except OSError:
        pass
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and usage is not None and limit < 2**60:
            room = max(limit - usage, 0)
            if best is None or room < best:
                best, source = room, f"cgroup limit {limit / GIB:.1f} GiB"
    return (best if best is not None else 2**62), source


def free_disk_bytes(path: str) -> int | None:
    """Free bytes at `path` (None when it is not there yet: the build's own check names that)."""
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _local_ranks(world_size: int) -> int:
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    except ValueError:
        return world_size


def _bucket_mb(strategy: Any) -> float:
    """The chunk size memory_model assumes for a shard strategy: its bucket_mb, 0 (one parameter per chunk) for
    TensorShardStrategy, 25 for a strategy of unknown sizes."""
    from zerogpt.config.strategy import TensorShardStrategy

    return 0.0 if isinstance(strategy, TensorShardStrategy) else getattr(strategy, "bucket_mb", 25.0)


def _model_type(cfg: Any) -> Any:
    """The config's model.type ("hf" for a Hugging Face checkpoint), None when it has no model section."""
    return dict(cfg["model"]).get("type") if "model" in cfg else None


def check_memory(cfg: Any, world_size: int, model: Callable[[], Any], on_gpu: bool | None = None) -> dict:
    """Refuse (PreflightError, one line) a run whose model state needs more host RAM or disk than is available.

    Args:
        cfg: the run's Config (zero, precision, compile, BATCH_SIZE, SEQ_LEN); world_size: the ranks torchrun
            starts.
        model: builds the model on the meta device (its shape: parameters, layers).
        on_gpu: whether the ranks compute on GPUs (None: torch.cuda.is_available(), as launch decides).
    Returns: what was compared, {"host": (need, available), "disk": (need, free) or None, ...} in bytes.
    """
    import torch

    from zerogpt.config import engine_config, parallel_config
    from zerogpt.config.dtypes import compute_dtype_name
    from zerogpt.parallel.mesh import ParallelDims
    from zerogpt.memory_model import CATEGORIES, ModelShape, estimate, model_state_bytes

    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    dims = ParallelDims.from_config(parallel_config(cfg), world_size)
    ecfg = engine_config(cfg, dims.dp)
    zero, precision = ecfg.zero, ecfg.precision
    precision = compute_dtype_name(precision)  # fp8: bf16 state and activations, float8 in matmuls
    try:
        built = model()
    except Exception:  # a model that does not build on meta (a local HF model): its shape is unknown here
        return {"host": None, "disk": None}
    params = {id(p): p for p in built.parameters() if p.requires_grad}  # tied weights once
    total = sum(p.numel() for p in params.values())
    psi = math.ceil(total / (dims.tp * dims.pp))  # this rank's part
    moment_bytes = 4 if zero.offload_optimizer.state_dtype == "bf16" else 8  # Adam's two moments per param
    states = model_state_bytes(psi, zero.stage, dims.dp, precision, zero.offload_optimizer.device,
                               zero.offload_param.device, optimizer_bytes_per_param=moment_bytes,
                               accumulation=ecfg.gradient_accumulation)
    homes = HOMES_ON_HOST if on_gpu else ("device", "host")
    per_rank = {h: sum(states[c][h] for c in CATEGORIES) for h in ("device", "host", "disk")}
    host_rank = sum(per_rank[h] for h in homes)
    config = getattr(built, "config", None)
    shape = ModelShape.from_config(config)  # a model_zoo GPT or Llama-family config (duck-typed); else None
    if shape is not None and shape.num_params != total:
        shape = None  # a config that reads alike but builds another model: its chunks are not these
    if shape is not None:
        # memory_model's whole estimate beside the model state: buffers (compile = True gathers each block whole at
        # stage 3, zerogpt/compile.py); on a CPU run the activations too, and what the two homes share counted once
        chunked = bool(getattr(config, "chunked_loss", False))
        est = estimate(shape, zero.stage, dims.dp, precision, zero.offload_optimizer.device, zero.offload_param.device,
                       cfg.SEQ_LEN, cfg.BATCH_SIZE, checkpoint=bool(getattr(config, "checkpoint", False)),
                       prefetch=zero.prefetch, bucket_mb=_bucket_mb(zero.shard_strategy), gpu_overhead=0,
                       accumulation=ecfg.gradient_accumulation, optimizer_bytes_per_param=moment_bytes,
                       gather_per_block=ecfg.compile,
                       loss_chunk=getattr(config, "loss_chunk_size", 0) if chunked else 0, on_gpu=on_gpu)
        # est["host_ram"] counts the whole model's state; this rank's (psi, under tensor/pipeline parallelism) is above
        host_rank += est["host_ram"] - sum(est["model_states"][c][h] for c in CATEGORIES for h in homes)
    ranks = _local_ranks(world_size)
    need, (available, source) = host_rank * ranks, available_host_bytes()
    what = (f"{psi / 1e9:.2f}B params per rank x {ranks} rank{'s' if ranks > 1 else ''}, stage {zero.stage}, "
            f"{precision}, offload_optimizer={zero.offload_optimizer.device} "
            f"({zero.offload_optimizer.state_dtype} moments), "
            f"offload_param={zero.offload_param.device}")
    if need > available:
        fixes = []
        if zero.offload_optimizer.device != "none" and zero.offload_optimizer.state_dtype == "fp32":
            fixes.append("keep Adam's moments in bf16 (--set zero.offload_optimizer.state_dtype=bf16, 4 bytes/param "
                         "less)")
        if zero.offload_optimizer.device != "disk":
            fixes.append("put the optimizer state on disk (--set zero.offload_optimizer.device=disk "
                         "--set zero.offload_optimizer.path=/nvme/dir)")
        if zero.stage < 3 and dims.dp > 1:
            fixes.append("shard more (--set zero.stage=3)")
        if shape is not None and shape.layers > 1 and _model_type(cfg) != "hf":  # a checkpoint's depth is fixed
            per_layer = need * shape.layer_params / max(psi * dims.tp * dims.pp, 1)
            fit = shape.layers - math.ceil((need - available) / max(per_layer, 1))
            if fit >= 1:
                key = "n_layer" if shape.family == "gpt2" else "num_hidden_layers"
                fixes.append(f"fewer layers (--set model.{key}={fit} fits)")
        fixes.append("more hosts")
        raise PreflightError(f"host memory: this run needs at least {need / GIB:.1f} GiB of host RAM for model "
                             f"state{'' if on_gpu else ', activations'} and buffers ({what}) but {available / GIB:.1f} "
                             f"GiB is available ({source}); " + ", or ".join(fixes))
    disk = None
    if zero.offload_optimizer.device == "disk" and zero.offload_optimizer.path:
        free = free_disk_bytes(zero.offload_optimizer.path)
        disk = (per_rank["disk"] * ranks, free)
        if free is not None and disk[0] > free:
            raise PreflightError(f"disk: this run writes {disk[0] / GIB:.1f} GiB of optimizer state ({what}) to "
                                 f"zero.offload_optimizer.path={zero.offload_optimizer.path!r} but it has "
                                 f"{free / GIB:.1f} GiB free; point zero.offload_optimizer.path at a larger disk, "
                                 f"or use fewer layers or more hosts")
    return {"host": (need, available), "disk": disk, "num_params": psi, "source": source}
