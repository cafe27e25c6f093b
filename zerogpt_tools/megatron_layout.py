"""Megatron-LM's checkpoint layouts as tensor names and splits: the plan, no files (megatron_files.py reads/writes).

One naming sits in the middle: Megatron-Core's parameter names at TP=1, PP=1 with global layer indices
("decoder.layers.3.self_attention.linear_qkv.weight", the norms as the local spec names them: input_layernorm,
pre_mlp_layernorm). A family's adapter maps its model to and from these names (model_zoo/hf.py for GPT-2,
model_zoo/llama_adapter.py for the Llama family); this module maps them to what a rank's file holds: the legacy
layout's (model.language_model.{embedding,encoder}, fused query_key_value whose order depends on
checkpoint_version) or Megatron-Core's (Transformer Engine fuses the norms into linear_qkv / linear_fc1), one TP
shard of it (column-parallel on dim 0, row-parallel on dim 1, vocabulary rows on dim 0, [gate_r; up_r] on each
rank, the rest replicated), with the layers of one pipeline stage renumbered from 0.
Sources: Megatron-LM megatron/training/checkpointing.py (file names, fix_query_key_value_ordering), megatron/legacy/
model (at 39ec5eb^, before its removal), megatron/core/transformer (mlp.py apply_swiglu_sharded_factory,
transformer_block.py sharded_state_dict); Megatron-Bridge param_mapping.py; /work/shared/research/model_families.md §2.
"""
from __future__ import annotations

import re

import torch

__all__ = ["CHECKPOINT_VERSIONS", "LEGACY", "CORE", "tp_kind", "tp_split", "tp_merge", "check_version",
           "qkv_from_version", "qkv_to_version", "stage_layers", "to_canonical", "from_canonical", "stage_of",
           "tied_head_key", "TE_EXTRA_STATE", "MegatronLayoutError", "FAMILIES", "family_of_args", "family_of_class"]

CHECKPOINT_VERSIONS = (0.0, 1.0, 2.0, 3.0)
"""The legacy `checkpoint_version`s: 0 stored each rank's qkv as [3, np, hn], 1 as [np, hn, 3], 2 and 3 as
[np, 3, hn] (Megatron-Core's order; 3 only renamed args). A checkpoint without the key is version 0."""
LEGACY, CORE = "legacy", "core"

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
CANONICAL_LAYER = ("input_layernorm.weight", "input_layernorm.bias", "self_attention.linear_qkv.weight",
                   "self_attention.linear_qkv.bias", "self_attention.q_layernorm.weight",
                   "self_attention.k_layernorm.weight", "self_attention.linear_proj.weight",
                   "self_attention.linear_proj.bias", "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias",
                   "mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.linear_fc2.weight", "mlp.linear_fc2.bias")
FIRST_STAGE = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")
LAST_STAGE = ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight")

# Layer suffixes: canonical -> legacy (ParallelTransformerLayer) and -> Megatron-Core with Transformer Engine.
_TO_LEGACY = {"input_layernorm": "input_layernorm", "self_attention.linear_qkv": "self_attention.query_key_value",
              "self_attention.linear_proj": "self_attention.dense", "pre_mlp_layernorm": "post_attention_layernorm",
              "mlp.linear_fc1": "mlp.dense_h_to_4h", "mlp.linear_fc2": "mlp.dense_4h_to_h"}
_TO_TE = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
          "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
          "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
          "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias"}
# Spellings other Megatron-LM versions wrote, read as the ones above: v1.x's 'attention', late legacy's *_norm,
# and legacy with Transformer Engine's TransformerLayer (the "new format" transformers' GPT-2 converter reads).
_LEGACY_ALIASES = [(".attention.", ".self_attention."), ("input_norm.", "input_layernorm."),
                   ("post_attention_norm.", "post_attention_layernorm."),
                   ("self_attention.layernorm_qkv.layer_norm_", "input_layernorm."),
                   ("self_attention.layernorm_qkv.", "self_attention.query_key_value."),
                   ("self_attention.proj.", "self_attention.dense."),
                   ("layernorm_mlp.layer_norm_", "post_attention_layernorm."),
                   ("layernorm_mlp.fc1_", "mlp.dense_h_to_4h."), ("layernorm_mlp.fc2_", "mlp.dense_4h_to_h.")]
_LEGACY_GLOBAL = {"embedding.word_embeddings.weight": "language_model.embedding.word_embeddings.weight",
                  "embedding.position_embeddings.weight": "language_model.embedding.position_embeddings.weight",
                  "decoder.final_layernorm.weight": "language_model.encoder.final_layernorm.weight",
                  "decoder.final_layernorm.bias": "language_model.encoder.final_layernorm.bias",
                  "output_layer.weight": "language_model.output_layer.weight"}
TE_EXTRA_STATE = ("self_attention.core_attention._extra_state", "self_attention.linear_qkv._extra_state",
                  "self_attention.linear_proj._extra_state", "mlp.linear_fc1._extra_state",
                  "mlp.linear_fc2._extra_state")
"""Transformer Engine modules' `_extra_state` (FP8 metadata) in a Megatron-Core layer: written as None (no FP8
state) so a strict load finds every key; skipped when read."""


class MegatronLayoutError(ValueError):
    """A Megatron checkpoint that does not fit the layout it claims (one line: the file, the key, the fix)."""


# ------------------------------------------------------------------------------------------------
# tensor parallelism


def tp_kind(name: str, gated: bool) -> str:
    """How canonical tensor `name` is split over tensor-parallel ranks: "vocab" and "column" (dim 0), "gated"
    ([gate_r; up_r] per rank), "row" (dim 1) or "replicated". linear_qkv is plain column-parallel because its
    rows go query group by query group, and each rank holds num_query_groups / TP whole groups."""
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return "vocab"
    if name.endswith(("linear_fc1.weight", "linear_fc1.bias")):
        return "gated" if gated else "column"
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias")):
        return "column"
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return "row"
    return "replicated"


def tp_split(name: str, tensor: torch.Tensor, tp: int, gated: bool) -> list[torch.Tensor]:
    """The `tp` ranks' shards of canonical tensor `name` (contiguous; the replicated one repeated)."""
    kind = tp_kind(name, gated)
    if kind == "replicated" or tp == 1:
        return [tensor.contiguous()] * tp
    dim = 1 if kind == "row" else 0
    rows = tensor.size(dim) // (2 if kind == "gated" else 1)
    if rows % tp:
        raise MegatronLayoutError(f"{name} {list(tensor.shape)}: dim {dim} ({rows}"
                                  f"{' per half' if kind == 'gated' else ''}) does not split over --tp {tp}")
    if kind == "gated":  # [gate; up] -> rank r holds [gate_r; up_r], never a chunk of the fused tensor
        halves = tensor.reshape(2, rows, *tensor.shape[1:])
        return [part.reshape(-1, *tensor.shape[1:]).contiguous() for part in halves.chunk(tp, dim=1)]
    return [part.contiguous() for part in tensor.chunk(tp, dim=dim)]


def tp_merge(name: str, shards: list[torch.Tensor], gated: bool) -> torch.Tensor:
    """Canonical tensor `name` from its TP shards in rank order: tp_split's inverse (a replicated one: rank 0's)."""
    kind = tp_kind(name, gated)
    if kind == "replicated" or len(shards) == 1:
        return shards[0]
    if kind == "gated":
        halves = [s.reshape(2, -1, *s.shape[1:]) for s in shards]
        return torch.cat(halves, dim=1).reshape(-1, *shards[0].shape[1:])
    return torch.cat(shards, dim=1 if kind == "row" else 0)


# ------------------------------------------------------------------------------------------------
# legacy qkv orders (Megatron's fix_query_key_value_ordering), on one rank's tensor


def check_version(version: float, where: str) -> float:
    """`version` as a float; MegatronLayoutError in one line if it is not one of CHECKPOINT_VERSIONS."""
    if float(version) not in CHECKPOINT_VERSIONS:
        raise MegatronLayoutError(f"{where}: checkpoint_version {version!r} is unknown; this reader knows "
                                  f"{', '.join(map(str, CHECKPOINT_VERSIONS))} (Megatron-LM writes 3.0)")
    return float(version)


def qkv_from_version(tensor: torch.Tensor, version: float, heads: int, where: str) -> torch.Tensor:
    """One rank's fused query_key_value (weight or bias) of `heads` local heads, stored at `version`, in the
    order of versions >= 2: [np, 3, hn] (per head q, k, v)."""
    version = check_version(version, where)
    rest = tensor.shape[1:]
    if version == 0.0:    # [3, np, hn]
        return tensor.reshape(3, heads, -1, *rest).transpose(0, 1).reshape(tensor.shape)
    if version == 1.0:    # [np, hn, 3]
        return tensor.reshape(heads, -1, 3, *rest).transpose(1, 2).reshape(tensor.shape)
    return tensor


def qkv_to_version(tensor: torch.Tensor, version: float, heads: int, where: str) -> torch.Tensor:
    """qkv_from_version's inverse: [np, 3, hn] written in the order of `version`."""
    version = check_version(version, where)
    rest = tensor.shape[1:]
    if version == 0.0:
        return tensor.reshape(heads, 3, -1, *rest).transpose(0, 1).contiguous().reshape(tensor.shape)
    if version == 1.0:
        return tensor.reshape(heads, 3, -1, *rest).transpose(1, 2).contiguous().reshape(tensor.shape)
    return tensor


# ------------------------------------------------------------------------------------------------
# pipeline stages and names


def stage_layers(num_layers: int, pp: int) -> list[range]:
    """The global layers of each of `pp` stages: Megatron's even split (each stage num_layers / pp layers)."""
    if num_layers % pp:
        raise MegatronLayoutError(f"num_layers={num_layers} does not split evenly over --pp {pp} pipeline stages; "
                                  f"choose a --pp that divides it")
    per = num_layers // pp
    return [range(s * per, (s + 1) * per) for s in range(pp)]


def stage_of(name: str, stages: list[range]) -> int:
    """The pipeline stage that holds canonical tensor `name` (embeddings first, final norm and head last)."""
    m = _LAYER.match(name)
    if m:
        layer = int(m.group(1))
        return next(s for s, r in enumerate(stages) if layer in r)
    return 0 if name in FIRST_STAGE else len(stages) - 1


def tied_head_key(layout: str) -> str:
    """The last stage's copy of a tied embedding when PP > 1 (Megatron keeps one for the head on that stage)."""
    return "word_embeddings_for_head.weight" if layout == LEGACY else "output_layer.weight"


def _legacy_spelling(key: str) -> str:
    key = key.replace("language_model.transformer.", "language_model.encoder.")
    key = key.replace("encoder.final_norm.", "encoder.final_layernorm.")
    if ".layers." in key:
        for old, new in _LEGACY_ALIASES:
            key = key.replace(old, new)
    return key


def to_canonical(key: str, layout: str, first_layer: int) -> str | None:
    """The canonical name of file key `key` (flattened with dots) of a stage whose layers start at global
    `first_layer`; None for what holds no weight (_extra_state, rotary inv_freq) and for the last stage's tied
    head copy, "output_layer.weight" in the core layout (the caller decides); MegatronLayoutError if unknown."""
    if key.endswith("_extra_state") or key.endswith("inv_freq"):
        return None
    if layout == LEGACY:
        key = _legacy_spelling(key)
        if key == "word_embeddings_for_head.weight":
            return "output_layer.weight"
        back = {v: k for k, v in _LEGACY_GLOBAL.items()}
        if key in back:
            return back[key]
        m = re.match(r"^language_model\.encoder\.layers\.(\d+)\.(.+)$", key)
        if m:
            module, _, param = m.group(2).rpartition(".")
            canon = next((c for c, legacy in _TO_LEGACY.items() if legacy == module), None)
            if canon is not None and f"{canon}.{param}" in CANONICAL_LAYER:
                return f"decoder.layers.{int(m.group(1)) + first_layer}.{canon}.{param}"
    else:
        if key in FIRST_STAGE or key in LAST_STAGE:
            return key
        m = _LAYER.match(key)
        if m:
            suffix = {v: k for k, v in _TO_TE.items()}.get(m.group(2), m.group(2))
            if suffix in CANONICAL_LAYER:
                return f"decoder.layers.{int(m.group(1)) + first_layer}.{suffix}"
    raise MegatronLayoutError(f"key {key!r} is not a weight of a GPT-2 or Llama-family Megatron model in the {layout} "
                              f"layout (MoE, tokentype embeddings, poolers and the like are not imported)")


def from_canonical(name: str, layout: str, first_layer: int) -> str:
    """The file key (flattened with dots) of canonical tensor `name` in a stage whose layers start at global
    `first_layer`; core uses Transformer Engine's names (the norms fused into linear_qkv and linear_fc1)."""
    m = _LAYER.match(name)
    if layout == LEGACY:
        if not m:
            return _LEGACY_GLOBAL[name]
        module, _, param = m.group(2).rpartition(".")
        if module not in _TO_LEGACY:
            raise MegatronLayoutError(f"{name} has no place in the legacy layout (it has no qk-layernorm); "
                                      f"export with --core")
        return f"language_model.encoder.layers.{int(m.group(1)) - first_layer}.{_TO_LEGACY[module]}.{param}"
    if not m:
        return name
    return f"decoder.layers.{int(m.group(1)) - first_layer}.{_TO_TE.get(m.group(2), m.group(2))}"


# ------------------------------------------------------------------------------------------------
# model families: which adapter maps a model to and from the canonical names

FAMILIES = {"gpt": ("model_zoo.gpt.GPT", "model_zoo.hf"), "llama": ("model_zoo.llama.Llama", "model_zoo.llama_adapter")}
"""family -> (the model class a zerogpt checkpoint records, the module with its Megatron hooks: config_from_megatron,
megatron_args, to_megatron, from_megatron)."""


def family_of_args(args: dict) -> str:
    """"gpt" (learned positions, LayerNorm, GELU) or "llama" (RoPE, RMSNorm, SwiGLU) from a checkpoint's args."""
    rope = args.get("position_embedding_type") == "rope" or bool(args.get("use_rotary_position_embeddings"))
    llama = {"position_embedding_type": rope, "swiglu": bool(args.get("swiglu")),
             "normalization": args.get("normalization") == "RMSNorm"}
    if all(llama.values()):
        return "llama"
    if not any(llama.values()):
        return "gpt"
    traits = ", ".join(f"{k}={args.get(k)!r}" for k in llama)
    raise MegatronLayoutError(f"Megatron args mix GPT-2 and Llama traits ({traits}): neither model_zoo family "
                              f"reproduces that model")


def family_of_class(class_path: str) -> str:
    """The family of a zerogpt checkpoint's recorded model class; ValueError for classes with no Megatron mapping."""
    for family, (cls, _) in FAMILIES.items():
        if class_path == cls:
            return family
    raise MegatronLayoutError(f"model class {class_path} has no Megatron mapping; model_zoo's GPT and Llama family "
                              f"have one ({', '.join(c for c, _ in FAMILIES.values())})")
