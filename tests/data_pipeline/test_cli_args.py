"""data_pipeline/cli_args.py: parse_size, the one size parser every command uses, and the one-line parser errors."""
import os
import subprocess
import sys

import pytest

from data_pipeline.cli_args import parse_size


def test_si_units_are_powers_of_1000_iec_units_and_bare_letters_powers_of_1024():
    assert parse_size("1GB") == 10**9 and parse_size("500MB") == 5 * 10**8 and parse_size("2kb") == 2000
    assert parse_size("2GiB") == 2 * 2**30 and parse_size("2G") == 2 * 2**30 and parse_size("64KiB") == 65536
    assert parse_size("512m") == 512 * 2**20 and parse_size("1.5T") == int(1.5 * 2**40)
    assert parse_size("1234") == 1234 and parse_size(" 7 B ") == 7


@pytest.mark.parametrize("text", ["1 parsec", "lots", "", "-1G", "0"])
def test_bad_sizes_name_the_text_and_the_forms(text):
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


@pytest.mark.parametrize("argv", [
    [sys.executable, "-m", "data_pipeline", "tokenize"],
    [sys.executable, "-m", "zerogpt_tools.estimate", "--batch", "-1"],
    [sys.executable, "train_gpt.py", "--confg", "x.py"],
])
def test_a_command_line_mistake_is_one_line_with_the_help_hint(argv):
    """argparse printed its usage block (27 lines for estimate) above the one line that matters."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(argv, cwd=root, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=root))
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and ": error: " in lines[0] and lines[0].endswith("--help lists the options)"), proc.stderr
