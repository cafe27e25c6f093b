"""zero/grad_hooks.py: when each stage reduces, and that close() removes every hook.

DESIGN §2: stages 0 and 1 accumulate gradients locally and reduce once per optimizer step (on the
micro-step that completes the accumulation); stages 2 and 3 reduce-scatter every micro-step into
the fp32 shard. Counted on 2 gloo ranks with GRADIENT_ACCUMULATION=3 (parity of the resulting
training at every stage is in test_parity.py).
"""
from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.zero.reference import cpu_ctx
from tests.zero.recipes import lm_loss, tiny_gpt, token_batches, zero_config

ACCUM = 3


def _count_reductions(rank: int, world: int) -> dict:
    import zerogpt

    torch.set_num_threads(1)
    out = {}
    for stage in range(4):
        model = tiny_gpt()
        cfg = zerogpt.Config(dict(zero=zero_config(stage), GRADIENT_ACCUMULATION=ACCUM))
        engine = zerogpt.initialize(model, torch.optim.AdamW(model.parameters()), config=cfg,
                                    ctx=cpu_ctx(rank, world))
        calls = []
        for chunk in engine.chunks:
            def launch(chunk=chunk, original=chunk.launch_reduce):
                calls.append(chunk.plan.index)
                original()
            chunk.launch_reduce = launch
        per_backward = []
        data = token_batches(2, world, ACCUM)
        for step in range(2):
            for j in range(ACCUM):
                calls.clear()
                engine.backward(lm_loss(engine, data[step, j, rank], step))
                per_backward.append(list(calls))
                engine.step()
                engine.zero_grad()
        out[stage] = {"per_backward": per_backward, "trainable": [c.plan.index for c in engine.chunks
                                                                  if c.plan.trainable]}
        engine.close()
        out[stage]["hooks_left"] = _hooks_left(model)
    return out


def _hooks_left(model: torch.nn.Module) -> int:
    modules = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    params = sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
    return modules + params


@pytest.fixture(scope="module")
def counts() -> list[dict]:
    return run_distributed(_count_reductions, 2, timeout=150)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_reduction_schedule_per_stage(counts, stage):
    for rank, result in enumerate(counts):
        trainable = result[stage]["trainable"]
        every_chunk_once = sorted(trainable, reverse=True)  # descending index: the same order on every rank
        if stage <= 1:
            expected = ([[]] * (ACCUM - 1) + [every_chunk_once]) * 2
        else:
            expected = [every_chunk_once] * (ACCUM * 2)
        assert result[stage]["per_backward"] == expected, f"rank {rank} stage {stage}"


@pytest.mark.timeout(180)
def test_close_removes_every_hook(counts):
    assert all(result[stage]["hooks_left"] == 0 for result in counts for stage in range(4))


# -- the tied embedding's gradient, taken as rows (issue 30 point 1) ---------------------------------------------


def _tied_grads(stage: int, loss_of) -> tuple[torch.Tensor, torch.Tensor, list[tuple]]:
    """(wte's gradient from the engine, from plain autograd, the aten ops the engine's backward ran with the shape
    of what each returned)."""
    import copy

    import zerogpt
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.names.append((str(func), tuple(out.shape) if isinstance(out, torch.Tensor) else None))
            return out

    model = tiny_gpt()
    reference = copy.deepcopy(model)
    tokens = torch.randint(0, 8, (2, 9), generator=torch.Generator().manual_seed(0))  # repeated ids
    loss_of(reference, tokens).backward()
    cfg = zerogpt.Config(dict(zero=zero_config(stage)))
    engine = zerogpt.initialize(model, torch.optim.AdamW(model.parameters()), config=cfg, ctx=cpu_ctx())
    loss = loss_of(engine, tokens)
    with Ops() as ops:
        engine.backward(loss)
    index, slot_index = engine.grad_hooks.param_to_chunk[id(model.transformer.wte.weight)]
    slot = engine.chunks[index].plan.slots[slot_index]
    grad = engine.sharded_optim.states[index].grad[slot.offset : slot.end].view(slot.shape).clone()
    engine.close()
    return grad, reference.transformer.wte.weight.grad, ops.names


def lm_loss_of(model, tokens: torch.Tensor) -> torch.Tensor:
    from model_zoo.gpt import GPTLMLoss

    return GPTLMLoss(shift=False)(model(tokens[:, :-1]), tokens[:, 1:])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [0, 3])
def test_tied_embedding_gradient_comes_as_rows(stage):
    """GPT-2's wte is also the LM head: its embedding gradient is added row by row into the head's, bit for bit
    autograd's sum, and the dense vocab x dim embedding gradient is never built."""
    grad, want, ops = _tied_grads(stage, lm_loss_of)
    dense = [(op, shape) for op, shape in ops if "embedding_dense_backward" in op]
    assert dense and all(shape != tuple(want.shape) for _, shape in dense), dense  # wpe's only, not wte's
    assert torch.equal(grad, want)
    synced = [op for op, _ in ops if any(name in op for name in ("unique", "nonzero", "_local_scalar_dense"))]
    assert not synced, f"ops whose output shape or value the host must wait for on a GPU: {synced}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_segment_sum_of_repeated_ids_is_autograds(dtype):
    """The row sum (sort + segments, no unique), with ids repeated many times and ids absent: in fp32 it equals
    autograd's dense embedding gradient added to another gradient, bit for bit; in bf16 (where CPU autograd's
    dense backward rounds differently) it equals the sum over `unique` that it replaced, bit for bit."""
    from zerogpt.zero.chunk import _segments_of_equal_ids

    gen = torch.Generator().manual_seed(1)
    vocab, dim = 16, 8
    ids = torch.randint(0, vocab // 2, (300,), generator=gen)
    rows = torch.randn(300, dim, generator=gen).to(dtype)
    base = torch.randn(vocab, dim, generator=gen).to(dtype)
    weight = torch.zeros(vocab, dim, dtype=dtype, requires_grad=True)
    torch.nn.functional.embedding(ids, weight).backward(rows)
    want = base + weight.grad
    segment_ids, segment_of_row, order = _segments_of_equal_ids(ids)
    summed = torch.zeros_like(rows).index_add_(0, segment_of_row, rows.index_select(0, order))
    got = base.clone().index_add_(0, segment_ids, summed)
    if dtype == torch.float32:
        assert torch.equal(got, want)
    distinct, inverse = ids.unique(return_inverse=True)
    by_unique = torch.zeros(distinct.numel(), dim, dtype=dtype).index_add_(0, inverse, rows)
    assert torch.equal(got, base.clone().index_add_(0, distinct, by_unique))


@pytest.mark.timeout(120)
def test_tied_embedding_rows_alone_still_land():
    """A backward that reaches wte only through the embedding (the head's output not in the loss): the rows, with
    no gradient of the weight's own to join, are added at the end of backward."""
    def embedding_only(m, t):
        return (m.module if hasattr(m, "module") else m).transformer.wte(t).pow(2).sum()

    grad, want, _ = _tied_grads(3, embedding_only)
    assert torch.equal(grad, want)
