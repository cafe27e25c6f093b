"""Sharded checkpoints of a ZeRO engine that reshard across tensor (T), pipeline (P) and data (D) parallelism.

A checkpoint maps `Engine.state_dict()` to files: `meta.json` (names, global shapes, where every piece lives,
(T, P, D), hyperparameters, the caller's extra_state; JSON only, nothing executes on load), one safetensors file
per rank and chunk holding fp32 masters and optimizer state as pieces, per-rank RNG state, the module's buffers
and the resolved config.py. A piece is a flat element range of one rank's local tensor of one parameter, and
records that tensor's layout in the unsharded parameter (zerogpt/parallel/layout.py), so each distinct element
is saved once (a TP-replicated parameter by TP rank 0 only, a pipeline stage its own parameters, the last
stage's copy of the tied head not at all) and a rank of any other (T, P, D), stage or shard strategy reads the
elements it needs straight from the files that hold them: a read, not a gather. Saving is atomic (a `.tmp`
directory renamed by global rank 0 once every rank is done; a full disk on any rank removes it on every rank's
word and raises CheckpointNotSaved everywhere). Everything comes from the engine's `state_dict()`: the shard
tensors, each shard's ShardMap (which parameter ranges it holds), each parameter's layout and the tied names;
nothing here knows chunks. The files are read by checkpoint_reader.py.
"""
from __future__ import annotations

import dataclasses
import errno
import json
import os
import random
import shutil
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from zerogpt.atomic_write import write_json_atomic
from zerogpt.checkpoint_reader import (BUFFERS, FORMAT, META, VERSION, CheckpointError, CheckpointReader,
                                       resolve_checkpoint)
from zerogpt.context import DistContext
from zerogpt.parallel.layout import ParamLayout
from zerogpt.zero.shard_map import ShardMap

__all__ = ["save_engine", "load_engine", "CheckpointedEngine", "CheckpointReader", "CheckpointError",
           "CheckpointNotSaved", "resolve_checkpoint"]

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class CheckpointedEngine(Protocol):
    """What a checkpoint reads of an engine (zerogpt.Engine): its state, and what meta.json records beside it."""

    ctx: DistContext
    stage: int
    config: Any
    """The engine config: meta.json records its precision."""
    module: nn.Module
    """The model: meta.json records its class and config, for export and generate."""
    run_config: Any
    """The whole run's Config, saved as config.py; None when the engine was built without one."""

    def state_dict(self) -> dict[str, Any]:
        """Live shard tensors with their ShardMaps, layouts and tied names (Engine.state_dict)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put a state_dict in force (all ranks call)."""


class CheckpointNotSaved(OSError):
    """A save that ran out of disk space on some rank: nothing of it is left, and every rank raises it alike.

    Attributes: directory (the checkpoint that was not written), needed_bytes (what all ranks would have
    written, about), free_bytes (free in its parent now, after the partial directory was removed).
    """

    def __init__(self, directory: str, reason: str, needed_bytes: int, free_bytes: int):
        super().__init__(errno.ENOSPC, f"{directory} not saved: {reason}")
        self.directory, self.reason, self.needed_bytes, self.free_bytes = directory, reason, needed_bytes, free_bytes



# ------------------------------------------------------------------------------------------------
# helpers shared by save and load


def _barrier(ctx: DistContext) -> None:
    if dist.is_initialized() and ctx.world_size > 1:
        dist.barrier()


def _all_gather_objects(obj: Any, ctx: DistContext) -> list[Any]:
    """Every rank's `obj`, in global rank order: files and meta.json span the run, not one data-parallel group."""
    if not dist.is_initialized() or ctx.world_size == 1:
        return [obj]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def _save_safetensors_atomic(tensors: dict[str, torch.Tensor], path: str) -> None:
    from safetensors.torch import save_file

    tmp = f"{path}.tmp.{os.getpid()}"
    save_file(tensors, tmp)
    os.replace(tmp, path)


def _model_description(module: torch.nn.Module) -> dict:
    """The model's class and config, so export/generate can rebuild or convert it without a config file.

    The config is plain JSON. A config's own `to_dict()` comes first: a transformers config is a dataclass too
    (transformers >= 5), but `dataclasses.asdict` keeps its `dtype` a torch.dtype, which meta.json cannot hold,
    while `to_dict()` is the form its config.json takes ("float32") and `from_dict` rebuilds it from.
    """
    cls = type(module)
    config = getattr(module, "config", None)
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    elif dataclasses.is_dataclass(config):
        config = dataclasses.asdict(config)
    else:
        config = None
    name = f"{cls.__module__}.{cls.__qualname__}"
    return {"class": name, "config": _plain_json(config, f"{name}.config")}


def _plain_json(value: Any, where: str) -> Any:
    """`value` as JSON values: a torch.dtype as its name ("bfloat16"), a tuple as a list; TypeError for the rest."""
    if isinstance(value, dict):
        return {str(k): _plain_json(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"{where} is a {type(value).__name__} ({value!r}), which a checkpoint's meta.json cannot "
                    f"record; make it a number, string, list, dict or torch.dtype in the model's config")


# ------------------------------------------------------------------------------------------------
# RNG


def _rng_state() -> tuple[dict[str, torch.Tensor], dict]:
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["cuda"] = torch.cuda.get_rng_state()
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    plain = {"python": [version, list(internal), gauss],
             "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]}
    return tensors, plain


def _set_rng_state(tensors: dict[str, torch.Tensor], plain: dict) -> None:
    torch.set_rng_state(tensors["torch"])
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["cuda"])
    version, internal, gauss = plain["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = plain["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


# ------------------------------------------------------------------------------------------------
# save


def _shard_sources(state: dict, shard: ShardMap) -> dict[str, torch.Tensor]:
    """{kind: flat shard tensor} of one chunk: the optimizer's (master, moments) if trainable, else the params."""
    if shard.trainable:
        return {k: v for k, v in state["optimizer"]["chunks"][shard.chunk].items()
                if isinstance(v, torch.Tensor) and v.dim() > 0}
    return {"param": state["frozen"][shard.chunk]}


def _shard_pieces(shard: ShardMap, sources: dict[str, torch.Tensor],
                  skip: set[str]) -> tuple[dict[str, torch.Tensor], list[list]]:
    """This rank's pieces of one chunk's shard tensors `sources`, leaving out the parameters in `skip`:
    ({key: tensor}, [[kind, name, start, end, key], ...]), start/end in the local tensor."""
    tensors, index = {}, []
    for kind, flat in sources.items():
        flat = flat.detach()
        for piece in shard.pieces:
            if piece.name in skip:
                continue
            key = f"{kind}/{piece.name}@{piece.start}"
            # clone: safetensors refuses tensors that share storage, and the piece must outlive a later step
            tensors[key] = flat[piece.shard_slice].to("cpu", torch.float32).clone()
            index.append([kind, piece.name, piece.start, piece.end, key])
    return tensors, index


def _saves(shard: ShardMap, ctx: DistContext) -> bool:
    """Whether this rank saves `shard`: a replicated one (stage 0) by data-parallel rank 0 only."""
    return not shard.replicated or ctx.dp_rank == 0


def _optimizer_meta(state: dict) -> dict:
    """Hyperparameters per param group and the scalar state (Adam's step), which is the same for every shard."""
    optimizer = state["optimizer"]
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in optimizer["param_groups"]]
    scalars: dict[str, dict[str, float]] = {}
    for shard in state["shards"].values():
        for key, value in optimizer["chunks"].get(shard.chunk, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() == 0 or isinstance(value, (int, float)):
                scalars.setdefault(str(shard.group), {})[key] = float(value)
    return {"class": optimizer["class"], "param_groups": groups, "scalars": scalars}


def _saved_elsewhere(state: dict, ctx: DistContext) -> set[str]:
    """Parameters this rank holds but does not save, so each element is written once: a tied copy (its canonical
    parameter is saved), and on tensor-parallel ranks other than 0 a replicated (whole) parameter."""
    return {n for n, layout in state["layouts"].items()
            if n in state["tied"] or (ctx.tp_rank != 0 and layout.is_whole)}


def _write_rank_files(state: dict, ctx: DistContext, tmp: str) -> dict[str, dict]:
    """This rank's chunk shard files; returns {file name: {"pieces": [...], "layouts": {name: layout}}}."""
    skip = _saved_elsewhere(state, ctx)
    layouts = state["layouts"]
    files: dict[str, dict] = {}
    for shard in state["shards"].values():
        if not _saves(shard, ctx):
            continue
        tensors, index = _shard_pieces(shard, _shard_sources(state, shard), skip)
        if tensors:
            fname = f"r{ctx.global_rank:05d}_c{shard.chunk:05d}.safetensors"
            _save_safetensors_atomic(tensors, os.path.join(tmp, fname))
            names = {piece[1] for piece in index}
            files[fname] = {"pieces": index,
                            "layouts": {n: layouts[n].to_json() for n in sorted(names) if not layouts[n].is_whole}}
    return files


def _rank_meta(state: dict, files: dict) -> dict:
    """What this rank contributes to meta.json (rank 0 merges every rank's, in rank order = model order)."""
    layouts, tied = state["layouts"], state["tied"]
    params = {name: {"shape": list(layouts[name].global_shape), "trainable": shard.trainable}
              for shard in state["shards"].values() for name in shard.params if name not in tied}
    return {"files": files, "params": params, "tied": tied, "buffers": sorted(state["buffers"]),
            "optimizer": _optimizer_meta(state)}


def save_engine(engine: CheckpointedEngine, directory: str, extra_state: dict | None = None) -> str:
    """Write `engine`'s state to `directory` (every rank of the run calls). Returns the absolute directory.

    extra_state must be JSON-serialisable (the trainer's state_dict is): a checkpoint never holds pickles.
    Raises CheckpointNotSaved on every rank when any rank's disk is full (ENOSPC, EDQUOT): the partial directory
    is removed, an existing checkpoint of that step is left in place, and the ranks stay in step.
    """
    ctx = engine.ctx
    final = os.path.abspath(directory)
    parent, name = os.path.split(final)
    tmp = os.path.join(parent, f".{name}.tmp")
    try:
        extra_json = json.loads(json.dumps(extra_state or {}))
    except TypeError as e:
        raise TypeError(f"save_checkpoint(extra_state=...) must be JSON-serialisable (no pickles in checkpoints): {e}")
    state = engine.state_dict()
    mine: dict[str, Any] = {"bytes": _planned_bytes(state, ctx)}
    try:
        if ctx.global_rank == 0:
            os.makedirs(parent, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed while saving
            os.makedirs(tmp)
        _barrier(ctx)
        files = _write_rank_files(state, ctx, tmp)
        rng_tensors, rng_plain = _rng_state()
        _save_safetensors_atomic(rng_tensors, os.path.join(tmp, f"rng_r{ctx.global_rank:05d}.safetensors"))
        buffer_file = None
        if ctx.dp_rank == 0 and ctx.tp_rank == 0 and state["buffers"]:  # one copy per pipeline stage
            buffer_file = BUFFERS if ctx.global_rank == 0 else f"buffers_r{ctx.global_rank:05d}.safetensors"
            buffers = {n: b.detach().cpu().clone() for n, b in state["buffers"].items()}
            _save_safetensors_atomic(buffers, os.path.join(tmp, buffer_file))
        mine.update(_rank_meta(state, files), rng=rng_plain, buffer_file=buffer_file)
    except OSError as e:
        if e.errno not in NO_SPACE:
            raise
        mine["error"] = e.strerror or str(e)
    gathered = _all_gather_objects(mine, ctx)   # every rank learns whether any rank failed
    error = next((part["error"] for part in gathered if "error" in part), None)
    if error is None:
        if ctx.global_rank == 0:
            try:
                _finish_save(engine, state, ctx, gathered, extra_json, tmp, final)
            except OSError as e:
                if e.errno not in NO_SPACE:
                    raise
                error = e.strerror or str(e)
        error = _all_gather_objects(error, ctx)[0]  # how rank 0's meta.json and rename went (and a barrier)
    if error is not None:
        if ctx.global_rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        _barrier(ctx)
        free = shutil.disk_usage(parent).free if os.path.isdir(parent) else 0
        raise CheckpointNotSaved(final, error, sum(part["bytes"] for part in gathered), free)
    return final


def _finish_save(engine: CheckpointedEngine, state: dict, ctx: DistContext, gathered: list[dict], extra_json: dict,
                 tmp: str, final: str) -> None:
    """Rank 0: meta.json from every rank's part, config.py, then the rename that makes the checkpoint."""
    parent, name = os.path.split(final)
    meta = {
        "format": FORMAT, "version": VERSION,
        "world_size": ctx.world_size, "parallel": ctx.parallel_sizes,
        "stage": engine.stage, "precision": engine.config.precision,
        "global_step": state["global_step"],
        "model": _model_description(engine.module),
        "loss_scaler": state["optimizer"]["loss_scaler"],
        "extra_state": extra_json,
        **_merge_rank_meta(gathered, tmp),
    }
    if engine.run_config is not None:
        with open(os.path.join(tmp, "config.py"), "w") as f:
            f.write(engine.run_config.to_python())
    write_json_atomic(os.path.join(tmp, META), meta)  # last: its presence marks a complete checkpoint
    if os.path.exists(final):  # re-saving a step: move the old one aside, never delete before the new is in
        old = os.path.join(parent, f".{name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(parent)


def _start_fresh(live: dict[str, torch.Tensor], keep: set[str]) -> None:
    """Zero the optimizer state a checkpoint does not hold (one saved before the first step, the weights alone),
    as a new optimizer's is: an engine that has trained must not step on from its own moments and step count."""
    for key, value in live.items():
        if key not in keep and key != "master":
            live[key] = value.new_zeros(()) if value.dim() == 0 else value.zero_()


def _planned_bytes(state: dict, ctx: DistContext) -> int:
    """About what this rank's shard files take (fp32 pieces; the small RNG and buffer files left out)."""
    return sum(4 * len(_shard_sources(state, shard)) * sum(piece.end - piece.start for piece in shard.pieces)
               for shard in state["shards"].values() if _saves(shard, ctx))


def _merge_rank_meta(gathered: list[dict], tmp: str) -> dict:
    """meta.json's params, tied, files, buffers, optimizer and rng from every rank's part."""
    params: dict[str, dict] = {}
    tied: dict[str, str] = {}
    files: dict[str, dict] = {}
    buffers: dict[str, str] = {}
    scalars: dict[str, dict[str, float]] = {}
    for part in gathered:
        tied.update(part["tied"])
        for name, info in part["params"].items():
            if name in params and params[name]["shape"] != info["shape"]:
                raise ValueError(f"parameter {name!r} has global shape {params[name]['shape']} on one rank and "
                                 f"{info['shape']} on another; the ranks' param_layouts disagree")
            params.setdefault(name, info)
        for fname, entry in part["files"].items():
            files[fname] = {"bytes": os.path.getsize(os.path.join(tmp, fname)), **entry}
        if part["buffer_file"]:
            buffers.update({n: part["buffer_file"] for n in part["buffers"]})
        for group, values in part["optimizer"]["scalars"].items():
            scalars.setdefault(group, {}).update(values)
    params = {n: info for n, info in params.items() if n not in tied}  # a copy declared on another stage
    optimizer = dict(gathered[0]["optimizer"], scalars=scalars)
    return {"params": params, "tied": tied, "files": files, "buffers": sorted(buffers), "buffer_files": buffers,
            "optimizer": optimizer, "rng": [part["rng"] for part in gathered]}


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------------------
# load


def _check_compatible(reader: CheckpointReader, ctx: DistContext, layouts: dict[str, ParamLayout],
                      tied: dict[str, str]) -> None:
    """Every parameter of the model (all ranks together) is in the checkpoint with the same global shape and
    the reverse; else every rank raises with the list of what differs."""
    saved = reader.meta["params"]
    problems, names = [], set()
    for name, layout in layouts.items():
        source = tied.get(name, name) if name not in saved else name
        names.add(source)
        if source not in saved:
            problems.append(f"  {name}: in the model {list(layout.global_shape)}, not in the checkpoint")
        elif list(layout.global_shape) != saved[source]["shape"]:
            problems.append(f"  {name}: model {list(layout.global_shape)} vs checkpoint {saved[source]['shape']}")
    gathered = _all_gather_objects((names, problems), ctx)
    model_names = set().union(*(n for n, _ in gathered))
    problems = list(dict.fromkeys(p for _, part in gathered for p in part))
    problems += [f"  {n}: in the checkpoint {saved[n]['shape']}, not in the model" for n in saved if n not in model_names]
    if problems:
        raise CheckpointError(f"checkpoint {reader.directory} is of another model; mismatched tensors:\n"
                              + "\n".join(problems))


def _saved_name(reader: CheckpointReader, name: str, tied: dict[str, str]) -> str:
    """The name `name`'s values are saved under: itself, or the canonical parameter of a tied copy."""
    return name if name in reader.meta["params"] else tied.get(name, name)


def _read_shard(reader: CheckpointReader, shard: ShardMap, kind: str, layouts: dict[str, ParamLayout],
                tied: dict[str, str]) -> torch.Tensor:
    """This rank's shard (padding zero) of `kind`, read from the saved pieces."""
    out = torch.zeros(shard.numel, dtype=torch.float32)
    for piece in shard.pieces:
        out[piece.shard_slice] = reader.read(kind, _saved_name(reader, piece.name, tied), layouts[piece.name],
                                             piece.start, piece.end)
    return out


def load_engine(engine: CheckpointedEngine, directory: str) -> dict:
    """Load a checkpoint written at any (T, P, D), stage or shard strategy (every rank of the run calls).

    The engine's own `state_dict()` names what to read and where each local tensor lies in the unsharded
    parameters: each rank reads its shard ranges straight into the live tensors from the files that hold them
    (peak extra memory: one chunk's shard), then `engine.load_state_dict()` puts it in force. A last pipeline
    stage's copy of the tied head is read from the canonical parameter (wte). Returns the extra_state saved with
    it. RNG states are restored when (T, P, D) is the same (exact resume); at another layout each rank keeps the
    seed it was launched with. A checkpoint of weights alone (meta's optimizer state None, with a reason: an import
    from Megatron-LM) loads the masters and starts the optimizer fresh, saying so.
    """
    ctx = engine.ctx
    reader = CheckpointReader(directory)
    state = engine.state_dict()
    layouts, tied = state["layouts"], {**reader.tied, **state["tied"]}
    _check_compatible(reader, ctx, layouts, tied)
    # RNG states are read before anything is loaded, and a bad file on any rank stops every rank here (one rank
    # raising while the others went on into load_state_dict's collectives would hang them)
    rng, error = None, None
    if reader.parallel == ctx.parallel_sizes and reader.meta["rng"]:  # an import holds no RNG state
        try:
            rng = reader.rng_tensors(ctx.global_rank)
        except CheckpointError as e:
            error = str(e)
    errors = [part for part in _all_gather_objects(error, ctx) if part]
    if errors:
        raise CheckpointError(errors[0])
    optim_state = state["optimizer"]
    if "state" in reader.meta["optimizer"] and reader.meta["optimizer"]["state"] is None:
        # Weights alone (zerogpt_tools.import_megatron writes these): the masters are read below, the moments
        # start fresh (below), while the optimizer's hyperparameters and loss scale stay as this run built them.
        ctx.logger.info(f"{reader.directory} holds no optimizer state ({reader.meta['optimizer']['reason']}): "
                        f"the optimizer starts fresh from these weights")
    else:
        saved_groups = reader.meta["optimizer"]["param_groups"]
        if len(saved_groups) != len(optim_state["param_groups"]):
            raise CheckpointError(f"checkpoint {reader.directory} has {len(saved_groups)} optimizer param "
                                  f"groups, the optimizer has {len(optim_state['param_groups'])}; build the "
                                  f"optimizer as the run did")
        optim_state["param_groups"] = saved_groups
        optim_state["loss_scaler"] = reader.meta["loss_scaler"]
    scalars = reader.meta["optimizer"]["scalars"]
    with torch.no_grad():
        for shard in state["shards"].values():
            if not shard.trainable:
                state["frozen"][shard.chunk].copy_(_read_shard(reader, shard, "param", layouts, tied))
                continue
            live = optim_state["chunks"][shard.chunk]
            kinds = reader.kinds(_saved_name(reader, shard.params[0], tied))
            saved_scalars = scalars.get(str(shard.group), {})
            _start_fresh(live, keep={*kinds, *saved_scalars})
            for kind in kinds:
                values = _read_shard(reader, shard, kind, layouts, tied)
                target = live.get(kind)
                if isinstance(target, torch.Tensor) and target.shape == values.shape:
                    target.copy_(values)  # in place: keeps its home (pinned host, memory-mapped disk)
                else:
                    live[kind] = values
            for key, value in saved_scalars.items():
                live[key] = torch.tensor(value, dtype=torch.float32)
        for name in reader.meta["buffers"]:
            if name in state["buffers"]:
                state["buffers"][name] = reader.tensor(name)
    state["global_step"] = reader.meta["global_step"]
    engine.load_state_dict(state)
    if rng is not None:
        _set_rng_state(rng, reader.meta["rng"][ctx.global_rank])
    _barrier(ctx)
    return reader.meta["extra_state"]
