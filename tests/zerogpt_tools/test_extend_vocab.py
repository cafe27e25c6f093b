"""Tests for zerogpt_tools/extend_vocab.py: a GPT-2 grown to a merge-tokenizers vocabulary keeps its old outputs exactly,
new rows start at the mean (or zeros), files load with transformers, and the result trains as gpt2_tiny(pretrained=);
an untied Llama and a tied Qwen2 grown to merged Llama-3, Llama-2 (sentencepiece) and Qwen2 tokenizers keep their old
logits under transformers and model_zoo.from_pretrained.
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
from tests.hf_tokenizers import NEW_WORDS  # noqa: E402
from zerogpt_tools.extend_vocab import extend_vocab, grow_rows, main  # noqa: E402
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


# ------------------------------------------------------------------------------------------------
# the Llama family: a Llama-3-style and a Llama-2-style tokenizer pair, an untied Llama and a tied Qwen2


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    """{style: (A, A+B)}: tokenizer A of the model and A merged with B (trained on other words)."""
    from data_pipeline.merge_tokenizers import merge_tokenizers
    from tests.hf_tokenizers import llama2_tokenizer_dir, llama3_tokenizer_dir, other_texts, qwen2_tokenizer_dir

    root = tmp_path_factory.mktemp("merged")
    pairs = {}
    for style, make in (("llama3", llama3_tokenizer_dir), ("llama2", llama2_tokenizer_dir),
                        ("qwen2", qwen2_tokenizer_dir)):
        a, b = make(root / f"{style}_a"), make(root / f"{style}_b", texts=other_texts())
        merge_tokenizers(a, b, str(root / f"{style}_ab"))
        pairs[style] = a, str(root / f"{style}_ab")
    return pairs


@pytest.mark.parametrize("family, style", [("llama", "llama3"), ("llama", "llama2"), ("qwen2", "qwen2")])
def test_llama_family_keeps_old_logits(merged, tmp_path, family, style):
    """Untied Llama and tied Qwen2 (with Qwen2.5-style padding rows past its tokenizer): the old vocabulary's
    logits are unchanged under transformers and model_zoo, new rows are the old tokens' mean, new words get new ids.

    Qwen2 gets its own byte-level BPE style (added specials, no BOS): transformers 5 loads any tokenizer in a
    model_type=qwen2 directory as Qwen2Tokenizer, so a Llama-3 one there is not the tokenizer it was given."""
    import shutil

    from data_pipeline.tokenizer import load_tokenizer
    from model_zoo import from_pretrained
    from tests.model_zoo.hf_families import make_hf_model

    a_dir, ab_dir = merged[style]
    a, ab = load_tokenizer(a_dir), load_tokenizer(ab_dir)
    n_old = len(a)
    old_rows = n_old if family == "llama" else n_old + 48  # Qwen2.5 ships 151936 rows for 151665 tokens
    model_bos = 7  # the tokenizer of qwen2 style names no BOS: the model's stays
    old = make_hf_model(family, tmp_path / "model", vocab_size=old_rows, eos_token_id=a.eos_token_id,
                        bos_token_id=a.bos_token_id if a.bos_token_id is not None else model_bos)
    shutil.copytree(a_dir, tmp_path / "model", dirs_exist_ok=True)  # the model ships tokenizer A

    stats = extend_vocab(str(tmp_path / "model"), ab_dir, str(tmp_path / "out"))
    rows = -(-len(ab) // 128) * 128
    tied = family == "qwen2"
    assert stats["grown"] == (["model.embed_tokens.weight"] if tied else ["lm_head.weight",
                                                                           "model.embed_tokens.weight"])
    assert (stats["vocab_size"], stats["new_tokens"]) == (rows, len(ab) - n_old)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["vocab_size"], config["eos_token_id"]) == (rows, a.eos_token_id)
    assert config["bos_token_id"] == (a.bos_token_id if a.bos_token_id is not None else model_bos)

    new = load(tmp_path / "out")
    native = from_pretrained(str(tmp_path / "out"), device="cpu").eval()
    for get in ("get_input_embeddings", "get_output_embeddings"):
        w_old, w_new = getattr(old, get)().weight, getattr(new, get)().weight
        assert w_new.shape == (rows, 64) and torch.equal(w_new[:n_old], w_old[:n_old])
        assert torch.equal(w_new[n_old:], w_old[:n_old].mean(0).expand(rows - n_old, -1))  # padding rows too
    if tied:
        assert new.get_output_embeddings().weight.data_ptr() == new.get_input_embeddings().weight.data_ptr()

    x = torch.randint(0, n_old, (2, 24), generator=torch.Generator().manual_seed(0))  # old tokens only
    with torch.no_grad():
        want, got, got_native = old(x).logits[..., :n_old], new(x).logits, native(x)
    assert got.shape[-1] == got_native.shape[-1] == rows
    assert (got[..., :n_old] - want).abs().max() <= 1e-6 and (got_native[..., :n_old] - want).abs().max() <= 1e-6

    tok = load_tokenizer(str(tmp_path / "out"))
    assert tok.get_vocab() == ab.get_vocab()
    ids = tok(NEW_WORDS)["input_ids"]
    assert ids == ab(NEW_WORDS)["input_ids"] and n_old <= max(ids) < len(ab)
    assert tok.decode(ids, skip_special_tokens=True) == NEW_WORDS


def test_grow_rows_reuses_padding_rows_for_new_tokens():
    w = torch.arange(12.0).view(6, 2)  # 4 tokens + 2 padding rows
    mean = w[:4].mean(0)
    grown = grow_rows(w, 8, "mean", mean_of=4, taken=5)  # one new token takes padding row 4; row 5 stays padding
    assert torch.equal(grown[:4], w[:4]) and torch.equal(grown[4], mean) and torch.equal(grown[5], w[5])
    assert torch.equal(grown[6:], mean.expand(2, -1))
    assert torch.equal(grow_rows(w, 7, "zeros", mean_of=4, taken=7)[4:], torch.zeros(3, 2))


def test_llama_errors_name_the_fix(merged, tmp_path):
    import shutil

    from tests.model_zoo.hf_families import make_hf_model

    ab_dir = merged["llama2"][1]
    make_hf_model("llama", tmp_path / "model", vocab_size=384)
    shutil.copytree(merged["llama3"][0], tmp_path / "model", dirs_exist_ok=True)  # a tokenizer of other ids
    with pytest.raises(ValueError, match="changes or drops .* merge-tokenizers"):
        extend_vocab(str(tmp_path / "model"), ab_dir, str(tmp_path / "x"))
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    (tmp_path / "model" / "config.json").write_text(json.dumps({**config, "architectures": ["BertForMaskedLM"]}))
    with pytest.raises(SystemExit, match="'BertForMaskedLM' model; extend_vocab grows .*LlamaForCausalLM"):
        main(["--model", str(tmp_path / "model"), "--tokenizer", ab_dir, "--out", str(tmp_path / "x")])
    assert not (tmp_path / "x").exists()
