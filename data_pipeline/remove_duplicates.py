"""Stage `remove-duplicates`: stream IN and drop every document a group marks for removal.

Documents are identified by (source name, line) as find-duplicates wrote them; each removed
line's text hash is checked, so groups built from a different file fail loudly instead of
deleting the wrong documents. References to other sources (loaded fingerprints) are counted and
ignored. Counts documents and characters removed and kept.

    python -m data_pipeline remove-duplicates groups.jsonl clean.jsonl --output dedup.jsonl
"""
from __future__ import annotations

import argparse
import os
import time
from collections import Counter

from data_pipeline.cli_args import add_common_args, add_output_arg, check_input
from data_pipeline.files import atomic_write
from data_pipeline.find_duplicates import text_hash
from data_pipeline.jsonl import BadLineReporter, iter_jsonl
from data_pipeline.stats import write_stats
from data_pipeline.workers import progress


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("remove-duplicates", help="drop all but the keeper of each group",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("groups", help="JSONL of groups from group-duplicates")
    p.add_argument("input", help="the JSONL that find-duplicates read")
    add_output_arg(p, "JSONL without the removed documents")
    p.add_argument("--source", help="source name of IN in the groups (default: its file name)")
    p.add_argument("--text-key", default="text", help="JSON field holding the text")
    add_common_args(p)
    return p


def load_removals(path: str, source: str, counts: Counter, strict: bool) -> dict[int, str | None]:
    """line -> expected text hash of every document of `source` marked for removal."""
    report = BadLineReporter(path, strict)
    remove: dict[int, str | None] = {}
    sources: Counter = Counter()
    for lineno, rec, _ in iter_jsonl(path, counts, strict, text_key=None):
        refs = rec.get("remove")
        if not isinstance(refs, list) or not all(isinstance(r, dict) and isinstance(r.get("line"), int)
                                                 for r in refs):
            counts["malformed"] += 1
            report(lineno, "not a group record (needs a 'remove' list of {source, line, hash})")
            continue
        for ref in refs:
            sources[ref.get("source")] += 1
            if ref.get("source") == source:
                remove[ref["line"]] = ref.get("hash")
            else:
                counts["refs_other_sources"] += 1
    if sources and not remove:
        raise ValueError(f"{path} marks documents of {sorted(map(str, sources))[:5]} but none of "
                         f"{source!r}; pass --source NAME if IN was renamed after find-duplicates")
    return remove


def run(args: argparse.Namespace) -> int:
    started = time.time()
    check_input(args.groups, "groups file")
    check_input(args.input)
    source = args.source or os.path.basename(args.input)
    counts: Counter = Counter(docs=0, kept=0, removed=0, chars_kept=0, chars_removed=0, malformed=0)
    group_counts: Counter = Counter()
    remove = load_removals(args.groups, source, group_counts, args.strict)
    counts["malformed_group_lines"] = group_counts["malformed"]
    counts["refs_other_sources"] = group_counts["refs_other_sources"]
    found: set[int] = set()
    with atomic_write(args.output) as out:
        for lineno, rec, raw in progress(iter_jsonl(args.input, counts, args.strict, args.text_key),
                                         desc="remove-duplicates"):
            counts["docs"] += 1
            text = rec[args.text_key]
            if lineno in remove:
                found.add(lineno)
                expected = remove[lineno]
                if expected is not None and text_hash(text) != expected:
                    raise ValueError(f"{args.input}:{lineno}: text differs from the document find-duplicates "
                                     f"saw there (hash {text_hash(text)} != {expected}); the groups were built "
                                     f"from another version of this file, re-run find-duplicates on it")
                counts["removed"] += 1
                counts["chars_removed"] += len(text)
                continue
            counts["kept"] += 1
            counts["chars_kept"] += len(text)
            out.write(raw if raw.endswith("\n") else raw + "\n")
        if len(found) != len(remove):  # inside the with: the output is not renamed into place
            missing = sorted(set(remove) - found)[:5]
            raise ValueError(f"{args.groups} marks {len(remove) - len(found)} lines of {source} that are not "
                             f"valid documents in {args.input} (e.g. lines {missing}); it was built from "
                             f"another file")
    write_stats(args.output, "remove-duplicates", counts, args, [args.groups, args.input], started)
    return 0
