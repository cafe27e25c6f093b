"""What the tensor and pipeline plans know of each model_zoo family: where its parts are, and one block's plan.

tensor.py and pipeline.py do the same to every family but what its `Family` says: the module names (the blocks,
the token embedding, what only the first pipeline stage keeps, the final norm), the Megatron plan of one block,
the dropouts on what only this rank holds, and whether the head is tied to the embedding. A model's family comes
from its class name (`family_of`), so zerogpt never imports model_zoo and model_zoo knows nothing of the plans.

- GPT: a fused [q; k; v] `c_attn`, whose rows are permuted before DTensor splits them (tensor.py), learned
  positions (`wpe`, cut to a rank's positions under SP), residual dropouts, a head always tied to `wte`.
- The Llama family (Llama 2/3, Qwen2/2.5, Qwen3, Mistral): q/k/v projections that split as they are (rank r of
  T holds query heads [r*nh/T, (r+1)*nh/T) and k/v heads [r*nkv/T, ...), the groups its query heads use; their
  Qwen2 biases with them), SwiGLU, RMSNorms, RoPE computed in the forward for the whole sequence (replicated), a
  head tied or not. Qwen3's q/k-norm weights act per head on this rank's heads, so their gradient is a partial
  sum over the tensor-parallel ranks: the plan makes them Replicate DTensors on a head-sharded input (as SP makes
  the norms on a sequence-sharded one), and the engine all-reduces that gradient (`chunk.grad_as_param`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel)

__all__ = ["Family", "family_of", "GPT", "LLAMA"]

HEAD = "lm_head.weight"


@dataclass(frozen=True)
class Family:
    """One model_zoo family as the plans see it. Paths are submodule names from the model's root."""

    name: str
    layers: str
    """The blocks' ModuleList (a pipeline stage's ModuleDict keyed by layer index)."""
    embedding: str
    """The token embedding: vocab-parallel under TP, on the first pipeline stage, the head's tie when tied."""
    first_stage: tuple[str, ...]
    """Modules only the first pipeline stage keeps (the embedding among them)."""
    final_norm: str
    """The norm before `lm_head`, on the last stage."""
    block_plan: Callable[[str, nn.Module, bool], dict[str, ParallelStyle]]
    """(block path, block, sequence_parallel) -> the block's parallelize_module plan."""
    own_dropouts: Callable[[nn.Module, bool], list[nn.Module]]
    """(model, sequence_parallel) -> the modules whose dropout acts on what only this rank holds (rng.py)."""
    tied: Callable[[Any], bool]
    """config -> whether `lm_head.weight` is the embedding's weight."""
    fused_qkv: str | None = None
    """A block's fused [q; k; v] Linear (block-relative): its rows are permuted before the plan splits them."""
    positions: str | None = None
    """A learned position embedding whose (T, C) output is cut to a rank's positions under SP."""
    later_stage_sp: Callable[[nn.Module, int], None] | None = None
    """(stage model, tensor-parallel size): what a pipeline stage without the embedding needs under SP, where the
    hidden states it receives hold that rank's 1/T of the positions (a Llama's RoPE)."""

    @property
    def embedding_weight(self) -> str:
        return f"{self.embedding}.weight"


def family_of(model: nn.Module) -> Family:
    """The Family of a model_zoo model, by its class name; ValueError for any other model."""
    family = _BY_CLASS.get(type(model).__name__)
    if family is None:
        raise ValueError(f"tensor and pipeline parallelism split model_zoo's GPT and Llama-family models "
                         f"(classes {', '.join(sorted(_BY_CLASS))}); a {type(model).__name__} has no plan")
    return family


def _seq(sequence_parallel: bool) -> Replicate | Shard:
    """The residual stream's placement between blocks: Shard(1) on the sequence under SP, else Replicate."""
    return Shard(1) if sequence_parallel else Replicate()


# -- GPT -----------------------------------------------------------------------------------------------------

def _gpt_block(block: str, module: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    seq = _seq(sequence_parallel)
    plan: dict[str, ParallelStyle] = {
        f"{block}.attn.c_attn": ColwiseParallel(), f"{block}.mlp.c_fc": ColwiseParallel(),
        f"{block}.attn.c_proj": RowwiseParallel(output_layouts=seq),
        f"{block}.mlp.c_proj": RowwiseParallel(output_layouts=seq)}
    if sequence_parallel:
        plan.update({f"{block}.ln_1": SequenceParallel(), f"{block}.ln_2": SequenceParallel(),
                     # attn(x, layer_past, use_cache), mlp(x): the whole sequence in
                     f"{block}.attn": PrepareModuleInput(input_layouts=(seq, None, None),
                                                         desired_input_layouts=(Replicate(), None, None)),
                     f"{block}.mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))})
    return plan


def _gpt_dropouts(model: nn.Module, sequence_parallel: bool) -> list[nn.Module]:
    """The attention probabilities of this rank's heads; under SP the embedding and residual dropouts of its
    positions."""
    blocks = list(model.transformer.h)
    own = [block.attn.attend for block in blocks]
    if sequence_parallel:
        own += [model.transformer.drop]
        own += [m for block in blocks for m in (block.attn.resid_dropout, block.mlp.dropout)]
    return own


GPT = Family(name="GPT", layers="transformer.h", embedding="transformer.wte",
             first_stage=("transformer.wte", "transformer.wpe", "transformer.drop"), final_norm="transformer.ln_f",
             block_plan=_gpt_block, own_dropouts=_gpt_dropouts, tied=lambda config: True,
             fused_qkv="attn.c_attn", positions="transformer.wpe")


# -- the Llama family ----------------------------------------------------------------------------------------

def _llama_block(block: str, module: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    seq, attn, mlp = _seq(sequence_parallel), f"{block}.self_attn", f"{block}.mlp"
    plan: dict[str, ParallelStyle] = {
        f"{attn}.q_proj": ColwiseParallel(), f"{attn}.k_proj": ColwiseParallel(),
        f"{attn}.v_proj": ColwiseParallel(), f"{attn}.o_proj": RowwiseParallel(output_layouts=seq),
        f"{mlp}.gate_proj": ColwiseParallel(), f"{mlp}.up_proj": ColwiseParallel(),
        f"{mlp}.down_proj": RowwiseParallel(output_layouts=seq)}
    if hasattr(module.self_attn, "q_norm"):
        # q, k (B, T, heads, hs) hold this rank's heads: the norm's weight a Replicate DTensor on an input sharded
        # on the heads dim, so its gradient is a Partial sum that the engine all-reduces over "tp"
        plan.update({f"{attn}.{norm}": SequenceParallel(sequence_dim=2, use_local_output=True)
                     for norm in ("q_norm", "k_norm")})
    if sequence_parallel:
        plan.update({f"{block}.input_layernorm": SequenceParallel(),
                     f"{block}.post_attention_layernorm": SequenceParallel(),
                     # self_attn(x, cos, sin, layer_past, use_cache): the whole sequence in; cos, sin (T, hs) are
                     # the whole sequence's already, replicated
                     attn: PrepareModuleInput(input_layouts=(seq, None, None, None, None),
                                              desired_input_layouts=(Replicate(), None, None, None, None)),
                     mlp: PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))})
    return plan


def _llama_dropouts(model: nn.Module, sequence_parallel: bool) -> list[nn.Module]:
    """The attention probabilities of this rank's heads (the family has no residual dropouts)."""
    return [layer.self_attn.attend for layer in model.model.layers]


def _llama_later_stage_sp(model: nn.Module, tp: int) -> None:
    """A stage without the embedding computes RoPE for its input's length, T/tp under SP; its attention gathers
    the whole sequence, so cos/sin must cover all T positions."""
    rope = model.rope

    def rope_of_the_gathered_sequence(T_past: int, T: int, dtype: Any) -> Any:
        return rope(T_past, T * tp, dtype)

    model.rope = rope_of_the_gathered_sequence


LLAMA = Family(name="Llama", layers="model.layers", embedding="model.embed_tokens",
               first_stage=("model.embed_tokens",), final_norm="model.norm", block_plan=_llama_block,
               own_dropouts=_llama_dropouts, tied=lambda config: bool(config.tie_word_embeddings),
               later_stage_sp=_llama_later_stage_sp)

_BY_CLASS = {"GPT": GPT, "Llama": LLAMA}
