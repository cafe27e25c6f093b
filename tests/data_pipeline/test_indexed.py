"""Tests for data_pipeline/indexed.py: Megatron MMIDIDX round trip, files from an independent writer, bad files."""
from __future__ import annotations

import os
import pickle
import signal
import socket
import struct
import subprocess
import sys

import numpy as np
import pytest

from data_pipeline.indexed import (IndexedDataset, IndexedDatasetWriter, best_fitting_dtype, exists,
                                   HEADER_BYTES)

pytestmark = pytest.mark.timeout(60)

# Megatron-LM DType codes, restated here on purpose (an independent reading of the format).
MEGATRON_CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.float64: 6, np.float32: 7,
                  np.uint16: 8}


def megatron_write(prefix, documents, dtype):
    """Write .bin/.idx the way Megatron-LM's IndexedDatasetBuilder + _IndexWriter do.

    `documents` is a list of documents, each a list of sequences (token lists), so documents made of
    several sequences (preprocess_data.py --split-sentences) are covered too.
    """
    sizes, doc_idx = [], [0]
    with open(prefix + ".bin", "wb") as f:
        for doc in documents:
            for seq in doc:
                f.write(np.array(seq, dtype=dtype).tobytes(order="C"))
                sizes.append(len(seq))
            doc_idx.append(len(sizes))
    pointers, pos = [], 0
    for n in sizes:
        pointers.append(pos)
        pos += n * np.dtype(dtype).itemsize
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", MEGATRON_CODES[dtype]))
        f.write(struct.pack("<Q", len(sizes)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(np.array(sizes, dtype=np.int32).tobytes(order="C"))
        f.write(np.array(pointers, dtype=np.int64).tobytes(order="C"))
        f.write(np.array(doc_idx, dtype=np.int64).tobytes(order="C"))


def random_docs(n, vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=rng.integers(1, 50)).tolist() for _ in range(n)]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_writer_matches_independent_megatron_writer_byte_for_byte(tmp_path, dtype):
    docs = random_docs(40, 60000 if dtype == np.uint16 else 100_000)
    megatron_write(str(tmp_path / "ref"), [[d] for d in docs], dtype)
    with IndexedDatasetWriter(str(tmp_path / "ours"), dtype) as w:
        w.add_document(docs[0])
        flat = np.concatenate([np.array(d) for d in docs[1:]])
        w.add_documents(flat, np.array([len(d) for d in docs[1:]]))
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"ours{ext}").read_bytes() == (tmp_path / f"ref{ext}").read_bytes()


def test_reads_megatron_file_with_multi_sequence_documents(tmp_path):
    docs = [[[1, 2, 3], [4, 5]], [[6]], [[7, 8], [9], [10, 11, 12]]]
    prefix = str(tmp_path / "megatron_text_sentence")
    megatron_write(prefix, docs, np.int32)
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.int32 and len(ds) == 6 and ds.num_documents == 3 and ds.num_tokens == 12
    assert ds.doc_idx.tolist() == [0, 2, 3, 6]
    assert ds.sizes.tolist() == [3, 2, 1, 2, 1, 3]
    assert ds.pointers.tolist() == [0, 12, 20, 24, 32, 36]
    assert [ds[i].tolist() for i in range(6)] == [[1, 2, 3], [4, 5], [6], [7, 8], [9], [10, 11, 12]]
    assert ds.get(5, offset=1, length=1).tolist() == [11]
    starts, lengths = ds.document_token_ranges()
    assert starts.tolist() == [0, 5, 6] and lengths.tolist() == [5, 1, 6]
    assert ds.max_token_id() == 12 and ds.max_token_id(0, 5) == 5


def test_round_trip_and_pickle(tmp_path):
    docs = random_docs(100, 500, seed=1)
    prefix = str(tmp_path / "rt")
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for d in docs:
            w.add_document(d)
    ds = IndexedDataset(prefix)
    assert [ds[i].tolist() for i in range(len(ds))] == docs
    assert ds[-1].tolist() == docs[-1]
    with pytest.raises(IndexError):
        ds[len(ds)]
    clone = pickle.loads(pickle.dumps(ds))
    assert len(pickle.dumps(ds)) < 1000  # re-opens the map instead of copying the tokens
    assert clone[7].tolist() == docs[7]


def test_best_fitting_dtype():
    assert best_fitting_dtype(50257) == np.uint16
    assert best_fitting_dtype(65499) == np.uint16
    assert best_fitting_dtype(65500) == np.int32
    assert best_fitting_dtype(None) == np.int32


def test_writer_is_atomic(tmp_path):
    prefix = str(tmp_path / "atomic")
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        w.add_document([1, 2, 3])
    before = (tmp_path / "atomic.bin").read_bytes(), (tmp_path / "atomic.idx").read_bytes()
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(prefix, np.uint16) as w:
            w.add_document([9, 9, 9, 9])
            assert (tmp_path / "atomic.bin").read_bytes() == before[0]  # new tokens go to a temp file
            raise RuntimeError("killed mid-write")
    assert ((tmp_path / "atomic.bin").read_bytes(), (tmp_path / "atomic.idx").read_bytes()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["atomic.bin", "atomic.idx"]


def test_a_killed_writers_temporary_is_removed_by_the_next_write(tmp_path):
    """SIGKILL cannot be caught: the killed tokenize's `.bin` temporary (a corpus' size) is removed by the next run."""
    prefix = str(tmp_path / "killed")
    child = subprocess.Popen([sys.executable, "-c", (
        "import sys, time, numpy as np\n"
        "from data_pipeline.indexed import IndexedDatasetWriter\n"
        f"w = IndexedDatasetWriter({prefix!r}, np.uint16)\n"
        "w.add_document(np.arange(1000))\n"
        "w._bin.flush(); print('writing', flush=True); time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "writing\n"
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    assert [p.name for p in tmp_path.iterdir()] == [f"killed.bin.tmp-{socket.gethostname()}-{child.pid}"]
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        w.add_document([1, 2, 3])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["killed.bin", "killed.idx"]


def test_writer_rejects_ids_that_do_not_fit(tmp_path):
    with pytest.raises(ValueError, match="does not fit uint16"):
        with IndexedDatasetWriter(str(tmp_path / "x"), np.uint16) as w:
            w.add_document(np.array([70000], dtype=np.int64))
    assert not exists(str(tmp_path / "x"))


def test_empty_dataset(tmp_path):
    prefix = str(tmp_path / "empty")
    with IndexedDatasetWriter(prefix, np.uint16):
        pass
    ds = IndexedDataset(prefix)
    assert len(ds) == 0 and ds.num_documents == 0 and ds.num_tokens == 0


def _corrupt(tmp_path, edit):
    prefix = str(tmp_path / "c")
    megatron_write(prefix, [[d] for d in random_docs(10, 100)], np.uint16)
    edit(prefix)
    return prefix


def _patch(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.mark.parametrize("edit, message", [
    (lambda p: os.truncate(p + ".idx", 20), r"c\.idx is truncated \(20 bytes"),
    (lambda p: os.truncate(p + ".idx", os.path.getsize(p + ".idx") - 8), r"c\.idx is \d+ bytes but its header"),
    (lambda p: _patch(p + ".idx", 0, b"XXXXXXXXX"), r"c\.idx is not a Megatron MMIDIDX index"),
    (lambda p: _patch(p + ".idx", 9, struct.pack("<Q", 2)), r"c\.idx has index version 2"),
    (lambda p: _patch(p + ".idx", 17, struct.pack("<B", 42)), r"c\.idx has unknown dtype code 42"),
    (lambda p: _patch(p + ".idx", 17, struct.pack("<B", 7)), r"stores float32 values"),
    (lambda p: os.truncate(p + ".bin", os.path.getsize(p + ".bin") - 2), r"c\.bin is \d+ bytes .*truncated"),
    (lambda p: open(p + ".bin", "ab").write(b"\0\0"), r"c\.bin is \d+ bytes .*longer than its index"),
    (lambda p: os.remove(p + ".bin"), r"missing .*c\.bin"),
    (lambda p: _patch(p + ".idx", HEADER_BYTES + 10 * 4 + 8, struct.pack("<q", 3)), r"sequence 1 points at byte 3"),
    (lambda p: _patch(p + ".idx", HEADER_BYTES + 10 * 12, struct.pack("<q", 5)), r"bad document index"),
])
def test_bad_files_raise_clear_errors(tmp_path, edit, message):
    prefix = _corrupt(tmp_path, edit)
    with pytest.raises(ValueError, match=message) as info:
        IndexedDataset(prefix)
    assert "python -m data_pipeline tokenize" in str(info.value)
