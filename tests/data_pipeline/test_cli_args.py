"""data_pipeline/cli_args.py: parse_size, the one size parser every command uses."""
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
