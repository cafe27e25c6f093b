"""Tests for model_zoo/weight_init.py through GPT.init_param_range: GPT-2's init statistics, any split of a
parameter equal to the whole, a meta build filled range by range equal to a plain build, and the RNG draws."""
from __future__ import annotations

import math

import pytest
import torch

from model_zoo.gpt import GPT, GPTConfig, gpt2_medium, gpt2_tiny
from model_zoo.weight_init import INIT_BLOCK
from tests.model_zoo.tiny_gpt import tiny


def test_gpt2_initialisation():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=1000, n_layer=8, n_head=4, n_embd=256, max_position_embeddings=64))
    h = model.transformer.h
    proj = torch.cat([torch.cat([b.attn.c_proj.weight.flatten(), b.mlp.c_proj.weight.flatten()]) for b in h])
    fc = torch.cat([torch.cat([b.attn.c_attn.weight.flatten(), b.mlp.c_fc.weight.flatten()]) for b in h])
    assert proj.std().item() == pytest.approx(0.02 / math.sqrt(2 * 8), rel=0.02)  # GPT-2 scaled residual init
    assert fc.std().item() == pytest.approx(0.02, rel=0.02)
    assert model.transformer.wte.weight[:1000].std().item() == pytest.approx(0.02, rel=0.05)
    assert model.transformer.wte.weight[1000:].abs().max() == 0
    assert all(b.attn.c_attn.bias.abs().max() == 0 and torch.all(b.ln_1.weight == 1) for b in h)
    assert all(torch.all(b.ln_2.bias == 0) and torch.all(b.mlp.c_fc.bias == 0) for b in h)
    assert torch.all(model.transformer.ln_f.weight == 1) and torch.all(model.transformer.ln_f.bias == 0)
    assert model.transformer.wpe.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert abs(fc.mean().item()) < 1e-3 and abs(proj.mean().item()) < 1e-3


# wte is (1536, 48) = 73,728 elements: two init blocks (INIT_BLOCK = 65,536), the second one short
MULTI_BLOCK = dict(vocab_size=1500, n_embd=48, n_head=3, n_inner=100, max_position_embeddings=37)


def multi_block(seed: int = 0, meta: bool = False) -> GPT:
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            return gpt2_tiny(**MULTI_BLOCK)
    return gpt2_tiny(**MULTI_BLOCK)


def test_init_param_range_over_any_split_equals_the_whole_parameter():
    model = multi_block()
    numel = model.transformer.wte.weight.numel()
    assert numel > INIT_BLOCK and numel % INIT_BLOCK
    whole = model.transformer.wte.weight.detach().reshape(-1)
    g = torch.Generator().manual_seed(0)
    # cuts at, around and far from the block boundary and the first padded row; pieces shorter than 16 elements
    # (torch's randn takes another path under 16) and longer than a block
    fixed = [0, 3, 17, INIT_BLOCK - 1, INIT_BLOCK, INIT_BLOCK + 1, 1500 * 48 - 1, 1500 * 48 + 5, numel]
    random_cuts = torch.randint(1, numel, (20,), generator=g).tolist()
    for cuts in (fixed, sorted({0, numel, *random_cuts}), [0, numel]):
        pieces = [model.init_param_range("transformer.wte.weight", a, b) for a, b in zip(cuts, cuts[1:])]
        assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in pieces)
        assert torch.equal(torch.cat(pieces), whole), cuts
    assert model.init_param_range("transformer.wte.weight", 5, 5).shape == (0,)
    assert torch.equal(model.init_param_range("lm_head.weight", 10, 99), whole[10:99])  # the tied name


def test_meta_build_initialised_range_by_range_equals_plain_construction():
    plain, meta = multi_block(seed=3), multi_block(seed=3, meta=True)
    assert all(p.is_meta for p in meta.parameters()) and meta.init_seed == plain.init_seed
    for (name, p), (meta_name, q) in zip(plain.named_parameters(), meta.named_parameters()):
        assert name == meta_name and q.is_meta
        step = max(1, p.numel() // 3 + 7)  # uneven pieces, as shards cut them
        got = torch.cat([meta.init_param_range(name, a, min(a + step, p.numel())) for a in range(0, p.numel(), step)])
        assert torch.equal(got, p.detach().reshape(-1)), name


def test_manual_seed_decides_the_weights_and_construction_draws_once():
    a, b, c = multi_block(seed=5), multi_block(seed=5), multi_block(seed=6)
    assert a.init_seed == b.init_seed != c.init_seed
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.transformer.h[0].attn.c_attn.weight, c.transformer.h[0].attn.c_attn.weight)
    # every build path leaves the CPU RNG where one draw leaves it, so dropout afterwards is the same
    torch.manual_seed(5)
    torch.randint(0, 2**62, ())
    after_one_draw = torch.get_rng_state()
    for meta in (False, True):
        multi_block(seed=5, meta=meta)
        assert torch.equal(torch.get_rng_state(), after_one_draw), meta


def test_meta_build_skips_the_init(monkeypatch):
    def fail(*args):
        raise AssertionError("a meta build must not compute init values")

    monkeypatch.setattr(GPT, "init_param_range", fail)
    with torch.device("meta"):
        model = gpt2_medium()
    assert all(p.is_meta for p in model.parameters())


def test_init_param_range_errors_name_the_parameter_and_the_range():
    model = tiny()
    with pytest.raises(KeyError, match="no parameter 'transformer.h.9.attn.c_attn.weight'"):
        model.init_param_range("transformer.h.9.attn.c_attn.weight", 0, 1)
    with pytest.raises(ValueError, match=r"init_param_range\('transformer.wpe.weight', 10, 2049\).*2048 elements"):
        model.init_param_range("transformer.wpe.weight", 10, 2049)
    with pytest.raises(ValueError, match="0 <= start <= end"):
        model.init_param_range("transformer.ln_f.bias", 5, 4)
