"""What a replay of one configuration comes to: latency percentiles, throughput, preemptions
and KV use over every executor's timeline."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from scheduler_service.replay.simulate import Replayed


@dataclass(slots=True, frozen=True)
class Summary:
    label: str
    requests: int
    ttft_p50_s: float
    ttft_p99_s: float
    # Seconds between a request's token and its previous one (one figure per request and step).
    itl_p50_s: float
    itl_p99_s: float
    e2e_p50_s: float
    e2e_p99_s: float
    output_tokens_per_s: float
    preemptions: int
    kv_usage_mean: float
    kv_usage_max: float
    steps: int
    # Leading steps equal to the recorded schedule, of the recorded steps.
    matched_steps: int
    recorded_steps: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(label: str, replays: Sequence[Replayed]) -> Summary:
    ttft = [r.first_token_s[i] - r.arrival_s[i] for r in replays for i in r.first_token_s if i in r.arrival_s]
    e2e = [r.finished_s[i] - r.arrival_s[i] for r in replays for i in r.finished_s if i in r.arrival_s]
    gaps = [gap for r in replays for gap in r.token_gaps]
    arrivals = [t for r in replays for t in r.arrival_s.values()]
    ends = [t for r in replays for t in r.finished_s.values()]
    span = (max(ends) - min(arrivals)) if ends and arrivals else 0.0
    outputs = sum(sum(r.outputs.values()) for r in replays)
    usage = [s.kv_used_blocks / r.config.num_kv_blocks for r in replays for s in r.steps]
    return Summary(
        label=label,
        requests=sum(len(r.arrival_s) for r in replays),
        ttft_p50_s=_percentile(ttft, 50), ttft_p99_s=_percentile(ttft, 99),
        itl_p50_s=_percentile(gaps, 50), itl_p99_s=_percentile(gaps, 99),
        e2e_p50_s=_percentile(e2e, 50), e2e_p99_s=_percentile(e2e, 99),
        output_tokens_per_s=outputs / span if span > 0 else 0.0,
        preemptions=sum(r.steps[-1].preemptions for r in replays if r.steps),
        kv_usage_mean=float(np.mean(usage)) if usage else 0.0,
        kv_usage_max=max(usage, default=0.0),
        steps=sum(len(r.steps) for r in replays),
        matched_steps=sum(r.matched_steps for r in replays),
        recorded_steps=sum(r.num_recorded_steps for r in replays),
    )


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0
