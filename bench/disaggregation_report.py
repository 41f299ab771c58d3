"""bench.disaggregation's records and report: one configuration's figures per run, their
medians over the runs, and the tables printed."""

from __future__ import annotations

import math
import os
import statistics
from dataclasses import dataclass

import numpy as np

from bench.disaggregation_load import LoadShape
from bench.disaggregation_services import (
    DISAGGREGATED,
    MIXED,
    Configuration,
    TransferFigures,
)


@dataclass(slots=True, frozen=True)
class Measurement:
    """One configuration in one run."""

    configuration: str
    run: int
    steady_gap_p50_s: float
    steady_gap_p99_s: float
    steady_gap_max_s: float
    long_ttft_p50_s: float
    long_ttft_p99_s: float
    steady_tokens_per_s: float
    long_prompts: int
    sent: int
    completed: int
    during_load: TransferFigures
    # A only: long prompts one after the other, each move alone.
    alone: TransferFigures | None


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


@dataclass(slots=True, frozen=True)
class TransferSummary:
    """Moves summed over the runs; the rest, the median over the runs that moved any."""

    moves: int
    failed_moves: int
    mb_per_move: float
    kb_per_token: float
    gb_per_s: float
    executor_gb_per_s: float


def summarize_transfers(figures: list[TransferFigures]) -> TransferSummary:
    moved = [f for f in figures if f.moves]
    return TransferSummary(
        moves=sum(f.moves for f in figures),
        failed_moves=sum(f.failed_moves for f in figures),
        mb_per_move=_median([f.bytes_per_move / 1e6 for f in moved]),
        kb_per_token=_median([f.bytes_per_token / 1e3 for f in moved]),
        gb_per_s=_median([f.gb_per_s for f in moved]),
        executor_gb_per_s=_median([f.executor_gb_per_s for f in moved]),
    )


@dataclass(slots=True, frozen=True)
class LatencySummary:
    """One configuration: medians over its runs; counts summed over them."""

    configuration: str
    steady_gap_p50_ms: float
    steady_gap_p99_ms: float
    steady_gap_max_ms: float
    long_ttft_p50_s: float
    long_ttft_p99_s: float
    steady_tokens_per_s: float
    long_prompts: int
    moves: int
    sent: int
    completed: int


def summarize_latency(configuration: Configuration, runs: list[Measurement]) -> LatencySummary:
    return LatencySummary(
        configuration=f"{configuration.name}: {configuration.description}",
        steady_gap_p50_ms=_median([m.steady_gap_p50_s for m in runs]) * 1e3,
        steady_gap_p99_ms=_median([m.steady_gap_p99_s for m in runs]) * 1e3,
        steady_gap_max_ms=_median([m.steady_gap_max_s for m in runs]) * 1e3,
        long_ttft_p50_s=_median([m.long_ttft_p50_s for m in runs]),
        long_ttft_p99_s=_median([m.long_ttft_p99_s for m in runs]),
        steady_tokens_per_s=_median([m.steady_tokens_per_s for m in runs]),
        long_prompts=sum(m.long_prompts for m in runs),
        moves=sum(m.during_load.moves for m in runs),
        sent=sum(m.sent for m in runs),
        completed=sum(m.completed for m in runs),
    )


@dataclass(slots=True, frozen=True)
class Report:
    model: str
    cpu_cores: int
    shape: LoadShape
    runs: int
    # K/V moves of A: long prompts one by one, and during its load.
    transfer_alone: TransferSummary
    transfer_during_load: TransferSummary
    latency: list[LatencySummary]
    measurements: list[Measurement]


def summarize(model: str, shape: LoadShape, runs: int, measurements: list[Measurement]) -> Report:
    a = [m for m in measurements if m.configuration == DISAGGREGATED.name]
    return Report(
        model=model,
        cpu_cores=os.cpu_count() or 0,
        shape=shape,
        runs=runs,
        transfer_alone=summarize_transfers([m.alone for m in a if m.alone is not None]),
        transfer_during_load=summarize_transfers([m.during_load for m in a]),
        latency=[
            summarize_latency(c, [m for m in measurements if m.configuration == c.name]) for c in (DISAGGREGATED, MIXED)
        ],
        measurements=measurements,
    )


def _transfer_row(label: str, t: TransferSummary, kv_kb_per_token: float) -> str:
    return (
        f"| {label} | {t.moves} | {t.failed_moves} | {t.mb_per_move:.2f} | {t.kb_per_token:.1f} | {kv_kb_per_token:.1f} "
        f"| {t.gb_per_s:.2f} | {t.executor_gb_per_s:.2f} |"
    )


def format_report(report: Report, kv_bytes_per_token: int) -> str:
    shape, kv_kb = report.shape, kv_bytes_per_token / 1e3
    lines = [
        f"model: {report.model}; {report.cpu_cores} CPU cores shared by both executors (--threads 1 each), the "
        "scheduler and this client: the prefill executor's long forwards and the decode executor compete for the "
        "same cores, which colours the comparison",
        "",
        f"K/V moved between the two executors of A over loopback (median of {report.runs} runs; moves summed over them):",
        "| when | moves | failed | MB per move | KB per token | model KV KB per token | GB/s (scheduler) | GB/s (executor) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        _transfer_row(f"{shape.long_prompt_tokens}-token prompts one by one", report.transfer_alone, kv_kb),
        _transfer_row("during A's load below", report.transfer_during_load, kv_kb),
        "GB/s: bytes over the moves' summed seconds; scheduler: from the destination told to fetch to the blocks "
        "written; executor: from the plan that asked for the import to the blocks written",
        "",
        f"{shape.steady_streams} steady streams ({shape.steady_prompt_tokens}-token prompts, "
        f"{shape.steady_max_tokens} new tokens, re-sent as they end) while a {shape.long_prompt_tokens}-token prompt "
        f"({shape.long_max_tokens} new tokens) arrives every {shape.arrival_s:g} s for {shape.duration_s:g} s; "
        f"client-side times, median of {report.runs} runs, A and B alternately:",
        "| configuration | steady gap p50 ms | steady gap p99 ms | steady gap max ms | long TTFT p50 s "
        "| long TTFT p99 s | steady tok/s | long prompts | K/V moves | requests completed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in report.latency:
        lines.append(
            f"| {s.configuration} | {s.steady_gap_p50_ms:.1f} | {s.steady_gap_p99_ms:.1f} | {s.steady_gap_max_ms:.0f} "
            f"| {s.long_ttft_p50_s:.2f} | {s.long_ttft_p99_s:.2f} | {s.steady_tokens_per_s:.1f} | {s.long_prompts} "
            f"| {s.moves} | {s.completed}/{s.sent} |"
        )
    return "\n".join(lines)
