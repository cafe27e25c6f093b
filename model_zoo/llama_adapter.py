"""The Llama family's Hugging Face mapping: config.json <-> LlamaConfig, and tensors by name both ways.

One adapter for the family (torchtitan's StateDictAdapter is the model): LlamaForCausalLM, Qwen2ForCausalLM,
Qwen3ForCausalLM and MistralForCausalLM differ only in options, which `config_from_hf` reads from config.json and
`hf_config` writes back. The native modules carry Hugging Face's names and rotate-half RoPE, so a tensor maps to
itself: no q/k permutation, no renames; only the padded vocabulary rows are added on the way in and dropped on the
way out, and a tied head is the embedding. config.json is read as JSON (transformers 4's rope_theta/rope_scaling
and transformers 5's rope_parameters alike), so loading needs no transformers import.
"""
from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

import torch

from model_zoo.llama import ARCHITECTURES, LlamaConfig, as_llama_config

__all__ = ["config_from_hf", "hf_config", "to_hf_tensor", "hf_name", "VOCAB_ROWS"]

VOCAB_ROWS = ("model.embed_tokens.weight", "lm_head.weight")  # (padded_vocab_size, hidden): pad rows not in HF

_SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
               "tie_word_embeddings", "initializer_range", "attention_dropout")
_KEPT = ("bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype", "dtype")


def _rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling or None) from either transformers 4's keys or transformers 5's rope_parameters."""
    params = dict(hf.get("rope_parameters") or {})
    theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = dict(hf.get("rope_scaling") or params)
    if "type" in scaling and "rope_type" not in scaling:  # the older spelling
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor={scaling['partial_rotary_factor']} (RoPE on part of each head) is "
                         f"not supported by model_zoo's Llama family")
    scaling.pop("partial_rotary_factor", None)
    if scaling.get("rope_type", "default") == "default":
        return float(theta), None
    return float(theta), scaling


def config_from_hf(hf: dict[str, Any], where: str = "config.json", **overrides: Any) -> LlamaConfig:
    """The LlamaConfig of a Hugging Face config.json dict; ValueError naming the key for what the family cannot
    reproduce (other architectures, biases Llama checkpoints do not have, sliding windows in use, yarn RoPE).

    Args:
        where: the file it came from, for error messages.
        overrides: LlamaConfig fields that do not change the weights (checkpoint, chunked_loss, ...).
    """
    arch = (hf.get("architectures") or [None])[0]
    if arch not in ARCHITECTURES:
        raise ValueError(f"{where}: architectures={hf.get('architectures')!r} is not a Llama-family model "
                         f"({', '.join(ARCHITECTURES)}); other causal LMs train through the generic "
                         f"transformers path, model = dict(type='hf', path=DIR, generic=True)")
    bad = {k: hf[k] for k in ("mlp_bias",) if hf.get(k)}
    if hf.get("hidden_act", "silu") != "silu":
        bad["hidden_act"] = hf["hidden_act"]
    if hf.get("attention_bias") and arch != "Qwen2ForCausalLM":  # Llama's and Qwen3's would add an o_proj bias too
        bad["attention_bias"] = True
    if hf.get("use_sliding_window") and arch == "Qwen2ForCausalLM":
        bad["use_sliding_window"] = True
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        bad["partial_rotary_factor"] = hf["partial_rotary_factor"]
    if bad:
        raise ValueError(f"{where}: {bad} is not supported by model_zoo's Llama family; use the generic "
                         f"transformers path, model = dict(type='hf', path=DIR, generic=True)")
    theta, scaling = _rope(hf)
    shape = {k: hf[k] for k in _SHAPE_KEYS if hf.get(k) is not None}
    config = LlamaConfig(**shape, rope_theta=theta, rope_scaling=scaling, architecture=arch,
                         qkv_bias=arch == "Qwen2ForCausalLM", qk_norm=arch == "Qwen3ForCausalLM",
                         sliding_window=hf.get("sliding_window") if arch == "MistralForCausalLM" else None,
                         extra={k: hf[k] for k in _KEPT if hf.get(k) is not None})
    names = {f.name for f in fields(LlamaConfig)}
    unknown = set(overrides) - names
    if unknown:
        raise TypeError(f"unknown LlamaConfig field(s) {sorted(unknown)}; valid: {', '.join(sorted(names))}")
    return replace(config, **overrides)


def hf_config(config: LlamaConfig | dict[str, Any]) -> Any:
    """The transformers config (LlamaConfig, Qwen2Config, Qwen3Config or MistralConfig) that rebuilds the model."""
    import transformers

    c = as_llama_config(config)
    cls = getattr(transformers, c.architecture.replace("ForCausalLM", "Config"))
    kwargs = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                  num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                  num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
                  max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
                  tie_word_embeddings=c.tie_word_embeddings, initializer_range=c.initializer_range,
                  attention_dropout=c.attention_dropout, hidden_act="silu",
                  bos_token_id=c.extra.get("bos_token_id"), eos_token_id=c.extra.get("eos_token_id"),
                  pad_token_id=c.extra.get("pad_token_id"))
    rope = dict(c.rope_scaling or {"rope_type": "default"})
    if int(transformers.__version__.split(".")[0]) >= 5:
        kwargs["rope_parameters"] = {**rope, "rope_theta": c.rope_theta}
    else:
        kwargs.update(rope_theta=c.rope_theta, rope_scaling=c.rope_scaling)
    if c.architecture == "LlamaForCausalLM":
        kwargs.update(attention_bias=False, mlp_bias=False)
    if c.architecture == "MistralForCausalLM":
        kwargs["sliding_window"] = c.sliding_window
    if c.architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        kwargs.update(use_sliding_window=False, sliding_window=None)
    if c.architecture == "Qwen3ForCausalLM":
        kwargs["attention_bias"] = False
    hc = cls(**kwargs)
    hc.architectures = [c.architecture]
    return hc


def hf_name(name: str, config: LlamaConfig | dict[str, Any]) -> str:
    """The tensor of a Hugging Face checkpoint that holds our parameter `name` (a tied head reads the embedding)."""
    if name == "lm_head.weight" and as_llama_config(config).tie_word_embeddings:
        return "model.embed_tokens.weight"
    return name


def to_hf_tensor(name: str, tensor: torch.Tensor, config: LlamaConfig | dict[str, Any]) -> tuple[str, torch.Tensor]:
    """One of our tensors as Hugging Face stores it: the same name, the padded vocabulary rows dropped."""
    if name in VOCAB_ROWS:
        tensor = tensor[: as_llama_config(config).vocab_size]
    return name, tensor.contiguous()
