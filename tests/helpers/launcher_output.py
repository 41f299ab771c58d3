"""What `splitserve run` and `splitserve serve` print, read on a thread so that a test can wait
for the banner with a deadline while the launcher keeps running.

    output = LauncherOutput(process)          # process started with stdout=PIPE, text=True
    banner = output.until_banner(timeout_s=180)
    ...
    output.close()
"""

from __future__ import annotations

import queue
import re
import subprocess
import threading
import time

# The last line of the banner printed once every service serves.
BANNER_END = re.compile(r"status --server \S+\n")


class LauncherOutput:
    def __init__(self, process: subprocess.Popen[str]) -> None:
        self._process = process
        self._lines: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=self._forward, daemon=True)
        self._reader.start()

    def _forward(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            self._lines.put(line)

    def until_banner(self, timeout_s: float) -> str:
        """Everything printed up to the banner's last line; fails if the launcher exits first
        or the banner takes longer than timeout_s."""
        stdout = ""
        deadline = time.monotonic() + timeout_s
        while not BANNER_END.search(stdout):
            assert time.monotonic() < deadline and self._process.poll() is None, stdout
            try:
                stdout += self._lines.get(timeout=0.5)
            except queue.Empty:
                continue
        return stdout

    def close(self, timeout_s: float | None = None) -> None:
        """Waits for the reader (the launcher's stdout closed)."""
        self._reader.join(timeout_s)
