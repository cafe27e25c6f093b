"""Hugging Face checkpoints into model_zoo's native families, streamed: `from_pretrained(DIR)`.

config.json names the architecture; a Llama-family one (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
MistralForCausalLM) builds model_zoo's `Llama` on the meta device with the safetensors files as its weight source
(`Llama.weight_source`, read through `init_param_range`). zerogpt.initialize then fills each rank's shards straight
from the files, reading only the rows that cover them: no rank holds the whole model, not even in passing. Outside
zerogpt, `device="cpu"` (or "cuda") fills a whole model one tensor at a time. Other architectures are not native:
`is_native` says so, and model_zoo.build_model takes them through transformers (model_zoo.hf.load_hf_causal_lm).
"""
from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn

from model_zoo.llama import ARCHITECTURES, SIZES, Llama
from model_zoo.llama_adapter import config_from_hf, hf_name
from model_zoo.safetensors_source import SafetensorsDir

__all__ = ["from_pretrained", "read_hf_config", "is_native"]


def read_hf_config(directory: str) -> dict[str, Any]:
    """config.json of a local HF model directory, with one-line errors for a missing or unreadable one."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{directory}: no config.json there; point at a directory written by save_pretrained "
                         f"(nothing is downloaded)")
    try:
        with open(path) as f:
            return json.load(f)
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None


def is_native(directory: str) -> bool:
    """Whether config.json names an architecture model_zoo builds natively (the Llama family)."""
    return (read_hf_config(directory).get("architectures") or [None])[0] in ARCHITECTURES


def from_pretrained(directory: str, *, device: str | torch.device = "meta", dtype: torch.dtype = torch.float32,
                    expect: str | None = None, **overrides: Any) -> Llama:
    """A native model of a local Hugging Face checkpoint, its weights streamed from the safetensors files.

    Args:
        directory: a save_pretrained directory (config.json, model.safetensors or sharded files with their index).
        device: "meta" (default): no storage; zerogpt.initialize fills each rank's shards from the files. Any other
            device: the whole model is filled there, one tensor at a time.
        dtype: the parameters' dtype off the meta device (the values are read as stored and cast).
        expect: a factory name ("llama3_8b"): refuse a checkpoint of another shape.
        overrides: LlamaConfig fields that do not change the weights (checkpoint, chunked_loss, loss_chunk_size,
            attention_dropout, pad_vocab_multiple).
    Example:
        >>> model = from_pretrained("checkpoints/Meta-Llama-3.1-8B", checkpoint=True)   # doctest: +SKIP
        >>> engine = zerogpt.initialize(model, optimizer, config=cfg, ctx=ctx)           # doctest: +SKIP
    """
    config = config_from_hf(read_hf_config(directory), where=os.path.join(directory, "config.json"), **overrides)
    if expect is not None:
        _check_shape(config, expect, directory)
    source = SafetensorsDir(directory)
    with torch.device("meta"):
        model = Llama(config)
    _check_tensors(model, source, directory)
    rows = {name: p.size(0) for name, p in model.named_parameters()}

    def read(name: str, start: int, end: int) -> torch.Tensor:
        return source.read_range(hf_name(name, config), start, end, rows=rows[name])

    model.weight_source = read
    if torch.device(device).type != "meta":
        _materialize(model, torch.device(device), dtype)
    return model


def _check_shape(config: Any, expect: str, directory: str) -> None:
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size")
    want = SIZES[expect]
    diff = {k: getattr(config, k) for k in keys if k in want and getattr(config, k) != want[k]}
    if diff:
        raise ValueError(f"{expect}(pretrained={directory!r}): the checkpoint has {diff}, which is not {expect}; "
                         f"use the matching factory or model = dict(type='hf', path=...)")


def _check_tensors(model: nn.Module, source: SafetensorsDir, directory: str) -> None:
    """Every parameter has its tensor in the files, of its shape (bar the padded vocabulary rows)."""
    config = model.config
    for name, p in model.named_parameters():
        stored = hf_name(name, config)
        if stored not in source:
            raise ValueError(f"{directory}: no tensor {stored!r} in the safetensors files, which the config.json's "
                             f"{config.architecture} needs; the checkpoint is incomplete or of another model")
        shape, want = source.shape(stored), tuple(p.shape)
        vocab_rows = name in ("model.embed_tokens.weight", "lm_head.weight")
        if shape != want and not (vocab_rows and shape == (config.vocab_size, *want[1:])):
            raise ValueError(f"{directory}: tensor {stored!r} has shape {list(shape)} but config.json makes it "
                             f"{list(want)}; config.json and the weights disagree")


@torch.no_grad()
def _materialize(model: Llama, device: torch.device, dtype: torch.dtype) -> None:
    """Give a meta-built model real parameters on `device`, one tensor read at a time (the tied head re-tied)."""
    tied = model.config.tie_word_embeddings
    for module_name, module in model.named_modules():
        for pname, p in list(module._parameters.items()):
            name = f"{module_name}.{pname}" if module_name else pname
            if p is None or (tied and name == "lm_head.weight"):
                continue
            values = model.init_param_range(name, 0, p.numel()).view(p.shape)
            module._parameters[pname] = nn.Parameter(values.to(device=device, dtype=dtype), p.requires_grad)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = model.inv_freq.to(device)
