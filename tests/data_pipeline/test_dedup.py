"""Tests for find_duplicates.py, group_duplicates.py and remove_duplicates.py."""
from __future__ import annotations

import itertools
import json
import random

import numpy as np
import pytest

from data_pipeline.__main__ import main

pytestmark = pytest.mark.timeout(60)  # tests that need longer say so
from data_pipeline.find_duplicates import jaccard, normalise, shingle_hashes

try:  # the shared corpus helpers (rootdir-relative or package import)
    from dedup_docs import edit, real_docs, write_docs
except ImportError:  # pragma: no cover - when tests/data_pipeline becomes a package
    from tests.data_pipeline.dedup_docs import edit, real_docs, write_docs




def read_jsonl(path):
    with open(path) as f:
        return [json.loads(x) for x in f]


def test_shingles_keep_the_last_one_and_normalise():
    assert len(shingle_hashes("abcdef", 5)) == 2   # 'abcde', 'bcdef'
    assert len(shingle_hashes("abcde", 5)) == 1
    assert len(shingle_hashes("abc", 5)) == 1      # shorter than n: one shingle
    assert len(shingle_hashes(" ,;! ", 5)) == 0    # nothing left after normalisation
    assert normalise("Hello,   WORLD!\n\tＦｕｌｌ") == "hello world full"
    assert np.array_equal(shingle_hashes("Hello, World!"), shingle_hashes("hello world"))
    assert len(shingle_hashes("one two three four five six", 5, "word")) == 2
    assert len(shingle_hashes("abcdefgh", 5)) == 4 and shingle_hashes("abcdefgh").dtype == np.uint32
    a, b = shingle_hashes("the quick brown fox"), shingle_hashes("the quick brown fox jumps")
    assert 0 < jaccard(a, b) < 1 and jaccard(a, a) == 1.0


def corpus(tmp_path):
    """Originals, near-duplicates (2% edits, J > 0.85), an exact copy, hard negatives (J ~ 0.5)."""
    rng = random.Random(0)
    docs = real_docs(40)
    texts = list(docs)                            # lines 1..40
    texts.append(edit(docs[0], 0.02, rng))        # line 41 ~ line 1
    texts.append(docs[3])                         # line 42 == line 4 (exact)
    texts.append(edit(docs[7], 0.02, rng))        # line 43 ~ line 8
    texts.append(edit(texts[-1], 0.02, rng))      # line 44 ~ line 43 (and line 8)
    texts.append(edit(docs[9], 0.25, rng))        # line 45: hard negative of line 10 (J ~ 0.5)
    texts.append("!!! ... ???")                   # line 46: empty after normalisation
    path = write_docs(tmp_path / "docs.jsonl", texts)
    with open(path, "a") as f:
        f.write("{broken json\n")                 # line 47
    return path, texts


def brute_force_pairs(texts, threshold=0.7):
    sets = [shingle_hashes(t) for t in texts]
    return {(i + 1, j + 1) for i, j in itertools.combinations(range(len(texts)), 2)
            if sets[i].size and sets[j].size and jaccard(sets[i], sets[j]) >= threshold}


@pytest.mark.timeout(60)
def test_find_group_remove_match_brute_force(tmp_path, capsys):
    path, texts = corpus(tmp_path)
    truth = brute_force_pairs(texts)
    assert truth == {(1, 41), (4, 42), (8, 43), (8, 44), (43, 44)}

    pairs = tmp_path / "pairs.jsonl"
    assert main(["find-duplicates", str(path), "--output", str(pairs), "--workers", "1"]) == 0
    found = read_jsonl(pairs)
    assert {(p["a"]["line"], p["b"]["line"]) for p in found} == truth
    assert all(p["a"]["line"] < p["b"]["line"] and p["jaccard"] >= 0.7 for p in found)
    assert found[0]["a"] == {"src": 0, "source": "docs.jsonl", "line": 1, "url": "https://example.com/0",
                             "hash": found[0]["a"]["hash"]}
    stats = json.loads((tmp_path / "pairs.jsonl.stats.json").read_text())
    c = stats["counts"]
    assert c["malformed"] == 1 and c["empty_after_normalisation"] == 1 and c["exact_duplicates"] == 1
    assert c["docs"] == len(texts) - 1 and stats["lsh"]["bands"] * stats["lsh"]["rows"] <= 128
    assert "docs.jsonl:47: malformed JSON" in capsys.readouterr().err

    # parallel signatures give the same bytes
    pairs2 = tmp_path / "pairs2.jsonl"
    assert main(["find-duplicates", str(path), "--output", str(pairs2), "--workers", "2"]) == 0
    assert pairs2.read_bytes() == pairs.read_bytes()

    # group: the keeper is the first in input order, whatever order the pairs come in
    lines = pairs.read_text().splitlines()
    random.Random(1).shuffle(lines)
    shuffled = tmp_path / "shuffled_pairs.jsonl"
    shuffled.write_text("\n".join(lines) + "\n[1, 2]\n")
    groups = tmp_path / "groups.jsonl"
    assert main(["group-duplicates", str(shuffled), "--output", str(groups)]) == 0
    got = [(g["keep"]["line"], [r["line"] for r in g["remove"]]) for g in read_jsonl(groups)]
    assert got == [(1, [41]), (4, [42]), (8, [43, 44])]
    gstats = json.loads((tmp_path / "groups.jsonl.stats.json").read_text())
    assert gstats["group_sizes"] == {"2": 2, "3": 1} and gstats["counts"]["malformed"] == 1

    out = tmp_path / "dedup.jsonl"
    assert main(["remove-duplicates", str(groups), str(path), "--output", str(out)]) == 0
    kept = [r["text"] for r in read_jsonl(out)]
    removed = {41, 42, 43, 44}
    assert kept == [t for i, t in enumerate(texts, 1) if i not in removed]
    rstats = json.loads((tmp_path / "dedup.jsonl.stats.json").read_text())["counts"]
    assert rstats["removed"] == 4 and rstats["chars_removed"] == sum(len(texts[i - 1]) for i in removed)

    # groups applied to a different file: loud error, no output
    other = write_docs(tmp_path / "docs_other.jsonl", list(reversed(texts)))
    assert main(["remove-duplicates", str(groups), str(other), "--output", str(tmp_path / "x.jsonl"),
                 "--source", "docs.jsonl"]) == 2
    assert "re-run find-duplicates" in capsys.readouterr().err and not (tmp_path / "x.jsonl").exists()


@pytest.mark.timeout(60)
def test_group_threshold_and_chain(tmp_path):
    def ref(line):
        return {"src": 0, "source": "d.jsonl", "line": line, "url": None, "hash": None}
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"a": ref(a), "b": ref(b), "jaccard": j}) + "\n" for a, b, j in
                             [(5, 9, 0.95), (2, 5, 0.75), (9, 12, 0.9), (20, 21, 0.72), (3, 4, "x")]))
    groups = tmp_path / "groups.jsonl"
    assert main(["group-duplicates", str(pairs), "--output", str(groups), "--threshold", "0.8"]) == 0
    assert [(g["keep"]["line"], [r["line"] for r in g["remove"]]) for g in read_jsonl(groups)] == [(5, [9, 12])]
    assert main(["group-duplicates", str(pairs), "--output", str(groups), "--threshold", "0.7"]) == 0
    assert [(g["keep"]["line"], g["size"]) for g in read_jsonl(groups)] == [(2, 4), (20, 2)]
    assert main(["group-duplicates", str(pairs), "--output", str(groups), "--strict"]) == 2


@pytest.mark.timeout(60)
def test_exact_duplicate_cluster_is_linear(tmp_path):
    doc = real_docs(1)[0]
    path = write_docs(tmp_path / "d.jsonl", [doc] * 300 + real_docs(4)[1:])
    pairs = tmp_path / "p.jsonl"
    assert main(["find-duplicates", str(path), "--output", str(pairs), "--workers", "1"]) == 0
    c = json.loads((tmp_path / "p.jsonl.stats.json").read_text())["counts"]
    assert c["pairs"] == 299 and c["exact_duplicates"] == 299 and c["candidates"] <= 3
    groups = tmp_path / "g.jsonl"
    assert main(["group-duplicates", str(pairs), "--output", str(groups)]) == 0
    assert [g["size"] for g in read_jsonl(groups)] == [300]


@pytest.mark.timeout(60)
def test_fingerprints_save_load(tmp_path, capsys):
    rng = random.Random(2)
    docs = real_docs(30)
    old = write_docs(tmp_path / "old.jsonl", docs[:20])
    new = write_docs(tmp_path / "new.jsonl", [edit(docs[3], 0.02, rng), docs[25], docs[10], docs[26]])
    fp = tmp_path / "old.fp"
    assert main(["find-duplicates", str(old), "--output", str(tmp_path / "p_old.jsonl"),
                 "--save-fingerprints", str(fp), "--workers", "1"]) == 0
    pairs = tmp_path / "p_new.jsonl"
    assert main(["find-duplicates", str(new), "--output", str(pairs), "--load-fingerprints", str(fp),
                 "--workers", "1"]) == 0
    found = [((p["a"]["source"], p["a"]["line"]), (p["b"]["source"], p["b"]["line"])) for p in read_jsonl(pairs)]
    assert found == [(("old.jsonl", 4), ("new.jsonl", 1)), (("old.jsonl", 11), ("new.jsonl", 3))]
    groups = tmp_path / "g.jsonl"
    assert main(["group-duplicates", str(pairs), "--output", str(groups)]) == 0
    out = tmp_path / "new.dedup.jsonl"
    assert main(["remove-duplicates", str(groups), str(new), "--output", str(out)]) == 0
    assert [r["text"] for r in read_jsonl(out)] == [docs[25], docs[26]]  # the old corpus wins

    assert main(["find-duplicates", str(new), "--output", str(pairs), "--load-fingerprints", str(fp),
                 "--ngram", "4"]) == 2
    assert "ngram=5" in capsys.readouterr().err
    bad = tmp_path / "bad.fp"
    bad.write_bytes(b"\x00" * 100)
    assert main(["find-duplicates", str(new), "--output", str(pairs), "--load-fingerprints", str(bad)]) == 2
    assert "bad magic" in capsys.readouterr().err
