"""An offloaded step's gradient is kept on the host as it crossed, in the compute dtype, when that crossing is the
step's only one (GradPath.keeps_as_crossed; issue 30 point 1): bf16 holds 2 bytes/param there from backward to
the step instead of an fp32 shard's 4, and the pass that converted it goes. CPUAdam's host step reads it as it is;
another optimizer gets one chunk's fp32 copy at the step.

Checked on CPU, where the hand-over runs the same code with no copy: which runs keep it (the step's one crossing at
stage 3 and at stage 1 over micro-steps; not a sum over micro-steps), that training is the fp32-shard path bit for
bit with CPUAdam and with torch's AdamW, that the build line's host bytes count the kept dtype, and that a skipped
(non-finite) step leaves everything as it was.
"""
from __future__ import annotations

import pytest
import torch

from model_zoo.gpt import GPTLMLoss
from tests.zero.test_offload_traffic import SEQ, VOCAB, build as build_engine, max_param_diff, run_steps
from zerogpt.zero.grad_path import GradPath


def build(stage: int, *, param: bool = False, accum: int = 1, optimizer: str = "hybrid"):
    """bf16 with clipping, the optimizer offloaded: HybridAdam (the host op) or torch's AdamW."""
    return build_engine(stage, param=param, accum=accum, precision="bf16", clip=1.0,
                        hybrid_adam=optimizer == "hybrid")


def grad_dtypes_at_step(engine) -> set[torch.dtype]:
    """The dtypes of the host gradients the first step finds (one batch's backward, accumulation included)."""
    x = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(3))
    for _ in range(engine.gradient_accumulation):
        engine.backward(GPTLMLoss(shift=False)(engine(x[:, :-1]), x[:, 1:]))
    dtypes = {s.grad.dtype for s in engine.sharded_optim.states.values() if s.grad is not None}
    engine.close()
    return dtypes


@pytest.mark.parametrize("stage, param, accum, optimizer, kept", [
    (3, True, 1, "hybrid", torch.bfloat16),   # the single-GPU layout: one crossing per step
    (2, False, 1, "hybrid", torch.bfloat16),
    (1, False, 2, "hybrid", torch.bfloat16),  # stage 1 reduces once, at the boundary
    (3, True, 2, "hybrid", torch.float32),    # summed on the host over micro-steps: fp32
    (3, True, 1, "torch", torch.bfloat16),    # torch's AdamW: converted chunk by chunk at the step
])
def test_which_steps_keep_the_gradient_as_it_crossed(stage, param, accum, optimizer, kept):
    assert grad_dtypes_at_step(build(stage, param=param, accum=accum, optimizer=optimizer)) == {kept}


@pytest.mark.parametrize("stage, param, accum, optimizer", [(3, True, 1, "hybrid"), (1, False, 2, "hybrid"),
                                                           (3, True, 1, "torch")])
def test_training_is_the_fp32_shard_path_bit_for_bit(stage, param, accum, optimizer):
    got = run_steps(build(stage, param=param, accum=accum, optimizer=optimizer), 3)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(GradPath, "keeps_as_crossed", lambda self, state: False)
        ref = run_steps(build(stage, param=param, accum=accum, optimizer=optimizer), 3)
    assert got["losses"] == ref["losses"]
    assert max_param_diff(got["params"], ref["params"]) == 0.0
    assert got["traffic"] == ref["traffic"]  # the same bytes cross; only what the host keeps changed


def test_the_build_line_counts_the_kept_dtype():
    engine = build(3, param=True)
    fp32_shards = sum(s.master.numel() * 4 for s in engine.sharded_optim.states.values())
    held = engine.host_bytes()
    engine.close()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(GradPath, "keeps_as_crossed", lambda self, state: False)
        ref = build(3, param=True)
        assert ref.host_bytes() - held == fp32_shards // 2  # 2 of the 4 bytes/param
        ref.close()


def test_a_non_finite_step_is_skipped_with_the_kept_gradient():
    engine = build(3, param=True)
    x = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(3))
    before = {k: v.clone() for k, v in engine.state_dict_full().items()}
    loss = GPTLMLoss(shift=False)(engine(x[:, :-1]), x[:, 1:])
    engine.backward(loss * float("nan"))
    assert {s.grad.dtype for s in engine.sharded_optim.states.values()} == {torch.bfloat16}
    assert not torch.isfinite(engine.step())
    engine.zero_grad()
    after = engine.state_dict_full()
    engine.close()
    assert all(torch.equal(before[k], after[k]) for k in before)
