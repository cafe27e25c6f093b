"""Tests for model_zoo/generation.py: greedy decoding past the position window, and top-k sampling."""
from __future__ import annotations

import torch

from model_zoo.generation import generate
from tests.model_zoo.tiny_gpt import ids, tiny


def test_greedy_matches_the_argmax_and_runs_past_the_position_window():
    model = tiny().eval()
    x = ids(seq=12)
    greedy = model.generate(x[:, :4], max_new_tokens=40, temperature=0)  # runs past max_position_embeddings=32
    assert greedy.shape == (2, 44) and torch.equal(greedy[:, :4], x[:, :4])
    first = model(x[:, :4])[:, -1].argmax(-1)
    assert torch.equal(greedy[:, 4], first)
    assert torch.equal(generate(model, x[:, :4], 40, temperature=0), greedy)  # GPT.generate is this function


def test_top_k_sampling_draws_from_the_generator():
    model = tiny().eval()
    x = ids(seq=12)
    sampled = model.generate(x[:, :4], 5, temperature=0.8, top_k=5, generator=torch.Generator().manual_seed(0))
    assert sampled.shape == (2, 9) and int(sampled.max()) < 100
    again = model.generate(x[:, :4], 5, temperature=0.8, top_k=5, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sampled, again)
