"""`python -m data_pipeline <stage> ...`: dispatch to one module per stage (DESIGN §6).

Each stage module (stages.py lists them) exposes `add_parser(subparsers)` and `run(args) -> int`.
Modules are imported only when their stage is chosen, so a missing or broken optional stage never
breaks the others.
Bad input data ends in a one-line `error:` message and exit code 2, never a traceback.

    python -m data_pipeline blacklist urls.txt --output clean_urls.txt
    python -m data_pipeline cleanup raw.jsonl --output clean.jsonl --executor ray   # as sharded tasks
    python -m data_pipeline all --urls urls.txt --workdir data/webtext
"""
from __future__ import annotations

import argparse
import sys

from data_pipeline.cli_args import ArgumentParser
from data_pipeline.stages import DIST_JOBS, STAGES, load_stage

# Errors that come from user input (paths, flags, data); anything else is a bug and keeps its traceback.
USER_ERRORS = (ValueError, FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """A stage's --help: its docstring as written, and every option's default (as zerogpt/cli.py's)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        # a help text that already states its default keeps it; flags and unset options (None) need none
        if "default" in (action.help or "") or action.default in (None, False):
            return action.help
        return super()._get_help_string(action)


def build_parser(stage: str | None = None) -> argparse.ArgumentParser:
    """The CLI parser; only `stage`'s module is imported (all stages get a stub for --help)."""
    parser = ArgumentParser(
        prog="python -m data_pipeline",
        description="Webtext data pipeline: " + " -> ".join(n for n in STAGES if n != "all"))
    sub = parser.add_subparsers(dest="stage", metavar="STAGE")
    sub.required = True
    for name, (_, help_text) in STAGES.items():
        if name == stage:
            stage_parser = load_stage(name).add_parser(sub)
            stage_parser.formatter_class = HelpFormatter
            if name in DIST_JOBS:  # the CPU stages can also run as tasks on an executor
                from data_pipeline.executor import add_executor_args

                add_executor_args(stage_parser, single_stage=True)
        else:
            sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` (default sys.argv[1:]), run the stage, return its exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    stage = argv[0] if argv and argv[0] in STAGES else None
    try:
        args = build_parser(stage).parse_args(argv)
        if getattr(args, "executor", None) and args.stage in DIST_JOBS:
            from data_pipeline.dist_stages import run_on_executor

            return run_on_executor(args.stage, args, args)
        return int(load_stage(args.stage).run(args) or 0)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; outputs are written atomically, re-run to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
