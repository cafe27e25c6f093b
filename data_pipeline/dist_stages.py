"""The CPU stages as sharded tasks (see executor.py): `all` runs them, and so does each stage's
own command given `--executor` (both through `run_on_executor`).

Every stage that works line by line (blacklist's URL checks, cleanup, find-duplicates' signatures,
remove-duplicates, shuffle's scatter, tokenize) runs one task per byte-range shard of its input
(shards.py) and a last task that merges the shards' outputs, in shard order, into the file the
single-process stage writes, with the same stats: `all` and the later stages cannot tell the two
apart, and the documents are the same. blacklist drops exact duplicate URLs in its merge;
group-duplicates (union-find over the pairs) runs as one task, through its own `run()`. Task files
live in WORKDIR/.tasks/STAGE/ until the stage's output is complete.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
import time
from collections import Counter

import fsspec
import numpy as np

from data_pipeline import dist_dedup
from data_pipeline.cli_args import parse_size
from data_pipeline.executor import Job, executor_session, num_tasks, run_jobs
from data_pipeline.files import atomic_write, exists, local_path, remove_tree
from data_pipeline.jsonl import BadLineReporter, dumps, parse_jsonl_line
from data_pipeline.shards import concat, count_lines, file_size, first_line, iter_shard, read_json, write_json
from data_pipeline.stages import load_stage
from data_pipeline.stats import file_signature, read_stats, stage_params, write_stats
from data_pipeline.workers import batched

SHUFFLE_RECORD = struct.Struct("<QQI")  # key, line index, byte length (as shuffle.py's bucket files)


def part(work: str, kind: str, rank: int, suffix: str = ".jsonl") -> str:
    return os.path.join(work, kind, f"{rank:05d}{suffix}")


def run_module_task(rank: int, world: int, stage: str, stage_args: argparse.Namespace) -> None:
    """A stage that runs as one task: its own `run()`."""
    rc = load_stage(stage).run(stage_args)
    if rc:
        raise RuntimeError(f"{stage} exited with {rc}")


# ----------------------------------------------------------------------------------- blacklist

def blacklist_lines_task(rank: int, world: int, files: list[str], work: str) -> None:
    """Line counts of shard `rank` of every URL file (a folder per file)."""
    for i, path in enumerate(files):
        count_lines(rank, world, path, os.path.join(work, f"file{i:05d}"))


def blacklist_lists(sargs: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The domains and extensions `blacklist` rejects, as its run() builds them."""
    from data_pipeline import blacklist

    domains = [] if sargs.no_default_lists else blacklist.default_list("blacklist_domains.txt")
    extensions = [] if sargs.no_default_lists else blacklist.default_list("blacklist_extensions.txt")
    domains += blacklist.read_list(sargs.extra_domains) if sargs.extra_domains else []
    extensions += blacklist.read_list(sargs.extra_extensions) if sargs.extra_extensions else []
    return domains, extensions


def blacklist_task(rank: int, world: int, files: list[str], work: str, sargs: argparse.Namespace) -> None:
    """Check every URL of shard `rank` of each file; exact duplicates are left to the merge."""
    from data_pipeline.blacklist import UrlFilter

    url_filter = UrlFilter(*blacklist_lists(sargs), sargs.min_length)
    for i, path in enumerate(files):
        lines = enumerate(iter_shard(path, rank, world), first_line(os.path.join(work, f"file{i:05d}"), rank))
        with atomic_write(part(work, f"file{i:05d}", rank)) as out:
            for lineno, raw in lines:
                url = raw.decode("utf-8", errors="replace").strip()
                if url and not url.startswith("#"):  # as blacklist.iter_text_lines
                    out.write(dumps({"line": lineno, "url": url, "reason": url_filter.check(url)}))


def blacklist_merge(rank: int, world: int, files: list[str], work: str, shards: int, sargs: argparse.Namespace,
                    started: float) -> None:
    """The kept URLs in input order without exact duplicates, rejects and stats, as `blacklist` writes them."""
    from data_pipeline import blacklist

    counts: Counter = Counter()
    seen: set[str] = set()
    with atomic_write(sargs.output) as out, atomic_write(sargs.output + ".rejected.jsonl") as rej:
        for i, path in enumerate(files):
            report = BadLineReporter(path, sargs.strict)
            for r in range(shards):
                with fsspec.open(part(work, f"file{i:05d}", r), "r", encoding="utf-8") as f:
                    for rec in map(json.loads, f):
                        url, line = rec["url"], rec["line"]
                        blacklist.record_url(url, rec["reason"], f"{path}:{line}", seen, counts, out, rej,
                                             lambda: report(line, f"malformed URL {url[:200]!r}"))
    for reason in blacklist.REASONS:
        counts.setdefault(reason, 0)
    domains, extensions = blacklist_lists(sargs)
    inputs = ([sargs.input] if os.path.isdir(sargs.input) else []) + files + \
        [f for f in (sargs.extra_domains, sargs.extra_extensions) if f]
    write_stats(sargs.output, "blacklist", counts, sargs, inputs, started,
                num_domains=len(set(domains)), num_extensions=len(set(extensions)), shards=shards)


def blacklist_jobs(args, sargs, work, started) -> list[Job]:
    from data_pipeline.blacklist import input_files

    files = input_files(sargs.input)
    n = num_tasks(args, sum(file_size(f) for f in files))
    return [Job("lines", blacklist_lines_task, n, {"files": files, "work": work}),
            Job("check", blacklist_task, n, {"files": files, "work": work, "sargs": sargs}),
            Job("merge", blacklist_merge, 1, {"files": files, "work": work, "shards": n, "sargs": sargs,
                                              "started": started})]


# ------------------------------------------------------------------------------------- cleanup

def cleanup_task(rank: int, world: int, work: str, sargs: argparse.Namespace, tokenizer_json: str | None) -> None:
    from data_pipeline import cleanup

    cleanup._init_worker(tokenizer_json)
    lines = enumerate(iter_shard(sargs.input, rank, world), first_line(work, rank))
    counts: Counter = Counter(kept=0, empty=0, too_short=0, wrong_lang=0, lang_detect_failed=0, malformed=0)
    languages: Counter = Counter()
    total_length = 0
    report = BadLineReporter(sargs.input, sargs.strict, action=f"recorded in {sargs.output}.rejected.jsonl")
    with atomic_write(part(work, "out", rank)) as out, atomic_write(part(work, "rejected", rank)) as rej:
        for batch in batched(lines, cleanup.BATCH_LINES):
            for result in cleanup._process_batch((batch, sargs.lang, sargs.min_tokens, sargs.quality,
                                                  cleanup.input_keys(sargs))):
                total_length += cleanup.record_result(result, out, rej, counts, languages, report)
    write_json(part(work, "counts", rank, ".json"),
               {"counts": counts, "languages": languages, "total_length": total_length})


def cleanup_merge(rank: int, world: int, work: str, shards: int, sargs: argparse.Namespace, started: float) -> None:
    from data_pipeline.dist_cleanup import merge_outputs

    merge_outputs(work, shards, sargs, [sargs.input], started)


def cleanup_jobs(args, sargs, work, started) -> list[Job]:
    from data_pipeline.readers import is_line_input

    tokenizer_json = None
    if sargs.tokenizer:
        from data_pipeline.tokenizer import load_backend

        tokenizer_json = load_backend(sargs.tokenizer, require_eod=False)[0].to_str()
    if not is_line_input(sargs):  # Parquet, datasets, WARC, JSONL folders: a task per group of files
        from data_pipeline.dist_cleanup import reader_jobs

        return reader_jobs(args, sargs, work, started, tokenizer_json)
    n = num_tasks(args, file_size(sargs.input))
    return [Job("lines", count_lines, n, {"path": sargs.input, "out_dir": work}),
            Job("clean", cleanup_task, n, {"work": work, "sargs": sargs, "tokenizer_json": tokenizer_json}),
            Job("merge", cleanup_merge, 1, {"work": work, "shards": n, "sargs": sargs, "started": started})]


# ----------------------------------------------------------------------------- find-duplicates

def find_duplicates_jobs(args, sargs, work, started) -> list[Job]:
    if not 0.0 < sargs.threshold <= 1.0:
        raise ValueError(f"--threshold must be in (0, 1], got {sargs.threshold}")
    n = num_tasks(args, file_size(sargs.input))
    bands, _ = dist_dedup.bands_rows(sargs.threshold, sargs.num_perm)
    return [Job("lines", count_lines, n, {"path": sargs.input, "out_dir": work}),
            Job("signatures", dist_dedup.signatures_task, n,
                {"input": sargs.input, "work": work, "text_key": sargs.text_key, "ngram": sargs.ngram,
                 "unit": sargs.unit, "num_perm": sargs.num_perm, "seed": sargs.seed,
                 "threshold": sargs.threshold, "strict": sargs.strict}),
            Job("buckets", dist_dedup.buckets_task, min(bands, n),
                {"work": work, "shards": n, "partitions": n, "bands": bands}),
            Job("verify", dist_dedup.verify_task, n,
                {"work": work, "shards": n, "bands": bands, "threshold": sargs.threshold,
                 "source": os.path.basename(sargs.input)}),
            Job("merge", dist_dedup.merge_task, 1, {"work": work, "shards": n, "partitions": n, "args": sargs,
                                                    "started": started})]


# --------------------------------------------------------------------------- remove-duplicates

def remove_task(rank: int, world: int, work: str, sargs: argparse.Namespace) -> None:
    from data_pipeline.find_duplicates import text_hash
    from data_pipeline.remove_duplicates import load_removals

    first = first_line(work, rank)
    last = first_line(work, rank + 1) if rank + 1 < world else None
    source = sargs.source or os.path.basename(sargs.input)
    group_counts: Counter = Counter()
    remove = {line: h for line, h in load_removals(sargs.groups, source, group_counts, sargs.strict).items()
              if line >= first and (last is None or line < last)}
    counts: Counter = Counter(docs=0, kept=0, removed=0, chars_kept=0, chars_removed=0, malformed=0)
    report = BadLineReporter(sargs.input, sargs.strict)
    found = set()
    with atomic_write(part(work, "out", rank), "wb") as out:
        for lineno, raw in enumerate(iter_shard(sargs.input, rank, world), first):
            rec, err = parse_jsonl_line(raw, sargs.text_key)
            if rec is None:
                counts["malformed" if err else "blank_lines"] += 1
                if err:
                    report(lineno, err)
                continue
            counts["docs"] += 1
            text = rec[sargs.text_key]
            if lineno in remove:
                found.add(lineno)
                if remove[lineno] is not None and text_hash(text) != remove[lineno]:
                    raise ValueError(f"{sargs.input}:{lineno}: text differs from the document find-duplicates saw "
                                     f"there; the groups were built from another version of this file")
                counts["removed"] += 1
                counts["chars_removed"] += len(text)
                continue
            counts["kept"] += 1
            counts["chars_kept"] += len(text)
            out.write(raw if raw.endswith(b"\n") else raw + b"\n")
        if len(found) != len(remove):
            raise ValueError(f"{sargs.groups} marks lines of {source} that are not valid documents in "
                             f"{sargs.input} (e.g. {sorted(set(remove) - found)[:5]}); it was built from another file")
    counts["malformed_group_lines"] = group_counts["malformed"]
    counts["refs_other_sources"] = group_counts["refs_other_sources"]
    write_json(part(work, "counts", rank, ".json"), counts)


def concat_merge(rank: int, world: int, work: str, shards: int, stage: str, sargs: argparse.Namespace,
                 inputs: list[str], started: float) -> None:
    """Concatenate the shards' outputs into sargs.output and write the stage's stats."""
    counts: Counter = Counter()
    for r in range(shards):
        counts.update(read_json(part(work, "counts", r, ".json")))
    for key in ("malformed_group_lines", "refs_other_sources"):  # the same groups file read by every shard
        if key in counts:
            counts[key] //= shards
    with atomic_write(sargs.output, "wb") as out:
        concat([part(work, "out", r) for r in range(shards)], out)
    write_stats(sargs.output, stage, counts, sargs, inputs, started, shards=shards)


def remove_duplicates_jobs(args, sargs, work, started) -> list[Job]:
    n = num_tasks(args, file_size(sargs.input))
    return [Job("lines", count_lines, n, {"path": sargs.input, "out_dir": work}),
            Job("remove", remove_task, n, {"work": work, "sargs": sargs}),
            Job("merge", concat_merge, 1, {"work": work, "shards": n, "stage": "remove-duplicates", "sargs": sargs,
                                           "inputs": [sargs.groups, sargs.input], "started": started})]


# ------------------------------------------------------------------------------------- shuffle

def shuffle_buckets(input_size: int, memory_limit: int) -> int:
    """Range buckets of the key space: each holds about half of --memory-limit."""
    from data_pipeline.shuffle import MAX_BUCKETS

    return min(MAX_BUCKETS, 1 << max(0, math.ceil(math.log2(max(1, 2 * input_size / memory_limit)))))


def line_keys(seed: int, start: int, n: int) -> np.ndarray:
    """Keys of lines start..start+n-1: draws start.. of Philox(seed), as shuffle.py draws them
    (Philox is a counter-based generator: jump to any draw without making the ones before).
    shuffle.py numbers valid lines only, so the outputs are equal when every line is valid."""
    gen = np.random.Philox(key=seed)
    gen.advance(start // 4)  # one Philox step is 4 draws
    return gen.random_raw(n + start % 4)[start % 4:] if n else np.zeros(0, np.uint64)


def scatter_task(rank: int, world: int, work: str, sargs: argparse.Namespace, buckets: int) -> None:
    """Key each line of shard `rank` and append it to the file of its key's range bucket."""
    first = first_line(work, rank)
    lines = list(iter_shard(sargs.input, rank, world))
    keys = line_keys(sargs.seed, first - 1, len(lines))
    shift = np.uint64(64 - int(math.log2(buckets))) if buckets > 1 else np.uint64(64)
    bucket_of = (keys >> shift).astype(np.int64) if buckets > 1 else np.zeros(len(lines), np.int64)
    counts: Counter = Counter(docs=0, malformed=0)
    report = BadLineReporter(sargs.input, sargs.strict)
    out = [bytearray() for _ in range(buckets)]
    for i, raw in enumerate(lines):
        rec, err = parse_jsonl_line(raw, text_key=None)
        if rec is None:
            counts["malformed" if err else "blank_lines"] += 1
            if err:
                report(first + i, err)
            continue
        counts["docs"] += 1
        raw = raw if raw.endswith(b"\n") else raw + b"\n"
        out[bucket_of[i]] += SHUFFLE_RECORD.pack(int(keys[i]), first - 1 + i, len(raw)) + raw
    for b, data in enumerate(out):
        with atomic_write(os.path.join(work, "scatter", f"{b:05d}", f"{rank:05d}.bin"), "wb") as f:
            f.write(data)
    write_json(part(work, "counts", rank, ".json"), counts)


def sort_task(rank: int, world: int, work: str, shards: int) -> None:
    """Bucket `rank`: its lines from every shard, sorted by (key, line index)."""
    records = []
    for s in range(shards):
        with fsspec.open(os.path.join(work, "scatter", f"{rank:05d}", f"{s:05d}.bin"), "rb") as f:
            data = f.read()
        pos = 0
        while pos < len(data):
            key, index, length = SHUFFLE_RECORD.unpack_from(data, pos)
            pos += SHUFFLE_RECORD.size
            records.append((key, index, data[pos:pos + length]))
            pos += length
    records.sort(key=lambda r: (r[0], r[1]))
    with atomic_write(part(work, "out", rank), "wb") as out:
        for _, _, line in records:
            out.write(line)


def shuffle_merge(rank: int, world: int, work: str, shards: int, buckets: int, sargs: argparse.Namespace,
                  started: float) -> None:
    counts: Counter = Counter()
    for r in range(shards):
        counts.update(read_json(part(work, "counts", r, ".json")))
    with atomic_write(sargs.output, "wb") as out:
        concat([part(work, "out", b) for b in range(buckets)], out)
    write_stats(sargs.output, "shuffle", counts, sargs, [sargs.input], started, mode="distributed",
                buckets=buckets, shards=shards)


def shuffle_jobs(args, sargs, work, started) -> list[Job]:
    if sargs.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {sargs.seed}")
    size = file_size(sargs.input)
    n, buckets = num_tasks(args, size), shuffle_buckets(size, parse_size(sargs.memory_limit))
    return [Job("lines", count_lines, n, {"path": sargs.input, "out_dir": work}),
            Job("scatter", scatter_task, n, {"work": work, "sargs": sargs, "buckets": buckets}),
            Job("sort", sort_task, buckets, {"work": work, "shards": n}),
            Job("merge", shuffle_merge, 1, {"work": work, "shards": n, "buckets": buckets, "sargs": sargs,
                                            "started": started})]


# ------------------------------------------------------------------------------------ tokenize

def tokenize_task(rank: int, world: int, work: str, sargs: argparse.Namespace) -> None:
    from data_pipeline.tokenize_stage import tokenize_file

    shard = part(work, "in", rank)
    with atomic_write(shard, "wb") as f:
        for raw in iter_shard(sargs.input, rank, world):
            f.write(raw)
    tokenize_file(shard, sargs.tokenizer, part(work, "out", rank, ""), workers=1, text_key=sargs.json_key,
                  strict=sargs.strict)
    os.unlink(shard)


def tokenize_merge(rank: int, world: int, work: str, shards: int, sargs: argparse.Namespace, started: float) -> None:
    from data_pipeline import tokenize_stage as ts
    from data_pipeline.indexed import IndexedDataset, IndexedDatasetWriter

    counts: Counter = Counter()
    parts = [IndexedDataset(part(work, "out", r, "")) for r in range(shards)]
    shard_stats = [read_stats(part(work, "out", r, "")) for r in range(shards)]
    for stats in shard_stats:
        counts.update(stats["counts"])
    with IndexedDatasetWriter(sargs.output_prefix, parts[0].dtype) as writer:
        for ds in parts:
            if len(ds):
                writer.add_documents(np.asarray(ds.tokens), np.asarray(ds.sizes))
    # the stats of the in-process stage (vocab_size and eod_id, which GPTDataset reads, included)
    ts.write_tokenize_stats(sargs.input, sargs.tokenizer, sargs.output_prefix, sargs.json_key, counts, started,
                            shard_stats[0]["vocab_size"], shard_stats[0]["eod_id"], parts[0].dtype,
                            sum(stats["chars"] for stats in shard_stats), shards=shards)
    ts.refuse_no_documents(counts, sargs.input, sargs.output_prefix, sargs.json_key)


def tokenize_jobs(args, sargs, work, started) -> list[Job]:
    n = num_tasks(args, file_size(sargs.input))
    return [Job("tokenize", tokenize_task, n, {"work": work, "sargs": sargs}),
            Job("merge", tokenize_merge, 1, {"work": work, "shards": n, "sargs": sargs, "started": started})]


# -------------------------------------------------------------------------------------- driver

def one_task_jobs(stage: str):
    def jobs(args, sargs, work, started) -> list[Job]:
        return [Job(stage, run_module_task, 1, {"stage": stage, "stage_args": sargs})]
    return jobs


JOBS = {"blacklist": blacklist_jobs, "cleanup": cleanup_jobs, "find-duplicates": find_duplicates_jobs,
        "group-duplicates": one_task_jobs("group-duplicates"), "remove-duplicates": remove_duplicates_jobs,
        "shuffle": shuffle_jobs, "tokenize": tokenize_jobs}


# What must stay a local path (or file:// URL), and why; every other path may be an fsspec URL.
LOCAL_ONLY = {
    "blacklist": {"input": ("IN", "a folder of URL files is walked locally")},
    "find-duplicates": {"workdir": ("--workdir", "the signature store is memory-mapped")},
    "group-duplicates": {"pairs": ("PAIRS", "union-find reads it in one process")},
    "remove-duplicates": {"groups": ("GROUPS", "every task reads it whole")},
    "tokenize": {"output_prefix": ("--output-prefix", "the .bin/.idx writer needs local files"),
                 "workdir": ("--workdir", "the tokenizer reads its shard from a local file")},
}


def check_paths(stage: str, sargs: argparse.Namespace, args: argparse.Namespace) -> None:
    """ValueError naming the flag when a path that must be local is a remote URL."""
    for key, (flag, why) in LOCAL_ONLY.get(stage, {}).items():
        path = getattr(args if key == "workdir" else sargs, key)
        if path is not None and local_path(path) is None:
            raise ValueError(f"{stage} {flag} {path!r}: must be a local path or file:// URL ({why}); "
                             f"fsspec URLs work for its other inputs and outputs")


def run_on_executor(stage: str, sargs: argparse.Namespace, args: argparse.Namespace) -> int:
    """Run `stage` as tasks on args.executor: what `all` and the stage's own command with
    --executor do. A single stage (sargs is args) without --workdir keeps its task files in
    the folder of its output."""
    if args.workdir is None:
        output = getattr(sargs, "output", None) or sargs.output_prefix
        args.workdir = output.rsplit("/", 1)[0] if "/" in output else "."
    check_paths(stage, sargs, args)
    with executor_session(args):
        run_stage(stage, sargs, args)
    workdir = local_path(args.workdir)
    if workdir and args.executor != "slurm" and not getattr(args, "verbose", False):  # the tasks' lines: in its log
        from data_pipeline.console import stage_log, summary

        output = getattr(sargs, "output", None) or sargs.output_prefix
        print(summary(stage, output, stage_log(workdir, stage)), file=sys.stderr)
    return 0


def task_identity(sargs: argparse.Namespace) -> dict:
    """What a stage's finished tasks were made from: its parameters and the signatures of its inputs, the tokenizer's
    files among them (one retrained at the same path makes a killed stage's finished shards stale)."""
    from data_pipeline.tokenizer import tokenizer_inputs

    inputs = [getattr(sargs, k) for k in ("input", "groups", "pairs") if isinstance(getattr(sargs, k, None), str)]
    inputs += tokenizer_inputs(getattr(sargs, "tokenizer", None))
    identity = {"params": stage_params(sargs), "inputs": [file_signature(p) for p in inputs if exists(p)]}
    return json.loads(json.dumps(identity, default=str))


def run_stage(stage: str, sargs: argparse.Namespace, args: argparse.Namespace) -> dict[str, int]:
    """Run `stage` (parsed as `sargs`) as tasks on args.executor, in WORKDIR/.tasks/STAGE; the task
    files are deleted once the stage's output and stats are in place. Returns the peak RSS (KiB)
    of each job's tasks."""
    work = os.path.join(args.workdir, ".tasks", stage)
    identity = task_identity(sargs)
    marker = os.path.join(work, "identity.json")
    if exists(marker) and read_json(marker) != identity:  # tasks of another input or parameters
        remove_tree(work)
    if not exists(marker):
        write_json(marker, identity)
    run_jobs(args, work, JOBS[stage](args, sargs, work, time.time()))
    if args.executor == "slurm":
        return {}
    peaks = dist_dedup.peak_rss(work)
    remove_tree(work)
    return peaks
