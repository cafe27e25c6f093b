"""Every command-line tool's --help shows each option's default (issue 18.9)."""
import argparse

import pytest

import train_gpt
from data_pipeline.__main__ import STAGES, build_parser as pipeline_parser
from zerogpt_tools import estimate, export, extend_vocab, generate, import_megatron


def stage_parser(stage):
    parser = pipeline_parser(stage)
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[stage]


PARSERS = {"train_gpt.py": train_gpt.build_parser, "zerogpt_tools.estimate": estimate.build_parser,
           "zerogpt_tools.export": export.build_parser, "zerogpt_tools.generate": generate.build_parser,
           "zerogpt_tools.extend_vocab": extend_vocab.build_parser,
           "zerogpt_tools.import_megatron": import_megatron.build_parser,
           **{f"data_pipeline {stage}": (lambda stage=stage: stage_parser(stage)) for stage in STAGES}}


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_help_shows_every_default(name):
    parser = PARSERS[name]()
    text = " ".join(parser.format_help().split())        # argparse wraps lines; compare on single spaces
    options = [a for a in parser._actions if a.option_strings and a.default not in (None, False, argparse.SUPPRESS)
               and a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)]
    for action in options:
        shown = f"(default: {action.default})" in text or "default" in (action.help or "")
        assert shown, f"{name} {action.option_strings[0]}: its default {action.default!r} is not in --help"
