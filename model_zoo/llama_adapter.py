"""The Llama family's checkpoint mappings: Hugging Face's (config.json <-> LlamaConfig, tensors by name both ways)
and, beside it, Megatron-LM's (args <-> LlamaConfig, tensors to and from Megatron-Core's names at TP=1).

One adapter for the family (torchtitan's StateDictAdapter is the model): LlamaForCausalLM, Qwen2ForCausalLM,
Qwen3ForCausalLM and MistralForCausalLM differ only in options, which `config_from_hf` reads from config.json and
`hf_config` writes back. The native modules carry Hugging Face's names and rotate-half RoPE, so a tensor maps to
itself: no q/k permutation, no renames; only the padded vocabulary rows are added on the way in and dropped on the
way out, and a tied head is the embedding. config.json is read as JSON (transformers 4's rope_theta/rope_scaling
and transformers 5's rope_parameters alike), so loading needs no transformers import. Megatron fuses q/k/v into
linear_qkv per query group and gate/up into linear_fc1; its RoPE is rotate-half too (rotary_interleaved=False), so
no permutation either. Files, legacy names and TP/PP splits are zerogpt_tools/megatron_layout.py's.
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import torch

__all__ = ["ARCHITECTURES", "MODEL_TYPES", "GENERIC_PATH", "native_architecture", "config_from_hf", "hf_config",
           "to_hf_tensor", "hf_name", "VOCAB_ROWS", "config_from_megatron", "megatron_args", "to_megatron",
           "from_megatron"]

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")
"""The Hugging Face classes the family reproduces (LlamaConfig.architecture names the one it exports as)."""
ROPE_TYPES = ("default", "linear", "llama3")
"""The rope_scaling types the family computes (yarn, dynamic and longrope are not implemented)."""

MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
               "mistral": "MistralForCausalLM"}
"""config.json's model_type -> the class: what its fields are (transformers' AutoModelForCausalLM goes by it)."""

GENERIC_PATH = ("transformers' generic path, model = dict(type='hf', path=DIR) (AutoModelForCausalLM; the whole "
                "model on every rank while loading)")


def native_architecture(hf: dict[str, Any]) -> tuple[str | None, str | None]:
    """(the native class a config.json loads as, or None; a note when its `architectures` label contradicts
    its fields).

    The label (`architectures[0]`) chooses; `model_type` names what the fields are, and transformers'
    AutoModelForCausalLM builds by it. When the two disagree and model_type is one of the four, the fields win:
    the model loads natively as model_type's class, with a note (a hand-edited label, FalconForCausalLM over
    Llama's keys, is still a Llama). When model_type is not one of the four, the model is not native whatever
    its label says.
    """
    label = (hf.get("architectures") or [None])[0]
    model_type = hf.get("model_type")
    if model_type is None:
        return (label, None) if label in ARCHITECTURES else (None, None)
    arch = MODEL_TYPES.get(model_type)
    if arch is None or label in (None, arch):
        return arch, None
    return arch, (f"config.json's architectures says {label} but its model_type {model_type!r} and fields are "
                  f"{arch}'s; loaded natively as {arch}, the class transformers' AutoModelForCausalLM builds for it")

VOCAB_ROWS = ("model.embed_tokens.weight", "lm_head.weight")  # (padded_vocab_size, hidden): pad rows not in HF


class _LlamaFields(SimpleNamespace):
    """A LlamaConfig's fields with its derived padded vocabulary, as LlamaConfig derives it."""

    @property
    def padded_vocab_size(self) -> int:
        return -(-self.vocab_size // self.pad_vocab_multiple) * self.pad_vocab_multiple


def as_llama_config(config: Any) -> _LlamaFields:
    """A LlamaConfig, or its `dataclasses.asdict` form (what checkpoints record), as its fields. The rules take
    configs as fields and give back LlamaConfig keyword arguments, so this module does not import the model:
    model_zoo/llama.py imports it."""
    return _LlamaFields(**(config if isinstance(config, dict) else dataclasses.asdict(config)))

_SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
               "tie_word_embeddings", "initializer_range", "attention_dropout")
_MISTRAL_WINDOW = 4096  # MistralConfig's sliding_window where config.json omits the key (transformers 4 and 5)
_KEPT = ("bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype", "dtype")


def _rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling or None) from either transformers 4's keys or transformers 5's rope_parameters."""
    params = dict(hf.get("rope_parameters") or {})
    theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = dict(hf.get("rope_scaling") or params)
    if "type" in scaling and "rope_type" not in scaling:  # the older spelling
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default" and scaling.get("partial_rotary_factor", 1.0) == 1.0:
        return float(theta), None
    return float(theta), scaling


def _qwen_slides(hf: dict[str, Any]) -> bool:
    """Whether a Qwen2/Qwen3 config.json has a layer that attends through a window (ours attend in full):
    its layer_types, else transformers' rule, use_sliding_window from max_window_layers (default 28) on."""
    if hf.get("layer_types"):
        return "sliding_attention" in hf["layer_types"]
    window = hf.get("use_sliding_window") and ("sliding_window" not in hf or hf["sliding_window"] is not None)
    return bool(window) and hf.get("max_window_layers", 28) < hf.get("num_hidden_layers", 0)


def config_from_hf(hf: dict[str, Any], where: str = "config.json") -> dict[str, Any]:
    """LlamaConfig's keyword arguments for a Hugging Face config.json dict; ValueError naming the key for what the
    family cannot reproduce (other architectures, biases Llama checkpoints do not have, sliding windows, yarn RoPE).

    Args:
        where: the file it came from, for error messages.
    """
    arch, _ = native_architecture(hf)
    if arch is None:
        raise ValueError(f"{where}: architectures={hf.get('architectures')!r} (model_type "
                         f"{hf.get('model_type')!r}) is not one of the four native architectures "
                         f"({', '.join(ARCHITECTURES)}); other causal LMs train through {GENERIC_PATH}")
    bad = {k: hf[k] for k in ("mlp_bias",) if hf.get(k)}
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):  # transformers' "swish" is SiLU too
        bad["hidden_act"] = hf["hidden_act"]
    if hf.get("attention_bias") and arch != "Qwen2ForCausalLM":  # Llama's and Qwen3's would add an o_proj bias too
        bad["attention_bias"] = True
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and _qwen_slides(hf):
        bad["use_sliding_window"] = True
    theta, scaling = _rope(hf)
    partial = {hf.get("partial_rotary_factor", 1.0), (scaling or {}).pop("partial_rotary_factor", 1.0)} - {1.0}
    if partial:  # RoPE on part of each head
        bad["partial_rotary_factor"] = partial.pop()
    if (scaling or {}).get("rope_type", "default") not in ROPE_TYPES:
        bad["rope_type"] = scaling["rope_type"]
    if bad:
        raise ValueError(f"{where}: {bad} is not supported by model_zoo's Llama family; use the generic "
                         f"transformers path, model = dict(type='hf', path=DIR, generic=True)")
    shape = {k: hf[k] for k in _SHAPE_KEYS if hf.get(k) is not None}
    return dict(**shape, rope_theta=theta, rope_scaling=scaling, architecture=arch,
                qkv_bias=arch == "Qwen2ForCausalLM", qk_norm=arch == "Qwen3ForCausalLM",
                sliding_window=hf.get("sliding_window", _MISTRAL_WINDOW) if arch == "MistralForCausalLM" else None,
                extra={k: hf[k] for k in _KEPT if hf.get(k) is not None})


def hf_config(config: Any) -> Any:
    """The transformers config (LlamaConfig, Qwen2Config, Qwen3Config or MistralConfig) that rebuilds the model."""
    import transformers

    c = as_llama_config(config)
    expressed = _HF_ATTENTION[c.architecture]
    if (c.qkv_bias, c.qk_norm) != expressed:
        raise ValueError(f"{c.architecture} in Hugging Face has {_attention_words(*expressed)}; this model has "
                         f"{_attention_words(c.qkv_bias, c.qk_norm)} (a Megatron checkpoint with both "
                         f"--add-qkv-bias and --qk-layernorm, say), which no Hugging Face architecture of the "
                         f"family holds: its zerogpt checkpoints and a Megatron-LM export keep them")
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


_HF_ATTENTION = {"LlamaForCausalLM": (False, False), "MistralForCausalLM": (False, False),
                 "Qwen2ForCausalLM": (True, False), "Qwen3ForCausalLM": (False, True)}
"""(q/k/v biases, q/k norms) each architecture's transformers class builds (attention_bias elsewhere biases o_proj)."""


def _attention_words(qkv_bias: bool, qk_norm: bool) -> str:
    return " and ".join(part for part, on in (("q/k/v biases", qkv_bias), ("q/k norms", qk_norm)) if on) \
        or "neither q/k/v biases nor q/k norms"


def hf_name(name: str, config: Any) -> str:
    """The tensor of a Hugging Face checkpoint that holds our parameter `name` (a tied head reads the embedding)."""
    if name == "lm_head.weight" and as_llama_config(config).tie_word_embeddings:
        return "model.embed_tokens.weight"
    return name


def to_hf_tensor(name: str, tensor: torch.Tensor, config: Any) -> tuple[str, torch.Tensor]:
    """One of our tensors as Hugging Face stores it: the same name, the padded vocabulary rows dropped."""
    if name in VOCAB_ROWS:
        tensor = tensor[: as_llama_config(config).vocab_size]
    return name, tensor.contiguous()


# ----------------------------------------------------------------------------------------------------------
# Megatron-LM: the four hooks zerogpt_tools/megatron_layout.py calls for this family. Megatron-Core's names at
# TP=1, PP=1 (global layer indices, vocabulary rows as they are): linear_qkv holds each query group's
# [q_1 .. q_{nq/ng}; k_g; v_g] one group after another, linear_fc1 is [gate; up] (Megatron-Bridge's
# merge_qkv_weights and GatedMLPMapping describe the same).

_MEGATRON_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
_LLAMA3_FIXED = dict(low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
"""Megatron-Core's llama3 RoPE scaling (RotaryEmbedding._apply_scaling) takes only the factor; the rest is fixed."""


def _arg(args: dict[str, Any], key: str, default: Any = None) -> Any:
    value = args.get(key)
    return default if value is None else value


def config_from_megatron(args: dict[str, Any], vocab_size: int, pad_vocab_multiple: int) -> dict[str, Any]:
    """LlamaConfig's keyword arguments for a Megatron Llama-family model's `args` (a dict of its Namespace);
    ValueError naming the argument for what the family cannot reproduce.

    Args:
        vocab_size: the real vocabulary (the tokenizer's), <= args.padded_vocab_size.
        pad_vocab_multiple: chosen so the embedding has args.padded_vocab_size rows, as Megatron's has.
    """
    def refuse(key: str, why: str) -> ValueError:
        return ValueError(f"Megatron args {key}={args.get(key)!r}: {why}; model_zoo's Llama family cannot reproduce it")

    rope = _arg(args, "position_embedding_type", "learned_absolute") == "rope" or \
        _arg(args, "use_rotary_position_embeddings", False)
    if not rope:
        raise refuse("position_embedding_type", "the Llama family uses RoPE")
    if not _arg(args, "swiglu", False):
        raise refuse("swiglu", "the Llama family's MLP is SwiGLU")
    if _arg(args, "normalization", "LayerNorm") != "RMSNorm":
        raise refuse("normalization", "the Llama family uses RMSNorm")
    if _arg(args, "add_bias_linear", True):
        raise refuse("add_bias_linear", "the Llama family's linear layers have no bias (--disable-bias-linear)")
    if _arg(args, "rotary_percent", 1.0) != 1.0:
        raise refuse("rotary_percent", "RoPE covers every head dimension here")
    if _arg(args, "rotary_interleaved", False):
        raise refuse("rotary_interleaved", "RoPE here is rotate-half (Megatron's default)")
    if _arg(args, "apply_residual_connection_post_layernorm", False):
        raise refuse("apply_residual_connection_post_layernorm", "the family is pre-norm")
    heads = args["num_attention_heads"]
    qkv_bias, qk_norm = bool(_arg(args, "add_qkv_bias", False)), bool(_arg(args, "qk_layernorm", False))
    scaling = None
    if _arg(args, "use_rope_scaling", False):
        scaling = dict(rope_type="llama3", factor=float(_arg(args, "rope_scaling_factor", 8.0)), **_LLAMA3_FIXED)
    elif _arg(args, "rotary_seq_len_interpolation_factor", None):  # positions / f: HF's linear scaling
        scaling = dict(rope_type="linear", factor=float(args["rotary_seq_len_interpolation_factor"]))
    dtype = next((name for flag, name in _MEGATRON_DTYPES.items() if _arg(args, flag, False)), "float32")
    return dict(
        vocab_size=vocab_size, hidden_size=args["hidden_size"], intermediate_size=args["ffn_hidden_size"],
        num_hidden_layers=args["num_layers"], num_attention_heads=heads,
        num_key_value_heads=args["num_query_groups"] if _arg(args, "group_query_attention", False) else heads,
        head_dim=_arg(args, "kv_channels", args["hidden_size"] // heads),
        max_position_embeddings=_arg(args, "max_position_embeddings", args.get("seq_length")),
        rms_norm_eps=_arg(args, "norm_epsilon", args.get("layernorm_epsilon") or 1e-5),
        rope_theta=float(_arg(args, "rotary_base", 10000)), rope_scaling=scaling, qkv_bias=qkv_bias,
        qk_norm=qk_norm, tie_word_embeddings=not _arg(args, "untie_embeddings_and_output_weights", False),
        attention_dropout=_arg(args, "attention_dropout", 0.0), pad_vocab_multiple=pad_vocab_multiple,
        architecture="Qwen3ForCausalLM" if qk_norm else "Qwen2ForCausalLM" if qkv_bias else "LlamaForCausalLM",
        extra={"torch_dtype": dtype})


def megatron_args(config: Any) -> dict[str, Any]:
    """The Megatron arguments that give a LlamaConfig's shape (the layout module adds vocab, TP/PP and the rest);
    ValueError for what Megatron-Core cannot express (a sliding window, llama3 RoPE scaling other than Llama 3's)."""
    c = as_llama_config(config)
    if c.sliding_window is not None:
        raise ValueError(f"sliding_window={c.sliding_window}: a Megatron export of a sliding-window model is not "
                         f"supported")
    scaling = dict(use_rope_scaling=False, rope_scaling_factor=8.0, rotary_seq_len_interpolation_factor=None)
    rope = c.rope_scaling or {}
    if rope.get("rope_type") == "llama3":
        fixed = {k: rope.get(k) for k in _LLAMA3_FIXED}
        if fixed != _LLAMA3_FIXED:
            raise ValueError(f"rope_scaling {fixed}: Megatron-Core's llama3 scaling fixes these to {_LLAMA3_FIXED} "
                             f"and takes only --rope-scaling-factor; this model cannot be written for it")
        scaling.update(use_rope_scaling=True, rope_scaling_factor=rope["factor"])
    elif rope.get("rope_type") == "linear":
        scaling["rotary_seq_len_interpolation_factor"] = rope["factor"]
    return dict(num_layers=c.num_hidden_layers, hidden_size=c.hidden_size, ffn_hidden_size=c.intermediate_size,
                num_attention_heads=c.num_attention_heads, kv_channels=c.head_dim,
                group_query_attention=c.num_key_value_heads != c.num_attention_heads,
                num_query_groups=c.num_key_value_heads, max_position_embeddings=c.max_position_embeddings,
                position_embedding_type="rope", add_position_embedding=False, rotary_base=c.rope_theta,
                rotary_percent=1.0, rotary_interleaved=False, normalization="RMSNorm", norm_epsilon=c.rms_norm_eps,
                swiglu=True, add_bias_linear=False, add_qkv_bias=c.qkv_bias, qk_layernorm=c.qk_norm,
                untie_embeddings_and_output_weights=not c.tie_word_embeddings, attention_dropout=c.attention_dropout,
                hidden_dropout=0.0, **scaling)


def _megatron_layer(c: _LlamaFields, i: int) -> list[tuple[tuple[str, ...], str]]:
    """((our names...), Megatron-Core name) of layer i: several of ours fuse into one of Megatron's."""
    ours, theirs = f"model.layers.{i}.", f"decoder.layers.{i}."
    attn = [(tuple(f"{ours}self_attn.{p}_proj.weight" for p in "qkv"), "self_attention.linear_qkv.weight")]
    if c.qkv_bias:
        attn.append((tuple(f"{ours}self_attn.{p}_proj.bias" for p in "qkv"), "self_attention.linear_qkv.bias"))
    if c.qk_norm:
        attn += [((f"{ours}self_attn.q_norm.weight",), "self_attention.q_layernorm.weight"),
                 ((f"{ours}self_attn.k_norm.weight",), "self_attention.k_layernorm.weight")]
    pairs = [((f"{ours}input_layernorm.weight",), "input_layernorm.weight"), *attn,
             ((f"{ours}self_attn.o_proj.weight",), "self_attention.linear_proj.weight"),
             ((f"{ours}post_attention_layernorm.weight",), "pre_mlp_layernorm.weight"),
             ((f"{ours}mlp.gate_proj.weight", f"{ours}mlp.up_proj.weight"), "mlp.linear_fc1.weight"),
             ((f"{ours}mlp.down_proj.weight",), "mlp.linear_fc2.weight")]
    return [(names, theirs + name) for names, name in pairs]


def _megatron_pairs(config: _LlamaFields) -> list[tuple[tuple[str, ...], str]]:
    """((our names...), Megatron-Core name) for every weight, in model order; a tied head is the embedding."""
    pairs = [(("model.embed_tokens.weight",), "embedding.word_embeddings.weight")]
    for i in range(config.num_hidden_layers):
        pairs += _megatron_layer(config, i)
    pairs.append((("model.norm.weight",), "decoder.final_layernorm.weight"))
    if not config.tie_word_embeddings:
        pairs.append((("lm_head.weight",), "output_layer.weight"))
    return pairs


def to_megatron(read: Callable[[str], torch.Tensor],
                config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(Megatron-Core name, tensor) of every weight at TP=1, from `read(our name)`; one fused tensor at a time."""
    c = as_llama_config(config)
    groups = c.num_key_value_heads
    for ours, theirs in _megatron_pairs(c):
        parts = [read(name) for name in ours]
        if len(parts) == 3:  # q (nq*hd, ...), k and v (ng*hd, ...) -> per group [q_g; k_g; v_g]
            parts = [t.reshape(groups, -1, *t.shape[1:]) for t in parts]
            yield theirs, torch.cat(parts, dim=1).reshape(-1, *parts[0].shape[2:])
        else:
            yield theirs, parts[0] if len(parts) == 1 else torch.cat(parts)  # fc1: [gate; up]


def from_megatron(read: Callable[[str], torch.Tensor],
                  config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(our name, tensor) of every parameter from `read(Megatron-Core name)` at TP=1: to_megatron's inverse."""
    c = as_llama_config(config)
    groups, per_group = c.num_key_value_heads, c.num_attention_heads // c.num_key_value_heads
    for ours, theirs in _megatron_pairs(c):
        tensor = read(theirs)
        if len(ours) == 3:
            grouped = tensor.reshape(groups, (per_group + 2) * c.head_dim, *tensor.shape[1:])
            parts = grouped.split([per_group * c.head_dim, c.head_dim, c.head_dim], dim=1)
            yield from ((name, part.reshape(-1, *tensor.shape[1:])) for name, part in zip(ours, parts))
        elif len(ours) == 2:
            yield from zip(ours, tensor.chunk(2))
        else:
            yield ours[0], tensor
