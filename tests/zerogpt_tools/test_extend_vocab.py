"""Tests for zerogpt_tools/extend_vocab.py: a GPT-2 grown to a merge-tokenizers vocabulary keeps its old outputs exactly,
new rows start at the mean (or zeros), files load with transformers, and the result trains as gpt2_tiny(pretrained=).
"""
from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from data_pipeline.__main__ import main as pipeline  # noqa: E402
from data_pipeline.tokenizer import save_tokenizer_dir  # noqa: E402
from data_pipeline.train_tokenizer import train_byte_level_bpe  # noqa: E402
from tests.corpus import prose_and_code  # noqa: E402
from zerogpt_tools.extend_vocab import extend_vocab, main  # noqa: E402
from zerogpt.context import DistContext

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Tokenizer A (prose, 300), B (code), AB = merge-tokenizers A B; a gpt2_tiny-shaped HF GPT-2 on A."""
    root = tmp_path_factory.mktemp("extend")
    prose, code = prose_and_code()
    save_tokenizer_dir(train_byte_level_bpe(prose, vocab_size=300), str(root / "a"))
    save_tokenizer_dir(train_byte_level_bpe(code, vocab_size=400), str(root / "b"))
    assert pipeline(["merge-tokenizers", str(root / "a"), str(root / "b"), "--out", str(root / "ab")]) == 0
    save_tokenizer_dir(train_byte_level_bpe(prose, vocab_size=300), str(root / "model"))  # the model ships A
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=300, n_positions=64, n_embd=64, n_layer=2, n_head=2,
                                     bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(config).save_pretrained(root / "model")
    ab = transformers.AutoTokenizer.from_pretrained(root / "ab")
    assert len(ab) > 300 + 64  # B adds enough tokens to need more than one 128-row block past 300
    return root, code


def load(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()


def test_grows_to_a_multiple_and_keeps_old_outputs(setup, tmp_path):
    root, code = setup
    stats = extend_vocab(str(root / "model"), str(root / "ab"), str(tmp_path / "out"))
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    rows = -(-len(tok) // 128) * 128
    assert stats["vocab_size"] == rows and stats["old_vocab_size"] == 300 and stats["new_rows"] == rows - 300
    assert json.loads((tmp_path / "out" / "config.json").read_text())["vocab_size"] == rows
    assert tok.get_vocab() == transformers.AutoTokenizer.from_pretrained(root / "ab").get_vocab()

    old, new = load(root / "model"), load(tmp_path / "out")
    w_old, w_new = old.transformer.wte.weight, new.transformer.wte.weight
    assert w_new.shape == (rows, 64)
    assert torch.equal(w_new[:300], w_old)
    torch.testing.assert_close(w_new[300:], w_old.mean(0).expand(rows - 300, -1), rtol=0, atol=1e-7)
    assert new.lm_head.weight.data_ptr() == w_new.data_ptr()  # still tied
    for name, tensor in old.state_dict().items():
        if "wte" not in name and "lm_head" not in name:
            assert torch.equal(new.state_dict()[name], tensor), name

    x = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(0))  # old tokens only
    with torch.no_grad():
        out_old, out_new = old(x, output_hidden_states=True), new(x, output_hidden_states=True)
    for h_old, h_new in zip(out_old.hidden_states, out_new.hidden_states):
        assert torch.equal(h_old, h_new)
    torch.testing.assert_close(out_new.logits[..., :300], out_old.logits, rtol=0, atol=1e-5)
    # The new tokens encode code more cheaply, and their ids reach the new rows.
    ids = tok(code[1][:3000])["input_ids"]
    assert max(ids) >= 300 and tok.decode(ids) == code[1][:3000]


def test_cli_zeros_init_divisible_by_and_shards(setup, tmp_path, capsys):
    root, _ = setup
    assert main(["--model", str(root / "model"), "--tokenizer", str(root / "ab"), "--out", str(tmp_path / "z"),
                 "--init", "zeros", "--divisible-by", "64", "--max-shard-size", "40KB"]) == 0
    assert "-> " in capsys.readouterr().out
    tok_len = len(transformers.AutoTokenizer.from_pretrained(tmp_path / "z"))
    new = load(tmp_path / "z")
    rows = new.config.vocab_size
    assert rows % 64 == 0 and rows - 64 < tok_len <= rows
    assert (new.transformer.wte.weight[300:] == 0).all()
    assert (tmp_path / "z" / "model.safetensors.index.json").is_file()


def test_result_continues_pretraining_as_gpt2_tiny(setup, tmp_path):
    import zerogpt
    from model_zoo import GPTLMLoss, build_model

    root, code = setup
    extend_vocab(str(root / "model"), str(root / "ab"), str(tmp_path / "out"))
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    from model_zoo.gpt import gpt2_tiny

    model = build_model(dict(type=gpt2_tiny, pretrained=str(tmp_path / "out")), vocab_size=len(tok))
    assert model.config.vocab_size == transformers.AutoConfig.from_pretrained(tmp_path / "out").vocab_size
    new_row = max(tok(code[0][:2000])["input_ids"])
    assert new_row >= 300
    before = model.transformer.wte.weight[new_row].detach().clone()
    engine = zerogpt.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                config=zerogpt.Config(dict(zero=dict(stage=2))), ctx=DistContext.current())
    ids = torch.tensor([tok(code[0][:4000])["input_ids"][:65]])
    losses = []
    for _ in range(2):
        loss = GPTLMLoss(shift=False)(engine(ids[:, :-1]), ids[:, 1:])
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
    after = engine.state_dict_full()["transformer.wte.weight"][new_row]
    engine.close()
    assert all(torch.isfinite(torch.tensor(losses))) and losses[1] < losses[0]
    assert not torch.equal(before, after)  # the new token's row is trained


def test_errors_name_the_fix(setup, tmp_path):
    root, _ = setup
    with pytest.raises(ValueError, match="changes or drops .* merge-tokenizers"):
        extend_vocab(str(root / "model"), str(root / "b"), str(tmp_path / "x"))  # B alone renumbers A's tokens
    small = tmp_path / "small"
    save_tokenizer_dir(train_byte_level_bpe(["tiny corpus"] * 10, vocab_size=260), str(small))
    bare = tmp_path / "bare"  # no tokenizer files, so only the size can be checked
    load(root / "model").save_pretrained(bare)
    with pytest.raises(ValueError, match="only grows"):
        extend_vocab(str(bare), str(small), str(tmp_path / "x"), divisible_by=1)
    with pytest.raises(SystemExit, match="no config.json"):
        main(["--model", str(tmp_path), "--tokenizer", str(root / "ab"), "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="--tokenizer .*no such file"):
        main(["--model", str(root / "model"), "--tokenizer", str(tmp_path / "nope"), "--out", str(tmp_path / "x")])
    assert not (tmp_path / "x").exists()  # nothing half-written
