"""Runs a service command that must refuse to start, and reads its one-line refusal.

    refusal = refused([*EXECUTOR, "--model", "/nowhere"])
    assert "no such folder" in refusal.reason
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from service_support.log_format import message_fields
from tests.helpers.executor_token import token_file
from tests.helpers.service_process import REPO_ROOT

SPLITSERVE = str(Path(sys.executable).parent / "splitserve")
# Each service through the installed command and through its module, as users start them; an
# executor is closed by default, so it is given the tests' token to get past that refusal.
_EXECUTOR_ACCESS = ["--executor-token-file", str(token_file())]
EXECUTOR = [SPLITSERVE, "executor", *_EXECUTOR_ACCESS]
EXECUTOR_MODULE = [sys.executable, "-m", "executor_service", *_EXECUTOR_ACCESS]
SCHEDULER = [SPLITSERVE, "scheduler"]
SCHEDULER_MODULE = [sys.executable, "-m", "scheduler_service"]


@dataclass(slots=True, frozen=True)
class Refusal:
    status: int
    # The only line on stderr, and its key=value fields.
    line: str
    fields: dict[str, object]

    @property
    def reason(self) -> str:
        return str(self.fields["reason"])


def run(command: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=180)


def refused(command: list[str], status: int = 2) -> Refusal:
    """The refusal of a command that must exit with status, one line on stderr, no traceback."""
    result = run(command)
    assert result.returncode == status, result.stderr[-3000:]
    assert result.stdout == "", result.stdout[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr[-3000:]
    assert "level=ERROR" in lines[0], lines[0]
    return Refusal(result.returncode, lines[0], message_fields(lines[0]))


def refused_by_argparse(command: list[str], flag: str) -> str:
    """argparse's `error:` line for flag (after its usage), exit status 2, no traceback."""
    result = run(command)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert f"error: argument {flag}: " in last, result.stderr[-3000:]
    return last


@contextmanager
def listener() -> Iterator[int]:
    """A port something listens on (without SO_REUSEPORT, as a running service would)."""
    with socket.create_server(("127.0.0.1", 0)) as held:
        yield int(held.getsockname()[1])
