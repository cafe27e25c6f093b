"""Sharded, world-size-independent checkpoints of a ZeRO engine: save, load (reshard), read.

A checkpoint maps `Engine.state_dict()` to files: `meta.json` (names, shapes, where every piece lives,
hyperparameters, the caller's extra_state; JSON only, nothing executes on load), one safetensors file per
rank and chunk holding fp32 masters and optimizer state as pieces keyed by parameter name and element
range, per-rank RNG state, the module's buffers and the resolved config.py. Pieces keyed
by name and range read back at any world size, stage or shard strategy, and saving is atomic (a `.tmp`
directory renamed by rank 0 once every rank is done).
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

FORMAT = "zerogpt-checkpoint"
VERSION = 1
META = "meta.json"
BUFFERS = "buffers.safetensors"
_OPEN_FILES = 4  # shard files a reader keeps open at once


# ------------------------------------------------------------------------------------------------
# helpers shared by save and load


def _barrier(ctx: Any) -> None:
    if dist.is_initialized() and ctx.world_size > 1:
        dist.barrier(group=ctx.group)


def _all_gather_objects(obj: Any, ctx: Any) -> list[Any]:
    if not dist.is_initialized() or ctx.world_size == 1:
        return [obj]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj, group=ctx.group)
    return out


def _write_json_atomic(path: str, obj: Any) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _save_safetensors_atomic(tensors: dict[str, torch.Tensor], path: str) -> None:
    from safetensors.torch import save_file

    tmp = f"{path}.tmp.{os.getpid()}"
    save_file(tensors, tmp)
    os.replace(tmp, path)


def _model_description(module: torch.nn.Module) -> dict:
    """The model's class and config, so export/generate can rebuild or convert it without a config file."""
    cls = type(module)
    config = getattr(module, "config", None)
    if dataclasses.is_dataclass(config):
        config = dataclasses.asdict(config)
    elif hasattr(config, "to_dict"):
        config = config.to_dict()
    else:
        config = None
    return {"class": f"{cls.__module__}.{cls.__qualname__}", "config": config}


def _tied_aliases(module: torch.nn.Module) -> dict[str, str]:
    """{alias: canonical} for parameters reachable under two names (GPT-2's lm_head.weight = wte.weight)."""
    canonical: dict[int, str] = {}
    aliases = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in canonical:
            aliases[name] = canonical[id(p)]
        else:
            canonical[id(p)] = name
    return aliases


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


def _chunk_pieces(chunk: Any, sources: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[list]]:
    """This rank's pieces of one chunk's shard tensors `sources` ({kind: flat shard}):
    ({key: tensor}, [[kind, name, start, end, key], ...])."""
    plan = chunk.plan
    shard_index = chunk.shard_index
    lo, _ = plan.shard_range(shard_index)
    tensors, index = {}, []
    for kind, flat in sources.items():
        flat = flat.detach()
        for slot in plan.slots:
            overlap = plan.slot_overlap(slot, shard_index)
            if overlap is None:
                continue
            start, end = overlap[0] - slot.offset, overlap[1] - slot.offset
            key = f"{kind}/{slot.name}@{start}"
            # clone: safetensors refuses tensors that share storage, and the piece must outlive a later step
            tensors[key] = flat[overlap[0] - lo: overlap[1] - lo].to("cpu", torch.float32).clone()
            index.append([kind, slot.name, start, end, key])
    return tensors, index


def _optimizer_meta(optimizer: Any, chunks: list, state: dict) -> dict:
    """Hyperparameters per param group and the scalar state (Adam's step), which is the same for every shard."""
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in state["param_groups"]]
    scalars: dict[str, dict[str, float]] = {}
    for chunk in chunks:
        for key, value in state["chunks"].get(chunk.plan.index, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() == 0 or isinstance(value, (int, float)):
                scalars.setdefault(str(chunk.plan.group_index), {})[key] = float(value)
    return {"class": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}", "param_groups": groups,
            "scalars": scalars}


def _stage_directory(engine: Any, directory: str) -> str:
    """Where this engine's state goes: `directory`, or `directory/pp<stage>` for one stage of a pipeline.

    Each stage is a checkpoint of its own parameters (the last stage's tied head under `lm_head.weight`),
    written by its data-parallel ranks; it resumes at the same pipeline size.
    """
    pipeline = getattr(engine, "pipeline", None)
    if pipeline is None or pipeline.stages == 1:
        return directory
    return os.path.join(directory, f"pp{pipeline.stage:02d}")


def save_engine(engine: Any, directory: str, extra_state: dict | None = None) -> str:
    """Write `engine`'s state to `directory` (all ranks call). Returns the absolute directory.

    extra_state must be JSON-serialisable (the trainer's state_dict is): a checkpoint never holds pickles.
    """
    ctx = engine.ctx
    final = os.path.abspath(_stage_directory(engine, directory))
    parent, name = os.path.split(final)
    tmp = os.path.join(parent, f".{name}.tmp")
    try:
        extra_json = json.loads(json.dumps(extra_state or {}))
    except TypeError as e:
        raise TypeError(f"save_checkpoint(extra_state=...) must be JSON-serialisable (no pickles in checkpoints): {e}")
    if ctx.rank == 0:
        os.makedirs(parent, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed while saving
        os.makedirs(tmp)
    _barrier(ctx)

    files: dict[str, list[list]] = {}
    state = engine.state_dict()
    optimizer_state = state["optimizer"]["chunks"]  # {chunk index: {kind: shard or scalar}}, trainable
    for chunk in engine.chunks:
        if chunk.plan.num_shards == 1 and ctx.rank != 0:  # stage 0: every rank holds the same state
            continue
        if chunk.plan.trainable:
            sources = {k: v for k, v in optimizer_state[chunk.plan.index].items()
                       if isinstance(v, torch.Tensor) and v.dim() > 0}
        else:
            sources = {"param": state["frozen"][chunk.plan.index]}
        tensors, index = _chunk_pieces(chunk, sources)
        if tensors:
            fname = f"r{ctx.rank:05d}_c{chunk.plan.index:05d}.safetensors"
            _save_safetensors_atomic(tensors, os.path.join(tmp, fname))
            files[fname] = index
    rng_tensors, rng_plain = _rng_state()
    _save_safetensors_atomic(rng_tensors, os.path.join(tmp, f"rng_r{ctx.rank:05d}.safetensors"))
    if ctx.rank == 0:
        buffers = {n: b.detach().cpu().clone() for n, b in state["buffers"].items()}
        _save_safetensors_atomic(buffers, os.path.join(tmp, BUFFERS))

    gathered = _all_gather_objects({"files": files, "rng": rng_plain}, ctx)
    if ctx.rank == 0:
        all_files = {}
        for part in gathered:
            for fname, index in part["files"].items():
                all_files[fname] = {"bytes": os.path.getsize(os.path.join(tmp, fname)), "pieces": index}
        meta = {
            "format": FORMAT, "version": VERSION,
            "world_size": ctx.world_size, "stage": engine.stage, "precision": engine.config.precision,
            "global_step": state["global_step"],
            "params": {slot.name: {"shape": list(slot.shape), "trainable": chunk.plan.trainable}
                       for chunk in engine.chunks for slot in chunk.plan.slots},
            "buffers": sorted(state["buffers"]),
            "tied": _tied_aliases(engine.module),
            "model": _model_description(engine.module),
            "files": all_files,
            "optimizer": _optimizer_meta(engine.optimizer, engine.chunks, state["optimizer"]),
            "loss_scaler": state["optimizer"]["loss_scaler"],
            "rng": [part["rng"] for part in gathered],
            "extra_state": extra_json,
        }
        run_config = getattr(engine, "run_config", None)
        if run_config is not None:
            with open(os.path.join(tmp, "config.py"), "w") as f:
                f.write(run_config.to_python())
        _write_json_atomic(os.path.join(tmp, META), meta)  # last: its presence marks a complete checkpoint
        if os.path.exists(final):  # re-saving a step: move the old one aside, never delete before the new is in
            old = os.path.join(parent, f".{name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(parent)
    _barrier(ctx)
    return final


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------------------
# read


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, truncated, corrupt, or of another model."""


def resolve_checkpoint(path: str) -> str:
    """A checkpoint directory from a run directory (via checkpoints/latest) or a checkpoint directory."""
    if os.path.isfile(os.path.join(path, META)):
        return path
    latest = os.path.join(path, "checkpoints", "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            ckpt = os.path.join(path, "checkpoints", f.read().strip())
        if os.path.isfile(os.path.join(ckpt, META)):
            return ckpt
        raise CheckpointError(f"{latest} names {ckpt}, which is not a complete checkpoint (no {META})")
    raise CheckpointError(f"{path} is neither a checkpoint directory (no {META}) nor a run directory "
                          f"(no checkpoints/latest); pass e.g. runs/x or runs/x/checkpoints/step_1000")


class CheckpointReader:
    """Reads tensors, or element ranges of them, from a checkpoint without loading it whole.

    Example:
        >>> r = CheckpointReader(resolve_checkpoint("runs/demo_cpu"))
        >>> r.tensor("transformer.wte.weight").shape
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        meta_path = os.path.join(directory, META)
        if not os.path.isfile(meta_path):
            raise CheckpointError(f"{directory} is not a complete checkpoint: {META} is missing (a save that was "
                                  f"interrupted leaves no {META}); use the previous checkpoint")
        try:
            with open(meta_path) as f:
                self.meta = json.load(f)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{meta_path} is corrupt ({e}); use another checkpoint") from None
        if self.meta.get("format") != FORMAT or self.meta.get("version") != VERSION:
            raise CheckpointError(f"{meta_path}: format {self.meta.get('format')!r} version "
                                  f"{self.meta.get('version')!r}, expected {FORMAT!r} version {VERSION}")
        self._check_files()
        self._pieces: dict[tuple[str, str], list[tuple[int, int, str, str]]] = {}
        for fname, entry in self.meta["files"].items():
            for kind, name, start, end, key in entry["pieces"]:
                self._pieces.setdefault((kind, name), []).append((start, end, fname, key))
        for pieces in self._pieces.values():
            pieces.sort()
        self._open: dict[str, Any] = {}

    def _check_files(self) -> None:
        for fname, entry in self.meta["files"].items():
            path = os.path.join(self.directory, fname)
            if not os.path.isfile(path):
                raise CheckpointError(f"checkpoint shard {path} is missing; the checkpoint is incomplete")
            size = os.path.getsize(path)
            if size != entry["bytes"]:
                raise CheckpointError(f"checkpoint shard {path} is truncated or corrupt: {size} bytes, "
                                      f"expected {entry['bytes']}")

    @property
    def config_path(self) -> str | None:
        path = os.path.join(self.directory, "config.py")
        return path if os.path.isfile(path) else None

    def names(self) -> list[str]:
        """Parameter names (unique; tied aliases not repeated), then persistent buffer names, in model order."""
        return list(self.meta["params"]) + list(self.meta["buffers"])

    def kinds(self, name: str) -> list[str]:
        return sorted({kind for kind, n in self._pieces if n == name})

    def _file(self, fname: str) -> Any:
        """An open (memory-mapped) shard file. Only the few most recently used stay open: a mapping keeps its
        pages counted in RSS, and a reader that kept every file open would look like a second copy of the model."""
        handle = self._open.pop(fname, None)
        if handle is None:
            from safetensors import safe_open

            path = os.path.join(self.directory, fname)
            try:
                handle = safe_open(path, framework="pt")
            except Exception as e:
                raise CheckpointError(f"checkpoint file {path} is unreadable (truncated or corrupt): {e}") from None
        self._open[fname] = handle  # most recent last
        while len(self._open) > _OPEN_FILES:
            self._open.pop(next(iter(self._open)))
        return handle

    def read_range(self, kind: str, name: str, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of the flattened `kind` tensor ("master", "exp_avg", ...) of parameter `name`."""
        out = torch.empty(end - start, dtype=torch.float32)
        covered = 0
        for p_start, p_end, fname, key in self._pieces.get((kind, name), ()):
            lo, hi = max(start, p_start), min(end, p_end)
            if lo >= hi:
                continue
            try:
                piece = self._file(fname).get_slice(key)[lo - p_start: hi - p_start]
            except CheckpointError:
                raise
            except Exception as e:
                raise CheckpointError(f"checkpoint file {os.path.join(self.directory, fname)}: cannot read "
                                      f"{key!r} ({e})") from None
            out[lo - start: hi - start] = piece
            covered += hi - lo
        if covered != end - start:
            raise CheckpointError(f"{self.directory}: {kind} of {name!r} elements [{start}, {end}) are not all in "
                                  f"the checkpoint ({covered} found); the checkpoint is incomplete")
        return out

    def tensor(self, name: str, kind: str | None = None) -> torch.Tensor:
        """The full fp32 tensor of a parameter (its master or frozen value) or buffer, in its model shape."""
        if name in self.meta["buffers"]:
            from safetensors import safe_open

            with safe_open(os.path.join(self.directory, BUFFERS), framework="pt") as f:
                return f.get_tensor(name)
        if name not in self.meta["params"]:
            raise KeyError(f"{name!r} is not in checkpoint {self.directory}")
        info = self.meta["params"][name]
        kind = kind or ("master" if info["trainable"] else "param")
        numel = int(np.prod(info["shape"], dtype=np.int64))
        return self.read_range(kind, name, 0, numel).view(info["shape"])

    def rng_tensors(self, rank: int) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        return load_file(os.path.join(self.directory, f"rng_r{rank:05d}.safetensors"))


# ------------------------------------------------------------------------------------------------
# load


def _check_compatible(engine: Any, reader: CheckpointReader) -> None:
    """Every parameter of the model is in the checkpoint with the same shape; else list what differs."""
    saved = reader.meta["params"]
    problems = []
    for chunk in engine.chunks:
        for slot in chunk.plan.slots:
            if slot.name not in saved:
                problems.append(f"  {slot.name}: in the model {list(slot.shape)}, not in the checkpoint")
            elif list(slot.shape) != saved[slot.name]["shape"]:
                problems.append(f"  {slot.name}: model {list(slot.shape)} vs checkpoint {saved[slot.name]['shape']}")
    model_names = {s.name for c in engine.chunks for s in c.plan.slots}
    problems += [f"  {n}: in the checkpoint {saved[n]['shape']}, not in the model" for n in saved if n not in model_names]
    if problems:
        raise CheckpointError(f"checkpoint {reader.directory} is of another model; mismatched tensors:\n"
                              + "\n".join(problems))


def _read_shard(reader: CheckpointReader, chunk: Any, kind: str) -> torch.Tensor:
    """This rank's shard (padding zero) of `kind` for `chunk`, assembled from the saved pieces."""
    plan = chunk.plan
    lo, _ = plan.shard_range(chunk.shard_index)
    out = torch.zeros(plan.shard_numel, dtype=torch.float32)
    for slot in plan.slots:
        overlap = plan.slot_overlap(slot, chunk.shard_index)
        if overlap is not None:
            out[overlap[0] - lo: overlap[1] - lo] = reader.read_range(kind, slot.name, overlap[0] - slot.offset,
                                                                      overlap[1] - slot.offset)
    return out


def load_engine(engine: Any, directory: str) -> dict:
    """Load a checkpoint written at any world size, stage or shard strategy (all ranks call).

    The engine's own `state_dict()` names what to read: each rank reads its shard ranges straight into
    the live tensors (peak extra memory: one chunk's piece), then `engine.load_state_dict()` puts it in force.
    Returns the extra_state saved with it. RNG states are restored when the world size is the same
    (exact resume); at another world size each rank keeps the seed it was launched with.
    """
    ctx = engine.ctx
    reader = CheckpointReader(_stage_directory(engine, directory))
    _check_compatible(engine, reader)
    state = engine.state_dict()
    optim_state = state["optimizer"]
    saved_groups = reader.meta["optimizer"]["param_groups"]
    if len(saved_groups) != len(optim_state["param_groups"]):
        raise CheckpointError(f"checkpoint {reader.directory} has {len(saved_groups)} optimizer param "
                              f"groups, the optimizer has {len(optim_state['param_groups'])}; build the "
                              f"optimizer as the run did")
    optim_state["param_groups"] = saved_groups
    optim_state["loss_scaler"] = reader.meta["loss_scaler"]
    scalars = reader.meta["optimizer"]["scalars"]
    with torch.no_grad():
        for chunk in engine.chunks:
            index = chunk.plan.index
            if not chunk.plan.trainable:
                state["frozen"][index].copy_(_read_shard(reader, chunk, "param"))
                continue
            live = optim_state["chunks"][index]
            for kind in reader.kinds(chunk.plan.slots[0].name):
                values = _read_shard(reader, chunk, kind)
                target = live.get(kind)
                if isinstance(target, torch.Tensor) and target.shape == values.shape:
                    target.copy_(values)  # in place: keeps its home (pinned host, memory-mapped disk)
                else:
                    live[kind] = values
            for key, value in scalars.get(str(chunk.plan.group_index), {}).items():
                live[key] = torch.tensor(value, dtype=torch.float32)
        for name in reader.meta["buffers"]:
            if name in state["buffers"]:
                state["buffers"][name] = reader.tensor(name)
    state["global_step"] = reader.meta["global_step"]
    engine.load_state_dict(state)
    if reader.meta["world_size"] == ctx.world_size:
        _set_rng_state(reader.rng_tensors(ctx.rank), reader.meta["rng"][ctx.rank])
    _barrier(ctx)
    return reader.meta["extra_state"]
