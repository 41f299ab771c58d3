"""The installed `splitserve` command: its subcommands are the services and tools, each with a
`--help` that lists its flags and their defaults."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from scheduler_service.launch.command import SUBCOMMANDS, main

INSTALLED = Path(sys.executable).parent / "splitserve"
# A flag and the default its help must show, per subcommand that has one worth checking.
SHOWN_DEFAULTS = {
    "scheduler": ("--max-num-seqs", "(default: 256)"),
    "executor": ("--block-size", "(default: 16)"),
    "run": ("--port", "(default: 50051)"),
    "generate": ("--max-tokens", "(default: 256)"),
    "gateway": ("--drain-timeout", "(default: 25.0)"),
}


def test_the_installed_command_lists_every_subcommand() -> None:
    result = subprocess.run([str(INSTALLED), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    listed = {line.split()[0] for line in result.stdout.splitlines() if line.startswith("  ")}
    assert listed == set(SUBCOMMANDS)


@pytest.mark.parametrize("name", list(SUBCOMMANDS))
def test_each_subcommand_help_names_the_command_and_shows_defaults(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([name, "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: splitserve {name} ")
    if name in SHOWN_DEFAULTS:
        flag, default = SHOWN_DEFAULTS[name]
        helped = text[text.index(f"  {flag}") :]
        assert default in " ".join(helped.split()[:60]), helped[:600]


def test_an_unknown_subcommand_is_refused_with_the_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve-everything"]) == 2
    error = capsys.readouterr().err
    assert "unknown command 'serve-everything'" in error and "prepare-model" in error


def test_a_subcommand_runs_its_module(tmp_path: Path) -> None:
    # A client subcommand reaching no server fails as the client CLI does, through the command.
    result = subprocess.run(
        [str(INSTALLED), "status", "--server", "127.0.0.1:1", "--timeout", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert result.stderr.startswith("error: ") and "UNAVAILABLE" in result.stderr
