"""A process's resident memory, as the kernel reports it (/proc/PID/status), for tests that bound
what a service holds."""

from __future__ import annotations

from pathlib import Path


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")
