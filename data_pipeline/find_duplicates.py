"""Stage `find-duplicates`: near-duplicate pairs by MinHash LSH, each verified by exact Jaccard.

Text is normalised (NFKC, casefold, runs of non-word characters -> one space) and cut into
n-grams of characters or words, all of them (Megatron's tool dropped the last shingle). Each
n-gram is hashed to 32 bits; worker processes compute the sorted shingle-hash set and a datasketch
MinHash (affine32 scheme) per document. The main process queries a datasketch MinHashLSH (bands
and rows from the threshold) before inserting each document, so each candidate pair appears once,
(earlier, later), and verifies it by exact Jaccard of the two shingle-hash sets, read back from a
file on disk: no text is kept in memory. Documents with identical shingle sets are paired with
the first one directly (Jaccard 1.0) and not indexed again, which keeps big exact-duplicate
clusters linear. Fingerprints (signatures + shingle sets) can be saved and loaded to deduplicate
a new corpus against earlier ones.

    python -m data_pipeline find-duplicates clean.jsonl --output pairs.jsonl --threshold 0.7
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import struct
import tempfile
import time
import unicodedata
import zlib
from array import array
from collections import Counter

import numpy as np

from data_pipeline.cli_args import add_common_args, check_input
from data_pipeline.files import atomic_write
from data_pipeline.jsonl import BadLineReporter, dumps, iter_line_batches, parse_jsonl_line
from data_pipeline.stats import write_stats
from data_pipeline.workers import imap_bounded, progress

FINGERPRINT_MAGIC = b"ZGPTFPR1"
FINGERPRINT_VERSION = 1
NORMALIZATION = "nfkc-casefold-nonword-v1"  # bump when normalise() or shingle hashing changes
SCHEME = "affine32"  # datasketch's bijective 32-bit permutations (2.0+)
# Candidates are verified exactly, so a false positive only costs one intersection while a false
# negative loses a duplicate: weight false negatives 9:1 when choosing bands x rows. At t=0.7 and
# 128 permutations this gives 20 bands x 6 rows, P(candidate | J=0.7) = 0.92, P(J=0.5) = 0.27.
LSH_WEIGHTS = (0.1, 0.9)
BATCH_LINES = 128
MAX_SHINGLES_PER_UPDATE = 1 << 14  # bounds the (shingles x num_perm) matrix of one MinHash update
_NONWORD_RE = re.compile(r"[\W_]+", re.UNICODE)
_P = np.uint64(0x100000001B3)  # FNV-64 prime: odd multiplier for the polynomial n-gram hash
_M1, _M2 = np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53)  # MurmurHash3 fmix64


def normalise(text: str) -> str:
    """NFKC + casefold, and every run of punctuation/whitespace becomes one space."""
    return _NONWORD_RE.sub(" ", unicodedata.normalize("NFKC", text).casefold()).strip()


def _fmix64(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint64(33))
    h = h * _M1
    h = h ^ (h >> np.uint64(33))
    h = h * _M2
    return h ^ (h >> np.uint64(33))


def shingle_hashes(text: str, ngram: int = 5, unit: str = "char") -> np.ndarray:
    """Sorted unique uint32 hashes of all n-grams of normalise(text); a text shorter than n
    units is one shingle; an empty one has none.

    Example:
        >>> len(shingle_hashes("abcdef", 5))  # "abcde", "bcdef": the last one is not dropped
        2
    """
    norm = normalise(text)
    if unit == "char":
        codes = np.frombuffer(norm.encode("utf-32-le"), dtype=np.uint32).astype(np.uint64)
    else:
        # crc32 | length << 32: a deterministic id per word (Python's hash() is salted per process)
        codes = np.fromiter(((zlib.crc32(w.encode()) | (len(w) << 32)) for w in norm.split()), np.uint64)
    if codes.size == 0:
        return np.zeros(0, np.uint32)
    n = min(ngram, codes.size)
    m = codes.size - n + 1
    h = np.zeros(m, np.uint64)
    for k in range(n):  # polynomial hash of each window; uint64 arrays wrap mod 2^64 silently
        h = h * _P + codes[k:k + m]
    h = _fmix64(h + np.uint64(n))
    return np.unique((h >> np.uint64(32)).astype(np.uint32))


_TEMPLATES: dict = {}


def _template(num_perm: int, seed: int):
    """An empty MinHash per (num_perm, seed): generating permutations costs more than hashing a
    short document, so every signature reuses these."""
    from datasketch import MinHash

    if (num_perm, seed) not in _TEMPLATES:
        _TEMPLATES[(num_perm, seed)] = MinHash(num_perm=num_perm, seed=seed, scheme=SCHEME)
    return _TEMPLATES[(num_perm, seed)]


def signature(shingles: np.ndarray, num_perm: int, seed: int) -> np.ndarray:
    """datasketch MinHash hash values (uint32[num_perm]) of a shingle-hash set."""
    from datasketch import MinHash

    template = _template(num_perm, seed)
    m = MinHash(seed=seed, hashfunc=int, scheme=SCHEME, permutations=template.permutations,
                hashvalues=template.hashvalues.copy())
    for start in range(0, len(shingles), MAX_SHINGLES_PER_UPDATE):
        m.update_batch(shingles[start:start + MAX_SHINGLES_PER_UPDATE].tolist())
    return m.hashvalues


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Exact Jaccard of two sorted unique arrays."""
    inter = np.intersect1d(a, b, assume_unique=True).size
    union = a.size + b.size - inter
    return inter / union if union else 1.0


def text_hash(text: str) -> str:
    """Short content hash stored with each document reference; remove-duplicates checks it."""
    return hashlib.blake2b(text.encode("utf-8"), digest_size=8).hexdigest()


def _fingerprint_batch(task) -> list[tuple]:
    """Worker: raw lines -> [(lineno, kind, detail, url, text_hash, shingles, signature)]."""
    lines, text_key, ngram, unit, num_perm, seed = task
    out = []
    for lineno, raw in lines:
        rec, err = parse_jsonl_line(raw, text_key)
        if rec is None:
            out.append((lineno, "blank" if not err else "malformed", err, None, None, None, None))
            continue
        sh = shingle_hashes(rec[text_key], ngram, unit)
        if sh.size == 0:
            out.append((lineno, "empty", "", None, None, None, None))
            continue
        url = rec.get("url") if isinstance(rec.get("url"), str) else None
        out.append((lineno, "doc", "", url, text_hash(rec[text_key]), sh, signature(sh, num_perm, seed)))
    return out


class ShingleStore:
    """Shingle-hash sets of all indexed documents, on disk; `get(doc)` reads one back."""

    def __init__(self) -> None:
        self.files: list = []       # open binary files, one per segment
        self.seg = array("H")       # per doc: segment index
        self.off = array("q")       # per doc: byte offset in the segment
        self.num = array("i")       # per doc: number of uint32 hashes

    def add_segment(self, f) -> int:
        self.files.append(f)
        return len(self.files) - 1

    def add(self, seg: int, offset: int, count: int) -> None:
        self.seg.append(seg), self.off.append(offset), self.num.append(count)

    def get(self, doc: int) -> np.ndarray:
        f = self.files[self.seg[doc]]
        data = os.pread(f.fileno(), 4 * self.num[doc], self.off[doc])
        return np.frombuffer(data, dtype=np.uint32)


def read_fingerprint_meta(path: str) -> dict:
    """The JSON metadata of a fingerprint file (see `_write_fingerprint_tail`)."""
    check_input(path, "fingerprint file")
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        if size < 24:
            raise ValueError(f"{path}: not a fingerprint file (too small); rebuild it with "
                             f"`find-duplicates IN --save-fingerprints {path}`")
        f.seek(size - 24)
        meta_off, meta_len, magic = struct.unpack("<QQ8s", f.read(24))
        if magic != FINGERPRINT_MAGIC:
            raise ValueError(f"{path}: bad magic {magic!r}, expected {FINGERPRINT_MAGIC!r}; rebuild it with "
                             f"`find-duplicates IN --save-fingerprints {path}`")
        f.seek(meta_off)
        meta = json.loads(f.read(meta_len))
    if meta.get("version") != FINGERPRINT_VERSION:
        raise ValueError(f"{path}: fingerprint version {meta.get('version')}, expected {FINGERPRINT_VERSION}")
    return meta


class Deduper:
    """Query-then-insert over a MinHashLSH; collects verified pairs in document order."""

    def __init__(self, args: argparse.Namespace, pairs_out, counts: Counter) -> None:
        from datasketch import MinHashLSH

        self.args, self.out, self.counts = args, pairs_out, counts
        self.lsh = MinHashLSH(threshold=args.threshold, num_perm=args.num_perm, weights=LSH_WEIGHTS)
        self.store = ShingleStore()
        self.refs: list[tuple] = []          # per doc: (src, source name, line, url, text hash)
        self.first_with_set: dict[bytes, int] = {}

    def add(self, ref: tuple, shingles: np.ndarray, sig: np.ndarray, seg: int, offset: int) -> None:
        from datasketch import LeanMinHash

        doc = len(self.refs)
        self.refs.append(ref)
        self.store.add(seg, offset, shingles.size)
        self.counts["docs"] += 1
        set_key = hashlib.blake2b(shingles.tobytes(), digest_size=16).digest()
        first = self.first_with_set.setdefault(set_key, doc)
        if first != doc:  # identical shingle set: pair with the first, do not index again
            self.counts["exact_duplicates"] += 1
            self._emit(first, doc, 1.0)
            return
        m = LeanMinHash(seed=self.args.seed, hashvalues=sig, scheme=SCHEME)
        for cand in sorted(self.lsh.query(m)):
            self.counts["candidates"] += 1
            j = jaccard(self.store.get(cand), shingles)
            if j >= self.args.threshold:
                self._emit(cand, doc, j)
            else:
                self.counts["rejected_candidates"] += 1
        self.lsh.insert(doc, m, check_duplication=False)

    def _emit(self, a: int, b: int, j: float) -> None:
        self.counts["pairs"] += 1
        self.out.write(dumps({"a": self._ref(a), "b": self._ref(b), "jaccard": float(j)}))

    def _ref(self, doc: int) -> dict:
        src, source, line, url, thash = self.refs[doc]
        return {"src": src, "source": source, "line": line, "url": url, "hash": thash}


def _write_fingerprint_tail(f, store: ShingleStore, seg: int, docs: range, deduper: Deduper,
                            sig_path: str, meta: dict) -> None:
    """Append signatures, offsets, metadata and the trailer to the shingle segment file `f`.

    Layout: [uint32 shingle hashes][uint32 signatures, docs x num_perm][int64 byte offsets,
    docs + 1][JSON metadata][uint64 meta offset, uint64 meta length, magic]. Arrays are
    memory-mapped back by `--load-fingerprints`.
    """
    end = f.seek(0, os.SEEK_END)
    meta["signatures_offset"] = end
    with open(sig_path, "rb") as sig_f:
        shutil.copyfileobj(sig_f, f)
    meta["offsets_offset"] = f.tell()
    offsets = np.array([store.off[d] for d in docs] + [meta["signatures_offset"]], dtype=np.int64)
    f.write(offsets.tobytes())
    refs = [deduper.refs[d] for d in docs]
    meta.update(num_docs=len(refs), lines=[r[2] for r in refs], urls=[r[3] for r in refs],
                hashes=[r[4] for r in refs])
    blob = json.dumps(meta, ensure_ascii=False).encode("utf-8")
    meta_off = f.tell()
    f.write(blob)
    f.write(struct.pack("<QQ8s", meta_off, len(blob), FINGERPRINT_MAGIC))


def _load_fingerprints(path: str, src: int, deduper: Deduper, params: dict, bar) -> str:
    """Index the documents of a saved fingerprint file as source `src`; returns its source name."""
    meta = read_fingerprint_meta(path)
    for key, value in params.items():
        if meta.get(key) != value:
            raise ValueError(f"{path}: fingerprints were made with {key}={meta.get(key)!r}, this run uses "
                             f"{value!r}; pass the same --{key.replace('_', '-')} or rebuild the fingerprints")
    n, num_perm = meta["num_docs"], meta["num_perm"]
    seg = deduper.store.add_segment(open(path, "rb"))
    sigs = np.memmap(path, dtype=np.uint32, mode="r", offset=meta["signatures_offset"], shape=(n, num_perm)) \
        if n else np.zeros((0, num_perm), np.uint32)
    offsets = np.fromfile(path, dtype=np.int64, count=n + 1, offset=meta["offsets_offset"])
    f = deduper.store.files[seg]
    for i in range(n):
        count = int(offsets[i + 1] - offsets[i]) // 4
        shingles = np.frombuffer(os.pread(f.fileno(), 4 * count, int(offsets[i])), dtype=np.uint32)
        ref = (src, meta["source"], meta["lines"][i], meta["urls"][i], meta["hashes"][i])
        deduper.add(ref, shingles, np.array(sigs[i]), seg, int(offsets[i]))
        bar.update(1)
    return meta["source"]


class _TutorialInputs(argparse.Action):
    """`--inputs FILE url`, Megatron's (file, id key) pair as the Colossal-AI tutorial passes it.

    Documents are identified by file and line here, and each pair records the `url` field for
    reading, so the only key that means what Megatron meant is `url`.
    """

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        path, key = values
        if key != "url":
            parser.error(f"--inputs {path} {key}: the id key must be 'url' (documents are identified by file "
                         f"and line, and pairs record the 'url' field); pass the file alone: find-duplicates {path}")
        setattr(namespace, self.dest, path)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("find-duplicates", help="MinHash LSH candidate pairs verified by Jaccard",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("input", nargs="?", default=argparse.SUPPRESS,
                        help="JSONL with a 'text' field (the cleanup output)")
    source.add_argument("--inputs", nargs=2, metavar=("FILE", "url"), dest="input", action=_TutorialInputs,
                        help="the same as FILE (the tutorial's form; Megatron's id key must be 'url')")
    p.add_argument("-o", "--output", required=True, help="JSONL of verified pairs {a, b, jaccard}, a before b")
    p.add_argument("--threshold", type=float, default=0.7, help="Jaccard similarity of duplicates")
    p.add_argument("--num-perm", type=int, default=128, help="MinHash permutations")
    p.add_argument("--ngram", type=int, default=5, help="shingle length in --unit")
    p.add_argument("--unit", choices=("char", "word"), default="char", help="shingle unit")
    p.add_argument("--seed", type=int, default=1, help="MinHash permutation seed")
    p.add_argument("--text-key", default="text", help="JSON field holding the text")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="signature processes")
    p.add_argument("--save-fingerprints", metavar="F", help="save this input's signatures and shingle sets")
    p.add_argument("--load-fingerprints", metavar="F", nargs="+", default=[],
                   help="earlier corpora to deduplicate against; they come first in document order")
    add_common_args(p)
    return p


def run(args: argparse.Namespace) -> int:
    started = time.time()
    check_input(args.input)
    if not 0.0 < args.threshold <= 1.0:
        raise ValueError(f"--threshold must be in (0, 1], got {args.threshold}")
    if args.num_perm < 2 or args.ngram < 1:
        raise ValueError(f"--num-perm must be >= 2 and --ngram >= 1, got {args.num_perm}, {args.ngram}")
    params = {"num_perm": args.num_perm, "ngram": args.ngram, "unit": args.unit, "seed": args.seed,
              "scheme": SCHEME, "normalization": NORMALIZATION}
    source = os.path.basename(args.input)
    counts: Counter = Counter(docs=0, pairs=0, candidates=0, rejected_candidates=0, exact_duplicates=0,
                              malformed=0, empty_after_normalisation=0)
    out_dir = os.path.dirname(os.path.abspath(args.output))
    os.makedirs(out_dir, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=".find-duplicates-", dir=out_dir)
    seg_path = os.path.join(tmp_dir, "shingles.bin")
    if args.save_fingerprints:
        fd, seg_path = tempfile.mkstemp(prefix="." + os.path.basename(args.save_fingerprints) + ".",
                                        suffix=".tmp", dir=os.path.dirname(os.path.abspath(args.save_fingerprints)))
        os.close(fd)
        os.chmod(seg_path, 0o644)
    sig_path = os.path.join(tmp_dir, "signatures.bin")
    report = BadLineReporter(args.input, args.strict)
    sources = []
    tasks = ((batch, args.text_key, args.ngram, args.unit, args.num_perm, args.seed)
             for batch in iter_line_batches(args.input, BATCH_LINES))
    # Fork when safe: workers inherit datasketch (its import pulls in scipy, 1-2 s per spawned
    # worker) and the permutations; created before the progress bar so no other thread exists yet.
    _template(args.num_perm, args.seed)
    results = imap_bounded(_fingerprint_batch, tasks, args.workers, prefer_fork=True)
    deduper = None
    try:
        with atomic_write(args.output) as pairs_out, progress(desc="find-duplicates", unit="doc") as bar, \
                open(seg_path, "w+b", buffering=0) as seg_f, open(sig_path, "wb") as sig_f:
            deduper = Deduper(args, pairs_out, counts)
            for src, path in enumerate(args.load_fingerprints):
                name = _load_fingerprints(path, src, deduper, params, bar)
                sources.append({"source": name, "fingerprints": os.path.abspath(path)})
            src = len(args.load_fingerprints)
            if source in {s["source"] for s in sources}:
                raise ValueError(f"input name {source!r} is also the source of a loaded fingerprint file; "
                                 f"rename one so remove-duplicates can tell them apart")
            seg = deduper.store.add_segment(seg_f)
            first_doc = len(deduper.refs)
            offset = 0
            for batch in results:
                for lineno, kind, detail, url, thash, shingles, sig in batch:
                    bar.update(1)
                    if kind == "malformed":
                        counts["malformed"] += 1
                        report(lineno, detail)
                    elif kind == "blank":
                        counts["blank_lines"] += 1
                    elif kind == "empty":
                        counts["empty_after_normalisation"] += 1
                    else:
                        seg_f.write(shingles.tobytes())
                        sig_f.write(np.ascontiguousarray(sig, dtype=np.uint32).tobytes())
                        deduper.add((src, source, lineno, url, thash), shingles, sig, seg, offset)
                        offset += 4 * shingles.size
            sources.append({"source": source, "input": os.path.abspath(args.input)})
            if args.save_fingerprints:
                sig_f.flush()
                _write_fingerprint_tail(seg_f, deduper.store, seg, range(first_doc, len(deduper.refs)),
                                        deduper, sig_path, dict(params, version=FINGERPRINT_VERSION,
                                                                 source=source))
                os.fsync(seg_f.fileno())
            bands, rows = deduper.lsh.b, deduper.lsh.r
        if args.save_fingerprints:
            os.replace(seg_path, args.save_fingerprints)
    finally:
        results.close()
        for f in deduper.store.files if deduper else ():
            f.close()  # loaded fingerprint files (the segment file is closed by its with)
        shutil.rmtree(tmp_dir, ignore_errors=True)
        if args.save_fingerprints and os.path.exists(seg_path):
            os.unlink(seg_path)
    write_stats(args.output, "find-duplicates", counts, args, [args.input, *args.load_fingerprints], started,
                lsh={"bands": bands, "rows": rows, "weights": list(LSH_WEIGHTS)}, sources=sources,
                shingles=params)
    return 0

