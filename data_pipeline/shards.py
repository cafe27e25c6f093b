"""Byte-range shards of a line file: the unit of work of the distributed stages.

Shard `rank` of `world` holds the lines that start in bytes [rank * size / world, (rank + 1) * size
/ world), so every task finds its own lines with one seek and a partial line read, and no task
reads the whole input. Paths, the task files' included, may be local or fsspec URLs (s3://,
gs://, with their fsspec backend installed). Line numbers are the documents' identity in
find/remove-duplicates; a task that needs them adds the line counts of the shards before it,
which a cheap first pass writes (`count_lines`).
"""
from __future__ import annotations

import json
import os
from typing import IO, Iterator

import fsspec

READ_BLOCK = 1 << 20


def file_size(path: str) -> int:
    fs, p = fsspec.core.url_to_fs(path)
    return fs.size(p)


def shard_bounds(path: str, rank: int, world: int) -> tuple[int, int]:
    """[start, end) byte offsets of shard `rank`: whole lines that start inside its byte range."""
    size = file_size(path)
    lo, hi = size * rank // world, size * (rank + 1) // world

    def line_start(offset: int, f: IO[bytes]) -> int:
        if offset == 0 or offset >= size:
            return min(offset, size)
        f.seek(offset - 1)
        f.readline()  # the line that holds byte offset-1 belongs to the previous shard
        return f.tell()

    with fsspec.open(path, "rb") as f:
        return line_start(lo, f), line_start(hi, f)


def iter_shard(path: str, rank: int, world: int) -> Iterator[bytes]:
    """Raw lines (with their newline) of shard `rank`, in file order."""
    start, end = shard_bounds(path, rank, world)
    with fsspec.open(path, "rb", block_size=READ_BLOCK) as f:
        f.seek(start)
        pos = start
        while pos < end:
            line = f.readline()
            if not line:
                break
            pos += len(line)
            yield line


def count_lines(rank: int, world: int, path: str, out_dir: str) -> int:
    """Write the number of lines of shard `rank` to OUT_DIR/lines/RANK.json (for `first_line`)."""
    n = sum(1 for _ in iter_shard(path, rank, world))
    write_json(os.path.join(out_dir, "lines", f"{rank:05d}.json"), {"lines": n})
    return n


def first_line(out_dir: str, rank: int) -> int:
    """1-based number of the first line of shard `rank`, from the counts of the shards before it."""
    return 1 + sum(read_json(os.path.join(out_dir, "lines", f"{r:05d}.json"))["lines"] for r in range(rank))


def write_json(path: str, obj) -> None:
    """Write a small JSON file atomically (a killed task leaves no half file)."""
    from data_pipeline.files import atomic_write

    with atomic_write(path) as f:
        json.dump(obj, f)


def read_json(path: str):
    with fsspec.open(path, "r", encoding="utf-8") as f:
        return json.load(f)


def concat(parts: list[str], out: IO[bytes]) -> None:
    """Append the files `parts`, in order, to the binary file `out`."""
    import shutil

    for part in parts:
        with fsspec.open(part, "rb") as f:
            shutil.copyfileobj(f, out, READ_BLOCK)
