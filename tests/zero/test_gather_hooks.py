"""zero/gather_hooks.py with the blocks hooked whole (`gather_per_block`, what `compile = True` installs):
`prefetch = N` gathers the chunks of the next N hooked modules of the recorded order, in forward and in backward.

World 1 on the CPU, a 4-block tiny GPT in fp32, nothing compiled (the hooks are moved as compile_blocks moves them).
The chunks gathered are read as each hooked module starts: its forward (a pre-hook after the gather hook) and its
backward (after the gather before it). The multi-rank behaviour of stage 3 is tests/zero/test_stage3.py's (eager)
and tests/test_compile.py's (blocks hooked whole).
"""
from __future__ import annotations

import pytest
import torch

import zerogpt
from model_zoo.gpt import gpt2_tiny
from tests.zero.reference import cpu_ctx, train_losses
from zerogpt.compile import find_blocks
from zerogpt.zero import BucketTensorShardStrategy, TensorShardStrategy

VOCAB, SEQ, LAYERS = 128, 16, 4


def run(bucket_mb: float, prefetch: int, steps: int = 3) -> tuple[list[set[int]], list[list[tuple]]]:
    """Train `steps` steps with the blocks hooked whole. Returns the chunks of each hooked module in forward order
    (wte, wpe, the blocks, ln_f, the tied head) and, per step, (phase, module position, chunks gathered then)."""
    torch.manual_seed(0)
    model = gpt2_tiny(vocab_size=VOCAB, max_position_embeddings=SEQ, n_layer=LAYERS)
    strategy = BucketTensorShardStrategy(bucket_mb=bucket_mb) if bucket_mb else TensorShardStrategy()
    cfg = zerogpt.Config(dict(zero=dict(stage=3, shard_strategy=strategy, prefetch=prefetch), precision="fp32"))
    engine = zerogpt.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=cfg, ctx=cpu_ctx())
    hooks, model = engine.gather_hooks, engine.module
    hooks.gather_per_block(find_blocks(model))
    t = model.transformer
    modules = [t.wte, t.wpe, *t.h, t.ln_f, model.lm_head]
    units = [set(hooks.module_chunks[id(m)]) for m in modules]
    position = {id(m): i for i, m in enumerate(modules[:-1])}  # the head shares the embedding's chunk
    position[id(model.lm_head)] = len(modules) - 1
    log: list[list[tuple]] = []

    def gathered() -> set[int]:
        return {c.plan.index for c in engine.chunks if c.full_buffer is not None}

    def forward_start(module, args) -> None:
        if not hooks.in_backward:
            log[-1].append(("forward", position[id(module)], gathered()))

    for m in modules:  # registered after the gather hook: sees what it gathered
        m.register_forward_pre_hook(forward_start)

    def gather_for_backward(module_id: int, original=hooks.gather_for_backward) -> None:
        original(module_id)
        log[-1].append(("backward", position[module_id], gathered()))
    hooks.gather_for_backward = gather_for_backward
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        log.append([])
        train_losses(engine, torch.randint(0, VOCAB, (1, 2, SEQ + 1), generator=g))
    engine.close()
    return units, log


@pytest.fixture(autouse=True)
def one_thread():
    torch.set_num_threads(1)


@pytest.mark.parametrize("bucket_mb", [0, 0.02])
@pytest.mark.parametrize("prefetch", [1, 2, 3])
def test_prefetch_gathers_the_next_hooked_modules_whole(bucket_mb, prefetch):
    """As each module starts (after the first step, once the order is recorded), the chunks of the next `prefetch`
    modules of the pass are gathered, and nothing that only a module further on uses."""
    units, log = run(bucket_mb, prefetch)
    assert len(units) == LAYERS + 4  # wte, wpe, the blocks, ln_f, the head
    for phase in ("forward", "backward"):
        order = list(range(len(units))) if phase == "forward" else list(range(len(units)))[::-1]
        for step, seen in enumerate(log[1:], start=1):
            starts = [(pos, held) for p, pos, held in seen if p == phase]
            assert [pos for pos, _ in starts] == order, (phase, step, starts)
            for k, (pos, held) in enumerate(starts):
                ahead = set().union(*(units[q] for q in order[k + 1 : k + 1 + prefetch]))
                assert units[pos] | ahead <= held, f"{phase} step {step} at module {pos}: {sorted(ahead - held)} " \
                                                   f"of the next {prefetch} modules not gathered"
                beyond = set().union(*(units[q] for q in order[k + 1 + prefetch :])) - set().union(
                    *(units[q] for q in order[: k + 1 + prefetch]))
                assert not beyond & held, f"{phase} step {step} at module {pos}: {sorted(beyond & held)} gathered " \
                                          f"more than {prefetch} modules ahead"


def test_first_pass_gathers_on_demand():
    """Nothing recorded yet: each block's chunks are gathered only when it runs, so the next block's are not."""
    units, log = run(0, prefetch=2, steps=1)
    blocks = range(2, 2 + LAYERS)
    for p, pos, held in log[0]:
        if p == "forward" and pos in blocks[:-1]:
            assert not units[pos + 1] & held, (pos, sorted(held))
