"""Tests for data_pipeline/dataset.py: packing across documents, splits, seeded shuffle, epochs, index cache
(single process and rank-0-builds under gloo), loss mask, WebtextDataset, and bad-input errors."""
from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
import torch

from data_pipeline.dataset import GPTDataset, WebtextDataset, split_document_ranges
from data_pipeline.indexed import IndexedDatasetWriter
from tests.dist_utils import run_distributed

pytestmark = pytest.mark.timeout(90)
EOD = 0


def make_corpus(prefix, num_docs=60, seed=0, max_len=40):
    """Documents of unique content tokens (a running counter from 1) each ending in EOD=0.

    Returns {token: (doc, position)} for content tokens and the documents themselves.
    """
    rng = np.random.default_rng(seed)
    docs, where, next_token = [], {}, 1
    for d in range(num_docs):
        n = int(rng.integers(3, max_len))
        content = list(range(next_token, next_token + n))
        next_token += n
        for pos, t in enumerate(content):
            where[t] = (d, pos)
        docs.append(content + [EOD])
    with IndexedDatasetWriter(str(prefix), np.uint16) as w:
        for doc in docs:
            w.add_document(doc)
    return where, docs


def assert_contiguous_packing(tokens, where, docs):
    """Consecutive tokens continue the same document, or jump from a document's EOD to another's start."""
    for a, b in zip(tokens[:-1], tokens[1:]):
        if a == EOD:
            assert where[b][1] == 0, (a, b)  # the next document starts at its first token
        else:
            d, pos = where[a]
            expected = docs[d][pos + 1]
            assert b == expected, (a, b, expected)


@pytest.fixture()
def corpus(tmp_path):
    where, docs = make_corpus(tmp_path / "c")
    return str(tmp_path / "c"), where, docs


def test_items_are_packed_shifted_windows_covering_the_split(corpus):
    prefix, where, docs = corpus
    ds = GPTDataset(prefix, seq_len=16, splits="1,0,0")
    total = sum(len(d) for d in docs)
    assert len(ds) == (total - 1) // 16 and ds.num_epochs == 1
    seen = set()
    for i in range(len(ds)):
        item = ds[i]
        assert set(item) == {"input_ids", "labels"}
        assert item["input_ids"].shape == (16,) and item["input_ids"].dtype == torch.int64
        assert torch.equal(item["labels"][:-1], item["input_ids"][1:])
        tokens = item["input_ids"].tolist() + item["labels"][-1:].tolist()
        assert_contiguous_packing(tokens, where, docs)
        seen.update(tokens)
    content = total - len(docs)
    assert len(seen - {EOD}) >= content - 16  # everything but the tail shorter than one sample


def test_split_ranges_follow_megatron_rounding():
    assert split_document_ranges("969,30,1", 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert split_document_ranges("969,30,1", 100) == [(0, 97), (97, 100), (100, 100)]
    assert split_document_ranges("98,2", 50) == [(0, 49), (49, 50), (50, 50)]
    assert split_document_ranges([1, 1, 1], 10) == [(0, 4), (4, 7), (7, 10)]  # rounding excess shifts the bounds


def test_split_ranges_are_disjoint_when_a_split_is_empty():
    # Megatron's bounds would be 0, -1, 1, 3: train docs[0:-1] = 0..1 and test 1..2 overlap, valid reads nothing
    assert split_document_ranges("0,1,1", 3) == [(0, 0), (0, 1), (1, 3)]
    for n in range(1, 40):
        for splits in ("0,1,1", "1,0,1", "0,0,1", "1,1,1", "0,1,0", "0.5,0.25,0.25"):
            bounds = [b for r in split_document_ranges(splits, n) for b in r]
            assert bounds == sorted(bounds) and bounds[0] == 0 and bounds[-1] == n, (splits, n, bounds)


def test_splits_are_disjoint_documents(corpus):
    prefix, where, docs = corpus
    train = GPTDataset(prefix, seq_len=8, splits="8,2,0")
    valid = GPTDataset(prefix, seq_len=8, split="valid", splits="8,2,0")
    docs_of = lambda ds: {where[t][0] for i in range(len(ds)) for t in ds[i]["input_ids"].tolist() if t}  # noqa
    train_docs, valid_docs = docs_of(train), docs_of(valid)
    assert max(train_docs) < 48 <= min(valid_docs)
    with pytest.raises(ValueError, match=r"split 'test' of .*c\.bin has 0 tokens .*seq_len"):
        GPTDataset(prefix, seq_len=8, split="test", splits="8,2,0")


def test_seeded_order_and_cache_reuse(corpus, monkeypatch, tmp_path):
    prefix, _, _ = corpus
    a = GPTDataset(prefix, seq_len=16, seed=1)
    order = [a[i]["input_ids"][0].item() for i in range(len(a))]
    assert [GPTDataset(prefix, seq_len=16, seed=1)[i]["input_ids"][0].item() for i in range(len(a))] == order
    b = GPTDataset(prefix, seq_len=16, seed=2)
    assert [b[i]["input_ids"][0].item() for i in range(len(b))] != order
    cache_files = sorted(os.listdir(tmp_path / "index-cache"))
    assert len(cache_files) == 8  # (doc, sample, shuffle idx + meta) x 2 seeds

    def no_rebuild(self, key):
        raise AssertionError("index rebuilt although cached")
    monkeypatch.setattr(GPTDataset, "_build_index", no_rebuild)
    GPTDataset(prefix, seq_len=16, seed=1)  # served from cache
    with pytest.raises(AssertionError, match="rebuilt"):
        GPTDataset(prefix, seq_len=17, seed=1)  # a different key builds a new index


def test_a_damaged_index_cache_is_named_in_one_line(corpus, tmp_path):
    prefix, _, _ = corpus
    GPTDataset(prefix, seq_len=16, seed=3)
    cached = next(p for p in sorted((tmp_path / "index-cache").iterdir()) if p.name.endswith("sample_idx.npy"))
    cached.write_bytes(cached.read_bytes()[:-8])  # truncated after the build
    with pytest.raises(ValueError, match=f"index cache {cached} cannot be read .*it is corrupt: delete"):
        GPTDataset(prefix, seq_len=16, seed=3)


def test_num_samples_adds_epochs_full_epochs_first(corpus):
    prefix, where, docs = corpus
    one = GPTDataset(prefix, seq_len=16, splits="1,0,0")
    many = GPTDataset(prefix, seq_len=16, splits="1,0,0", num_samples=3 * len(one) + 5)
    assert len(many) == 3 * len(one) + 5 and many.num_epochs == 4
    total = sum(len(d) for d in docs)
    full = (3 * total - 1) // 16
    assert sorted(many.shuffle_idx[:full].tolist()) == list(range(full))
    assert min(many.shuffle_idx[full:].tolist()) >= full
    for i in (0, full - 1, full, len(many) - 1):
        item = many[i]
        assert_contiguous_packing(item["input_ids"].tolist() + item["labels"][-1:].tolist(), where, docs)
    # every epoch uses a different document order
    assert not np.array_equal(many.doc_idx[:60], many.doc_idx[60:120])


def test_loss_mask_masks_the_token_after_eod(corpus, tmp_path):
    prefix, _, _ = corpus
    with pytest.raises(ValueError, match="pass eod_id"):
        GPTDataset(prefix, seq_len=32, loss_mask=True)
    ds = GPTDataset(prefix, seq_len=32, loss_mask=True, eod_id=EOD)
    plain = GPTDataset(prefix, seq_len=32)
    masked = 0
    for i in range(len(ds)):
        item, ref = ds[i], plain[i]
        after_eod = ref["input_ids"] == EOD
        masked += int(after_eod.sum())
        assert torch.equal(item["loss_mask"], (~after_eod).float())
        assert torch.equal(item["labels"][after_eod], torch.full((int(after_eod.sum()),), -100))
        assert torch.equal(item["labels"][~after_eod], ref["labels"][~after_eod])
    assert masked >= 50  # about one per document


def test_vocab_and_length_errors_name_the_file(corpus, tmp_path):
    prefix, where, _ = corpus
    max_id = max(where)
    with pytest.raises(ValueError, match=rf"c\.bin holds token id {max_id} .* vocab_size is 100"):
        GPTDataset(prefix, seq_len=16, vocab_size=100, splits="1,0,0")
    GPTDataset(prefix, seq_len=16, vocab_size=max_id + 1, splits="1,0,0")
    with pytest.raises(ValueError, match=r"fewer than seq_len \+ 1 = 100001.*data_pipeline tokenize"):
        GPTDataset(prefix, seq_len=100_000)
    (tmp_path / "c.stats.json").write_text(json.dumps(
        {"stage": "tokenize", "vocab_size": 50257, "dtype": "uint16", "eod_id": 0, "tokenizer": "/tok"}))
    with pytest.raises(ValueError, match=r"tokenized with /tok \(50257 ids.*vocab_size is 5000"):
        GPTDataset(prefix, seq_len=16, vocab_size=5000)
    (tmp_path / "c.stats.json").write_text(json.dumps(
        {"stage": "tokenize", "vocab_size": 100000, "dtype": "int32", "eod_id": 0}))
    with pytest.raises(ValueError, match=r"stores uint16 tokens but .*stats\.json records a int32 file"):
        GPTDataset(prefix, seq_len=16)
    (tmp_path / "c.stats.json").unlink()
    for kwargs, message in (({"split": "dev"}, "split='dev'"), ({"splits": "a,b"}, "splits='a,b'"),
                            ({"seq_len": 0}, "seq_len must be"), ({"num_samples": 0}, "num_samples")):
        with pytest.raises(ValueError, match=message):
            GPTDataset(prefix, **{"seq_len": 16, **kwargs})


def test_reads_megatron_written_files(tmp_path):
    """A .bin/.idx pair written by hand in Megatron's layout (int32 tokens, two sentences per document)."""
    docs = [[[5, 6, 7], [8, 0]], [[9, 10, 11, 12, 0]], [[13, 14], [15, 0]]]
    sizes = [len(s) for d in docs for s in d]
    with open(tmp_path / "m.bin", "wb") as f:
        f.write(np.array([t for d in docs for s in d for t in s], dtype=np.int32).tobytes())
    with open(tmp_path / "m.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 4, len(sizes), len(docs) + 1))
        f.write(np.array(sizes, np.int32).tobytes())
        f.write((np.concatenate([[0], np.cumsum(sizes)[:-1]]) * 4).astype(np.int64).tobytes())
        f.write(np.array([0, 2, 3, 5], np.int64).tobytes())
    ds = GPTDataset(str(tmp_path / "m"), seq_len=4, splits="1,0,0", seed=0)
    assert len(ds) == (15 - 1) // 4
    stream = [t for i in range(len(ds)) for t in ds.sample_tokens(i).tolist()]
    assert set(stream) <= set(range(5, 16)) | {0}


def _build_on_two_ranks(rank, world_size, prefix):
    calls = []
    original = GPTDataset._build_index
    GPTDataset._build_index = lambda self, key: (calls.append(rank), original(self, key))[1]
    ds = GPTDataset(prefix, seq_len=16, seed=7)
    return calls, [ds[i]["input_ids"].tolist() for i in range(len(ds))]


def test_rank0_builds_the_index_once_under_torch_distributed(corpus):
    prefix, _, _ = corpus
    (calls0, items0), (calls1, items1) = run_distributed(_build_on_two_ranks, 2, prefix, timeout=60)
    assert calls0 == [0] and calls1 == []
    assert items0 == items1 == [GPTDataset(prefix, seq_len=16, seed=7)[i]["input_ids"].tolist()
                                for i in range(len(items0))]


def test_dataloader_workers_reopen_the_maps(corpus):
    prefix, _, _ = corpus
    ds = GPTDataset(prefix, seq_len=16)
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2)
    batches = list(loader)
    assert torch.equal(torch.cat([b["input_ids"] for b in batches]), torch.stack([ds[i]["input_ids"]
                                                                                for i in range(len(ds))]))


def test_webtext_dataset_tokenizes_once_and_needs_a_tokenizer(tmp_path, monkeypatch):
    from data_pipeline import tokenize_stage
    from data_pipeline.tokenizer import save_tokenizer_dir
    from data_pipeline.train_tokenizer import train_byte_level_bpe

    texts = [f"Document number {i} talks about rivers, sand and the valley floor. " * (1 + i % 4) for i in range(80)]
    path = tmp_path / "webtext.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    with pytest.raises(ValueError, match=r"needs a tokenizer.*train-tokenizer .*webtext\.jsonl --output .*tokenizer"):
        WebtextDataset(str(path), seq_len=32)
    save_tokenizer_dir(train_byte_level_bpe(texts, vocab_size=300), str(tmp_path / "tokenizer"))
    ds = WebtextDataset(str(path), seq_len=32)  # finds tokenizer/ beside the data
    assert len(ds) > 10 and ds[0]["input_ids"].shape == (32,) and ds.eod_id == 0
    monkeypatch.setattr(tokenize_stage, "tokenize_file", lambda *a, **k: pytest.fail("re-tokenized"))
    again = WebtextDataset(str(path), seq_len=32)
    assert torch.equal(again[3]["input_ids"], ds[3]["input_ids"])
    assert WebtextDataset(str(path), seq_len=32, splits="1,0,0").prefix == ds.prefix
