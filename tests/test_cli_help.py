"""Every command-line tool's --help shows each option's default (issue 18.9)."""
import argparse

import pytest

import train_gpt
from zerogpt import estimate, export, extend_vocab, generate

PARSERS = {"train_gpt.py": train_gpt.build_parser, "zerogpt.estimate": estimate.build_parser,
           "zerogpt.export": export.build_parser, "zerogpt.generate": generate.build_parser,
           "zerogpt.extend_vocab": extend_vocab.build_parser}


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_help_shows_every_default(name):
    parser = PARSERS[name]()
    text = " ".join(parser.format_help().split())        # argparse wraps lines; compare on single spaces
    options = [a for a in parser._actions if a.option_strings and a.default not in (None, False, argparse.SUPPRESS)
               and a.help != argparse.SUPPRESS]
    assert options, f"{name}: no option with a default to check"
    for action in options:
        assert f"(default: {action.default})" in text, f"{name} {action.option_strings[0]}: default not shown"
