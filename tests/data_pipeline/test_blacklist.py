"""Tests for data_pipeline/blacklist.py: domains, extensions, schemes, malformed URLs, duplicates."""
from __future__ import annotations

import json

import pytest

from data_pipeline.__main__ import main

pytestmark = pytest.mark.timeout(60)  # tests that need longer say so
from data_pipeline.blacklist import UrlFilter, default_list


@pytest.fixture(scope="module")
def url_filter():
    return UrlFilter(default_list("blacklist_domains.txt"), default_list("blacklist_extensions.txt"))


@pytest.mark.parametrize("url, reason", [
    ("https://example.com/story/2019/04/a-long-read", None),
    ("https://news.bbc.co.uk/2/hi/science/nature/1.stm", None),
    ("http://rabbit.ly/not-bitly", None),
    ("https://youtube.dev.example.org/post", None),       # 'youtube' is not the registered label here
    ("https://www.youtube.com/watch?v=abc", "domain"),
    ("https://m.youtube.co.uk/watch?v=abc", "domain"),    # any public suffix
    ("https://youtu.be/abc123", "domain"),
    ("https://i.imgur.com/xyz.gifv", "domain"),
    ("https://bit.ly/3abc", "domain"),
    ("https://user.github.io/blog/post", None),           # github.io is a public suffix: registered label is 'user'
    ("https://github.com/org/repo", "domain"),
    ("https://play.google.com/store/apps", "domain"),
    ("https://example.com/archive.7z", "extension"),      # Megatron fused '.7z' '.ai' into '.7z.ai'
    ("https://example.com/logo.ai", "extension"),
    ("https://example.com/logo.AI?download=1", "extension"),
    ("https://example.com/page?file=x.pdf", None),        # the query is not the path
    ("https://example.com/data.tar.gz", "extension"),
    ("https://example.com/paper.pdf#page=2", "extension"),
    ("ftp://example.com/file", "scheme"),
    ("mailto:someone@example.com", "scheme"),
    ("javascript:alert(1)", "scheme"),
    ("example.com/no-scheme", "scheme"),
    ("http://a.b", None),
    ("http://a", "too_short"),
    ("http://exa mple.com/", "malformed"),
    ("http://[::1/", "malformed"),
    ("http://example.com:99999/", "malformed"),
    ("http://-bad-.com/", "malformed"),
    ("http://exam\ufffdple.com/", "malformed"),
    ("http://", "malformed"),
])
def test_url_reasons(url_filter, url, reason):
    assert url_filter.check(url) == reason


def test_default_lists_have_megatron_fix():
    exts = default_list("blacklist_extensions.txt")
    assert ".7z" in exts and ".ai" in exts and ".7z.ai" not in exts
    assert all(e.startswith(".") for e in exts)


@pytest.mark.timeout(30)
def test_stage_directory_order_extras_and_stats(tmp_path, capsys):
    d = tmp_path / "urls"
    (d / "sub").mkdir(parents=True)
    (d / "b.txt").write_text("https://example.org/b1\nhttps://example.com/a1\n")
    (d / "a.txt").write_text("# comment\nhttps://example.com/a1\n\nhttps://example.com/a2\n"
                             "https://blocked.example.net/x\nhttps://example.com/file.weird\n")
    (d / "sub" / "c.txt").write_bytes(b"https://example.com/c1\nhttp://bad\xff.com/\n")
    (d / "notes.md").write_text("https://ignored.example.com/\n")
    extra_d = tmp_path / "domains.txt"
    extra_d.write_text("blocked.example.net\n")
    extra_e = tmp_path / "exts.txt"
    extra_e.write_text(".weird\n")
    out = tmp_path / "out.txt"
    assert main(["blacklist", str(d), "--output", str(out), "--extra-domains", str(extra_d),
                 "--extra-extensions", str(extra_e)]) == 0
    assert out.read_text().splitlines() == [
        "https://example.com/a1", "https://example.com/a2", "https://example.org/b1", "https://example.com/c1"]
    stats = json.loads((tmp_path / "out.txt.stats.json").read_text())
    assert stats["complete"]
    assert {k: stats["counts"][k] for k in ("input", "kept", "duplicate", "domain", "extension", "malformed")} == \
        {"input": 8, "kept": 4, "duplicate": 1, "domain": 1, "extension": 1, "malformed": 1}
    rejected = [json.loads(x) for x in (tmp_path / "out.txt.rejected.jsonl").read_text().splitlines()]
    assert rejected[0] == {"url": "https://blocked.example.net/x", "reason": "domain",
                           "source": f"{d}/a.txt:5"}
    err = capsys.readouterr().err
    assert "[blacklist]" in err and "c.txt:2: malformed URL" in err
    assert main(["blacklist", str(d), "--output", str(tmp_path / "strict.txt"), "--strict"]) == 2
    assert "c.txt:2: malformed URL" in capsys.readouterr().err and not (tmp_path / "strict.txt").exists()

    bad_ext = tmp_path / "bad_ext.txt"
    bad_ext.write_text("pdf\n")
    assert main(["blacklist", str(d), "--output", str(out), "--extra-extensions", str(bad_ext)]) == 2
    assert "must start with '.'" in capsys.readouterr().err
    assert main(["blacklist", str(tmp_path / "empty_dir_missing"), "--output", str(out)]) == 2
