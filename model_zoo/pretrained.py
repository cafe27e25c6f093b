"""Hugging Face checkpoints into model_zoo's native families, streamed: `from_pretrained(DIR)`.

config.json names the architecture; a Llama-family one (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
MistralForCausalLM) builds model_zoo's `Llama` on the meta device with the safetensors files as its weight source
(`Llama.weight_source`, read through `init_param_range`; model_zoo/llama.py load_pretrained). zerogpt.initialize
then fills each rank's shards straight from the files, reading only the rows that cover them: no rank holds the
whole model, not even in passing. Outside zerogpt, `device="cpu"` (or "cuda") fills a whole model one tensor at a
time. Other architectures are not native: `is_native` says so, and model_zoo.build_model takes them through
transformers (model_zoo.hf.load_hf_causal_lm).
"""
from __future__ import annotations

from typing import Any

import torch

from model_zoo.llama import Llama, load_pretrained
from model_zoo.llama_adapter import ARCHITECTURES
from model_zoo.safetensors_source import read_hf_config

__all__ = ["from_pretrained", "is_native"]


def is_native(directory: str) -> bool:
    """Whether config.json names an architecture model_zoo builds natively (the Llama family)."""
    return (read_hf_config(directory).get("architectures") or [None])[0] in ARCHITECTURES


def from_pretrained(directory: str, *, device: str | torch.device = "meta", dtype: torch.dtype = torch.float32,
                    **overrides: Any) -> Llama:
    """A native model of a local Hugging Face checkpoint, its weights streamed from the safetensors files.

    Args:
        directory: a save_pretrained directory (config.json, model.safetensors or sharded files with their index).
        device: "meta" (default): no storage; zerogpt.initialize fills each rank's shards from the files. Any other
            device: the whole model is filled there, one tensor at a time.
        dtype: the parameters' dtype off the meta device (the values are read as stored and cast).
        overrides: config fields that do not change the weights (checkpoint, chunked_loss, loss_chunk_size,
            attention_dropout, pad_vocab_multiple).
    Raises:
        ValueError naming config.json for an architecture no native family reproduces.
    Example:
        >>> model = from_pretrained("checkpoints/Meta-Llama-3.1-8B", checkpoint=True)   # doctest: +SKIP
        >>> engine = zerogpt.initialize(model, optimizer, config=cfg, ctx=ctx)           # doctest: +SKIP
    """
    return load_pretrained(directory, device=device, dtype=dtype, **overrides)
