"""Reads steps.jsonl (planner/step_trace.py) into one timeline per executor incarnation: its
planner's config, the requests placed on it and how each ended, the plans it was sent with
their timings."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scheduler_service.core.tenants import DEFAULT_TENANT

# A plan's identity for comparing schedules: new ids, continuing ids with their tokens,
# steady-decode ids, and a hybrid model's checkpoints (id, tokens, slot) and resumes (id, slot).
Signature = tuple[
    frozenset[str], frozenset[tuple[str, int]], frozenset[str], frozenset[tuple[str, int, int]], frozenset[tuple[str, int]]
]


@dataclass(slots=True)
class TracedRequest:
    request_id: str
    arrival_s: float
    prompt_tokens: int
    # Outputs it already had when placed here (moved from another executor).
    prior_outputs: int
    block_digests: list[str]
    priority: int
    max_tokens: int
    ignore_eos: bool
    # How it ended here: "length", "stop", "abort", "left" (moved away or lost), or None.
    finish: str | None = None
    outputs: int = 0
    # When its client aborted it.
    aborted_s: float | None = None
    # The first choice it forks from (Request.fork_of), or "".
    fork_of: str = ""
    # Who sent it and the targets it carried (Request's fields of the same names), from a step
    # trace or a synthesised trace (replay/tenant_traces.py).
    tenant: str = DEFAULT_TENANT
    ttft_deadline_s: float = 0.0
    tpot_target_s: float = 0.0


@dataclass(slots=True)
class TracedPlan:
    planned_s: float
    signature: Signature
    prefill_tokens: int
    decode_tokens: int
    # Seconds the executor took: from when it could start (the plan sent, the previous result
    # back) to its result.
    duration_s: float = 0.0
    forward_s: float = 0.0
    # Speculative decoding: drafts the plan carried and, once its result is in, how many were
    # accepted.
    draft_tokens: int = 0
    accepted_tokens: int = 0
    # The step token limit it was planned under (--target-itl-ms), if any.
    step_token_limit: int | None = None


@dataclass(slots=True)
class Timeline:
    address: str
    config: dict[str, Any]
    requests: dict[str, TracedRequest] = field(default_factory=dict)
    plans: list[TracedPlan] = field(default_factory=list)


def signature(
    new: list[str],
    continuing: dict[str, int],
    decodes: list[str],
    checkpoints: Iterable[tuple[str, int, int]] = (),
    sources: Mapping[str, int] | None = None,
) -> Signature:
    return (
        frozenset(new), frozenset(continuing.items()), frozenset(decodes),
        frozenset(checkpoints), frozenset((sources or {}).items()),
    )


def read_trace(directory: Path) -> list[Timeline]:
    """Timelines in the order their executors came up. Heartbeat plans (no work, nothing
    dropped) are left out: they change nothing."""
    path = directory / "steps.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{directory} holds no steps.jsonl (record one with --trace-dir)")
    timelines: list[Timeline] = []
    current: dict[str, Timeline] = {}
    pending: dict[tuple[str, int], TracedPlan] = {}
    last_result: dict[str, float] = {}
    with path.open(encoding="utf-8") as lines:
        for line in lines:
            event = json.loads(line)
            kind, address, t = event["e"], event["x"], event["t"]
            if kind == "up":
                current[address] = Timeline(address, event["config"])
                timelines.append(current[address])
                continue
            timeline = current.get(address)
            if timeline is None:
                continue
            if kind == "add":
                timeline.requests[event["id"]] = TracedRequest(
                    event["id"], t, event["prompt"], event["outputs"], event["blocks"],
                    event["priority"], event["max_tokens"], event["ignore_eos"],
                    # Traces from before forks have none.
                    fork_of=event.get("fork_of", ""),
                    # Written only where they differ from the defaults.
                    tenant=event.get("tenant", DEFAULT_TENANT),
                    ttft_deadline_s=event.get("ttft_s", 0.0),
                    tpot_target_s=event.get("tpot_s", 0.0),
                )
            elif kind == "plan":
                if event["new"] or event["cont"] or event["dec"] or event["drop"]:
                    # Traces from before hybrid models' prefix caching have neither.
                    checkpoints = [(rid, tokens, slot) for rid, tokens, slot in event.get("ckpt", ())]
                    plan = TracedPlan(
                        t, signature(event["new"], event["cont"], event["dec"], checkpoints, event.get("src")),
                        event["prefill_tokens"], event["decode_tokens"],
                        # Traces from before speculative decoding have no drafts.
                        draft_tokens=sum(event.get("drafts", {}).values()),
                        step_token_limit=event.get("limit"),
                    )
                    pending[(address, event["step"])] = plan
                    timeline.plans.append(plan)
            elif kind == "result":
                plan = pending.pop((address, event["step"]), None)
                if plan is not None:
                    plan.duration_s = t - max(plan.planned_s, last_result.get(address, plan.planned_s))
                    plan.forward_s = event["forward_s"]
                    plan.accepted_tokens = sum(event.get("accepted", {}).values())
                last_result[address] = t
                for finished in event["finished"]:
                    _ended(timeline, finished["id"], finished["reason"], finished["outputs"])
            elif kind in ("abort", "stop", "leave", "move"):
                request = timeline.requests.get(event["id"])
                if request is not None and kind == "abort":
                    request.aborted_s = t
                _ended(timeline, event["id"], {"leave": "left", "move": "left"}.get(kind, kind), event["outputs"])
            elif kind == "lost":
                for request in timeline.requests.values():
                    if request.finish is None:
                        request.finish = "left"
                del current[address]
    return timelines


def _ended(timeline: Timeline, request_id: str, reason: str | None, outputs: int) -> None:
    request = timeline.requests.get(request_id)
    if request is not None and request.finish is None:
        request.finish, request.outputs = reason, outputs
