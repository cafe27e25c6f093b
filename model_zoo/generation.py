"""Sampling from our GPT with a KV cache: greedy (temperature 0), temperature and top-k.

`GPT.generate` calls `generate` here. The model is only called (input_ids, past_key_values, use_cache) and read
for `config.max_position_embeddings`; it is not changed. zerogpt_tools.generate is the command-line front end.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["generate"]


@torch.no_grad()
def generate(model: nn.Module, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Sample `max_new_tokens` tokens after `input_ids` with a KV cache; temperature 0 = greedy.

    Args:
        model: a GPT or Llama (in eval mode, usually); its forward with use_cache=True gives logits and past_key_values.
        input_ids: (B, T) int64 prompt on the model's device.
        max_new_tokens: tokens to append. Past max_position_embeddings the window slides: the cache is dropped
            and the last max_position_embeddings tokens are recomputed.
        temperature: divides the logits; 0 takes the argmax.
        top_k: sample among the k most likely tokens only (None: all).
        generator: the random stream torch.multinomial draws from (None: the global one).
    Returns:
        (B, T + max_new_tokens) int64: the prompt followed by the new tokens.
    Example:
        >>> generate(gpt2_tiny().eval(), torch.zeros(1, 3, dtype=torch.long), 5, temperature=0).shape
        torch.Size([1, 8])
    """
    max_positions = model.config.max_position_embeddings
    out_ids, past, step_ids = input_ids, None, input_ids
    for _ in range(max_new_tokens):
        if (past[0][0].size(2) if past else 0) + step_ids.size(1) > max_positions:
            past, step_ids = None, out_ids[:, -max_positions:]  # window slides: recompute
        out = model(step_ids, past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1, :].float()
        if temperature == 0:
            next_id = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            next_id = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
        out_ids = torch.cat([out_ids, next_id], dim=1)
        step_ids = next_id
    return out_ids
