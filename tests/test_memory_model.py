"""zerogpt/memory_model.py's stage-3 chunk buffers: the chunks the model packs and the most it says are gathered
at once (`gather_peak`), against the engine's own chunks and what it really holds gathered at once, with eager
per-module hooks and with the blocks gathered whole (`compile = True`; tiny GPT, world 1 on the CPU; the hooks are
moved as compile_blocks moves them, nothing is compiled). The Llama family's shapes: parameters against model_zoo's
Llama built on meta, per-layer activations against what autograd saves, the gather peak against the engine's.

(The ZeRO formulas, activations and the CLI are tested in tests/zerogpt_tools/test_estimate.py.)
"""
from __future__ import annotations

import json
import os

import pytest
import torch

import zerogpt
from model_zoo.gpt import gpt2_tiny
from tests.zero.reference import cpu_ctx, train_losses
from zerogpt.compile import find_blocks
from zerogpt.memory_model import ModelShape, activation_bytes, buffer_bytes, chunk_of_params, estimate, gather_peak
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
    eager = estimate(SHAPE, 3, 2, "fp32", prefetch=2, bucket_mb=0)  # 2 ranks: one rank's shard is its whole chunk
    whole = estimate(SHAPE, 3, 2, "fp32", prefetch=2, bucket_mb=0, gather_per_block=True)
    assert whole["totals"]["device"] - eager["totals"]["device"] == (whole["buffers"]["device"]
                                                                     - eager["buffers"]["device"]) > 0
    # stages 0-2 gather nothing: the flag changes nothing there
    assert estimate(SHAPE, 2, 1, gather_per_block=True) == estimate(SHAPE, 2, 1)


# -- the Llama family: GQA, SwiGLU, RMSNorm, optional qkv bias / qk-norm, tied or untied head -------------------

LLAMA_TINY = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=176, num_hidden_layers=LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
LLAMA_VARIANTS = {"untied": {}, "qkv-bias-qk-norm": dict(qkv_bias=True, qk_norm=True, head_dim=32),
                  "tied": dict(tie_word_embeddings=True)}


def llama(**overrides):
    from model_zoo.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    return Llama(LlamaConfig(**{**LLAMA_TINY, **overrides}))


@pytest.mark.parametrize("name", ["llama3_8b", "qwen2_5_7b", "qwen3_0_6b"])
def test_llama_shapes_count_the_meta_built_models_parameters(name):
    """num_params and param_numels (registration order, owning modules) of the real shapes against model_zoo's
    Llama built on the meta device: GQA and an untied 128k vocabulary (Llama-3.1-8B), q/k/v biases (Qwen2.5-7B),
    qk-norm, an explicit head_dim and a tied head (Qwen3-0.6B)."""
    from model_zoo import llama as family

    with torch.device("meta"):
        model = getattr(family, name)()
    shape = ModelShape.from_config(model.config)
    assert shape.num_params == model.num_params() == sum(p.numel() for p in model.parameters())
    assert shape.param_numels() == [(n.rsplit(".", 1)[0], p.numel()) for n, p in model.named_parameters()]
    assert shape.layer_params == sum(p.numel() for p in model.model.layers[0].parameters())
    assert shape.largest_param == max(p.numel() for p in model.parameters())
    written = dict(  # the same shapes written out by hand, as the estimate's users write them
        llama3_8b=ModelShape(32, 4096, 32, 128256, family="llama", kv_heads=8, ffn=14336, tied=False),
        qwen2_5_7b=ModelShape(28, 3584, 28, 152064, family="llama", kv_heads=4, ffn=18944, qkv_bias=True,
                              tied=False),
        qwen3_0_6b=ModelShape(28, 1024, 16, 151936, family="llama", kv_heads=8, head_dim=128, ffn=3072,
                              qk_norm=True))[name]
    assert written.param_numels() == shape.param_numels()
    assert {"llama3_8b": 8_030_261_248, "qwen2_5_7b": 7_615_616_512, "qwen3_0_6b": 596_049_920}[name] == \
        shape.num_params  # the published counts (Llama-3.1-8B: 8.03B; Qwen2.5-7B: 7.61B; Qwen3-0.6B: 0.6B)


@pytest.mark.parametrize("variant", LLAMA_VARIANTS)
def test_llama_modules_run_in_forward_modules_order(variant):
    """The hooked modules (those owning parameters) run in ModelShape.forward_modules' order, the head last: a
    block's q_norm/k_norm before o_proj, which registers before them."""
    model = llama(**LLAMA_VARIANTS[variant])
    ran = []
    for name, module in model.named_modules():
        if next(module.parameters(recurse=False), None) is not None or name == "lm_head":
            module.register_forward_pre_hook(lambda m, args, name=name: ran.append(name))
    model(torch.randint(0, VOCAB, (1, SEQ)))
    assert ran == ModelShape.from_config(model.config).forward_modules()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("variant", [*LLAMA_VARIANTS, "mqa"])
def test_llama_layer_activations_are_what_autograd_saves(variant, precision):
    """activation_bytes' per-layer Llama term is exactly the bytes autograd keeps for backward in one DecoderLayer
    (unique storages; parameters and the shared RoPE tables aside), and `embeddings` is those RoPE tables."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    model = llama(**(LLAMA_VARIANTS.get(variant) or dict(num_key_value_heads=1))).to(dtype)
    B, T = 2, 24
    cos, sin = model.rope(0, T, dtype)
    skip = {t.untyped_storage().data_ptr() for t in [cos, sin, *model.parameters()]}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x = torch.randn(B, T, HIDDEN, dtype=dtype, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model.layers[0](x, cos, sin)
    acts = activation_bytes(ModelShape.from_config(model.config), T, B, precision)
    assert acts["per_layer"] == sum(saved.values())
    assert acts["embeddings"] == cos.nbytes + sin.nbytes


def test_llama_activations_against_gpt2s():
    """Llama-3-8B's layer keeps 49 sbh bytes in bf16 (norms 16, attention 5 with 8 of 32 heads for k/v, SwiGLU 28)
    where GPT-2's keeps 32; the chunked loss keeps one chunk's logits; checkpointing keeps each block's input."""
    shape = ModelShape(32, 4096, 32, 128256, family="llama", kv_heads=8, ffn=14336, tied=False)
    s, b = 1024, 2
    sb, sbh = s * b, s * b * 4096
    acts = activation_bytes(shape, s, b, "bf16")
    assert acts["per_layer"] == 49 * sbh + 2 * 4 * sb + 4 * 32 * sb  # + the fp32 rsqrt and logsumexp rows
    gpt2 = activation_bytes(ModelShape(32, 4096, 32, 128256), s, b, "bf16")
    assert gpt2["per_layer"] == 32 * sbh
    chunked = activation_bytes(shape, s, b, "bf16", checkpoint=True, loss_chunk=256)
    # the hidden states' and the head's gradients, made in the forward and held to backward, and one chunk's
    # 256 x 128256 logits, 4 + 2 bytes each
    saved = (sb + shape.padded_vocab) * 4096 * 2
    assert acts["logits"] - chunked["logits"] == sb * 128256 * 12 - saved - 256 * 128256 * (4 + 2)
    assert chunked["layers"] == 32 * 2 * sbh + acts["per_layer"]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_plain_loss_peaks_at_12_bytes_per_logit_in_its_backward(dtype):
    """GPTLMLoss as the Trainer runs it (logits dropped before backward): measured with the trial's CPU measure,
    forward then backward, against activation_bytes' logits term (GPT-2: no final norm in it)."""
    import torch
    from model_zoo import GPTLMLoss
    from zerogpt.amp import compute_dtype
    from zerogpt.planner.live_bytes import LiveBytes

    tokens, vocab, hidden = 256, 1024, 32
    torch.manual_seed(0)
    x = torch.randn(1, tokens, hidden, requires_grad=True)
    head = torch.randn(vocab, hidden, dtype=compute_dtype(dtype), requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens))
    with LiveBytes() as live:
        logits = x.to(head.dtype) @ head.t()
        loss = GPTLMLoss(shift=False)(logits, labels)
        forward = live.peak
        del logits
        loss.backward()
    predicted = activation_bytes(ModelShape(1, hidden, 1, vocab), tokens, 1, dtype)["logits"]
    per_logit = tokens * vocab
    assert forward < live.peak  # the backward's, not the forward's
    assert predicted <= live.peak <= predicted + 2 * tokens * hidden * 4 + per_logit // 8  # + x's copy and grad


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_the_chunked_loss_holds_its_gradients_and_one_chunk(dtype):
    """model_zoo's chunked loss (the "torch" backend), forward then backward, measured with the trial's CPU measure
    against activation_bytes' logits term: the two gradients it makes in its forward and one chunk's logits; and the
    chunk rule is model_zoo's (LOSS_MIN_CHUNKS)."""
    import torch
    from model_zoo.loss import MIN_CHUNKS, chunk_tokens, chunked_cross_entropy
    from zerogpt.amp import compute_dtype
    from zerogpt.memory_model import LOSS_MIN_CHUNKS, loss_chunk_tokens
    from zerogpt.planner.live_bytes import LiveBytes

    assert LOSS_MIN_CHUNKS == MIN_CHUNKS
    assert all(loss_chunk_tokens(n, c) == chunk_tokens(n, c) for n in (1, 7, 64, 1000) for c in (1, 16, 1024))
    tokens, vocab, hidden = 512, 1000, 32  # the head padded to 1024 rows
    shape = ModelShape(1, hidden, 1, vocab)
    torch.manual_seed(0)
    x = torch.randn(tokens, hidden, dtype=compute_dtype(dtype), requires_grad=True)
    head = torch.randn(shape.padded_vocab, hidden, dtype=x.dtype, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,))
    with LiveBytes() as live:
        chunked_cross_entropy(x, head, labels, vocab_size=vocab, chunk_size=1024, backend="torch").backward()
    predicted = activation_bytes(shape, tokens, 1, dtype, loss_chunk=1024)["logits"]
    assert predicted <= live.peak <= predicted * 1.05, (predicted, live.peak)


def test_llama_shape_checks():
    with pytest.raises(ValueError, match="needs ffn"):
        ModelShape(2, 64, 4, family="llama")
    with pytest.raises(ValueError, match="no position table"):
        ModelShape(2, 64, 4, positions=16, family="llama", ffn=128)
    with pytest.raises(ValueError, match=r"heads \(4\) must be a multiple of kv_heads \(3\)"):
        ModelShape(2, 64, 4, family="llama", kv_heads=3, ffn=128)
    with pytest.raises(ValueError, match="kv_heads=2 is a llama-family option"):
        ModelShape(2, 64, 4, kv_heads=2)
    with pytest.raises(ValueError, match="family='llamma' is not valid"):
        ModelShape(2, 64, 4, family="llamma")
    assert ModelShape.from_config(object()) is None


@pytest.mark.parametrize("bucket_mb", [0, 0.02])
@pytest.mark.parametrize("per_block", [True, False], ids=["blocks-whole", "per-module"])
@pytest.mark.parametrize("variant", LLAMA_VARIANTS)
def test_llama_stage3_gather_peak_is_the_engines(variant, per_block, bucket_mb):
    """The Llama chunks pack as the engine packs them, and gather_peak is the most the engine holds gathered at once
    (stage 3, world 1, fp32, prefetch 2), per-module and with the blocks whole, tied and untied heads."""
    model = llama(**LLAMA_VARIANTS[variant])
    shape = ModelShape.from_config(model.config)
    names = [name for name, _ in model.named_parameters()]
    strategy = BucketTensorShardStrategy(bucket_mb=bucket_mb) if bucket_mb else TensorShardStrategy()
    cfg = zerogpt.Config(dict(zero=dict(stage=3, shard_strategy=strategy, prefetch=2), precision="fp32"))
    engine = zerogpt.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=cfg, ctx=cpu_ctx())
    engine_chunk = {slot.name: chunk.plan.index for chunk in engine.chunks for slot in chunk.plan.slots}
    assert chunk_of_params([n for _, n in shape.param_numels()], 4, bucket_mb) == [engine_chunk[n] for n in names]
    if per_block:
        engine.gather_hooks.gather_per_block(find_blocks(engine.module))
    peaks = gathered_at_once(engine)
    engine.close()
    expected = gather_peak(shape, "fp32", 2, bucket_mb, per_block=per_block)
    assert peaks[1:] == [expected] * (len(peaks) - 1), (peaks, expected)


def test_one_rank_with_its_shards_on_the_device_gathers_nothing():
    alone = estimate(SHAPE, 3, 1, "fp32", prefetch=2, bucket_mb=0)
    offloaded = estimate(SHAPE, 3, 1, "fp32", offload_param="cpu", prefetch=2, bucket_mb=0)
    assert alone["buffers"]["device"] == buffer_bytes(SHAPE, 2, 1, "fp32", "none", 2, 0)["device"]  # grad chunks
    assert offloaded["buffers"]["device"] > alone["buffers"]["device"]  # the shards' device copies


# ----------------------------------------------------------------------------------------------------------
# the gradients and the activations at accumulation 1; the prediction against a measured live peak (issue 47.6)

def test_gradients_and_activations_overlap_only_at_accumulation_one():
    from zerogpt.memory_model import grads_activations_overlap

    shape = ModelShape(layers=2, hidden=64, heads=2, vocab=256, positions=32)
    for accumulation, overlaps in ((1, True), (2, False)):
        est = estimate(shape, 0, 1, "fp32", seq_len=32, batch=4, gpu_overhead=0, accumulation=accumulation)
        states, acts = est["model_states"], est["activations"]
        grads = states["grads"]["device"]
        # made buffer by buffer as the activations go, the gradients take the place of all of them
        assert grads_activations_overlap(states, acts, accumulation) == (min(grads, acts["total"]) if overlaps else 0)
        # this model is one chunk: its buffer is made whole at the first gradient, beside all but the loss's peak
        whole = min(grads, acts["total"] - acts["after_loss"]) if overlaps else 0
        assert est["overlap"] == whole == grads_activations_overlap(states, acts, accumulation, 0, grads)
        assert 0 < whole < grads or not overlaps
        held = sum(sum(home.values()) for home in states.values())
        assert est["totals"]["device"] == held + acts["total"] - est["overlap"]  # not the sum of the two peaks


def _plan_memory():
    import importlib
    import sys

    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
    sys.path.insert(0, bench)
    try:
        return importlib.import_module("plan_memory")
    finally:
        sys.path.remove(bench)


def test_a_cpu_run_holds_once_what_both_homes_count():
    """The device is host RAM on a CPU run: the reduced gradient that crosses once is the host's grad shard, and at
    one rank a gathered chunk is the host's param shard (memory_model.cpu_run_shared_bytes)."""
    shape = ModelShape(layers=2, hidden=64, heads=2, vocab=256, positions=32)
    kw = dict(seq_len=32, batch=4, gpu_overhead=0)

    def both(**plan) -> tuple[dict, dict]:
        return estimate(shape, **plan, **kw), estimate(shape, **plan, **kw, on_gpu=False)

    gpu, cpu = both(stage=0, precision="fp32", offload_optimizer="cpu")  # stage 0 crosses once, at the step
    assert gpu["host_ram"] == gpu["totals"]["host"] and gpu["shared"] == 0
    grads = cpu["model_states"]["grads"]
    assert cpu["shared"] == min(grads["host"], grads["device"]) > 0
    gpu, cpu = both(stage=3, precision="fp32", offload_optimizer="cpu", offload_param="cpu", accumulation=2)
    from zerogpt.memory_model import gathered_bytes

    params = cpu["model_states"]["params"]["host"]  # summed over micro-steps on the host: grads not shared
    gathered = gathered_bytes(shape, 3, 1, "fp32", offload_param="cpu")
    assert cpu["shared"] == min(params, gathered) > 0
    whole = sum(sum(h for home, h in by.items() if home != "disk") for by in cpu["model_states"].values())
    # accumulation 2: gradients held through the micro-steps overlap nothing; the first buffer backward fills only
    # the loss's backward peak, gone by then
    acts = cpu["activations"]
    assert 0 < cpu["overlap"] <= acts["total"] - acts["after_loss"]
    assert cpu["host_ram"] == (whole + cpu["buffers"]["device"] + cpu["buffers"]["host"]
                               + acts["total"] - cpu["overlap"] - cpu["shared"])


def test_above_one_rank_a_cpu_run_shares_no_reduced_gradient():
    """Two ranks, ZeRO-3, optimizer and params offloaded (the issue's 459M Llama run): the reduce-scatter writes a
    new shard, the host's, beside the full buffer, so nothing is held once; at accumulation 1 the gradients backward
    makes, the host's shards and the chunks in flight, overlap the activations in RAM as on the device."""
    from zerogpt.memory_model import grad_chunks_in_flight, largest_chunk

    shape = ModelShape(layers=4, hidden=512, heads=8, vocab=32000, pad_vocab_multiple=1, family="llama", kv_heads=4,
                       ffn=1376, tied=False)
    est = estimate(shape, 3, 2, "fp32", "cpu", "cpu", seq_len=256, batch=2, gpu_overhead=0, on_gpu=False)
    states, acts = est["model_states"], est["activations"]["total"]
    in_flight = grad_chunks_in_flight(shape, 3, 2, "fp32", "cpu")
    first = largest_chunk(shape, 4, 25.0) * 4  # the head's, filled beside the activations still all there
    assert est["shared"] == 0 and est["overlap"] == min(in_flight - first, acts) > 0
    held = est["totals"]["host"] + est["totals"]["device"] + est["overlap"]  # both homes, nothing overlapped
    assert est["host_ram"] == held - min(states["grads"]["host"] + in_flight, acts)


def test_the_step_ahead_of_the_norm_spare_set_is_reported_not_needed():
    """A GPU run with masters on the host steps each chunk into a spare master and moments where the gradient
    crosses once and RAM has room (12 bytes/param, 8 with bf16 moments): reported apart, not in host_ram."""
    shape = ModelShape(layers=2, hidden=64, heads=2, vocab=256, positions=32)
    kw = dict(seq_len=32, batch=4, gpu_overhead=0)
    est = estimate(shape, 3, 2, "bf16", "cpu", "cpu", **kw)
    assert est["speculative_spare"] == -(-shape.num_params // 2) * 12
    assert est["host_ram"] == est["totals"]["host"]
    assert estimate(shape, 3, 2, "bf16", "cpu", "cpu", optimizer_bytes_per_param=4, **kw)["speculative_spare"] \
        == -(-shape.num_params // 2) * 8
    for other in (dict(precision="fp16"), dict(offload_optimizer="none"), dict(accumulation=2),  # summed on the host
                  dict(on_gpu=False)):
        plan = dict(precision="bf16", offload_optimizer="cpu", offload_param="cpu") | other
        assert estimate(shape, 3, 2, **plan, **kw)["speculative_spare"] == 0, other


def test_one_rank_fp32_reduces_into_the_grad_shard_itself():
    """Stage 2-3 at one rank, accumulation 1, fp32, gradients on the device: no gradient chunk in flight beside the
    shard (GradPath._add takes the reduced buffer as the shard); above accumulation 1, or in bf16, two."""
    from zerogpt.memory_model import grad_chunks_in_flight

    shape = ModelShape(layers=2, hidden=64, heads=2, vocab=256, positions=32)
    assert grad_chunks_in_flight(shape, 3, 1, "fp32", "none", 25.0, accumulation=1) == 0
    assert grad_chunks_in_flight(shape, 3, 1, "fp32", "none", 25.0, accumulation=2) > 0
    assert grad_chunks_in_flight(shape, 3, 1, "bf16", "none", 25.0, accumulation=1) > 0
    assert grad_chunks_in_flight(shape, 3, 2, "fp32", "none", 25.0, accumulation=1) > 0
    assert grad_chunks_in_flight(shape, 1, 2, "fp32", "none", 25.0, accumulation=1) == 0  # stage 1: none


@pytest.mark.timeout(600)
@pytest.mark.parametrize("plan, home", [("z0 1x4 bucket 25MB", "device"), ("z3 4x1 bucket 25MB prefetch 2", "device"),
                                        ("z0 opt->cpu(fp32) 4x1 bucket 25MB", "host"),
                                        ("z3 opt->cpu(fp32) param->cpu 1x4 bucket 25MB prefetch 2", "device")])
def test_prediction_within_10_percent_of_the_measured_live_peak(plan, home):
    """bench/plan_memory.py's method on one plan, in a fresh process: the live peak (VmHWM with a 64 KiB mmap
    threshold and every allocation resident whole, as a GPU counts it) of bench/auto_plan.py's 8L-384 GPT (15M
    params, fp32, 4 x 64 tokens per step) against memory_model (2026-11-28e: -3.0%, -4.4%, -3.6%).
    z0 1 x 4 holds the gradients beside a micro-batch's activations (drop them and the device is 26% short); z3
    4 x 1 makes the gradients while it frees the activations, but each chunk's buffer whole at its first gradient
    (let all the gradients take the activations' place and it is 11% under); z0 with the optimizer offloaded holds
    the crossed gradient once on a CPU (count both homes' copies and the host is 15% over). Where there is one
    home, the trial's op count (its CPU device measure) agrees with VmHWM; it measures the device of z3 with the
    optimizer and parameters offloaded, 1 x 4, where it leaves out each micro-step's gradient once the host holds
    it (counted, the prediction is 35% under)."""
    plan_memory = _plan_memory()
    work, _, grid = plan_memory._grid("8L-384")
    index = next(i for i, c in enumerate(grid) if c.plan.describe() == plan)
    measured = plan_memory.measure("8L-384", index, timeout=500)
    assert "error" not in measured, measured
    est = plan_memory.predict(work, grid[index].plan)
    offloaded = plan_memory.offloaded(grid[index].plan)
    got = measured["op_device"] if home == "device" and offloaded else measured["peak"]
    predicted = est["totals"]["device"] if home == "device" else est["host_ram"]
    assert abs(predicted - got) <= 0.10 * got, (predicted, got)
    if home == "device" and not offloaded:
        assert abs(measured["op_device"] - got) <= 0.05 * got, (measured["op_device"], got)


@pytest.mark.timeout(600)
def test_host_ram_within_10_percent_at_two_ranks_with_full_offload(tmp_path):
    """The issue's case, small: a 5.5M Llama from an HF directory, 2 gloo ranks, ZeRO-3, optimizer and params on
    the CPU, fp32 (bench/host_gap.py, after a warm-up, glibc's mmap threshold at 64 KiB so the peak is the live
    one). memory_model's host_ram against each rank's peak (89 MB against 95): leave out the gathered chunks and
    gradient buffers (42 MiB), the activations (26 MiB) or their overlap (counting both: 11% over) and it fails."""
    import json
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "host_gap.py")
    out = tmp_path / "gap.json"
    args = ["--keep", "off", "--layers", "2", "--hidden", "256", "--ffn", "688", "--heads", "4", "--kv-heads", "2",
            "--vocab", "8000", "--seq", "128", "--cache-dir", str(tmp_path), "--json", str(out)]
    run = subprocess.run([sys.executable, script, *args], env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"},
                         capture_output=True, text=True, timeout=540)
    assert run.returncode == 0 and out.exists(), run.stdout[-2000:] + run.stderr[-2000:]
    for rank in json.loads(out.read_text())["ranks"]:
        predicted, measured = rank["predicted"]["total"], rank["peaks"]["VmHWM"]
        assert abs(predicted - measured) <= 0.10 * measured, (rank["rank"], predicted, measured)


def test_device_predictions_against_the_h200_offload_rows():
    """The recorded H200 rows (bench/results, GPT-2 XL, stage 3, optimizer on the host, checkpointed, plain loss,
    bf16): memory_model's device total, the CUDA context left out, against torch.cuda.max_memory_allocated."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "results",
                        "gpu_h200_2026-11-28_offload.json")
    with open(path) as f:
        rows = [r for r in json.load(f)["rows"] if r["spec"]["system"] == "zerogpt" and "peak_gpu_gib" in r]
    assert len(rows) == 2
    for row in rows:
        spec = row["spec"]
        layers, heads, hidden = spec["shape"]
        est = estimate(ModelShape(layers, hidden, heads, spec["vocab"]), spec["stage"], 1, "bf16", spec["offload"],
                       "none", spec["seq"], spec["batch"], spec["checkpoint"], prefetch=spec["prefetch"] or 2,
                       bucket_mb=spec["bucket_mb"] or 25.0, gpu_overhead=0)
        measured = row["peak_gpu_gib"] * 2**30
        assert abs(est["totals"]["device"] - measured) <= 0.03 * measured, (spec["label"], est["totals"]["device"])


def test_above_accumulation_1_the_first_gradient_buffer_does_not_meet_the_loss_peak():
    """Stage 3 at one rank, fp32, 2 micro-steps: the chunk's gradient buffer is made once the loss's backward is
    done (its fp32 log-probs and gradients gone), so the device peak is the larger of the loss's peak and what is
    left of the activations plus that buffer, not their sum; at accumulation 1 nothing changes."""
    from zerogpt.memory_model import largest_chunk

    shape = ModelShape(layers=2, hidden=128, heads=2, vocab=2048, positions=64)
    two = estimate(shape, 3, precision="fp32", seq_len=64, batch=2, accumulation=2, gpu_overhead=0)
    acts = two["activations"]
    chunk = largest_chunk(shape, 4, 25.0) * 4
    assert acts["total"] - acts["after_loss"] == 64 * 2 * 2048 * (12 - 4)  # the loss's peak less its fp32 gradient
    assert two["overlap"] == min(chunk, acts["total"] - acts["after_loss"]) > 0
    from zerogpt.memory_model import grad_chunks_in_flight, grads_activations_overlap

    one = estimate(shape, 3, precision="bf16", seq_len=64, batch=4, gpu_overhead=0)  # a bf16 chunk in flight
    in_flight = grad_chunks_in_flight(shape, 3, 1, "bf16", "none")
    beside = min(in_flight, largest_chunk(shape, 2, 25.0) * 2)
    assert beside > 0
    assert one["overlap"] == grads_activations_overlap(one["model_states"], one["activations"], 1, in_flight - beside)
