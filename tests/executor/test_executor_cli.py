"""The executor's command line, parsed without starting anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from executor_service.__main__ import parse_args
from executor_service.settings import parse_size


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
        ["--model", "/m", "--port", "0", "--dtype", "bfloat16", "--kv-cache-memory", "64MiB"]
    )
    assert settings.model_dir == Path("/m")
    assert (settings.port, settings.dtype, settings.device) == (0, "bfloat16", "auto")
    assert (settings.kv_cache_bytes, settings.num_kv_blocks) == (64 << 20, None)
    assert (settings.trust_remote_code, settings.attention_backend) == (False, "auto")
    chosen = parse_args(
        ["--model", "/m", "--port", "0", "--trust-remote-code", "--attention-backend", "sdpa"]
    )
    assert (chosen.trust_remote_code, chosen.attention_backend) == (True, "sdpa")
    assert settings.packed_linear
    assert not parse_args(["--model", "/m", "--port", "0", "--no-packed-linear"]).packed_linear


def test_block_budget_flags_are_exclusive() -> None:
    with pytest.raises(SystemExit):
        parse_args(
            ["--model", "/m", "--port", "0", "--num-kv-blocks", "8", "--kv-cache-memory", "1GiB"]
        )
