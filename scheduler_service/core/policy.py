"""Scheduling policies: who goes first, and who is preempted when blocks run out."""

import enum
from collections.abc import Iterable

from scheduler_service.core.request import Request


class Policy(enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"


class StepMode(enum.Enum):
    # Decodes and prefill chunks share every step (the default; best throughput and latency).
    MIXED = "mixed"
    # A step with prefill work runs only prefill work: new requests start at once, decodes wait.
    PREFILL_FIRST = "prefill-first"
    # New requests start only when no request is running: running ones decode to completion.
    DECODE_FIRST = "decode-first"


def rank(request: Request, policy: Policy) -> tuple[int, int]:
    """Sort key: lower runs first. Priority counts only under the priority policy."""
    priority = request.priority if policy is Policy.PRIORITY else 0
    return (priority, request.arrival_index)


def pick_victim(running: Iterable[Request], policy: Policy) -> Request:
    """The running request ranked last. Whoever needs room either outranks it or is it, so a
    request is never preempted for one it outranks."""
    return max(running, key=lambda r: rank(r, policy))
