"""cleanup as sharded tasks when its input is read through readers.py (JSONL folders, Parquet, Hugging Face
datasets, WARC): dist_stages.cleanup_jobs hands such an input over to `reader_jobs`.

The input's work units (readers.Source.units: whole files, or row ranges of a saved dataset) are dealt to the
tasks; each unit's kept documents, rejects and counts go to files of its own, and a last task concatenates them
in unit order into the output, rejects and stats that cleanup writes in one process: the documents are the same
on every executor. A task holds one document batch at a time, whatever the size of its files.
"""
from __future__ import annotations

import argparse
import os
from collections import Counter

from data_pipeline import cleanup
from data_pipeline.executor import Job, num_tasks
from data_pipeline.files import atomic_write, exists
from data_pipeline.readers import Source, is_dir
from data_pipeline.shards import concat, file_size, read_json, write_json
from data_pipeline.stats import write_stats
from data_pipeline.tokenizer import tokenizer_inputs
from data_pipeline.workers import batched


def unit_file(work: str, kind: str, unit: int, suffix: str = ".jsonl") -> str:
    return os.path.join(work, kind, f"{unit:05d}{suffix}")


def reader_jobs(args: argparse.Namespace, sargs: argparse.Namespace, work: str, started: float,
                tokenizer_json: str | None) -> list[Job]:
    """The clean and merge jobs; about --shard-size bytes of input per task, no more tasks than units."""
    if not exists(sargs.input):
        raise ValueError(f"input {sargs.input!r} does not exist; check the path")
    source = Source.from_args(sargs)
    tasks = num_tasks(args, sum(file_size(f) for f in source.files() if not is_dir(f)))
    units = source.units(tasks)
    tasks = max(1, min(tasks, len(units)))
    return [Job("clean", clean_task, tasks, {"work": work, "source": source, "units": units, "sargs": sargs,
                                            "tokenizer_json": tokenizer_json}),
            Job("merge", merge_task, 1, {"work": work, "source": source, "units": len(units), "sargs": sargs,
                                         "started": started})]


def clean_task(rank: int, world: int, work: str, source: Source, units: list, sargs: argparse.Namespace,
               tokenizer_json: str | None) -> None:
    """Clean units rank, rank + world, ...: each unit's output, rejects and counts in files of its own."""
    cleanup._init_worker(tokenizer_json)
    for u in range(rank, len(units), world):
        counts: Counter = Counter(kept=0, empty=0, too_short=0, wrong_lang=0, lang_detect_failed=0, malformed=0)
        languages: Counter = Counter()
        total_length = 0
        with atomic_write(unit_file(work, "out", u)) as out, atomic_write(unit_file(work, "rejected", u)) as rej:
            for batch in batched(source.read(units[u]), cleanup.BATCH_LINES):
                for result in cleanup.process_items((batch, sargs.lang, sargs.min_tokens, sargs.quality)):
                    total_length += cleanup.record_result(result, out, rej, counts, languages, report=None)
        write_json(unit_file(work, "counts", u, ".json"),
                   {"counts": counts, "languages": languages, "total_length": total_length})


def merge_task(rank: int, world: int, work: str, source: Source, units: int, sargs: argparse.Namespace,
               started: float) -> None:
    """The units' outputs and rejects in unit order, and the stats, as cleanup writes them."""
    merge_outputs(work, units, sargs, source.files(), started, input_format=source.format)


def merge_outputs(work: str, parts: int, sargs: argparse.Namespace, inputs: list[str], started: float,
                  **stats) -> None:
    """Concatenate `parts` tasks' kept and rejected documents in task order and write cleanup's stats from their
    counts: the output one process would have written (the sharded cleanup of a URL download's JSONL too)."""
    counts, languages, total_length = Counter(), Counter(), 0
    for u in range(parts):
        c = read_json(unit_file(work, "counts", u, ".json"))
        counts.update(c["counts"])
        languages.update(c["languages"])
        total_length += c["total_length"]
    with atomic_write(sargs.output, "wb") as out, atomic_write(sargs.output + ".rejected.jsonl", "wb") as rej:
        concat([unit_file(work, "out", u) for u in range(parts)], out)
        concat([unit_file(work, "rejected", u) for u in range(parts)], rej)
    unit = f"tokens ({sargs.tokenizer})" if sargs.tokenizer else "words (whitespace split; no --tokenizer)"
    write_stats(sargs.output, "cleanup", counts, sargs, inputs + tokenizer_inputs(sargs.tokenizer),
                started, length_unit=unit, kept_length_total=total_length,
                languages=dict(languages.most_common()), shards=parts, **stats)
