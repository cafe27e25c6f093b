"""The Llama family of decoders: Llama 2/3, Qwen2/2.5, Qwen3 and Mistral as one model with options.

RMSNorm, SwiGLU, grouped-query attention and RoPE in Hugging Face's rotate-half convention (as Megatron-Core and
Qwen also compute it), so Hugging Face q/k weights load as they are, without the permutation Meta's interleaved
layout needs. Options: Llama-3's RoPE frequency scaling, qkv bias (Qwen2), qk-norm (Qwen3), an explicit head_dim,
tied or untied embeddings. Module names are Hugging Face's (model.layers.N.self_attn.q_proj, mlp.gate_proj, ...),
so the weight mapping (model_zoo/llama_adapter.py) is a lookup. Like gpt.py this file knows nothing about ZeRO;
its promises to the engine are the same: every parameter is used inside the forward of the module that owns it,
and `init_param_range` gives any element range of any parameter on its own, so a meta build never holds the model
(the pretrained values come through the same door: model_zoo/pretrained.py).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as activation_checkpoint

from model_zoo import generation, llama_adapter
from model_zoo.factory_args import check_overrides
from model_zoo.layers import CausalAttention, LMHead, RealVocab
from model_zoo.llama_adapter import ARCHITECTURES, ROPE_TYPES
from model_zoo.loss import LOSS_BACKENDS, GPTLMLoss
from model_zoo.meta_weights import weights_are_real
from model_zoo.safetensors_source import SafetensorsDir, read_hf_config
from model_zoo.weight_init import draw_range

__all__ = ["LlamaConfig", "Llama", "DecoderLayer", "Attention", "SwiGLU", "RMSNorm", "LlamaOutput", "SIZES",
           "ARCHITECTURES", "llama_tiny", "llama2_7b", "llama3_2_1b", "llama3_2_3b", "llama3_8b", "qwen2_5_0_5b",
           "qwen2_5_7b", "qwen3_0_6b", "qwen3_8b", "mistral_7b", "model_from_config", "as_llama_config",
           "load_pretrained"]

KVCache = tuple[tuple[torch.Tensor, torch.Tensor], ...]  # per layer (k, v), each (B, n_kv, T_past, hs)


@dataclass
class LlamaConfig:
    """Shape of a Llama-family decoder. Field names are Hugging Face's config.json keys where one exists."""

    vocab_size: int = 32000
    """Real vocabulary size (tokenizer); the embedding is padded up to `padded_vocab_size`."""
    hidden_size: int = 4096
    intermediate_size: int = 11008
    """SwiGLU hidden width (gate_proj and up_proj rows)."""
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    """k/v heads (grouped-query attention); None = num_attention_heads (multi-head), 1 = multi-query."""
    head_dim: int | None = None
    """Width of one head; None = hidden_size / num_attention_heads (Qwen3 sets it explicitly)."""
    max_position_embeddings: int = 4096
    """Longest sequence the model is meant for (RoPE has no table, so this only bounds inputs)."""
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    """None, dict(rope_type="linear", factor=F) or Llama-3's dict(rope_type="llama3", factor=8.0,
    low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)."""
    qkv_bias: bool = False
    """Biases on q_proj, k_proj and v_proj (Qwen2/2.5), not on o_proj."""
    qk_norm: bool = False
    """RMSNorm over each head's q and k before RoPE (Qwen3)."""
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    """Mistral's window; not implemented: a sequence longer than it is refused (shorter ones are exact)."""
    attention_dropout: float = 0.0
    initializer_range: float = 0.02
    """std of the normal init of every weight and embedding (Hugging Face's _init_weights)."""
    architecture: str = "LlamaForCausalLM"
    """The Hugging Face class an export writes (one of ARCHITECTURES)."""
    checkpoint: bool = False
    """Activation checkpointing per layer: recompute layer activations in backward to save memory."""
    pad_vocab_multiple: int = 64
    """Pad the embedding (and an untied head) rows to a multiple of this; Llama-3's and Qwen's vocabularies
    already are one, so their rows are not padded."""
    chunked_loss: bool = False
    """`model(x, labels=y)` computes the loss and its gradients a chunk of tokens at a time
    (loss.chunked_cross_entropy): no (B, T, vocab) logits, and the output has no logits. Worth it with 128k-152k
    vocabularies."""
    loss_chunk_size: int = 1024
    """The most tokens per chunk of the chunked loss (and at most 1/8 of the micro-batch's, loss.chunk_tokens)."""
    loss_backend: str = "auto"
    """The chunked loss's kernel (loss.LOSS_BACKENDS): "auto", "torch", "cce" or "liger" (GPTConfig.loss_backend)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """config.json keys kept for the export (bos/eos ids, torch_dtype) that do not change the model."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "max_position_embeddings", "pad_vocab_multiple", "loss_chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"LlamaConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.loss_backend not in LOSS_BACKENDS:
            raise ValueError(f"LlamaConfig.loss_backend must be one of {', '.join(LOSS_BACKENDS)}, "
                             f"got {self.loss_backend!r}")
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                                 f"({self.num_attention_heads}), or give head_dim explicitly")
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads}): each k/v head serves a group")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE's rotate-half, got {self.head_dim}")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_scaling rope_type {rope_type!r} is not supported; supported: "
                             f"{', '.join(ROPE_TYPES)} (yarn, dynamic and longrope are not implemented)")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture must be one of {', '.join(ARCHITECTURES)}, got {self.architecture!r}")
        if not 0.0 <= self.attention_dropout < 1.0:
            raise ValueError(f"attention_dropout must be in [0, 1), got {self.attention_dropout}")

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_multiple
        return (self.vocab_size + m - 1) // m * m


@dataclass
class LlamaOutput:
    """What `Llama.forward` returns when labels or use_cache are given (GPTOutput's fields)."""

    logits: torch.Tensor | None
    loss: torch.Tensor | None = None
    past_key_values: KVCache | None = None


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """RoPE's inverse frequencies (head_dim / 2,) fp32, with the config's scaling: Hugging Face's
    `_compute_default_rope_parameters`, `_compute_linear_scaling_rope_parameters` and `_compute_llama3_parameters`
    (Meta's Llama 3.1 reference: long wavelengths divided by `factor`, short ones kept, a smooth ramp between)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type != "llama3":
        return inv_freq
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.size(-1) // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, the mean square taken in fp32 (Hugging Face's LlamaRMSNorm).

    Through torch's rms_norm: on a CPU the same ops as Hugging Face's, bit for bit; on CUDA one fused kernel for the
    normalization and one for its backward, where the composite form launches five kernels forward and more back
    (issue 46.2's fused-norm lever; compiled, inductor fuses either form). The weight multiplies after the cast to the
    compute dtype, as Hugging Face's does."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x.float(), (x.size(-1),), eps=self.eps).to(x.dtype)


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE: q_proj/k_proj/v_proj, optional per-head q/k RMSNorm, o_proj."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        c = config
        self.head_dim = c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.attend = CausalAttention(c.attention_dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                layer_past: tuple[torch.Tensor, torch.Tensor] | None = None,
                use_cache: bool = False) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """x (B, T, C); cos, sin (T, hs). The head counts come from the projections' outputs, so a tensor-parallel
        rank whose projections hold its own heads' rows (zerogpt.parallel) computes just those."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, -1, self.head_dim)  # (B, T, nh, hs)
        k = self.k_proj(x).view(B, T, -1, self.head_dim)  # (B, T, n_kv, hs)
        v = self.v_proj(x).view(B, T, -1, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, hs)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if layer_past is not None:
            k = torch.cat([layer_past[0], k], dim=2)  # (B, n_kv, T_past + T, hs)
            v = torch.cat([layer_past[1], v], dim=2)
        present = (k, v) if use_cache else None
        y = self.attend(q, k, v)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, -1)
        return self.o_proj(y), present


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) (Shazeer 2020, "GLU Variants Improve Transformer")."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-RMSNorm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                layer_past: tuple[torch.Tensor, torch.Tensor] | None = None,
                use_cache: bool = False) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        a, present = self.self_attn(self.input_layernorm(x), cos, sin, layer_past, use_cache)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), present


class Llama(nn.Module):
    """A Llama-family causal LM; the same calls as model_zoo's GPT.

    `model(input_ids)` -> logits (B, T, vocab_size). With `labels` (B, T), ALIGNED with input_ids (labels[:, t] is
    the target of position t, as zerogpt's datasets yield them; -100 ignored) -> LlamaOutput(loss, logits). With
    `use_cache=True` the output carries `past_key_values` for incremental decoding. With `chunked_loss` in the
    config, labels give LlamaOutput(loss) without logits.

    Weights: a fresh model draws Hugging Face's init (N(0, initializer_range) weights and embeddings, norms one,
    biases zero) from `init_param_range`; `model_zoo.from_pretrained(DIR)` gives it a source of pretrained values
    instead (`weight_source`), read through the same method range by range.

    Example:
        >>> model = llama_tiny()
        >>> model(torch.randint(0, 1024, (2, 16))).shape
        torch.Size([2, 16, 1024])
    """

    adapter = "model_zoo.llama_adapter"
    """The module with this family's checkpoint mappings (Hugging Face, Megatron-LM), for zerogpt_tools."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        # As GPT: the weights are a function of this seed and the config alone, drawn before any submodule touches
        # the RNG, on the CPU even under torch.device("meta"), the same on every rank.
        self.init_seed = int(torch.randint(0, 2**62, (), device="cpu"))
        # Pretrained values by (name, start, end), set by model_zoo.pretrained; None: the fresh init.
        self.weight_source: Callable[[str, int, int], torch.Tensor] | None = None
        with torch.random.fork_rng(devices=[]):
            self.model = nn.ModuleDict(dict(
                embed_tokens=nn.Embedding(config.padded_vocab_size, config.hidden_size),
                layers=nn.ModuleList([DecoderLayer(config) for _ in range(config.num_hidden_layers)]),
                norm=RMSNorm(config.hidden_size, config.rms_norm_eps),
            ))
            self.lm_head = LMHead(config.hidden_size, config.padded_vocab_size, config.vocab_size,
                                  config.loss_chunk_size, config.loss_backend)
        if config.tie_word_embeddings:  # the head OWNS the same Parameter, so module hooks on lm_head see it
            self.lm_head.weight = self.model.embed_tokens.weight
        self.real_vocab = RealVocab(config.vocab_size)
        # Not a parameter and not saved; real (CPU) even in a meta build, so the engine moves it with the buffers.
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        self._init_numel = {name: p.numel() for name, p in self.named_parameters()}
        self._init_shape = {name: tuple(p.shape) for name, p in self.named_parameters()}
        self._weights_real = False  # meta_weights.weights_are_real said so once: not asked again
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Every parameter from `init_param_range` on whole parameters; a meta build has nothing to fill."""
        if any(p.is_meta for p in self.parameters()):
            return
        for name, p in self.named_parameters():
            p.copy_(self.init_param_range(name, 0, p.numel()).view(p.shape))

    def init_param_range(self, name: str, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of flattened parameter `name` (as named_parameters() names it), fp32 on the CPU:
        the pretrained values when the model has a weight source, else the fresh init. Any split concatenates to
        the whole parameter bit for bit; zerogpt.initialize fills each rank's shards of a meta build with it."""
        if self.config.tie_word_embeddings and name == "lm_head.weight":
            name = "model.embed_tokens.weight"
        if name not in self._init_numel:
            raise KeyError(f"{type(self).__name__} has no parameter {name!r}; names are those of "
                           f"named_parameters(), e.g. 'model.layers.0.self_attn.q_proj.weight'")
        if self.weight_source is not None:
            return self.weight_source(name, start, end)
        numel = self._init_numel[name]
        kind = name.rpartition(".")[2]
        if kind == "bias":
            return draw_range(self.init_seed, name, numel, start, end, None, 0.0)
        if len(self._init_shape[name]) == 1:  # an RMSNorm weight
            return draw_range(self.init_seed, name, numel, start, end, None, 1.0)
        out = draw_range(self.init_seed, name, numel, start, end, self.config.initializer_range)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):  # padded vocab rows: zero, never a token
            out[max(0, self.config.vocab_size * self.config.hidden_size - start):] = 0.0
        return out

    def rope(self, T_past: int, T: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (T, head_dim) of positions T_past .. T_past + T - 1, computed in fp32 and cast to the compute
        dtype as Hugging Face's LlamaRotaryEmbedding does."""
        pos = torch.arange(T_past, T_past + T, device=self.inv_freq.device).float()
        freqs = pos[:, None] * self.inv_freq.float()[None, :]  # (T, hs/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                past_key_values: KVCache | None = None, use_cache: bool = False) -> torch.Tensor | LlamaOutput:
        """Args: input_ids (B, T) int64 ids < vocab_size (or, on a later pipeline stage, hidden states (B, T, C));
        labels (B, T) aligned targets or None; past_key_values from a previous use_cache=True call."""
        if not self._weights_real and not torch.compiler.is_compiling():
            self._weights_real = weights_are_real(self, input_ids)  # a meta model called directly: one line
        T = input_ids.size(1)
        T_past = past_key_values[0][0].size(2) if past_key_values is not None else 0
        window = self.config.sliding_window
        if window is not None and T_past + T > window:
            raise ValueError(f"sequence length {T_past + T} exceeds sliding_window={window}, and sliding-window "
                             f"attention is not implemented; use SEQ_LEN <= {window}")
        # A pipeline stage (split from outside) may lack the embedding, the norm or the head; its `layers` is then
        # a ModuleDict keyed by layer index, so parameter names stay those of the whole model.
        x = self.model.embed_tokens(input_ids) if "embed_tokens" in self.model else input_ids  # (B, T, C)
        cos, sin = self.rope(T_past, T, x.dtype)
        layers = self.model.layers
        presents = []
        for i, layer in enumerate(layers.values() if isinstance(layers, nn.ModuleDict) else layers):
            layer_past = past_key_values[i] if past_key_values is not None else None
            if self.config.checkpoint and self.training and not use_cache and torch.is_grad_enabled():
                x, present = activation_checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x, present = layer(x, cos, sin, layer_past, use_cache)
            presents.append(present)
        if self.lm_head is None:
            return x  # hidden states for the next stage
        x = self.model.norm(x)
        if labels is not None and self.config.chunked_loss and not use_cache and type(self.real_vocab) is RealVocab:
            return LlamaOutput(logits=None, loss=self.lm_head(x, labels))
        logits = self.real_vocab(self.lm_head(x))  # (B, T, vocab_size): padding sliced off
        if labels is None and not use_cache:
            return logits
        loss = GPTLMLoss(shift=False)(logits, labels) if labels is not None else None
        return LlamaOutput(logits=logits, loss=loss, past_key_values=tuple(presents) if use_cache else None)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample with a KV cache (model_zoo/generation.py); temperature 0 = greedy."""
        return generation.generate(self, input_ids, max_new_tokens, temperature, top_k, generator)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameters counted once. non_embedding=True drops the input embedding (a lookup, no matmul) when the
        head is untied, and the padded vocab rows; a tied embedding is counted as the head (nanoGPT)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            c = self.config
            n -= (c.padded_vocab_size - c.vocab_size) * c.hidden_size
            if not c.tie_word_embeddings:
                n -= c.vocab_size * c.hidden_size
        return n

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward), PaLM appendix B: 6N + 12 * L * H * Q * T."""
        c = self.config
        return 6 * self.num_params(non_embedding=True) + 12 * c.num_hidden_layers * c.num_attention_heads \
            * c.head_dim * seq_len


# ----------------------------------------------------------------------------------------------------------
# Factories with the published shapes (each model's config.json on the Hugging Face Hub):
# model = dict(type=llama3_8b, checkpoint=True) in a config calls these with the dict's kwargs.

_LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)
_LLAMA32_ROPE = dict(_LLAMA3_ROPE, factor=32.0)

SIZES: dict[str, dict[str, Any]] = {  # the one table of the family's sizes (zerogpt_tools.estimate reads it too)
    "llama_tiny": dict(vocab_size=1024, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       rope_theta=500000.0, rope_scaling=dict(_LLAMA3_ROPE, original_max_position_embeddings=64)),
    "llama2_7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096, rms_norm_eps=1e-5),
    "llama3_2_1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                        rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=_LLAMA32_ROPE, tie_word_embeddings=True),
    "llama3_2_3b": dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                        num_attention_heads=24, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                        rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=_LLAMA32_ROPE, tie_word_embeddings=True),
    "llama3_8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                      rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE),  # Llama-3.1-8B, 8.03B
    "qwen2_5_0_5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                         rope_theta=1000000.0, qkv_bias=True, tie_word_embeddings=True,
                         architecture="Qwen2ForCausalLM"),
    "qwen2_5_7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=131072,
                       rope_theta=1000000.0, qkv_bias=True, architecture="Qwen2ForCausalLM"),
    "qwen3_0_6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       rope_theta=1000000.0, qk_norm=True, tie_word_embeddings=True, architecture="Qwen3ForCausalLM"),
    "qwen3_8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                     rope_theta=1000000.0, qk_norm=True, architecture="Qwen3ForCausalLM"),
    "mistral_7b": dict(vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=32768,
                       rms_norm_eps=1e-5, rope_theta=1000000.0, architecture="MistralForCausalLM"),  # v0.3
}


def as_llama_config(config: LlamaConfig | dict[str, Any]) -> LlamaConfig:
    """A LlamaConfig from itself or from its `dataclasses.asdict` form (what checkpoints record)."""
    return config if isinstance(config, LlamaConfig) else LlamaConfig(**config)


def _build(size: str, pretrained: str | None, overrides: dict[str, Any]) -> Llama:
    check_overrides(LlamaConfig, overrides, f"{size}()")
    if pretrained is not None:
        return load_pretrained(pretrained, expect=size, **overrides)
    return Llama(LlamaConfig(**{**SIZES[size], **overrides}))


def model_from_config(config: LlamaConfig | dict[str, Any]) -> Llama:
    """A freshly initialised model of a recorded config (zerogpt_tools.generate loads checkpoint tensors into it)."""
    return Llama(as_llama_config(config))


def llama_tiny(pretrained: str | None = None, **overrides: Any) -> Llama:
    """2 layers, width 64, 4 q / 2 kv heads, vocab 1024, Llama-3 RoPE scaling: tests and the CPU demo.

    Overrides: any LlamaConfig field; pretrained=DIR loads a local Hugging Face checkpoint of the same family
    (its shape comes from its config.json)."""
    return _build("llama_tiny", pretrained, overrides)


def llama2_7b(pretrained: str | None = None, **overrides: Any) -> Llama:
    """Llama-2-7B: 32 layers, width 4096, 32 heads (multi-head), vocab 32000 (overrides as llama_tiny)."""
    return _build("llama2_7b", pretrained, overrides)


def llama3_2_1b(pretrained: str | None = None, **overrides: Any) -> Llama:
    """Llama-3.2-1B: 16 layers, width 2048, 32 q / 8 kv heads, tied 128256 vocab (overrides as llama_tiny)."""
    return _build("llama3_2_1b", pretrained, overrides)


def llama3_2_3b(pretrained: str | None = None, **overrides: Any) -> Llama:
    """Llama-3.2-3B: 28 layers, width 3072, 24 q / 8 kv heads, tied 128256 vocab (overrides as llama_tiny)."""
    return _build("llama3_2_3b", pretrained, overrides)


def llama3_8b(pretrained: str | None = None, **overrides: Any) -> Llama:
    """Llama-3.1-8B, 8.03B: 32 layers, width 4096, 32 q / 8 kv heads, SwiGLU 14336, untied 128256 vocab."""
    return _build("llama3_8b", pretrained, overrides)


def qwen2_5_0_5b(pretrained: str | None = None, **overrides: Any) -> Llama:
    """Qwen2.5-0.5B: 24 layers, width 896, 14 q / 2 kv heads, qkv bias, tied 151936 vocab."""
    return _build("qwen2_5_0_5b", pretrained, overrides)


def qwen2_5_7b(pretrained: str | None = None, **overrides: Any) -> Llama:
    """Qwen2.5-7B, 7.62B: 28 layers, width 3584, 28 q / 4 kv heads, qkv bias, untied 152064 vocab."""
    return _build("qwen2_5_7b", pretrained, overrides)


def qwen3_0_6b(pretrained: str | None = None, **overrides: Any) -> Llama:
    """Qwen3-0.6B: 28 layers, width 1024, 16 q / 8 kv heads of 128, qk-norm, tied 151936 vocab."""
    return _build("qwen3_0_6b", pretrained, overrides)


def qwen3_8b(pretrained: str | None = None, **overrides: Any) -> Llama:
    """Qwen3-8B: 36 layers, width 4096, 32 q / 8 kv heads of 128, qk-norm, untied 151936 vocab."""
    return _build("qwen3_8b", pretrained, overrides)


def mistral_7b(pretrained: str | None = None, **overrides: Any) -> Llama:
    """Mistral-7B v0.3: 32 layers, width 4096, 32 q / 8 kv heads, untied 32768 vocab, no sliding window."""
    return _build("mistral_7b", pretrained, overrides)


# ----------------------------------------------------------------------------------------------------------
# Hugging Face checkpoints streamed in (model_zoo.from_pretrained, type="hf", the factories' pretrained=DIR); the
# checkpoint mappings are model_zoo/llama_adapter.py's, which Llama.adapter names for zerogpt_tools' exporters.

def load_pretrained(directory: str, *, device: str | torch.device = "meta", dtype: torch.dtype = torch.float32,
                    expect: str | None = None, **overrides: Any) -> Llama:
    """A Llama-family Hugging Face checkpoint as a Llama, its weights streamed from the safetensors files
    (model_zoo.from_pretrained and the factories' pretrained=DIR call this).

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
    where = os.path.join(directory, "config.json")
    kwargs = llama_adapter.config_from_hf(read_hf_config(directory), where=where)
    check_overrides(LlamaConfig, overrides, f"from_pretrained({directory!r})")
    config = LlamaConfig(**{**kwargs, **overrides})
    if expect is not None:
        _check_shape(config, expect, directory)
    source = SafetensorsDir(directory)
    with torch.device("meta"):
        model = Llama(config)
    _check_tensors(model, source, directory)
    rows = {name: p.size(0) for name, p in model.named_parameters()}

    def read(name: str, start: int, end: int) -> torch.Tensor:
        return source.read_range(llama_adapter.hf_name(name, config), start, end, rows=rows[name])

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
        stored = llama_adapter.hf_name(name, config)
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
