"""Starts a real executor process (python -m executor_service) for tests and waits until ready.

    from tests.executor_process import start_executor
    with start_executor(model_dir, num_kv_blocks=256) as (address, process):
        channel = grpc.insecure_channel(address)

Flags are the CLI's, with underscores: block_size=16, dtype="float32", threads=1, ...
The executor binds port 0 and the address comes from its ready log line, so parallel tests never
race for a port. Its log goes to a file whose tail is shown if it fails to start.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
READY_PATTERN = re.compile(r"event=executor_ready address=(\S+):(\d+)")
# One torch thread: test machines are small and shared, and OpenMP threads that wait for a busy
# core make every step slower than one thread alone.
DEFAULT_FLAGS: dict[str, object] = {"num_kv_blocks": 1024, "threads": 1}


class ExecutorStartError(RuntimeError):
    pass


def executor_command(model_dir: Path | str, **flags: object) -> list[str]:
    merged = dict(DEFAULT_FLAGS)
    if "kv_cache_memory" in flags:
        merged.pop("num_kv_blocks")
    merged.update(flags)
    command = [sys.executable, "-m", "executor_service", "--model", str(model_dir), "--port", "0"]
    for name, value in merged.items():
        if value is not None:
            command += [f"--{name.replace('_', '-')}", str(value)]
    return command


class ExecutorProcess:
    """An executor started in the background; wait_ready() blocks until it serves."""

    def __init__(self, model_dir: Path | str, **flags: object) -> None:
        self._log = tempfile.NamedTemporaryFile(prefix="executor-", suffix=".log", delete=False)
        self.log_path = Path(self._log.name)
        self.process = subprocess.Popen(
            executor_command(model_dir, **flags),
            cwd=REPO_ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.address: str | None = None

    def wait_ready(self, timeout_s: float = 180.0) -> str:
        deadline = time.monotonic() + timeout_s
        while self.address is None:
            text = self.log_path.read_text(errors="replace")
            match = READY_PATTERN.search(text)
            if match:
                self.address = f"{match.group(1)}:{match.group(2)}"
            elif self.process.poll() is not None:
                raise ExecutorStartError(
                    f"executor exited with {self.process.returncode}:\n{text[-4000:]}"
                )
            elif time.monotonic() > deadline:
                raise ExecutorStartError(f"executor not ready after {timeout_s}s:\n{text[-4000:]}")
            else:
                time.sleep(0.05)
        return self.address

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, grace_s: float = 15.0) -> int:
        """SIGTERM, then SIGKILL after grace_s; returns the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def close(self) -> None:
        self.stop()
        self._log.close()
        self.log_path.unlink(missing_ok=True)


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
