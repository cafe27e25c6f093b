"""Grow a Hugging Face GPT-2's vocabulary to a bigger tokenizer that keeps the old ids (merge-tokenizers output).

    python -m zerogpt_tools.extend_vocab --model exports/web --tokenizer runs/tok_web_code --out exports/web_code

The embedding (and an untied head) gets len(tokenizer) rows rounded up to --divisible-by; old rows are copied,
so old-token inputs give the same outputs, and new rows start at the mean of the old ones (J. Hewitt,
"Initializing New Word Embeddings for Pretrained Language Models", 2021) or at zeros. Tensors stream one at a time.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import Any

import torch

from zerogpt.cli import HelpFormatter

__all__ = ["grow_rows", "check_ids_kept", "extend_vocab", "main"]

VOCAB_TENSORS = ("transformer.wte.weight", "lm_head.weight")  # GPT-2's (vocab, n_embd) tensors
INITS = ("mean", "zeros")


def grow_rows(weight: torch.Tensor, rows: int, init: str, mean_of: int | None = None) -> torch.Tensor:
    """`weight` (V, C) with rows V..rows-1 appended: zeros, or the mean (in fp32) of its first `mean_of` rows
    (default all V; pass the old tokenizer's length so padding rows past it do not pull the mean)."""
    if init not in INITS:
        raise ValueError(f"--init {init!r}: choose one of {', '.join(INITS)}")
    extra = rows - weight.size(0)
    if init == "mean":
        new = weight[:mean_of].float().mean(dim=0, keepdim=True).expand(extra, -1).to(weight.dtype)
    else:
        new = weight.new_zeros(extra, weight.size(1))
    return torch.cat([weight, new])


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


def _check_model(model_dir: str) -> dict:
    config_path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"--model {model_dir}: no config.json there; point at a Hugging Face GPT-2 directory "
                         f"(e.g. `python -m zerogpt_tools.export RUN --out DIR` output)")
    with open(config_path) as f:
        config = json.load(f)
    if config.get("model_type") != "gpt2":
        raise ValueError(f"--model {model_dir} is a {config.get('model_type')!r} model; extend_vocab grows GPT-2 "
                         f"(model_type 'gpt2') embeddings only")
    return config


def extend_vocab(model_dir: str, tokenizer: str, out_dir: str, divisible_by: int = 128, init: str = "mean",
                 max_shard_bytes: int = 10**9) -> dict:
    """Write `model_dir` with its vocabulary grown to `tokenizer` at `out_dir` (atomically). Returns stats.

    Example:
        >>> extend_vocab("exports/web", "runs/tok_web_code", "exports/web_code")["vocab_size"]   # doctest: +SKIP
        58112
    """
    from transformers import AutoConfig

    from data_pipeline.tokenizer import load_tokenizer
    from zerogpt_tools.export import ShardWriter, atomic_output_dir, find_tokenizer, iter_hf_weights, save_tokenizer

    if divisible_by < 1:
        raise ValueError(f"--divisible-by must be >= 1, got {divisible_by}")
    if init not in INITS:
        raise ValueError(f"--init {init!r}: choose one of {', '.join(INITS)}")
    _check_model(model_dir)
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

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    old_rows = config.vocab_size
    rows = -(-len(new_tok) // divisible_by) * divisible_by
    if rows < old_rows:
        raise ValueError(f"the new tokenizer has {len(new_tok)} tokens ({rows} rows at --divisible-by "
                         f"{divisible_by}) but the model already has {old_rows} embedding rows; extend_vocab only "
                         f"grows the vocabulary (pass a bigger tokenizer, or a --divisible-by that reaches {old_rows})")

    grown = []
    with atomic_output_dir(out_dir) as tmp:
        writer = ShardWriter(tmp, max_shard_bytes)
        for name, tensor in iter_hf_weights(model_dir):
            if name in VOCAB_TENSORS:
                if tensor.size(0) != old_rows:
                    raise ValueError(f"{model_dir}: {name} has {tensor.size(0)} rows but config.json says "
                                     f"vocab_size={old_rows}; the directory is inconsistent")
                tensor = grow_rows(tensor, rows, init, mean_of=len(old_tok) if old_tok is not None else None)
                grown.append(name)
            writer.add(name, tensor)
        writer.close()
        if "transformer.wte.weight" not in grown:
            raise ValueError(f"{model_dir} has no transformer.wte.weight; not a GPT-2 checkpoint")
        config.vocab_size = rows
        config.eos_token_id = new_tok.eos_token_id if new_tok.eos_token_id is not None else config.eos_token_id
        config.save_pretrained(tmp)
        generation = os.path.join(model_dir, "generation_config.json")
        if os.path.isfile(generation):
            shutil.copy(generation, os.path.join(tmp, "generation_config.json"))
        save_tokenizer(new_tok, tmp, getattr(config, "max_position_embeddings", None))
    return dict(model=os.path.abspath(model_dir), out=os.path.abspath(out_dir), old_vocab_size=old_rows,
                tokenizer_size=len(new_tok), vocab_size=rows, new_rows=rows - old_rows, init=init, grown=grown,
                shards=len(writer.shards))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zerogpt-extend-vocab", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--model", required=True, help="Hugging Face GPT-2 directory (e.g. a zerogpt_tools.export output)")
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
          f", +{stats['new_rows']} rows initialised to the {stats['init']}) of {', '.join(stats['grown'])} "
          f"-> {stats['out']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
