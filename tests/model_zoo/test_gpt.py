"""Tests for model_zoo/gpt.py: shapes, parameter counts, tying, vocab padding, init, checkpointing, KV cache,
the loss, factories, and the ZeRO-3 promise (every parameter is used inside its owning module's forward)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from model_zoo import build_model, builds_on_meta
from model_zoo.gpt import (INIT_BLOCK, GPT, GPTConfig, GPTLMLoss, GPTOutput, gpt2_large, gpt2_medium, gpt2_small,
                           gpt2_tiny, gpt2_xl)


def tiny(**kw) -> GPT:
    torch.manual_seed(0)
    return gpt2_tiny(vocab_size=100, max_position_embeddings=32, **kw)


def ids(batch=2, seq=16, vocab=100, seed=1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_logits_shape_is_the_real_vocab_and_labels_give_a_loss():
    model = tiny()
    x = ids()
    logits = model(x)
    assert logits.shape == (2, 16, 100) and model.config.padded_vocab_size == 128
    y = ids(seed=2)
    out = model(x, labels=y)
    assert isinstance(out, GPTOutput) and out.loss.shape == () and torch.equal(out.logits, logits)
    assert torch.allclose(out.loss, F.cross_entropy(logits.reshape(-1, 100), y.reshape(-1)))


# HF GPT2LMHeadModel parameter counts (vocab 50257); ours add the padded rows up to 50304 (47 rows).
@pytest.mark.parametrize("factory, hf_count, n_head", [
    (gpt2_small, 124_439_808, 12), (gpt2_medium, 354_823_168, 16),
    (gpt2_large, 774_030_080, 20), (gpt2_xl, 1_557_611_200, 25)])
def test_parameter_counts_match_gpt2(factory, hf_count, n_head):
    with torch.device("meta"):  # no memory, no init cost
        model = factory()
    assert model.config.padded_vocab_size == 50304 and model.config.n_head == n_head
    assert model.num_params() == hf_count + 47 * model.config.n_embd
    wpe = model.config.max_position_embeddings * model.config.n_embd
    assert model.num_params(non_embedding=True) == hf_count - wpe


def test_flops_per_token_is_palm_formula():
    model = tiny()
    c = model.config
    n = model.num_params(non_embedding=True)
    assert model.flops_per_token(32) == 6 * n + 12 * c.n_layer * c.n_head * (c.n_embd // c.n_head) * 32


def test_lm_head_owns_the_tied_embedding():
    model = tiny()
    assert model.lm_head.weight is model.transformer.wte.weight
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names and "transformer.wte.weight" in names
    assert {"lm_head.weight", "transformer.wte.weight"} <= set(model.state_dict())
    model(ids(), labels=ids(seed=2)).loss.backward()
    assert model.transformer.wte.weight.grad is model.lm_head.weight.grad


def test_padded_vocab_rows_never_affect_the_loss_and_get_no_gradient():
    model = tiny()
    x, y = ids(), ids(seed=2)
    loss = model(x, labels=y).loss
    with torch.no_grad():
        model.transformer.wte.weight[100:].normal_(0, 100.0)  # garbage in the padding rows
    out = model(x, labels=y)
    assert torch.equal(out.loss, loss)
    out.loss.backward()
    assert model.transformer.wte.weight.grad[100:].abs().max() == 0
    assert model.transformer.wte.weight.grad[:100].abs().max() > 0


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


def test_activation_checkpointing_gives_the_same_grads():
    plain, ckpt = tiny(), tiny(checkpoint=True)
    assert ckpt.config.checkpoint
    x, y = ids(), ids(seed=2)
    for model in (plain, ckpt):
        model(x, labels=y).loss.backward()
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-6, msg=name)


def test_every_parameter_is_used_only_inside_its_owning_module():
    # Simulate ZeRO-3: parameters hold NaN except while a module that owns them (recurse=False) is in forward.
    model = tiny(checkpoint=True).train()
    real = {p: p.detach().clone() for p in model.parameters()}

    def poison(params):
        with torch.no_grad():
            for p in params:
                p.fill_(float("nan"))

    def gather(module, *_):
        with torch.no_grad():
            for p in module.parameters(recurse=False):
                p.copy_(real[p])

    def release(module, *_):
        poison(module.parameters(recurse=False))

    handles = []
    for module in model.modules():
        handles.append(module.register_forward_pre_hook(gather))
        handles.append(module.register_forward_hook(release))
    poison(real)
    out = model(ids(), labels=ids(seed=2))
    assert torch.isfinite(out.loss) and torch.isfinite(out.logits).all()
    for h in handles:
        h.remove()


def test_dropout_only_in_training():
    model = tiny(dropout=0.2)
    x = ids()
    model.eval()
    assert torch.equal(model(x), model(x))
    model.train()
    assert not torch.equal(model(x), model(x))


def test_kv_cache_matches_full_forward_and_generate():
    model = tiny().eval()
    x = ids(seq=12)
    full = model(x)
    a = model(x[:, :5], use_cache=True)
    b = model(x[:, 5:9], past_key_values=a.past_key_values, use_cache=True)  # several tokens against a cache
    c = model(x[:, 9:], past_key_values=b.past_key_values, use_cache=True)
    torch.testing.assert_close(torch.cat([a.logits, b.logits, c.logits], dim=1), full, rtol=0, atol=1e-5)
    assert a.past_key_values[0][0].shape == (2, 2, 5, 32)
    greedy = model.generate(x[:, :4], max_new_tokens=40, temperature=0)  # runs past max_position_embeddings=32
    assert greedy.shape == (2, 44) and torch.equal(greedy[:, :4], x[:, :4])
    first = model(x[:, :4])[:, -1].argmax(-1)
    assert torch.equal(greedy[:, 4], first)
    sampled = model.generate(x[:, :4], 5, temperature=0.8, top_k=5, generator=torch.Generator().manual_seed(0))
    assert sampled.shape == (2, 9) and int(sampled.max()) < 100


def test_sequence_longer_than_positions_is_a_clear_error():
    with pytest.raises(ValueError, match="exceeds max_position_embeddings=32"):
        tiny()(ids(seq=33))


def test_gptlmloss_shift_and_ignore_index():
    logits, x = torch.randn(2, 8, 50), ids(seq=8, vocab=50)
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, 50), x[:, 1:].reshape(-1))
    torch.testing.assert_close(GPTLMLoss()(logits, x), expected)  # tutorial form: (logits, input_ids)
    labels = x.clone()
    labels[:, :3] = -100
    aligned = F.cross_entropy(logits.reshape(-1, 50), labels.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(GPTLMLoss(shift=False)(logits, labels), aligned)
    torch.testing.assert_close(GPTLMLoss(shift=False)(GPTOutput(logits=logits), labels), aligned)  # output objects
    assert GPTLMLoss()(logits.to(torch.bfloat16), x).dtype == torch.float32
    model = tiny()
    x = ids()
    torch.testing.assert_close(GPTLMLoss()(model(x), x), model(x[:, :-1], labels=x[:, 1:]).loss)


def test_factories_overrides_and_errors():
    model = gpt2_tiny(vocab_size=300, max_position_embeddings=64, dropout=0.1, checkpoint=True, n_layer=3)
    c = model.config
    assert (c.vocab_size, c.padded_vocab_size, c.max_position_embeddings, c.dropout, c.checkpoint, c.n_layer) == \
        (300, 320, 64, 0.1, True, 3)
    assert gpt2_tiny().config.vocab_size == 1024 and gpt2_tiny().config.n_embd == 64
    with pytest.raises(TypeError, match="did you mean 'dropout'"):
        gpt2_tiny(dropuot=0.1)
    with pytest.raises(ValueError, match="divisible by n_head"):
        gpt2_tiny(n_head=3)


def test_build_model_from_config_dict():
    model = build_model(dict(type=gpt2_tiny, checkpoint=True), vocab_size=500)
    assert model.config.vocab_size == 500 and model.config.checkpoint
    assert build_model(dict(type=gpt2_tiny, vocab_size=200), vocab_size=500).config.vocab_size == 200
    with pytest.raises(ValueError, match="needs a 'type'"):
        build_model(dict(checkpoint=True))
    with pytest.raises(TypeError, match="callable"):
        build_model(dict(type="gpt2_tiny"))


def test_builds_on_meta_only_fresh_model_zoo_gpts():
    assert builds_on_meta(dict(type=gpt2_tiny)) and builds_on_meta(dict(type=gpt2_xl, checkpoint=True))
    assert not builds_on_meta(dict(type=gpt2_small, pretrained="weights/gpt2"))  # needs its real weights
    assert not builds_on_meta(dict(type="hf", path="weights/gpt2"))
    assert not builds_on_meta(dict(type=lambda **kw: gpt2_tiny(**kw)))  # any other callable: built as it is
    with torch.device("meta"):
        model = build_model(dict(type=gpt2_tiny), vocab_size=500)
    assert all(p.is_meta for p in model.parameters()) and model.config.vocab_size == 500


@pytest.mark.gpu
def test_cuda_bf16_forward_backward_matches_fp32():
    model = tiny(checkpoint=True).cuda()
    x, y = ids().cuda(), ids(seed=2).cuda()
    ref = model(x, labels=y).loss
    with torch.autocast("cuda", dtype=torch.bfloat16):  # SDPA picks a fused (flash / mem-efficient) kernel
        out = model(x, labels=y)
    assert out.loss.dtype == torch.float32 and abs(out.loss.item() - ref.item()) < 5e-2
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
