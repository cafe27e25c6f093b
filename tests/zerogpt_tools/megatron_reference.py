"""Megatron-LM checkpoints written, and run, from Megatron's documented layout: the tests' independent reference.

Nothing here imports zerogpt: the writer and the forward follow Megatron's own description of its files, so the
importer and exporter are checked against them, not against themselves. Sources: Megatron-LM
megatron/training/checkpointing.py (iter_{:07d}/mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt, the tracker file,
fix_query_key_value_ordering: version 0 stores a rank's qkv as [3, np, hn], 1 as [np, hn, 3], 2+ as [np, 3, hn]);
megatron/legacy/model/{language_model,transformer,gpt_model}.py at 39ec5eb^ (the nested language_model dict,
word_embeddings_for_head on the last stage); Megatron-Core's GPTModel state dict (decoder.layers.N, TE's fused
norms linear_qkv.layer_norm_weight / linear_fc1.layer_norm_weight), linear_qkv grouped per query group
(Megatron-Bridge merge_qkv_weights), [gate_r; up_r] per TP rank (GatedMLPMapping), torch_dist stacking layers on
a leading axis (TransformerBlock.sharded_state_dict) with fc1 global [gate; up] (apply_swiglu_sharded_factory).
"""
from __future__ import annotations

import argparse
import json
import math
import os

import torch
import torch.nn.functional as F

VOCAB = 200          # real tokens; Megatron pads the embedding to a multiple of make_vocab_size_divisible_by x TP
DIVISIBLE_BY = 32


def padded_vocab(tp: int) -> int:
    """Megatron's _vocab_size_with_padding."""
    multiple = DIVISIBLE_BY * tp
    return math.ceil(VOCAB / multiple) * multiple


def gpt_args(tp: int = 1, pp: int = 1, **over) -> argparse.Namespace:
    """A tiny GPT-2 as Megatron-LM's pretrain_gpt.py records its arguments (bias GELU fusion on: its default)."""
    args = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, max_position_embeddings=32,
                seq_length=32, padded_vocab_size=padded_vocab(tp), make_vocab_size_divisible_by=DIVISIBLE_BY,
                tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                position_embedding_type="learned_absolute", add_position_embedding=True, normalization="LayerNorm",
                layernorm_epsilon=1e-5, bias_gelu_fusion=True,
                openai_gelu=False, swiglu=False, add_bias_linear=True, untie_embeddings_and_output_weights=False,
                tokenizer_type="GPT2BPETokenizer", consumed_train_samples=640, hidden_dropout=0.1, fp16=False,
                bf16=False, params_dtype=torch.float32)
    args.update(over)
    return argparse.Namespace(**args)


def llama_args(tp: int = 1, pp: int = 1, **over) -> argparse.Namespace:
    """A tiny Llama (4 query heads in 2 groups, SwiGLU, RMSNorm, RoPE, untied head) as Megatron-Core records it."""
    args = dict(num_layers=2, hidden_size=64, num_attention_heads=4, group_query_attention=True, num_query_groups=2,
                kv_channels=16, ffn_hidden_size=96, max_position_embeddings=64, seq_length=64,
                padded_vocab_size=padded_vocab(tp), make_vocab_size_divisible_by=DIVISIBLE_BY,
                tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, position_embedding_type="rope",
                rotary_base=10000, rotary_percent=1.0, normalization="RMSNorm", norm_epsilon=1e-5, swiglu=True,
                add_bias_linear=False, add_qkv_bias=False, untie_embeddings_and_output_weights=True,
                tokenizer_type="HuggingFaceTokenizer", vocab_size=VOCAB, bf16=True, params_dtype=torch.bfloat16,
                ckpt_format="torch", use_mcore_models=True)
    args.update(over)
    return argparse.Namespace(**args)


# ------------------------------------------------------------------------------------------------
# weights at TP=1 in Megatron's own names (the local spec's norms), global layer numbers


def random_weights(args: argparse.Namespace, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    dtype = args.params_dtype

    def rand(*shape, scale=0.2):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    h, ffn = args.hidden_size, args.ffn_hidden_size
    heads = args.num_attention_heads
    hd = getattr(args, "kv_channels", None) or h // heads
    groups = args.num_query_groups if getattr(args, "group_query_attention", False) else heads
    qkv_rows = (heads + 2 * groups) * hd
    bias = args.add_bias_linear
    w = {"embedding.word_embeddings.weight": rand(args.padded_vocab_size, h)}
    if args.position_embedding_type == "learned_absolute":
        w["embedding.position_embeddings.weight"] = rand(args.max_position_embeddings, h)
    for i in range(args.num_layers):
        p = f"decoder.layers.{i}."
        w[p + "input_layernorm.weight"] = 1 + rand(h, scale=0.1)
        if args.normalization == "LayerNorm":
            w[p + "input_layernorm.bias"] = rand(h, scale=0.1)
        w[p + "self_attention.linear_qkv.weight"] = rand(qkv_rows, h)
        if bias or getattr(args, "add_qkv_bias", False):
            w[p + "self_attention.linear_qkv.bias"] = rand(qkv_rows, scale=0.1)
        if getattr(args, "qk_layernorm", False):  # one norm over each head's width, shared by the heads
            w[p + "self_attention.q_layernorm.weight"] = 1 + rand(hd, scale=0.1)
            w[p + "self_attention.k_layernorm.weight"] = 1 + rand(hd, scale=0.1)
        w[p + "self_attention.linear_proj.weight"] = rand(h, heads * hd)
        if bias:
            w[p + "self_attention.linear_proj.bias"] = rand(h, scale=0.1)
        w[p + "pre_mlp_layernorm.weight"] = 1 + rand(h, scale=0.1)
        if args.normalization == "LayerNorm":
            w[p + "pre_mlp_layernorm.bias"] = rand(h, scale=0.1)
        w[p + "mlp.linear_fc1.weight"] = rand(2 * ffn if args.swiglu else ffn, h)
        if bias:
            w[p + "mlp.linear_fc1.bias"] = rand(ffn, scale=0.1)
        w[p + "mlp.linear_fc2.weight"] = rand(h, ffn)
        if bias:
            w[p + "mlp.linear_fc2.bias"] = rand(h, scale=0.1)
    w["decoder.final_layernorm.weight"] = 1 + rand(h, scale=0.1)
    if args.normalization == "LayerNorm":
        w["decoder.final_layernorm.bias"] = rand(h, scale=0.1)
    if args.untie_embeddings_and_output_weights:
        w["output_layer.weight"] = rand(args.padded_vocab_size, h)
    return w


# ------------------------------------------------------------------------------------------------
# one TP rank's and one PP stage's part


def rank_part(name: str, t: torch.Tensor, rank: int, tp: int, swiglu: bool) -> torch.Tensor:
    """What TP rank `rank` holds of TP=1 tensor `name` (a copy)."""
    if name.endswith(("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight", "linear_qkv.bias")) \
            or (name.endswith(("linear_fc1.weight", "linear_fc1.bias")) and not swiglu):
        n = t.shape[0] // tp  # qkv: rows go group by group, each rank ng / tp whole groups
        return t[rank * n:(rank + 1) * n].clone()
    if name.endswith(("linear_fc1.weight", "linear_fc1.bias")):  # [gate; up] -> [gate_r; up_r]
        gate, up = t.chunk(2)
        n = gate.shape[0] // tp
        return torch.cat([gate[rank * n:(rank + 1) * n], up[rank * n:(rank + 1) * n]]).clone()
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        n = t.shape[1] // tp
        return t[:, rank * n:(rank + 1) * n].clone()
    return t.clone()


def to_version(t: torch.Tensor, version: float, heads: int) -> torch.Tensor:
    """A rank's qkv from the [np, 3, hn] order into the order `version` stored (Megatron's _transpose_first_dim
    undone)."""
    shape = t.shape
    if version == 0:
        return t.reshape(heads, 3, -1, *shape[1:]).permute(1, 0, 2, *range(3, t.dim() + 2)).reshape(shape).clone()
    if version == 1:
        return t.reshape(heads, 3, -1, *shape[1:]).permute(0, 2, 1, *range(3, t.dim() + 2)).reshape(shape).clone()
    return t


LEGACY_LAYER = {"input_layernorm": "input_layernorm", "self_attention.linear_qkv": "self_attention.query_key_value",
                "self_attention.linear_proj": "self_attention.dense", "pre_mlp_layernorm": "post_attention_layernorm",
                "mlp.linear_fc1": "mlp.dense_h_to_4h", "mlp.linear_fc2": "mlp.dense_4h_to_h"}
TE_NORMS = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
            "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
            "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
            "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias"}


def _stage_model(weights, args, rank, stage, layout, version, te):
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    per = args.num_layers // pp
    first, last = stage == 0, stage == pp - 1
    tied = not args.untie_embeddings_and_output_weights
    heads_local = args.num_attention_heads // tp
    flat, legacy = {}, {"language_model": {}}
    lm = legacy["language_model"]
    for name, t in weights.items():
        part = rank_part(name, t, rank, tp, args.swiglu)
        if name.startswith("decoder.layers."):
            i, rest = int(name.split(".")[2]), ".".join(name.split(".")[3:])
            if not stage * per <= i < (stage + 1) * per:
                continue
            local = i - stage * per  # pipeline stages number their layers from 0
            module, param = rest.rsplit(".", 1)
            if layout == "legacy":
                if module == "self_attention.linear_qkv":
                    part = to_version(part, version, heads_local)
                lm.setdefault("encoder", {})[f"layers.{local}.{LEGACY_LAYER[module]}.{param}"] = part
            else:
                flat[f"decoder.layers.{local}.{TE_NORMS.get(rest, rest) if te else rest}"] = part
        elif name.startswith("embedding."):
            if first:
                if layout == "legacy":
                    lm.setdefault("embedding", {})[name.split(".")[1]] = {"weight": part}
                else:
                    flat[name] = part
            if last and not first and tied and name == "embedding.word_embeddings.weight":  # the head's own copy
                if layout == "legacy":
                    legacy["word_embeddings_for_head"] = {"weight": part}
                else:
                    flat["output_layer.weight"] = part
        elif last:
            if layout == "legacy":
                target = lm.setdefault("encoder", {}) if name.startswith("decoder.") else lm
                key = "final_layernorm." + name.rsplit(".", 1)[1] if name.startswith("decoder.") else None
                if key:
                    target[key] = part
                else:
                    lm["output_layer"] = {"weight": part}
            else:
                flat[name] = part
    if layout != "legacy" and te:
        for local in range(per):
            flat[f"decoder.layers.{local}.self_attention.linear_qkv._extra_state"] = None
    return legacy if layout == "legacy" else flat


def write_megatron(root: str, args: argparse.Namespace, weights: dict[str, torch.Tensor], iteration: int = 100,
                   layout: str = "legacy", version: float = 3.0, te: bool = True, optimizer: bool = False) -> str:
    """A checkpoint as Megatron's save_checkpoint lays it out (torch format); returns root."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    directory = os.path.join(root, f"iter_{iteration:07d}")
    for stage in range(pp):
        for rank in range(tp):
            rank_dir = os.path.join(directory, f"mp_rank_{rank:02d}" + (f"_{stage:03d}" if pp > 1 else ""))
            os.makedirs(rank_dir, exist_ok=True)
            state = {"args": args, "iteration": iteration,
                     "model": _stage_model(weights, args, rank, stage, layout, version, te),
                     "rng_state": [{"random_rng_state": ("x", (1, 2)), "np_rng_state": None}]}
            if version is not None:
                state["checkpoint_version"] = version
            if optimizer:
                state["optimizer"] = {"optimizer": {"state": {0: {"exp_avg": torch.zeros(3)}}, "param_groups": []}}
                state["opt_param_scheduler"] = {"max_lr": 3e-4, "num_steps": iteration}
            torch.save(state, os.path.join(rank_dir, "model_optim_rng.pt"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))
    return root


def write_torch_dist(root: str, args: argparse.Namespace, weights: dict[str, torch.Tensor],
                     iteration: int = 100, per_layer: bool = False) -> str:
    """Megatron-Core's torch_dist: global tensors through DCP, each layer tensor stacked over the layers; or, as
    non-homogeneous models and singleton_local_shards save them, one key per layer with fc1's gate and up apart
    (<key>_w, <key>_v)."""
    import torch.distributed.checkpoint as dcp

    directory = os.path.join(root, f"iter_{iteration:07d}")
    state, stacks = {}, {}
    for name, t in weights.items():
        if name.startswith("decoder.layers."):
            i, rest = name.split(".")[2], ".".join(name.split(".")[3:])
            if not per_layer:
                stacks.setdefault("decoder.layers." + TE_NORMS.get(rest, rest), []).append(t)
            elif rest == "mlp.linear_fc1.weight" and args.swiglu:
                state[f"decoder.layers.{i}.{rest}_w"], state[f"decoder.layers.{i}.{rest}_v"] = t.chunk(2)
            else:
                state[f"decoder.layers.{i}.{TE_NORMS.get(rest, rest)}"] = t
        else:
            state[name] = t
    state.update({k: torch.stack(v) for k, v in stacks.items()})
    state["optimizer.state.exp_avg.embedding.word_embeddings.weight"] = torch.zeros_like(
        weights["embedding.word_embeddings.weight"])
    dcp.save(state, storage_writer=dcp.FileSystemWriter(directory))
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": iteration}, os.path.join(directory, "common.pt"))
    with open(os.path.join(directory, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1}, f)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))
    return root


# ------------------------------------------------------------------------------------------------
# the forward Megatron computes with these weights (fp32)


def _attend(q, k, v):  # (B, T, heads, hd) each, k/v already one per query head
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    T = q.shape[2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2).flatten(2)


def reference_logits(args: argparse.Namespace, weights: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """Logits (B, T, VOCAB) of Megatron's GPT model with `weights` (TP=1 names), computed in fp32."""
    w = {k: v.float() for k, v in weights.items()}
    B, T = ids.shape
    heads = args.num_attention_heads
    hd = getattr(args, "kv_channels", None) or args.hidden_size // heads
    groups = args.num_query_groups if getattr(args, "group_query_attention", False) else heads
    eps = getattr(args, "norm_epsilon", None) or args.layernorm_epsilon
    rms = args.normalization == "RMSNorm"

    def norm(x, prefix):
        if rms:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w[prefix + ".weight"]
        return F.layer_norm(x, x.shape[-1:], w[prefix + ".weight"], w[prefix + ".bias"], eps)

    def linear(x, prefix):
        return F.linear(x, w[prefix + ".weight"], w.get(prefix + ".bias"))

    x = w["embedding.word_embeddings.weight"][ids]
    if args.position_embedding_type == "learned_absolute":
        x = x + w["embedding.position_embeddings.weight"][:T]
    else:  # RoPE, rotate-half: Megatron-Core's RotaryEmbedding with rotary_interleaved=False
        inv_freq = 1.0 / (args.rotary_base ** (torch.arange(0, hd, 2).float() / hd))
        if getattr(args, "use_rope_scaling", False):  # RotaryEmbedding._apply_scaling: Llama 3.1's, context 8192
            factor, wavelen = args.rope_scaling_factor, 2 * math.pi / inv_freq
            scaled = torch.where(wavelen > 8192, inv_freq / factor, inv_freq)
            smooth = (8192 / wavelen - 1) / (4 - 1)
            medium = ~(wavelen < 8192 / 4) * ~(wavelen > 8192)
            inv_freq = torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
        freqs = torch.outer(torch.arange(T).float(), inv_freq)
        cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    for i in range(args.num_layers):
        p = f"decoder.layers.{i}."
        qkv = linear(norm(x, p + "input_layernorm"), p + "self_attention.linear_qkv")
        per = heads // groups
        qkv = qkv.view(B, T, groups, per + 2, hd)  # each group: its query heads, then its key, then its value
        q = qkv[:, :, :, :per].reshape(B, T, heads, hd)
        k = qkv[:, :, :, per].repeat_interleave(per, dim=2)
        v = qkv[:, :, :, per + 1].repeat_interleave(per, dim=2)
        if getattr(args, "qk_layernorm", False):  # before RoPE, as Megatron-Core's SelfAttention applies them
            q, k = norm(q, p + "self_attention.q_layernorm"), norm(k, p + "self_attention.k_layernorm")
        if args.position_embedding_type == "rope":
            def rotate(t):
                t1, t2 = t.chunk(2, -1)
                return t * cos[:, None] + torch.cat([-t2, t1], -1) * sin[:, None]
            q, k = rotate(q), rotate(k)
        x = x + linear(_attend(q, k, v), p + "self_attention.linear_proj")
        hidden = linear(norm(x, p + "pre_mlp_layernorm"), p + "mlp.linear_fc1")
        if args.swiglu:
            gate, up = hidden.chunk(2, -1)
            hidden = F.silu(gate) * up
        else:
            tanh = args.bias_gelu_fusion or args.openai_gelu
            hidden = F.gelu(hidden, approximate="tanh" if tanh else "none")
        x = x + linear(hidden, p + "mlp.linear_fc2")
    x = norm(x, "decoder.final_layernorm")
    tied = not args.untie_embeddings_and_output_weights
    head = w["embedding.word_embeddings.weight"] if tied else w["output_layer.weight"]
    return (x @ head.T)[..., :VOCAB]
