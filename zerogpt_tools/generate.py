"""Generate text from an exported Hugging Face directory or a zerogpt checkpoint / run directory, with a KV cache.

    python -m zerogpt_tools.generate --model exports/demo_cpu --prompt "The json module" --max-new-tokens 50
    python -m zerogpt_tools.generate --model runs/demo_cpu --prompt "Return" --greedy

One decoding loop for both (prefill once, then one token at a time with the cache); a checkpoint is rebuilt
through the model class it records (see zerogpt_tools/export.py). Greedy decoding gives the same tokens as
transformers' `generate(do_sample=False)` on the export; sampling is reproducible for a --seed.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch

from data_pipeline.cli_args import ArgumentParser
from zerogpt.cli import HelpFormatter

__all__ = ["SamplingConfig", "load_model", "next_token", "generate_ids", "generate_text", "main"]


@dataclass
class SamplingConfig:
    """How the next token is picked from the logits."""

    greedy: bool = False
    """Argmax at every step (temperature, top_k and top_p are then ignored)."""
    temperature: float = 1.0
    """Divide logits by this before sampling; 0 means greedy."""
    top_k: int | None = None
    """Sample only among the k most likely tokens."""
    top_p: float | None = None
    """Nucleus sampling: the smallest set of tokens whose probability sums to at least top_p."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"--top-k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")


def next_token(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None = None) -> int:
    """Pick one token id from `logits` (vocab,) by `sampling`; sampling draws on CPU from `generator`."""
    if sampling.greedy or sampling.temperature == 0:
        return int(logits.argmax())
    logits = logits.float().cpu() / sampling.temperature
    if sampling.top_k is not None:
        kth = torch.topk(logits, min(sampling.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p is not None and sampling.top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p (the most likely one always stays).
        drop = (torch.cumsum(probs, dim=-1) - probs) >= sampling.top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))


def context_length(model: torch.nn.Module) -> int:
    """Longest sequence the model takes (learned positions): GPTConfig and GPT2Config both answer this."""
    return int(model.config.max_position_embeddings)


@torch.no_grad()
def generate_ids(model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingConfig,
                 generator: torch.Generator | None = None, eos_id: int | None = None,
                 vocab_limit: int | None = None) -> list[int]:
    """New token ids after `prompt_ids`, decoded with a KV cache.

    Args:
        model: our GPT or an HF causal LM, in eval mode.
        prompt_ids: at least one token; prompt + max_new_tokens must fit the model's context.
        eos_id: stop after emitting it (it is included); None never stops early.
        vocab_limit: ids >= this are never picked (an embedding padded past the tokenizer, e.g. extend_vocab's).
    """
    if not prompt_ids:
        raise ValueError("the prompt encodes to no tokens; give some text (or a tokenizer with an EOS to start from)")
    context = context_length(model)
    if len(prompt_ids) > context:
        raise ValueError(f"the prompt is {len(prompt_ids)} tokens but the model's context is {context}; "
                         f"shorten the prompt")
    if len(prompt_ids) + max_new_tokens > context:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + --max-new-tokens {max_new_tokens} exceeds the model's "
                         f"context of {context}; pass --max-new-tokens {context - len(prompt_ids)} or less")
    device = next(model.parameters()).device
    out = model(torch.tensor([prompt_ids], device=device), use_cache=True)  # prefill: (1, T, vocab)
    new: list[int] = []
    while len(new) < max_new_tokens:
        logits = out.logits[0, -1]
        if vocab_limit is not None and vocab_limit < logits.numel():
            logits = logits[:vocab_limit]
        new.append(next_token(logits, sampling, generator))
        if new[-1] == eos_id or len(new) == max_new_tokens:
            break
        out = model(torch.tensor([[new[-1]]], device=device), past_key_values=out.past_key_values, use_cache=True)
    return new


# ------------------------------------------------------------------------------------------------
# loading


def _load_checkpoint_model(reader: Any) -> torch.nn.Module:
    """Rebuild the recorded model class and fill it from the checkpoint, one tensor at a time."""
    from zerogpt_tools.model_plugin import ModelPlugin

    model = ModelPlugin(reader.meta["model"]).build()
    targets = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    tied = reader.meta.get("tied", {})
    saved = set(reader.names())
    missing = [n for n in model.state_dict() if n not in saved and n not in tied]
    if missing:
        raise ValueError(f"checkpoint {reader.directory} lacks {missing[:5]} of model {reader.meta['model']['class']}")
    with torch.no_grad():
        for name in reader.names():
            if name in targets:
                targets[name].copy_(reader.tensor(name))
    return model


def load_model(path: str, tokenizer: str | None = None, device: str = "cpu",
               dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, Any]:
    """(model in eval mode on `device`, tokenizer) from an HF dir or a checkpoint / run dir.

    The tokenizer is `tokenizer` if given, else an HF dir's own tokenizer files, else the run's own RUN/tokenizer
    (import_megatron --tokenizer writes it), else the run config's data.tokenizer; ValueError naming the fix when
    there is none.
    """
    from data_pipeline.tokenizer import load_tokenizer
    from model_zoo.hf import check_hf_dir, load_checked
    from zerogpt.preflight import check_vocab, run_data_vocab
    from zerogpt_tools.run_tokenizer import find_tokenizer

    if not os.path.isdir(path):
        raise ValueError(f"--model {path}: no such directory (an exported HF dir, a run dir or a checkpoint dir)")
    dataset = None
    if os.path.isfile(os.path.join(path, "config.json")):
        check_hf_dir(path)  # a corrupt model.safetensors is named here, not in a transformers traceback
        model = load_checked(path, dtype=dtype)  # weights that do not fit config.json: one line, not a random model
        tok_path = find_tokenizer(tokenizer, model_dir=path)
    else:
        from zerogpt.checkpoint import CheckpointReader, resolve_checkpoint

        reader = CheckpointReader(resolve_checkpoint(path))
        model = _load_checkpoint_model(reader).to(dtype)
        tok_path = find_tokenizer(tokenizer, reader)
        dataset = run_data_vocab(reader.config_path)
    if tok_path is None:
        raise ValueError(f"no tokenizer found for {path} (no tokenizer files there, no tokenizer/ in its run "
                         f"directory and no data.tokenizer in its run config); pass --tokenizer DIR, the tokenizer "
                         f"the model was trained with")
    tok = load_tokenizer(tok_path)
    check_vocab(tokenizer=(len(tok), f"tokenizer {tok_path}"), dataset=dataset,
                model=(model.config.vocab_size, f"vocab_size of {path}"))
    return model.to(device).eval(), tok


def generate_text(model: torch.nn.Module, tok: Any, prompt: str, max_new_tokens: int = 50,
                  sampling: SamplingConfig | None = None, seed: int | None = None,
                  stop_at_eos: bool = True) -> tuple[list[int], list[int]]:
    """(prompt ids, new ids) for a text prompt; an empty prompt starts from the tokenizer's BOS/EOS."""
    ids = tok(prompt, add_special_tokens=False)["input_ids"] if prompt else []
    if not ids:
        start = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
        ids = [start] if start is not None else []
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    new = generate_ids(model, ids, max_new_tokens, sampling or SamplingConfig(), generator,
                       eos_id=tok.eos_token_id if stop_at_eos else None, vocab_limit=len(tok))
    return ids, new


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="zerogpt-generate", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--model", required=True, help="exported HF dir, run dir (checkpoints/latest) or checkpoint dir")
    p.add_argument("--prompt", required=True, help="text to continue ('' starts from the tokenizer's BOS/EOS)")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir/file (default: the model dir's or the run's)")
    p.add_argument("--max-new-tokens", type=int, default=50, help="tokens to generate at most (default 50)")
    # sampling
    p.add_argument("--greedy", action="store_true", help="argmax decoding (same tokens as HF do_sample=False)")
    p.add_argument("--temperature", type=float, default=1.0, help="logit temperature; 0 = greedy (default 1.0)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling threshold in (0, 1]")
    p.add_argument("--seed", type=int, default=None, help="sampling seed: the same seed gives the same text")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating after the tokenizer's EOS")
    # numerics and placement
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda, cuda:1 ...")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="compute dtype (default fp32)")
    return p


def main(argv: list[str] | None = None) -> int:
    from zerogpt_tools.model_plugin import DTYPES

    args = build_parser().parse_args(argv)
    if args.max_new_tokens < 1:
        raise SystemExit(f"error: --max-new-tokens must be >= 1, got {args.max_new_tokens}")
    try:
        sampling = SamplingConfig(args.greedy, args.temperature, args.top_k, args.top_p)
        model, tok = load_model(args.model, args.tokenizer, args.device, DTYPES[args.dtype])
        ids, new = generate_text(model, tok, args.prompt, args.max_new_tokens, sampling, args.seed,
                                 stop_at_eos=not args.ignore_eos)
    except ValueError as e:  # CheckpointError is a ValueError
        raise SystemExit(f"error: {e}")
    # The EOS generation stopped at ends the text, it is not part of it (--ignore-eos shows every one it passed).
    if new and new[-1] == tok.eos_token_id and not args.ignore_eos:
        new = new[:-1]
    # Decode prompt and continuation together: a byte-level token may end mid-character. Trailing whitespace (a
    # small model's greedy run of newlines) would print as a screen of blank lines: the text ends at its last
    # visible character.
    print((tok.decode(ids + new) if args.prompt else tok.decode(new)).rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
