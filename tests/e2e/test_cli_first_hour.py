"""The command-line client as a new user meets it, through the installed `splitserve` command
against real services: -v after the subcommand, logs apart from the text, bad flags in one line,
`status` with no executor up, and a request no executor can take failing with UNAVAILABLE that
says why instead of waiting without end."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from protos.splitserve.v1 import admin_pb2, admin_pb2_grpc
from tests.helpers.executor_process import start_executor
from tests.helpers.model_factory import build_model
from tests.helpers.scheduler_process import SchedulerProcess, start_scheduler
from tests.helpers.service_process import free_port
from tests.helpers.tokenizer_assets import gpt2_tokenizer_dir

SPLITSERVE = str(Path(sys.executable).parent / "splitserve")
# GPT-2's tokenizer: the random model's vocabulary must hold every id it makes.
VOCAB_SIZE = 50_257
NO_EXECUTOR_TIMEOUT_S = 3


def splitserve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SPLITSERVE, *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def model_and_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("cli")
    model = build_model("llama", folder / "llama", seed=5, vocab_size=VOCAB_SIZE)
    return model, gpt2_tokenizer_dir(folder / "tokenizer")


@pytest.fixture(scope="module")
def stack(model_and_tokenizer: tuple[Path, Path]) -> Iterator[tuple[str, str]]:
    """(scheduler, executor) addresses, the scheduler failing unplaceable requests after 3 s."""
    model, tokenizer = model_and_tokenizer
    with start_executor(model, num_kv_blocks=256) as (executor, _):
        with start_scheduler(
            executor, tokenizer=tokenizer, no_executor_timeout=NO_EXECUTOR_TIMEOUT_S
        ) as scheduler:
            yield scheduler, executor


def test_verbose_after_the_subcommand_logs_to_stderr_apart_from_the_text(stack: tuple[str, str]) -> None:
    scheduler, _ = stack
    result = splitserve("generate", "-v", "--server", scheduler, "Hello", "--max-tokens", "5", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    # stdout is the generated text and its newline, nothing else.
    assert result.stdout.endswith("\n") and result.stdout.count("\n") <= 5
    assert "finish_reason" not in result.stdout
    log = [line for line in result.stderr.splitlines() if "event=generated" in line]
    assert len(log) == 1 and "finish_reason=length" in log[0], result.stderr


@pytest.mark.parametrize(
    ("flags", "complaint"),
    [
        (("--max-tokens", "-5"), "--max-tokens: must be at least 0, got -5"),
        (("--max-tokens", "lots"), "--max-tokens: 'lots' is not a whole number"),
        (("--top-k", "-1"), "--top-k: must be at least 0, got -1"),
    ],
)
def test_a_bad_flag_is_one_line_and_status_2(flags: tuple[str, ...], complaint: str) -> None:
    # Refused before any connection: the server address does not matter.
    result = splitserve("generate", "--server", "127.0.0.1:1", "Hi", *flags)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert complaint in result.stderr.splitlines()[-1], result.stderr


def test_a_value_the_client_library_refuses_is_one_line(stack: tuple[str, str]) -> None:
    scheduler, _ = stack
    result = splitserve("generate", "--server", scheduler, "Hi", "--temperature", "-3")
    assert result.returncode in (1, 2), result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "temperature" in lines[0], result.stderr


def test_the_server_defaults_to_the_one_splitserve_run_starts() -> None:
    help_text = splitserve("generate", "--help").stdout
    assert "127.0.0.1:50051" in " ".join(help_text.split())


def test_status_with_no_executor_reached_prints_what_the_server_knows(tmp_path: Path) -> None:
    nowhere = f"127.0.0.1:{free_port()}"
    scheduler = SchedulerProcess(nowhere, wait_for="listening")
    try:
        address = scheduler.wait_ready(timeout_s=60.0)
        result = splitserve("status", "--server", address)
    finally:
        scheduler.close()
    assert result.returncode == 0, result.stderr
    assert '"model": null' in result.stdout
    assert "no executor has been reached yet" in result.stdout and nowhere in result.stdout
    assert '"executors"' in result.stdout and nowhere in result.stdout


def test_a_request_no_executor_can_take_fails_fast_naming_why(stack: tuple[str, str]) -> None:
    scheduler, executor = stack
    with grpc.insecure_channel(scheduler) as channel:
        admin = admin_pb2_grpc.AdminStub(channel)
        admin.DrainExecutor(admin_pb2.DrainExecutorRequest(address=executor), timeout=30)
        try:
            # Bounded: the subprocess timeout is many times the scheduler's wait.
            result = splitserve("generate", "--server", scheduler, "Hi", "--max-tokens", "4", timeout=60)
        finally:
            admin.ResumeExecutor(admin_pb2.ResumeExecutorRequest(address=executor), timeout=30)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: UNAVAILABLE: no executor could take the request")
    assert f"{executor} is drained" in lines[0] and "ResumeExecutor" in lines[0]
    # Resumed, it serves again.
    again = splitserve("generate", "--server", scheduler, "Hi", "--max-tokens", "3", timeout=120)
    assert again.returncode == 0, again.stderr
