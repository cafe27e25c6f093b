"""Megatron-LM checkpoint files: find an iteration, read it into canonical tensors, write canonical tensors back.

Two on-disk formats. `torch`: iter_{N:07d}/mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt per tensor and pipeline
rank, named by latest_checkpointed_iteration.txt, each a pickled dict of args, checkpoint_version, iteration and
the rank's model (legacy or Megatron-Core names). `torch_dist`: one torch.distributed.checkpoint directory of
global tensors (a layer's tensors stacked over layers) plus common.pt and metadata.json; read and written with
DCP, never by hand. The names, splits and qkv orders are megatron_layout.py's; this module moves bytes.
Pickles are read with an unpickler that builds tensors, argparse.Namespace and torch dtypes and turns every
other class (Megatron's enums, optimizer objects) into an inert placeholder: no code from the file runs, and
Megatron need not be installed.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import shutil
import types
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from zerogpt_tools.megatron_layout import (CORE, LEGACY, TE_EXTRA_STATE, MegatronLayoutError, check_version,
                                           from_canonical, qkv_from_version, stage_layers, stage_of, tied_head_key,
                                           to_canonical, tp_merge, tp_split)

__all__ = ["MegatronCheckpoint", "open_checkpoint", "read_tensors", "write_checkpoint", "load_pt", "TRACKER",
           "RANK_FILE"]

TRACKER = "latest_checkpointed_iteration.txt"
RANK_FILE = "model_optim_rng.pt"
DIST_CONFIG, DIST_COMMON = "metadata.json", "common.pt"
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")
_WEIGHT_PREFIXES = ("embedding.", "decoder.", "output_layer.")


# ------------------------------------------------------------------------------------------------
# pickles without running their code


class Unimported:
    """What a pickled object of a class this reader does not build becomes (its name kept in `where`)."""

    where = ""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<{self.where} not imported>"


class _Unpickler(pickle.Unpickler):
    _BUILT = {("collections", "OrderedDict"), ("argparse", "Namespace"), ("torch", "Size"), ("torch", "device"),
              ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor_v3"),
              ("torch._utils", "_rebuild_parameter"), ("torch._tensor", "_rebuild_from_type_v2"),
              ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._BUILT or module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return super().find_class(module, name)
        return type(name, (Unimported,), {"where": f"{module}.{name}"})


_SAFE_PICKLE = types.ModuleType("zerogpt_megatron_pickle")
_SAFE_PICKLE.Unpickler = _Unpickler
_SAFE_PICKLE.load = lambda f, **kwargs: _Unpickler(f, **kwargs).load()
_SAFE_PICKLE.__dict__.update(dumps=pickle.dumps, dump=pickle.dump, loads=pickle.loads,
                             HIGHEST_PROTOCOL=pickle.HIGHEST_PROTOCOL)


def load_pt(path: str) -> Any:
    """A Megatron .pt file, on the CPU, through the inert unpickler (see the module docstring)."""
    try:
        return torch.load(path, map_location="cpu", pickle_module=_SAFE_PICKLE, weights_only=False)
    except (OSError, RuntimeError, pickle.UnpicklingError, EOFError) as e:
        raise MegatronLayoutError(f"{path} is not a readable torch checkpoint ({type(e).__name__}: {e})") from None


def _args_dict(args: Any, where: str) -> dict[str, Any]:
    if isinstance(args, argparse.Namespace):
        return vars(args)
    if isinstance(args, dict):
        return dict(args)
    raise MegatronLayoutError(f"{where} has no Megatron `args` (found {type(args).__name__}); the model's shape "
                              f"comes from them, so checkpoints saved without args cannot be imported")


# ------------------------------------------------------------------------------------------------
# reading


@dataclass
class MegatronCheckpoint:
    """One iteration of a Megatron checkpoint: where it is, its format and what its common part says."""

    directory: str
    """the iteration's directory (iter_0001000 or release)"""
    iteration: int
    format: str
    """"torch" (a file per TP/PP rank) or "torch_dist" (one DCP directory)"""
    args: dict[str, Any]
    version: float
    """checkpoint_version (0 when the file has none, as Megatron reads it)"""
    tp: int = 1
    pp: int = 1
    ranks: dict[tuple[int, int], str] = field(default_factory=dict)
    """(tp rank, pp rank) -> model_optim_rng.pt ("torch" only)"""
    notes: list[str] = field(default_factory=list)
    """what was not imported, one line each (optimizer state, a tied head copy that differs)"""


def _iteration_dir(path: str) -> tuple[str, int]:
    """(iteration directory, iteration) from a checkpoint root (via its tracker file) or an iteration directory."""
    path = os.path.abspath(path.rstrip("/"))
    tracker = os.path.join(path, TRACKER)
    if os.path.isfile(tracker):
        with open(tracker) as f:
            text = f.read().strip()
        if text == "release":
            return os.path.join(path, "release"), 0
        if not text.isdigit():
            raise MegatronLayoutError(f"{tracker} holds {text!r}, neither an iteration nor 'release'")
        directory = os.path.join(path, f"iter_{int(text):07d}")
        if not os.path.isdir(directory):
            raise MegatronLayoutError(f"{tracker} names iteration {text} but {directory} does not exist")
        return directory, int(text)
    base = os.path.basename(path)
    if os.path.isdir(path) and (re.fullmatch(r"iter_\d+", base) or base == "release"):
        return path, 0 if base == "release" else int(base[5:])
    raise MegatronLayoutError(f"{path} is not a Megatron checkpoint: no {TRACKER} and not an iter_N or release "
                              f"directory; pass the directory Megatron's --save wrote")


def open_checkpoint(path: str) -> MegatronCheckpoint:
    """Locate and describe a Megatron checkpoint (args, iteration, format, ranks); reads one rank's file.

    Raises MegatronLayoutError (a ValueError) in one line for an unknown layout or version, or a missing TP/PP shard.
    """
    directory, iteration = _iteration_dir(path)
    if os.path.isfile(os.path.join(directory, DIST_CONFIG)):
        with open(os.path.join(directory, DIST_CONFIG)) as f:
            backend = json.load(f).get("sharded_backend")
        if backend != "torch_dist":
            raise MegatronLayoutError(f"{directory}/{DIST_CONFIG}: sharded_backend {backend!r} is not read here; "
                                      f"torch_dist and the torch format (mp_rank_* files) are")
        common = load_pt(os.path.join(directory, DIST_COMMON))
        args = _args_dict(common.get("args"), f"{directory}/{DIST_COMMON}")
        return MegatronCheckpoint(directory, common.get("iteration", iteration), "torch_dist", args,
                                  check_version(common.get("checkpoint_version", 0.0), f"{directory}/{DIST_COMMON}"))
    ranks = {}
    for name in sorted(os.listdir(directory)):
        m = _RANK_DIR.match(name)
        if m and os.path.isdir(os.path.join(directory, name)):
            ranks[(int(m.group(1)), int(m.group(2) or 0))] = os.path.join(directory, name, RANK_FILE)
    if not ranks:
        raise MegatronLayoutError(f"{directory} holds neither mp_rank_* directories (the torch format) nor "
                                  f"{DIST_CONFIG} (torch_dist); expert-parallel and other layouts are not read")
    first = load_pt(ranks[min(ranks)]) if os.path.isfile(ranks[min(ranks)]) else {}
    args = _args_dict(first.get("args"), ranks[min(ranks)])
    tp = args.get("tensor_model_parallel_size") or args.get("model_parallel_size") or 1
    pp = args.get("pipeline_model_parallel_size") or 1
    for t in range(tp):
        for p in range(pp):
            rank_dir = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "")
            if not os.path.isfile(os.path.join(directory, rank_dir, RANK_FILE)):
                raise MegatronLayoutError(f"{directory}/{rank_dir}/{RANK_FILE} is missing (args say "
                                          f"tensor_model_parallel_size={tp}, pipeline_model_parallel_size={pp}); "
                                          f"copy every rank's file of the checkpoint")
    extra = sorted(k for k in ranks if k[0] >= tp or k[1] >= pp)
    if extra:
        raise MegatronLayoutError(f"{directory} has rank directories {extra} beyond args' TP={tp} x PP={pp}")
    ckpt = MegatronCheckpoint(directory, int(first.get("iteration", iteration)), "torch", args,
                              check_version(first.get("checkpoint_version", 0.0), ranks[min(ranks)]), tp, pp,
                              {(t, p): ranks[(t, p)] for p in range(pp) for t in range(tp)})
    if any(key.startswith("model") and key != "model" for key in first):
        models = sorted(k for k in first if k.startswith("model"))
        raise MegatronLayoutError(f"{ranks[min(ranks)]} holds {models}: virtual pipeline stages are not read; "
                                  f"reshard it with Megatron to one stage per rank")
    return ckpt


def _flatten(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _flatten(value, f"{prefix}{key}.")
    else:
        yield prefix[:-1], tree


def _layout_of(model: dict, where: str) -> str:
    if "language_model" in model:
        return LEGACY
    if any(str(k).startswith(_WEIGHT_PREFIXES) for k in model):
        return CORE
    raise MegatronLayoutError(f"{where}: model keys {sorted(model)[:6]} are neither the legacy layout "
                              f"(language_model.embedding/encoder) nor Megatron-Core's (embedding., decoder.)")


def _note_optimizer(ckpt: MegatronCheckpoint, state: dict, rank_dir: str) -> None:
    said = any("optimizer state" in note for note in ckpt.notes)
    if (state.get("optimizer") or os.path.isfile(os.path.join(rank_dir, "distrib_optim.pt"))) and not said:
        ckpt.notes.append(f"{ckpt.directory} holds Megatron optimizer state, which is not imported (its distributed "
                          f"optimizer shards and fp32 main weights follow Megatron's own bucket layout): the "
                          f"weights are the model's, and the optimizer starts fresh")


def _read_torch(ckpt: MegatronCheckpoint, gated: bool, heads: int) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    first_layer = 0
    for p in range(ckpt.pp):
        shards: dict[str, list[torch.Tensor]] = {}
        for t in range(ckpt.tp):
            path = ckpt.ranks[(t, p)]
            state = load_pt(path)
            _note_optimizer(ckpt, state, os.path.dirname(path))
            version = check_version(state.get("checkpoint_version", 0.0), path)
            model = state.get("model")
            if not isinstance(model, dict):
                raise MegatronLayoutError(f"{path} has no 'model' state dict (keys: {sorted(state)})")
            layout = _layout_of(model, path)
            local = {}
            for key, value in _flatten(model):
                name = to_canonical(key, layout, first_layer)
                if name is None:
                    continue
                if not isinstance(value, torch.Tensor):
                    raise MegatronLayoutError(f"{path}: {key} is a {type(value).__name__}, not a tensor")
                if layout == LEGACY and name.endswith(("linear_qkv.weight", "linear_qkv.bias")) and version < 2.0:
                    if ckpt.args.get("group_query_attention"):
                        raise MegatronLayoutError(f"{path}: checkpoint_version {version} with grouped-query attention "
                                                  f"does not exist in Megatron-LM; the file is inconsistent")
                    value = qkv_from_version(value, version, heads // ckpt.tp, path)
                local[name] = value
            if shards and set(local) != set(shards):
                differ = sorted(set(local) ^ set(shards))
                raise MegatronLayoutError(f"{path} and tensor rank 0 of its stage hold different tensors "
                                          f"({differ[:3]}); the checkpoint mixes runs")
            for name, value in local.items():
                shards.setdefault(name, []).append(value)
            del state, model
        layers = {int(n.split(".")[2]) for n in shards if n.startswith("decoder.layers.")}
        for name, parts in shards.items():
            if name in out:  # an earlier stage gave it already: the first holder's copy counts
                continue
            try:
                out[name] = tp_merge(name, parts, gated)
            except RuntimeError as e:
                raise MegatronLayoutError(f"{ckpt.directory} stage {p}: the TP shards of {name} do not fit "
                                          f"together ({e})") from None
        first_layer += len(layers)
    return out


def _read_dist(ckpt: MegatronCheckpoint) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(ckpt.directory)
    metadata = reader.read_metadata().state_dict_metadata
    if any(k.startswith("optimizer.") for k in metadata):
        ckpt.notes.append(f"{ckpt.directory} holds Megatron optimizer state, which is not imported: the weights "
                          f"are the model's, and the optimizer starts fresh")
    wanted = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.items()
              if k.startswith(_WEIGHT_PREFIXES) and isinstance(m, TensorStorageMetadata)
              and not k.endswith("_extra_state")}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process")
        dcp.load(wanted, storage_reader=reader)
    out: dict[str, torch.Tensor] = {}
    num_layers = ckpt.args["num_layers"]
    for key, value in wanted.items():
        stacked = re.match(r"^decoder\.layers\.(?!\d+\.)(.+)$", key)
        per_layer = [(f"decoder.layers.{i}.{stacked.group(1)}", value[i]) for i in range(num_layers)] if stacked \
            else [(key, value)]
        if stacked and value.size(0) != num_layers:
            raise MegatronLayoutError(f"{ckpt.directory}: {key} stacks {value.size(0)} layers, args.num_layers="
                                      f"{num_layers}")
        for name, tensor in per_layer:
            half = re.match(r"^(.*linear_fc1\.(?:weight|bias))_([wv])$", name)  # singleton_local_shards' [gate], [up]
            if half:
                base = to_canonical(half.group(1), CORE, 0)
                out[base] = tensor if base not in out else (torch.cat([tensor, out[base]]) if half.group(2) == "w"
                                                            else torch.cat([out[base], tensor]))
                continue
            canonical = to_canonical(name, CORE, 0)
            if canonical is not None:
                out[canonical] = tensor
    return out


def read_tensors(ckpt: MegatronCheckpoint) -> dict[str, torch.Tensor]:
    """Every weight of the checkpoint by canonical name: TP shards merged, pipeline stages joined, legacy qkv in
    the order of version >= 2, a tied head's last-stage copy dropped. Dtypes as stored. Memory: the model once."""
    gated = bool(ckpt.args.get("swiglu"))
    if ckpt.format == "torch_dist":
        tensors = _read_dist(ckpt)
    else:
        tensors = _read_torch(ckpt, gated, ckpt.args["num_attention_heads"])
    if not ckpt.args.get("untie_embeddings_and_output_weights") and "output_layer.weight" in tensors:
        copy = tensors.pop("output_layer.weight")
        embedding = tensors.get("embedding.word_embeddings.weight")
        if embedding is not None and not torch.equal(copy, embedding):
            ckpt.notes.append("the last pipeline stage's copy of the tied embedding differs from the first stage's; "
                              "the first stage's embedding is used")
    return tensors


# ------------------------------------------------------------------------------------------------
# writing


def _nest_legacy(flat: dict[str, Any]) -> dict[str, Any]:
    """Legacy's nesting: model.language_model.{embedding.word_embeddings, ...} dicts, the encoder a flat dict."""
    model: dict[str, Any] = {}
    for key, value in flat.items():
        if key.startswith("language_model.encoder."):
            encoder = model.setdefault("language_model", {}).setdefault("encoder", {})
            encoder[key[len("language_model.encoder."):]] = value
            continue
        node = model
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return model


def _common(args: dict[str, Any], iteration: int) -> dict[str, Any]:
    return {"args": argparse.Namespace(**args), "checkpoint_version": 3.0, "iteration": iteration}


def write_checkpoint(out_dir: str, tensors: Iterator[tuple[str, torch.Tensor]], args: dict[str, Any], iteration: int,
                     layout: str, tp: int = 1, pp: int = 1, dist: bool = False) -> list[str]:
    """Write canonical `tensors` (in model order: embeddings, layers in order, final norm, head) as a Megatron
    checkpoint of `layout` (legacy or core) under out_dir, split for `tp` x `pp` (torch format) or as one
    torch_dist directory (dist). Holds one pipeline stage (all of the model for torch_dist). Returns the files."""
    directory = os.path.join(out_dir, f"iter_{iteration:07d}")
    shutil.rmtree(directory, ignore_errors=True)  # replaced whole: no rank file of an earlier TP/PP split stays
    os.makedirs(directory)
    tied = not args["untie_embeddings_and_output_weights"]
    if dist:
        files = _write_dist(directory, dict(tensors), args, iteration)
    else:
        stages = stage_layers(args["num_layers"], pp)
        files, stage, held, embedding = [], 0, {}, None
        for name, tensor in tensors:
            if name == "embedding.word_embeddings.weight":
                embedding = tensor
            s = stage_of(name, stages)
            if s != stage:
                files += _write_stage(directory, held, stage, stages, args, iteration, layout, tp, pp, tied, embedding)
                stage, held = s, {}
            held[name] = tensor
        files += _write_stage(directory, held, stage, stages, args, iteration, layout, tp, pp, tied, embedding)
    with open(os.path.join(out_dir, TRACKER), "w") as f:
        f.write(str(iteration))
    return files


def _write_stage(directory: str, held: dict[str, torch.Tensor], stage: int, stages: list[range], args: dict,
                 iteration: int, layout: str, tp: int, pp: int, tied: bool,
                 embedding: torch.Tensor | None) -> list[str]:
    gated = bool(args["swiglu"])
    if tied and pp > 1 and stage == pp - 1:  # Megatron keeps the tied head's own copy on the last stage
        held = {**held, "output_layer.weight": embedding}
    first = stages[stage].start
    models: list[dict[str, Any]] = [{} for _ in range(tp)]
    for name, tensor in held.items():
        key = tied_head_key(layout) if tied and name == "output_layer.weight" else from_canonical(name, layout, first)
        for rank, shard in enumerate(tp_split(name, tensor, tp, gated)):
            models[rank][key] = shard.clone()  # its own storage: torch.save writes a view's whole base
    if layout == CORE:  # Transformer Engine modules' FP8 state, empty: a strict load wants the keys
        for layer in range(len(stages[stage])):
            for model in models:
                model.update({f"decoder.layers.{layer}.{k}": None for k in TE_EXTRA_STATE})
    files = []
    for rank, model in enumerate(models):
        rank_dir = os.path.join(directory, f"mp_rank_{rank:02d}" + (f"_{stage:03d}" if pp > 1 else ""))
        os.makedirs(rank_dir, exist_ok=True)
        path = os.path.join(rank_dir, RANK_FILE)
        torch.save({**_common(args, iteration), "model": _nest_legacy(model) if layout == LEGACY else model}, path)
        files.append(path)
    return files


def _write_dist(directory: str, tensors: dict[str, torch.Tensor], args: dict, iteration: int) -> list[str]:
    """torch_dist: global tensors, each layer tensor stacked over layers under decoder.layers.<name> (Megatron-
    Core's homogeneous-layer form), Transformer Engine names; through DCP."""
    import torch.distributed.checkpoint as dcp

    state: dict[str, torch.Tensor] = {}
    per_layer: dict[str, list[torch.Tensor]] = {}
    for name, tensor in tensors.items():
        key = from_canonical(name, CORE, 0)
        m = re.match(r"^decoder\.layers\.(\d+)\.(.+)$", key)
        if m:
            per_layer.setdefault(f"decoder.layers.{m.group(2)}", []).append(tensor)
        else:
            state[key] = tensor.contiguous()
    state.update({key: torch.stack(parts) for key, parts in per_layer.items()})
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(directory))
    torch.save(_common(args, iteration), os.path.join(directory, DIST_COMMON))
    with open(os.path.join(directory, DIST_CONFIG), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                   "common_backend_version": 1}, f)
    return sorted(os.path.join(directory, n) for n in os.listdir(directory))
