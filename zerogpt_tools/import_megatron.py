"""Import a Megatron-LM checkpoint as a zerogpt checkpoint that train_gpt.py --resume continues.

    python -m zerogpt_tools.import_megatron CKPT_DIR --out RUN_DIR [--tokenizer DIR] [--vocab-size N]

Reads the legacy layout (any checkpoint_version), Megatron-Core's torch format (TE or local names) and its
torch_dist format, at any TP x PP (zerogpt_tools/megatron_files.py); the model's family and shape come from the
checkpoint's args (learned positions, LayerNorm, GELU -> model_zoo's GPT; RoPE, RMSNorm, SwiGLU -> its Llama family,
with grouped-query attention, qkv bias, qk-layernorm), the weights through the family's adapter. Writes
RUN_DIR/checkpoints/step_<iteration>/ (and checkpoints/latest): a one-rank, stage-0 zerogpt checkpoint whose fp32
masters are the weights and which holds no optimizer state (Megatron's is not imported; load_engine starts the
optimizer fresh and says so), with the trainer at Megatron's iteration so the LR schedule continues there. It loads
at any ZeRO stage and world size, as every zerogpt checkpoint does. --tokenizer saves that tokenizer, and only
it, to RUN_DIR/tokenizer (transformers' save_pretrained: the tokenizer files, never the weights or config.json a
model directory also holds) and gives the real vocabulary size; export and generate find it there, and with it
the Hugging Face bos/eos ids. Without --tokenizer, the tokenizer the checkpoint's args name (tokenizer_model, or
GPT2BPETokenizer's vocab_file + merge_file) is used when it is on this machine; when it is not, a note says so.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import os
import shutil
import sys
from typing import Any, Iterator

import torch

from zerogpt.checkpoint_reader import FORMAT, META, VERSION
from data_pipeline.cli_args import ArgumentParser
from zerogpt.cli import HelpFormatter
from zerogpt_tools.megatron_files import MegatronCheckpoint, open_checkpoint, read_tensors
from zerogpt_tools.megatron_layout import FAMILIES, MegatronLayoutError, family_of_args

__all__ = ["import_megatron", "vocab_padding", "tokenizer_of_args", "write_weights_checkpoint", "save_run_tokenizer",
           "model_line", "main"]

NO_OPTIMIZER_REASON = ("imported from a Megatron-LM checkpoint by zerogpt_tools.import_megatron, which does not import "
                       "Megatron's optimizer state")
_FILE_BYTES = 1 << 30  # safetensors files of at most about 1 GiB


def vocab_padding(args: dict[str, Any], vocab_size: int | None) -> tuple[int, int, str | None]:
    """(real vocabulary, pad_vocab_multiple, a note or None): the multiple makes our embedding exactly
    args.padded_vocab_size rows, so the padding rows Megatron trained survive a round trip.

    The real size is `vocab_size` (a tokenizer's), else args.vocab_size, else the padded size itself (noted).
    """
    padded = args.get("padded_vocab_size")
    if not padded:
        raise MegatronLayoutError("Megatron args have no padded_vocab_size; the embedding's size cannot be checked")
    note = None
    if vocab_size is None:
        vocab_size = args.get("vocab_size") if args.get("vocab_size") and args["vocab_size"] <= padded else None
    if vocab_size is None:
        vocab_size = padded
        note = (f"the real vocabulary size is not in the checkpoint; all {padded} padded rows are taken as tokens "
                f"(pass --tokenizer or --vocab-size to drop the padding from logits)")
    if vocab_size > padded:
        raise MegatronLayoutError(f"vocabulary of {vocab_size} tokens is larger than the checkpoint's "
                                  f"padded_vocab_size={padded}; use the tokenizer the Megatron run used")
    tp = args.get("tensor_model_parallel_size") or 1
    multiple = (args.get("make_vocab_size_divisible_by") or 128) * tp
    if math.ceil(vocab_size / multiple) * multiple != padded:
        multiple = padded  # one multiple that always gives padded rows for vocab_size <= padded
    return vocab_size, multiple, note


def tokenizer_of_args(args: dict[str, Any], vocab_size: int | None) -> tuple[Any | None, str]:
    """(the tokenizer the checkpoint's args name, loaded from this machine, or None; a note saying which, or why
    none and how to give it).

    Megatron-LM records the tokenizer it trained with: HuggingFaceTokenizer (and the sentencepiece types) by
    tokenizer_model, GPT2BPETokenizer by vocab_file and merge_file; export --format megatron writes the run's as
    tokenizer_model. Without a tokenizer the run has no bos/eos ids for an HF export or generate, so a missing one
    is said. A tokenizer larger than padded_vocab_size, or of another size than --vocab-size, is not the run's.
    """
    from data_pipeline.tokenizer import byte_level_bpe_from_files, load_tokenizer, wrap_fast

    keys = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file")
    named = ", ".join(f"{k}={args[k]}" for k in keys if args.get(k))
    fix = "pass --tokenizer DIR (the Megatron run's tokenizer) so that export and generate have its bos/eos ids"
    model, vocab, merges = args.get("tokenizer_model"), args.get("vocab_file"), args.get("merge_file")
    try:
        if isinstance(model, str) and os.path.exists(model):
            # a sentencepiece tokenizer.model is read from its directory, as a Hugging Face model ships it
            tok = load_tokenizer(model if os.path.isdir(model) or model.endswith(".json") else os.path.dirname(model))
        elif isinstance(vocab, str) and isinstance(merges, str) and os.path.isfile(vocab) and os.path.isfile(merges):
            tok = wrap_fast(byte_level_bpe_from_files(vocab, merges))  # <|endoftext|> as bos/eos, as GPT-2's
        elif model or vocab:
            return None, f"the tokenizer the checkpoint's args name ({named}) is not on this machine; {fix}"
        else:
            return None, f"the checkpoint's args name no tokenizer files ({named or 'no tokenizer_type'}); {fix}"
    except ValueError as e:
        return None, f"the tokenizer the checkpoint's args name ({named}) does not load ({e}); {fix}"
    padded = args.get("padded_vocab_size") or 0
    if len(tok) > padded or vocab_size not in (None, len(tok)):
        wanted = f"--vocab-size {vocab_size}" if vocab_size is not None else f"padded_vocab_size={padded}"
        return None, f"the tokenizer the checkpoint's args name ({named}) has {len(tok)} tokens, which does not fit " \
                     f"{wanted}, so it is not used; {fix}"
    return tok, f"the run's tokenizer is the one the checkpoint's args name ({named}); --tokenizer DIR gives another"


def _adapter(family: str) -> Any:
    return importlib.import_module(FAMILIES[family][1])


def _model_module(family: str) -> Any:
    return importlib.import_module(FAMILIES[family][0].rpartition(".")[0])


def _meta_model(family: str, config: dict[str, Any]) -> tuple[Any, dict[str, torch.Tensor], dict[str, str]]:
    """The model's config (from the adapter's keyword arguments), its parameters on the meta device (names and
    shapes, nothing allocated) and its tied aliases."""
    with torch.device("meta"):
        model = _model_module(family).model_from_config(config)
    params = dict(model.named_parameters())
    ids = {id(p): n for n, p in params.items()}
    tied = {n: ids[id(p)] for n, p in model.named_parameters(remove_duplicate=False) if n not in params}
    return model.config, params, tied


def _check_shapes(tensors: dict[str, torch.Tensor], expected: dict[str, torch.Size], ckpt: MegatronCheckpoint) -> None:
    """Every weight the args imply is there with the implied shape, and nothing else; else one line."""
    def first(names: list[str]) -> str:
        return names[0] + (f" and {len(names) - 1} more" if len(names) > 1 else "")

    missing = [n for n in expected if n not in tensors]
    if missing:
        raise MegatronLayoutError(f"{ckpt.directory} lacks {first(missing)} that its args imply; the checkpoint "
                                  f"is incomplete")
    extra = [n for n in tensors if n not in expected]
    if extra:
        raise MegatronLayoutError(f"{ckpt.directory} holds {first(extra)} that its args do not imply (a model "
                                  f"option zerogpt does not read?)")
    for name, shape in expected.items():
        if tensors[name].shape != shape:
            keys = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
                    "ffn_hidden_size", "padded_vocab_size", "max_position_embeddings")
            given = ", ".join(f"{k}={ckpt.args.get(k)}" for k in keys if ckpt.args.get(k) is not None)
            raise MegatronLayoutError(f"{ckpt.directory}: {name} is {list(tensors[name].shape)}, but the args "
                                      f"({given}) give {list(shape)}; the weights contradict the args")


def write_weights_checkpoint(directory: str, class_path: str, config: Any, tensors: Iterator[tuple[str, torch.Tensor]],
                             tied: dict[str, str], global_step: int, extra_state: dict, reason: str) -> None:
    """A one-rank, stage-0 zerogpt checkpoint of weights alone (fp32 masters, no optimizer state, no RNG state).

    The format is zerogpt/checkpoint.py's (meta.json + safetensors pieces, each a whole parameter), so every
    loader reads it; meta["optimizer"]["state"] = None with `reason` tells load_engine to start the optimizer
    fresh. Written to a temporary sibling and renamed, as save_engine does.
    """
    from safetensors.torch import save_file

    final = os.path.abspath(directory)
    if os.path.exists(final):
        raise ValueError(f"{final} already exists; write the import to a new directory")
    tmp = os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    params, files, pending, size = {}, {}, {}, 0

    def flush() -> None:
        nonlocal pending, size
        if pending:
            fname = f"r00000_c{len(files):05d}.safetensors"
            save_file({key: t for key, (_, t) in pending.items()}, os.path.join(tmp, fname))
            files[fname] = {"bytes": os.path.getsize(os.path.join(tmp, fname)), "layouts": {},
                            "pieces": [["master", name, 0, t.numel(), key] for key, (name, t) in pending.items()]}
            pending, size = {}, 0

    for name, tensor in tensors:
        tensor = tensor.detach().to("cpu", torch.float32).contiguous().clone()
        params[name] = {"shape": list(tensor.shape), "trainable": True}
        pending[f"master/{name}@0"] = (name, tensor.view(-1))
        size += tensor.numel() * 4
        if size >= _FILE_BYTES:
            flush()
    flush()
    meta = {"format": FORMAT, "version": VERSION, "world_size": 1, "parallel": {"tp": 1, "pp": 1, "dp": 1},
            "stage": 0, "precision": "fp32", "global_step": global_step,
            "model": {"class": class_path, "config": json.loads(json.dumps(dataclasses.asdict(config)))},
            "loss_scaler": {}, "extra_state": extra_state, "params": params, "tied": tied, "files": files,
            "buffers": [], "buffer_files": {},
            "optimizer": {"class": None, "param_groups": [], "scalars": {}, "state": None, "reason": reason},
            "rng": []}
    with open(os.path.join(tmp, META), "w") as f:
        json.dump(meta, f, indent=1)
    os.replace(tmp, final)


def save_run_tokenizer(tok: Any, target: str, model_max_length: int | None = None) -> None:
    """The tokenizer's own files (transformers' save_pretrained) as `target`, written beside it and renamed: a
    model directory given as --tokenizer also holds weights and config.json, which the run must not copy."""
    from zerogpt_tools.run_tokenizer import save_tokenizer

    tmp = os.path.join(os.path.dirname(os.path.abspath(target)), f".{os.path.basename(target)}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_tokenizer(tok, tmp, model_max_length)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)


def model_line(family: str, config: Any) -> str:
    """The `model = dict(...)` a run config needs to build this shape: the nearest factory and what differs
    (vocab_size is left to the run's tokenizer, as for any model_zoo factory)."""
    module = _model_module(family)
    shape = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
             if f.name not in ("vocab_size", "dropout", "attention_dropout", "checkpoint", "chunked_loss",
                               "loss_chunk_size", "initializer_range", "extra")}

    def differs(size: str) -> dict[str, Any]:
        base = type(config)(**module.SIZES[size])
        return {k: v for k, v in shape.items() if getattr(base, k) != v}

    size = min(module.SIZES, key=lambda s: len(differs(s)))
    return "model = dict(" + ", ".join([f"type={size}"] + [f"{k}={v!r}" for k, v in differs(size).items()]) + ")"


def _trainer_state(ckpt: MegatronCheckpoint) -> dict:
    """extra_state for Trainer.load_state_dict: Megatron's iteration as the step (the LR schedule continues
    from it), its tokens (consumed_train_samples x seq_length) as the tokens seen, and the data position at
    zerogpt's start (Megatron's sample order is its own, not zerogpt's: the trainer's consumed_samples is where
    the sampler resumes, so it starts at 0). Megatron's seq_length is kept for the way back (export_megatron)."""
    samples = int(ckpt.args.get("consumed_train_samples") or 0)
    seq = int(ckpt.args.get("seq_length") or 0)
    step = ckpt.iteration
    return {"trainer": {"step": step, "epoch": 0, "micro_step": 0, "consumed_samples": 0, "epoch_samples": 0,
                        "tokens_seen": samples * seq, "skipped_steps": 0},
            "hooks": {}, "lr_scheduler": {"last_epoch": step, "_step_count": step + 1, "lr_lambdas": []},
            "data": {"epoch": 0, "epoch_samples": 0, "consumed_samples": 0, "world_size": 1},
            "megatron": {"checkpoint": ckpt.directory, "iteration": ckpt.iteration, "format": ckpt.format,
                         "checkpoint_version": ckpt.version, "tp": ckpt.tp, "pp": ckpt.pp,
                         "consumed_train_samples": samples, "seq_length": seq}}


def import_megatron(path: str, run_dir: str, tokenizer: str | None = None, vocab_size: int | None = None) -> dict:
    """Write Megatron checkpoint `path` as RUN_DIR/checkpoints/step_<iteration> (+ latest); see the module docstring.

    Returns dict(checkpoint, family, config, iteration, tensors, notes, model_line, source, tokenizer): tokenizer
    is RUN_DIR/tokenizer, or None when neither --tokenizer nor the checkpoint's args gave one.
    Raises ValueError (MegatronLayoutError) in one line for an unknown layout or version, a missing TP shard, a
    shape that contradicts the args, or args no model_zoo family reproduces.
    """
    latest = os.path.join(run_dir, "checkpoints", "latest")
    if os.path.exists(latest):
        raise ValueError(f"{run_dir} already holds a run's checkpoints ({latest}); import into a new --out directory")
    ckpt = open_checkpoint(path)
    family = family_of_args(ckpt.args)
    tok, tok_note = None, None
    if tokenizer is not None:
        from data_pipeline.tokenizer import load_tokenizer

        if not os.path.exists(tokenizer):
            raise ValueError(f"--tokenizer {tokenizer}: no such file or directory")
        tok = load_tokenizer(tokenizer)
    else:
        tok, tok_note = tokenizer_of_args(ckpt.args, vocab_size)
    if tok is not None:
        vocab_size = len(tok)
    vocab_size, multiple, vocab_note = vocab_padding(ckpt.args, vocab_size)
    adapter = _adapter(family)
    config, params, tied = _meta_model(family, adapter.config_from_megatron(ckpt.args, vocab_size, multiple))
    expected = {name: t.shape for name, t in adapter.to_megatron(params.__getitem__, config)}
    tensors = read_tensors(ckpt)
    _check_shapes(tensors, expected, ckpt)

    def ours() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in adapter.from_megatron(tensors.pop, config):  # pop: each Megatron tensor freed once used
            assert tensor.shape == params[name].shape, (name, tensor.shape, params[name].shape)
            yield name, tensor

    out = os.path.join(run_dir, "checkpoints", f"step_{ckpt.iteration}")
    write_weights_checkpoint(out, FAMILIES[family][0], config, ours(), tied, ckpt.iteration, _trainer_state(ckpt),
                             NO_OPTIMIZER_REASON)
    with open(os.path.join(run_dir, "checkpoints", "latest"), "w") as f:
        f.write(f"step_{ckpt.iteration}\n")
    run_tokenizer = None
    if tok is not None:
        run_tokenizer = os.path.join(run_dir, "tokenizer")
        save_run_tokenizer(tok, run_tokenizer, getattr(config, "max_position_embeddings", None))
    notes = [note for note in (tok_note, vocab_note) if note] + ckpt.notes
    return dict(checkpoint=os.path.abspath(out), family=family, config=config, iteration=ckpt.iteration,
                tensors=len(params), notes=notes, model_line=model_line(family, config), source=ckpt,
                tokenizer=run_tokenizer)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m zerogpt_tools.import_megatron", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("checkpoint", help="Megatron checkpoint: the --save directory (latest_checkpointed_iteration.txt) "
                                      "or one iter_N / release directory")
    p.add_argument("--out", required=True, help="zerogpt run directory; the checkpoint goes to "
                                                "OUT/checkpoints/step_<iteration>")
    p.add_argument("--tokenizer", default=None, help="the Megatron run's tokenizer (HF dir or file): its tokenizer "
                                                     "files are saved to OUT/tokenizer, and its size is the real "
                                                     "vocabulary (default: the one the checkpoint's args name, "
                                                     "when it is on this machine)")
    p.add_argument("--vocab-size", type=int, default=None, help="the real vocabulary size, without --tokenizer")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        stats = import_megatron(args.checkpoint, args.out, args.tokenizer, args.vocab_size)
    except (ValueError, KeyError) as e:
        raise SystemExit(f"error: {e}")
    src = stats["source"]
    print(f"[import_megatron] {src.directory} ({src.format}, TP={src.tp} PP={src.pp}, checkpoint_version "
          f"{src.version}) -> {stats['checkpoint']}: {stats['family']} family, {stats['tensors']} tensors, "
          f"iteration {stats['iteration']}")
    for note in stats["notes"]:
        print(f"[import_megatron] note: {note}")
    tok = stats["tokenizer"] or "<the Megatron run's tokenizer>"
    print(f"[import_megatron] continue it with a config holding\n    {stats['model_line']}\n    data = dict(..., "
          f"tokenizer={tok!r})\n  and: python train_gpt.py --config CFG --set train.output_dir={args.out} "
          f"--resume auto")
    return 0


if __name__ == "__main__":
    sys.exit(main())
