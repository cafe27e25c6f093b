"""Stage `all`: blacklist -> download -> cleanup -> find/group/remove-duplicates -> shuffle
[-> train-tokenizer -> tokenize].

Runs each stage through its own parser and `run()`, with outputs in --workdir:
urls.txt, raw.jsonl, clean.jsonl, pairs.jsonl, groups.jsonl, dedup.jsonl, webtext.jsonl, and with
--tokenize also tokenizer/ (trained on webtext.jsonl unless --tokenizer names one) and
webtext_text_document.bin/.idx (the prefix the shipped configs read). A stage is skipped when its
output and `<output>.stats.json` are complete, made with the same arguments, and its inputs are
unchanged (stats.is_complete, or the stage's own `is_complete(args)`); otherwise it runs again
(download resumes; --force makes it start over). A stage whose output holds no documents stops
the chain with its counts, instead of a later stage failing on an empty input.

The options of `all` are the stages' own, as each stage's `add_parser` defines them (name, default,
help): a stage's new option is an option of `all` too. One option feeds every stage that has it
(--workers: cleanup, find-duplicates and tokenize; --threshold: find- and group-duplicates).
Download's --workers is --download-workers, and find-duplicates' --seed is --minhash-seed (--seed
is shuffle's). The stages' files are not options: `all` chains them through --workdir; nor are
find-duplicates' fingerprints (its sharded tasks do not use them).

    python -m data_pipeline all --urls urls/ --workdir data/webtext --lang en --threshold 0.7 --tokenize

With --input instead of --urls, the chain starts at cleanup, which reads users' own data (readers.py):
JSONL with any --text-key, Parquet, a Hugging Face dataset folder, or WARC/WET files (--input-format).

    python -m data_pipeline all --input CC-MAIN-20240101-00000.warc.gz --workdir data/cc --tokenize

The CPU stages run as sharded, resumable datatrove tasks (dist_stages.py) on --executor: local
processes by default, a Ray cluster (`--executor ray [--ray-address ADDR]`), or Slurm job arrays.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time

from data_pipeline.stages import DIST_JOBS, load_stage
from data_pipeline.stats import is_complete, read_stats

OUTPUTS = {"blacklist": "urls.txt", "download": "raw.jsonl", "cleanup": "clean.jsonl",
           "find-duplicates": "pairs.jsonl", "group-duplicates": "groups.jsonl",
           "remove-duplicates": "dedup.jsonl", "shuffle": "webtext.jsonl",
           "train-tokenizer": "tokenizer", "tokenize": "webtext_text_document"}
# Stages whose output is the corpus itself: when one is empty, nothing after it can work.
CORPUS_STAGES = ("blacklist", "download", "cleanup", "remove-duplicates", "shuffle")

# A stage's options that `all` sets itself: its files, chained through --workdir (chain_argvs).
# Its positionals are files too, and never options of `all`.
CHAIN_OPTIONS = {
    "blacklist": {"output"}, "download": {"output"}, "cleanup": {"output"},
    # input: --inputs FILE url, the tutorial's form of IN; text_key: clean.jsonl holds `text` whatever the
    # input's key (--text-key of `all` is cleanup's)
    "find-duplicates": {"input", "output", "text_key"},
    "group-duplicates": {"output"},
    "remove-duplicates": {"output", "source", "text_key"},  # source: the groups name clean.jsonl, the file it reads
    "shuffle": {"output"}, "train-tokenizer": {"output"},
    "tokenize": {"output_prefix", "tokenizer"},  # tokenizer: `all`'s --tokenizer, or the one trained
}
# (stage, option) that `all` leaves at the stage's default: the sharded tasks (dist_dedup.py) that
# run find-duplicates for `all` neither save nor load fingerprints.
NOT_IN_ALL = {("find-duplicates", "save_fingerprints"), ("find-duplicates", "load_fingerprints")}
# (stage, option) that `all` names differently, because an option of another stage (or of `all`)
# holds the name with another meaning or default.
RENAMED = {("download", "workers"): "--download-workers",  # concurrent requests, not processes
           ("find-duplicates", "seed"): "--minhash-seed"}  # --seed is shuffle's


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "all", help="run blacklist -> ... -> shuffle [-> tokenize], skipping complete stages",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--urls", help="a .txt of URLs or a directory of them")
    source.add_argument("--input", help="instead of --urls: your own documents, a file or a folder (JSONL, "
                                        "Parquet, a Hugging Face dataset, WARC/WET; see --input-format); the chain "
                                        "starts at cleanup")
    p.add_argument("--workdir", required=True, help="directory for every stage's output")
    p.add_argument("--force", action="store_true",
                   help="re-run every stage even if complete (download starts over instead of resuming)")
    p.add_argument("--tokenize", action="store_true",
                   help="also tokenize webtext.jsonl into WORKDIR/webtext_text_document.bin/.idx, training "
                        "WORKDIR/tokenizer first unless --tokenizer is given")
    add_stage_options(p)
    from data_pipeline.executor import add_executor_args

    add_executor_args(p)
    return p


def stage_parser(stage: str) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The parser of `stage`'s own command (without the executor flags), and its subparser, whose
    actions are the stage's arguments."""
    parser = argparse.ArgumentParser(prog=f"all -> {stage}")
    return parser, load_stage(stage).add_parser(parser.add_subparsers(dest="stage"))


def all_dest(stage: str, action: argparse.Action) -> str | None:
    """Where `all`'s arguments hold the value of `stage`'s argument `action`; None when `all` does
    not take it (-h, the stage's files, NOT_IN_ALL)."""
    if (not action.option_strings or action.dest == "help" or action.dest in CHAIN_OPTIONS.get(stage, ())
            or (stage, action.dest) in NOT_IN_ALL):
        return None
    renamed = RENAMED.get((stage, action.dest))
    return renamed.removeprefix("--").replace("-", "_") if renamed else action.dest


def _meaning(action: argparse.Action) -> tuple:
    """What two stages' options must agree on to be one option of `all`."""
    return type(action), action.default, action.type, action.choices, action.nargs, action.const


def add_stage_options(p: argparse.ArgumentParser) -> None:
    """Add every stage's options to `all`'s parser `p`, each as its stage defines it, with the stages
    it feeds before its help. An option that several stages have is added once; they must agree on
    its default, type and choices (else it belongs in RENAMED)."""
    # argparse has no public way to copy an option from one parser to another; `parents=` copies
    # whole parsers the same way, through _actions and _add_action.
    by_flag = {flag: action for action in p._actions for flag in action.option_strings}  # `all`'s own
    fed: dict[argparse.Action, list[str]] = {}  # option of `all` copied from the stages -> those stages
    for stage in OUTPUTS:
        for action in stage_parser(stage)[1]._actions:
            dest = all_dest(stage, action)
            if dest is None:
                continue
            flags = [RENAMED[stage, action.dest]] if (stage, action.dest) in RENAMED else action.option_strings
            held = {by_flag[flag] for flag in flags if flag in by_flag}
            if held:
                option = held.pop()
                assert not held and option.dest == dest and _meaning(option) == _meaning(action), (
                    f"{stage} {flags} is not the `all` option {option.option_strings}: "
                    f"{_meaning(action)} != {_meaning(option)}; name it in RENAMED")
                if option in fed:  # (`all`'s own options keep their help)
                    fed[option].append(stage)
                continue
            option = copy.copy(action)
            option.option_strings, option.dest, option.container = flags, dest, p
            p._add_action(option)
            by_flag.update(dict.fromkeys(flags, option))
            fed[option] = [stage if flags == action.option_strings else f"{stage} {action.option_strings[0]}"]
    for option, stages in fed.items():
        names = "every stage" if stages == list(OUTPUTS) else ", ".join(stages)
        option.help = f"{names}: {option.help}" if option.help else names


def chain_argvs(a: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(stage, argv of its files) for every stage, in chain order: each reads the outputs before it."""
    out = {stage: os.path.join(a.workdir, name) for stage, name in OUTPUTS.items()}
    stages = [
        ("blacklist", [a.urls, "--output", out["blacklist"]]),
        ("download", [out["blacklist"], "--output", out["download"]]),
        ("cleanup", [out["download"], "--output", out["cleanup"]]),
    ] if a.input is None else [
        ("cleanup", [a.input, "--output", out["cleanup"]]),  # the user's documents: no URLs to fetch
    ]
    stages += [
        ("find-duplicates", [out["cleanup"], "--output", out["find-duplicates"]]),
        ("group-duplicates", [out["find-duplicates"], "--output", out["group-duplicates"]]),
        ("remove-duplicates", [out["group-duplicates"], out["cleanup"], "--output", out["remove-duplicates"]]),
        ("shuffle", [out["remove-duplicates"], "--output", out["shuffle"]]),
    ]
    if a.tokenize:
        tokenizer = a.tokenizer or out["train-tokenizer"]
        if not a.tokenizer:
            stages.append(("train-tokenizer", [out["shuffle"], "--output", tokenizer]))
        stages.append(("tokenize", [out["shuffle"], "--tokenizer", tokenizer, "--output-prefix", out["tokenize"]]))
    return stages


def stage_args(stage: str, argv: list[str], args: argparse.Namespace) -> argparse.Namespace:
    """`stage`'s arguments: its files parsed from `argv` (chain_argvs), every other option taken
    from `all`'s `args`, where the same option definition parsed it."""
    parser, sub = stage_parser(stage)
    sargs = parser.parse_args([stage, *argv])
    for action in sub._actions:
        dest = all_dest(stage, action)
        if dest is not None:
            setattr(sargs, action.dest, getattr(args, dest))
    return sargs


def run_stage(stage: str, module, sargs: argparse.Namespace, args: argparse.Namespace) -> int:
    """The CPU stages run as sharded tasks on --executor (dist_stages.py); download and
    train-tokenizer run in this process."""
    if stage not in DIST_JOBS:
        return module.run(sargs)
    from data_pipeline.dist_stages import run_on_executor

    return run_on_executor(stage, sargs, args)


def run(args: argparse.Namespace) -> int:
    from data_pipeline.executor import executor_session
    from data_pipeline.files import local_path

    workdir = local_path(args.workdir)
    if workdir is None:
        raise ValueError(f"all --workdir {args.workdir!r}: must be a local path or file:// URL (download, "
                         f"find-duplicates' signature store and tokenize write local files); run the single "
                         f"stages with --executor to write their outputs to fsspec URLs")
    args.workdir = workdir

    with executor_session(args):  # one Ray for the whole chain
        return run_chain(args)


def run_chain(args: argparse.Namespace) -> int:
    started = time.time()
    os.makedirs(args.workdir, exist_ok=True)
    for stage, argv in chain_argvs(args):
        module = load_stage(stage)
        sargs = stage_args(stage, argv, args)
        complete = getattr(module, "is_complete", None)  # stages whose output is not one file say how
        if not args.force and (complete(sargs) if complete else is_complete(sargs.output, sargs)):
            output = getattr(sargs, "output", None) or sargs.output_prefix
            print(f"[all] {stage}: skipped, {output} is complete", file=sys.stderr)
            check_produced(stage, sargs, args)
            continue
        print(f"[all] {stage}: running" + (f" on {args.executor}" if stage in DIST_JOBS else ""), file=sys.stderr)
        rc = run_stage(stage, module, sargs, args)
        if rc:
            print(f"[all] {stage} failed with exit code {rc}; fix it and re-run `all` to resume", file=sys.stderr)
            return rc
        if args.executor == "slurm" and stage in DIST_JOBS:  # the next stage reads this one's output
            print(f"[all] {stage}: submitted to Slurm; re-run this command when its jobs are done to go on "
                  f"(finished tasks and stages are skipped)", file=sys.stderr)
            return 0
        check_produced(stage, sargs, args)
    final = OUTPUTS["tokenize"] + ".bin/.idx" if args.tokenize else OUTPUTS["shuffle"]
    print(f"[all] done in {time.time() - started:.1f}s: {os.path.join(args.workdir, final)}", file=sys.stderr)
    return 0


def check_produced(stage: str, sargs: argparse.Namespace, args: argparse.Namespace) -> None:
    """ValueError naming `stage`, its counts and the way out when its output is a corpus with no
    documents: the next stage would fail on it with a message about its own input."""
    output = sargs.output if stage in CORPUS_STAGES else None
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
