"""Tests for data_pipeline/__main__.py and the `all` stage (data_pipeline/run_all.py) end to end."""
from __future__ import annotations

import json
import os

import pytest

try:  # the local test web server lives in test_download.py (rootdir-relative or package import)
    from test_download import Handler, QuietServer, read_jsonl
except ImportError:  # pragma: no cover - when tests/data_pipeline becomes a package
    from tests.data_pipeline.test_download import Handler, QuietServer, read_jsonl

from data_pipeline import __main__ as cli
from data_pipeline.__main__ import main

pytestmark = pytest.mark.timeout(60)  # tests that need longer say so


@pytest.fixture
def site():
    import threading
    from collections import Counter

    handler = type("H", (Handler,), {"counters": Counter(), "delay": 0.0})
    httpd = QuietServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", handler
    httpd.shutdown()
    httpd.server_close()


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
            "--timeout", "5", "--backoff", "0.05", "--extract-workers", "1", "--workers", "2", "--seed", "3"]
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
    before = {p: os.stat(work / p).st_mtime_ns for p in os.listdir(work)}
    first_bytes = (work / "webtext.jsonl").read_bytes()

    capsys.readouterr()
    handler.counters.clear()
    assert main(argv) == 0  # everything complete: nothing runs, nothing is fetched
    err = capsys.readouterr().err
    assert err.count("skipped") == 7 and sum(handler.counters.values()) == 0
    assert {p: os.stat(work / p).st_mtime_ns for p in os.listdir(work)} == before

    # a different threshold re-runs dedup onward only; a different seed changes only the order
    assert main(argv[:-1] + ["4", "--threshold", "0.99"]) == 0
    err = capsys.readouterr().err
    assert "blacklist: skipped" in err and "cleanup: skipped" in err and "find-duplicates: running" in err
    again = read_jsonl(work / "webtext.jsonl")
    assert sorted(r["url"] for r in again) == sorted([r["url"] for r in final] + [base + "/dup/0"])
    assert (work / "webtext.jsonl").read_bytes() != first_bytes

    # a truncated (partial) output is detected and rebuilt
    (work / "webtext.jsonl").write_text("")
    assert main(argv[:-1] + ["4", "--threshold", "0.99"]) == 0
    assert "shuffle: running" in capsys.readouterr().err
    assert len(read_jsonl(work / "webtext.jsonl")) == len(again)
