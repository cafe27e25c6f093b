"""Tiny random Hugging Face checkpoints of each Llama-family architecture, built by transformers from a config and
saved to a directory: the fixtures every native-family test loads (nothing is downloaded)."""
from __future__ import annotations

import copy
from pathlib import Path

import torch

VOCAB = 250  # not a multiple of 64: the native model pads its rows, and the mapping must drop them again
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6)
FAMILIES = {
    # Llama-3 style: GQA, llama3 RoPE scaling, untied
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(_COMMON, rope_theta=500000.0, tie_word_embeddings=False,
                   rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position_embeddings=32))),
    # Qwen2.5: qkv bias, tied
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(_COMMON, rope_theta=1000000.0, tie_word_embeddings=True)),
    # Qwen3: qk-norm, explicit head_dim that is not hidden / heads
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(_COMMON, head_dim=32, rope_theta=1000000.0, tie_word_embeddings=False)),
    # Mistral: multi-query (1 kv head), sliding window longer than the tests' sequences
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(_COMMON, num_key_value_heads=1, rope_theta=10000.0, sliding_window=128,
                     tie_word_embeddings=False)),
}


def make_hf_model(family: str, path: Path, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """Save a random tiny `family` model (FAMILIES) to `path` with save_pretrained; returns the model (eval mode).

    Norm weights and biases are randomised too, so a mapping that drops or swaps them changes the logits."""
    import transformers

    config_cls, model_cls, kwargs = FAMILIES[family]
    # a copy: transformers 5 writes rope_theta (and a partial_rotary_factor override) into the rope_scaling dict
    config = getattr(transformers, config_cls)(**copy.deepcopy({**kwargs, **overrides}))
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.1 * torch.randn_like(p))
    model = model.to(dtype).eval()
    model.save_pretrained(path)
    return model
