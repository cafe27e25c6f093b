"""What transformers itself produces, as the reference the tools' outputs are compared with."""
import torch


def hf_greedy(model, ids: list[int], max_new_tokens: int) -> list[int]:
    """The new token ids of transformers' greedy `generate` after prompt `ids` (batch of one)."""
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                         attention_mask=torch.ones(1, len(ids), dtype=torch.long), pad_token_id=0)
    return out[0, len(ids):].tolist()
