"""Starts a real executor process (python -m executor_service) for tests and waits until ready.

    from executor_process import start_executor
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
DEFAULT_FLAGS: dict[str, object] = {"num_kv_blocks": 1024, "threads": 2}


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


@contextmanager
def start_executor(
    model_dir: Path | str, timeout_s: float = 180.0, **flags: object
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Yields (address, process); the process is terminated (then killed) on exit."""
    log = tempfile.NamedTemporaryFile(prefix="executor-", suffix=".log", delete=False)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        executor_command(model_dir, **flags),
        cwd=REPO_ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        yield wait_until_ready(process, Path(log.name), timeout_s), process
    finally:
        stop_executor(process)
        log.close()
        os.unlink(log.name)


def wait_until_ready(process: subprocess.Popen[bytes], log_path: Path, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log_path.read_text(errors="replace")
        match = READY_PATTERN.search(text)
        if match:
            return f"{match.group(1)}:{match.group(2)}"
        if process.poll() is not None:
            raise ExecutorStartError(f"executor exited with {process.returncode}:\n{text[-4000:]}")
        time.sleep(0.1)
    raise ExecutorStartError(f"executor not ready after {timeout_s}s:\n{log_path.read_text()[-4000:]}")


def stop_executor(process: subprocess.Popen[bytes], grace_s: float = 15.0) -> int:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode
