"""The executor's command line, parsed without starting anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from executor_service.__main__ import parse_args
from executor_service.serving.settings import parse_size
from service_support.default_ports import DEFAULT_EXECUTOR_PORT

# An executor refuses to start without an access rule; these tests are about the other flags.
MODEL = ["--model", "/m", "--insecure-executor"]


@pytest.mark.parametrize(
    ("text", "size"),
    [("1048576", 1 << 20), ("512MiB", 512 << 20), ("2GiB", 2 << 30), ("1.5GB", 1_500_000_000)],
)
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "lots", "5XB", "-1GiB"])
def test_parse_size_refuses_nonsense(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_flags_reach_the_settings() -> None:
    settings = parse_args(
        [*MODEL, "--port", "0", "--dtype", "bfloat16", "--kv-cache-memory", "64MiB"]
    )
    assert settings.model_dir == Path("/m")
    assert (settings.port, settings.dtype, settings.device) == (0, "bfloat16", "auto")
    assert (settings.kv_cache_bytes, settings.num_kv_blocks) == (64 << 20, None)
    assert (settings.trust_remote_code, settings.attention_backend) == (False, "auto")
    chosen = parse_args(
        [*MODEL, "--port", "0", "--trust-remote-code", "--attention-backend", "sdpa"]
    )
    assert (chosen.trust_remote_code, chosen.attention_backend) == (True, "sdpa")
    assert settings.packed_linear
    assert not parse_args([*MODEL, "--port", "0", "--no-packed-linear"]).packed_linear


def test_shortcuts_that_make_tokens_depend_on_the_batch_or_the_host_are_opt_in() -> None:
    settings = parse_args([*MODEL])
    assert not settings.greedy_screen and not settings.amx
    assert parse_args([*MODEL, "--greedy-screen"]).greedy_screen
    assert not parse_args([*MODEL, "--no-greedy-screen"]).greedy_screen


def test_the_role_is_both_unless_chosen() -> None:
    assert parse_args([*MODEL]).role == "both"
    assert parse_args([*MODEL, "--role", "prefill"]).role == "prefill"
    assert parse_args([*MODEL, "--role", "decode"]).role == "decode"


def test_block_budget_flags_are_exclusive() -> None:
    with pytest.raises(SystemExit):
        parse_args(
            [*MODEL, "--port", "0", "--num-kv-blocks", "8", "--kv-cache-memory", "1GiB"]
        )


def test_the_port_has_a_default_the_scheduler_dials_by_default() -> None:
    assert parse_args([*MODEL]).port == DEFAULT_EXECUTOR_PORT == 50052
    assert not parse_args([*MODEL]).verbose
    assert parse_args([*MODEL, "-v"]).verbose


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--port", "-1"),
        ("--port", "65536"),
        ("--health-port", "70000"),
        ("--metrics-port", "-5"),
        ("--block-size", "0"),
        ("--num-kv-blocks", "0"),
        ("--kv-cache-memory", "0"),
        ("--kv-cache-memory", "lots"),
        ("--max-model-len", "0"),
        ("--max-logprobs", "-1"),
        ("--threads", "0"),
        ("--gpu-memory-utilization", "0"),
        ("--gpu-memory-utilization", "1.5"),
        ("--gpu-memory-utilization", "nan"),
        ("--lease-timeout", "0"),
        ("--lease-timeout", "-3"),
        ("--drain-timeout", "-1"),
        ("--tensor-parallel-size", "0"),
        ("--cuda-graph-max-batch", "-1"),
        ("--block-size", "sixteen"),
        ("--device", "gpu"),
        ("--role", "verify"),
    ],
)
def test_a_meaningless_value_is_argparses_error(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_args([*MODEL, flag, value])
    assert exit_.value.code == 2
    assert f"error: argument {flag}: " in capsys.readouterr().err.splitlines()[-1]


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--port", "0"), ("--max-logprobs", "0"), ("--drain-timeout", "0"), ("--gpu-memory-utilization", "1")],
)
def test_edge_values_that_mean_something_are_taken(flag: str, value: str) -> None:
    parse_args([*MODEL, flag, value])
