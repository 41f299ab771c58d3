"""Scheduling policies: who goes first, who is preempted when blocks run out, and who may
preempt whom."""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable

from scheduler_service.core.fair_share import FairShare
from scheduler_service.core.request import Request


class Policy(enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"
    # Token-weighted deficit round robin across tenants (core/fair_share.py); within a tenant,
    # priority, then deadline, then arrival.
    FAIR = "fair"


class StepMode(enum.Enum):
    # Decodes and prefill chunks share every step (the default; best throughput and latency).
    MIXED = "mixed"
    # A step with prefill work runs only prefill work: new requests start at once, decodes wait.
    PREFILL_FIRST = "prefill-first"
    # New requests start only when no request is running: running ones decode to completion.
    DECODE_FIRST = "decode-first"


def deadline_of(request: Request) -> float:
    """When its first token is due; inf once it has one (here, or before it was submitted again
    after its planner was lost), or when it never had a deadline."""
    if request.first_token_time is not None or request.num_output_tokens:
        return math.inf
    return request.ttft_deadline


def rank(request: Request, policy: Policy) -> tuple[int, float, int]:
    """Sort key: lower runs first. Under FCFS arrival alone; otherwise priority, then the
    earliest TTFT deadline, then arrival (the fair policy ranks this way within a tenant)."""
    if policy is Policy.FCFS:
        return (0, 0.0, request.arrival_index)
    return (request.priority, deadline_of(request), request.arrival_index)


def pick_victim(running: Iterable[Request], policy: Policy, share: FairShare | None = None) -> Request:
    """The running request ranked last; under the fair policy, the last of the tenant furthest
    over its share. Whoever needs room either outranks it or is it, so a request is never
    preempted for one it outranks."""
    if policy is Policy.FAIR and share is not None:
        return max(running, key=lambda r: (share.counter(r.tenant), rank(r, policy)))
    return max(running, key=lambda r: rank(r, policy))


def preempts(waiting: Request, running: Request, policy: Policy, share: FairShare | None = None) -> bool:
    """Whether a waiting request takes a running one's place when the batch or the blocks are
    full: under the priority policy when its priority is higher (a lower number); under the fair
    policy also only from its own tenant or one served more than its own, so priorities never
    take from a tenant that is owed (and the one preempted does not head the queue after)."""
    if policy is Policy.FCFS or waiting.priority >= running.priority:
        return False
    if policy is Policy.FAIR and share is not None and running.tenant != waiting.tenant:
        return share.counter(running.tenant) > share.counter(waiting.tenant)
    return True
