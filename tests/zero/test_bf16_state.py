"""`zero.offload_optimizer.state_dtype='bf16'` (issue 30 point 2): Adam's moments in bf16 on the host beside the
fp32 master. The state takes half the bytes, training follows fp32 state closely, a resumed run repeats the
straight one bit for bit (the stochastic rounding is seeded per chunk and step), and misuse is refused with the fix.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from model_zoo.gpt import GPTLMLoss, gpt2_tiny
from tests.dist_utils import run_distributed
from zerogpt.context import DistContext

VOCAB, SEQ, MICRO, STEPS = 128, 16, 4, 8


def make_engine(state_dtype: str, *, stage: int = 3, param: bool = True, precision: str = "bf16",
                optimizer: str = "HybridAdam", seed: int = 0):
    import zerogpt
    from zerogpt.zero import BucketTensorShardStrategy

    torch.manual_seed(seed)
    model = gpt2_tiny(vocab_size=VOCAB, dropout=0.0, max_position_embeddings=SEQ)
    zero = dict(stage=stage, shard_strategy=BucketTensorShardStrategy(bucket_mb=0.02),
                offload_optimizer=dict(device="cpu", state_dtype=state_dtype))
    if param:
        zero["offload_param"] = dict(device="cpu")
    cfg = zerogpt.Config(dict(zero=zero, precision=precision, clip_grad_norm=1.0))
    return zerogpt.initialize(model, dict(type=optimizer, lr=3e-3, weight_decay=0.1), config=cfg,
                              ctx=DistContext.current())


def batches(world: int) -> torch.Tensor:
    """Counting sequences from random starts: learnable in a few steps, so the losses have a curve to compare."""
    g = torch.Generator().manual_seed(1234)
    starts = torch.randint(0, VOCAB, (STEPS, world, MICRO, 1), generator=g)
    return (starts + torch.arange(SEQ + 1)) % VOCAB


def train(engine, data: torch.Tensor, rank: int, world: int) -> list[float]:
    losses = []
    for step in data:
        mine = step[rank]
        loss = GPTLMLoss(shift=False)(engine(mine[:, :-1]), mine[:, 1:])
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        total = loss.detach().float().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def test_state_takes_half_the_bytes_and_follows_fp32_state():
    runs = {}
    for dtype in ("fp32", "bf16"):
        engine = make_engine(dtype)
        runs[dtype] = (train(engine, batches(1), 0, 1), engine.memory_stats()["optimizer"]["host"])
        moments = [t.dtype for s in engine.sharded_optim.states.values() for t in s.state_tensors().values()]
        assert set(moments) == {torch.float32 if dtype == "fp32" else torch.bfloat16}
        engine.close()
    (fp32_losses, fp32_bytes), (bf16_losses, bf16_bytes) = runs["fp32"], runs["bf16"]
    assert bf16_bytes * 2 == fp32_bytes
    assert fp32_losses[-1] < fp32_losses[0] - 0.1  # it learns, so the comparison means something
    assert max(abs(a - b) for a, b in zip(fp32_losses, bf16_losses)) < 0.02, (fp32_losses, bf16_losses)


def _resume(rank: int, world: int, root: str) -> tuple[list[float], list[float]]:
    data = batches(world)
    straight = make_engine("bf16", stage=2, param=False)
    losses = train(straight, data, rank, world)
    straight.close()
    first = make_engine("bf16", stage=2, param=False)
    head = train(first, data[:3], rank, world)
    first.save_checkpoint(f"{root}/step_3")
    first.close()
    resumed = make_engine("bf16", stage=2, param=False, seed=7)
    resumed.load_checkpoint(f"{root}/step_3")
    tail = train(resumed, data[3:], rank, world)
    resumed.close()
    return losses, head + tail


@pytest.mark.timeout(240)
def test_resume_is_bit_identical(tmp_path):
    straight, resumed = run_distributed(_resume, 2, str(tmp_path), timeout=220)[0]
    assert resumed == straight


def test_refused_where_no_fused_host_step_keeps_it():
    with pytest.raises(ValueError, match="state_dtype='bf16'.*HybridAdam"):
        make_engine("bf16", optimizer="AdamW")
    import zerogpt

    with pytest.raises(ValueError, match="set zero.offload_optimizer.device='cpu' or 'disk'"):
        zerogpt.Config(dict(zero=dict(stage=2, offload_optimizer=dict(state_dtype="bf16")))).validate()
