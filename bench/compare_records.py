"""What one measured run of one system in the peer comparison gives."""

from __future__ import annotations

from dataclasses import dataclass, field

from bench.peer_io import ItlKind, RunResult, token_gaps
from bench.throughput_workload import SystemResult


@dataclass(slots=True)
class Measurement:
    """One run of one system: what it produced and the peak RSS of its processes."""

    result: RunResult
    # bench.process_memory.PeakRss.peak_bytes
    peak_rss_bytes: int
    # "process (pid)" -> its own peak RSS.
    rss_by_process: dict[str, int] = field(default_factory=dict)
    # CPU seconds over the timed run by role (SystemResult.cpu_s); splitserve's systems only.
    cpu_s: dict[str, float] = field(default_factory=dict)


def run_result_of(result: SystemResult, prompt_tokens_computed: int) -> RunResult:
    """A run timed per streamed token (splitserve, transformers generate) as a RunResult."""
    return RunResult(
        system=result.system,
        wall_s=result.wall_s,
        outputs=result.outputs,
        ttft_s=result.ttft_s,
        itl_s=[gap for times in result.token_times_s for gap in token_gaps(times)],
        itl_kind=ItlKind.PER_TOKEN,
        prompt_tokens_computed=prompt_tokens_computed,
    )
