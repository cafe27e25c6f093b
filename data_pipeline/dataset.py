"""Packed GPT training samples from a Megatron `.bin/.idx` pair (GPTDataset) or straight from JSONL (WebtextDataset).

Owns the train/valid/test split by contiguous document ranges, packing documents into `seq_len + 1`
token windows across document boundaries, the seeded per-epoch document and sample shuffles, and the
`.npy` index cache (built once, by rank 0 under torch.distributed). It does not own the file format
(`indexed.py`), tokenization (`tokenize_stage.py`) or which rank reads which sample (`sampler.py`).
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Callable

import numpy as np
import torch

from data_pipeline.files import temp_sibling
from data_pipeline.indexed import IndexedDataset

INDEX_CACHE_VERSION = 1
SPLIT_NAMES = {"train": 0, "valid": 1, "validation": 1, "val": 1, "test": 2}
_REBUILD = "python -m data_pipeline tokenize IN.jsonl --tokenizer DIR --output-prefix {prefix}"


def parse_splits(splits: str | list | tuple) -> list[float]:
    """'969,30,1' (or [969, 30, 1], '0.9,0.1') -> three weights summing to 1 (missing ones are 0)."""
    parts = splits.replace("/", ",").split(",") if isinstance(splits, str) else list(splits)
    try:
        weights = [float(p) for p in parts]
    except (TypeError, ValueError):
        raise ValueError(f"splits={splits!r} is not a list of numbers; use e.g. '969,30,1' "
                         "(train,valid,test weights)") from None
    if not 1 <= len(weights) <= 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"splits={splits!r} needs 1-3 non-negative weights with a positive sum, e.g. '969,30,1'")
    weights += [0.0] * (3 - len(weights))
    return [w / sum(weights) for w in weights]


def split_document_ranges(splits: str | list | tuple, num_documents: int) -> list[tuple[int, int]]:
    """[start, end) document ranges of train/valid/test; the same rounding as Megatron-LM's get_split_index."""
    bounds = [0]
    for w in parse_splits(splits):
        bounds.append(bounds[-1] + int(round(w * num_documents)))
    excess = bounds[-1] - num_documents
    # Megatron takes the rounding excess off every bound; clamped at 0, so a split rounded up after an empty one
    # ("0,1,1" of 3 documents: 0, -1, 1, 3) cannot give a negative bound, which a slice would read from the end.
    bounds = [bounds[0]] + [max(0, b - excess) for b in bounds[1:]]
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


def build_sample_index(doc_lengths: np.ndarray, seq_len: int, num_epochs: int,
                       rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Pack shuffled documents into windows of `seq_len + 1` tokens (consecutive windows share one token).

    Args:
        doc_lengths: tokens per document of the split (int64, includes each document's EOD).
        num_epochs: passes over the split; each pass uses a fresh document permutation.

    Returns:
        doc_idx (E*D,) int64: document order (split-relative ids), epochs back to back.
        sample_idx (N+1, 2) int64: sample i starts at (doc_idx position, token offset) sample_idx[i] and
        ends, inclusive, at sample_idx[i + 1]; N = (E * tokens - 1) // seq_len.
    """
    num_docs = doc_lengths.size
    doc_idx = np.concatenate([rng.permutation(num_docs) for _ in range(num_epochs)]).astype(np.int64)
    ends = np.cumsum(doc_lengths[doc_idx], dtype=np.int64)  # token position where each doc in the stream ends
    num_samples = (int(ends[-1]) - 1) // seq_len
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_len
    pos = np.searchsorted(ends, starts, side="right")  # first doc whose end lies beyond the position
    offsets = starts - (ends[pos] - doc_lengths[doc_idx[pos]])
    return doc_idx, np.stack([pos, offsets], axis=1)


def build_shuffle_index(num_samples: int, num_full_epoch_samples: int, rng: np.random.Generator) -> np.ndarray:
    """Permutation of sample ids; the samples of the last, partial epoch are shuffled separately and come
    last (Megatron's separate_last_epoch), so the full epochs are seen whole before any of the extra."""
    first = rng.permutation(num_full_epoch_samples)
    rest = num_full_epoch_samples + rng.permutation(num_samples - num_full_epoch_samples)
    return np.concatenate([first, rest]).astype(np.int64)


def _dist_rank_world(group=None) -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
    return 0, 1


def _built_by_rank_zero(group, built: Callable[[], bool], build: Callable[[], None]) -> int:
    """Rank 0 runs `build()` unless `built()`; every rank waits for it. Returns this rank.

    Rank 0's error is raised after the barrier, so the other ranks do not hang on it (they go on to find the file
    missing and say so)."""
    rank, world = _dist_rank_world(group)
    error: Exception | None = None
    if rank == 0 and not built():
        try:
            build()
        except Exception as e:
            error = e
    if world > 1:
        torch.distributed.barrier(group)
    if error is not None:
        raise error
    return rank


class GPTDataset(torch.utils.data.Dataset):
    """Packed, shuffled next-token samples from `prefix.bin/.idx` (ours or Megatron-LM's preprocess_data.py).

    Documents of the chosen split (a contiguous document range, `splits` weights as in Megatron) are
    shuffled per epoch, laid end to end (each ends with EOD) and cut into windows of `seq_len + 1`
    tokens; consecutive windows share one token so no target is lost. Window order is shuffled too.
    With `num_samples` larger than one epoch gives, more epochs are added (the partial last epoch is
    shuffled separately and comes last). Indices are built once and cached as .npy files keyed by a
    hash of everything that affects them; under torch.distributed rank 0 builds, the others wait
    at a barrier and memory-map the result (the cache directory must be shared).

    Args:
        prefix: path prefix of `prefix.bin` / `prefix.idx`.
        seq_len: tokens per sample (model context).
        split: "train" | "valid" | "test".
        splits: train,valid,test document weights, e.g. "969,30,1".
        seed: seeds the document and sample shuffles.
        num_samples: samples wanted (default: one epoch, `(split tokens - 1) // seq_len`).
        loss_mask: add `loss_mask` (float32, 0 where the input is EOD, i.e. on the first token of the
            next document, which is unpredictable) and set those `labels` to -100 so any
            `CrossEntropyLoss(ignore_index=-100)` honours it.
        vocab_size: the model's vocabulary; checked against the tokenizer recorded in
            `prefix.stats.json` and against the largest token id in the split.
        eod_id: EOD token id (default: from `prefix.stats.json`; needed only with `loss_mask`).
        cache_dir: where index .npy files go (default: `index-cache/` beside the data).
        group: process group whose rank 0 builds the cache (default: the world).

    Items: `dict(input_ids, labels)`, int64 tensors of shape (seq_len,), `labels[t] = input_ids[t + 1]`.

    Example:
        >>> ds = GPTDataset("data/webtext", seq_len=1024, split="train", vocab_size=50257)   # doctest: +SKIP
        >>> ds[0]["input_ids"].shape                                                         # doctest: +SKIP
        torch.Size([1024])
    """

    def __init__(self, prefix: str, seq_len: int, split: str = "train", splits: str = "969,30,1",
                 seed: int = 1234, num_samples: int | None = None, loss_mask: bool = False,
                 vocab_size: int | None = None, eod_id: int | None = None, cache_dir: str | None = None,
                 group=None) -> None:
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
        if split not in SPLIT_NAMES:
            raise ValueError(f"split={split!r} is not one of {sorted(SPLIT_NAMES)}")
        if num_samples is not None and num_samples < 1:
            raise ValueError(f"num_samples must be a positive int or None, got {num_samples!r}")
        self.prefix, self.seq_len, self.split, self.seed = prefix, seq_len, split, seed
        self.indexed = IndexedDataset(prefix)
        self.meta_file = _read_tokenize_stats(prefix)
        self._check_vocab_against_file(vocab_size)
        self.use_loss_mask = loss_mask
        self.eod_id = eod_id if eod_id is not None else self.meta_file.get("eod_id")
        if loss_mask and self.eod_id is None:
            raise ValueError(f"loss_mask=True needs the EOD token id and {prefix}.stats.json does not record it "
                             "(not written by our tokenize stage); pass eod_id=<id of <|endoftext|>>")

        doc_start, doc_end = split_document_ranges(splits, self.indexed.num_documents)[SPLIT_NAMES[split]]
        starts, lengths = self.indexed.document_token_ranges()
        self.doc_range = (doc_start, doc_end)
        self._doc_starts = starts[doc_start:doc_end]
        self._doc_lengths = lengths[doc_start:doc_end]
        self.tokens_per_epoch = int(self._doc_lengths.sum())
        if self.tokens_per_epoch < seq_len + 1:
            raise ValueError(
                f"split {split!r} of {prefix}.bin has {self.tokens_per_epoch} tokens (documents "
                f"{doc_start}..{doc_end} of {self.indexed.num_documents} with splits={splits!r}), fewer than "
                f"seq_len + 1 = {seq_len + 1}: use a smaller seq_len, change splits, or tokenize more text "
                f"(`{_REBUILD.format(prefix=prefix)}`)")
        samples_per_epoch = (self.tokens_per_epoch - 1) // seq_len
        self.num_epochs = 1 if num_samples is None else max(1, -(-(num_samples * seq_len + 1) // self.tokens_per_epoch))
        self.num_samples = samples_per_epoch if num_samples is None else num_samples

        key = {"version": INDEX_CACHE_VERSION, "seq_len": seq_len, "seed": seed, "num_samples": self.num_samples,
               "num_epochs": self.num_epochs, "doc_range": [doc_start, doc_end],
               "num_documents": self.indexed.num_documents, "num_tokens": self.indexed.num_tokens,
               "doc_lengths_sha": hashlib.sha256(self._doc_lengths.tobytes()).hexdigest()}
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        cache_dir = cache_dir or os.path.join(os.path.dirname(os.path.abspath(prefix)), "index-cache")
        stem = os.path.join(cache_dir, f"{os.path.basename(prefix)}.{split}.{seq_len}.{digest}")
        self.index_files = {name: f"{stem}.{name}.npy" for name in ("doc_idx", "sample_idx", "shuffle_idx")}
        self.index_files["meta"] = f"{stem}.meta.json"

        rank = _built_by_rank_zero(group, lambda: os.path.exists(self.index_files["meta"]),
                                   lambda: self._build_index(key))
        if not os.path.exists(self.index_files["meta"]):
            raise RuntimeError(f"rank {rank}: index cache {self.index_files['meta']} is missing after rank 0 "
                               "built it; see rank 0's error, and make sure the cache_dir is on a filesystem "
                               "all ranks share")
        self._load_index()
        if vocab_size is not None and self.max_token_id >= vocab_size:
            raise ValueError(f"{prefix}.bin holds token id {self.max_token_id} in split {split!r}, but vocab_size is "
                             f"{vocab_size}: the data was tokenized with a larger vocabulary; set the model's "
                             f"vocab_size >= {self.max_token_id + 1} or re-tokenize (`{_REBUILD.format(prefix=prefix)}`)")

    def _check_vocab_against_file(self, vocab_size: int | None) -> None:
        """dtype / tokenizer-vocabulary checks that need no pass over the tokens."""
        file_vocab, dtype = self.meta_file.get("vocab_size"), self.indexed.dtype
        if file_vocab is not None and (dtype.name != self.meta_file.get("dtype", dtype.name)
                                       or np.iinfo(dtype).max < file_vocab - 1):
            raise ValueError(f"{self.prefix}.idx stores {dtype} tokens but {self.prefix}.stats.json records a "
                             f"{self.meta_file.get('dtype')} file of a {file_vocab}-id tokenizer: the files are from "
                             f"different runs; re-tokenize (`{_REBUILD.format(prefix=self.prefix)}`)")
        if vocab_size is not None and file_vocab is not None and file_vocab > vocab_size:
            raise ValueError(f"{self.prefix}.bin was tokenized with {self.meta_file.get('tokenizer')} "
                             f"({file_vocab} ids, see {self.prefix}.stats.json) but vocab_size is {vocab_size}; "
                             f"set vocab_size >= {file_vocab} or re-tokenize with the model's tokenizer "
                             f"(`{_REBUILD.format(prefix=self.prefix)}`)")

    def _build_index(self, key: dict) -> None:
        started = time.time()
        rng = np.random.default_rng(self.seed)
        doc_idx, sample_idx = build_sample_index(self._doc_lengths, self.seq_len, self.num_epochs, rng)
        full = self.num_epochs - 1
        full_epoch_samples = (full * self.tokens_per_epoch - 1) // self.seq_len if full else sample_idx.shape[0] - 1
        shuffle_idx = build_shuffle_index(sample_idx.shape[0] - 1, full_epoch_samples, rng)[:self.num_samples]
        lo, hi = int(self._doc_starts[0]), int(self._doc_starts[-1] + self._doc_lengths[-1])
        meta = {**key, "max_token_id": self.indexed.max_token_id(lo, hi), "prefix": os.path.abspath(self.prefix),
                "split": self.split, "seconds": round(time.time() - started, 3)}
        os.makedirs(os.path.dirname(self.index_files["meta"]), exist_ok=True)
        for name, array in (("doc_idx", doc_idx), ("sample_idx", sample_idx), ("shuffle_idx", shuffle_idx)):
            _save_npy_atomic(self.index_files[name], array)
        tmp = temp_sibling(self.index_files["meta"])
        with open(tmp, "w") as f:
            json.dump(meta, f, indent=2)
        os.replace(tmp, self.index_files["meta"])  # written last: its presence means the cache is complete

    def _load_index(self) -> None:
        with open(self.index_files["meta"]) as f:
            meta = json.load(f)
        self.max_token_id = int(meta["max_token_id"])
        self.doc_idx, self.sample_idx, self.shuffle_idx = (self._load_array(name)
                                                           for name in ("doc_idx", "sample_idx", "shuffle_idx"))
        if self.shuffle_idx.shape[0] != self.num_samples:
            raise ValueError(f"index cache {self.index_files['shuffle_idx']} has {self.shuffle_idx.shape[0]} samples, "
                             f"expected {self.num_samples}; it is corrupt: delete {os.path.dirname(self.index_files['meta'])}")

    def _load_array(self, name: str) -> np.ndarray:
        """One cached index, memory-mapped; a damaged file (written atomically, so changed since) named in one line."""
        path = self.index_files[name]
        try:
            return np.load(path, mmap_mode="r")
        except (OSError, ValueError) as e:
            raise ValueError(f"index cache {path} cannot be read ({e}); it is corrupt: delete "
                             f"{os.path.dirname(self.index_files['meta'])} and it is built again") from None

    def __getstate__(self) -> dict:
        # DataLoader workers re-open the memory maps instead of pickling their contents.
        state = dict(self.__dict__)
        for name in ("doc_idx", "sample_idx", "shuffle_idx"):
            state.pop(name)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._load_index()

    def __len__(self) -> int:
        return self.num_samples

    def sample_tokens(self, i: int) -> np.ndarray:
        """The `seq_len + 1` tokens of sample i (after shuffling), as an int64 numpy array."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.num_samples} samples ({self.prefix}, {self.split})")
        j = int(self.shuffle_idx[i])
        (pos, offset), (last_pos, last_offset) = self.sample_idx[j], self.sample_idx[j + 1]
        tokens = self.indexed.tokens
        pieces = []
        for p in range(int(pos), int(last_pos) + 1):
            doc = int(self.doc_idx[p])
            start = int(self._doc_starts[doc])
            lo = start + (int(offset) if p == pos else 0)
            hi = start + (int(last_offset) + 1 if p == last_pos else int(self._doc_lengths[doc]))
            pieces.append(tokens[lo:hi])
        out = np.concatenate(pieces).astype(np.int64) if len(pieces) > 1 else pieces[0].astype(np.int64)
        assert out.size == self.seq_len + 1, (i, out.size, self.seq_len)
        return out

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        tokens = torch.from_numpy(self.sample_tokens(int(i)))
        item = {"input_ids": tokens[:-1], "labels": tokens[1:].clone()}
        if self.use_loss_mask:
            after_eod = item["input_ids"] == self.eod_id
            item["loss_mask"] = (~after_eod).to(torch.float32)
            item["labels"][after_eod] = -100
        return item


class WebtextDataset(GPTDataset):
    """The tutorial's `WebtextDataset(path, seq_len)`, as packed samples from a JSONL file.

    On first use the JSONL is tokenized (the `tokenize` stage, in parallel) into a cached `.bin/.idx`
    beside it, keyed by a hash of the tokenizer files, the JSON key and the file's size and mtime; later
    runs reuse it. Under torch.distributed rank 0 tokenizes and the others wait. Unlike the tutorial,
    documents are not padded to `seq_len`: they are packed (no training on padding), and items are
    `dict(input_ids, labels)` with labels shifted by one.

    Tokenizer: `tokenizer=DIR` if given, else a `tokenizer/` directory beside the JSONL. There is no
    silent fallback (the tutorial downloaded GPT-2's; nothing is downloaded here, and training one
    implicitly would hide a choice that fixes the model's vocabulary); the error says how to make one.

    Example:
        >>> ds = WebtextDataset("data/webtext/train.jsonl", seq_len=1024, tokenizer="runs/tokenizer")  # doctest: +SKIP
    """

    def __init__(self, path: str, seq_len: int = 1024, tokenizer: str | None = None, json_key: str = "text",
                 workers: int | None = None, cache_dir: str | None = None, group=None, **kwargs) -> None:
        from data_pipeline.cli_args import check_input
        from data_pipeline.indexed import exists

        check_input(path, "WebtextDataset path")
        tokenizer = tokenizer or _default_tokenizer_dir(path)
        data_dir = os.path.dirname(os.path.abspath(path))
        cache_dir = cache_dir or os.path.join(data_dir, "index-cache")
        st = os.stat(path)
        fingerprint = hashlib.sha256(json.dumps(
            [_tokenizer_fingerprint(tokenizer), json_key, st.st_size, st.st_mtime_ns]).encode()).hexdigest()[:12]
        stem = os.path.splitext(os.path.basename(path))[0]
        prefix = os.path.join(cache_dir, f"{stem}.tokens-{fingerprint}")

        from data_pipeline.tokenize_stage import tokenize_file
        _built_by_rank_zero(group, lambda: exists(prefix), lambda: tokenize_file(
            path, tokenizer, prefix, workers=workers or os.cpu_count() or 1, text_key=json_key))
        self.path, self.tokenizer_dir = path, tokenizer
        super().__init__(prefix, seq_len, cache_dir=cache_dir, group=group, **kwargs)


def _default_tokenizer_dir(path: str) -> str:
    candidate = os.path.join(os.path.dirname(os.path.abspath(path)), "tokenizer")
    if os.path.isdir(candidate):
        return candidate
    raise ValueError(f"WebtextDataset({path!r}) needs a tokenizer: pass tokenizer=DIR, or create {candidate} with "
                     f"`python -m data_pipeline train-tokenizer {path} --output {candidate} --vocab-size 50257`")


def _tokenizer_fingerprint(tokenizer: str) -> str:
    """sha256 over the tokenizer's files, so a changed tokenizer never reuses an old token cache."""
    h = hashlib.sha256()
    files = [tokenizer] if os.path.isfile(tokenizer) else [
        os.path.join(tokenizer, n) for n in sorted(os.listdir(tokenizer)) if n.endswith((".json", ".txt", ".model"))
    ] if os.path.isdir(tokenizer) else []
    if not files:
        raise ValueError(f"tokenizer {tokenizer} does not exist or holds no tokenizer files; train one with "
                         "`python -m data_pipeline train-tokenizer IN.jsonl --output DIR --vocab-size 50257`")
    for name in files:
        with open(name, "rb") as f:
            h.update(os.path.basename(name).encode() + b"\0" + f.read())
    return h.hexdigest()


def _read_tokenize_stats(prefix: str) -> dict:
    """`prefix.stats.json` written by our tokenize stage ({} for Megatron-made data or if unreadable)."""
    try:
        with open(prefix + ".stats.json") as f:
            stats = json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}
    return stats if isinstance(stats, dict) and stats.get("stage") == "tokenize" else {}


def _save_npy_atomic(path: str, array: np.ndarray) -> None:
    tmp = temp_sibling(path) + ".npy"
    np.save(tmp, array, allow_pickle=False)
    os.replace(tmp, path)
