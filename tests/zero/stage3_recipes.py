"""The models the stage-3 tests train (and test_parity trains at stages 0-2): a toy LM whose forward varies
by step (keyword arguments, a shared layer, a sometimes-used branch, a changing order, a frozen embedding),
model_zoo's GPT with and without activation checkpointing, and Hugging Face's GPT2LMHeadModel."""
from __future__ import annotations

import torch
from torch import nn

from model_zoo.gpt import GPTLMLoss, gpt2_tiny
from tests.zero.reference import Recipe, adamw

VOCAB, HIDDEN, SEQ, MICRO_BATCH = 32, 16, 8, 2


def tokens(steps: int, world: int, accum: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, VOCAB, (steps, accum, world, MICRO_BATCH, SEQ + 1), generator=g)


def next_token_loss(logits: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    logits = getattr(logits, "logits", logits)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), batch[:, 1:].reshape(-1))


# ----------------------------------------------------------------------------------------------
# models


class ToyLM(nn.Module):
    """Embedding -> 3 layers -> optional extra branch -> head tied to the embedding.

    Keyword-only arguments pick the behaviour per call: `reverse` runs the layers in reverse order
    (a different chunk order), `use_extra` runs a branch whose parameters get no gradient otherwise,
    `twice` applies `shared` two times (one module, two uses per pass), `scale` multiplies the input.
    """

    def __init__(self, frozen_embedding: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList([nn.Linear(HIDDEN, HIDDEN) for _ in range(3)])
        self.shared = nn.Linear(HIDDEN, HIDDEN)
        self.extra = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.embed.weight.requires_grad_(not frozen_embedding)

    def forward(self, ids: torch.Tensor, *, reverse: bool = False, use_extra: bool = False, twice: bool = False,
                scale: float = 1.0) -> torch.Tensor:
        x = self.embed(ids) * scale  # (B, T, C)
        for layer in (reversed(self.layers) if reverse else self.layers):
            x = torch.tanh(layer(x))
        x = self.shared(x)
        if twice:
            x = self.shared(torch.tanh(x))
        if use_extra:
            x = x + self.extra(x)
        return self.head(self.norm(x))  # (B, T, VOCAB)


def toy() -> nn.Module:
    torch.manual_seed(0)
    return ToyLM()


def toy_frozen() -> nn.Module:
    torch.manual_seed(0)
    return ToyLM(frozen_embedding=True)


def trainable_adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3, weight_decay=0.1,
                             eps=1e-6)


def plain_loss(model, batch, step):
    return next_token_loss(model(batch[:, :-1]), batch)


def kwargs_loss(model, batch, step):  # every step passes keyword arguments, some vary per step
    return next_token_loss(model(ids=batch[:, :-1], scale=0.5 + 0.25 * (step % 3), twice=True), batch)


def branch_loss(model, batch, step):  # the extra branch runs on steps 0, 3, 6, 9 only
    return next_token_loss(model(batch[:, :-1], use_extra=step % 3 == 0), batch)


def reorder_loss(model, batch, step):  # order: forward on steps 0-3, reversed 4-7, forward 8-9
    return next_token_loss(model(batch[:, :-1], reverse=4 <= step < 8), batch)


def gpt_ckpt() -> nn.Module:
    torch.manual_seed(0)
    return gpt2_tiny(vocab_size=VOCAB, dropout=0.0, max_position_embeddings=SEQ, checkpoint=True)


def gpt_plain() -> nn.Module:
    torch.manual_seed(0)
    return gpt2_tiny(vocab_size=VOCAB, dropout=0.0, max_position_embeddings=SEQ)


def gpt_loss(model, batch, step):
    return GPTLMLoss(shift=False)(model(batch[:, :-1]), batch[:, 1:])


def eval_and_double_forward_loss(model, batch, step):
    """Odd steps: an eval-mode no_grad forward first (as an eval hook does between steps). Every third
    step: two forwards (half batches) and one backward through both graphs."""
    if step % 2 == 1:
        model.eval()
        with torch.no_grad():
            model(batch[:, :5])
        model.train()
    if step % 3 == 2:
        return (gpt_loss(model, batch[:1], step) + gpt_loss(model, batch[1:], step)) / 2
    return gpt_loss(model, batch, step)


def hf_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=HIDDEN, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)
    return GPT2LMHeadModel(config)


def hf_loss(model, batch, step):  # HF call convention: keyword arguments, a ModelOutput back
    return next_token_loss(model(input_ids=batch[:, :-1], use_cache=False), batch)


RECIPES = {
    "toy_plain": Recipe(build=toy, data=tokens, loss=plain_loss),
    "toy_kwargs_shared_layer": Recipe(build=toy, data=tokens, loss=kwargs_loss),
    "toy_branch_some_steps": Recipe(build=toy, data=tokens, loss=branch_loss),
    "toy_order_changes": Recipe(build=toy, data=tokens, loss=reorder_loss),
    "toy_frozen_embedding": Recipe(build=toy_frozen, data=tokens, loss=plain_loss, optimizer=trainable_adamw),
    "gpt_activation_checkpointing": Recipe(build=gpt_ckpt, data=tokens, loss=gpt_loss),
    "gpt": Recipe(build=gpt_plain, data=tokens, loss=gpt_loss),
    "gpt_eval_and_double_forward": Recipe(build=gpt_plain, data=tokens, loss=eval_and_double_forward_loss),
    "hf_gpt2": Recipe(build=hf_gpt2, data=tokens, loss=hf_loss, optimizer=adamw),
}
