"""Tests for data_pipeline/__main__.py and the `all` stage (data_pipeline/run_all.py) end to end."""
from __future__ import annotations

import json
import os
import shutil

import pytest

try:  # the local test web server (rootdir-relative or package import)
    from web_server import read_jsonl
except ImportError:  # pragma: no cover - when tests/data_pipeline becomes a package
    from tests.data_pipeline.web_server import read_jsonl

from data_pipeline import __main__ as cli
from data_pipeline.__main__ import main

pytestmark = pytest.mark.timeout(60)  # tests that need longer say so


def test_help_lists_every_stage(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for stage in cli.STAGES:
        assert stage in out
    with pytest.raises(SystemExit) as e:
        main(["no-such-stage"])
    assert e.value.code == 2


def test_unavailable_stage_is_a_clean_error(monkeypatch, capsys):
    monkeypatch.setitem(cli.STAGES, "ghost", ("data_pipeline.no_such_module", "missing"))
    assert main(["ghost"]) == 2
    assert "stage 'ghost' is unavailable" in capsys.readouterr().err
    assert main(["shuffle", "/nonexistent.jsonl", "--output", "/tmp/x"]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_all_end_to_end_then_skips(tmp_path, site, capsys):
    base, handler = site
    urls = tmp_path / "urls"
    urls.mkdir()
    (urls / "a.txt").write_text("".join(f"{base}/article/{i}\n" for i in range(6)) +
                                f"{base}/dup/0\n{base}/article/1?copy=1\n{base}/german\n{base}/404\n")
    (urls / "b.txt").write_text(f"https://www.youtube.com/watch?v=x\n{base}/paper.pdf\n{base}/article/2\n"
                                f"not a url\n")
    work = tmp_path / "work"
    argv = ["all", "--urls", str(urls), "--workdir", str(work), "--allow-private", "--min-tokens", "50",
            "--timeout", "5", "--backoff", "0.05", "--extract-workers", "1", "--workers", "2", "--tokenize",
            "--vocab-size", "300", "--seed", "3"]
    assert main(argv) == 0
    final = read_jsonl(work / "webtext.jsonl")
    got = sorted(r["url"].removeprefix(base) for r in final)
    # article/1?copy=1 is an exact copy of article/1 (kept: first), dup/0 a near-duplicate of article/0,
    # german fails the language filter, 404 fails download, youtube/.pdf/bad URL never leave blacklist.
    assert got == [f"/article/{i}" for i in range(6)]
    assert sum(handler.counters.values()) == 10  # article 0-5, dup/0, article/1?copy=1, german, 404
    stats = {s: json.loads((work / f"{n}.stats.json").read_text()) for s, n in
             [("bl", "urls.txt"), ("dl", "raw.jsonl"), ("cl", "clean.jsonl"), ("gr", "groups.jsonl"),
              ("rm", "dedup.jsonl"), ("sh", "webtext.jsonl")]}
    assert stats["bl"]["counts"]["duplicate"] == 1 and stats["bl"]["counts"]["domain"] == 1
    assert stats["cl"]["counts"]["wrong_lang"] == 1 and stats["rm"]["counts"]["removed"] == 2
    assert stats["gr"]["group_sizes"] == {"2": 2}
    # --tokenize: a tokenizer trained on webtext.jsonl, and the shuffled documents in order as .bin/.idx + EOD
    from transformers import AutoTokenizer

    from data_pipeline.indexed import IndexedDataset

    tok = AutoTokenizer.from_pretrained(str(work / "tokenizer"))
    ds = IndexedDataset(str(work / "webtext_text_document"))
    assert len(tok) == 300 and ds.num_documents == len(final)
    assert [ds[i].tolist() for i in range(len(ds))] == [tok(r["text"])["input_ids"] + [tok.eos_token_id]
                                                        for r in final]
    before = {p: os.stat(work / p).st_mtime_ns for p in os.listdir(work)}
    first_bytes = (work / "webtext.jsonl").read_bytes()

    capsys.readouterr()
    handler.counters.clear()
    assert main(argv) == 0  # everything complete: nothing runs, nothing is fetched
    err = capsys.readouterr().err
    assert err.count("skipped") == 9 and sum(handler.counters.values()) == 0
    assert {p: os.stat(work / p).st_mtime_ns for p in os.listdir(work)} == before

    # another vocabulary size re-trains the tokenizer and re-tokenizes, nothing before
    assert main(argv[:-3] + ["320", "--seed", "3"]) == 0
    err = capsys.readouterr().err
    assert err.count("skipped") == 7 and "train-tokenizer: running" in err and "tokenize: running" in err
    assert len(AutoTokenizer.from_pretrained(str(work / "tokenizer"))) == 320
    assert main(argv[:-3] + ["320", "--seed", "3"]) == 0
    assert capsys.readouterr().err.count("skipped") == 9

    # a different threshold re-runs dedup onward only; a different seed changes only the order
    argv = argv[:-3] + ["320", "--seed", "3"]
    assert main(argv[:-1] + ["4", "--threshold", "0.99"]) == 0
    err = capsys.readouterr().err
    assert "blacklist: skipped" in err and "cleanup: skipped" in err and "find-duplicates: running" in err
    assert "tokenize: running" in err
    assert IndexedDataset(str(work / "webtext_text_document")).num_documents == len(final) + 1
    again = read_jsonl(work / "webtext.jsonl")
    assert sorted(r["url"] for r in again) == sorted([r["url"] for r in final] + [base + "/dup/0"])
    assert (work / "webtext.jsonl").read_bytes() != first_bytes

    # a truncated (partial) output is detected and rebuilt
    (work / "webtext.jsonl").write_text("")
    assert main(argv[:-1] + ["4", "--threshold", "0.99"]) == 0
    assert "shuffle: running" in capsys.readouterr().err
    assert len(read_jsonl(work / "webtext.jsonl")) == len(again)
    os.truncate(work / "webtext_text_document.bin", 0)  # so is a damaged .bin
    assert main(argv[:-1] + ["4", "--threshold", "0.99"]) == 0
    err = capsys.readouterr().err
    assert err.count("skipped") == 8 and "tokenize: running" in err
    assert IndexedDataset(str(work / "webtext_text_document")).num_documents == len(again)


# One input with every kind of bad line a JSONL stage can meet, and two good documents.
BAD_LINES = [b'{"text": "a lone \\ud800 surrogate escape is valid JSON but not Unicode"}',  # line 2
             b"\xff\xfe not utf-8", b"[1, 2]", b'"a string"', b'{"text": 5}', b"{truncated"]


def _stage_argvs(tmp_path):
    """(stage, argv) running every JSONL-reading stage on the bad input; outputs under tmp_path."""
    from data_pipeline.tokenizer import save_tokenizer_dir
    from data_pipeline.train_tokenizer import train_byte_level_bpe

    good = "The river bends because the outer bank erodes faster than the inner one, year after year. " * 3
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"\n".join([json.dumps({"text": good, "url": "u1"}).encode(), *BAD_LINES,
                                 json.dumps({"text": good + " Again.", "url": "u2"}).encode()]) + b"\n")
    save_tokenizer_dir(train_byte_level_bpe([good], vocab_size=300), str(tmp_path / "tok"))
    groups = tmp_path / "groups.jsonl"
    groups.write_text(json.dumps({"keep": {"src": 0, "source": "bad.jsonl", "line": 1, "hash": None},
                                  "remove": [{"src": 0, "source": "bad.jsonl", "line": 8, "hash": None}]}) + "\n")
    o = str(tmp_path / "out")
    return [("cleanup", ["cleanup", str(bad), "--output", o, "--min-tokens", "5", "--workers", "1"]),
            ("find-duplicates", ["find-duplicates", str(bad), "--output", o, "--workers", "1"]),
            ("group-duplicates", ["group-duplicates", str(bad), "--output", o]),
            ("remove-duplicates", ["remove-duplicates", str(groups), str(bad), "--output", o]),
            ("shuffle", ["shuffle", str(bad), "--output", o]),
            ("shuffle-external", ["shuffle", str(bad), "--output", o, "--memory-limit", "100"]),
            ("train-tokenizer", ["train-tokenizer", str(bad), "--output", o, "--vocab-size", "300"]),
            ("tokenize", ["tokenize", str(bad), "--tokenizer", str(tmp_path / "tok"), "--output-prefix", o,
                          "--workers", "1"])]


@pytest.mark.timeout(120)
def test_every_stage_reports_bad_lines_with_file_and_line_never_a_traceback(tmp_path, capsys):
    """Each bad line is reported as file:line, skipped and counted (group-duplicates: every line is bad
    for it; shuffle copies any JSON object, so `{"text": 5}` passes); with --strict the first one is a
    one-line error and no output appears."""
    for stage, argv in _stage_argvs(tmp_path):
        assert main(argv) == 0, stage
        err = capsys.readouterr().err
        assert "Traceback" not in err
        bad_lines = [2, 3, 4, 5, 7] if stage.startswith("shuffle") else [2, 3, 4, 5, 6, 7]
        for lineno in bad_lines:
            assert f"bad.jsonl:{lineno}: " in err, (stage, lineno, err)
        assert "bad.jsonl:2: unpaired UTF-16 surrogate" in err or stage == "group-duplicates", (stage, err)
        stats = json.loads((tmp_path / "out.stats.json").read_text())
        malformed = 8 if stage == "group-duplicates" else len(bad_lines)
        assert stats["counts"]["malformed"] == malformed, (stage, stats["counts"])
        kept = {"cleanup": ("kept", 2), "find-duplicates": ("docs", 2), "remove-duplicates": ("kept", 1),
                "shuffle": ("docs", 3), "shuffle-external": ("docs", 3), "train-tokenizer": ("docs", 2),
                "tokenize": ("docs", 2)}.get(stage)
        if kept:
            assert stats["counts"][kept[0]] == kept[1], (stage, stats["counts"])
        for p in tmp_path.glob("out*"):
            p.unlink() if p.is_file() else shutil.rmtree(p)

        assert main(argv + ["--strict"]) == 2, stage
        err = capsys.readouterr().err
        first_bad = 1 if stage == "group-duplicates" else 2
        assert "Traceback" not in err and f"bad.jsonl:{first_bad}: " in err and "--strict" in err, (stage, err)
        assert not list(tmp_path.glob("out*")), stage  # atomic: nothing half-written is left


def test_malformed_lines_go_to_the_cleanup_rejects_file_whole(tmp_path, capsys):
    """A malformed input line is not only reported and counted: cleanup's rejects file keeps it, with
    its reason, as it keeps rejected documents."""
    from data_pipeline.jsonl import parse_jsonl_line

    assert parse_jsonl_line(b'{"text": "open')[1] == "malformed JSON (Unterminated string starting at column 10)"
    _, argv = _stage_argvs(tmp_path)[0]
    assert main(argv) == 0
    assert "recorded in" in capsys.readouterr().err
    rejected = [json.loads(line) for line in (tmp_path / "out.rejected.jsonl").read_text().splitlines()]
    malformed = {r["line"]: r for r in rejected if r["reason"] == "malformed"}
    assert sorted(malformed) == [2, 3, 4, 5, 6, 7]
    assert malformed[7]["raw"] == "{truncated" and "malformed JSON" in malformed[7]["detail"]
    assert malformed[3]["raw"].endswith(" not utf-8") and "not valid UTF-8" in malformed[3]["detail"]
    assert "field 'text' must be a string" in malformed[6]["detail"]


@pytest.mark.timeout(180)
def test_all_does_not_poison_its_workdir(tmp_path, site, capsys):
    """`all` without --allow-private on loopback URLs stops at download with its counts and the flags
    that help; with --allow-private the refused URLs are fetched; --force redoes download; --retry-failed
    fetches the other failures again."""
    base, handler = site
    urls = tmp_path / "urls.txt"
    urls.write_text("".join(f"{base}/article/{i}\n" for i in range(3)) + f"{base}/404\n")
    work = tmp_path / "work"
    argv = ["all", "--urls", str(urls), "--workdir", str(work), "--min-tokens", "50", "--timeout", "5",
            "--backoff", "0.05", "--extract-workers", "1", "--workers", "1", "--tokenize", "--vocab-size", "300"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "error: stage download produced nothing" in err and "private_address=4" in err
    assert "need --allow-private" in err and "--retry-failed" in err and "--force" in err
    assert not (work / "clean.jsonl").exists() and sum(handler.counters.values()) == 0
    assert main(argv + ["--force"]) == 2  # --force redoes download (no `already_done` from the run before)
    counts = json.loads((work / "raw.jsonl.stats.json").read_text())["counts"]
    assert counts["private_address"] == 4 and counts.get("already_done", 0) == 0
    capsys.readouterr()

    assert main(argv + ["--allow-private"]) == 0
    assert "fetching again 4 URLs that failed before (private_address=4)" in capsys.readouterr().err
    assert len(read_jsonl(work / "webtext.jsonl")) == 3 and handler.counters["/article/0"] == 1
    assert main(argv + ["--allow-private"]) == 0  # complete: the 404 is not fetched again
    assert "download: skipped" in capsys.readouterr().err and handler.counters["/404"] == 1
    assert main(argv + ["--allow-private", "--retry-failed"]) == 0
    err = capsys.readouterr().err
    assert "download: running" in err and "cleanup: skipped" in err  # nothing new: the rest is complete
    assert handler.counters["/404"] == 2 and handler.counters["/article/0"] == 1
    assert main(argv + ["--allow-private", "--force"]) == 0
    assert handler.counters["/article/0"] == 2 and len(read_jsonl(work / "raw.jsonl")) == 3


def test_an_empty_input_names_the_stage_that_wrote_it(tmp_path, capsys):
    """Run stage by stage (the tutorial's way), the first stage after the one that produced nothing
    says so, with that stage's counts; train-tokenizer's error does too (not a --json-key hint)."""
    urls = tmp_path / "urls.txt"
    urls.write_text("http://127.0.0.1:9/a\nhttp://10.0.0.1/b\n")
    assert main(["download", str(urls), "--output", str(tmp_path / "raw.json"), "--extract-workers", "1"]) == 0
    assert main(["cleanup", str(tmp_path / "raw.json"), str(tmp_path / "clean.json"), "--workers", "1"]) == 0
    err = capsys.readouterr().err
    assert f"warning: input {tmp_path / 'raw.json'} is empty; stage download wrote it (input=2, private_address=2" \
        in err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["shuffle", str(empty), "-o", str(tmp_path / "shuffled.jsonl")]) == 0
    assert main(["train-tokenizer", str(tmp_path / "shuffled.jsonl"), "--output", str(tmp_path / "tok")]) == 2
    err = capsys.readouterr().err
    assert "shuffled.jsonl holds no documents to train a tokenizer on; stage shuffle wrote it" in err
    assert "--json-key" not in err


@pytest.mark.timeout(180)
def test_colossalai_tutorial_commands_as_written(tmp_path, site, monkeypatch):
    """The seed tutorial's data preparation, command by command (Megatron's tool names become stages,
    `shuf` becomes `shuffle`), ends in a train_data.json that WebtextDataset trains from. Only
    --allow-private is added: the test's pages are on loopback."""
    base, handler = site
    monkeypatch.chdir(tmp_path)
    os.mkdir("urls")
    with open("urls/RS_2011-01.txt", "w") as f:
        f.write("".join(f"{base}/article/{i}\n" for i in range(6)) +
                f"{base}/dup/0\n{base}/article/1?copy=1\nhttps://www.youtube.com/watch?v=x\n{base}/paper.pdf\n")
    tutorial = [
        "blacklist urls clean_urls.txt",
        "download clean_urls.txt --n_procs 50 --output raw.json --allow-private",
        "cleanup raw.json clean.json",
        "find-duplicates --inputs clean.json url --output process_stage_one.json",
        "group-duplicates process_stage_one.json process_stage_two.json",
        "remove-duplicates process_stage_two.json clean.json dedup.json",
        "shuffle dedup.json -o train_data.json",
    ]
    for command in tutorial:
        assert main(command.split()) == 0, command
    final = read_jsonl("train_data.json")
    # youtube and .pdf never leave blacklist; article/1?copy=1 (exact) and dup/0 (near) are duplicates
    assert sorted(r["url"].removeprefix(base) for r in final) == [f"/article/{i}" for i in range(6)]
    assert sum(handler.counters.values()) == 8

    # the training side: DATA=train_data.json with a tokenizer/ beside it
    from data_pipeline.dataset import WebtextDataset
    from data_pipeline.indexed import IndexedDataset

    assert main("train-tokenizer train_data.json --output tokenizer --vocab-size 300".split()) == 0
    ds = WebtextDataset("train_data.json", seq_len=32, workers=1)
    item = ds[len(ds) - 1]
    assert item["input_ids"].shape == (32,) and (item["labels"][:-1] == item["input_ids"][1:]).all()
    cached = [p for p in os.listdir("index-cache") if p.endswith(".idx")]
    assert len(cached) == 1 and IndexedDataset(os.path.join("index-cache", cached[0][:-4])).num_documents == 6


def test_tutorial_forms_are_aliases_not_a_second_cli(capsys):
    """Each alias fills the same argument as today's flag; giving both, or neither, is an argparse error."""
    from data_pipeline.__main__ import build_parser

    def parse(command):
        return vars(build_parser(command.split()[0]).parse_args(command.split()))

    assert parse("cleanup raw.json clean.json") == parse("cleanup raw.json --output clean.json")
    assert parse("shuffle dedup.json -o t.json") == parse("shuffle dedup.json --output t.json")
    assert parse("remove-duplicates g.json c.json d.json") == parse("remove-duplicates g.json c.json --output d.json")
    assert parse("find-duplicates --inputs c.json url --output p.json") == \
        parse("find-duplicates c.json --output p.json")
    assert parse("download u.txt --n_procs 50 --output r.json") == parse("download u.txt --workers 50 --output r.json")
    for command, message in [("cleanup raw.json", "one of the arguments -o/--output OUTPUT is required"),
                             ("cleanup raw.json a.json --output b.json", "not allowed with argument"),
                             ("find-duplicates --inputs c.json id --output p.json", "the id key must be 'url'")]:
        with pytest.raises(SystemExit) as e:
            parse(command)
        assert e.value.code == 2 and message in capsys.readouterr().err, command
