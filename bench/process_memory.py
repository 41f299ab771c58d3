"""Peak resident memory of a system's processes (given ones and all their descendants).

Every interval (and once more at the end) each live process's own high-water mark is read
(VmHWM in /proc/PID/status: the most RSS it ever held, model loading included) and the marks of
the processes alive together are summed; the peak is the largest such sum. Exact for one
process; for several an upper bound on their joint peak (their own peaks need not coincide),
while short-lived helpers that never overlap (a compiler run at start) are not added up. A child
that exits early (vLLM's engine core) counts up to its last sample. Linux only.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import psutil

SAMPLE_INTERVAL_S = 0.2


def high_water_mark(pid: int) -> int | None:
    """Bytes of the process's VmHWM; None once it has gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return None


def process_name(pid: int) -> str:
    try:
        command = psutil.Process(pid).cmdline()
    except psutil.Error:
        return f"pid {pid}"
    # "python -m bench.peer_transformers ..." reads best as its module.
    if "-m" in command[:-1]:
        return command[command.index("-m") + 1]
    return " ".join(command[:2]) or f"pid {pid}"


@dataclass(slots=True)
class PeakRss:
    """with PeakRss([pid]) as rss: ... then rss.peak_bytes, rss.by_process."""

    roots: list[int]
    interval_s: float = SAMPLE_INTERVAL_S
    # The largest sum of the high-water marks of processes alive at one sample.
    peak_bytes: int = 0
    # "name (pid)" -> the highest VmHWM seen, for every process that was sampled.
    by_process: dict[str, int] = field(default_factory=dict)
    _names: dict[int, str] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> PeakRss:
        self.sample()
        self._thread = threading.Thread(target=self._run, name="peak-rss", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        alive = 0
        for pid in self._tree():
            mark = high_water_mark(pid)
            if mark is None:
                continue
            alive += mark
            if pid not in self._names:
                self._names[pid] = f"{process_name(pid)} ({pid})"
            key = self._names[pid]
            self.by_process[key] = max(mark, self.by_process.get(key, 0))
        self.peak_bytes = max(self.peak_bytes, alive)

    def _tree(self) -> list[int]:
        pids = list(self.roots)
        for root in self.roots:
            try:
                pids += [child.pid for child in psutil.Process(root).children(recursive=True)]
            except psutil.Error:
                continue
        return pids
