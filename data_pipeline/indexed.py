"""Megatron-LM indexed dataset (`MMIDIDX`) format: a streaming writer and a memory-mapped reader.

Owns the byte layout of `P.bin` (all tokens back to back) and `P.idx` (header, per-sequence lengths and
byte pointers, document index), bit-compatible with Megatron-LM's `preprocess_data.py` output.
Packing tokens into training samples lives in `dataset.py`; tokenization lives in `tokenize_stage.py`.

Layout of `P.idx` (little-endian), as written by Megatron-LM's `_IndexWriter`:
    9 bytes  magic b"MMIDIDX\\x00\\x00"       8 bytes  <Q version (1)         1 byte <B dtype code
    8 bytes  <Q number of sequences N          8 bytes  <Q length D of the document index (= documents + 1)
    N x int32 sequence lengths (tokens)        N x int64 sequence byte pointers into P.bin
    D x int64 document index: document d holds sequences [doc_idx[d], doc_idx[d+1])
"""
from __future__ import annotations

import os
import struct

import numpy as np

from data_pipeline.files import temp_sibling

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER_BYTES = 9 + 8 + 1 + 8 + 8  # magic, version, dtype code, sequence count, document index length

# Megatron-LM's DType enum codes (megatron/core/datasets/indexed_dataset.py).
DTYPE_CODES: dict[int, type] = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32,
    5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
CODE_OF_DTYPE = {np.dtype(v): k for k, v in DTYPE_CODES.items()}

_REBUILD_HINT = ("rebuild it with `python -m data_pipeline tokenize IN.jsonl --tokenizer DIR "
                 "--output-prefix PREFIX` (or Megatron-LM's tools/preprocess_data.py)")


def best_fitting_dtype(vocab_size: int | None) -> type:
    """uint16 when every token id fits with room to spare (vocab < 65500, Megatron's rule), else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


def exists(prefix: str) -> bool:
    """True when both P.bin and P.idx are present (not a validity check)."""
    return os.path.isfile(data_file_path(prefix)) and os.path.isfile(index_file_path(prefix))


class IndexedDatasetWriter:
    """Streams token documents to `P.bin`/`P.idx`, atomically.

    Tokens go to temporary files beside the targets; `finalize()` writes the index and renames both
    into place (`.bin` first, then `.idx`), so a reader never sees a half-written pair. Leaving the
    `with` block through an exception removes the temporaries and leaves old outputs untouched.
    Per-document lengths stay in memory (4 bytes per document); the tokens never do.

    Example:
        >>> with IndexedDatasetWriter("/tmp/corpus", np.uint16) as w:  # doctest: +SKIP
        ...     w.add_document(np.array([5, 7, 0]))
        ...     w.add_documents(np.array([1, 0, 2, 3, 0]), np.array([2, 3]))
    """

    def __init__(self, prefix: str, dtype: type = np.uint16) -> None:
        if np.dtype(dtype) not in CODE_OF_DTYPE:
            raise ValueError(f"token dtype {np.dtype(dtype)} is not a Megatron dtype; "
                             f"valid: {sorted(str(np.dtype(d)) for d in DTYPE_CODES.values())}")
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        self._bin_tmp = temp_sibling(data_file_path(prefix))
        self._idx_tmp = temp_sibling(index_file_path(prefix))
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        self._bin = open(self._bin_tmp, "wb")
        self._lengths: list[np.ndarray] = []
        self.num_documents = 0
        self.num_tokens = 0
        self._done = False

    def add_document(self, tokens: np.ndarray | list[int]) -> None:
        """Append one document (one sequence)."""
        tokens = np.asarray(tokens)
        self.add_documents(tokens, np.array([tokens.size], dtype=np.int64))

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append many documents at once: `tokens` is their concatenation, `lengths` their sizes."""
        lengths = np.asarray(lengths, dtype=np.int64)
        tokens = np.asarray(tokens)
        assert tokens.ndim == 1 and int(lengths.sum()) == tokens.size, (tokens.shape, int(lengths.sum()))
        if lengths.size and (lengths.max() > np.iinfo(np.int32).max or lengths.min() < 0):
            raise ValueError(f"document length {int(lengths.max())} does not fit the int32 length field")
        if tokens.dtype != self.dtype:
            if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(self.dtype).max):
                raise ValueError(f"token id {int(tokens.max())} does not fit {self.dtype} in {self.prefix}.bin; "
                                 "write with dtype=np.int32 (vocab >= 65500)")
            tokens = tokens.astype(self.dtype)
        self._bin.write(tokens.tobytes(order="C"))
        self._lengths.append(lengths.astype(np.int32))
        self.num_documents += lengths.size
        self.num_tokens += tokens.size

    def finalize(self) -> None:
        """Write the index and move both files into place."""
        self._bin.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
        write_index(self._idx_tmp, lengths, np.arange(lengths.size + 1, dtype=np.int64), self.dtype)
        os.replace(self._bin_tmp, data_file_path(self.prefix))
        os.replace(self._idx_tmp, index_file_path(self.prefix))
        self._done = True

    def abort(self) -> None:
        """Drop the temporaries; existing outputs stay as they were."""
        self._bin.close()
        for path in (self._bin_tmp, self._idx_tmp):
            if os.path.exists(path):
                os.remove(path)

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._done:
            self.finalize()


def write_index(path: str, lengths: np.ndarray, doc_idx: np.ndarray, dtype: type) -> None:
    """Write a `.idx` file for sequences stored back to back in the matching `.bin`."""
    dtype = np.dtype(dtype)
    lengths = np.asarray(lengths, dtype=np.int32)
    pointers = np.zeros(lengths.size, dtype=np.int64)
    np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
    pointers *= dtype.itemsize
    with open(path, "wb") as f:
        f.write(INDEX_MAGIC)
        f.write(struct.pack("<Q", INDEX_VERSION))
        f.write(struct.pack("<B", CODE_OF_DTYPE[dtype]))
        f.write(struct.pack("<Q", lengths.size))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(lengths.tobytes(order="C"))
        f.write(pointers.tobytes(order="C"))
        f.write(np.asarray(doc_idx, dtype=np.int64).tobytes(order="C"))


class IndexedDataset:
    """Memory-mapped reader of a Megatron `P.bin`/`P.idx` pair, validated on open.

    `ds[i]` is sequence i as a read-only numpy view; `ds.tokens` is the whole `.bin` as one flat array.
    Documents (the unit the train/valid/test split works on) are contiguous runs of sequences; with
    `preprocess_data.py` and our `tokenize` stage each document is exactly one sequence.

    Opening checks the magic, version, dtype code, the index size against its header, the document
    index, and that the sequence pointers tile `P.bin` exactly; any mismatch raises ValueError naming
    the file and the stage that rebuilds it. Picklable (re-opens the maps), so DataLoader workers work.

    Example:
        >>> ds = IndexedDataset("/data/webtext_text_document")  # doctest: +SKIP
        >>> len(ds), ds.num_tokens, ds[0][:8]                   # doctest: +SKIP
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._open()

    def _open(self) -> None:
        idx_path, bin_path = index_file_path(self.prefix), data_file_path(self.prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise ValueError(f"missing {path}: an indexed dataset needs both {self.prefix}.bin and "
                                 f"{self.prefix}.idx; {_REBUILD_HINT}")
        idx_size = os.path.getsize(idx_path)
        if idx_size < HEADER_BYTES:
            raise ValueError(f"{idx_path} is truncated ({idx_size} bytes, the header alone is {HEADER_BYTES}); "
                             f"{_REBUILD_HINT}")
        with open(idx_path, "rb") as f:
            header = f.read(HEADER_BYTES)
        magic = header[:9]
        if magic != INDEX_MAGIC:
            raise ValueError(f"{idx_path} is not a Megatron MMIDIDX index: magic {magic!r}, expected "
                             f"{INDEX_MAGIC!r}; {_REBUILD_HINT}")
        (version,) = struct.unpack("<Q", header[9:17])
        if version != INDEX_VERSION:
            raise ValueError(f"{idx_path} has index version {version}, expected {INDEX_VERSION}; {_REBUILD_HINT}")
        (code,) = struct.unpack("<B", header[17:18])
        if code not in DTYPE_CODES:
            raise ValueError(f"{idx_path} has unknown dtype code {code}; valid Megatron codes: "
                             f"{sorted(DTYPE_CODES)}; the file is corrupt, {_REBUILD_HINT}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        if self.dtype.kind == "f":
            raise ValueError(f"{idx_path} stores {self.dtype} values, not token ids; {_REBUILD_HINT}")
        num_seq, doc_len = struct.unpack("<QQ", header[18:34])
        expected = HEADER_BYTES + num_seq * (4 + 8) + doc_len * 8
        # Megatron's multimodal variant appends one int8 mode per sequence; accept and ignore it.
        if idx_size not in (expected, expected + num_seq):
            raise ValueError(f"{idx_path} is {idx_size} bytes but its header (sequences={num_seq}, "
                             f"document index={doc_len}) needs {expected}: truncated or corrupt; {_REBUILD_HINT}")

        self._idx_map = np.memmap(idx_path, mode="r", dtype=np.uint8)
        buf = self._idx_map
        self.sizes = np.frombuffer(buf, np.int32, num_seq, HEADER_BYTES)
        self.pointers = np.frombuffer(buf, np.int64, num_seq, HEADER_BYTES + 4 * num_seq)
        self.doc_idx = np.frombuffer(buf, np.int64, doc_len, HEADER_BYTES + 12 * num_seq)
        if doc_len < 1 or self.doc_idx[0] != 0 or self.doc_idx[-1] != num_seq or np.any(np.diff(self.doc_idx) < 0):
            raise ValueError(f"{idx_path} has a bad document index (must rise from 0 to the sequence count "
                             f"{num_seq}); the file is corrupt, {_REBUILD_HINT}")
        if num_seq and self.sizes.min() < 0:
            raise ValueError(f"{idx_path} has negative sequence lengths; the file is corrupt, {_REBUILD_HINT}")

        # Sequences must tile the .bin back to back: this is what every Megatron writer produces, it
        # catches a .bin/.idx pair from different runs, and it lets samples be read as one slice.
        item = self.dtype.itemsize
        offsets = np.zeros(num_seq + 1, dtype=np.int64)
        np.cumsum(self.sizes, dtype=np.int64, out=offsets[1:])
        self.num_tokens = int(offsets[-1])
        if not np.array_equal(self.pointers, offsets[:-1] * item):
            bad = int(np.flatnonzero(self.pointers != offsets[:-1] * item)[0])
            raise ValueError(f"{idx_path}: sequence {bad} points at byte {int(self.pointers[bad])}, expected "
                             f"{int(offsets[bad]) * item} (sequences must be stored back to back); "
                             f"the index is corrupt, {_REBUILD_HINT}")
        bin_size = os.path.getsize(bin_path)
        if bin_size != self.num_tokens * item:
            what = "truncated" if bin_size < self.num_tokens * item else "longer than its index"
            raise ValueError(f"{bin_path} is {bin_size} bytes but {idx_path} describes {self.num_tokens} "
                             f"{self.dtype} tokens = {self.num_tokens * item} bytes ({what}; .bin and .idx "
                             f"must come from the same run); {_REBUILD_HINT}")
        self._token_offsets = offsets
        # np.memmap cannot map an empty file.
        self.tokens = (np.memmap(bin_path, mode="r", dtype=self.dtype) if bin_size
                       else np.zeros(0, dtype=self.dtype))

    def __getstate__(self) -> dict:
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict) -> None:
        self.prefix = state["prefix"]
        self._open()

    def __len__(self) -> int:
        return int(self.sizes.size)

    def __getitem__(self, i: int) -> np.ndarray:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sequence {i} out of range for {len(self)} sequences in {self.prefix}.idx")
        i %= len(self)
        start = self._token_offsets[i]
        return self.tokens[start:start + self.sizes[i]]

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Part of sequence i: `length` tokens from `offset` (Megatron's `IndexedDataset.get`)."""
        seq = self[i]
        return seq[offset:] if length is None else seq[offset:offset + length]

    @property
    def num_documents(self) -> int:
        return int(self.doc_idx.size - 1)

    def document_token_ranges(self) -> tuple[np.ndarray, np.ndarray]:
        """(start token offset, length in tokens) of every document, both int64 arrays."""
        starts = self._token_offsets[self.doc_idx[:-1]]
        ends = self._token_offsets[self.doc_idx[1:]]
        return starts, ends - starts

    def max_token_id(self, start: int = 0, end: int | None = None, chunk: int = 1 << 24) -> int:
        """Largest token id in tokens[start:end], read in chunks (one pass over that range)."""
        end = self.num_tokens if end is None else end
        best = -1
        for lo in range(start, end, chunk):
            best = max(best, int(self.tokens[lo:min(end, lo + chunk)].max()))
        return best
