"""Export a zerogpt checkpoint as a Hugging Face model directory, streaming one tensor at a time.

    python -m zerogpt_tools.export runs/demo_cpu --out exports/demo_cpu [--dtype bf16] [--tokenizer DIR]

The output loads with `AutoModelForCausalLM.from_pretrained(DIR)` and `AutoTokenizer.from_pretrained(DIR)`:
GPT2LMHeadModel for model_zoo's GPT, LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM / MistralForCausalLM
for its Llama family. Peak memory is one safetensors shard plus one tensor. The conversion is found through the
model class the checkpoint records: a transformers class is written as is; any other "pkg.mod.Cls" plugs in
through `hf_config` and `to_hf_tensor` in its adapter module (the class's `adapter` attribute, else "pkg.mod") and
`model_from_config` in "pkg.mod" (model_zoo's families have them; see ModelPlugin). The weights' dtype defaults to the one the model's source checkpoint was stored in
(fp32 for a model trained from scratch); bos/eos ids come from the shipped tokenizer.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import Any, Callable, Iterator

import torch

from data_pipeline.cli_args import parse_size
from data_pipeline.files import atomic_dir as atomic_output_dir  # the output directory appears whole or not at all
from data_pipeline.tokenizer import load_tokenizer
from model_zoo.hf import check_safetensors, quiet_model_import
from zerogpt.amp import TORCH_DTYPES
from zerogpt.cli import HelpFormatter
from zerogpt.config.dtypes import DTYPES as DTYPE_NAMES

__all__ = ["export_checkpoint", "ShardWriter", "iter_hf_weights", "ModelPlugin", "find_tokenizer",
           "save_tokenizer", "atomic_output_dir", "resolve_dtype", "set_special_ids", "main"]

DTYPES = TORCH_DTYPES  # --dtype NAME -> torch dtype: the one table of dtype names (zerogpt/config/dtypes.py)
AUTO = "auto"  # --dtype default: the source checkpoint's dtype (ModelPlugin.source_dtype), else fp32
_DTYPE_NAMES = {d.torch_name: name for name, d in DTYPE_NAMES.items()}  # config.json's spelling -> ours
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_TOKENIZER_HINT = ("pass --tokenizer DIR (the tokenizer the model was trained with, e.g. the run's data.tokenizer "
                   "or a `python -m data_pipeline train-tokenizer` output)")


# ------------------------------------------------------------------------------------------------
# safetensors: write in bounded shards, read back one tensor at a time


class ShardWriter:
    """Writes tensors into safetensors shards of at most `max_shard_bytes`, holding at most one shard in memory.

    A tensor larger than the limit gets a shard of its own (as HF's save_pretrained does). `close()` names the
    files as HF expects: one `model.safetensors`, or `model-0000i-of-0000n.safetensors` plus the index json.
    `peak_bytes` records the most tensor bytes ever held, so callers and tests can check the memory bound.
    """

    def __init__(self, out_dir: str, max_shard_bytes: int) -> None:
        if max_shard_bytes < 1:
            raise ValueError(f"max shard size must be >= 1 byte, got {max_shard_bytes}")
        self.out_dir, self.max_shard_bytes = out_dir, max_shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.peak_bytes = 0
        self.shards: list[list[str]] = []  # tensor names per written shard
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.pending or any(name in shard for shard in self.shards):
            raise ValueError(f"tensor {name!r} written twice")
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_shard_bytes:
            self.flush()
        self.pending[name] = tensor.detach().cpu().contiguous()
        self.pending_bytes += nbytes
        self.total_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.pending_bytes)

    def flush(self) -> None:
        if not self.pending:
            return
        from safetensors.torch import save_file

        save_file(self.pending, self._tmp_name(len(self.shards)), metadata={"format": "pt"})
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def _tmp_name(self, index: int) -> str:
        return os.path.join(self.out_dir, f".shard-{index:05d}.safetensors")

    def close(self) -> list[str]:
        """Flush the last shard and give the files their final names; returns them."""
        self.flush()
        n = len(self.shards)
        if n == 0:
            raise ValueError("no tensors were written")
        names = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for i, final in enumerate(names):
            os.replace(self._tmp_name(i), os.path.join(self.out_dir, final))
        if n > 1:
            weight_map = {t: names[i] for i, shard in enumerate(self.shards) for t in shard}
            with open(os.path.join(self.out_dir, INDEX_FILE), "w") as f:
                json.dump({"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}, f, indent=2)
            names.append(INDEX_FILE)
        return names


def hf_weight_files(model_dir: str) -> list[str]:
    """The safetensors files of an HF model directory (single file or index), each checked to open."""
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            files = list(dict.fromkeys(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(model_dir, SINGLE_FILE)):
        files = [SINGLE_FILE]
    else:
        raise ValueError(f"{model_dir} has no {SINGLE_FILE} or {INDEX_FILE}; point at a directory written by "
                         f"`python -m zerogpt_tools.export` or save_pretrained(..., safe_serialization=True)")
    paths = [os.path.join(model_dir, fname) for fname in files]
    check_safetensors(paths, model_dir)
    return paths


def iter_hf_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of an HF model directory's safetensors weights, one tensor in memory at a time."""
    from safetensors import safe_open

    for path in hf_weight_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


# ------------------------------------------------------------------------------------------------
# the model plugin: how a recorded model class converts to Hugging Face


def _import_class(class_path: str) -> type:
    module_name, _, cls_name = class_path.rpartition(".")
    try:
        with quiet_model_import():  # a transformers model class's import logs torchao's noise
            return getattr(importlib.import_module(module_name), cls_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"the checkpoint's model class {class_path!r} cannot be imported ({e}); run from the "
                         f"directory that holds its package (e.g. the zerogpt checkout for model_zoo)") from None


class ModelPlugin:
    """How a checkpoint's recorded model class converts to Hugging Face and is rebuilt (see the module docstring).

    Example:
        >>> plugin = ModelPlugin(CheckpointReader(ckpt).meta["model"])      # doctest: +SKIP
        >>> plugin.hf_config().vocab_size, plugin.to_hf_tensor("transformer.wte.weight", w)[1].shape  # doctest: +SKIP
    """

    def __init__(self, model_meta: dict) -> None:
        self.class_path, self.config = model_meta.get("class"), model_meta.get("config")
        if not self.class_path or self.config is None:
            raise ValueError(f"the checkpoint records no model class/config ({model_meta!r}): it was saved from a "
                             f"model without a `config` attribute, which cannot be converted or rebuilt")
        self.cls = _import_class(self.class_path)
        # A transformers class is already an HF model: same names, same layout, its own config class.
        self.is_transformers = self.class_path.startswith("transformers.")
        self.module = sys.modules[self.cls.__module__]
        # The conversion rules live in the family's adapter module when the class names one (model_zoo's GPT and
        # Llama: `adapter = "model_zoo.hf"`, "model_zoo.llama_adapter"), else beside the class.
        adapter = getattr(self.cls, "adapter", None)
        self.adapter = importlib.import_module(adapter) if isinstance(adapter, str) else self.module

    def _hook(self, name: str, module: Any = None) -> Callable:
        module = module or self.adapter
        if not hasattr(module, name):
            raise ValueError(f"model class {self.class_path} has no Hugging Face conversion: its module "
                             f"{module.__name__} defines no {name}() (see ModelPlugin in zerogpt_tools/export.py)")
        return getattr(module, name)

    def hf_config(self) -> Any:
        if self.is_transformers:
            return self.cls.config_class.from_dict(dict(self.config))
        return self._hook("hf_config")(self.config)

    def source_dtype(self) -> str | None:
        """The dtype config.json gave for the weights this model was loaded from ("bfloat16"), or None.

        A Llama-family model built from a Hugging Face checkpoint keeps config.json's torch_dtype / dtype in its
        config's `extra`; a transformers config holds it itself; a model trained from scratch has none.
        """
        extra = self.config.get("extra")
        for where in (extra if isinstance(extra, dict) else {}, self.config):
            for key in ("dtype", "torch_dtype"):
                if isinstance(where.get(key), str):
                    return where[key].removeprefix("torch.")
        return None

    def to_hf_tensor(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        return (name, tensor) if self.is_transformers else self._hook("to_hf_tensor")(name, tensor, self.config)

    def build(self) -> torch.nn.Module:
        """A freshly initialised model of the recorded class and config (to load checkpoint tensors into)."""
        if self.is_transformers:
            return self.cls(self.hf_config())
        return self._hook("model_from_config", self.module)(self.config)


# ------------------------------------------------------------------------------------------------
# tokenizer: find the run's, load it with transformers alone


def find_tokenizer(explicit: str | None, reader: Any = None, model_dir: str | None = None) -> str | None:
    """The tokenizer path to use: --tokenizer, else an HF dir's own files, else the run config's data.tokenizer."""
    if explicit:
        if not os.path.exists(explicit):
            raise ValueError(f"--tokenizer {explicit}: no such file or directory")
        return explicit
    if model_dir and {"tokenizer.json", "tokenizer_config.json", "vocab.json"} & set(os.listdir(model_dir)):
        return model_dir
    if reader is not None and reader.config_path:
        from zerogpt.config import Config, data_config

        try:
            path = data_config(Config.from_file(reader.config_path)).tokenizer
        except Exception as e:  # the recorded config imports code that is not importable here, or no longer loads
            raise ValueError(f"cannot read data.tokenizer from the run config {reader.config_path} "
                             f"({type(e).__name__}: {e}); {_TOKENIZER_HINT}") from e
        if path and not os.path.exists(path):
            raise ValueError(f"the run config {reader.config_path} names data.tokenizer={path!r}, which does not "
                             f"exist from {os.getcwd()} (a relative path is resolved from the current directory); "
                             f"{_TOKENIZER_HINT}")
        return path
    return None


def save_tokenizer(tok: Any, out_dir: str, model_max_length: int | None = None) -> None:
    """Save `tok` so AutoTokenizer loads it in transformers 4 and 5 (as data_pipeline's tokenizer dirs do)."""
    tok.save_pretrained(out_dir)
    config_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    if config.get("tokenizer_class") in ("TokenizersBackend", "PreTrainedTokenizerFast", None):
        # transformers 5's generic class name is unknown to 4.x; this one means "tokenizer.json as is" in both.
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        config.pop("backend", None)
    for key in ("is_local", "local_files_only"):  # load-time arguments that transformers 5 writes back
        config.pop(key, None)
    if model_max_length:
        config["model_max_length"] = model_max_length
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)


SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def set_special_ids(hf_config: Any, tok: Any) -> list[str]:
    """bos/eos in config.json from the tokenizer, so HF generate stops where ours does; returns notes to print.

    eos is the tokenizer's (where the source config.json listed several stop ids that include it, as
    Llama-3.1-Instruct's [128001, 128008, 128009], the list stays); bos is the tokenizer's, else its eos (one
    token for both, as GPT-2 and Qwen do). Without a tokenizer (tok None) the recorded ids stay. Either way an id
    outside the vocabulary is dropped with a note: transformers warns about it and generation never stops there.
    """
    if tok is not None and tok.eos_token_id is not None:
        eos, recorded = tok.eos_token_id, hf_config.eos_token_id
        hf_config.eos_token_id = recorded if isinstance(recorded, list) and eos in recorded else eos
        hf_config.bos_token_id = tok.bos_token_id if tok.bos_token_id is not None else eos
    notes = []
    vocab = hf_config.vocab_size
    for key in SPECIAL_IDS:
        value = getattr(hf_config, key, None)
        ids = value if isinstance(value, list) else [value]
        kept = [i for i in ids if i is not None and 0 <= i < vocab]
        outside = [i for i in ids if i is not None and not 0 <= i < vocab]
        if outside:
            notes.append(f"{key} {', '.join(map(str, outside))} is outside the {vocab:,}-token vocabulary: "
                         + (f"kept {kept}" if kept else "left unset") + " (a --tokenizer with that token sets it)")
            setattr(hf_config, key, (kept if isinstance(value, list) else kept[0]) if kept else None)
    return notes


def write_configs(hf_config: Any, out_dir: str, dtype: torch.dtype) -> None:
    """config.json (with the weights' dtype) and generation_config.json (eos doubles as pad, as for GPT-2)."""
    import transformers

    # transformers 5 renamed config.torch_dtype to config.dtype (the key config.json records).
    setattr(hf_config, "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype", dtype)
    hf_config.save_pretrained(out_dir)
    generation = transformers.GenerationConfig.from_model_config(hf_config)
    eos = generation.eos_token_id
    if generation.pad_token_id is None and eos is not None:
        generation.pad_token_id = eos[0] if isinstance(eos, list) else eos
    generation.save_pretrained(out_dir)


# ------------------------------------------------------------------------------------------------
# export


def resolve_dtype(dtype: str, plugin: ModelPlugin) -> tuple[str, str | None]:
    """(the DTYPES key to write, a note saying why when --dtype auto chose it from the source checkpoint).

    auto writes what the model's Hugging Face source was stored in, so a continued bf16 Llama exports as the
    bf16 files it came as (half the bytes of fp32, and what transformers' dtype="auto" loads); a model trained
    from scratch has no source and exports its fp32 masters exactly.
    """
    if dtype != AUTO:
        return dtype, None
    source = plugin.source_dtype()
    chosen = _DTYPE_NAMES.get(source, "fp32")
    if chosen != "fp32":
        return chosen, f"the source checkpoint's {source}; --dtype fp32 writes the fp32 masters"
    if source is not None and source not in _DTYPE_NAMES:
        return "fp32", f"the source checkpoint's {source} is not one of {', '.join(DTYPES)}; wrote the fp32 masters"
    return "fp32", None


def export_checkpoint(path: str, out_dir: str, dtype: str = AUTO, tokenizer: str | None = None,
                      max_shard_bytes: int = 10**9, with_tokenizer: bool = True) -> dict:
    """Write checkpoint (or run dir) `path` as a Hugging Face model directory at `out_dir`, atomically.

    Args:
        path: a run directory (its checkpoints/latest is used) or a checkpoint directory.
        out_dir: output directory; replaced only once the export is complete.
        dtype: "fp32", "bf16" or "fp16" for the saved weights (the checkpoint's fp32 masters are cast); "auto":
            the dtype of the Hugging Face checkpoint the model was loaded from, fp32 for one trained from scratch.
        tokenizer: tokenizer dir/file to ship; default the run config's data.tokenizer.
        max_shard_bytes: safetensors shard size limit (also the writer's memory bound).
        with_tokenizer: False exports weights and configs only.
    Returns:
        dict(checkpoint, out, files, shards, tensors, total_bytes, peak_shard_bytes, vocab_size, dtype, notes):
        dtype is the DTYPES key written, notes the lines worth printing (why that dtype, ids left unset).
    Example:
        >>> export_checkpoint("runs/demo_cpu", "exports/demo")["files"]          # doctest: +SKIP
        ['config.json', 'generation_config.json', 'model.safetensors', 'tokenizer.json', ...]
    """
    from zerogpt.checkpoint import CheckpointReader, resolve_checkpoint
    from zerogpt.preflight import check_vocab, run_data_vocab

    if dtype != AUTO and dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: choose one of {AUTO}, {', '.join(DTYPES)}")
    reader = CheckpointReader(resolve_checkpoint(path))
    plugin = ModelPlugin(reader.meta["model"])
    dtype, why = resolve_dtype(dtype, plugin)
    hf_config = plugin.hf_config()
    tok = None
    if with_tokenizer:
        tok_path = find_tokenizer(tokenizer, reader)
        if tok_path is None:
            raise ValueError(f"no tokenizer found for {path}: the checkpoint's run config sets no data.tokenizer; "
                             f"{_TOKENIZER_HINT}, or --no-tokenizer to export the weights alone")
        tok = load_tokenizer(tok_path)
        check_vocab(tokenizer=(len(tok), f"tokenizer {tok_path}"), dataset=run_data_vocab(reader.config_path),
                    model=(hf_config.vocab_size, f"vocab_size of {reader.directory}"))
    notes = ([f"dtype {dtype}: {why}"] if why else []) + set_special_ids(hf_config, tok)

    with atomic_output_dir(out_dir) as tmp:
        writer = ShardWriter(tmp, max_shard_bytes)
        tied = reader.meta.get("tied", {})
        for name in reader.names():
            if name in tied:  # names() lists tied tensors once already; tolerate older metadata
                continue
            converted = plugin.to_hf_tensor(name, reader.tensor(name))
            if converted is not None:
                hf_name, tensor = converted
                writer.add(hf_name, tensor.to(DTYPES[dtype]))
                del tensor
            del converted  # before the next read: one tensor in flight besides the pending shard, not two
        writer.close()
        write_configs(hf_config, tmp, DTYPES[dtype])
        if tok is not None:
            save_tokenizer(tok, tmp, getattr(hf_config, "max_position_embeddings", None))
    out_dir = os.path.abspath(out_dir)
    return dict(checkpoint=reader.directory, out=out_dir, files=sorted(os.listdir(out_dir)), shards=len(writer.shards),
                tensors=sum(len(s) for s in writer.shards), total_bytes=writer.total_bytes,
                peak_shard_bytes=writer.peak_bytes, vocab_size=hf_config.vocab_size, dtype=dtype, notes=notes)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zerogpt-export", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("checkpoint", help="run directory (uses checkpoints/latest) or checkpoint directory")
    p.add_argument("--out", required=True, help="output directory (Hugging Face layout); replaced atomically")
    p.add_argument("--dtype", default=AUTO, choices=[AUTO, *DTYPES],
                   help="dtype of the saved weights; auto: the Hugging Face checkpoint's the model was loaded from "
                        "(config.json's torch_dtype), fp32 (the masters, exactly) for a model trained from scratch")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir/file to ship (default: the run's data.tokenizer)")
    p.add_argument("--no-tokenizer", action="store_true", help="export weights and configs only")
    p.add_argument("--max-shard-size", default="1GB", help="largest safetensors file, e.g. 500MB, 2GB (default 1GB)")
    mg = p.add_argument_group("Megatron-LM output (--format megatron; zerogpt_tools/export_megatron.py)")
    mg.add_argument("--format", default="hf", choices=["hf", "megatron"],
                    help="hf: a Hugging Face model directory; megatron: a Megatron-LM checkpoint (legacy layout)")
    mg.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks to split the Megatron files for")
    mg.add_argument("--pp", type=int, default=1, help="pipeline stages to split the Megatron files for")
    mg.add_argument("--core", action="store_true", help="Megatron-Core's names (torch format) instead of legacy")
    mg.add_argument("--dist", action="store_true", help="with --core: the torch_dist format (one DCP directory)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.format == "megatron":
        from zerogpt_tools.export_megatron import main_megatron

        try:
            return main_megatron(args)
        except (ValueError, KeyError) as e:
            raise SystemExit(f"error: {e}")
    try:
        max_shard_bytes = parse_size(args.max_shard_size, "--max-shard-size")
        stats = export_checkpoint(args.checkpoint, args.out, args.dtype, args.tokenizer, max_shard_bytes,
                                  with_tokenizer=not args.no_tokenizer)
    except (ValueError, KeyError) as e:  # CheckpointError is a ValueError
        raise SystemExit(f"error: {e}")
    print(f"[export] {stats['checkpoint']} -> {stats['out']}: {stats['tensors']} tensors, "
          f"{stats['total_bytes'] / 2**20:.1f} MiB {stats['dtype']} in {stats['shards']} shard(s), "
          f"vocab {stats['vocab_size']}; files: {', '.join(stats['files'])}")
    for note in stats["notes"]:
        print(f"[export] note: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
