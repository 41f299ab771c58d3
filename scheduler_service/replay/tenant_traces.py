"""Synthesised multi-tenant traces: Poisson arrivals per tenant at its request rate, heavy-tailed
prompt and output lengths (lognormal about a median, capped), each tenant's priority, TTFT
deadline and per-token target on its requests. Seeded: the same arguments give the same trace,
and each tenant's draws are its own (adding a tenant changes no other's requests).

A tenant is written NAME:key=value[:key=value...], tenants separated by commas, e.g.
`a:rate=40,b:rate=4:weight=2:ttft_ms=2000`. Keys: rate (requests per second, required), weight
(its share under the fair policy, default 1), priority (lower runs first under the priority
policy, default 0), ttft_ms (its requests' TTFT deadline, 0: none), tpot_ms (their per-token
target, 0: none), prompt and output (median lengths in tokens, default the trace's).

A request stops at an EOS after its drawn output length; its max_tokens is the output cap, as a
client that does not know how long the answer will be sets it, so deadline admission forecasts
with the mean output it has seen, not the length drawn.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from scheduler_service.core.config import SchedulingKnobs
from scheduler_service.core.policy import Policy, StepMode
from scheduler_service.core.tenants import check_tenant_name
from scheduler_service.replay.trace_reader import TracedRequest

_KEYS = ("rate", "weight", "priority", "ttft_ms", "tpot_ms", "prompt", "output")

# The executors a synthesised trace is replayed on: their block size, and the knobs that
# --policy, --mode, --max-num-batched-tokens and --max-num-seqs do not set.
SYNTHETIC_BLOCK_SIZE = 16
SYNTHETIC_KNOBS = SchedulingKnobs(Policy.FCFS, StepMode.MIXED, max_num_batched_tokens=2048, max_num_seqs=16)
# Their step time in milliseconds: overhead, per prefill token, per decode token.
DEFAULT_STEP_COST_MS = (10.0, 0.05, 0.1)
# The default trace: two tenants at 10:1 request rates and equal weights. One such executor
# serves about 11 requests a second of the default lengths, so b alone asks for about 0.7 of
# it, more than its half share, and a for seven times it: both are backlogged while requests
# arrive, the window in which fair queuing can equalise them.
DEFAULT_TENANTS = "a:rate=80,b:rate=8"


@dataclass(slots=True, frozen=True)
class Lengths:
    """Token lengths: lognormal about the median with this sigma, between 1 and the cap."""

    prompt_median: int = 128
    output_median: int = 64
    max_prompt: int = 1024
    max_output: int = 512
    sigma: float = 1.0


@dataclass(slots=True, frozen=True)
class TenantLoad:
    name: str
    # Requests per second (Poisson).
    rate: float
    weight: float = 1.0
    priority: int = 0
    ttft_ms: float = 0.0
    tpot_ms: float = 0.0
    # Median lengths; None: the trace's (Lengths).
    prompt: int | None = None
    output: int | None = None


def parse_tenants(spec: str) -> list[TenantLoad]:
    """The tenants a spec names (see the module's docstring); ValueError saying what is wrong."""
    tenants: list[TenantLoad] = []
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        name, *pairs = item.split(":")
        check_tenant_name(name)
        if any(t.name == name for t in tenants):
            raise ValueError(f"tenant {name!r} is named twice")
        values: dict[str, float] = {}
        for pair in pairs:
            key, equals, value = pair.partition("=")
            if key not in _KEYS or not equals:
                raise ValueError(f"tenant {name!r}: {pair!r} is not key=value with a key of {', '.join(_KEYS)}")
            try:
                values[key] = float(value)
            except ValueError:
                raise ValueError(f"tenant {name!r}: {key} must be a number, got {value!r}") from None
        if not values.get("rate", 0) > 0:
            raise ValueError(f"tenant {name!r} needs rate=N, requests per second (> 0)")
        if values.get("weight", 1.0) <= 0 or min(values.get(k, 0) for k in ("ttft_ms", "tpot_ms")) < 0:
            raise ValueError(f"tenant {name!r}: weight must be > 0, ttft_ms and tpot_ms >= 0")
        if min(values.get(k, 1) for k in ("prompt", "output")) < 1:
            raise ValueError(f"tenant {name!r}: prompt and output must be at least 1 token")
        tenants.append(
            TenantLoad(
                name, values["rate"], values.get("weight", 1.0), int(values.get("priority", 0)),
                values.get("ttft_ms", 0.0), values.get("tpot_ms", 0.0),
                _whole(values.get("prompt")), _whole(values.get("output")),
            )
        )
    if not tenants:
        raise ValueError("name at least one tenant, e.g. a:rate=40,b:rate=4")
    return tenants


def synthesize(tenants: Sequence[TenantLoad], duration_s: float, lengths: Lengths, seed: int = 0) -> list[TracedRequest]:
    """Every tenant's requests arriving in [0, duration_s), in arrival order."""
    requests: list[TracedRequest] = []
    for index, tenant in enumerate(tenants):
        rng = np.random.default_rng([seed, index])
        t = rng.exponential(1.0 / tenant.rate)
        number = 0
        while t < duration_s:
            prompt = _draw(rng, tenant.prompt or lengths.prompt_median, lengths.sigma, lengths.max_prompt)
            output = _draw(rng, tenant.output or lengths.output_median, lengths.sigma, lengths.max_output)
            requests.append(
                TracedRequest(
                    f"{tenant.name}-{number}", float(t), prompt, 0, [], tenant.priority, lengths.max_output,
                    ignore_eos=False, finish="stop", outputs=output, tenant=tenant.name,
                    ttft_deadline_s=tenant.ttft_ms / 1000, tpot_target_s=tenant.tpot_ms / 1000,
                )
            )
            number += 1
            t += rng.exponential(1.0 / tenant.rate)
    return sorted(requests, key=lambda r: (r.arrival_s, r.request_id))


def _draw(rng: np.random.Generator, median: int, sigma: float, cap: int) -> int:
    return int(min(cap, max(1, round(median * math.exp(sigma * rng.standard_normal())))))


def _whole(value: float | None) -> int | None:
    return None if value is None else int(value)
