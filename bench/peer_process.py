"""Runs one measured run of a peer in a process of its own and reads back its result file, with
the peak RSS of that process and everything it starts (bench.process_memory)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from pathlib import Path

from bench.compare_records import Measurement
from bench.peer_io import read_result
from bench.process_memory import PeakRss

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
LOG_TAIL_CHARS = 4000


class PeerFailed(RuntimeError):
    pass


def run_peer(
    command: list[str], out_path: Path, log_path: Path, timeout_s: float, env: dict[str, str] | None = None
) -> Measurement:
    """Runs command (which writes a bench.peer_io result to out_path) from the repository root,
    its output going to log_path, with env over this process's environment. Raises PeerFailed,
    with the log's tail, when it fails or runs past timeout_s (then it and its children are
    killed)."""
    extra = env or {}
    logger.info("event=peer_start command=%s env=%s log=%s", " ".join(command), extra, log_path)
    out_path.unlink(missing_ok=True)
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **extra, "PYTHONUNBUFFERED": "1"},
            # A group of its own, so a timeout ends the engine processes it spawned too.
            start_new_session=True,
        )
        with PeakRss([process.pid]) as rss:
            try:
                returncode = process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                raise PeerFailed(f"timed out after {timeout_s:.0f} s:\n{log_tail(log_path)}") from None
            finally:
                # Timed out, or this process is being stopped (SIGTERM, Ctrl-C): the peer goes too.
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
    if returncode != 0 or not out_path.is_file():
        raise PeerFailed(f"exited with {returncode}:\n{log_tail(log_path)}")
    return Measurement(read_result(out_path), rss.peak_bytes, dict(rss.by_process))


def log_tail(path: Path) -> str:
    return path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
