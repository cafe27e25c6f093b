"""The command-line arguments the stages share, and what they accept: --strict, the output as
`--output OUT` or a last positional, sizes (`parse_size`), and the check that an input exists (a one-line
error naming the path, not a traceback).

`parse_size` has its one home here: zerogpt_tools' flags (export --max-shard-size, estimate's sizes,
extend_vocab) import it from this module, as DESIGN §1 lets the tools import the data pipeline, while zerogpt
and data_pipeline import neither each other nor the tools. zerogpt itself reads no size from a command line.

Each stage's own flags stay in its module's `add_parser`.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any

from data_pipeline.stats import written_by

_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str, name: str = "size") -> int:
    """Bytes from a size, with the one meaning every zerogpt command uses (the coreutils `dd` convention).

    SI units are powers of 1000 ("1GB" = 10**9, as Hugging Face's max_shard_size); IEC units and bare letters
    are powers of 1024 ("1GiB" = "1G" = 2**30). Case does not matter; a plain number is bytes.

    Example:
        >>> parse_size("1GB"), parse_size("1G"), parse_size("512MiB")
        (1000000000, 1073741824, 536870912)
    Raises:
        ValueError naming `name` (e.g. the flag), the text and the accepted forms (also for sizes <= 0).
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"{name}: cannot read {text!r} as a size; write bytes or e.g. 500MB (10**6), 2G or 2GiB "
                         f"(2**30)")
    value = int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {text!r}")
    return value


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose mistake is one line, `PROG: error: MESSAGE (PROG --help lists the options)`, exit 2,
    where argparse prints its whole usage block first (27 lines for estimate, before the line that matters).
    Every command of the project uses it: the pipeline's stages (subparsers inherit it), train_gpt.py, the tools."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the options)\n")


def add_common_args(parser: Any) -> None:
    """--strict, the flag every stage that reads JSONL shares."""
    parser.add_argument("--strict", action="store_true",
                        help="fail on the first malformed input line instead of skipping and counting it")


def add_output_arg(parser: argparse.ArgumentParser, help: str) -> None:
    """`--output OUT` / `-o OUT`, or OUT as the last positional: the Megatron tools' form that the
    Colossal-AI GPT tutorial runs (`cleanup raw.json clean.json`, `shuffle dedup.json -o train.json`).

    Both land in `args.output`; giving neither or both is an argparse error. Add it after the
    stage's other positionals.
    """
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("-o", "--output", help=help)
    # SUPPRESS: when the positional is absent it must not overwrite --output with a default
    group.add_argument("output", nargs="?", metavar="OUTPUT", default=argparse.SUPPRESS,
                       help="the same as --output (the tutorial's positional form)")


def check_input(path: str, what: str = "input") -> None:
    """ValueError (not a traceback) when an input file is missing; a warning naming the stage that
    wrote it, and its counts, when it is an empty stage output (the chain is broken upstream)."""
    if not os.path.exists(path):
        raise ValueError(f"{what} {path!r} does not exist; check the path (or run the previous stage)")
    if os.path.isfile(path) and os.path.getsize(path) == 0 and written_by(path):
        print(f"warning: {what} {path} is empty{written_by(path)}", file=sys.stderr)
