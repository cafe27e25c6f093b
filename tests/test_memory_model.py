"""zerogpt/memory_model.py's stage-3 chunk buffers with the blocks gathered whole (`compile = True`): the chunks
the model packs and the most it says are gathered at once, against the engine's own chunks and what it really
holds gathered at once with per-block hooks (tiny GPT, world 1 on the CPU; the hooks are moved as compile_blocks
moves them, nothing is compiled).

(The ZeRO formulas, activations and the CLI are tested in tests/zerogpt_tools/test_estimate.py.)
"""
from __future__ import annotations

import pytest
import torch

import zerogpt
from model_zoo.gpt import gpt2_tiny
from tests.zero.reference import cpu_ctx, train_losses
from zerogpt.compile import find_blocks
from zerogpt.memory_model import ModelShape, block_gather_peak, buffer_bytes, chunk_of_params, estimate
from zerogpt.zero import BucketTensorShardStrategy, TensorShardStrategy

VOCAB, SEQ, LAYERS, HIDDEN = 128, 16, 4, 64
SHAPE = ModelShape(layers=LAYERS, hidden=HIDDEN, heads=2, vocab=VOCAB, positions=SEQ)
BUCKETS = [0, 0.02]  # TensorShardStrategy; ~5K fp32 elements, so chunks straddle parameters and blocks


def build(bucket_mb: float, prefetch: int):
    """The tiny GPT (4 blocks) on a world-1 stage-3 engine in fp32, its blocks hooked whole."""
    torch.manual_seed(0)
    model = gpt2_tiny(vocab_size=VOCAB, max_position_embeddings=SEQ, n_layer=LAYERS)
    strategy = BucketTensorShardStrategy(bucket_mb=bucket_mb) if bucket_mb else TensorShardStrategy()
    cfg = zerogpt.Config(dict(zero=dict(stage=3, shard_strategy=strategy, prefetch=prefetch), precision="fp32"))
    engine = zerogpt.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=cfg, ctx=cpu_ctx())
    engine.gather_hooks.gather_per_block(find_blocks(engine.module))
    return engine


def gathered_at_once(engine, steps: int = 3) -> list[tuple[int, int]]:
    """Per training step: the most chunks, and the most elements, gathered at once (sampled after every gather,
    prefetches included: nothing else adds a gathered chunk)."""
    peaks = []
    for chunk in engine.chunks:
        def gather(async_op: bool = False, original=chunk.gather) -> None:
            original(async_op)
            held = [c.full_buffer for c in engine.chunks if c.full_buffer is not None]
            peaks[-1] = (max(peaks[-1][0], len(held)), max(peaks[-1][1], sum(b.numel() for b in held)))
        chunk.gather = gather
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        peaks.append((0, 0))
        train_losses(engine, torch.randint(0, VOCAB, (1, 2, SEQ + 1), generator=g))
    return peaks


@pytest.fixture(autouse=True)
def one_thread():
    torch.set_num_threads(1)


def most_chunks_per_block(bucket_mb: float) -> int:
    owners = [module for module, _ in SHAPE.param_numels()]
    chunk_of = chunk_of_params([n for _, n in SHAPE.param_numels()], 4, bucket_mb)
    return max(len({c for owner, c in zip(owners, chunk_of) if owner == f"h.{i}"}) for i in range(LAYERS))


@pytest.mark.parametrize("bucket_mb", BUCKETS)
def test_chunks_are_packed_as_the_engine_packs_them(bucket_mb):
    torch.manual_seed(0)
    plain = gpt2_tiny(vocab_size=VOCAB, max_position_embeddings=SEQ, n_layer=LAYERS)
    names = [name for name, _ in plain.named_parameters()]
    numels = [n for _, n in SHAPE.param_numels()]
    assert numels == [p.numel() for p in plain.parameters()]  # model_zoo's registration order
    engine = build(bucket_mb, prefetch=2)
    engine_chunk = {slot.name: chunk.plan.index for chunk in engine.chunks for slot in chunk.plan.slots}
    engine.close()
    assert chunk_of_params(numels, 4, bucket_mb) == [engine_chunk[name] for name in names]


@pytest.mark.parametrize("bucket_mb", BUCKETS)
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_compiled_stage3_counts_the_chunks_the_engine_gathers_at_once(bucket_mb, prefetch):
    """block_gather_peak (what buffer_bytes(gather_per_block=True) counts) is the most chunks and elements the
    engine holds gathered at once once the order is recorded and prefetch hits (the first step, with nothing
    recorded, no more)."""
    engine = build(bucket_mb, prefetch)
    num_chunks = len(engine.chunks)
    peaks = gathered_at_once(engine)
    engine.close()
    chunks, elements = block_gather_peak(SHAPE, "fp32", prefetch, bucket_mb)
    assert peaks[1:] == [(chunks, elements)] * (len(peaks) - 1), (peaks, chunks, elements)
    assert peaks[0][0] <= chunks and peaks[0][1] <= elements  # nothing recorded: no prefetch
    assert chunks < num_chunks  # the model is deep enough for the count to mean something
    assert chunks >= most_chunks_per_block(bucket_mb) + 1  # a whole block's beside the tied embedding's
    # the bytes: stage 3's buffers less stage 2's (the grad chunks in flight) are the gathered elements
    gathered = (buffer_bytes(SHAPE, 3, 1, "fp32", "none", prefetch, bucket_mb, gather_per_block=True)["device"]
                - buffer_bytes(SHAPE, 2, 1, "fp32", "none", prefetch, bucket_mb)["device"])
    assert gathered == elements * 4
    # what the eager count (current chunk + prefetch, each at the largest chunk's size) would say: too little
    eager = (buffer_bytes(SHAPE, 3, 1, "fp32", "none", prefetch, bucket_mb)["device"]
             - buffer_bytes(SHAPE, 2, 1, "fp32", "none", prefetch, bucket_mb)["device"])
    assert eager < gathered


def test_estimate_takes_gather_per_block():
    eager = estimate(SHAPE, 3, 1, "fp32", prefetch=2, bucket_mb=0)
    whole = estimate(SHAPE, 3, 1, "fp32", prefetch=2, bucket_mb=0, gather_per_block=True)
    assert whole["totals"]["device"] - eager["totals"]["device"] == (whole["buffers"]["device"]
                                                                     - eager["buffers"]["device"]) > 0
    # stages 0-2 gather nothing: the flag changes nothing there
    assert estimate(SHAPE, 2, 1, gather_per_block=True) == estimate(SHAPE, 2, 1)
