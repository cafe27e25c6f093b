"""Export a zerogpt checkpoint as a Hugging Face model directory, streaming one tensor at a time.

    python -m zerogpt_tools.export runs/demo_cpu --out exports/demo_cpu [--dtype bf16] [--tokenizer DIR]

The output loads with `AutoModelForCausalLM.from_pretrained(DIR)` and `AutoTokenizer.from_pretrained(DIR)`:
GPT2LMHeadModel for model_zoo's GPT, LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM / MistralForCausalLM
for its Llama family. Peak memory is one safetensors shard plus one tensor. The conversion is found through the
model class the checkpoint records (zerogpt_tools/model_plugin.py, which export_megatron.py shares). The weights'
dtype defaults to the one the model's source checkpoint was stored in (fp32 for a model trained from scratch);
bos/eos ids come from the shipped tokenizer, found as zerogpt_tools/run_tokenizer.py finds a run's.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Iterator

import torch

from data_pipeline.cli_args import ArgumentParser, parse_size
from data_pipeline.files import atomic_dir as atomic_output_dir  # the output directory appears whole or not at all
from data_pipeline.tokenizer import load_tokenizer
from model_zoo.hf import check_safetensors
from zerogpt.cli import HelpFormatter
from zerogpt_tools.model_plugin import AUTO, DTYPES, ModelPlugin, resolve_dtype
from zerogpt_tools.run_tokenizer import TOKENIZER_HINT, find_tokenizer, save_tokenizer

__all__ = ["export_checkpoint", "ShardWriter", "iter_hf_weights", "ModelPlugin", "find_tokenizer",
           "save_tokenizer", "atomic_output_dir", "resolve_dtype", "set_special_ids", "main"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


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
# config.json and the tokenizer's special ids


SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def set_special_ids(hf_config: Any, tok: Any) -> list[str]:
    """bos/eos in config.json from the tokenizer, so HF generate stops where ours does; returns notes to print.

    eos is the tokenizer's (where the source config.json listed several stop ids that include it, as
    Llama-3.1-Instruct's [128001, 128008, 128009], the list stays); bos is the tokenizer's, else its eos (one
    token for both, as GPT-2 and Qwen do). Without a tokenizer (tok None) the recorded ids stay. Either way an id
    outside the vocabulary is dropped with a note: transformers warns about it and generation never stops there;
    and an eos left unset is said too (a Megatron import without its tokenizer records none), for the same reason.
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
    if hf_config.eos_token_id is None and not any(note.startswith("eos_token_id") for note in notes):
        which = "the" if tok is not None else "a"
        notes.append(f"eos_token_id is unset: neither the checkpoint nor {which} tokenizer names one, so "
                     f"generate() never stops at an end of text (a --tokenizer with an eos_token sets it)")
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
            raise ValueError(f"no tokenizer found for {path}: its run has no tokenizer/ and its run config sets no "
                             f"data.tokenizer; {TOKENIZER_HINT}, or --no-tokenizer to export the weights alone")
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
    p = ArgumentParser(prog="zerogpt-export", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("checkpoint", help="run directory (uses checkpoints/latest) or checkpoint directory")
    p.add_argument("--out", required=True, help="output directory (Hugging Face layout); replaced atomically")
    p.add_argument("--dtype", default=AUTO, choices=[AUTO, *DTYPES],
                   help="dtype of the saved weights; auto: the Hugging Face checkpoint's the model was loaded from "
                        "(config.json's torch_dtype), fp32 (the masters, exactly) for a model trained from scratch")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer dir/file to ship, or with --format megatron to record as args.tokenizer_model "
                        "(default: the run's own, else its data.tokenizer)")
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
