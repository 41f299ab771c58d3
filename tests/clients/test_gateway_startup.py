"""The gateway's start-up refusals through the installed command: one line saying what is wrong
and what to do, exit 2, no traceback; and its defaults meet `splitserve run`'s scheduler."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

SPLITSERVE = str(Path(sys.executable).parent / "splitserve")


def gateway(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SPLITSERVE, "gateway", *args], capture_output=True, text=True, timeout=60)


def test_a_port_in_use_is_one_line() -> None:
    with socket.create_server(("127.0.0.1", 0)) as holder:
        port = holder.getsockname()[1]
        result = gateway("--port", str(port))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"127.0.0.1:{port} (--port) is already in use" in lines[0] and "0 picks a free port" in lines[0]


@pytest.mark.parametrize(
    ("flags", "complaint"),
    [
        (("--port", "70000"), "argument --port: must be a port within 0..65535"),
        (("--max-body-bytes", "0"), "argument --max-body-bytes: must be at least 1"),
        (("--drain-timeout", "-1"), "argument --drain-timeout: must be 0 or more"),
    ],
)
def test_a_bad_flag_is_refused_by_argparse(flags: tuple[str, ...], complaint: str) -> None:
    result = gateway(*flags)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert complaint in result.stderr.strip().splitlines()[-1], result.stderr


def test_a_missing_ca_file_is_one_line(tmp_path: Path) -> None:
    result = gateway("--port", "0", "--tls-ca", str(tmp_path / "absent.pem"))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "absent.pem" in lines[0], result.stderr


def test_the_defaults_meet_the_scheduler_run_starts() -> None:
    text = " ".join(subprocess.run([SPLITSERVE, "gateway", "--help"], capture_output=True, text=True, timeout=60).stdout.split())
    assert "--port PORT HTTP port (0: any free one) (default: 8000)" in text
    assert "(default: 127.0.0.1:50051)" in text


def test_a_budget_below_the_body_cap_is_one_line() -> None:
    result = gateway("--port", "0", "--max-body-bytes", "2048", "--max-body-bytes-in-flight", "1024")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "--max-body-bytes-in-flight (1,024) is below --max-body-bytes (2,048)" in lines[0]
