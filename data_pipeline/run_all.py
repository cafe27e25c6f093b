"""Stage `all`: blacklist -> download -> cleanup -> find/group/remove-duplicates -> shuffle
[-> train-tokenizer -> tokenize].

Runs each stage through its own parser and `run()`, with outputs in --workdir:
urls.txt, raw.jsonl, clean.jsonl, pairs.jsonl, groups.jsonl, dedup.jsonl, webtext.jsonl, and with
--tokenize also tokenizer/ (trained on webtext.jsonl unless --tokenizer names one) and
webtext_text_document.bin/.idx (the prefix the shipped configs read). A stage is skipped when its
output and `<output>.stats.json` are complete, made with the same arguments, and its inputs are
unchanged (io.is_complete, or the stage's own `is_complete(args)`); otherwise it runs again
(download resumes; --force makes it start over). A stage whose output holds no documents stops
the chain with its counts, instead of a later stage failing on an empty input.

    python -m data_pipeline all --urls urls/ --workdir data/webtext --lang en --threshold 0.7 --tokenize

The CPU stages run as sharded, resumable datatrove tasks (dist_stages.py) on --executor: local
processes by default, a Ray cluster (`--executor ray [--ray-address ADDR]`), or Slurm job arrays.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from data_pipeline.io import is_complete, read_stats

OUTPUTS = {"blacklist": "urls.txt", "download": "raw.jsonl", "cleanup": "clean.jsonl",
           "find-duplicates": "pairs.jsonl", "group-duplicates": "groups.jsonl",
           "remove-duplicates": "dedup.jsonl", "shuffle": "webtext.jsonl",
           "train-tokenizer": "tokenizer", "tokenize": "webtext_text_document"}
# Stages whose output is the corpus itself: when one is empty, nothing after it can work.
CORPUS_STAGES = ("blacklist", "download", "cleanup", "remove-duplicates", "shuffle")
# stages that run as sharded tasks on --executor (data_pipeline/dist_stages.py)
DIST_JOBS = ("blacklist", "cleanup", "find-duplicates", "group-duplicates", "remove-duplicates", "shuffle",
             "tokenize")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "all", help="run blacklist -> ... -> shuffle [-> tokenize], skipping complete stages",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--urls", required=True, help="a .txt of URLs or a directory of them")
    p.add_argument("--workdir", required=True, help="directory for every stage's output")
    p.add_argument("--force", action="store_true",
                   help="re-run every stage even if complete (download starts over instead of resuming)")
    p.add_argument("--strict", action="store_true", help="fail on malformed input lines (every stage)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help="processes for cleanup, find-duplicates and tokenize")
    # blacklist
    p.add_argument("--extra-domains", help="blacklist: extra domains file")
    p.add_argument("--extra-extensions", help="blacklist: extra extensions file")
    # download
    p.add_argument("--download-workers", type=int, default=32, help="download: concurrent requests (its --workers)")
    p.add_argument("--per-host", type=int, default=4, help="download: concurrent requests per host")
    p.add_argument("--timeout", type=float, default=30.0, help="download: seconds per attempt, whole fetch")
    p.add_argument("--max-bytes", type=int, default=5_000_000, help="download: body size cap")
    p.add_argument("--retries", type=int, default=2, help="download: extra attempts on 5xx/429/timeouts")
    p.add_argument("--backoff", type=float, default=1.0, help="download: first retry delay in seconds")
    p.add_argument("--allow-private", action="store_true", help="download: allow loopback/private addresses")
    p.add_argument("--retry-failed", action="store_true",
                   help="download: fetch every URL of raw.jsonl.failed.jsonl again (failures whose deciding "
                        "flag changed, such as private_address with --allow-private, are retried anyway)")
    p.add_argument("--extract-workers", type=int, default=None, help="download: trafilatura processes")
    # cleanup
    p.add_argument("--lang", default="en", help="cleanup: language to keep ('any': no filter)")
    p.add_argument("--min-tokens", type=int, default=128,
                   help="cleanup: minimum length, in tokens of --tokenizer or else in words")
    p.add_argument("--tokenizer", help="cleanup: tokenizer that counts --min-tokens; with --tokenize, also the "
                                       "tokenizer used (no train-tokenizer stage)")
    p.add_argument("--quality", action="store_true", help="cleanup: Gopher quality rules")
    # dedup
    p.add_argument("--threshold", type=float, default=0.7, help="find/group-duplicates: Jaccard threshold")
    p.add_argument("--num-perm", type=int, default=128, help="find-duplicates: MinHash permutations")
    p.add_argument("--ngram", type=int, default=5, help="find-duplicates: shingle length")
    p.add_argument("--unit", choices=("char", "word"), default="char", help="find-duplicates: shingle unit")
    # shuffle
    p.add_argument("--seed", type=int, default=1234, help="shuffle: seed")
    p.add_argument("--memory-limit", default="1G", help="shuffle: external shuffle above this input size")
    # tokenization (optional)
    p.add_argument("--tokenize", action="store_true",
                   help="also tokenize webtext.jsonl into WORKDIR/webtext_text_document.bin/.idx, training "
                        "WORKDIR/tokenizer first unless --tokenizer is given")
    p.add_argument("--vocab-size", type=int, default=50257, help="train-tokenizer: vocabulary size")
    from data_pipeline.executor import add_executor_args

    add_executor_args(p)
    return p


def stage_argvs(a: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(stage, argv) for every stage, in chain order."""
    out = {stage: os.path.join(a.workdir, name) for stage, name in OUTPUTS.items()}
    strict = ["--strict"] if a.strict else []

    def opt(flag: str, value) -> list[str]:
        return [flag, str(value)] if value is not None else []

    stages = [
        ("blacklist", [a.urls, "--output", out["blacklist"], *opt("--extra-domains", a.extra_domains),
                       *opt("--extra-extensions", a.extra_extensions), *strict]),
        ("download", [out["blacklist"], "--output", out["download"], "--workers", str(a.download_workers),
                      "--per-host", str(a.per_host), "--timeout", str(a.timeout), "--max-bytes", str(a.max_bytes),
                      "--retries", str(a.retries), "--backoff", str(a.backoff),
                      *opt("--extract-workers", a.extract_workers),
                      *(["--allow-private"] if a.allow_private else []),
                      *(["--retry-failed"] if a.retry_failed else []), *(["--force"] if a.force else []), *strict]),
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
    if a.tokenize:
        tokenizer = a.tokenizer or out["train-tokenizer"]
        if not a.tokenizer:
            stages.append(("train-tokenizer", [out["shuffle"], "--output", tokenizer, "--vocab-size",
                                               str(a.vocab_size), *strict]))
        stages.append(("tokenize", [out["shuffle"], "--tokenizer", tokenizer, "--output-prefix", out["tokenize"],
                                    "--workers", str(a.workers), *strict]))
    return stages


def run_stage(stage: str, module, stage_args: argparse.Namespace, args: argparse.Namespace) -> int:
    """The CPU stages run as sharded tasks on --executor (dist_stages.py); download and
    train-tokenizer run in this process."""
    if stage not in DIST_JOBS:
        return module.run(stage_args)
    from data_pipeline.dist_stages import run_on_executor

    return run_on_executor(stage, stage_args, args)


def run(args: argparse.Namespace) -> int:
    from data_pipeline.executor import executor_session
    from data_pipeline.io import local_path

    workdir = local_path(args.workdir)
    if workdir is None:
        raise ValueError(f"all --workdir {args.workdir!r}: must be a local path or file:// URL (download, "
                         f"find-duplicates' signature store and tokenize write local files); run the single "
                         f"stages with --executor to write their outputs to fsspec URLs")
    args.workdir = workdir

    with executor_session(args):  # one Ray for the whole chain
        return run_chain(args)


def run_chain(args: argparse.Namespace) -> int:
    from data_pipeline.__main__ import load_stage

    started = time.time()
    os.makedirs(args.workdir, exist_ok=True)
    for stage, argv in stage_argvs(args):
        module = load_stage(stage)
        parser = argparse.ArgumentParser(prog=f"all -> {stage}")
        module.add_parser(parser.add_subparsers(dest="stage"))
        stage_args = parser.parse_args([stage, *argv])
        complete = getattr(module, "is_complete", None)  # stages whose output is not one file say how
        if not args.force and (complete(stage_args) if complete else is_complete(stage_args.output, stage_args)):
            output = getattr(stage_args, "output", None) or stage_args.output_prefix
            print(f"[all] {stage}: skipped, {output} is complete", file=sys.stderr)
            check_produced(stage, stage_args, args)
            continue
        print(f"[all] {stage}: running" + (f" on {args.executor}" if stage in DIST_JOBS else ""), file=sys.stderr)
        rc = run_stage(stage, module, stage_args, args)
        if rc:
            print(f"[all] {stage} failed with exit code {rc}; fix it and re-run `all` to resume", file=sys.stderr)
            return rc
        if args.executor == "slurm" and stage in DIST_JOBS:  # the next stage reads this one's output
            print(f"[all] {stage}: submitted to Slurm; re-run this command when its jobs are done to go on "
                  f"(finished tasks and stages are skipped)", file=sys.stderr)
            return 0
        check_produced(stage, stage_args, args)
    final = OUTPUTS["tokenize"] + ".bin/.idx" if args.tokenize else OUTPUTS["shuffle"]
    print(f"[all] done in {time.time() - started:.1f}s: {os.path.join(args.workdir, final)}", file=sys.stderr)
    return 0


def check_produced(stage: str, stage_args: argparse.Namespace, args: argparse.Namespace) -> None:
    """ValueError naming `stage`, its counts and the way out when its output is a corpus with no
    documents: the next stage would fail on it with a message about its own input."""
    output = stage_args.output if stage in CORPUS_STAGES else None
    if output is None or os.path.getsize(output) > 0:
        return
    stats = read_stats(output) or {}
    counts = ", ".join(f"{k}={v}" for k, v in (stats.get("counts") or {}).items() if v) or "no counts"
    if stage == "download":
        reasons = stats.get("failed_reasons") or {}
        why = (f"every URL failed ({', '.join(f'{k}={v}' for k, v in reasons.items())}; "
               f"see {output}.failed.jsonl)")
        if "private_address" in reasons and not args.allow_private:
            why += "; loopback and private addresses need --allow-private"
        why += ("; a failed URL is fetched again only when the flag that decided it changes: "
                "--retry-failed fetches them all again, --force starts the download over")
    elif stage in ("blacklist", "cleanup"):
        why = f"every {'URL' if stage == 'blacklist' else 'document'} was rejected (see {output}.rejected.jsonl)"
    else:
        why = "its input held no valid documents"
    raise ValueError(f"stage {stage} produced nothing: {output} is empty ({counts}); {why}")
