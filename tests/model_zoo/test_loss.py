"""Tests for model_zoo/loss.py: GPTLMLoss's shift, ignore_index, fp32 result and output objects."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from model_zoo.gpt import GPTOutput
from model_zoo.loss import GPTLMLoss
from tests.model_zoo.tiny_gpt import ids, tiny


def test_gptlmloss_shift_and_ignore_index():
    logits, x = torch.randn(2, 8, 50), ids(seq=8, vocab=50)
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, 50), x[:, 1:].reshape(-1))
    torch.testing.assert_close(GPTLMLoss()(logits, x), expected)  # tutorial form: (logits, input_ids)
    labels = x.clone()
    labels[:, :3] = -100
    aligned = F.cross_entropy(logits.reshape(-1, 50), labels.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(GPTLMLoss(shift=False)(logits, labels), aligned)
    torch.testing.assert_close(GPTLMLoss(shift=False)(GPTOutput(logits=logits), labels), aligned)  # output objects
    assert GPTLMLoss()(logits.to(torch.bfloat16), x).dtype == torch.float32
    model = tiny()
    x = ids()
    torch.testing.assert_close(GPTLMLoss()(model(x), x), model(x[:, :-1], labels=x[:, 1:]).loss)
