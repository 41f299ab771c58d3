"""The scheduler's command line, parsed without starting anything: defaults that meet an
executor started without flags, and values that make no sense refused by argparse."""

from __future__ import annotations

import pytest

from scheduler_service.__main__ import parse_args
from service_support.default_ports import (
    DEFAULT_EXECUTOR_ADDRESS,
    DEFAULT_SCHEDULER_PORT,
)


def test_without_flags_it_listens_on_50051_and_drives_the_local_executor() -> None:
    args = parse_args([])
    assert (args.port, DEFAULT_SCHEDULER_PORT) == (50051, 50051)
    assert args.executor == [DEFAULT_EXECUTOR_ADDRESS] == ["127.0.0.1:50052"]
    assert not args.verbose
    assert args.state_checkpoint_blocks == 4


def test_executors_given_replace_the_default() -> None:
    args = parse_args(["--executor", "a:1", "--executor", "dns:///b.example:50052", "-v"])
    assert args.executor == ["a:1", "dns:///b.example:50052"]
    assert args.verbose


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--port", "-1"),
        ("--port", "65536"),
        ("--metrics-port", "70000"),
        ("--health-port", "-2"),
        ("--resolve-interval", "0"),
        ("--step-timeout-floor", "0"),
        ("--step-timeout-factor", "-1"),
        ("--step-timeout-factor", "inf"),
        ("--drain-timeout", "-1"),
        ("--route-tokens-per-request", "-1"),
        ("--max-num-seqs", "0"),
        ("--state-checkpoint-blocks", "-1"),
        ("--target-itl-ms", "-5"),
        ("--target-itl-ms", "nan"),
        ("--executor", "no-port"),
        ("--executor", "host:0"),
        ("--executor", "dns:///no-port"),
    ],
)
def test_a_meaningless_value_is_argparses_error(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_args([flag, value])
    assert exit_.value.code == 2
    assert f"error: argument {flag}: " in capsys.readouterr().err.splitlines()[-1]


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--port", "0"),
        ("--drain-timeout", "0"),
        ("--route-tokens-per-request", "0"),
        ("--state-checkpoint-blocks", "0"),
        ("--target-itl-ms", "0"),
    ],
)
def test_edge_values_that_mean_something_are_taken(flag: str, value: str) -> None:
    parse_args([flag, value])
