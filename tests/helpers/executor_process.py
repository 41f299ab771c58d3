"""Starts a real executor process (python -m executor_service) for tests and waits until ready.

    from tests.helpers.executor_process import start_executor
    with start_executor(model_dir, num_kv_blocks=256) as (address, process):
        channel = grpc.insecure_channel(address)

Flags are the CLI's, with underscores: block_size=16, dtype="float32", threads=1, ...
The executor binds port 0 and the address comes from its ready log line, so parallel tests never
race for a port. Its log goes to a file whose tail is shown if it fails to start.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import grpc

from tests.helpers.executor_token import token_file, with_token
from tests.helpers.service_process import REPO_ROOT, ServiceProcess, cli_flags

READY_PATTERN = re.compile(r"event=executor_ready address=(\S+):(\d+)")
# One torch thread: test machines are small and shared, and OpenMP threads that wait for a busy
# core make every step slower than one thread alone.
DEFAULT_FLAGS: dict[str, object] = {"num_kv_blocks": 1024, "threads": 1}


def executor_command(model_dir: Path | str, **flags: object) -> list[str]:
    """Closed as executors are by default: the process's test token (executor_token.py) unless
    flags name another access (executor_token_file=None with insecure_executor=True, say)."""
    merged = {**DEFAULT_FLAGS, "executor_token_file": token_file()}
    if "kv_cache_memory" in flags:
        merged.pop("num_kv_blocks")
    merged.update(flags)
    command = [sys.executable, "-m", "executor_service", "--model", str(model_dir), "--port", "0"]
    return command + cli_flags(merged)


class ExecutorProcess(ServiceProcess):
    """An executor started in the background; wait_ready() blocks until it serves. env: changes
    to the environment it inherits (None removes a variable); tree: the source tree it runs."""

    def __init__(
        self,
        model_dir: Path | str,
        env: Mapping[str, str | None] | None = None,
        tree: Path = REPO_ROOT,
        **flags: object,
    ) -> None:
        super().__init__(executor_command(model_dir, **flags), READY_PATTERN, "executor", env, tree)


@contextmanager
def start_executor(
    model_dir: Path | str, timeout_s: float = 180.0, **flags: object
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Yields (address, process) once the executor serves; it is stopped on exit."""
    executor = ExecutorProcess(model_dir, **flags)
    try:
        yield executor.wait_ready(timeout_s), executor.process
    finally:
        executor.close()


@contextmanager
def executor_channel(model_dir: Path | str, **flags: object) -> Iterator[grpc.Channel]:
    """A channel to an executor started for the test, closed and stopped on exit."""
    with start_executor(model_dir, **flags) as (address, _):
        with grpc.insecure_channel(address) as channel:
            yield with_token(channel)
