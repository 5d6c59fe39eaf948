"""The shared argument types: a bad value stops parsing with the flag's name and the rule it broke."""
import argparse

import pytest

from minispec import cli


def parse(kind, value: str):
    p = argparse.ArgumentParser(exit_on_error=False)
    p.add_argument("--flag", type=kind)
    return p.parse_args([f"--flag={value}"]).flag


@pytest.mark.parametrize("kind, good, bad, words", [
    (cli.positive_int, ("1", 1), ["0", "-3", "1.5", "x"], "integer >= 1"),
    (cli.non_negative_int, ("0", 0), ["-1", "two"], "integer >= 0"),
    (cli.positive_float, ("1e-3", 1e-3), ["0", "-1", "nan", "inf", "x"], "number"),
    (cli.non_negative_float, ("0", 0.0), ["-0.5", "nan", "-inf"], "number"),
])
def test_good_values_parse_and_bad_ones_name_the_flag(kind, good, bad, words):
    assert parse(kind, good[0]) == good[1]
    for value in bad:
        with pytest.raises(argparse.ArgumentError, match=words) as err:
            parse(kind, value)
        assert "--flag" in str(err.value)


def test_a_temperature_is_zero_or_one_the_samplers_accept():
    assert parse(cli.temperature, "0") == 0.0 and parse(cli.temperature, "0.7") == 0.7
    for value in ["1e-45", "-1", "nan"]:
        with pytest.raises(argparse.ArgumentError, match="--flag"):
            parse(cli.temperature, value)
