"""The memory model of a zerogpt run: bytes per rank on device, host and disk, as pure functions of ints.

Model states (`model_state_bytes`, the ZeRO-paper accounting as the engine holds it), activations (Korthikanti et
al. 2022) and chunk buffers in flight. The engine's `memory_stats()` measures the same categories and tests compare
the two. Preflight refuses a run that cannot fit with it (zerogpt/preflight_memory.py); the `zerogpt_tools.estimate`
CLI prints it for a model before you launch.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

from zerogpt.config.dtypes import DTYPES
from zerogpt.config.strategy import BucketTensorShardStrategy, TensorShardStrategy, chunk_groups

__all__ = ["HOMES", "OFFLOAD_HOMES", "CATEGORIES", "FAMILIES", "ModelShape", "model_state_bytes", "zero_paper_bytes",
           "activation_bytes", "chunk_of_params", "grads_activations_overlap", "largest_chunk", "gather_peak",
           "buffer_bytes", "chunk_numels", "gathered_bytes", "grad_chunks_in_flight", "cpu_run_shared_bytes",
           "speculative_spare_bytes", "estimate", "grad_crosses_once", "step_grad_itemsize"]

HOMES = ("device", "host", "disk")
"""Where a byte of model state lives: the one list (zero/offload.py's Placement, the engine's memory_stats and the
estimate tool read it)."""
OFFLOAD_HOMES = {"none": "device", "cpu": "host", "disk": "disk"}
"""zero.offload_optimizer.device / zero.offload_param.device -> the home of what it places (build_engine.py reads
it)."""
CATEGORIES = ("params", "grads", "master", "optimizer")
"""The kinds of model state (the ZeRO paper's), each counted per home; Engine.memory_stats measures the same."""
FAMILIES = ("gpt2", "llama")  # the decoder blocks ModelShape describes
LOSS_MIN_CHUNKS = 8
"""The chunked loss splits a micro-batch's tokens into at least this many chunks: model_zoo/loss.py's MIN_CHUNKS
(zerogpt does not import model_zoo; tests/test_memory_model.py holds the two equal)."""


@dataclass(frozen=True)
class ModelShape:
    """A decoder's shape, as ints, in one of two families.

    "gpt2" (the default): GPT-2's block as model_zoo/gpt.py builds it: tied wte/lm_head, `positions` learned position
    rows, pre-LayerNorm (weight and bias), a 4h GELU MLP, biases on every Linear.
    "llama": the Llama family as model_zoo/llama.py builds it (Llama 2/3, Qwen2/2.5/3, Mistral): RMSNorm (one
    vector per norm), grouped-query attention (`kv_heads` k/v heads of `head_dim`), a SwiGLU MLP of width `ffn` (three
    matrices), no biases but the optional q/k/v ones (`qkv_bias`), optional per-head q/k RMSNorm (`qk_norm`), RoPE (no
    position table), a head tied to the embedding or not (`tied`).
    The options default (None) to the family's own: kv_heads = heads, head_dim = hidden / heads, ffn = 4h (a Llama
    has no default width: give it), positions = 1024 (GPT-2) or none (Llama). `from_config` reads either model's
    config.
    """

    layers: int
    hidden: int
    heads: int
    vocab: int = 50257
    positions: int | None = None
    pad_vocab_multiple: int = 64  # model_zoo pads the embedding rows to a multiple of 64
    family: str = "gpt2"
    kv_heads: int | None = None
    head_dim: int | None = None
    ffn: int | None = None
    qkv_bias: bool = False
    qk_norm: bool = False
    tied: bool = True

    def __post_init__(self) -> None:
        _check_choice("family", self.family, FAMILIES)
        if self.head_dim is None and self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads}), or give head_dim")
        if self.family == "llama":
            if self.ffn is None:
                raise ValueError("a llama-family ModelShape needs ffn, the SwiGLU width (intermediate_size)")
            if self.positions:
                raise ValueError(f"a llama-family decoder has no position table (RoPE), got positions="
                                 f"{self.positions}; leave positions unset")
        else:
            gpt2 = dict(kv_heads=(self.kv_heads, None, self.heads), head_dim=(self.head_dim, None,
                        self.hidden // self.heads), ffn=(self.ffn, None, 4 * self.hidden),
                        qkv_bias=(self.qkv_bias, False), qk_norm=(self.qk_norm, False), tied=(self.tied, True))
            for name, (value, *allowed) in gpt2.items():
                if value not in allowed:
                    raise ValueError(f"{name}={value!r} is a llama-family option; GPT-2's block has "
                                     f"{name}={allowed[-1]!r} (pass family='llama' for a Llama-family shape)")
        if self.heads % self.n_kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads}): each k/v head "
                             f"serves a group of q heads")

    # -- the widths the formulas use ---------------------------------------------------------------------

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def q_width(self) -> int:
        """q_proj's (and o_proj's input) width: heads x head_dim (GPT-2: hidden)."""
        return self.heads * (self.head_dim or self.hidden // self.heads)

    @property
    def kv_width(self) -> int:
        """k_proj's and v_proj's width: kv_heads x head_dim (narrower than q under grouped-query attention)."""
        return self.n_kv_heads * (self.head_dim or self.hidden // self.heads)

    @property
    def ffn_width(self) -> int:
        """The MLP's hidden width: 4h (GPT-2), intermediate_size (Llama's SwiGLU)."""
        return self.ffn or 4 * self.hidden

    @property
    def position_rows(self) -> int:
        """Learned position-embedding rows: GPT-2's wpe (1024 unless given); none under RoPE."""
        return 0 if self.family == "llama" else (1024 if self.positions is None else self.positions)

    @property
    def padded_vocab(self) -> int:
        m = self.pad_vocab_multiple
        return (self.vocab + m - 1) // m * m

    @property
    def layer_params(self) -> int:
        """Parameters of one block: GPT-2 12h^2 + 13h; Llama 2h (norms) + h(2q + 2kv) (q, k, v, o) + 3hf (SwiGLU)
        [+ q + 2kv biases] [+ 2 head_dim qk-norms]."""
        return sum(n for _, n in self._block())

    @property
    def num_params(self) -> int:
        """Parameters counted once: the embedding (padded rows), an untied head, the positions, the blocks, the final
        norm (GPT-2: wte + wpe + L x (12h^2 + 13h) + 2h)."""
        return sum(n for _, n in self.param_numels())

    @property
    def largest_param(self) -> int:
        return max(self.padded_vocab * self.hidden, self.ffn_width * self.hidden, self.q_width * self.hidden)

    def _block(self) -> list[tuple[str, int]]:
        """(owning module within a block, numel) of each parameter of one block, in registration order."""
        h, q, kv, f = self.hidden, self.q_width, self.kv_width, self.ffn_width
        if self.family == "gpt2":
            return [("ln_1", h), ("ln_1", h), ("attn.c_attn", 3 * h * h), ("attn.c_attn", 3 * h),
                    ("attn.c_proj", h * h), ("attn.c_proj", h), ("ln_2", h), ("ln_2", h),
                    ("mlp.c_fc", f * h), ("mlp.c_fc", f), ("mlp.c_proj", f * h), ("mlp.c_proj", h)]
        out = [("input_layernorm", h)]
        for proj, width in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            out += [(f"self_attn.{proj}", width * h)] + ([(f"self_attn.{proj}", width)] if self.qkv_bias else [])
        out += [("self_attn.o_proj", h * q)]
        if self.qk_norm:
            d = q // self.heads
            out += [("self_attn.q_norm", d), ("self_attn.k_norm", d)]
        return out + [("post_attention_layernorm", h), ("mlp.gate_proj", f * h), ("mlp.up_proj", f * h),
                      ("mlp.down_proj", h * f)]

    @property
    def embedding(self) -> str:
        """The token embedding's module name, whose weight a tied head reads."""
        return "wte" if self.family == "gpt2" else "model.embed_tokens"

    def block_name(self, i: int) -> str:
        return f"h.{i}" if self.family == "gpt2" else f"model.layers.{i}"

    def param_numels(self) -> list[tuple[str, int]]:
        """(owning module, numel) of each parameter in model_zoo's (and Hugging Face's) registration order, the
        order chunks are packed in. GPT-2: wte, wpe, the 12 of each block `h.i` (owned by `h.i.ln_1`,
        `h.i.attn.c_attn`, `h.i.attn.c_proj`, `h.i.ln_2`, `h.i.mlp.c_fc`, `h.i.mlp.c_proj`, a weight and a bias
        each), ln_f's 2 (the head is wte's weight). Llama: model.embed_tokens, each block `model.layers.i`'s
        input_layernorm, self_attn.{q,k,v}_proj (weight, then a bias with qkv_bias), self_attn.o_proj,
        self_attn.{q,k}_norm (qk_norm), post_attention_layernorm, mlp.{gate,up,down}_proj, then model.norm and,
        untied, lm_head (tied, the head owns the embedding's weight and registers nothing)."""
        h = self.hidden
        if self.family == "gpt2":
            out = [("wte", self.padded_vocab * h), ("wpe", self.position_rows * h)]
        else:
            out = [("model.embed_tokens", self.padded_vocab * h)]
        block = self._block()
        for i in range(self.layers):
            out += [(f"{self.block_name(i)}.{module}", n) for module, n in block]
        if self.family == "gpt2":
            return out + [("ln_f", h), ("ln_f", h)]
        return out + [("model.norm", h)] + ([] if self.tied else [("lm_head", self.padded_vocab * h)])

    def forward_modules(self) -> list[str]:
        """The modules owning parameters in the order their forwards run, each once, then the head: registration
        order but for a Llama block's q_norm/k_norm, which run inside self_attn before o_proj. A tied head is
        listed as "lm_head" though it registers no parameter of its own."""
        order = list(dict.fromkeys(owner for owner, _ in self.param_numels()))
        if self.family == "llama" and self.qk_norm:
            for i in range(self.layers):
                o_proj = f"{self.block_name(i)}.self_attn.o_proj"
                order.remove(o_proj)
                order.insert(order.index(f"{self.block_name(i)}.self_attn.k_norm") + 1, o_proj)
        return order + (["lm_head"] if self.tied else [])

    @classmethod
    def from_config(cls, config: Any) -> ModelShape | None:
        """The shape of a model_zoo GPTConfig (n_layer, n_embd, ...) or LlamaConfig (Hugging Face's field names:
        num_hidden_layers, hidden_size, num_key_value_heads, ...), read by duck typing; None for any other config."""
        c = config
        if all(hasattr(c, k) for k in ("n_layer", "n_embd", "n_head", "vocab_size")):
            return cls(layers=c.n_layer, hidden=c.n_embd, heads=c.n_head, vocab=c.vocab_size,
                       positions=getattr(c, "max_position_embeddings", 1024),
                       pad_vocab_multiple=getattr(c, "pad_vocab_multiple", 1))
        if not all(hasattr(c, k) for k in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                                           "intermediate_size", "vocab_size")):
            return None
        heads = c.num_attention_heads
        head_dim = getattr(c, "head_dim", None)
        return cls(layers=c.num_hidden_layers, hidden=c.hidden_size, heads=heads, vocab=c.vocab_size,
                   pad_vocab_multiple=getattr(c, "pad_vocab_multiple", 1), family="llama",
                   kv_heads=getattr(c, "num_key_value_heads", None) or heads,
                   head_dim=None if head_dim is None or heads * head_dim == c.hidden_size else head_dim,
                   ffn=c.intermediate_size, qkv_bias=bool(getattr(c, "qkv_bias", False)),
                   qk_norm=bool(getattr(c, "qk_norm", False)),
                   tied=bool(getattr(c, "tie_word_embeddings", False)))


def _check_choice(name: str, value: str, valid) -> None:
    if value not in valid:
        raise ValueError(f"{name}={value!r} is not valid; choose one of {', '.join(map(str, valid))}")


def grad_crosses_once(stage: int, accumulation: int) -> bool:
    """Whether an offloaded step's gradient reaches the host in one crossing per chunk, the reduced shard as it
    is: stages 0-1 reduce once per step, stages 2-3 every micro-step (so once at accumulation 1)."""
    return stage <= 1 or accumulation == 1


def step_grad_itemsize(stage: int, accumulation: int, compute_itemsize: int, kept_as_crossed: bool = True) -> int:
    """Bytes per element of an offloaded chunk's reduced gradient shard held on the host from backward to the step:
    the compute dtype's when its one crossing (`grad_crosses_once`) is kept as it crossed (zero/grad_path.py,
    GradPath.keeps_as_crossed), else an fp32 shard's. `model_state_bytes` and `Engine.host_bytes` both read it."""
    return compute_itemsize if kept_as_crossed and grad_crosses_once(stage, accumulation) else 4


def model_state_bytes(num_params: int, stage: int, world_size: int = 1, precision: str = "bf16",
                      offload_optimizer: str = "none", offload_param: str = "none",
                      optimizer_bytes_per_param: int = 8, accumulation: int = 1,
                      device_budget: int = 0) -> dict[str, dict[str, int]]:
    """Peak model-state bytes on ONE rank, as our engine holds them (chunk padding ignored).

    ZeRO paper (Rajbhandari et al. 2020, Fig. 1; mixed precision + Adam, K=12): 16Psi, 4Psi+12Psi/N,
    2Psi+14Psi/N, 16Psi/N for stages 0-3. Our engine differs in one place: reduced gradients land in an
    **fp32** grad shard next to the master (4 B/param/N, not 2), so stage 2 is 2Psi+16Psi/N and stage 3
    is 18Psi/N in bf16/fp16; stages 0/1 keep full compute-dtype grads while accumulating and convert
    them chunk by chunk into fp32 shards at the boundary, so their grad peak is max(c Psi, 4 Psi/N_opt)
    per home (stage 0 mixed: 18Psi; stage 1: 4Psi+12Psi/N for N >= 2). In fp32 the master *is* the
    param shard when the params rest where the optimizer lives (16Psi ... 16Psi/N; stage 3 with param and
    optimizer offload: 16Psi/N on the host); otherwise a separate fp32 master is kept where the optimizer runs.
    With the optimizer offloaded, a step's gradient that crosses to the host once (stages 0-1, or accumulation
    1) is kept there as it crossed, in the compute dtype: stage 3 with param and optimizer offload in bf16 is
    2 + 2 + 4 + 8 = 16Psi/N on the host, the paper's figure.

    Args:
        num_params: Psi, trainable parameters (tied weights counted once).
        stage: ZeRO stage 0-3.  world_size: N, data-parallel ranks.
        precision: "fp32" | "bf16" | "fp16" (params/grads compute dtype; masters and Adam are fp32).
        offload_optimizer: "none" | "cpu" | "disk": where master + optimizer state (and grad shards: host for
            both cpu and disk) live. Offloaded, a step's gradient that crosses to the host once stays there in
            the compute dtype (bf16: 2 B/param/N, not 4) until the step.
        offload_param: "none" | "cpu": where stage-3 param shards rest between uses.
        optimizer_bytes_per_param: 8 for Adam (exp_avg + exp_avg_sq in fp32), 4 for SGD+momentum.
        accumulation: micro-steps per optimizer step. Above 1 at stages 2-3 with the optimizer offloaded and the
            params on the device, the reduced gradients accumulate in an fp32 shard on the device and cross to
            the host once per step (4 B/param/N more on the device).
        device_budget: with param offload, bytes of parameter shards kept on the device instead of the host
            (zero.offload_param.device_budget as bytes; whole chunks, so at most the shard): they move from the
            host's params to the device's. When it holds the whole shard, the gradients accumulate on the device as
            without param offload.
    Returns:
        {"params"|"grads"|"master"|"optimizer": {"device"|"host"|"disk": bytes}} -- the same layout as
        `engine.memory_stats()`.

    Example:
        >>> b = model_state_bytes(10**9, stage=3, world_size=8, precision="bf16")
        >>> sum(b[c]["device"] for c in b) == 18 * 10**9 // 8
        True
    """
    _check_choice("stage", stage, (0, 1, 2, 3))
    _check_choice("precision", precision, tuple(DTYPES))
    _check_choice("offload_optimizer", offload_optimizer, tuple(OFFLOAD_HOMES))
    _check_choice("offload_param", offload_param, ("none", "cpu"))
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if offload_param != "none" and stage != 3:
        raise ValueError(f"offload_param needs stage 3, got stage {stage}; use --stage 3 or --offload-param none")
    c = DTYPES[precision].itemsize
    psi = num_params
    n_opt = 1 if stage == 0 else world_size  # master/optimizer/grad shards: 1/N from stage 1 on

    def per_rank(nbytes_per_param: int, shards: int) -> int:
        return math.ceil(psi / shards) * nbytes_per_param

    out = {cat: dict.fromkeys(HOMES, 0) for cat in CATEGORIES}
    optim_home = OFFLOAD_HOMES[offload_optimizer]
    grad_home = "device" if optim_home == "device" else "host"
    param_home = OFFLOAD_HOMES[offload_param]

    # params: full compute-dtype copy at stages 0-2; only this rank's shard at stage 3
    param_bytes = per_rank(c, world_size if stage == 3 else 1)
    kept = min(device_budget, param_bytes) if param_home == "host" else 0  # shards the device budget keeps
    out["params"][param_home] += param_bytes - kept
    out["params"]["device"] += kept
    params_on_device = param_home == "device" or kept == param_bytes
    # grads: fp32 shards at every stage (reduced grads land there) + full compute-dtype grads at
    # stages 0/1 (held while accumulating); the two never peak together within one home
    shard_grads = per_rank(4, n_opt)
    full_grads = per_rank(c, 1) if stage <= 1 else 0
    if grad_home == "device":
        out["grads"]["device"] = max(full_grads, shard_grads)
    else:
        # the step's one crossing is kept on the host as it crossed, in the compute dtype; a sum over micro-steps: fp32
        crossed = step_grad_itemsize(stage, accumulation, c)
        out["grads"]["device"], out["grads"]["host"] = full_grads, per_rank(crossed, n_opt)
        if stage >= 2 and params_on_device and accumulation > 1:  # the device-side sum (issue 29)
            out["grads"]["device"] = shard_grads
    # master: aliased to the param shard in fp32 when the params rest where the optimizer lives (both on the
    # device, or both on the host: stage 3 with param and optimizer offload); apart otherwise
    if not (precision == "fp32" and optim_home == param_home):
        out["master"][optim_home] += per_rank(4, n_opt)
    out["optimizer"][optim_home] += per_rank(optimizer_bytes_per_param, n_opt)
    return out


def zero_paper_bytes(num_params: int, stage: int, world_size: int) -> tuple[str, int]:
    """The ZeRO paper's per-rank model states (mixed precision, Adam, K=12) for reference."""
    psi, n = num_params, world_size
    return [("16Psi", 16 * psi), ("4Psi+12Psi/N", 4 * psi + 12 * psi // n),
            ("2Psi+14Psi/N", 2 * psi + 14 * psi // n), ("16Psi/N", 16 * psi // n)][stage]


def activation_bytes(shape: ModelShape, seq_len: int, batch: int, precision: str = "bf16",
                     checkpoint: bool = False, flash: bool = True, dropout: bool = False,
                     loss_chunk: int = 0) -> dict[str, int]:
    """Activation bytes saved for backward on one rank (no tensor/sequence parallelism).

    GPT-2: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", §4.1:
    per layer s*b*h*(34 + 5*a*s/h) bytes with 2-byte activations and 1-byte dropout masks, i.e.
    16e*sbh + (2e)*a*s^2*b + masks (2sbh + a*s^2*b) for element size e. SDPA/flash attention saves no
    s x s scores (only a tiny logsumexp), so the s^2 term drops (`flash=True`, what model_zoo uses);
    with dropout 0 (model_zoo's default) there are no masks.

    Llama: the same count (every tensor autograd keeps for backward) over model_zoo/llama.py's DecoderLayer, with
    q = heads x head_dim, kv = kv_heads x head_dim, f = ffn, a = heads, g = kv_heads:
      - each of the 2 RMSNorms, computed unfused in fp32 as Hugging Face's: its input in fp32 (4 B per element
        even in bf16), the normalized value and the output (the next projections' input) in the compute dtype,
        (4 + 2e)*sbh, and the fp32 rsqrt, 4sb;
      - attention: the rotated q, e*sbq; k and v at the kv width, 2e*sb*kv (grouped-query attention keeps the
        g heads: SDPA takes them as they are, enable_gqa); the output, o_proj's input, e*sbq; the logsumexp,
        4sba; with qk_norm, the per-head norms' (4 + e)*sb*(q + kv) + 4sb*(a + g);
      - SwiGLU: gate's output (silu's input), silu's and up's outputs (the product's), the product (down's input),
        4e*sbf, where GPT-2's 4h GELU MLP keeps 9e*sbh.
    Llama-3-8B in bf16 (q = h, kv = h/4, f = 3.5h): 16 + 5 + 28 = 49 sbh per layer, GPT-2's 32. Eager
    attention (`flash=False`) adds the s x s softmax (and its dropout mask) as for GPT-2; with flash the
    attention dropout keeps no mask (the kernel redraws it), and a Llama has no other dropout.

    Full per-block checkpointing keeps only each block's input (e*sbh per layer) plus, at the peak, the larger of
    one block's activations while it is recomputed and the loss's backward (below): the loss runs its backward
    first and frees it before any block is recomputed, all but what it hands on, held through the recompute: the
    hidden states' gradient, e*sbh, and a tied head's weight gradient, e*V*h, which autograd sums with the
    embedding's only at the end of backward (2L-128, z0 4 x 1 chunked loss: 14.2 MiB measured with every allocation
    whole; 12.6 predicted without it, 13.7 with). (The H200's GPT-2 XL offload rows, ea4be00: allocator peaks
    14.71 and 49.57 GiB at 16k and 64k tokens per step; predicted with the larger 14.65 and 49.43, with the sum
    15.43 and 52.56, the CUDA context's 1 GiB left out.) Outside the blocks: GPT-2's embedding output, e*sbh; a
    Llama's RoPE cos and sin, 2e*s*head_dim (shared by the blocks; the embedding keeps only the ids). The plain
    loss peaks at the start of backward, with every activation still held: the fp32 log-probs it saved, nll_loss's
    dense fp32 gradient and log_softmax's fp32 gradient of the logits, s*b*V*12 (its forward holds less:
    compute-dtype logits, their fp32 copy and the log-probs, e + 8; in fp32 8, the copy being the logits;
    tests/test_memory_model.py measures both), plus a Llama's final RMSNorm. The chunked loss
    (model_zoo.loss.chunked_cross_entropy, at most `loss_chunk` tokens a chunk and at least LOSS_MIN_CHUNKS chunks:
    `loss_chunk_tokens`) computes the gradients of the hidden states and of the head's weight (padded rows) in its
    forward and holds them until backward, in the compute dtype (fp32 under fp16); beside them one chunk's fp32
    logits over the padded vocabulary (the padding's at -inf), and in bf16/fp16 its logits (or their gradient) in
    the compute dtype, 4 + e per chunk logit (4 in fp32); its backward scales the two in place (fp16: and casts
    them) (tests/test_memory_model.py measures it).

    Returns: dict(per_layer, layers, embeddings, logits, total, after_loss, grads_room) in bytes; `logits`: the
    loss's peak; `grads_room`: the activations gradients made at accumulation 1 take the place of (all of them;
    checkpointed, what was above a recomputed block beside what the loss handed on, grads_activations_overlap);
    `after_loss`: the most held from the moment the first parameter gradient is made, when the first chunk's
    gradient buffer is made whole (the plain loss: its backward done, the logits' gradient in the compute dtype left;
    the chunked loss: its two gradients; checkpointed, or a block's recompute beside what the loss handed on).
    """
    e = DTYPES[precision].itemsize
    s, b, a, L = seq_len, batch, shape.heads, shape.layers
    sb, sbh = s * b, s * b * shape.hidden
    if shape.family == "gpt2":
        per_layer = 16 * e * sbh + (2 * sbh if dropout else 0)
        embeddings = e * sbh + (sbh if dropout else 0)
        head = 0
    else:
        q, kv, f, g = shape.q_width, shape.kv_width, shape.ffn_width, shape.n_kv_heads
        norms = 2 * ((4 + 2 * e) * sbh + 4 * sb)
        attention = e * sb * q + 2 * e * sb * kv + e * sb * q + 4 * sb * a
        if shape.qk_norm:
            attention += (4 + e) * sb * (q + kv) + 4 * sb * (a + g)
        per_layer = norms + attention + 4 * e * sb * f
        embeddings = 2 * e * s * (q // a)
        head = (4 + 2 * e) * sbh + 4 * sb  # the final norm
    if not flash:
        per_layer += (2 * e + (1 if dropout else 0)) * a * s * s * b
    layers = L * e * sbh + per_layer if checkpoint else L * per_layer
    if loss_chunk > 0:
        grads = (sb + shape.padded_vocab) * shape.hidden
        saved = grads * (4 if precision == "fp16" else e)
        one_chunk = loss_chunk_tokens(sb, loss_chunk) * shape.padded_vocab * (4 + (e if e != 4 else 0))
        cast = grads * e if precision == "fp16" else 0  # backward: the fp32 gradients scaled in place, then cast
        logits, left = head + saved + max(one_chunk, cast), head + saved
    else:
        logits, left = head + sb * shape.vocab * 12, head + sb * shape.vocab * e

    def peak(loss: int) -> int:
        return (layers - per_layer + max(per_layer, loss) if checkpoint else layers + loss) + embeddings
    total, after_loss = peak(logits), peak(left)
    grads_room = total
    if checkpoint:
        # a block is recomputed after the gradients before it exist, beside what the loss's backward handed on and
        # holds to the end: the hidden states' gradient and a tied head's weight gradient, which autograd sums with
        # the embedding's only when that backward is done; gradients take the place of only what was above that
        recompute = layers + embeddings + (sb + (shape.padded_vocab if shape.tied else 0)) * shape.hidden * e
        total, after_loss = max(total, recompute), max(after_loss, recompute)
        grads_room = total - recompute
    return dict(per_layer=per_layer, layers=layers, embeddings=embeddings, logits=logits, total=total,
                after_loss=after_loss, grads_room=grads_room)


def loss_chunk_tokens(tokens: int, chunk_size: int) -> int:
    """Tokens per chunk of the chunked loss: at most `chunk_size`, and at most 1/LOSS_MIN_CHUNKS of the tokens
    (model_zoo/loss.py's chunk_tokens)."""
    return max(1, min(chunk_size, -(-tokens // LOSS_MIN_CHUNKS)))


def chunk_of_params(numels: list[int], element_size: int, bucket_mb: float) -> list[int]:
    """The chunk index of each parameter, packed in order as the engine packs one param group
    (config/strategy.py's chunk_groups: BucketTensorShardStrategy(bucket_mb); bucket_mb 0: TensorShardStrategy, one
    per chunk).

    Example:
        >>> chunk_of_params([3, 3, 3, 9], element_size=1, bucket_mb=8 / 2**20)  # 8-byte buckets
        [0, 0, 1, 2]
    """
    strategy = BucketTensorShardStrategy(bucket_mb) if bucket_mb > 0 else TensorShardStrategy()
    out = [0] * len(numels)
    for index, group in enumerate(chunk_groups(strategy, numels, element_size)):
        for i in group:
            out[i] = index
    return out


@functools.lru_cache(maxsize=256)  # a planner asks again for each candidate of one shape
def gather_peak(shape: ModelShape, precision: str, prefetch: int, bucket_mb: float, world_size: int = 1,
                per_block: bool = False) -> tuple[int, int]:
    """Stage 3: the most chunks, and the most elements, that one rank holds gathered at once.

    Packs the shape's parameters into chunks as the engine does (`chunk_of_params`: one param group, so a chunk
    may hold parameters of several modules, or the end of one block and the start of the next), then walks the
    hooked modules as zero/gather_hooks.py's Stage3GatherHooks does, forward and backward (the reverse). The
    hooked modules are those owning parameters in the order they run (`ModelShape.forward_modules`; GPT-2: wte,
    wpe, each block's ln_1, attn c_attn, attn c_proj, ln_2, mlp c_fc, mlp c_proj, then ln_f and the head, which
    owns wte's weight; Llama: embed_tokens, each block's norms and projections, the final norm, the head, tied or
    not), or with `per_block` (`compile = True`, `gather_per_block`) each block whole in place of its modules. A
    module gathers its chunks and
    the next `prefetch` gather units of the recorded order. A unit is one chunk in eager runs (listed once per
    module that gathers it, so a prefetch may land on a chunk held already) and one module's chunks per block.
    Backward records a chunk at its first use only, and a module with no new chunk gathers nothing. A chunk stays
    gathered until the last module using it in the pass has run (forward: its remaining uses; backward: its last
    gradient), so the tied embedding/head chunk is held from the embedding to the head and through backward; the
    end of forward keeps the chunks of backward's first `prefetch` units. Chunks are counted padded to a multiple
    of `world_size`. Assumes every prefetch hits (the recorded order repeats: from the second step on).

    Returns: (chunks, elements), each the maximum over forward and backward.
    Example:
        >>> shape = ModelShape(layers=2, hidden=64, heads=2, vocab=128, positions=16)
        >>> gather_peak(shape, "fp32", 2, 0), gather_peak(shape, "fp32", 2, 0, per_block=True)
        ((5, 41280), (27, 109184))
    """
    c = DTYPES[precision].itemsize
    params = shape.param_numels()
    chunk_of = chunk_of_params([n for _, n in params], c, bucket_mb)
    sizes: dict[int, int] = {}
    for (_, n), chunk in zip(params, chunk_of):
        sizes[chunk] = sizes.get(chunk, 0) + n
    padded = {chunk: math.ceil(n / world_size) * world_size for chunk, n in sizes.items()}
    owners: dict[str, set[int]] = {}  # each module owning parameters, with its chunks
    for (module, _), chunk in zip(params, chunk_of):
        owners.setdefault(module, set()).add(chunk)
    if shape.tied:
        owners["lm_head"] = owners[shape.embedding]  # the head reads the embedding's weight
    blocks = shape.block_name(0).rpartition(".")[0] + "."  # "h." or "model.layers."
    hooked: dict[str, set[int]] = {}  # the hooked modules in forward order, each with its chunks
    for module in shape.forward_modules():
        unit = module
        if per_block and module.startswith(blocks):  # h.3.attn.c_attn -> h.3
            unit = blocks + module[len(blocks):].split(".")[0]
        hooked.setdefault(unit, set()).update(owners[module])
    forward = [sorted(chunks) for chunks in hooked.values()]
    backward = forward[::-1]
    # what each module gathers and records: forward, all of its chunks; backward, those not gathered yet in it
    seen: set[int] = set()
    backward_new = []
    for chunks in backward:
        backward_new.append([ch for ch in chunks if ch not in seen])
        seen.update(chunks)

    def units(gathered: list[int]) -> list[tuple[int, ...]]:  # what a gather adds to the recorded order
        if not gathered:
            return []
        return [tuple(gathered)] if per_block else [(ch,) for ch in gathered]

    kept = {ch for unit in [u for new in backward_new for u in units(new)][:prefetch] for ch in unit}
    most_chunks = most_elements = 0
    for modules, gathers, keep in ((forward, forward, kept), (backward, backward_new, set())):
        order = [u for gathered in gathers for u in units(gathered)]
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for i, chunks in enumerate(modules):
            for ch in chunks:
                first.setdefault(ch, i)
                last[ch] = i
        pos = 0  # units recorded so far
        for i, (chunks, gathered) in enumerate(zip(modules, gathers)):
            if not gathered:  # no gather: what is held only shrinks
                continue
            pos += len(units(gathered))
            held = set(chunks).union(*order[pos : pos + prefetch])
            held |= {ch for ch in first if first[ch] < i and (last[ch] > i or ch in keep)}
            most_chunks = max(most_chunks, len(held))
            most_elements = max(most_elements, sum(padded[ch] for ch in held))
    return most_chunks, most_elements


@functools.lru_cache(maxsize=256)
def largest_chunk(shape: ModelShape, element_size: int, bucket_mb: float) -> int:
    """Elements of the largest chunk the engine packs for this shape (`chunk_of_params`): at most a bucket, or one
    parameter larger than a bucket (the embedding), and no more than the whole model (a small model is one chunk
    far under its bucket size)."""
    return chunk_numels(shape, element_size, bucket_mb)[0]


@functools.lru_cache(maxsize=256)
def chunk_numels(shape: ModelShape, element_size: int, bucket_mb: float) -> tuple[int, ...]:
    """Elements of each chunk the engine packs for this shape (`chunk_of_params`), largest first."""
    sizes: dict[int, int] = {}
    numels = [n for _, n in shape.param_numels()]
    for n, chunk in zip(numels, chunk_of_params(numels, element_size, bucket_mb)):
        sizes[chunk] = sizes.get(chunk, 0) + n
    return tuple(sorted(sizes.values(), reverse=True))


def buffer_bytes(shape: ModelShape, stage: int, world_size: int, precision: str, offload_optimizer: str,
                 prefetch: int = 2, bucket_mb: float = 25.0, gather_per_block: bool = False,
                 offload_param: str | None = None, accumulation: int = 1) -> dict[str, int]:
    """Chunk buffers in flight on one rank, by home.

    A chunk holds up to `bucket_mb` MiB of params, or one parameter if larger (the embedding), and no more than the
    model (`largest_chunk`). Stage 3 holds the chunks `gather_peak` counts (none at one rank whose shards rest on
    the device, `offload_param="none"`: each shard is its whole chunk), at their real sizes in compute dtype: a
    module's, the next `prefetch` chunks of the recorded order (with `gather_per_block`, `compile = True`: a whole
    block's and the next `prefetch` modules'), and those used before and after (the tied embedding's). Stages 2/3
    keep about two full-size grad chunks in flight (one filling, one reducing; `grad_chunks_in_flight`). Disk
    offload streams master + Adam state of the current and the read-ahead chunk shard (12 B/param) through host RAM.
    """
    if prefetch < 0:  # as zero.prefetch is checked
        raise ValueError(f"prefetch must be an int >= 0 (0 = no prefetch), got {prefetch!r}")
    c = DTYPES[precision].itemsize
    chunk_numel = largest_chunk(shape, c, bucket_mb)
    out = dict.fromkeys(HOMES, 0)
    out["device"] += gathered_bytes(shape, stage, world_size, precision, prefetch, bucket_mb, gather_per_block,
                                    offload_param)
    out["device"] += grad_chunks_in_flight(shape, stage, world_size, precision, offload_optimizer, bucket_mb,
                                           accumulation)
    if offload_optimizer == "disk":
        out["host"] += 2 * math.ceil(chunk_numel / (1 if stage == 0 else world_size)) * 12
    return out


def gathered_bytes(shape: ModelShape, stage: int, world_size: int, precision: str, prefetch: int = 2,
                   bucket_mb: float = 25.0, gather_per_block: bool = False, offload_param: str | None = None) -> int:
    """Stage 3's gathered chunks on the device at their most (`gather_peak`, compute dtype); none at one rank whose
    shards rest on the device (each chunk's shard is its `full`, Chunk.gather; offload_param None: not known,
    counted as gathered)."""
    if stage != 3 or (world_size == 1 and offload_param == "none"):
        return 0
    elements = gather_peak(shape, precision, prefetch, bucket_mb, world_size, gather_per_block)[1]
    return elements * DTYPES[precision].itemsize


def grad_chunks_in_flight(shape: ModelShape, stage: int, world_size: int, precision: str, offload_optimizer: str,
                          bucket_mb: float = 25.0, accumulation: int = 1) -> int:
    """Stages 2-3: the local gradient buffers of the two largest chunks (one filling, one reducing; one when the
    model is one chunk), compute dtype. None at one rank, accumulation 1, fp32, gradients on the device: the
    reduced buffer is the chunk's whole gradient and becomes its fp32 grad shard as it is (zero/grad_path.py,
    GradPath._add), which `model_state_bytes` counts (bench/plan_memory.py, 8L-384 z3 4 x 1: measured 237 MiB,
    279 with them counted; 4L-256, one chunk, z3 1 x 4: 72.5 MiB, 89.8 with two counted)."""
    if stage < 2:
        return 0
    if world_size == 1 and accumulation == 1 and precision == "fp32" and offload_optimizer == "none":
        return 0
    c = DTYPES[precision].itemsize
    return sum(chunk_numels(shape, c, bucket_mb)[:2]) * c


def estimate(shape: ModelShape, stage: int, world_size: int = 1, precision: str = "bf16",
             offload_optimizer: str = "none", offload_param: str = "none", seq_len: int = 1024,
             batch: int = 1, checkpoint: bool = False, flash: bool = True, dropout: bool = False,
             prefetch: int = 2, bucket_mb: float = 25.0, gpu_overhead: int = 2**30, accumulation: int = 1,
             optimizer_bytes_per_param: int = 8, gather_per_block: bool = False, loss_chunk: int = 0,
             device_budget: int = 0, on_gpu: bool = True) -> dict:
    """Everything on one rank: model states, activations, buffers, totals per home, host RAM held (bytes).

    `optimizer_bytes_per_param`: 8 for Adam's moments in fp32, 4 in bf16 (zero.offload_optimizer.state_dtype).
    `gather_per_block`: stage 3 gathers each block whole (`compile = True`; see `buffer_bytes`).
    `loss_chunk`: tokens per chunk of the chunked loss (`chunked_loss = True`, `loss_chunk_size`); 0: the plain loss.
    `device_budget`: with param offload, bytes of parameter shards kept on the device (`model_state_bytes`).
    `on_gpu`: False for a CPU run, whose device is host RAM too: "host_ram" is then every home but disk, the
    bytes both homes share counted once (`cpu_run_shared_bytes`).
    Returns: dict(num_params, model_states, activations, buffers, gpu_overhead, overlap, totals (per home, what a
    GPU run holds), shared (a CPU run's bytes in both homes' totals), host_ram (this rank's host RAM),
    speculative_spare (host bytes a GPU run adds where it has room, `speculative_spare_bytes`)).
    """
    states = model_state_bytes(shape.num_params, stage, world_size, precision, offload_optimizer, offload_param,
                               optimizer_bytes_per_param, accumulation, device_budget)
    acts = activation_bytes(shape, seq_len, batch, precision, checkpoint, flash, dropout, loss_chunk)
    buffers = buffer_bytes(shape, stage, world_size, precision, offload_optimizer, prefetch, bucket_mb,
                           gather_per_block, offload_param, accumulation)
    in_flight = grad_chunks_in_flight(shape, stage, world_size, precision, offload_optimizer, bucket_mb, accumulation)
    # the first chunk backward fills (the head's: the largest) is made whole beside the activations, still all
    # there, but not beside the loss's backward peak, gone before that first gradient is made: above accumulation 1
    # here; at 1 a buffer in flight is counted beside everything (the H200's rows fit so), else overlap_at_one
    head_chunk = largest_chunk(shape, DTYPES[precision].itemsize, bucket_mb) * DTYPES[precision].itemsize
    beside = min(in_flight, head_chunk)
    overlap = grads_activations_overlap(states, acts, accumulation, in_flight - beside, 0 if beside else head_chunk)
    loss_gone = min(beside, acts["total"] - acts["after_loss"]) if accumulation != 1 else 0
    overlap += loss_gone
    totals = {h: sum(states[cat][h] for cat in CATEGORIES) + buffers[h] for h in HOMES}
    totals["device"] += acts["total"] + gpu_overhead - overlap
    shared = host_ram = 0
    if on_gpu:
        host_ram = totals["host"]
    else:
        gathered = gathered_bytes(shape, stage, world_size, precision, prefetch, bucket_mb, gather_per_block,
                                  offload_param)
        shared_by = cpu_run_shared_bytes(states, stage, world_size, accumulation, in_flight, gathered)
        shared = sum(shared_by.values())
        # the gradients backward makes, held or in flight, each once: at accumulation 1 they overlap the
        # activations as on the device, all in RAM (the head's chunk too: held beside them, as on the device, the
        # CPU's measured peaks are overshot, 5.5M Llama at 2 ranks +11%, tests/test_memory_model.py)
        grads = states["grads"]
        grads_in_ram = grads["device"] + grads["host"] + in_flight - shared_by["grads"]
        cpu_overlap = overlap_at_one(grads_in_ram, acts, head_chunk) if accumulation == 1 else 0
        host_ram = totals["host"] + totals["device"] - gpu_overhead + overlap - loss_gone - shared - cpu_overlap
    spare = speculative_spare_bytes(shape.num_params, stage, world_size, precision, offload_optimizer, states,
                                    accumulation, optimizer_bytes_per_param) if on_gpu else 0
    return dict(num_params=shape.num_params, model_states=states, activations=acts, buffers=buffers,
                gpu_overhead=gpu_overhead, overlap=overlap, totals=totals, shared=shared, host_ram=host_ram,
                speculative_spare=spare)


def speculative_spare_bytes(num_params: int, stage: int, world_size: int, precision: str, offload_optimizer: str,
                            states: dict[str, dict[str, int]], accumulation: int = 1,
                            optimizer_bytes_per_param: int = 8) -> int:
    """Host bytes of the step ahead of the norm's spare master and moments (a GPU run, masters on the host, not
    fp16, the step's gradient crossing once: planner/engine_plan.py's host_step_speculates), taken at build only
    where half the available host RAM covers it. A speed-up, not a need: `host_ram` leaves it out and `estimate`
    reports it apart (docs/DESIGN.md §4: 12 bytes/param, 8 with bf16 moments)."""
    if offload_optimizer != "cpu" or precision == "fp16":
        return 0
    device_sum = stage >= 2 and states["params"]["host"] == 0 and accumulation > 1
    if not (grad_crosses_once(stage, accumulation) or device_sum):
        return 0
    return math.ceil(num_params / (1 if stage == 0 else world_size)) * (4 + optimizer_bytes_per_param)


def cpu_run_shared_bytes(states: dict[str, dict[str, int]], stage: int, world_size: int, accumulation: int,
                         grads_in_flight: int, gathered: int) -> dict[str, int]:
    """Bytes a CPU run holds once that `totals` counts in both homes: its "device" is host RAM, so the engine
    copies nothing between the homes (zero/offload.py's start_d2h returns the tensor; Chunk.gather at one rank
    takes the shard as `full`; GradPath._add takes a reduced fp32 shard as the grad shard).

    - The host's gradient shards are the device's reduced gradients when they cross once as they are: stage 0's
      (reduced in place), a device-side sum crossing at the step (stages 2-3, parameters on the device), and at one
      rank any stage's at accumulation 1 (the reduce returns the chunk's buffer, a chunk in flight). Above one rank
      a reduce-scatter writes a new shard, which is then the host's, beside the device's full buffer.
    - At one rank with the parameters offloaded, the gathered chunks are the host's param shards.
    Measured (bench/plan_memory.py, 8L-384, 36 plans): without this the CPU host need of the offloaded plans was
    13-64% over the live peak.
    Returns: {"grads": bytes, "params": bytes}.
    """
    shared = dict(grads=0, params=0)
    grads = states["grads"]
    device_sum = stage >= 2 and states["params"]["host"] == 0 and accumulation > 1
    if grads["host"] and (stage == 0 or device_sum):
        shared["grads"] = min(grads["host"], grads["device"])
    elif grads["host"] and world_size == 1 and grad_crosses_once(stage, accumulation):
        shared["grads"] = min(grads["host"], grads["device"] + grads_in_flight)
    if world_size == 1 and states["params"]["host"]:
        shared["params"] = min(gathered, states["params"]["host"])
    return shared


def grads_activations_overlap(states: dict[str, dict[str, int]], acts: dict[str, int], accumulation: int,
                              grads_in_flight: int = 0, first_chunk: int = 0) -> int:
    """Bytes the device's gradients and its saved activations never hold at the same time, taken off the sum.

    At accumulation 1 the step's gradients on the device (full compute-dtype grads at stages 0-1, the fp32 shards
    at 2-3, and the chunks' buffers in flight, `grads_in_flight`) do not exist before its only backward, which makes
    them as it frees the activations, layer by layer, and the step frees them (zero/chunk.py: `grad_full` is dropped
    once reduced; the optimizer consumes the shards). The two peaks are then the same memory at different moments:
    the peak is the larger of the two, not their sum (bench/plan_memory.py, 8L-384 at 4 x 1: measured 237 MiB, the
    sum 281, the larger 229; bench/host_gap.py, 2 ranks, the two vocabulary chunks in flight: 613 MiB measured, 693
    with them beside the activations, 570 without). But a chunk's gradient buffer is made whole when its first
    gradient arrives: the first one's (`first_chunk` bytes, the head's; `estimate` passes it where no buffer in
    flight already counts it) beside `acts["after_loss"]`, everything but the loss's peak still there (see
    overlap_at_one). Checkpointed, a block is recomputed after the gradients before it exist: they take the place of
    only what was above it (`acts["grads_room"]`, activation_bytes). Above accumulation 1 the first micro-step's
    gradients are held through the next ones' forwards: no overlap.
    """
    if accumulation != 1:
        return 0
    return overlap_at_one(states["grads"]["device"] + grads_in_flight, acts, first_chunk)


def overlap_at_one(grads: int, acts: dict[str, int], first_chunk: int) -> int:
    """At accumulation 1, the bytes of `grads` that take the place of activations: the peak of the two together is
    the largest of the activations' own, what is held after the loss beside the first chunk's whole buffer, and all
    the gradients beside what is left then (`acts["grads_room"]` under the total). Measured with every allocation
    counted whole, as a GPU counts it (bench/plan_memory.py, MALLOC_PERTURB_): 2L-128's z0 4 x 1 chunked-loss plan,
    one chunk, holds its whole gradient beside every activation but one loss chunk's logits (16.0 MiB; 13.1
    predicted before the first chunk was counted, 15.4 after)."""
    first = min(first_chunk, grads)
    return max(0, min(grads, acts["grads_room"], acts["total"] - acts["after_loss"] + grads - first))
