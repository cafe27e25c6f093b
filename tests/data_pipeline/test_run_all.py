"""data_pipeline/run_all.py: `all`'s options are the stages' own (one definition of each flag and its
default), and each stage gets the value `all` parsed. The chain end to end is in test_cli.py."""
from __future__ import annotations

import argparse

import pytest

from data_pipeline import run_all
from data_pipeline.__main__ import build_parser
from data_pipeline.stages import load_stage


def all_parser() -> argparse.ArgumentParser:
    parser = build_parser("all")
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["all"]


def parse_all(*argv: str) -> argparse.Namespace:
    return build_parser("all").parse_args(["all", "--urls", "urls.txt", "--workdir", "w", "--tokenize", *argv])


def own_parse(stage: str, argv: list[str]) -> dict:
    """`stage`'s arguments as its own command parses `argv`."""
    parser = argparse.ArgumentParser()
    load_stage(stage).add_parser(parser.add_subparsers(dest="stage"))
    return vars(parser.parse_args([stage, *argv]))


def test_every_stage_option_is_an_option_of_all_with_the_stage_default():
    options = {flag: action for action in all_parser()._actions for flag in action.option_strings}
    taken = 0
    for stage in run_all.OUTPUTS:
        for action in run_all.stage_parser(stage)[1]._actions:
            dest = run_all.all_dest(stage, action)
            if dest is None:
                continue
            flag = run_all.RENAMED.get((stage, action.dest), action.option_strings[0])
            ours = options[flag]
            assert ours.dest == dest and ours.default == action.default and ours.type is action.type, (stage, flag)
            assert ours.choices == action.choices and (stage in ours.help or "every stage" in ours.help), (stage, flag)
            taken += 1
    assert taken > 30
    # the files are the chain's, and the fingerprints have no task path
    for flag in ("--output", "--output-prefix", "--inputs", "--source", "--save-fingerprints", "--n_procs"):
        assert flag not in options, flag


def test_without_options_each_stage_gets_its_own_defaults():
    args = parse_all()
    for stage, argv in run_all.chain_argvs(args):
        assert vars(run_all.stage_args(stage, argv, args)) == own_parse(stage, argv), stage


def test_an_option_feeds_the_stages_that_have_it_under_its_own_or_its_renamed_flag():
    args = parse_all("--workers", "3", "--download-workers", "7", "--seed", "5", "--minhash-seed", "11",
                     "--threshold", "0.9", "--strict", "--min-length", "20", "--min-frequency", "4")
    got = {stage: run_all.stage_args(stage, argv, args) for stage, argv in run_all.chain_argvs(args)}
    assert got["download"].workers == 7
    assert got["cleanup"].workers == got["find-duplicates"].workers == got["tokenize"].workers == 3
    assert got["shuffle"].seed == 5 and got["find-duplicates"].seed == 11
    assert got["find-duplicates"].threshold == got["group-duplicates"].threshold == 0.9
    assert all(sargs.strict for sargs in got.values())
    assert got["blacklist"].min_length == 20 and got["train-tokenizer"].min_frequency == 4
    # the same as the stage's own command with those flags
    shuffle_argv = dict(run_all.chain_argvs(args))["shuffle"]
    assert vars(got["shuffle"]) == own_parse("shuffle", [*shuffle_argv, "--seed", "5", "--strict"])


def test_an_option_added_to_a_stage_is_an_option_of_all(monkeypatch):
    shuffle = load_stage("shuffle")
    add_parser = shuffle.add_parser

    def with_window(subparsers):
        p = add_parser(subparsers)
        p.add_argument("--window", type=int, default=64, help="lines kept in memory")
        return p

    monkeypatch.setattr(shuffle, "add_parser", with_window)
    window = next(a for a in all_parser()._actions if "--window" in a.option_strings)
    assert window.default == 64 and window.help == "shuffle: lines kept in memory"
    args = parse_all("--window", "9")
    sargs = {stage: run_all.stage_args(stage, argv, args) for stage, argv in run_all.chain_argvs(args)}
    assert sargs["shuffle"].window == 9 and not hasattr(sargs["cleanup"], "window")
    assert parse_all().window == 64


def test_two_stages_options_of_one_name_must_mean_the_same(monkeypatch):
    """A stage option whose name another stage holds with another default is refused until it is
    named in RENAMED, rather than silently feeding one value to both."""
    cleanup = load_stage("cleanup")
    add_parser = cleanup.add_parser

    def with_seed(subparsers):
        p = add_parser(subparsers)
        p.add_argument("--seed", type=int, default=7, help="sampling seed")
        return p

    monkeypatch.setattr(cleanup, "add_parser", with_seed)
    with pytest.raises(AssertionError, match="RENAMED"):
        all_parser()
    monkeypatch.setitem(run_all.RENAMED, ("cleanup", "seed"), "--cleanup-seed")
    args = parse_all("--cleanup-seed", "8")
    sargs = {stage: run_all.stage_args(stage, argv, args) for stage, argv in run_all.chain_argvs(args)}
    assert sargs["cleanup"].seed == 8 and sargs["shuffle"].seed == 1234


def test_a_stage_run_on_its_own_with_or_without_verbose_is_complete_for_all(tmp_path):
    """-v only shows the tasks' output on the console: it does not make `all` redo a stage (or a killed stage's
    tasks) that was run without it, nor the other way round."""
    from data_pipeline.__main__ import main
    from data_pipeline.stats import is_complete

    (tmp_path / "dedup.jsonl").write_text("".join(f'{{"text": "document {i}"}}\n' for i in range(20)))
    args = build_parser("all").parse_args(["all", "--input", "in.jsonl", "--workdir", str(tmp_path)])
    argv = dict(run_all.chain_argvs(args))["shuffle"]
    sargs = run_all.stage_args("shuffle", argv, args)
    for flags in ([], ["-v"]):
        assert main(["shuffle", *argv, *flags]) == 0
        assert is_complete(sargs.output, sargs), flags

