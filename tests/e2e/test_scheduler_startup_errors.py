"""What a user can get wrong starting a scheduler is refused in one line on stderr that says what
is wrong and what to do, with exit status 2 and no traceback (-v adds it), before it serves:
every case through the real command, as a user would meet it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.service_process import free_port
from tests.helpers.startup_refusal import (
    SCHEDULER,
    SCHEDULER_MODULE,
    listener,
    refused,
    refused_by_argparse,
    run,
)
from tests.helpers.tokenizer_assets import gpt2_tokenizer_dir

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_a_missing_tokenizer_folder_says_what_it_holds(tmp_path: Path) -> None:
    refusal = refused([*SCHEDULER, "--port", "0", "--tokenizer", str(tmp_path / "nowhere")])
    assert refusal.fields["event"] == "scheduler_refused"
    assert refusal.reason.startswith(f"--tokenizer {tmp_path / 'nowhere'}: no such folder")
    assert "tokenizer.json" in refusal.reason and "splitserve prepare-model" in refusal.reason


def test_a_hub_id_as_tokenizer_is_told_that_nothing_is_downloaded() -> None:
    refusal = refused([*SCHEDULER_MODULE, "--port", "0", "--tokenizer", HUB_ID])
    assert "nothing is downloaded" in refusal.reason and "Hugging Face hub id" in refusal.reason
    assert "HFValidationError" not in refusal.line


def test_a_folder_without_tokenizer_files_is_refused(tmp_path: Path) -> None:
    # A model folder without its tokenizer: config.json is no vocabulary.
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    refusal = refused([*SCHEDULER, "--port", "0", "--tokenizer", str(tmp_path)])
    assert refusal.reason.startswith(f"--tokenizer {tmp_path}: holds no tokenizer files")


def test_tokenizer_files_transformers_cannot_load_are_refused(tmp_path: Path) -> None:
    folder = gpt2_tokenizer_dir(tmp_path / "gpt2")
    (folder / "vocab.json").write_text("{not json")
    refusal = refused([*SCHEDULER, "--port", "0", "--tokenizer", str(folder)])
    assert refusal.reason.startswith(f"--tokenizer {folder}: transformers cannot load its tokenizer (")


@pytest.mark.parametrize("flag", ["--port", "--health-port", "--metrics-port"])
def test_a_port_in_use_is_refused(flag: str) -> None:
    with listener() as port:
        others = [] if flag == "--port" else ["--port", "0"]
        refusal = refused([*SCHEDULER, *others, flag, str(port)])
    assert refusal.reason.startswith(f"127.0.0.1:{port} ({flag}) is already in use")


def test_two_flags_on_one_port_are_refused() -> None:
    port = free_port()
    refusal = refused([*SCHEDULER, "--port", str(port), "--metrics-port", str(port)])
    assert refusal.reason == f"--metrics-port {port} is --port's port too; give each its own (0 picks a free one)"


def test_a_host_that_is_not_here_is_refused() -> None:
    refusal = refused([*SCHEDULER, "--host", "no-such-host.invalid", "--port", "0"])
    assert refusal.reason.startswith("--host no-such-host.invalid is not an address this machine can listen on")


@pytest.mark.parametrize(
    ("flag", "value", "problem"),
    [
        ("--route-tokens-per-request", "-1", "must be 0 or more, got -1"),
        ("--executor", "localhost", "'localhost' is not HOST:PORT"),
    ],
)
def test_a_meaningless_value_is_refused_by_argparse(flag: str, value: str, problem: str) -> None:
    line = refused_by_argparse([*SCHEDULER, flag, value], flag)
    assert problem in line


def test_verbose_adds_the_traceback(tmp_path: Path) -> None:
    result = run([*SCHEDULER, "--port", "0", "--tokenizer", str(tmp_path / "nowhere"), "--verbose"])
    assert result.returncode == 2
    first, *rest = result.stderr.strip().splitlines()
    assert "event=scheduler_refused" in first and "no such folder" in first
    assert rest[0] == "Traceback (most recent call last):"


@pytest.mark.parametrize(
    ("flags", "problem"),
    [
        # The all-in-one scheduler's planner listens on loopback in plaintext: its own front-ends
        # could not reach it with TLS.
        (
            ["--planner-tls-ca", "ca.pem"],
            "--planner-tls-ca, --planner-tls-server-name, --planner-tls-cert and --planner-tls-key are for --role frontend",
        ),
        (
            ["--role", "frontend", "--planner", "127.0.0.1:1", "--planner-tls-server-name", "planner"],
            "--planner-tls-server-name, --planner-tls-cert and --planner-tls-key need --planner-tls-ca",
        ),
        (
            ["--role", "frontend", "--planner", "127.0.0.1:1", "--planner-tls-ca", "ca.pem", "--planner-tls-cert", "fe.pem"],
            "--planner-tls-cert and --planner-tls-key go together",
        ),
        # Client certificates on the client API would lock out every client that sends none.
        (["--tls-client-ca", "ca.pem"], "--tls-client-ca is for --role planner (its front-ends' client certificates)"),
    ],
)
def test_planner_tls_flags_where_they_cannot_work_are_refused(flags: list[str], problem: str) -> None:
    assert refused([*SCHEDULER, "--port", "0", *flags]).reason == problem


@pytest.mark.parametrize("flag", ["--api-key-file", "--admin-key-file"])
def test_client_api_keys_given_to_a_planner_are_refused(flag: str, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("a-key-long-enough-for-the-check\n")
    refusal = refused([*SCHEDULER, "--port", "0", "--role", "planner", "--insecure-planner", flag, str(keys)])
    assert refusal.reason.startswith("a planner serves no client API: give --api-key-file and --admin-key-file")


def test_a_planner_tls_ca_that_is_not_there_is_refused(tmp_path: Path) -> None:
    missing = tmp_path / "ca.pem"
    flags = ["--role", "frontend", "--planner", "127.0.0.1:1", "--planner-tls-ca", str(missing)]
    assert refused([*SCHEDULER, "--port", "0", *flags]).reason.startswith(f"cannot read the CA certificate {str(missing)!r}")
