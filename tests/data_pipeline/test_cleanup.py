"""Tests for data_pipeline/cleanup.py: text repair, whitespace, language, length, quality, bad lines."""
from __future__ import annotations

import json

import pytest

from data_pipeline.__main__ import main

pytestmark = pytest.mark.timeout(60)  # tests that need longer say so
from data_pipeline.cleanup import gopher_quality, normalize_whitespace

ENGLISH = ("The river bends because the outer bank erodes faster than the inner one. Over many years "
           "the water carries sand and gravel downstream, and the loops of the channel slowly move across "
           "the valley floor. Farmers who live beside such rivers have always known that the land changes, "
           "and they plant their fields with that in mind. Engineers later tried to straighten the channels "
           "with walls and dredging, but the river usually found its old path again after a flood.")
GERMAN = ("Die Geschichte der Stadt beginnt im Mittelalter, als Händler an der Brücke einen Markt gründeten. "
          "Über viele Jahrhunderte wuchs die Siedlung langsam, und die Bürger bauten eine Kirche, ein "
          "Rathaus und mehrere Schulen. Heute leben dort ungefähr zwanzigtausend Menschen.")


def write_jsonl(path, lines):
    path.write_bytes(b"".join((ln if isinstance(ln, bytes) else json.dumps(ln).encode()) + b"\n"
                              for ln in lines))
    return path


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def corpus(tmp_path):
    return write_jsonl(tmp_path / "raw.jsonl", [
        {"text": ENGLISH, "url": "http://a/1"},
        {"text": "The Mona Lisa doesnâ€™t have eyebrows.  \t " + ENGLISH + "\r\n\r\n\r\n\r\nEnd of   story.",
         "url": "http://a/2"},
        {"text": GERMAN * 2, "url": "http://a/3"},
        {"text": "too short", "url": "http://a/4"},
        {"text": "1234 5678 9012 3456 7890 " * 30, "url": "http://a/5"},
        {"text": "   \n\t  ", "url": "http://a/6"},
        b"{not json",
        b"[1, 2, 3]",
        b'{"url": "http://a/7"}',
        b'{"text": "caf\xff"}',
        b"",
        {"text": "\n".join("- item number %d of the list" % i for i in range(40)) + "\n" + ENGLISH,
         "url": "http://a/8"},
    ])


@pytest.mark.timeout(60)
def test_cleanup_reasons_and_text(tmp_path, capsys):
    src = corpus(tmp_path)
    out = tmp_path / "clean.jsonl"
    assert main(["cleanup", str(src), "--output", str(out), "--min-tokens", "20", "--workers", "1"]) == 0
    kept = read_jsonl(out)
    assert [r["url"] for r in kept] == ["http://a/1", "http://a/2", "http://a/8"]
    assert kept[1]["text"].startswith("The Mona Lisa doesn't have eyebrows. The river")  # ftfy + spaces
    assert kept[1]["text"].endswith("valley floor. Farmers who live beside such rivers have always known "
                                    "that the land changes, and they plant their fields with that in mind. "
                                    "Engineers later tried to straighten the channels with walls and dredging, "
                                    "but the river usually found its old path again after a flood.\n\nEnd of story.")
    rejects = read_jsonl(str(out) + ".rejected.jsonl")
    rejected = {r["url"]: r["reason"] for r in rejects if r["reason"] != "malformed"}
    assert [r["line"] for r in rejects if r["reason"] == "malformed"] == [7, 8, 9, 10]  # kept whole, as `raw`
    assert rejected == {"http://a/3": "wrong_lang", "http://a/4": "too_short", "http://a/5": "lang_detect_failed",
                        "http://a/6": "empty"}
    stats = json.loads((tmp_path / "clean.jsonl.stats.json").read_text())
    c = stats["counts"]
    assert (c["kept"], c["malformed"], c["blank_lines"], c["wrong_lang"]) == (3, 4, 1, 1)
    assert stats["length_unit"].startswith("words") and stats["languages"]["de"] == 1
    err = capsys.readouterr().err
    for line in (7, 8, 9, 10):
        assert f"raw.jsonl:{line}:" in err
    assert "Traceback" not in err


@pytest.mark.timeout(60)
def test_quality_rules_and_strict(tmp_path, capsys):
    src = corpus(tmp_path)
    out = tmp_path / "clean.jsonl"
    assert main(["cleanup", str(src), "--output", str(out), "--min-tokens", "20", "--quality",
                 "--workers", "1"]) == 0
    rejected = {r["url"]: r["reason"] for r in read_jsonl(str(out) + ".rejected.jsonl")}
    assert rejected["http://a/8"] == "quality:bullet_lines"
    assert main(["cleanup", str(src), "--output", str(tmp_path / "s.jsonl"), "--strict", "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert "raw.jsonl:7: malformed JSON" in err and "--strict" in err
    assert not (tmp_path / "s.jsonl").exists()  # atomic: no partial output


def test_gopher_rules_unit():
    assert gopher_quality(ENGLISH) is None
    assert gopher_quality("word " * 10) == "quality:word_count"
    assert gopher_quality("\n".join("• bullet point number %d here" % i for i in range(30))) == "quality:bullet_lines"
    assert gopher_quality(("# " * 20) + ENGLISH) == "quality:symbol_ratio"
    assert gopher_quality(" ".join(["the cat and the dog"] * 30)) == "quality:top_2gram"
    assert normalize_whitespace("a \u00a0 b\t\tc\r\n\r\n\r\n\r\nd\x00 ") == "a b c\n\nd"


@pytest.mark.timeout(90)
def test_parallel_equals_serial_and_tokenizer_length(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([ENGLISH, GERMAN], trainers.BpeTrainer(vocab_size=300, show_progress=False))
    tok_path = tmp_path / "tokenizer.json"
    tok.save(str(tok_path))
    n_tokens = len(tok.encode(ENGLISH).ids)
    n_words = len(ENGLISH.split())
    assert n_tokens > n_words

    src = write_jsonl(tmp_path / "raw.jsonl", [{"text": ENGLISH, "url": f"u{i}"} for i in range(300)] +
                      [{"text": GERMAN, "url": "de"}])
    outs = []
    for workers in ("1", "2"):
        out = tmp_path / f"clean{workers}.jsonl"
        assert main(["cleanup", str(src), "--output", str(out), "--workers", workers,
                     "--min-tokens", str(n_words + 1), "--tokenizer", str(tok_path)]) == 0
        outs.append((out.read_bytes(), (tmp_path / f"clean{workers}.jsonl.rejected.jsonl").read_bytes()))
    assert outs[0] == outs[1]
    assert len(read_jsonl(tmp_path / "clean1.jsonl")) == 300  # long enough in tokens, not in words
    stats = json.loads((tmp_path / "clean2.jsonl.stats.json").read_text())
    assert stats["length_unit"].startswith("tokens") and stats["kept_length_total"] == 300 * n_tokens
    assert main(["cleanup", str(src), "--output", str(tmp_path / "x.jsonl"), "--tokenizer",
                 str(tmp_path / "nope")]) == 2


@pytest.mark.timeout(60)
def test_tokenizer_directories_count_like_tokenize(tmp_path, capsys):
    """--tokenizer takes what `tokenize` takes (a train-tokenizer directory, a GPT-2 style vocab.json +
    merges.txt directory) and counts the same ids; a directory that does not load is a clear error."""
    import shutil

    from transformers import AutoTokenizer

    from data_pipeline.tokenizer import save_tokenizer_dir
    from data_pipeline.train_tokenizer import train_byte_level_bpe

    save_tokenizer_dir(train_byte_level_bpe([ENGLISH, GERMAN], vocab_size=300), str(tmp_path / "tok"))
    gpt2_style = tmp_path / "gpt2_style"
    gpt2_style.mkdir()
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(tmp_path / "tok" / name, gpt2_style / name)
    src = write_jsonl(tmp_path / "raw.jsonl", [{"text": ENGLISH, "url": "a"}, {"text": ENGLISH[:200], "url": "b"}])
    expected = len(AutoTokenizer.from_pretrained(str(tmp_path / "tok"))(ENGLISH)["input_ids"])
    for tok in (tmp_path / "tok", gpt2_style):
        out = tmp_path / f"{tok.name}.jsonl"
        assert main(["cleanup", str(src), "--output", str(out), "--tokenizer", str(tok), "--workers", "2",
                     "--min-tokens", str(expected)]) == 0
        stats = json.loads((tmp_path / f"{tok.name}.jsonl.stats.json").read_text())
        assert stats["counts"]["kept"] == 1 and stats["kept_length_total"] == expected
        assert stats["inputs"][1]["path"] == str(tok)  # a replaced tokenizer makes `all` re-run cleanup
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{")
    assert main(["cleanup", str(src), "--output", str(tmp_path / "x.jsonl"), "--tokenizer", str(broken)]) == 2
    err = capsys.readouterr().err
    assert f"tokenizer {broken} does not load" in err and "Traceback" not in err
