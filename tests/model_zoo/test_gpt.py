"""Tests for model_zoo/gpt.py: shapes, parameter counts, tying, vocab padding, checkpointing, KV cache, factories,
build_model, and the ZeRO-3 promise (every parameter is used inside its owning module's forward)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model_zoo import build_model, builds_on_meta
from model_zoo.gpt import GPTOutput, gpt2_large, gpt2_medium, gpt2_small, gpt2_tiny, gpt2_xl
from tests.model_zoo.tiny_gpt import ids, tiny


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


def test_kv_cache_matches_full_forward():
    model = tiny().eval()
    x = ids(seq=12)
    full = model(x)
    a = model(x[:, :5], use_cache=True)
    b = model(x[:, 5:9], past_key_values=a.past_key_values, use_cache=True)  # several tokens against a cache
    c = model(x[:, 9:], past_key_values=b.past_key_values, use_cache=True)
    torch.testing.assert_close(torch.cat([a.logits, b.logits, c.logits], dim=1), full, rtol=0, atol=1e-5)
    assert a.past_key_values[0][0].shape == (2, 2, 5, 32)


def test_sequence_longer_than_positions_is_a_clear_error():
    with pytest.raises(ValueError, match="exceeds max_position_embeddings=32"):
        tiny()(ids(seq=33))


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
