"""A process's resident memory, as the kernel reports it (/proc/PID/status), for tests that bound
what a service holds."""

from __future__ import annotations

from pathlib import Path


def rss_bytes(pid: int) -> int:
    return _status_bytes(pid, "VmRSS")


def peak_rss_bytes(pid: int) -> int:
    """The most the process has held resident since it started, or since reset_peak."""
    return _status_bytes(pid, "VmHWM")


def reset_peak(pid: int) -> None:
    """Sets the process's peak resident size to its current one (proc(5), clear_refs)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def _status_bytes(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for process {pid}")
