"""`make run`'s launcher, run for real: prepared model, executor, scheduler, CLI client.

Every run uses port 0 for both services and the metrics endpoint, so tests never race for the
fixed default ports (or for a `make run` the developer has open).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from executor_service.prepare_model import COMPLETE_MARKER
from tests.helpers.launcher_output import LauncherOutput
from tests.helpers.service_process import is_running

REPO_ROOT = Path(__file__).resolve().parents[2]
CHILD_PID = re.compile(r"event=child_started name=(\w+) pid=(\d+)")


def launcher_command(cache_dir: Path, log_dir: Path, *extra: str) -> list[str]:
    # The installed command, as `make run` runs it.
    return [
        str(Path(sys.executable).parent / "splitserve"),
        "run",
        "--port",
        "0",
        "--executor-port",
        "0",
        "--metrics-port",
        "0",
        "--gateway-port",
        "0",
        "--threads",
        "1",
        "--cache-dir",
        str(cache_dir),
        "--log-dir",
        str(log_dir),
        *extra,
    ]


def child_pids(stderr: str) -> dict[str, int]:
    return {name: int(pid) for name, pid in CHILD_PID.findall(stderr)}


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_once_answers_the_question(prepared_model: Path, tmp_path: Path) -> None:
    started = time.monotonic()
    result = subprocess.run(
        launcher_command(prepared_model, tmp_path, "--once"),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    # Greedy SmolLM2-135M-Instruct: "The capital of France is Paris."
    assert "Paris" in result.stdout, result.stdout
    pids = child_pids(result.stderr)
    assert set(pids) == {"executor", "scheduler", "gateway"}
    assert not any(is_alive(pid) for pid in pids.values())
    assert (tmp_path / "executor.log").is_file() and (tmp_path / "scheduler.log").is_file()
    print(f"launcher --once took {time.monotonic() - started:.1f} s")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_signal_stops_both_services_and_exits_zero(
    prepared_model: Path, tmp_path: Path, signum: signal.Signals
) -> None:
    stderr_path = tmp_path / "launcher.err"
    with stderr_path.open("w") as stderr_file:
        process = subprocess.Popen(
            launcher_command(prepared_model, tmp_path, "--question", "Say hello."),
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=stderr_file,
            text=True,
        )
    output = LauncherOutput(process)
    try:
        stdout = output.until_banner(timeout_s=180)
        assert "splitserve is running" in stdout
        # The banner tells users what to run against the services it names.
        address = re.search(r"scheduler\s+(127\.0\.0\.1:\d+)", stdout)
        assert address is not None, stdout
        assert f"--server {address.group(1)}" in stdout
        # What it suggests is installed: the splitserve command beside this Python.
        assert f"{Path(sys.executable).parent / 'splitserve'} generate --server" in stdout
        gateway = re.search(r"gateway\s+(http://127\.0\.0\.1:\d+/v1)", stdout)
        assert gateway is not None, stdout
        with urllib.request.urlopen(f"{gateway.group(1)}/models", timeout=30) as reply:
            assert json.loads(reply.read())["data"][0]["id"] == prepared_model.name
        process.send_signal(signum)
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        output.close()
    stderr = stderr_path.read_text()
    assert process.returncode == 0, stderr[-4000:]
    pids = child_pids(stderr)
    assert set(pids) == {"executor", "scheduler", "gateway"}
    assert not any(is_alive(pid) for pid in pids.values())
    # Both services shut down on their own SIGTERM, within the grace period.
    assert "event=child_killed" not in stderr
    assert re.search(r"event=child_stopped name=executor status=0", stderr), stderr[-4000:]
    assert re.search(r"event=child_stopped name=scheduler status=0", stderr), stderr[-4000:]
    assert re.search(r"event=child_stopped name=gateway status=0", stderr), stderr[-4000:]


@pytest.mark.parametrize("verbose", [False, True], ids=["quiet", "verbose"])
def test_service_dying_during_start_says_why(tmp_path: Path, verbose: bool) -> None:
    # A folder marked prepared whose config is not a model: prepare_model trusts the marker,
    # and the executor refuses it.
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / COMPLETE_MARKER).write_text("test\n")
    (broken / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    extra = ("--once", "-v") if verbose else ("--once",)
    result = subprocess.run(
        launcher_command(broken, tmp_path / "logs", *extra),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert "event=child_failed" in result.stderr
    log = tmp_path / "logs" / "executor.log"
    if verbose:
        assert f"last lines of {log}" in result.stderr
    else:
        # The executor's own refusal, one line under the launcher's, and where the rest is.
        assert f"last lines of {log}" not in result.stderr and "Traceback" not in result.stderr
        error = result.stderr[result.stderr.index("error: executor exited") :].splitlines()
        assert str(log) in error[0] and "event=executor_refused" in error[1], result.stderr[-2000:]
    # The scheduler is never started without a ready executor.
    assert set(child_pids(result.stderr)) == {"executor"}


def test_fixed_port_in_use_is_refused_before_anything_starts(tmp_path: Path) -> None:
    # A listener without SO_REUSEPORT stands in for an earlier launch still serving.
    with socket.create_server(("127.0.0.1", 0)) as holder:
        port = holder.getsockname()[1]
        command = launcher_command(tmp_path / "never-prepared", tmp_path / "logs", "--once")
        command[command.index("--port") + 1] = str(port)
        result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert f"127.0.0.1:{port} (--port) is already in use" in result.stderr
    assert child_pids(result.stderr) == {}
    assert not (tmp_path / "never-prepared").exists()


def test_a_launcher_killed_with_sigkill_takes_its_services_with_it(prepared_model: Path, tmp_path: Path) -> None:
    """The services run in sessions of their own, so no signal reaches them from a terminal;
    each asks to end with the launcher (service_support/parent_death.py)."""
    stderr_path = tmp_path / "launcher.err"
    with stderr_path.open("w") as stderr_file:
        process = subprocess.Popen(
            launcher_command(prepared_model, tmp_path, "--question", "Say hello."),
            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=stderr_file, text=True,
        )
    output = LauncherOutput(process)
    try:
        output.until_banner(timeout_s=180)
        pids = child_pids(stderr_path.read_text())
        assert set(pids) == {"executor", "scheduler", "gateway"}
        process.kill()
        process.wait(timeout=60)
        deadline = time.monotonic() + 30
        while any(is_running(pid) for pid in pids.values()):
            assert time.monotonic() < deadline, {name: is_running(pid) for name, pid in pids.items()}
            time.sleep(0.2)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        output.close(timeout_s=10)
