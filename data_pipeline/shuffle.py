"""Stage `shuffle`: a seeded shuffle of JSONL documents, in memory or external for big files.

Every valid line i gets a random 64-bit key, the i-th draw of Philox(seed); the output is the
lines sorted by (key, i). In memory this is one argsort. For files larger than --memory-limit,
lines are scattered by the top bits of their key into 2^k bucket files (ranges of the key
space, so bucket b only holds keys below bucket b+1's), then each bucket is sorted alone. Both
paths give byte-identical output for a seed, whatever the memory limit. Lines are copied
verbatim; malformed ones are reported and skipped.

    python -m data_pipeline shuffle dedup.jsonl --output webtext.jsonl --seed 1234 --memory-limit 2G
"""
from __future__ import annotations

import argparse
import math
import os
import shutil
import struct
import tempfile
import time
from collections import Counter

import numpy as np

from data_pipeline.cli_args import add_common_args, add_output_arg, check_input, parse_size
from data_pipeline.files import atomic_write
from data_pipeline.jsonl import BadLineReporter, iter_line_batches, parse_jsonl_line
from data_pipeline.stats import write_stats
from data_pipeline.workers import progress

MAX_BUCKETS = 4096
_HEADER = struct.Struct("<QQI")  # key, line index, byte length: the bucket-file record framing


def _valid_lines(path: str, counts: Counter, strict: bool):
    """Yield raw bytes of each valid JSONL line (newline-terminated); bad lines reported."""
    report = BadLineReporter(path, strict)
    for batch in iter_line_batches(path, 4096):
        for lineno, raw in batch:
            rec, err = parse_jsonl_line(raw, text_key=None)
            if rec is None:
                if err:
                    counts["malformed"] += 1
                    report(lineno, err)
                else:
                    counts["blank_lines"] += 1
                continue
            counts["docs"] += 1
            yield raw if raw.endswith(b"\n") else raw + b"\n"


class KeyStream:
    """The i-th key is the i-th 64-bit output of Philox(seed), drawn in any chunk sizes."""

    def __init__(self, seed: int) -> None:
        self.gen = np.random.Philox(key=seed)
        self.buf = np.zeros(0, np.uint64)
        self.pos = 0

    def next(self) -> int:
        if self.pos == self.buf.size:
            self.buf, self.pos = self.gen.random_raw(65536), 0
        self.pos += 1
        return int(self.buf[self.pos - 1])


def shuffle_in_memory(path: str, out, seed: int, counts: Counter, strict: bool) -> None:
    lines = list(progress(_valid_lines(path, counts, strict), desc="shuffle (read)"))
    keys = np.random.Philox(key=seed).random_raw(len(lines)) if lines else np.zeros(0, np.uint64)
    for i in np.argsort(keys, kind="stable"):  # stable: equal keys keep input order
        out.write(lines[i])


def shuffle_external(path: str, out, seed: int, memory_limit: int, counts: Counter, strict: bool,
                     tmp_parent: str) -> int:
    """Scatter to range buckets by key, then sort each bucket in memory. Returns the bucket count."""
    size = os.path.getsize(path)
    bits = min(int(math.log2(MAX_BUCKETS)), max(1, math.ceil(math.log2(max(2, 2 * size / memory_limit)))))
    num_buckets, shift = 1 << bits, 64 - bits
    tmp_dir = tempfile.mkdtemp(prefix=".shuffle-", dir=tmp_parent)
    try:
        buffers = [bytearray() for _ in range(num_buckets)]
        buffered = 0

        def flush() -> None:
            for b, buf in enumerate(buffers):
                if buf:
                    with open(os.path.join(tmp_dir, f"{b:05d}"), "ab") as f:
                        f.write(buf)
                    buf.clear()

        keys = KeyStream(seed)
        for index, line in enumerate(progress(_valid_lines(path, counts, strict), desc="shuffle (scatter)")):
            key = keys.next()
            buffers[key >> shift] += _HEADER.pack(key, index, len(line)) + line
            buffered += len(line) + _HEADER.size
            if buffered > memory_limit // 4:  # bounded memory; fewer, larger appends than per line
                flush()
                buffered = 0
        flush()
        for b in progress(range(num_buckets), desc="shuffle (sort buckets)", unit="bucket"):
            bucket_path = os.path.join(tmp_dir, f"{b:05d}")
            if not os.path.exists(bucket_path):
                continue
            with open(bucket_path, "rb") as f:
                data = f.read()
            records, pos = [], 0
            while pos < len(data):
                key, index, length = _HEADER.unpack_from(data, pos)
                pos += _HEADER.size
                records.append((key, index, pos, length))
                pos += length
            records.sort()
            for _, _, start, length in records:
                out.write(data[start:start + length])
            os.unlink(bucket_path)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return num_buckets


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("shuffle", help="seeded shuffle, external for files larger than RAM",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", help="JSONL to shuffle")
    add_output_arg(p, "shuffled JSONL")
    p.add_argument("--seed", type=int, default=1234, help="the output is a function of input and seed only")
    p.add_argument("--memory-limit", default="1G",
                   help="files larger than this are shuffled externally via temporary buckets (e.g. 512M, 4G)")
    add_common_args(p)
    return p


def run(args: argparse.Namespace) -> int:
    started = time.time()
    check_input(args.input)
    if args.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    memory_limit = parse_size(args.memory_limit, "--memory-limit")
    counts: Counter = Counter(docs=0, malformed=0)
    external = os.path.getsize(args.input) > memory_limit
    with atomic_write(args.output, "wb") as out:
        if external:
            buckets = shuffle_external(args.input, out, args.seed, memory_limit, counts, args.strict,
                                       os.path.dirname(os.path.abspath(args.output)))
        else:
            shuffle_in_memory(args.input, out, args.seed, counts, args.strict)
            buckets = 0
    write_stats(args.output, "shuffle", counts, args, [args.input], started,
                mode="external" if external else "memory", buckets=buckets)
    return 0
