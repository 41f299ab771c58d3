"""The waiting queue under every policy, against a plain model: the head under fair comes from the
tenant served least per weight, a tenant's own requests go by (priority, TTFT deadline, arrival),
and no sequence of add, insert, push_front, remove, pop and reordered loses or doubles a request."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from scheduler_service.core.fair_share import FairShare
from scheduler_service.core.policy import Policy, rank
from scheduler_service.core.request import Request
from scheduler_service.core.request_queue import WaitingQueue

TENANTS = ("acme", "globex", "initech")
WEIGHTS = {"acme": 1.0, "globex": 3.0, "initech": 0.5}


def request(index: int, tenant: str = "acme", priority: int = 0, deadline_s: float = 0.0, arrival_time: float = 0.0) -> Request:
    return Request(
        f"q{index}",
        [1, 2, 3],
        tenant=tenant,
        priority=priority,
        ttft_deadline_s=deadline_s,
        arrival_time=arrival_time,
        arrival_index=index,
    )


def expected_order(queued: list[Request], policy: Policy, share: FairShare) -> list[Request]:
    """The admission order the queue must report, from the specification alone."""
    if policy is Policy.FCFS:
        return list(queued)
    if policy is Policy.PRIORITY:
        return sorted(queued, key=lambda r: rank(r, policy))
    by_tenant: dict[str, list[Request]] = {}
    for r in sorted(queued, key=lambda r: rank(r, policy)):
        by_tenant.setdefault(r.tenant, []).append(r)
    tenants = sorted(by_tenant, key=lambda t: (share.counter(t), by_tenant[t][0].arrival_index))
    return [r for t in tenants for r in by_tenant[t]]


class QueueMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.share = FairShare(lambda tenant: WEIGHTS[tenant])
        self.queue = WaitingQueue(Policy.FCFS, self.share)
        self.policy = Policy.FCFS
        # The model: queued requests in FCFS order (any order under the other policies).
        self.queued: list[Request] = []
        # Requests not queued here: popped, removed, or arrived elsewhere.
        self.outside: list[Request] = []
        self.arrivals = 0

    @initialize(policy=st.sampled_from(list(Policy)))
    def start(self, policy: Policy) -> None:
        self.policy = policy
        self.queue = WaitingQueue(policy, self.share)

    def _new(self, tenant: str, priority: int, deadline_s: float, arrival_time: float) -> Request:
        self.arrivals += 1
        return request(self.arrivals, tenant, priority, deadline_s, arrival_time)

    @rule(
        tenant=st.sampled_from(TENANTS),
        priority=st.integers(0, 3),
        deadline_s=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
        arrival_time=st.sampled_from([0.0, 0.25, 1.0]),
    )
    def add(self, tenant: str, priority: int, deadline_s: float, arrival_time: float) -> None:
        new = self._new(tenant, priority, deadline_s, arrival_time)
        self.queue.add(new)
        self.queued.append(new)

    @rule(tenant=st.sampled_from(TENANTS), priority=st.integers(0, 3), deadline_s=st.sampled_from([0.0, 1.0]))
    def arrive_elsewhere(self, tenant: str, priority: int, deadline_s: float) -> None:
        self.outside.append(self._new(tenant, priority, deadline_s, 0.0))

    @precondition(lambda self: self.outside)
    @rule(data=st.data())
    def insert(self, data: st.DataObject) -> None:
        moved = self.outside.pop(data.draw(st.integers(0, len(self.outside) - 1)))
        self.queue.insert(moved)
        # Under FCFS: behind the requests that arrived before it, ahead of the later arrivals
        # at the tail.
        position = len(self.queued)
        while position > 0 and self.queued[position - 1].arrival_index > moved.arrival_index:
            position -= 1
        self.queued.insert(position, moved)

    @precondition(lambda self: self.outside)
    @rule(data=st.data(), had_first_token=st.booleans())
    def push_front(self, data: st.DataObject, had_first_token: bool) -> None:
        preempted = self.outside.pop(data.draw(st.integers(0, len(self.outside) - 1)))
        if had_first_token:
            preempted.first_token_time = 0.1
        self.queue.push_front(preempted)
        self.queued.insert(0, preempted)

    @precondition(lambda self: self.queued or self.outside)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        candidates = self.queued + self.outside
        target = candidates[data.draw(st.integers(0, len(candidates) - 1))]
        was_queued = any(r is target for r in self.queued)
        assert self.queue.remove(target) is was_queued
        if was_queued:
            self.queued.remove(target)
            self.outside.append(target)
        assert self.queue.remove(target) is False

    @precondition(lambda self: self.queued)
    @rule()
    def pop(self) -> None:
        head = expected_order(self.queued, self.policy, self.share)[0]
        assert self.queue.peek() is head
        assert self.queue.pop() is head
        self.queued.remove(head)
        self.outside.append(head)

    @rule(tenant=st.sampled_from(TENANTS), tokens=st.integers(1, 50))
    def charge(self, tenant: str, tokens: int) -> None:
        self.share.charge(tenant, tokens)

    @rule(policy=st.sampled_from(list(Policy)))
    def reorder(self, policy: Policy) -> None:
        self.queue = self.queue.reordered(policy)
        self.policy = policy
        if policy is Policy.FCFS:
            self.queued.sort(key=lambda r: r.arrival_index)

    @invariant()
    def holds_each_queued_request_once_in_order(self) -> None:
        listed = list(self.queue)
        assert len(self.queue) == len(self.queued) == len(listed)
        assert [id(r) for r in listed] == [id(r) for r in expected_order(self.queued, self.policy, self.share)]
        if self.queued:
            assert self.queue.peek() is listed[0]
        else:
            assert not self.queue


TestQueueMachine = QueueMachine.TestCase
TestQueueMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_fair_head_comes_from_the_tenant_served_least_per_weight() -> None:
    share = FairShare(lambda tenant: WEIGHTS[tenant])
    queue = WaitingQueue(Policy.FAIR, share)
    flood = [request(i, "acme") for i in range(1, 6)]
    late = request(6, "globex")
    for r in [*flood, late]:
        queue.add(r)
    # Equal counters: the earlier head goes first.
    assert queue.peek() is flood[0]
    share.charge("acme", 3)
    assert queue.peek() is late
    # globex weighs 3: 6 tokens move it to a counter of 2, still under acme's 3.
    share.charge("globex", 6)
    assert queue.peek() is late
    share.charge("globex", 6)
    assert queue.peek() is flood[0]


def test_within_a_tenant_priority_then_deadline_then_arrival() -> None:
    queue = WaitingQueue(Policy.FAIR)
    plain = request(1, priority=1)
    later_deadline = request(2, priority=1, deadline_s=2.0)
    sooner_deadline = request(3, priority=1, deadline_s=0.5)
    urgent = request(4, priority=0)
    same_priority_later_arrival = request(5, priority=1)
    for r in [plain, later_deadline, sooner_deadline, urgent, same_priority_later_arrival]:
        queue.add(r)
    assert [queue.pop() for _ in range(5)] == [urgent, sooner_deadline, later_deadline, plain, same_priority_later_arrival]


@pytest.mark.parametrize("policy", [Policy.PRIORITY, Policy.FAIR])
def test_a_request_with_its_first_token_ranks_as_having_no_deadline(policy: Policy) -> None:
    preempted = request(1, deadline_s=0.5)
    preempted.first_token_time = 0.2
    fresh = request(2, deadline_s=5.0)
    assert rank(preempted, policy)[1] == math.inf
    queue = WaitingQueue(policy)
    queue.push_front(preempted)
    queue.add(fresh)
    assert queue.pop() is fresh
