"""GPT-2 in plain PyTorch: GPTConfig, the modules and their forward, and the factories (gpt2_tiny .. gpt2_xl).

Beside it: the loss (loss.py), the weight init (weight_init.py), sampling (generation.py) and Hugging Face
conversion (hf.py). Module names follow GPT-2/HF (transformer.wte, h[i].attn.c_attn, ln_f, lm_head) so
conversion is a lookup table. This file knows nothing about ZeRO; its only promise to the engine is that every
parameter is used inside the forward of the module that owns it (stage 3 gathers parameters in module
pre-forward hooks, and at every stage an offloaded step behind the next forward is waited for there), e.g.
position embeddings go through `self.wpe(pos)` and the tied head through `self.lm_head(x)`.

Vocabulary padding: the embedding/head have `padded_vocab_size` rows (a multiple of 64, for matmul speed),
but logits are sliced to the real `vocab_size` before they are returned or fed to the loss, so padded rows
never affect the loss or sampling and receive zero gradient.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as activation_checkpoint

from model_zoo import generation, hf, weight_init
from model_zoo.factory_args import check_overrides
from model_zoo.hf import GELU_APPROXIMATE
from model_zoo.layers import CausalAttention, LMHead, RealVocab
from model_zoo.loss import LOSS_BACKENDS, GPTLMLoss
from model_zoo.meta_weights import weights_are_real

__all__ = ["GPTConfig", "GPT", "Block", "CausalSelfAttention", "CausalAttention", "MLP", "LMHead", "GPTOutput",
           "gpt2_tiny", "gpt2_small", "gpt2_medium", "gpt2_large", "gpt2_xl", "SIZES", "as_gpt_config",
           "model_from_config", "from_hf", "to_hf", "load_pretrained_gpt"]

KVCache = tuple[tuple[torch.Tensor, torch.Tensor], ...]  # per layer (k, v), each (B, nh, T_past, hs)



@dataclass
class GPTConfig:
    """Shape and regularisation of a GPT-2 model."""

    vocab_size: int = 50257
    """Real vocabulary size (tokenizer); the embedding is padded up to `padded_vocab_size`."""
    max_position_embeddings: int = 1024
    """Longest sequence (learned position embeddings)."""
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    n_inner: int | None = None
    """MLP hidden width; None = 4 * n_embd."""
    dropout: float = 0.0
    """Embedding, attention and residual dropout (GPT-2 used 0.1; 0.0 is usual for pretraining)."""
    layer_norm_epsilon: float = 1e-5
    activation: str = "gelu_new"
    """"gelu_new" (GPT-2's tanh approximation) or "gelu" (exact)."""
    checkpoint: bool = False
    """Activation checkpointing per block: recompute block activations in backward to save memory."""
    pad_vocab_multiple: int = 64
    """Pad the embedding rows to a multiple of this for faster matmuls."""
    chunked_loss: bool = False
    """`model(x, labels=y)` computes the loss and its gradients from the hidden states, a chunk of tokens at a
    time (loss.chunked_cross_entropy): no (B, T, vocab) logits, and the output has no logits."""
    loss_chunk_size: int = 1024
    """The most tokens per chunk of the chunked loss (and at most 1/8 of the micro-batch's, loss.chunk_tokens): a
    chunk holds about 8 bytes x tokens x vocab (412 MB at 1024 x GPT-2's vocabulary). Large chunks keep the head's
    matmuls efficient and the per-chunk launches few."""
    loss_backend: str = "auto"
    """The chunked loss's kernel (loss.LOSS_BACKENDS): "auto" (a library kernel on CUDA where installed, else
    "torch"), "torch", "cce" (Apple's Cut Cross-Entropy) or "liger" (Liger-Kernel); a forced library needs CUDA."""

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.activation not in GELU_APPROXIMATE:
            raise ValueError(f"activation must be one of {sorted(GELU_APPROXIMATE)}, got {self.activation!r}")
        for name in ("vocab_size", "max_position_embeddings", "n_layer", "n_head", "n_embd", "pad_vocab_multiple",
                     "loss_chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.loss_backend not in LOSS_BACKENDS:
            raise ValueError(f"GPTConfig.loss_backend must be one of {', '.join(LOSS_BACKENDS)}, "
                             f"got {self.loss_backend!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_multiple
        return (self.vocab_size + m - 1) // m * m

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


@dataclass
class GPTOutput:
    """What `GPT.forward` returns when labels or use_cache are given."""

    logits: torch.Tensor | None
    """(B, T, vocab_size), compute dtype; None when GPTConfig.chunked_loss computed the loss without them."""
    loss: torch.Tensor | None = None
    """Scalar mean cross-entropy over labels != -100 (fp32)."""
    past_key_values: KVCache | None = None


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # q, k, v for all heads in one matmul
        self.attend = CausalAttention(config.dropout)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, layer_past: tuple[torch.Tensor, torch.Tensor] | None = None,
                use_cache: bool = False) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        B, T, _ = x.shape
        # c_attn's output is [q; k; v] for the heads this module computes: all n_head of them here, a
        # tensor-parallel rank's own heads when its c_attn holds the matching rows of each of q, k and v
        # (zerogpt.parallel.tensor). So the width and the head count come from the output, not the config.
        q, k, v = self.c_attn(x).chunk(3, dim=2)
        width = q.size(-1)
        q, k, v = (t.view(B, T, width // self.head_dim, self.head_dim).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        if layer_past is not None:
            k = torch.cat([layer_past[0], k], dim=2)  # (B, nh, T_past + T, hs)
            v = torch.cat([layer_past[1], v], dim=2)
        present = (k, v) if use_cache else None
        y = self.attend(q, k, v)
        y = y.transpose(1, 2).contiguous().view(B, T, width)  # re-assemble heads side by side
        return self.resid_dropout(self.c_proj(y)), present


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        hidden = config.n_inner or 4 * config.n_embd
        self.c_fc = nn.Linear(config.n_embd, hidden)
        self.act = nn.GELU(approximate=GELU_APPROXIMATE[config.activation])
        self.c_proj = nn.Linear(hidden, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, layer_past: tuple[torch.Tensor, torch.Tensor] | None = None,
                use_cache: bool = False) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        a, present = self.attn(self.ln_1(x), layer_past, use_cache)
        x = x + a
        x = x + self.mlp(self.ln_2(x))
        return x, present


class GPT(nn.Module):
    """GPT-2 language model.

    `model(input_ids)` -> logits (B, T, vocab_size). With `labels` (B, T) -> GPTOutput(loss, logits): labels are
    ALIGNED with input_ids (labels[:, t] is the target for position t, i.e. already shifted, as zerogpt's
    datasets yield them; -100 is ignored). Note Hugging Face shifts internally instead: for HF-style
    `labels=input_ids` use `GPTLMLoss()(logits, input_ids)`. With `use_cache=True` the output also carries
    `past_key_values` to pass back in for incremental decoding. With `chunked_loss=True` in the config,
    `labels` give GPTOutput(loss) without logits (the loss from the hidden states, a chunk at a time).

    Example:
        >>> model = gpt2_tiny()
        >>> model(torch.randint(0, 1024, (2, 16))).shape
        torch.Size([2, 16, 1024])
    """

    adapter = "model_zoo.hf"
    """The module with this family's checkpoint mappings (Hugging Face, Megatron-LM), for zerogpt_tools."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        # The weights are a function of this seed and the config alone (init_param_range). It is drawn before any
        # submodule touches the RNG, so torch.manual_seed(s) decides the weights and a meta build draws the same
        # seed as a plain one; device="cpu" even under torch.device("meta"). Every rank seeds alike
        # (launch_from_torch), so all ranks agree on it.
        self.init_seed = int(torch.randint(0, 2**62, (), device="cpu"))
        # nn.Linear and nn.Embedding draw a default init that reset_parameters overwrites. The CPU RNG is forked
        # around them so that building a GPT consumes exactly the draw above (a meta build draws nothing else
        # either), and dropout afterwards sees the same stream however the model was built.
        with torch.random.fork_rng(devices=[]):
            self.transformer = nn.ModuleDict(dict(
                wte=nn.Embedding(config.padded_vocab_size, config.n_embd),
                wpe=nn.Embedding(config.max_position_embeddings, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon),
            ))
            self.lm_head = LMHead(config.n_embd, config.padded_vocab_size, config.vocab_size, config.loss_chunk_size,
                                  config.loss_backend)
        # Tie: the head OWNS the same Parameter object, so module hooks on lm_head see it (named_parameters
        # lists it once, as transformer.wte.weight).
        self.lm_head.weight = self.transformer.wte.weight
        self.real_vocab = RealVocab(config.vocab_size)
        # What init_param_range needs of each parameter, fixed now: a parallel plan applied from outside may
        # later split a parameter or drop it from this rank (a pipeline stage), and a stage's own copy of the
        # tied head must still draw wte's values.
        self._init_numel = {name: p.numel() for name, p in self.named_parameters()}
        self._weights_real = False  # meta_weights.weights_are_real said so once: not asked again
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 init of every parameter, from `init_param_range` on whole parameters.

        A model built under `torch.device("meta")` has nothing to fill and returns at once; its values come
        later, range by range, from `init_param_range` (zerogpt.initialize fills each rank's shards with it), and
        are bit-identical to the ones this method gives a plainly built model with the same seed.
        """
        if any(p.is_meta for p in self.parameters()):
            return
        for name, p in self.named_parameters():
            p.copy_(self.init_param_range(name, 0, p.numel()).view(p.shape))

    def init_param_range(self, name: str, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of flattened parameter `name` exactly as initialised, however it is split.

        GPT-2's init, drawn block by block from generators seeded by (init_seed, name, block): see
        model_zoo/weight_init.py. zerogpt.initialize calls this on a meta-built model to fill each rank's shards.

        Args:
            name: a parameter name as in named_parameters(); the tied "lm_head.weight" is "transformer.wte.weight".
            start, end: element offsets into the flattened (unsharded) parameter, 0 <= start <= end <= numel.
        Returns:
            (end - start,) float32 CPU tensor.
        Example:
            >>> model = gpt2_tiny()
            >>> part = model.init_param_range("transformer.wpe.weight", 5, 9)
            >>> torch.equal(part, model.transformer.wpe.weight.view(-1)[5:9])
            True
        """
        return weight_init.init_param_range(self.config, self.init_seed, self._init_numel, name, start, end)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                past_key_values: KVCache | None = None, use_cache: bool = False) -> torch.Tensor | GPTOutput:
        """Args: input_ids (B, T) int64 token ids < vocab_size; labels (B, T) aligned targets or None;
        past_key_values from a previous call with use_cache=True. Returns logits (B, T, vocab_size) or GPTOutput.
        """
        if not self._weights_real and not torch.compiler.is_compiling():
            self._weights_real = weights_are_real(self, input_ids)  # a meta model called directly: one line
        B, T = input_ids.shape[:2]
        T_past = past_key_values[0][0].size(2) if past_key_values is not None else 0
        if T_past + T > self.config.max_position_embeddings:
            raise ValueError(f"sequence length {T_past + T} exceeds max_position_embeddings="
                             f"{self.config.max_position_embeddings}; use a shorter SEQ_LEN or build the model with "
                             f"max_position_embeddings={T_past + T}")
        # A pipeline stage (split from outside) may lack the embeddings, ln_f or the head; its `h` is then a
        # ModuleDict keyed by layer index, so parameter names stay those of the whole model.
        if "wte" in self.transformer:
            pos = torch.arange(T_past, T_past + T, dtype=torch.long, device=input_ids.device)  # (T,)
            x = self.transformer.drop(self.transformer.wte(input_ids) + self.transformer.wpe(pos))  # (B, T, C)
        else:
            x = input_ids  # hidden states (B, T, C) from the previous stage
        h = self.transformer.h
        presents = []
        for i, block in enumerate(h.values() if isinstance(h, nn.ModuleDict) else h):
            layer_past = past_key_values[i] if past_key_values is not None else None
            if self.config.checkpoint and self.training and not use_cache and torch.is_grad_enabled():
                x, present = activation_checkpoint(block, x, use_reentrant=False)
            else:
                x, present = block(x, layer_past, use_cache)
            presents.append(present)
        if self.lm_head is None:
            return x  # hidden states for the next stage
        x = self.transformer.ln_f(x)
        # chunked: not under tensor parallelism, whose plan replaces real_vocab (vocab-sharded logits)
        if labels is not None and self.config.chunked_loss and not use_cache and type(self.real_vocab) is RealVocab:
            return GPTOutput(logits=None, loss=self.lm_head(x, labels))
        logits = self.real_vocab(self.lm_head(x))  # (B, T, vocab_size): padding sliced off
        if labels is None and not use_cache:
            return logits
        loss = GPTLMLoss(shift=False)(logits, labels) if labels is not None else None
        return GPTOutput(logits=logits, loss=loss, past_key_values=tuple(presents) if use_cache else None)

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample `max_new_tokens` tokens after `input_ids` (B, T) with a KV cache; temperature 0 = greedy.

        See model_zoo/generation.py for the arguments; returns (B, T + max_new_tokens) token ids.
        """
        return generation.generate(self, input_ids, max_new_tokens, temperature, top_k, generator)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameters counted once (the tied head is wte). non_embedding=True drops the position embedding and
        the padded vocab rows, keeping wte's real rows because as the LM head they do matmul work (nanoGPT)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
            n -= (self.config.padded_vocab_size - self.config.vocab_size) * self.config.n_embd
        return n

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward), PaLM appendix B: 6N + 12 * L * H * Q * T."""
        c = self.config
        return 6 * self.num_params(non_embedding=True) + 12 * c.n_layer * c.n_head * c.head_dim * seq_len


# ----------------------------------------------------------------------------------------------------------
# Factories: model = dict(type=gpt2_small, checkpoint=True) in a config calls these with the dict's kwargs.

SIZES = {  # the one table of model sizes (zerogpt_tools.estimate reads it too)
    "gpt2_tiny": dict(n_layer=2, n_head=2, n_embd=64, vocab_size=1024, max_position_embeddings=256),
    "gpt2_small": dict(n_layer=12, n_head=12, n_embd=768),    # 124M
    "gpt2_medium": dict(n_layer=24, n_head=16, n_embd=1024),  # 355M
    "gpt2_large": dict(n_layer=36, n_head=20, n_embd=1280),   # 774M
    "gpt2_xl": dict(n_layer=48, n_head=25, n_embd=1600),      # 1.5B
}


def _build(size: str, pretrained: str | None, overrides: dict[str, Any]) -> GPT:
    check_overrides(GPTConfig, overrides, f"{size}()")
    config = GPTConfig(**{**SIZES[size], **overrides})
    if pretrained is None:
        return GPT(config)
    return load_pretrained_gpt(pretrained, size, config)


def gpt2_tiny(pretrained: str | None = None, **overrides: Any) -> GPT:
    """2 layers, width 64, 2 heads, vocab 1024, 256 positions: tests and the CPU demo.

    Overrides: any GPTConfig field (vocab_size, max_position_embeddings, dropout, checkpoint, ...);
    pretrained=DIR loads a local Hugging Face GPT-2 of the same shape.
    """
    return _build("gpt2_tiny", pretrained, overrides)


def gpt2_small(pretrained: str | None = None, **overrides: Any) -> GPT:
    """GPT-2 small, 124M: 12 layers, width 768, 12 heads (overrides as gpt2_tiny)."""
    return _build("gpt2_small", pretrained, overrides)


def gpt2_medium(pretrained: str | None = None, **overrides: Any) -> GPT:
    """GPT-2 medium, 355M: 24 layers, width 1024, 16 heads (overrides as gpt2_tiny)."""
    return _build("gpt2_medium", pretrained, overrides)


def gpt2_large(pretrained: str | None = None, **overrides: Any) -> GPT:
    """GPT-2 large, 774M: 36 layers, width 1280, 20 heads (overrides as gpt2_tiny)."""
    return _build("gpt2_large", pretrained, overrides)


def gpt2_xl(pretrained: str | None = None, **overrides: Any) -> GPT:
    """GPT-2 XL, 1.5B: 48 layers, width 1600, 25 heads (overrides as gpt2_tiny)."""
    return _build("gpt2_xl", pretrained, overrides)


# ----------------------------------------------------------------------------------------------------------
# The checkpoint plugin protocol: zerogpt_tools.export (ModelPlugin) rebuilds a recorded "model_zoo.gpt.GPT" with
# model_from_config from this module, and converts it with hf_config and to_hf_tensor from the module GPT.adapter
# names (model_zoo/hf.py).

def as_gpt_config(config: GPTConfig | dict[str, Any]) -> GPTConfig:
    """A GPTConfig from itself or from its `dataclasses.asdict` form (what checkpoints record)."""
    return config if isinstance(config, GPTConfig) else GPTConfig(**config)


def model_from_config(config: GPTConfig | dict[str, Any]) -> GPT:
    """A freshly initialised GPT of a recorded config (zerogpt_tools.generate loads checkpoint tensors into it)."""
    return GPT(as_gpt_config(config))


# ----------------------------------------------------------------------------------------------------------
# Hugging Face GPT-2 whole models (the rules per tensor and per config are model_zoo/hf.py's)

def from_hf(hf_model: Any, **overrides: Any) -> GPT:
    """Convert a transformers GPT2LMHeadModel into a GPT with identical outputs (fp32 logits within 1e-5).

    Args:
        hf_model: transformers.GPT2LMHeadModel (any size).
        overrides: GPTConfig fields that do not change the weights, e.g. dropout, checkpoint.
    """
    config = GPTConfig(**hf.gpt_config_from_hf(hf_model.config, **overrides))
    model = GPT(config)
    hf_state = hf_model.state_dict()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(hf.from_hf_tensor(name, hf_state[name], config)[1].to(param.dtype))
    return model


def to_hf(model: GPT) -> Any:
    """Convert a GPT into a transformers GPT2LMHeadModel with identical outputs (padded vocab rows dropped)."""
    from transformers import GPT2LMHeadModel

    hf_model = GPT2LMHeadModel(hf.hf_config(model.config))
    hf_params = dict(hf_model.named_parameters())
    with torch.no_grad():
        for name, param in model.named_parameters():
            hf_name, src = hf.to_hf_tensor(name, param.detach(), model.config)
            hf_params[hf_name].copy_(src.to(hf_params[hf_name].dtype))
    hf_model.tie_weights()
    return hf_model.to(next(model.parameters()).device)


def load_pretrained_gpt(path: str, size: str, config: GPTConfig) -> GPT:
    """Our GPT from a local HF GPT-2 directory, for the factories' pretrained=DIR (e.g. gpt2_small(pretrained=...)).

    Args:
        path: a `save_pretrained` GPT2LMHeadModel directory.
        size: the factory's name ("gpt2_small"); the checkpoint must have its n_layer, n_head and n_embd.
        config: the factory's GPTConfig; only its dropout and checkpoint are taken, the rest comes from the files.
    """
    from transformers import GPT2LMHeadModel

    hf.check_hf_dir(path)  # names a corrupt model.safetensors instead of a traceback
    model = from_hf(hf.load_checked(path, GPT2LMHeadModel), dropout=config.dropout, checkpoint=config.checkpoint)
    arch = ("n_layer", "n_head", "n_embd")
    if any(getattr(model.config, k) != getattr(config, k) for k in arch):
        got = ", ".join(f"{k}={getattr(model.config, k)}" for k in arch)
        raise ValueError(f"{size}(pretrained={path!r}): the checkpoint has {got}, which is not {size}; "
                         f"use the matching factory or model = dict(type='hf', path=...)")
    return model
