"""Tests for data_pipeline/shuffle.py: seeded, same output in memory and external, bad lines."""
from __future__ import annotations

import json

import pytest

from data_pipeline.__main__ import main

pytestmark = pytest.mark.timeout(60)  # tests that need longer say so


def make_input(tmp_path, n=2000):
    path = tmp_path / "in.jsonl"
    lines = [json.dumps({"text": f"document {i} " + "x" * (i % 50), "url": f"u{i}"}, ensure_ascii=False)
             for i in range(n)]
    lines.insert(7, "{not json")
    lines.insert(100, "")
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.timeout(60)
def test_same_output_in_memory_and_external(tmp_path, capsys):
    src = make_input(tmp_path)
    outs = {}
    for limit in ("1G", "64K", "3K"):  # in memory, a few buckets, many buckets
        out = tmp_path / f"out-{limit}.jsonl"
        assert main(["shuffle", str(src), "--output", str(out), "--seed", "5", "--memory-limit", limit]) == 0
        outs[limit] = out.read_bytes()
        stats = json.loads((tmp_path / f"out-{limit}.jsonl.stats.json").read_text())
        assert stats["counts"]["docs"] == 2000 and stats["counts"]["malformed"] == 1
        assert stats["mode"] == ("memory" if limit == "1G" else "external")
    assert outs["1G"] == outs["64K"] == outs["3K"]
    assert json.loads((tmp_path / "out-3K.jsonl.stats.json").read_text())["buckets"] >= 64
    assert "in.jsonl:8: malformed JSON" in capsys.readouterr().err

    lines = outs["1G"].decode().splitlines()
    original = [ln for ln in src.read_text().splitlines() if ln.startswith("{\"")]
    assert sorted(lines) == sorted(original) and lines != original  # a permutation, not the identity
    first = [json.loads(ln)["url"] for ln in lines[:200]]
    assert sum(int(u[1:]) < 1000 for u in first) in range(70, 131)  # roughly uniform

    other = tmp_path / "seed6.jsonl"
    assert main(["shuffle", str(src), "--output", str(other), "--seed", "6"]) == 0
    assert other.read_bytes() != outs["1G"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # temp files cleaned up


@pytest.mark.timeout(30)
def test_bad_args_and_strict(tmp_path, capsys):
    src = make_input(tmp_path, 10)
    out = tmp_path / "o.jsonl"
    assert main(["shuffle", str(src), "--output", str(out), "--memory-limit", "lots"]) == 2
    assert "--memory-limit: cannot read 'lots' as a size" in capsys.readouterr().err
    assert main(["shuffle", str(src), "--output", str(out), "--strict"]) == 2
    assert "in.jsonl:8" in capsys.readouterr().err and not out.exists()
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["shuffle", str(empty), "--output", str(out), "--memory-limit", "1"]) == 0
    assert out.read_bytes() == b""
