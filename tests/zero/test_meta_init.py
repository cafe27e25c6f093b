"""A model_zoo GPT built under torch.device("meta"): initialize() fills each rank's shards from GPT.init_param_range
(zero/meta_init.py) with bit-exactly the weights of plain construction with the same seed, at stages 1 and 3 on 2
gloo ranks; it then trains exactly like the plainly built model, never holds the whole model on a rank, and a meta
model the engine cannot fill is a clear error.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import zerogpt
from model_zoo.gpt import GPT, gpt2_medium, gpt2_tiny
from tests.dist_utils import run_distributed
from tests.zero.init_checks import LargestAllocation, mean_losses
from tests.zero.reference import cpu_ctx
from zerogpt.zero import BucketTensorShardStrategy

SEED = 77
# wte (1536, 48): two init blocks, cut by the shards; odd widths pad every chunk; dropout: the RNG stream matters
MODEL = dict(vocab_size=1500, n_embd=48, n_head=3, n_inner=100, max_position_embeddings=37, dropout=0.1)
STEPS = 2


def build(meta: bool) -> GPT:
    torch.manual_seed(SEED)
    with torch.device("meta") if meta else contextlib.nullcontext():
        return gpt2_tiny(**MODEL)


def make_config(stage: int) -> zerogpt.Config:
    return zerogpt.Config(dict(zero=dict(stage=stage, shard_strategy=BucketTensorShardStrategy(bucket_mb=0.1))))


# ----------------------------------------------------------------------------------------------
# on 2 gloo ranks: the weights and the training of a plain build


def _train(rank: int, world: int) -> dict:
    out = {}
    for stage in (1, 3):
        for meta in (False, True):
            model = build(meta)
            engine = zerogpt.initialize(model, torch.optim.AdamW(model.parameters(), lr=3e-3),
                                        config=make_config(stage), ctx=cpu_ctx(rank, world))
            left_meta = [n for n, p in model.named_parameters() if p.is_meta]
            tied = model.lm_head.weight is model.transformer.wte.weight
            init = engine.state_dict_full()
            losses = mean_losses(engine, MODEL["vocab_size"], STEPS, rank, world)
            out[(stage, meta)] = dict(init=init, losses=losses, final=engine.state_dict_full(), left_meta=left_meta,
                                      tied=tied, num_chunks=len(engine.chunks))
            engine.close()
    return out


@pytest.mark.timeout(240)
def test_meta_build_holds_the_plain_weights_and_trains_identically():
    results = run_distributed(_train, 2, timeout=220)[0]
    expected = {n: p.detach() for n, p in build(meta=False).named_parameters()}
    for stage in (1, 3):
        plain, meta = results[(stage, False)], results[(stage, True)]
        assert meta["num_chunks"] > 1 and meta["left_meta"] == [] and meta["tied"], stage
        assert set(meta["init"]) == set(expected), stage
        for n, t in expected.items():  # the plain GPT(config) of this process, same seed
            assert torch.equal(meta["init"][n], t), f"stage {stage}: {n}"
        assert meta["losses"] == plain["losses"], stage  # same values, layout and dropout stream: bit for bit
        for n, t in plain["final"].items():
            assert torch.equal(meta["final"][n], t), f"stage {stage}: {n} after {STEPS} steps"
        assert not torch.equal(meta["final"]["transformer.wpe.weight"], expected["transformer.wpe.weight"])


# ----------------------------------------------------------------------------------------------
# memory: a GPT-2 medium-wide model on meta at stage 3 never holds the whole model on a rank


def _medium(rank: int, world: int) -> dict:
    import os

    # No shared-memory transport (this spawned process only): the engine would open it inside the watch, and
    # its staging buffer is communication, not model state.
    os.environ["ZEROGPT_SHM_COMM"] = "0"
    watch = LargestAllocation()
    with watch:
        with torch.device("meta"):
            model = gpt2_medium(n_layer=6)  # medium's widths (1024, vocab 50257); 6 of its 24 layers keep it fast
        model_bytes = sum(p.numel() for p in model.parameters()) * 4
        engine = zerogpt.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                    config=zerogpt.Config(dict(zero=dict(stage=3))), ctx=cpu_ctx(rank, world))
    out = dict(max_bytes=watch.max_bytes, largest_shard=max(c.plan.shard_numel for c in engine.chunks) * 4,
               params_bytes=sum(engine.memory_stats()["params"].values()), num_chunks=len(engine.chunks),
               model_bytes=model_bytes)
    engine.close()
    return out


@pytest.mark.timeout(300)
def test_medium_width_gpt_on_meta_at_stage_3_never_holds_the_whole_model():
    world = 2
    for r in run_distributed(_medium, world, timeout=280):
        assert r["model_bytes"] > 5e8, r  # 128M parameters, fp32
        # one chunk shard (or one init block) at a time, the rank's shards at rest: 1/N, plus padding
        assert r["max_bytes"] <= r["largest_shard"] < r["model_bytes"] / 4, r
        assert r["params_bytes"] <= r["model_bytes"] / world + 4 * r["num_chunks"], r


# ----------------------------------------------------------------------------------------------
# in one process: what the engine cannot fill


def _initialize(model: nn.Module) -> None:
    engine = zerogpt.initialize(model, torch.optim.AdamW(model.parameters()), config=make_config(3),
                                ctx=cpu_ctx())
    engine.close()


def test_a_meta_model_the_engine_cannot_fill_is_a_clear_error():
    with torch.device("meta"):
        linear = nn.Linear(4, 3)
    with pytest.raises(ValueError, match="'weight' is on the meta device.*Linear has no init_param_range"):
        _initialize(linear)

    model = build(meta=True)
    model.register_buffer("scale", torch.ones(3, device="meta"))
    with pytest.raises(ValueError, match="buffer 'scale' of GPT is on the meta device"):
        _initialize(model)

    model = build(meta=True)
    model.init_param_range = lambda name, start, end: torch.zeros(1)
    with pytest.raises(ValueError, match=r"GPT.init_param_range\('transformer.wte.weight', 0, \d+\) returned 1 "
                                         r"values; it must return a tensor of end - start"):
        _initialize(model)


@pytest.mark.parametrize("stage, precision", [(0, "fp32"), (2, "bf16")])
def test_one_rank_meta_build_equals_plain_build_in_the_compute_dtype(stage, precision):
    states = []
    for meta in (False, True):
        model = build(meta)
        cfg = zerogpt.Config(dict(zero=dict(stage=stage), precision=precision))
        engine = zerogpt.initialize(model, torch.optim.AdamW(model.parameters()), config=cfg, ctx=cpu_ctx())
        states.append({n: p.detach().clone() for n, p in model.named_parameters()})  # compute dtype, gathered
        engine.close()
    assert all(t.dtype == (torch.bfloat16 if precision == "bf16" else torch.float32) for t in states[1].values())
    for n, t in states[0].items():
        assert torch.equal(states[1][n], t), n


def test_real_parameters_of_a_meta_model_are_kept():
    """A meta GPT whose embedding was given real weights keeps them; the rest comes from init_param_range."""
    plain, model = build(meta=False), build(meta=True)
    wpe = torch.arange(float(plain.transformer.wpe.weight.numel())).view_as(plain.transformer.wpe.weight)
    model.transformer.wpe.weight = nn.Parameter(wpe.clone())
    engine = zerogpt.initialize(model, torch.optim.AdamW(model.parameters()), config=make_config(1),
                                ctx=cpu_ctx())
    state = engine.state_dict_full()
    engine.close()
    assert torch.equal(state["transformer.wpe.weight"], wpe)
    assert torch.equal(state["transformer.h.0.mlp.c_fc.weight"], plain.transformer.h[0].mlp.c_fc.weight)
