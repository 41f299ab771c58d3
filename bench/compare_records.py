"""What one measured run of one system in the peer comparison gives."""

from __future__ import annotations

from dataclasses import dataclass, field

from bench.peer_io import RunResult


@dataclass(slots=True)
class Measurement:
    """One run of one system: what it produced and the peak RSS of its processes."""

    result: RunResult
    # bench.process_memory.PeakRss.peak_bytes
    peak_rss_bytes: int
    # "process (pid)" -> its own peak RSS.
    rss_by_process: dict[str, int] = field(default_factory=dict)
