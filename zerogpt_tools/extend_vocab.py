"""Grow a Hugging Face model's vocabulary to a bigger tokenizer that keeps the old ids (merge-tokenizers output).

    python -m data_pipeline merge-tokenizers MODEL_DIR runs/tok_other --out runs/tok_merged
    python -m zerogpt_tools.extend_vocab --model MODEL_DIR --tokenizer runs/tok_merged --out exports/merged

Models: GPT-2 (a zerogpt_tools.export output) and the Llama family (LlamaForCausalLM, Qwen2ForCausalLM,
Qwen3ForCausalLM, MistralForCausalLM). Each family's token-indexed tensors come from its adapter (VOCAB_TENSORS).
The embedding (and an untied head; a tied one is not in the files and follows the embedding) gets len(tokenizer)
rows rounded up to --divisible-by; old rows are copied, so old-token inputs give the same outputs, and the rows of
new tokens start at the mean of the old tokens' rows (J. Hewitt, "Initializing New Word Embeddings for Pretrained
Language Models", 2021) or at zeros. Tensors stream one at a time; config.json is edited, not rebuilt.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import Any

import torch

from model_zoo.llama import ARCHITECTURES
from model_zoo.llama_adapter import VOCAB_ROWS
from data_pipeline.cli_args import ArgumentParser
from zerogpt.cli import HelpFormatter

__all__ = ["VOCAB_TENSORS", "grow_rows", "check_ids_kept", "extend_vocab", "main"]

# Per architecture: the (rows, hidden) tensors indexed by token id, the embedding first (a tied head is absent).
VOCAB_TENSORS: dict[str, tuple[str, ...]] = {
    "GPT2LMHeadModel": ("transformer.wte.weight", "lm_head.weight"),
    **{arch: VOCAB_ROWS for arch in ARCHITECTURES},
}
_ARCH_OF_MODEL_TYPE = {"gpt2": "GPT2LMHeadModel"}  # zerogpt_tools.export's GPT-2 config.json names no architectures
INITS = ("mean", "zeros")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json")


def grow_rows(weight: torch.Tensor, rows: int, init: str, mean_of: int | None = None,
              taken: int | None = None) -> torch.Tensor:
    """`weight` (V, C) grown to (rows, C): rows V..rows-1 appended as zeros, or as the mean (in fp32) of its first
    `mean_of` rows (default all V: pass the old tokenizer's length so padding rows past it do not pull the mean).

    Rows from `mean_of` up to `taken` (the new tokenizer's length) that V already had, padding rows such as
    Qwen2.5's 151665..151935, now belong to new tokens and get the same init; padding rows past `taken` stay.
    """
    if init not in INITS:
        raise ValueError(f"--init {init!r}: choose one of {', '.join(INITS)}")
    old = weight.size(0) if mean_of is None else min(mean_of, weight.size(0))
    if init == "mean":
        fill = weight[:old].float().mean(dim=0, keepdim=True).to(weight.dtype)
    else:
        fill = weight.new_zeros(1, weight.size(1))
    grown = torch.cat([weight, fill.expand(rows - weight.size(0), -1)])
    if taken is not None and taken > old:
        grown[old:min(taken, weight.size(0))] = fill
    return grown


def check_ids_kept(old_tok: Any, new_tok: Any) -> None:
    """ValueError unless every token of `old_tok` has the same id in `new_tok` (old embedding rows stay valid)."""
    new_vocab = new_tok.get_vocab()
    moved = [(t, i, new_vocab.get(t)) for t, i in sorted(old_tok.get_vocab().items(), key=lambda kv: kv[1])
             if new_vocab.get(t) != i]
    if moved:
        examples = ", ".join(f"{t!r}: {i} -> {j}" for t, i, j in moved[:5])
        raise ValueError(f"the new tokenizer changes or drops {len(moved)} of the model's {len(old_tok)} token ids "
                         f"({examples}); the old embedding rows would mean other tokens. Build it with "
                         f"`python -m data_pipeline merge-tokenizers OLD_TOKENIZER OTHER --out NEW`, which keeps "
                         f"OLD_TOKENIZER's ids")


def _read_model_config(model_dir: str) -> tuple[dict, str]:
    """config.json of `model_dir` and its architecture (a key of VOCAB_TENSORS); one-line errors otherwise."""
    config_path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"--model {model_dir}: no config.json there; point at a Hugging Face directory of a GPT-2 "
                         f"(e.g. `python -m zerogpt_tools.export RUN --out DIR` output) or a Llama-family model")
    with open(config_path) as f:
        config = json.load(f)
    arch = (config.get("architectures") or [_ARCH_OF_MODEL_TYPE.get(config.get("model_type"))])[0]
    if arch not in VOCAB_TENSORS:
        raise ValueError(f"--model {model_dir} is a {arch or config.get('model_type')!r} model; extend_vocab grows "
                         f"the vocabulary of {', '.join(VOCAB_TENSORS)} checkpoints")
    if not isinstance(config.get("vocab_size"), int):
        raise ValueError(f"{config_path} has no integer vocab_size ({config.get('vocab_size')!r}); the directory "
                         f"is not a save_pretrained output")
    return config, arch


def _special_id(model_id: int | list[int] | None, tokenizer_id: int | None) -> int | list[int] | None:
    """bos/eos for config.json: the model's unless the tokenizer names another (a list that holds it stays, as
    Llama-3-Instruct's eos list [128001, 128008, 128009] does)."""
    if tokenizer_id is None or model_id == tokenizer_id or (isinstance(model_id, list) and tokenizer_id in model_id):
        return model_id
    return tokenizer_id


def _write_json_config(src: str, dst: str, updates: dict[str, Any]) -> None:
    """`src` (a JSON config) written to `dst` with `updates`; every other key is kept as the model had it."""
    with open(src) as f:
        config = json.load(f)
    config.update(updates)
    with open(dst, "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")


def _copy_tokenizer_files(tokenizer: str, out_dir: str) -> list[str]:
    """Copy a tokenizer directory's files as they are (tokenizer.model for sentencepiece users, the class, chat
    template and added tokens as its author wrote them; a transformers round trip would rewrite them). Returns the
    names copied: none unless `tokenizer` is a directory with a tokenizer_config.json."""
    if not os.path.isfile(os.path.join(tokenizer, "tokenizer_config.json")):
        return []
    names = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(tokenizer, n))]
    for name in names:
        shutil.copy(os.path.join(tokenizer, name), os.path.join(out_dir, name))
    return names


def extend_vocab(model_dir: str, tokenizer: str, out_dir: str, divisible_by: int = 128, init: str = "mean",
                 max_shard_bytes: int = 10**9) -> dict:
    """Write `model_dir` with its vocabulary grown to `tokenizer` at `out_dir` (atomically). Returns stats.

    Args:
        model_dir: a Hugging Face GPT-2 or Llama-family directory (config.json, safetensors, tokenizer files).
        tokenizer: the bigger tokenizer; it must keep the model tokenizer's ids (merge-tokenizers output).
        divisible_by: round the rows up to a multiple of this (never below the model's rows).
        init: "mean" (new rows = mean of the old tokens' rows) or "zeros".
    Example:
        >>> extend_vocab("exports/web", "runs/tok_web_code", "exports/web_code")["vocab_size"]   # doctest: +SKIP
        58112
    """
    from data_pipeline.tokenizer import load_tokenizer
    from zerogpt_tools.export import ShardWriter, atomic_output_dir, find_tokenizer, iter_hf_weights, save_tokenizer

    if divisible_by < 1:
        raise ValueError(f"--divisible-by must be >= 1, got {divisible_by}")
    if init not in INITS:
        raise ValueError(f"--init {init!r}: choose one of {', '.join(INITS)}")
    config, arch = _read_model_config(model_dir)
    if not os.path.exists(tokenizer):
        raise ValueError(f"--tokenizer {tokenizer}: no such file or directory")
    new_tok = load_tokenizer(tokenizer)
    old_tok_path = find_tokenizer(None, model_dir=model_dir)
    old_tok = load_tokenizer(old_tok_path) if old_tok_path else None
    if old_tok is not None:
        check_ids_kept(old_tok, new_tok)
    else:
        print(f"[extend-vocab] warning: {model_dir} has no tokenizer files, so the new tokenizer's ids cannot be "
              f"checked against the model's; make sure it extends the one the model was trained with", file=sys.stderr)

    old_rows = config["vocab_size"]
    # The model's tokens: its tokenizer's (rows past it are padding, as Qwen2.5's), else all its rows.
    old_tokens = len(old_tok) if old_tok is not None else old_rows
    if len(new_tok) < old_tokens:
        raise ValueError(f"the new tokenizer has {len(new_tok)} tokens but the model has {old_tokens} "
                         f"({'its tokenizer' if old_tok is not None else 'embedding rows, and no tokenizer files'}); "
                         f"extend_vocab only grows the vocabulary (pass a bigger tokenizer that keeps the model's "
                         f"ids: `python -m data_pipeline merge-tokenizers MODEL_TOKENIZER OTHER --out NEW`)")
    rows = max(old_rows, -(-len(new_tok) // divisible_by) * divisible_by)

    embedding = VOCAB_TENSORS[arch][0]
    grown = []
    with atomic_output_dir(out_dir) as tmp:
        writer = ShardWriter(tmp, max_shard_bytes)
        for name, tensor in iter_hf_weights(model_dir):
            if name in VOCAB_TENSORS[arch]:
                if tensor.size(0) != old_rows:
                    raise ValueError(f"{model_dir}: {name} has {tensor.size(0)} rows but config.json says "
                                     f"vocab_size={old_rows}; the directory is inconsistent")
                tensor = grow_rows(tensor, rows, init, mean_of=old_tokens, taken=len(new_tok))
                grown.append(name)
            writer.add(name, tensor)
        writer.close()
        if embedding not in grown:
            raise ValueError(f"{model_dir} has no {embedding} in its safetensors files; not a {arch} checkpoint")
        special = {key: _special_id(config.get(key), getattr(new_tok, key)) for key in ("bos_token_id", "eos_token_id")
                   if key in config or getattr(new_tok, key) is not None}
        _write_json_config(os.path.join(model_dir, "config.json"), os.path.join(tmp, "config.json"),
                           {"vocab_size": rows, **special})
        generation = os.path.join(model_dir, "generation_config.json")
        if os.path.isfile(generation):
            with open(generation) as f:
                keys = json.load(f).keys()
            _write_json_config(generation, os.path.join(tmp, "generation_config.json"),
                               {k: v for k, v in special.items() if k in keys})
        copied = _copy_tokenizer_files(tokenizer, tmp)
        if not copied:  # a bare tokenizer.json or vocab.json + merges.txt: saved the way export saves one
            save_tokenizer(new_tok, tmp, config.get("max_position_embeddings", config.get("n_positions")))
    return dict(model=os.path.abspath(model_dir), out=os.path.abspath(out_dir), architecture=arch,
                old_vocab_size=old_rows, tokenizer_size=len(new_tok), vocab_size=rows, new_rows=rows - old_rows,
                new_tokens=len(new_tok) - old_tokens, init=init, grown=grown, shards=len(writer.shards))


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="zerogpt-extend-vocab", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--model", required=True, help="Hugging Face directory of a GPT-2 (e.g. a zerogpt_tools.export "
                   "output), Llama, Qwen2, Qwen3 or Mistral")
    p.add_argument("--tokenizer", required=True, help="the bigger tokenizer (keeps the model's ids: merge-tokenizers)")
    p.add_argument("--out", required=True, help="output directory; replaced atomically")
    p.add_argument("--divisible-by", type=int, default=128, help="round the rows up to a multiple of this (128)")
    p.add_argument("--init", default="mean", choices=INITS, help="new rows: mean of the old rows (default) or zeros")
    p.add_argument("--max-shard-size", default="1GB", help="largest safetensors file, e.g. 500MB (default 1GB)")
    return p


def main(argv: list[str] | None = None) -> int:
    from data_pipeline.cli_args import parse_size

    args = build_parser().parse_args(argv)
    try:
        stats = extend_vocab(args.model, args.tokenizer, args.out, args.divisible_by, args.init,
                             parse_size(args.max_shard_size, "--max-shard-size"))
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    print(f"[extend-vocab] {stats['old_vocab_size']} -> {stats['vocab_size']} rows (tokenizer {stats['tokenizer_size']}"
          f", +{stats['new_tokens']} tokens whose rows start at the {stats['init']}) of {', '.join(stats['grown'])} "
          f"-> {stats['out']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
