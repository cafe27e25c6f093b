"""Export a zerogpt checkpoint as a Megatron-LM checkpoint, split for tensor and pipeline parallelism.

    python -m zerogpt_tools.export RUN_DIR --format megatron --out DIR [--tp N] [--pp M] [--core [--dist]]

Writes DIR/latest_checkpointed_iteration.txt and DIR/iter_<step>/: by default the legacy layout
(mp_rank_XX[_YYY]/model_optim_rng.pt with model.language_model.{embedding,encoder}, checkpoint_version 3.0: what
transformers' Megatron GPT-2 converter reads), with --core Megatron-Core's torch format (Transformer Engine
names), with --core --dist its torch_dist format (through torch.distributed.checkpoint). GPT-2 and the Llama family,
through their adapters' Megatron hooks (model_zoo/hf.py, model_zoo/llama_adapter.py). The files hold args,
checkpoint_version, iteration and the model: no optimizer or RNG state, so Megatron loads them with
--no-load-optim --no-load-rng (or --finetune). The vocabulary is padded as Megatron pads it for the requested TP.
The run's tokenizer (--tokenizer, else as the HF export finds it) is recorded as args.tokenizer_model, Megatron's
own key for it, so that import_megatron loads it back and an HF export of the import has its bos/eos ids.
"""
from __future__ import annotations

import importlib
import math
import os
from typing import Any, Iterator

import torch

from zerogpt_tools.megatron_files import write_checkpoint
from zerogpt_tools.model_plugin import DTYPES, ModelPlugin, resolve_dtype
from zerogpt_tools.megatron_layout import CORE, FAMILIES, LEGACY, MegatronLayoutError, family_of_class

__all__ = ["export_megatron", "megatron_vocab_rows", "trained_seq_length"]

_DTYPE_ARGS = {"fp32": dict(fp16=False, bf16=False, params_dtype=torch.float32),
               "bf16": dict(fp16=False, bf16=True, params_dtype=torch.bfloat16),
               "fp16": dict(fp16=True, bf16=False, params_dtype=torch.float16)}


def megatron_vocab_rows(vocab_size: int, rows: int, tp: int) -> tuple[int, int]:
    """(rows to write, make_vocab_size_divisible_by): our `rows` when `tp` divides them (a round trip keeps them
    all), else Megatron's padding of `vocab_size` to a multiple of 128 x tp; and the power of two d, Megatron's
    default 128 if it does, with which Megatron's own padding, ceil(vocab / (d x tp)) x d x tp, gives those rows
    (Megatron compares both with its arguments when it loads with a vocabulary file: pass the one recorded)."""
    if rows % tp:
        rows = math.ceil(vocab_size / (128 * tp)) * 128 * tp
    for d in sorted((2**k for k in range(max(1, rows).bit_length() + 1)), key=lambda d: (d < 128, abs(d - 128))):
        if math.ceil(vocab_size / (d * tp)) * d * tp == rows:
            return rows, d
    return rows, 128  # none does: Megatron, loading with a vocabulary file, pads its own way and refuses the rows


def trained_seq_length(trainer: dict, imported: dict | None, config_seq_len: int | None,
                       max_position_embeddings: int) -> int:
    """Megatron's seq_length: the sequence length the run trained at, not the model's context.

    Megatron's consumed_train_samples x seq_length is the tokens the model has seen, and import_megatron reads
    them back so; the context (often twice the training length) would double the count after a round trip.
    In order: the run config's SEQ_LEN; a Megatron import not trained since, its own seq_length; the trainer's
    tokens_seen / consumed_samples (both per sample); max_position_embeddings for a run with no step.
    """
    if config_seq_len:
        return config_seq_len
    if imported and imported.get("seq_length"):
        return int(imported["seq_length"])
    samples, tokens = int(trainer.get("consumed_samples", 0)), int(trainer.get("tokens_seen", 0))
    return tokens // samples if samples and tokens else max_position_embeddings


def _config_seq_len(config_path: str | None) -> int | None:
    """SEQ_LEN of the run config a checkpoint recorded; None without one, or when it no longer loads here."""
    if not config_path:
        return None
    from zerogpt.config import Config

    try:
        return int(Config.from_file(config_path).SEQ_LEN)
    except Exception:  # its code is not importable here: the counters decide instead
        return None


def _resize_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    if tensor.size(0) >= rows:
        return tensor[:rows]
    return torch.cat([tensor, tensor.new_zeros(rows - tensor.size(0), *tensor.shape[1:])])


def _run_tokenizer(explicit: str | None, reader: Any) -> tuple[str | None, str | None]:
    """(the run's tokenizer as an absolute path, or None with a note saying why args name none)."""
    from zerogpt_tools.run_tokenizer import TOKENIZER_HINT, find_tokenizer

    try:
        path = find_tokenizer(explicit, reader)
    except ValueError as e:
        if explicit:  # the user's own mistake stops the export; a recorded config that no longer loads does not
            raise
        return None, f"args.tokenizer_model is not written: {e}"
    if path is None:
        return None, (f"args.tokenizer_model is not written (the run has no tokenizer/ and its config no "
                      f"data.tokenizer), so an import back has no bos/eos ids; {TOKENIZER_HINT}")
    return os.path.abspath(path), None


def export_megatron(path: str, out_dir: str, tp: int = 1, pp: int = 1, core: bool = False, dist: bool = False,
                    dtype: str = "auto", tokenizer: str | None = None) -> dict:
    """Write checkpoint (or run dir) `path` as a Megatron checkpoint under `out_dir` (see the module docstring).

    Args:
        tp, pp: tensor- and pipeline-parallel sizes of the files (torch format; torch_dist holds global tensors).
        core: Megatron-Core's names instead of the legacy layout; dist: its torch_dist format (needs core).
        dtype: "fp32", "bf16", "fp16", or "auto" (the dtype the model's source checkpoint had, fp32 if none).
        tokenizer: the run's tokenizer to record as args.tokenizer_model; default the one the HF export would ship.
    Returns:
        dict(checkpoint, out, iteration, layout, files, dtype, notes).
    """
    from zerogpt.checkpoint import CheckpointReader, resolve_checkpoint

    if dist and not core:
        raise ValueError("--dist writes Megatron-Core's torch_dist format; add --core")
    if tp < 1 or pp < 1:
        raise ValueError(f"--tp {tp} --pp {pp}: both must be >= 1")
    reader = CheckpointReader(resolve_checkpoint(path))
    model = reader.meta["model"]
    family = family_of_class(model.get("class", ""))
    plugin = ModelPlugin(model)
    dtype, why = resolve_dtype(dtype, plugin)
    adapter = importlib.import_module(FAMILIES[family][1])
    config = model["config"]
    args = adapter.megatron_args(config)
    heads, groups = args["num_attention_heads"], args["num_query_groups"]
    if heads % tp or groups % tp:
        raise MegatronLayoutError(f"--tp {tp} must divide num_attention_heads={heads} and the k/v groups ({groups})")
    rows, divisible_by = megatron_vocab_rows(config["vocab_size"], reader.shape(_embedding_name(family))[0], tp)
    extra = reader.meta.get("extra_state") or {}
    trainer = extra.get("trainer") or {}
    iteration = int(trainer.get("step", reader.meta.get("global_step", 0)))
    # The model's tokens as samples of the trained length: what a re-import multiplies back (the trainer's own
    # consumed_samples excludes the samples of a Megatron run it was imported from; its tokens_seen does not).
    seq_length = trained_seq_length(trainer, extra.get("megatron"), _config_seq_len(reader.config_path),
                                    args["max_position_embeddings"])
    tokens = int(trainer.get("tokens_seen", 0))
    samples = tokens // seq_length if tokens else int(trainer.get("consumed_samples", 0))
    tokenizer_model, tokenizer_note = _run_tokenizer(tokenizer, reader)
    args.update(padded_vocab_size=rows, make_vocab_size_divisible_by=divisible_by, vocab_size=config["vocab_size"],
                tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                seq_length=seq_length, consumed_valid_samples=0,
                consumed_train_samples=samples,
                tokenizer_type="GPT2BPETokenizer" if family == "gpt" and config["vocab_size"] == 50257
                else "HuggingFaceTokenizer", tokenizer_model=tokenizer_model,
                ckpt_format="torch_dist" if dist else "torch", use_legacy_models=not core, use_mcore_models=core,
                transformer_impl="transformer_engine" if core else "local", **_DTYPE_ARGS[dtype])

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in adapter.to_megatron(reader.tensor, config):
            if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                tensor = _resize_rows(tensor, rows)
            yield name, tensor.to(DTYPES[dtype])

    files = write_checkpoint(out_dir, tensors(), args, iteration, CORE if core else LEGACY, tp, pp, dist)
    notes = [note for note in (f"dtype {dtype}: {why}" if why else None, tokenizer_note) if note]
    return dict(checkpoint=reader.directory, out=os.path.abspath(out_dir), iteration=iteration,
                layout=("core torch_dist" if dist else "core torch") if core else "legacy", files=files, dtype=dtype,
                notes=notes, padded_vocab_size=rows)


def _embedding_name(family: str) -> str:
    return "transformer.wte.weight" if family == "gpt" else "model.embed_tokens.weight"


def main_megatron(args: Any) -> int:
    """export.py's main hands `--format megatron` here with its parsed arguments."""
    stats = export_megatron(args.checkpoint, args.out, args.tp, args.pp, args.core, args.dist, args.dtype,
                            args.tokenizer)
    print(f"[export] {stats['checkpoint']} -> {stats['out']}: Megatron {stats['layout']} layout, iteration "
          f"{stats['iteration']}, TP={args.tp} PP={args.pp}, {len(stats['files'])} files, {stats['dtype']}, "
          f"padded vocab {stats['padded_vocab_size']}; load in Megatron with --no-load-optim --no-load-rng")
    for note in stats["notes"]:
        print(f"[export] note: {note}")
    return 0
