"""Tests for model_zoo/loss.py: GPTLMLoss's shift, ignore_index, fp32 result and output objects; the chunked loss
(same loss and gradients as the plain one, no whole-batch logits, ZeRO-3's gathers around it); its kernel's own
tests are in test_loss_fused.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from model_zoo.gpt import GPTOutput
from model_zoo.loss import GPTLMLoss, chunked_cross_entropy
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


# ----------------------------------------------------------------------------------------------------------
# chunked_cross_entropy and GPTConfig.chunked_loss: the same loss and gradients, without whole-batch logits

def test_chunked_cross_entropy_matches_the_plain_loss_and_grads():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 10, 16, generator=g, requires_grad=True)
    weight = torch.randn(128, 16, generator=g, requires_grad=True)  # 100 real classes, 28 padding rows
    labels = torch.randint(0, 100, (3, 10), generator=g)
    labels[0, :4] = -100
    plain = GPTLMLoss(shift=False)(F.linear(hidden, weight)[..., :100], labels)
    expected = torch.autograd.grad(plain, (hidden, weight))
    for chunk_size in (1, 7, 30, 1000):  # one token, chunks not dividing 30, exactly one chunk, more than all
        loss = chunked_cross_entropy(hidden, weight, labels, vocab_size=100, chunk_size=chunk_size)
        grads = torch.autograd.grad(loss, (hidden, weight))
        torch.testing.assert_close(loss, plain, rtol=1e-6, atol=1e-6)
        for got, want in zip(grads, expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
        assert grads[1][100:].abs().max() == 0  # padding rows are never a class


@pytest.mark.parametrize("checkpoint", [False, True])
def test_gpt_chunked_loss_gives_the_plain_loss_and_grads(checkpoint):
    plain, chunked = tiny(checkpoint=checkpoint), tiny(checkpoint=checkpoint, chunked_loss=True, loss_chunk_size=5)
    x, y = ids(), ids(seed=2)
    y[1, 3:] = -100
    expected = plain(x, labels=y).loss
    out = chunked(x, labels=y)
    assert out.logits is None
    torch.testing.assert_close(out.loss, expected, rtol=1e-6, atol=1e-6)
    expected.backward()
    out.loss.backward()
    for (name, p), q in zip(plain.named_parameters(), chunked.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert torch.equal(chunked(x), plain(x))  # no labels: logits, as before


class LargestLogits(TorchDispatchMode):
    """The most elements of any tensor an op returns with the vocabulary (real or padded) as its last dim."""

    def __init__(self, vocab: tuple[int, ...]) -> None:
        super().__init__()
        self.vocab, self.numel = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.size(-1) in self.vocab:
                self.numel = max(self.numel, t.numel())
        return out


def test_chunked_loss_never_holds_the_logits_of_the_batch():
    x, y = ids(batch=3, seq=32), ids(batch=3, seq=32, seed=2)  # 96 tokens, vocab 100 padded to 128
    sizes = {}
    for chunked in (False, True):
        model = tiny(chunked_loss=chunked, loss_chunk_size=16)
        with LargestLogits(vocab=(100, 128)) as probe:
            model(x, labels=y).loss.backward()
        sizes[chunked] = probe.numel
    assert sizes[False] == 96 * 128  # the batch's logits over the padded vocabulary
    assert sizes[True] <= 64 * 128  # at most the head's weight (C x padded vocab); a chunk's logits are 16 x 100


@pytest.mark.timeout(120)
def test_chunked_loss_at_zero_stage_3_gathers_the_tied_head():
    """The same losses through a ZeRO-3 engine (world 1 still gathers and releases chunks through the hooks):
    the head's weight is read in the loss's forward (which also makes its gradient), then released."""
    import zerogpt
    from tests.zero.reference import cpu_ctx
    from zerogpt.zero import BucketTensorShardStrategy

    small_chunks = BucketTensorShardStrategy(bucket_mb=0.02)  # the head's chunk is released between uses
    losses = {}
    for chunked in (False, True):
        model = tiny(chunked_loss=chunked, loss_chunk_size=7)
        engine = zerogpt.initialize(model, torch.optim.AdamW(model.parameters(), lr=3e-3),
                                    config=zerogpt.Config(dict(zero=dict(stage=3, shard_strategy=small_chunks))),
                                    ctx=cpu_ctx())
        assert engine.gather_hooks is not None and len(engine.chunks) > 1
        losses[chunked] = []
        for step in range(3):
            loss = engine(ids(seed=10 + step), labels=ids(seed=20 + step)).loss
            engine.backward(loss)
            engine.step()
            engine.zero_grad()
            losses[chunked].append(loss.item())
        engine.close()
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-5, atol=1e-6)
