"""Tests for data_pipeline/tokenizer.py and train_tokenizer.py: train, save, load (all three forms), bad dirs."""
from __future__ import annotations

import json
import shutil

import pytest

from data_pipeline.__main__ import main
from data_pipeline.tokenizer import EOD_TOKEN, eod_id, load_backend, load_tokenizer
from data_pipeline.train_tokenizer import train_byte_level_bpe
from tests.corpus import stdlib_docstrings

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 400-token tokenizer trained through the CLI on a JSONL with an empty and a malformed line."""
    root = tmp_path_factory.mktemp("tok")
    corpus = root / "corpus.jsonl"
    lines = [json.dumps({"text": d}) for d in stdlib_docstrings()]
    lines[3:3] = [json.dumps({"text": "  "}), "{not json", json.dumps({"url": "no text"})]
    corpus.write_text("\n".join(lines) + "\n")
    assert main(["train-tokenizer", str(corpus), "--output", str(root / "tok"), "--vocab-size", "400"]) == 0
    return root


def test_train_tokenizer_writes_a_directory_autotokenizer_loads(trained):
    from transformers import AutoTokenizer

    tok_dir = trained / "tok"
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
            "merges.txt"} <= {p.name for p in tok_dir.iterdir()}
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    assert tok.is_fast and len(tok) == 400
    assert tok.eos_token == EOD_TOKEN and tok.eos_token_id == 0
    text = "Return a new ordered dictionary — with ünïcode too.\n"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text  # byte-level: lossless on any text
    assert tok(f"a{EOD_TOKEN}b")["input_ids"][1] == 0  # EOD is a special token, not split into bytes
    stats = json.loads((trained / "tok.stats.json").read_text())
    assert stats["counts"]["empty"] == 1 and stats["counts"]["malformed"] == 2
    assert stats["counts"]["docs"] == len(stdlib_docstrings()) and stats["vocab_size"] == 400


def test_load_tokenizer_forms_agree(trained, tmp_path):
    full = load_tokenizer(str(trained / "tok"))
    gpt2_style = tmp_path / "gpt2_style"
    gpt2_style.mkdir()
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(trained / "tok" / name, gpt2_style / name)
    from_files = load_tokenizer(str(gpt2_style))
    from_json = load_tokenizer(str(trained / "tok" / "tokenizer.json"))
    text = "The JSON decoder (json.loads) returns Python objects.<|endoftext|>Next document."
    expected = full(text)["input_ids"]
    assert from_files(text)["input_ids"] == expected
    assert from_json(text)["input_ids"] == expected
    for tok in (full, from_files, from_json):
        assert eod_id(tok) == 0 and tok.eos_token == EOD_TOKEN
    backend, eod, vocab = load_backend(str(gpt2_style))
    assert backend.encode(text, add_special_tokens=False).ids == expected and (eod, vocab) == (0, 400)


def test_missing_empty_and_broken_dirs_name_the_dir(tmp_path):
    with pytest.raises(ValueError, match=r"nope does not exist.*train-tokenizer"):
        load_tokenizer(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty holds no tokenizer files"):
        load_tokenizer(str(tmp_path / "empty"))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{\"model\": 12")
    with pytest.raises(ValueError, match=r"broken does not load"):
        load_tokenizer(str(broken))
    with pytest.raises(ValueError, match=r"broken does not load"):
        load_backend(str(broken))
    assert main(["tokenize", str(tmp_path / "x.jsonl"), "--tokenizer", str(broken), "--output-prefix",
                 str(tmp_path / "out")]) == 2


def test_vocab_too_small_and_empty_corpus(tmp_path):
    with pytest.raises(ValueError, match="too small"):
        train_byte_level_bpe(["abc"], vocab_size=100)
    corpus = tmp_path / "empty.jsonl"
    corpus.write_text(json.dumps({"text": ""}) + "\n")
    assert main(["train-tokenizer", str(corpus), "--output", str(tmp_path / "t"), "--vocab-size", "300"]) == 2
    assert not (tmp_path / "t").exists()


def test_eod_id_requires_a_separator():
    from tokenizers import Tokenizer, models, pre_tokenizers

    from data_pipeline.tokenizer import wrap_fast

    backend = Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel()
    with pytest.raises(ValueError, match="no <\\|endoftext\\|> and no eos_token"):
        eod_id(wrap_fast(backend))
