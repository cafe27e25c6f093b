"""Stage `all`: blacklist -> download -> cleanup -> find/group/remove-duplicates -> shuffle.

Runs each stage through its own parser and `run()`, with outputs in --workdir:
urls.txt, raw.jsonl, clean.jsonl, pairs.jsonl, groups.jsonl, dedup.jsonl, webtext.jsonl.
A stage is skipped when its output and `<output>.stats.json` are complete, made with the same
arguments, and its inputs are unchanged (io.is_complete); otherwise it runs again (download
resumes). Tokenizer training and tokenization are separate stages (dataset worker).

    python -m data_pipeline all --urls urls/ --workdir data/webtext --lang en --threshold 0.7
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from data_pipeline.io import is_complete

OUTPUTS = {"blacklist": "urls.txt", "download": "raw.jsonl", "cleanup": "clean.jsonl",
           "find-duplicates": "pairs.jsonl", "group-duplicates": "groups.jsonl",
           "remove-duplicates": "dedup.jsonl", "shuffle": "webtext.jsonl"}


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("all", help="run blacklist -> ... -> shuffle, skipping complete stages",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--urls", required=True, help="a .txt of URLs or a directory of them")
    p.add_argument("--workdir", required=True, help="directory for every stage's output")
    p.add_argument("--force", action="store_true", help="re-run every stage even if complete")
    p.add_argument("--strict", action="store_true", help="fail on malformed input lines")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes for cleanup/find")
    # blacklist
    p.add_argument("--extra-domains", help="blacklist: extra domains file")
    p.add_argument("--extra-extensions", help="blacklist: extra extensions file")
    # download
    p.add_argument("--download-workers", type=int, default=32, help="download: concurrent requests")
    p.add_argument("--per-host", type=int, default=4)
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--max-bytes", type=int, default=5_000_000)
    p.add_argument("--retries", type=int, default=2)
    p.add_argument("--backoff", type=float, default=1.0)
    p.add_argument("--allow-private", action="store_true")
    p.add_argument("--extract-workers", type=int, default=None)
    # cleanup
    p.add_argument("--lang", default="en")
    p.add_argument("--min-tokens", type=int, default=128)
    p.add_argument("--tokenizer")
    p.add_argument("--quality", action="store_true")
    # dedup
    p.add_argument("--threshold", type=float, default=0.7)
    p.add_argument("--num-perm", type=int, default=128)
    p.add_argument("--ngram", type=int, default=5)
    p.add_argument("--unit", choices=("char", "word"), default="char")
    # shuffle
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--memory-limit", default="1G")
    return p


def stage_argvs(a: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(stage, argv) for every stage, in chain order."""
    out = {stage: os.path.join(a.workdir, name) for stage, name in OUTPUTS.items()}
    strict = ["--strict"] if a.strict else []

    def opt(flag: str, value) -> list[str]:
        return [flag, str(value)] if value is not None else []

    return [
        ("blacklist", [a.urls, "--output", out["blacklist"], *opt("--extra-domains", a.extra_domains),
                       *opt("--extra-extensions", a.extra_extensions)]),
        ("download", [out["blacklist"], "--output", out["download"], "--workers", str(a.download_workers),
                      "--per-host", str(a.per_host), "--timeout", str(a.timeout), "--max-bytes", str(a.max_bytes),
                      "--retries", str(a.retries), "--backoff", str(a.backoff),
                      *opt("--extract-workers", a.extract_workers),
                      *(["--allow-private"] if a.allow_private else [])]),
        ("cleanup", [out["download"], "--output", out["cleanup"], "--lang", a.lang, "--min-tokens",
                     str(a.min_tokens), "--workers", str(a.workers), *opt("--tokenizer", a.tokenizer),
                     *(["--quality"] if a.quality else []), *strict]),
        ("find-duplicates", [out["cleanup"], "--output", out["find-duplicates"], "--threshold", str(a.threshold),
                             "--num-perm", str(a.num_perm), "--ngram", str(a.ngram), "--unit", a.unit,
                             "--workers", str(a.workers), *strict]),
        ("group-duplicates", [out["find-duplicates"], "--output", out["group-duplicates"],
                              "--threshold", str(a.threshold), *strict]),
        ("remove-duplicates", [out["group-duplicates"], out["cleanup"], "--output", out["remove-duplicates"],
                               *strict]),
        ("shuffle", [out["remove-duplicates"], "--output", out["shuffle"], "--seed", str(a.seed),
                     "--memory-limit", a.memory_limit, *strict]),
    ]


def run(args: argparse.Namespace) -> int:
    from data_pipeline.__main__ import load_stage

    started = time.time()
    os.makedirs(args.workdir, exist_ok=True)
    for stage, argv in stage_argvs(args):
        module = load_stage(stage)
        parser = argparse.ArgumentParser(prog=f"all -> {stage}")
        module.add_parser(parser.add_subparsers(dest="stage"))
        stage_args = parser.parse_args([stage, *argv])
        if not args.force and is_complete(stage_args.output, stage_args):
            print(f"[all] {stage}: skipped, {stage_args.output} is complete", file=sys.stderr)
            continue
        print(f"[all] {stage}: running", file=sys.stderr)
        rc = module.run(stage_args)
        if rc:
            print(f"[all] {stage} failed with exit code {rc}; fix it and re-run `all` to resume", file=sys.stderr)
            return rc
    print(f"[all] done in {time.time() - started:.1f}s: {os.path.join(args.workdir, OUTPUTS['shuffle'])}",
          file=sys.stderr)
    return 0
