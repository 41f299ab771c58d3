"""What a multi-tenant replay comes to, per tenant: requests and those rejected at arrival, TTFT
and TPOT percentiles, SLO attainment, token throughput; and Jain's fairness index of the
tenants' token throughput per unit of weight.

Fair queuing can equalise what tenants get only while each of them asks for more than it gets:
a tenant whose requests all run at once gets what it asks for, however little. So Jain's index is
measured over the window in which every tenant has requests waiting (arrived, not yet admitted
to a batch), over the tokens steps computed in it (prompt tokens and decodes, as the fair
policy charges them); no such window, no index. Throughput over the whole run is reported
beside it.

TPOT is a request's time per output token after its first: (end - first token) / (outputs - 1).
SLO attainment is over the requests admitted that carried the target: first token within the
TTFT deadline of arrival; TPOT within the per-token target (a one-token answer meets it).
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from scheduler_service.core.request import Request
from scheduler_service.replay.fleet import FleetRun

# The row of every tenant together.
ALL = "all"


@dataclass(slots=True, frozen=True)
class TenantFigures:
    tenant: str
    weight: float
    # Requests that arrived, and of those the ones refused at arrival.
    requests: int
    rejected: int
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    # Share of admitted requests with the target that met it; None: none had one.
    ttft_met: float | None
    tpot_met: float | None
    # Output tokens per second over the run (first arrival to last end).
    output_tokens_per_s: float
    # Tokens computed per second in the window in which every tenant had requests waiting.
    backlogged_tokens_per_s: float


@dataclass(slots=True, frozen=True)
class TenantReport:
    label: str
    tenants: list[TenantFigures]
    total: TenantFigures
    # Jain's index of backlogged_tokens_per_s / weight over the tenants; None: no window.
    jain_index: float | None
    # Seconds in which every tenant had requests waiting.
    backlogged_s: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def tenant_report(label: str, run: FleetRun, weight_of: Callable[[str], float], tenants: Sequence[str]) -> TenantReport:
    """tenants: every tenant of the trace, in the order to report them."""
    refused = {id(request) for request, _ in run.refused}
    admitted = [r for r in run.requests if id(r) not in refused]
    window = _intersection([_union([(r.arrival_time, _admitted_at(r)) for r in admitted if r.tenant == t]) for t in tenants])
    backlogged_s = sum(end - start for start, end in window)
    served: Counter[str] = Counter()
    starts = [start for start, _ in window]
    for replayed in run.replays:
        for step in replayed.steps:
            slot = bisect.bisect_right(starts, step.done_s) - 1
            if slot >= 0 and step.done_s <= window[slot][1]:
                served.update(step.served)
    arrivals = [r.arrival_time for r in run.requests]
    ends = [r.finish_time for r in admitted if r.finish_time is not None]
    span = max(ends) - min(arrivals) if ends and arrivals else 0.0
    figures = [
        _figures(t, weight_of(t), [r for r in run.requests if r.tenant == t], refused, span, served[t], backlogged_s)
        for t in tenants
    ]
    total = _figures(ALL, sum(weight_of(t) for t in tenants), run.requests, refused, span, sum(served.values()), backlogged_s)
    shares = [f.backlogged_tokens_per_s / f.weight for f in figures]
    squares = sum(x * x for x in shares)
    jain = sum(shares) ** 2 / (len(shares) * squares) if backlogged_s > 0 and squares > 0 else None
    return TenantReport(label, figures, total, jain, backlogged_s)


def _figures(
    tenant: str, weight: float, requests: list[Request], refused: set[int], span: float, served: int, backlogged_s: float
) -> TenantFigures:
    admitted = [r for r in requests if id(r) not in refused]
    started = [r for r in admitted if r.first_token_time is not None]
    ttft = [r.first_token_time - r.arrival_time for r in started]
    tpot = [_tpot(r) for r in started if r.finish_time is not None and r.num_output_tokens > 1]
    with_deadline = [r for r in admitted if r.ttft_deadline_s]
    with_target = [r for r in admitted if r.tpot_target_s]
    return TenantFigures(
        tenant, weight, len(requests), len(requests) - len(admitted),
        _percentile(ttft, 50), _percentile(ttft, 99), _percentile(tpot, 50), _percentile(tpot, 99),
        _share(with_deadline, lambda r: r.first_token_time is not None and r.first_token_time <= r.ttft_deadline),
        _share(with_target, lambda r: r.finish_time is not None and (r.num_output_tokens <= 1 or _tpot(r) <= r.tpot_target_s)),
        sum(r.num_output_tokens for r in admitted) / span if span > 0 else 0.0,
        served / backlogged_s if backlogged_s > 0 else 0.0,
    )


def _tpot(request: Request) -> float:
    assert request.finish_time is not None and request.first_token_time is not None
    return (request.finish_time - request.first_token_time) / (request.num_output_tokens - 1)


def _admitted_at(request: Request) -> float:
    """When it stopped waiting: its first admission to a batch (else its end)."""
    for t in (request.first_scheduled_time, request.finish_time):
        if t is not None:
            return t
    return request.arrival_time


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _intersection(unions: list[list[tuple[float, float]]]) -> list[tuple[float, float]]:
    common = unions[0] if unions else []
    for other in unions[1:]:
        both, i, j = [], 0, 0
        while i < len(common) and j < len(other):
            start, end = max(common[i][0], other[j][0]), min(common[i][1], other[j][1])
            if start < end:
                both.append((start, end))
            if common[i][1] < other[j][1]:
                i += 1
            else:
                j += 1
        common = both
    return common


def _share(requests: list[Request], met: Callable[[Request], bool]) -> float | None:
    return sum(1 for r in requests if met(r)) / len(requests) if requests else None


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def markdown_table(reports: Sequence[TenantReport]) -> str:
    """One row per configuration and tenant, then one of all tenants with Jain's index."""
    lines = [
        (
            "| configuration | tenant | weight | requests | rejected | TTFT p50 s | TTFT p99 s | TPOT p50 ms | TPOT p99 ms "
            "| TTFT met | TPOT met | out tok/s | tok/s all waiting | Jain (all waiting) |"
        ),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for report in reports:
        for row in (*report.tenants, report.total):
            jain = ""
            if row is report.total:
                jain = f"{report.jain_index:.3f} over {report.backlogged_s:.1f} s" if report.jain_index is not None else "no window"
            lines.append(
                f"| {report.label} | {row.tenant} | {row.weight:g} | {row.requests} | {row.rejected} "
                f"| {row.ttft_p50_s:.3f} | {row.ttft_p99_s:.3f} | {row.tpot_p50_s * 1e3:.1f} | {row.tpot_p99_s * 1e3:.1f} "
                f"| {_percent(row.ttft_met)} | {_percent(row.tpot_met)} | {row.output_tokens_per_s:.1f} "
                f"| {row.backlogged_tokens_per_s:.1f} | {jain} |"
            )
    return "\n".join(lines)


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{share:.1%}"
