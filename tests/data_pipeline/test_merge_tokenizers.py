"""Tests for data_pipeline/merge_tokenizers.py: A's ids kept, B's tokens and merges appended, loadable, lossless."""
from __future__ import annotations

import json

import pytest

from data_pipeline.__main__ import main
from data_pipeline.tokenizer import save_tokenizer_dir
from data_pipeline.train_tokenizer import train_byte_level_bpe
from tests.corpus import prose_and_code

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def tokenizers_ab(tmp_path_factory):
    root = tmp_path_factory.mktemp("merge")
    prose, code = prose_and_code()
    a = train_byte_level_bpe(prose, vocab_size=400)
    b = train_byte_level_bpe(code, vocab_size=500, special_tokens=["<|endoftext|>", "<|code|>"])
    save_tokenizer_dir(a, str(root / "a"))
    save_tokenizer_dir(b, str(root / "b"))
    assert main(["merge-tokenizers", str(root / "a"), str(root / "b"), "--out", str(root / "ab")]) == 0
    return root, prose, code


def test_merged_keeps_a_ids_and_appends_b(tokenizers_ab):
    from transformers import AutoTokenizer

    root, prose, code = tokenizers_ab
    a, b, ab = (AutoTokenizer.from_pretrained(str(root / n)) for n in ("a", "b", "ab"))
    va, vb, vab = a.get_vocab(), b.get_vocab(), ab.get_vocab()
    assert all(vab[token] == i for token, i in va.items())
    assert set(vb) <= set(vab)
    new = sorted(set(vb) - set(va), key=vb.get)
    assert [vab[t] for t in new] == list(range(len(va), len(va) + len(new)))  # appended in B's order
    assert len(ab) == len(va) + len(new)
    assert ab.eos_token == "<|endoftext|>" and ab.eos_token_id == 0
    merges_a = json.loads((root / "a" / "tokenizer.json").read_text())["model"]["merges"]
    merges_ab = json.loads((root / "ab" / "tokenizer.json").read_text())["model"]["merges"]
    assert merges_ab[:len(merges_a)] == merges_a and len(merges_ab) > len(merges_a)
    stats = json.loads((root / "ab.stats.json").read_text())
    assert stats["counts"]["new_tokens"] == len(new) and stats["vocab_size"] == len(ab)


def test_merged_is_lossless_and_shorter_on_b_text(tokenizers_ab):
    from transformers import AutoTokenizer

    root, prose, code = tokenizers_ab
    a, ab = AutoTokenizer.from_pretrained(str(root / "a")), AutoTokenizer.from_pretrained(str(root / "ab"))
    for text in (prose[0], code[0][:5000], "naïve café — 東京 <|code|>"):
        assert ab.decode(ab(text)["input_ids"]) == text
    n_a, n_ab = len(a(code[1])["input_ids"]), len(ab(code[1])["input_ids"])
    assert n_ab < 0.95 * n_a  # B's code merges make code cheaper to encode
    assert ab.convert_tokens_to_ids("<|code|>") in ab("x <|code|> y")["input_ids"]  # still a special token


def test_rejects_non_bpe(tokenizers_ab, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    root, _, _ = tokenizers_ab
    word = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    word.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "wl").mkdir()
    word.save(str(tmp_path / "wl" / "tokenizer.json"))
    from data_pipeline.merge_tokenizers import merge_tokenizers
    with pytest.raises(ValueError, match=r"wl is a WordLevel model"):
        merge_tokenizers(str(root / "a"), str(tmp_path / "wl"), str(tmp_path / "out"))
    assert main(["merge-tokenizers", str(root / "a"), str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2
    assert not (tmp_path / "o").exists()
