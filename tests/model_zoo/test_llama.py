"""model_zoo/llama.py: the Llama family equals transformers' Llama, Qwen2, Qwen3 and Mistral (fp32 logits, from the
same safetensors files), its init is addressable by range like GPT's, and the factories have the published sizes."""
from __future__ import annotations

import pytest
import torch

from model_zoo import from_pretrained, llama
from model_zoo.llama import SIZES, Llama, LlamaConfig, llama_tiny
from tests.model_zoo.hf_families import FAMILIES, VOCAB, make_hf_model

# published parameter counts (the model cards), to 3 significant digits, in billions
PUBLISHED = {"llama2_7b": 6.74, "llama3_2_1b": 1.24, "llama3_2_3b": 3.21, "llama3_8b": 8.03, "qwen2_5_0_5b": 0.494,
             "qwen2_5_7b": 7.62, "qwen3_0_6b": 0.596, "qwen3_8b": 8.19, "mistral_7b": 7.25}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_equal_transformers(family, tmp_path):
    hf = make_hf_model(family, tmp_path)
    ours = from_pretrained(str(tmp_path), device="cpu").eval()
    assert ours.config.architecture == type(hf).__name__
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = hf(ids).logits, ours(ids)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= 1e-5
    # the KV cache decodes as the whole forward does
    with torch.no_grad():
        first = ours(ids[:, :20], use_cache=True)
        rest = ours(ids[:, 20:], past_key_values=first.past_key_values, use_cache=True)
    assert (rest.logits - expected[:, 20:]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_factories_have_published_sizes(name):
    with torch.device("meta"):
        model = getattr(llama, name)()
    assert round(model.num_params() / 1e9, 3 if PUBLISHED[name] < 1 else 2) == PUBLISHED[name]


def test_meta_build_draws_the_plain_weights_by_any_range():
    torch.manual_seed(3)
    plain = llama_tiny(vocab_size=1000)  # padded to 1024 rows: the pad rows are zero
    torch.manual_seed(3)
    with torch.device("meta"):
        meta = llama_tiny(vocab_size=1000)
    assert meta.init_seed == plain.init_seed and meta.inv_freq.device.type == "cpu"
    for name, p in plain.named_parameters():
        n = p.numel()
        parts = [meta.init_param_range(name, a, b) for a, b in ((0, n // 3), (n // 3, n - 5), (n - 5, n))]
        assert torch.equal(torch.cat(parts), p.detach().reshape(-1)), name
    assert plain.model.embed_tokens.weight[1000:].abs().sum() == 0
    assert plain.model.layers[0].input_layernorm.weight.eq(1).all()


def test_chunked_loss_and_checkpointing_match_the_plain_loss():
    torch.manual_seed(0)
    plain = llama_tiny()
    torch.manual_seed(0)
    other = llama_tiny(chunked_loss=True, loss_chunk_size=7, checkpoint=True)
    ids = torch.randint(0, 1024, (2, 17))
    a, b = plain(ids[:, :-1], labels=ids[:, 1:]), other(ids[:, :-1], labels=ids[:, 1:])
    assert b.logits is None and torch.allclose(a.loss, b.loss, atol=1e-6)
    a.loss.backward()
    b.loss.backward()
    for (n, p), q in zip(plain.named_parameters(), other.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6), n


def test_tied_head_is_the_embedding():
    model = llama_tiny(tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert "lm_head.weight" not in dict(model.named_parameters())


def test_bad_shapes_are_one_line():
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        LlamaConfig(num_attention_heads=6, num_key_value_heads=4, hidden_size=48)
    with pytest.raises(ValueError, match="yarn"):
        LlamaConfig(rope_scaling=dict(rope_type="yarn", factor=4.0))
    with pytest.raises(TypeError, match="did you mean 'hidden_size'"):
        llama_tiny(hiden_size=32)
    model = llama_tiny(sliding_window=8)
    with pytest.raises(ValueError, match="sliding_window=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_an_attention_no_hf_class_of_the_family_holds_is_refused_at_export():
    """A Megatron checkpoint with --add-qkv-bias and --qk-layernorm imports (our Llama has both), but Qwen3's HF
    class has no q/k/v biases: its export would drop them silently, so hf_config refuses, naming both."""
    from model_zoo import llama_adapter

    both = LlamaConfig(architecture="Qwen3ForCausalLM", qkv_bias=True, qk_norm=True)
    with pytest.raises(ValueError, match="Qwen3ForCausalLM in Hugging Face has q/k norms; this model has q/k/v "
                                         "biases and q/k norms"):
        llama_adapter.hf_config(both)
    assert llama_adapter.hf_config(LlamaConfig(architecture="Qwen3ForCausalLM", qk_norm=True)).architectures == \
        ["Qwen3ForCausalLM"]


def test_sizes_table_builds_every_factory():
    assert set(SIZES) == set(PUBLISHED) | {"llama_tiny"}
    assert isinstance(llama_tiny(), Llama)
