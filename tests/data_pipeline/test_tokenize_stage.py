"""Tests for data_pipeline/tokenize_stage.py: ids match the HF tokenizer, EOD per doc, parallel == serial,
empty/malformed documents counted, uint16/int32 choice, atomic output, clear errors."""
from __future__ import annotations

import json

import numpy as np
import pytest

from data_pipeline.__main__ import main
from data_pipeline.indexed import IndexedDataset
from data_pipeline.tokenize_stage import tokenize_file
from data_pipeline.tokenizer import save_tokenizer_dir
from data_pipeline.train_tokenizer import train_byte_level_bpe
from tests.corpus import stdlib_docstrings

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenize")
    docs = stdlib_docstrings()
    save_tokenizer_dir(train_byte_level_bpe(docs, vocab_size=400), str(root / "tok"))
    lines = [json.dumps({"text": d, "url": f"u{i}"}) for i, d in enumerate(docs)]
    lines.insert(5, json.dumps({"text": ""}))
    lines.insert(9, json.dumps({"text": " \n\t"}))
    lines.insert(12, "{broken")
    lines.insert(14, "")
    (root / "corpus.jsonl").write_text("\n".join(lines))  # no final newline on purpose
    return root, docs


def test_ids_match_hf_tokenizer_with_eod_and_counts(setup):
    from transformers import AutoTokenizer

    root, docs = setup
    assert main(["tokenize", str(root / "corpus.jsonl"), "--tokenizer", str(root / "tok"),
                 "--output-prefix", str(root / "serial"), "--workers", "1"]) == 0
    ds = IndexedDataset(str(root / "serial"))
    hf = AutoTokenizer.from_pretrained(str(root / "tok"))
    assert ds.dtype == np.uint16 and len(ds) == ds.num_documents == len(docs)
    for i, text in enumerate(docs):
        assert ds[i].tolist() == hf(text)["input_ids"] + [hf.eos_token_id]
    stats = json.loads((root / "serial.stats.json").read_text())
    assert stats["counts"] == {"docs": len(docs), "empty": 2, "malformed": 1, "blank_lines": 1,
                               "tokens": ds.num_tokens}
    assert stats["skipped"] == {"empty": 2, "malformed": 1}
    assert stats["eod_id"] == 0 and stats["vocab_size"] == 400 and stats["dtype"] == "uint16"
    assert stats["tokens_per_s"] > 0


def test_parallel_workers_and_small_blocks_give_identical_files(setup):
    root, _ = setup
    tokenize_file(str(root / "corpus.jsonl"), str(root / "tok"), str(root / "serial2"), workers=1)
    tokenize_file(str(root / "corpus.jsonl"), str(root / "tok"), str(root / "par"), workers=2, block_bytes=2000)
    for ext in (".bin", ".idx"):
        assert (root / f"par{ext}").read_bytes() == (root / f"serial2{ext}").read_bytes()


def test_json_key_and_strict(setup, tmp_path):
    root, _ = setup
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"body": "hello world"}) + "\n" + json.dumps({"body": "again"}) + "\n")
    stats = tokenize_file(str(corpus), str(root / "tok"), str(tmp_path / "c"), text_key="body")
    assert stats["counts"]["docs"] == 2
    # --strict: the first bad line aborts, and nothing is left behind (atomic output).
    assert main(["tokenize", str(root / "corpus.jsonl"), "--tokenizer", str(root / "tok"), "--output-prefix",
                 str(tmp_path / "strict"), "--strict", "--workers", "2"]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.bin", "c.idx", "c.jsonl", "c.stats.json"]


def test_large_vocab_uses_int32(setup, tmp_path):
    root, docs = setup
    backend = train_byte_level_bpe(docs[:20], vocab_size=300)
    backend.add_tokens([f"<extra_{i}>" for i in range(65300)])
    save_tokenizer_dir(backend, str(tmp_path / "big"))
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"text": "x <extra_65299> y"}) + "\n")
    stats = tokenize_file(str(corpus), str(tmp_path / "big"), str(tmp_path / "c"))
    ds = IndexedDataset(str(tmp_path / "c"))
    assert stats["dtype"] == "int32" and ds.dtype == np.int32
    assert backend.token_to_id("<extra_65299>") in ds[0].tolist() and ds[0].max() >= 65535


def test_missing_input_and_tokenizer(setup, tmp_path):
    root, _ = setup
    assert main(["tokenize", str(tmp_path / "missing.jsonl"), "--tokenizer", str(root / "tok"),
                 "--output-prefix", str(tmp_path / "o")]) == 2
    with pytest.raises(ValueError, match=r"no_tok does not exist"):
        tokenize_file(str(root / "corpus.jsonl"), str(tmp_path / "no_tok"), str(tmp_path / "o"))


def test_a_tokenizer_file_edited_in_place_makes_the_output_stale(setup, tmp_path):
    """`all` re-runs tokenize (and cleanup, which counts --min-tokens with it) when a file of the tokenizer
    directory is rewritten in place, which leaves the directory's own size and mtime as they were."""
    import os
    import shutil

    from data_pipeline import tokenize_stage
    from data_pipeline.__main__ import build_parser
    from data_pipeline.stats import is_complete

    root, _ = setup
    tok = shutil.copytree(root / "tok", tmp_path / "tok")
    argvs = {"tokenize": [str(root / "corpus.jsonl"), "--tokenizer", str(tok), "--output-prefix", str(tmp_path / "t")],
             "cleanup": [str(root / "corpus.jsonl"), "--output", str(tmp_path / "c.jsonl"), "--tokenizer", str(tok),
                         "--lang", "any", "--min-tokens", "5"]}
    args = {stage: build_parser(stage).parse_args([stage, *argv, "--workers", "1"]) for stage, argv in argvs.items()}
    for stage in argvs:
        assert main([stage, *argvs[stage], "--workers", "1"]) == 0
    complete = {"tokenize": lambda: tokenize_stage.is_complete(args["tokenize"]),
                "cleanup": lambda: is_complete(str(tmp_path / "c.jsonl"), args["cleanup"])}
    assert all(check() for check in complete.values())
    mtime = os.stat(tok).st_mtime_ns
    config = json.loads((tok / "tokenizer.json").read_text())
    config["model"]["merges"] = config["model"]["merges"][:-1]  # another tokenizer, written over the old file
    (tok / "tokenizer.json").write_text(json.dumps(config))
    assert os.stat(tok).st_mtime_ns == mtime
    assert not any(check() for check in complete.values())


def test_a_file_with_no_document_among_its_lines_is_one_error_and_no_dataset(setup, tmp_path, capsys):
    """The wrong file (another key, a CSV) gives every line malformed: a one-line error and nothing written, where it
    wrote an empty dataset and exited 0. A corpus of empty documents alone stays a warning."""
    root, _ = setup
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text(json.dumps({"body": "hello"}) + "\n" + "a,b,c\n")
    assert main(["tokenize", str(wrong), "--tokenizer", str(root / "tok"), "--output-prefix",
                 str(tmp_path / "o")]) == 2
    assert "none of its lines is a document (2 malformed" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["wrong.jsonl"]
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"text": ""}) + "\n")
    assert main(["tokenize", str(empty), "--tokenizer", str(root / "tok"), "--output-prefix",
                 str(tmp_path / "e")]) == 0
