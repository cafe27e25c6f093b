"""Models for zerogpt, and `build_model`, which turns a config's `model = dict(type=..., **kwargs)` into an nn.Module.

The GPT-2 family (gpt.py) with its loss (loss.py), weight init (weight_init.py) and sampling (generation.py);
Hugging Face conversion and local HF causal LMs (hf.py). Knows nothing about ZeRO or data.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from model_zoo.gpt import GPT, GPTConfig, GPTOutput, gpt2_large, gpt2_medium, gpt2_small, gpt2_tiny, gpt2_xl
from model_zoo.hf import from_hf, to_hf
from model_zoo.loss import GPTLMLoss

__all__ = ["GPT", "GPTConfig", "GPTLMLoss", "GPTOutput", "from_hf", "to_hf", "gpt2_tiny", "gpt2_small",
           "gpt2_medium", "gpt2_large", "gpt2_xl", "build_model", "builds_on_meta"]

GPT_FACTORIES = (gpt2_tiny, gpt2_small, gpt2_medium, gpt2_large, gpt2_xl)


def builds_on_meta(model_cfg: dict[str, Any]) -> bool:
    """Whether `build_model(model_cfg)` may run under torch.device("meta"): a model_zoo GPT with fresh weights.

    Such a model has no storage until zerogpt.initialize fills each rank's shards from GPT.init_param_range.
    A pretrained GPT (pretrained=DIR), a Hugging Face model (type="hf") or another callable needs real weights.
    """
    return model_cfg.get("type") in GPT_FACTORIES and model_cfg.get("pretrained") is None


def build_model(model_cfg: dict[str, Any], vocab_size: int | None = None) -> nn.Module:
    """Build the model a config describes.

    Args:
        model_cfg: `dict(type=<callable>, **kwargs)` -> type(**kwargs); or `dict(type="hf", path=DIR, **kwargs)`
            -> a local Hugging Face causal LM (model_zoo.hf.load_hf_causal_lm).
        vocab_size: the tokenizer's vocabulary; passed to a callable as vocab_size unless the config sets it,
            and checked against an HF model's embedding size.
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

        if "path" not in kwargs:
            raise ValueError("model = dict(type='hf') needs path=DIR (a local save_pretrained directory)")
        model = load_hf_causal_lm(kwargs.pop("path"), **kwargs)
        rows = model.get_input_embeddings().num_embeddings
        if vocab_size is not None and vocab_size > rows:
            raise ValueError(f"the tokenizer has {vocab_size} tokens but the HF model's embedding has only {rows} "
                             f"rows; use the model's own tokenizer (data.tokenizer) or resize the model")
        return model
    if not callable(kind):
        raise TypeError(f"model.type must be a callable (e.g. gpt2_small) or 'hf', got {kind!r}")
    if vocab_size is not None and "vocab_size" not in kwargs:
        kwargs["vocab_size"] = vocab_size
    return kind(**kwargs)
