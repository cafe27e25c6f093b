"""zerogpt/memory_model.py's stage-3 chunk buffers: the chunks the model packs and the most it says are gathered
at once (`gather_peak`), against the engine's own chunks and what it really holds gathered at once, with eager
per-module hooks and with the blocks gathered whole (`compile = True`; tiny GPT, world 1 on the CPU; the hooks are
moved as compile_blocks moves them, nothing is compiled).

(The ZeRO formulas, activations and the CLI are tested in tests/zerogpt_tools/test_estimate.py.)
"""
from __future__ import annotations

import pytest
import torch

import zerogpt
from model_zoo.gpt import gpt2_tiny
from tests.zero.reference import cpu_ctx, train_losses
from zerogpt.compile import find_blocks
from zerogpt.memory_model import ModelShape, buffer_bytes, chunk_of_params, estimate, gather_peak
from zerogpt.zero import BucketTensorShardStrategy, TensorShardStrategy

VOCAB, SEQ, LAYERS, HIDDEN = 128, 16, 4, 64
SHAPE = ModelShape(layers=LAYERS, hidden=HIDDEN, heads=2, vocab=VOCAB, positions=SEQ)
# (blocks, bucket_mb): 4 blocks with TensorShardStrategy, and with ~5K-element fp32 chunks that straddle parameters
# and blocks; 8 blocks with ~73K-element chunks, larger than a block (50K), so a block may lie wholly in chunks that
# backward gathered for the block after it: it gathers nothing new and adds nothing to the recorded order
CASES = [(4, 0), (4, 0.02), (8, 0.28)]


def shape_of(layers: int) -> ModelShape:
    return ModelShape(layers=layers, hidden=HIDDEN, heads=2, vocab=VOCAB, positions=SEQ)


def build(bucket_mb: float, prefetch: int, per_block: bool = True, layers: int = LAYERS):
    """The tiny GPT on a world-1 stage-3 engine in fp32, its blocks hooked whole (or, without `per_block`, every
    parameter-owning module hooked: the eager default)."""
    torch.manual_seed(0)
    model = gpt2_tiny(vocab_size=VOCAB, max_position_embeddings=SEQ, n_layer=layers)
    strategy = BucketTensorShardStrategy(bucket_mb=bucket_mb) if bucket_mb else TensorShardStrategy()
    cfg = zerogpt.Config(dict(zero=dict(stage=3, shard_strategy=strategy, prefetch=prefetch), precision="fp32"))
    engine = zerogpt.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=cfg, ctx=cpu_ctx())
    if per_block:
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


def most_chunks_per_block(layers: int, bucket_mb: float) -> int:
    params = shape_of(layers).param_numels()
    chunk_of = chunk_of_params([n for _, n in params], 4, bucket_mb)
    return max(len({c for (owner, _), c in zip(params, chunk_of) if owner.startswith(f"h.{i}.")})
               for i in range(layers))


@pytest.mark.parametrize("layers,bucket_mb", CASES)
def test_chunks_are_packed_as_the_engine_packs_them(layers, bucket_mb):
    torch.manual_seed(0)
    plain = gpt2_tiny(vocab_size=VOCAB, max_position_embeddings=SEQ, n_layer=layers)
    names = [name for name, _ in plain.named_parameters()]
    params = shape_of(layers).param_numels()
    numels = [n for _, n in params]
    assert numels == [p.numel() for p in plain.parameters()]  # model_zoo's registration order
    # the owners are the modules the engine hooks (and the head, which owns wte's weight)
    owners = [name.removeprefix("transformer.").rsplit(".", 1)[0] for name in names]
    assert [owner for owner, _ in params] == owners
    hooked = {name.removeprefix("transformer.") for name, m in plain.named_modules()
              if next(m.parameters(recurse=False), None) is not None}
    assert hooked == set(owners) | {"lm_head"}
    engine = build(bucket_mb, prefetch=2, layers=layers)
    engine_chunk = {slot.name: chunk.plan.index for chunk in engine.chunks for slot in chunk.plan.slots}
    engine.close()
    assert chunk_of_params(numels, 4, bucket_mb) == [engine_chunk[name] for name in names]


def gathered_bytes(shape: ModelShape, prefetch: int, bucket_mb: float, gather_per_block: bool) -> int:
    """Stage 3's buffers less stage 2's (the grad chunks in flight): the gathered chunks' bytes."""
    return (buffer_bytes(shape, 3, 1, "fp32", "none", prefetch, bucket_mb, gather_per_block)["device"]
            - buffer_bytes(shape, 2, 1, "fp32", "none", prefetch, bucket_mb)["device"])


@pytest.mark.parametrize("layers,bucket_mb", CASES)
@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("per_block", [True, False], ids=["blocks-whole", "per-module"])
def test_stage3_estimate_counts_the_chunks_the_engine_gathers_at_once(layers, bucket_mb, prefetch, per_block):
    """gather_peak (what buffer_bytes counts: with gather_per_block, the blocks hooked whole as compile=True does,
    prefetch counted in modules; without, the engine's default per-module hooks, prefetch counted in chunks of the
    recorded order) is the most chunks and elements the engine holds gathered at once once the order is recorded
    and prefetch hits (the first step, with nothing recorded, no more)."""
    shape = shape_of(layers)
    engine = build(bucket_mb, prefetch, per_block=per_block, layers=layers)
    num_chunks = len(engine.chunks)
    peaks = gathered_at_once(engine)
    engine.close()
    chunks, elements = gather_peak(shape, "fp32", prefetch, bucket_mb, per_block=per_block)
    assert peaks[1:] == [(chunks, elements)] * (len(peaks) - 1), (peaks, chunks, elements)
    assert peaks[0][0] <= chunks and peaks[0][1] <= elements  # nothing recorded: no prefetch
    assert chunks < num_chunks  # the model is deep enough for the count to mean something
    assert gathered_bytes(shape, prefetch, bucket_mb, gather_per_block=per_block) == elements * 4
    if per_block:
        assert chunks >= most_chunks_per_block(layers, bucket_mb) + 1  # a whole block's beside the embedding's
        # per-module hooks hold less: a Linear's or LayerNorm's chunks, not a block's
        assert gathered_bytes(shape, prefetch, bucket_mb, gather_per_block=False) < elements * 4


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_gpt2_xl_compiled_holds_at_least_what_eager_holds(prefetch):
    """On GPT-2 XL's shape (stage 3, 8 ranks, bf16, 25 MB chunks) whole blocks hold more gathered than per-module
    hooks, as on the tiny GPT above: the compiled estimate is never the lower one."""
    xl = ModelShape(layers=48, hidden=1600, heads=25)
    eager, whole = (buffer_bytes(xl, 3, 8, "bf16", "none", prefetch, 25.0, gather_per_block=g)["device"]
                    for g in (False, True))
    assert whole >= eager, (prefetch, eager, whole)


def test_estimate_takes_gather_per_block():
    eager = estimate(SHAPE, 3, 1, "fp32", prefetch=2, bucket_mb=0)
    whole = estimate(SHAPE, 3, 1, "fp32", prefetch=2, bucket_mb=0, gather_per_block=True)
    assert whole["totals"]["device"] - eager["totals"]["device"] == (whole["buffers"]["device"]
                                                                     - eager["buffers"]["device"]) > 0
    # stages 0-2 gather nothing: the flag changes nothing there
    assert estimate(SHAPE, 2, 1, gather_per_block=True) == estimate(SHAPE, 2, 1)
