"""find-duplicates as sharded tasks: signatures per shard, LSH buckets per band, exact verification.

The pairs are those of the single-process stage (find_duplicates.Deduper), computed without a
global index:

1. `signatures` (one task per input shard): shingle sets and MinHash signatures, as today. Per
   band, the task writes its documents' (band key, line, shingle-set key) records sorted by (band
   key, line). Shingle sets go to the shard's store, with an index by line.
2. `buckets` (a band per task, or several): merges the band's sorted files of all shards (a streaming
   k-way merge) and walks each run of equal band keys in line order. Documents with a shingle set
   seen earlier in the run pair with its first document (Jaccard 1.0) and take no further part,
   as in Deduper; the others are candidate pairs. Candidates are partitioned by pair.
3. `verify` (one task per partition): the unique candidate pairs, verified by exact Jaccard of
   the shingle sets read back from the shard stores; written sorted by (later, earlier) line: the
   order of Deduper's output.
4. `merge` (one task): a k-way merge of the partitions into the pairs file and its stats.

A task holds one shard, or one run of equal band keys, or one partition of pairs, so its memory
does not grow with the corpus when the number of shards does.
"""
from __future__ import annotations

import argparse
import bisect
import hashlib
import heapq
import json
import os
from collections import Counter
from typing import Iterator

import numpy as np

from data_pipeline import find_duplicates as fd
from data_pipeline.files import abspath, atomic_write
from data_pipeline.workers import batched
from data_pipeline.jsonl import BadLineReporter, dumps
from data_pipeline.shards import first_line, iter_shard, read_json, write_json
from data_pipeline.stats import write_stats

BAND_RECORD = np.dtype([("key", "V16"), ("line", "<i8"), ("set", "V8")])
PAIR_RECORD = np.dtype([("a", "<i8"), ("b", "<i8"), ("exact", "u1")])
INDEX_RECORD = np.dtype([("line", "<i8"), ("off", "<i8"), ("n", "<i8"), ("meta", "<i8")])
MERGE_RECORDS = 1 << 20  # records a merge task buffers, over all its input files (or output partitions)


def bands_rows(threshold: float, num_perm: int) -> tuple[int, int]:
    """Bands and rows of the single-process stage's MinHashLSH (the same weights)."""
    from datasketch.lsh import _optimal_param

    return _optimal_param(threshold, num_perm, *fd.LSH_WEIGHTS)


def signatures_task(rank: int, world: int, input: str, work: str, text_key: str, ngram: int, unit: str,
                    num_perm: int, seed: int, threshold: float, strict: bool) -> None:
    bands, rows = bands_rows(threshold, num_perm)
    first = first_line(work, rank)
    counts: Counter = Counter(docs=0, malformed=0, empty_after_normalisation=0)
    report = BadLineReporter(input, strict)
    fd._template(num_perm, seed)
    store_path = os.path.join(work, "store", f"{rank:05d}")
    records: list[list[tuple]] = [[] for _ in range(bands)]
    index = []
    lines = ((first + i, raw) for i, raw in enumerate(iter_shard(input, rank, world)))
    with atomic_write(store_path + ".shingles", "wb") as sh_f, atomic_write(store_path + ".meta.jsonl") as meta_f:
        offset, meta_off = 0, 0
        for batch in batched(lines, fd.BATCH_LINES):
            for lineno, kind, detail, url, thash, shingles, sig in fd._fingerprint_batch(
                    (batch, text_key, ngram, unit, num_perm, seed)):
                if kind == "malformed":
                    counts["malformed"] += 1
                    report(lineno, detail)
                    continue
                if kind in ("blank", "empty"):
                    counts["blank_lines" if kind == "blank" else "empty_after_normalisation"] += 1
                    continue
                counts["docs"] += 1
                sh_f.write(shingles.tobytes())
                meta = dumps({"url": url, "hash": thash}).encode("utf-8")
                meta_f.write(meta.decode("utf-8"))
                index.append((lineno, offset, shingles.size, meta_off))
                offset += 4 * shingles.size
                meta_off += len(meta)
                set_key = hashlib.blake2b(shingles.tobytes(), digest_size=8).digest()
                sig = np.ascontiguousarray(sig, dtype=np.uint32)
                for b in range(bands):
                    key = hashlib.blake2b(sig[b * rows:(b + 1) * rows].tobytes(), digest_size=16).digest()
                    records[b].append((key, lineno, set_key))
    with atomic_write(store_path + ".index.npy", "wb") as f:
        np.save(f, np.array(index, dtype=INDEX_RECORD))
    for b in range(bands):
        arr = np.array(records[b], dtype=BAND_RECORD)
        arr.sort(order=["key", "line"])
        with atomic_write(os.path.join(work, "bands", f"{b:03d}", f"{rank:05d}.bin"), "wb") as f:
            f.write(arr.tobytes())
    write_json(os.path.join(work, "counts", "signatures", f"{rank:05d}.json"), dict(counts))


def _read_sorted(path: str, dtype: np.dtype, chunk: int) -> Iterator[tuple]:
    """Records of a sorted binary file, read `chunk` at a time."""
    data = np.memmap(path, dtype=dtype, mode="r") if os.path.getsize(path) else np.zeros(0, dtype)
    for start in range(0, data.size, chunk):
        yield from data[start:start + chunk].tolist()


def buckets_task(rank: int, world: int, work: str, shards: int, partitions: int, bands: int) -> None:
    """Bands rank, rank + world, ...: candidate and exact pairs of every run of equal band keys."""
    for band in range(rank, bands, world):
        band_pairs(band, work, shards, partitions)


def band_pairs(band: int, work: str, shards: int, partitions: int) -> None:
    band_dir = os.path.join(work, "bands", f"{band:03d}")
    chunk = max(16, MERGE_RECORDS // shards)
    streams = [_read_sorted(os.path.join(band_dir, f"{s:05d}.bin"), BAND_RECORD, chunk) for s in range(shards)]
    flush_at = max(16, MERGE_RECORDS // partitions)
    parts: list[list[tuple]] = [[] for _ in range(partitions)]
    outs = [atomic_write(os.path.join(work, "cand", f"{p:05d}", f"{band:03d}.bin"), "wb") for p in range(partitions)]
    files = [o.__enter__() for o in outs]

    def emit(a: int, b: int, exact: int) -> None:
        p = (a * 1_000_003 + b) % partitions
        parts[p].append((a, b, exact))
        if len(parts[p]) >= flush_at:
            files[p].write(np.array(parts[p], dtype=PAIR_RECORD).tobytes())
            parts[p].clear()

    try:
        key, reps, first_of_set = None, [], {}
        for k, line, set_key in heapq.merge(*streams):
            if k != key:
                key, reps, first_of_set = k, [], {}
            first = first_of_set.setdefault(set_key, line)
            if first != line:
                emit(first, line, 1)
                continue
            for earlier in reps:
                emit(earlier, line, 0)
            reps.append(line)
        for p in range(partitions):
            files[p].write(np.array(parts[p], dtype=PAIR_RECORD).tobytes())
    except BaseException as e:
        for o in outs:
            o.__exit__(type(e), e, e.__traceback__)
        raise
    for o in outs:
        o.__exit__(None, None, None)


class ShardStore:
    """Shingle sets and references of the documents of every shard, read back by line.

    Indexes are memory-mapped and files opened per read, so a verify task holds neither the
    corpus's index nor a file handle per shard.
    """

    def __init__(self, work: str, shards: int) -> None:
        self.firsts = [first_line(work, s) for s in range(shards)]
        self.base = [os.path.join(work, "store", f"{s:05d}") for s in range(shards)]
        self.index: dict[int, np.ndarray] = {}

    def _find(self, line: int) -> tuple[str, tuple]:
        s = bisect.bisect_right(self.firsts, line) - 1
        if s not in self.index:
            self.index[s] = np.load(self.base[s] + ".index.npy", mmap_mode="r")
        index = self.index[s]
        return self.base[s], index[int(np.searchsorted(index["line"], line))]

    def shingles_of(self, line: int) -> np.ndarray:
        base, (_, off, n, _) = self._find(line)
        with open(base + ".shingles", "rb") as f:
            return np.frombuffer(os.pread(f.fileno(), 4 * int(n), int(off)), dtype=np.uint32)

    def ref(self, line: int, source: str) -> dict:
        base, (_, _, _, meta_off) = self._find(line)
        with open(base + ".meta.jsonl", "rb") as f:
            f.seek(int(meta_off))
            meta = json.loads(f.readline())
        return {"src": 0, "source": source, "line": line, "url": meta["url"], "hash": meta["hash"]}


def verify_task(rank: int, world: int, work: str, shards: int, bands: int, threshold: float, source: str) -> None:
    """Partition `rank`: unique candidate pairs, verified, sorted by (later, earlier) line."""
    part_dir = os.path.join(work, "cand", f"{rank:05d}")
    pairs = np.concatenate([np.fromfile(os.path.join(part_dir, f"{b:03d}.bin"), dtype=PAIR_RECORD)
                            for b in range(bands)])
    pairs = np.unique(pairs)  # the same pair from several bands (exact pairs come with exact=1 only)
    order = np.lexsort((pairs["a"], pairs["b"]))
    counts: Counter = Counter(pairs=0, candidates=0, rejected_candidates=0, exact_duplicates=0)
    store = ShardStore(work, shards)
    with atomic_write(os.path.join(work, "pairs", f"{rank:05d}.jsonl")) as out:
        for a, b, exact in pairs[order].tolist():
            if exact:
                counts["exact_duplicates"] += 1
                j = 1.0
            else:
                counts["candidates"] += 1
                j = fd.jaccard(store.shingles_of(a), store.shingles_of(b))
                if j < threshold:
                    counts["rejected_candidates"] += 1
                    continue
            counts["pairs"] += 1
            out.write(dumps({"a": store.ref(a, source), "b": store.ref(b, source), "jaccard": float(j)}))
    write_json(os.path.join(work, "counts", "verify", f"{rank:05d}.json"), dict(counts))


def _pair_lines(path: str) -> Iterator[tuple[int, int, str]]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            yield rec["b"]["line"], rec["a"]["line"], line


def merge_task(rank: int, world: int, work: str, shards: int, partitions: int, args: argparse.Namespace,
               started: float) -> None:
    counts: Counter = Counter(docs=0, pairs=0, candidates=0, rejected_candidates=0, exact_duplicates=0,
                              malformed=0, empty_after_normalisation=0)
    for kind, n in (("signatures", shards), ("verify", partitions)):
        for r in range(n):
            counts.update(read_json(os.path.join(work, "counts", kind, f"{r:05d}.json")))
    streams = [_pair_lines(os.path.join(work, "pairs", f"{p:05d}.jsonl")) for p in range(partitions)]
    with atomic_write(args.output) as out:
        for _, _, line in heapq.merge(*streams):
            out.write(line)
    bands, rows = bands_rows(args.threshold, args.num_perm)
    params = {"num_perm": args.num_perm, "ngram": args.ngram, "unit": args.unit, "seed": args.seed,
              "scheme": fd.SCHEME, "normalization": fd.NORMALIZATION}
    write_stats(args.output, "find-duplicates", counts, args, [args.input], started,
                lsh={"bands": bands, "rows": rows, "weights": list(fd.LSH_WEIGHTS)},
                sources=[{"source": os.path.basename(args.input), "input": abspath(args.input)}],
                shingles=params, shards=shards, peak_rss_kb_per_task=peak_rss(work))


def peak_rss(work: str) -> dict:
    """Peak RSS (KiB) of each task kind, as the tasks recorded it."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(os.path.join(work, "rss"))
    out = {}
    for kind in sorted(fs.ls(root, detail=False)) if fs.isdir(root) else ():
        name = kind.rstrip("/").rsplit("/", 1)[-1]
        out[name] = max(json.loads(fs.cat_file(f))["kb"] for f in fs.ls(kind, detail=False))
    return out
