"""Models for zerogpt, and `build_model`, which turns a config's `model = dict(type=..., **kwargs)` into an nn.Module.

Two native families: GPT-2 (gpt.py, its Hugging Face conversion in hf.py) and Llama / Qwen / Mistral (llama.py,
its mapping in llama_adapter.py), sharing layers.py, loss.py, weight_init.py and generation.py. Hugging Face
checkpoints of the Llama family stream into a meta-built native model (pretrained.py); any other local HF causal
LM loads through transformers (hf.load_hf_causal_lm). Knows nothing about ZeRO or data.
"""
from __future__ import annotations

from typing import Any, Callable

from torch import nn

from model_zoo.gpt import (GPT, GPTConfig, GPTOutput, from_hf, gpt2_large, gpt2_medium, gpt2_small, gpt2_tiny, gpt2_xl,
                           to_hf)
from model_zoo.llama import (Llama, LlamaConfig, llama2_7b, llama3_2_1b, llama3_2_3b, llama3_8b, llama_tiny,
                             mistral_7b, qwen2_5_0_5b, qwen2_5_7b, qwen3_0_6b, qwen3_8b)
from model_zoo.loss import GPTLMLoss
from model_zoo.pretrained import from_pretrained

__all__ = ["GPT", "GPTConfig", "GPTLMLoss", "GPTOutput", "from_hf", "to_hf", "gpt2_tiny", "gpt2_small",
           "gpt2_medium", "gpt2_large", "gpt2_xl", "build_model", "builds_on_meta", "Llama", "LlamaConfig",
           "from_pretrained", "llama_tiny", "llama2_7b", "llama3_2_1b", "llama3_2_3b", "llama3_8b", "qwen2_5_0_5b",
           "qwen2_5_7b", "qwen3_0_6b", "qwen3_8b", "mistral_7b"]

GPT_FACTORIES = (gpt2_tiny, gpt2_small, gpt2_medium, gpt2_large, gpt2_xl)
LLAMA_FACTORIES = (llama_tiny, llama2_7b, llama3_2_1b, llama3_2_3b, llama3_8b, qwen2_5_0_5b, qwen2_5_7b, qwen3_0_6b,
                   qwen3_8b, mistral_7b)


def builds_on_meta(model_cfg: dict[str, Any]) -> bool:
    """Whether `build_model(model_cfg)` may run under torch.device("meta"): a model_zoo factory with fresh weights.

    Such a model has no storage until zerogpt.initialize fills each rank's shards from its init_param_range.
    A pretrained GPT (pretrained=DIR) or another callable needs real weights; a Llama-family checkpoint
    (type="hf" or pretrained=DIR) is built on the meta device by build_model itself, its weights streamed.
    """
    factory = model_cfg.get("type")
    return factory in GPT_FACTORIES + LLAMA_FACTORIES and model_cfg.get("pretrained") is None


def build_model(model_cfg: dict[str, Any], vocab_size: int | None = None,
                log: Callable[[str], None] | None = None) -> nn.Module:
    """Build the model a config describes.

    Args:
        model_cfg: `dict(type=<callable>, **kwargs)` -> type(**kwargs); or `dict(type="hf", path=DIR, **kwargs)`
            -> a local Hugging Face causal LM: a Llama-family one as model_zoo's Llama on the meta device, its
            weights streamed from the files (pretrained.from_pretrained; kwargs are LlamaConfig fields such as
            checkpoint=True), any other through transformers (hf.load_hf_causal_lm; generic=True forces this path).
        vocab_size: the tokenizer's vocabulary; passed to a callable as vocab_size unless the config sets it or
            names a checkpoint (pretrained=DIR), and checked against an HF model's config.json vocab_size.
        log: gets, before an HF model loads, the line saying which path it takes and what that costs
            (pretrained.LoadPath.describe), and a note where config.json's label and fields disagree.
    Example:
        >>> build_model(dict(type=gpt2_tiny, checkpoint=True), vocab_size=512).config.vocab_size
        512
    """
    kwargs = dict(model_cfg)
    if "type" not in kwargs:
        raise ValueError(f"model config needs a 'type', e.g. model = dict(type=gpt2_small); got {model_cfg!r}")
    kind = kwargs.pop("type")
    if kind == "hf":
        from model_zoo.hf import load_hf_causal_lm
        from model_zoo.pretrained import load_path

        if "path" not in kwargs:
            raise ValueError("model = dict(type='hf') needs path=DIR (a local save_pretrained directory)")
        path, generic = kwargs.pop("path"), kwargs.pop("generic", False)
        how = load_path(path, generic)
        if log is not None:
            log(how.describe())
            if how.note:
                log(f"note: {how.note}")
        model = from_pretrained(path, **kwargs) if how.native else load_hf_causal_lm(path, **kwargs)
        # config.json's vocab_size, not the embedding's rows: a native model pads them (1000 -> 1024), and the
        # padding rows are no tokens
        real = getattr(model.config, "vocab_size", None) or model.get_input_embeddings().num_embeddings
        if vocab_size is not None and vocab_size > real:
            raise ValueError(f"the tokenizer has {vocab_size} tokens but {path}/config.json's vocab_size is {real}; "
                             f"use the model's own tokenizer (data.tokenizer) or resize the model "
                             f"(python -m zerogpt_tools.extend_vocab)")
        return model
    if not callable(kind):
        raise TypeError(f"model.type must be a callable (e.g. gpt2_small) or 'hf', got {kind!r}")
    if vocab_size is not None and "vocab_size" not in kwargs and kwargs.get("pretrained") is None:
        kwargs["vocab_size"] = vocab_size  # a checkpoint's vocabulary is its own (preflight compares the two)
    return kind(**kwargs)
