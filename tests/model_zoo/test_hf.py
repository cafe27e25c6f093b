"""Tests for model_zoo/hf.py: from_hf / to_hf parity, pretrained=DIR factories, and `model = dict(type="hf",
path=DIR)`. Models are random, built and saved in tmp dirs."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from model_zoo import build_model  # noqa: E402
from model_zoo.gpt import from_hf, gpt2_small, gpt2_tiny, to_hf  # noqa: E402
from model_zoo.loss import GPTLMLoss  # noqa: E402

SHAPES = [  # (vocab, positions, n_embd, n_layer, n_head): odd vocab (padding), several head counts
    (100, 32, 32, 2, 4),
    (1024, 256, 64, 2, 2),    # gpt2_tiny's shape
    (517, 64, 48, 3, 3),
]


def save_hf_gpt2(path, vocab, positions, n_embd, n_layer, n_head, seed=0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=n_embd, n_layer=n_layer,
                                     n_head=n_head, bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    return path


def load_hf(path):
    return transformers.GPT2LMHeadModel.from_pretrained(path, local_files_only=True).eval()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_from_hf_and_to_hf_are_exact(tmp_path, shape):
    vocab, positions = shape[0], shape[1]
    hf = load_hf(save_hf_gpt2(tmp_path / "hf", *shape))
    x = torch.randint(0, vocab, (2, min(positions, 24)), generator=torch.Generator().manual_seed(0))

    ours = from_hf(hf).eval()
    assert ours.config.vocab_size == vocab and ours.config.padded_vocab_size % 64 == 0
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x).logits, rtol=0, atol=1e-5)

    back = to_hf(ours).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, ours(x), rtol=0, atol=1e-5)
    assert back.lm_head.weight.data_ptr() == back.transformer.wte.weight.data_ptr()  # still tied
    hf_state, back_state = hf.state_dict(), back.state_dict()
    for name, tensor in hf_state.items():
        assert torch.equal(back_state[name], tensor), name

    back.save_pretrained(tmp_path / "back")  # the export loads as a plain HF model
    with torch.no_grad():
        torch.testing.assert_close(load_hf(tmp_path / "back")(x).logits, hf(x).logits, rtol=0, atol=1e-5)


def test_loss_matches_hf_with_hf_label_convention(tmp_path):
    hf = load_hf(save_hf_gpt2(tmp_path / "hf", *SHAPES[0]))
    ours = from_hf(hf).eval()
    x = torch.randint(0, 100, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hf_loss = hf(x, labels=x).loss  # HF shifts inside the model
        torch.testing.assert_close(GPTLMLoss()(ours(x), x), hf_loss, rtol=0, atol=1e-5)
        torch.testing.assert_close(ours(x[:, :-1], labels=x[:, 1:]).loss, hf_loss, rtol=0, atol=1e-5)
        torch.testing.assert_close(GPTLMLoss()(hf(x), x), hf_loss, rtol=0, atol=1e-5)  # HF outputs accepted


def test_factory_pretrained_dir(tmp_path):
    path = save_hf_gpt2(tmp_path / "hf", 1024, 256, 64, 2, 2)
    hf = load_hf(path)
    model = gpt2_tiny(pretrained=str(path), checkpoint=True).eval()
    assert model.config.checkpoint
    x = torch.randint(0, 1024, (1, 10))
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="not gpt2_small"):
        gpt2_small(pretrained=str(path))


def test_config_type_hf_builds_any_local_causal_lm(tmp_path):
    path = save_hf_gpt2(tmp_path / "hf", *SHAPES[0])
    model = build_model(dict(type="hf", path=str(path), checkpoint=True), vocab_size=100)
    assert isinstance(model, transformers.GPT2LMHeadModel)
    assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
    x = torch.randint(0, 100, (2, 8))
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, load_hf(path)(x).logits)
    with pytest.raises(ValueError, match="config.json.s vocab_size is 100;"):
        build_model(dict(type="hf", path=str(path)), vocab_size=5000)
    with pytest.raises(ValueError, match="no config.json"):
        build_model(dict(type="hf", path=str(tmp_path / "missing")))


def test_from_hf_rejects_unsupported_variants():
    config = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                     scale_attn_by_inverse_layer_idx=True)
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx"):
        from_hf(transformers.GPT2LMHeadModel(config))
    # our GPT's head is its embedding: an untied GPT-2's own lm_head would go unread (logits silently wrong)
    untied = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                     tie_word_embeddings=False)
    with pytest.raises(ValueError, match=r"'tie_word_embeddings': False.*generic=True"):
        from_hf(transformers.GPT2LMHeadModel(untied))


def _edit_config(path, **changes):
    import json
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **changes}))
    return path


def test_weights_that_do_not_fit_config_json_are_refused_in_one_line(tmp_path, capfd):
    """transformers starts tensors missing from the files at random and prints a table: a mislabelled or edited
    config.json must not train or generate from a random model, nor end in a traceback."""
    from model_zoo.hf import load_checked

    deeper = _edit_config(save_hf_gpt2(tmp_path / "deeper", *SHAPES[0]), n_layer=3)  # files hold 2 blocks
    with pytest.raises(ValueError, match=r"deeper: 12 tensors of the GPT2LMHeadModel .* not in its weight files "
                                         r"\(e\.g\. 'transformer\.h\.2\..*random"):
        build_model(dict(type="hf", path=str(deeper)), vocab_size=100)
    llama = tmp_path / "llama"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2)).save_pretrained(llama)
    with pytest.raises(ValueError, match=r"tensors it has no place for \(e\.g\. 'model\.embed_tokens\.weight'\)"):
        gpt2_tiny(pretrained=str(llama))  # a Llama under a GPT-2 factory
    wider = _edit_config(save_hf_gpt2(tmp_path / "wider", *SHAPES[0]), n_embd=16)
    with pytest.raises(ValueError, match=r"has shape \[.*\] but config.json makes it \[.*\]; config.json and the "
                                         r"weights disagree"):
        load_checked(str(wider))
    unknown = _edit_config(save_hf_gpt2(tmp_path / "unknown", *SHAPES[0]), model_type="foo")
    with pytest.raises(ValueError, match=r"model_type 'foo' .* is not a causal LM the installed transformers knows"):
        load_checked(str(unknown))
    assert "LOAD REPORT" not in capfd.readouterr().err
