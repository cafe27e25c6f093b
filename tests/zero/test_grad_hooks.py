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
