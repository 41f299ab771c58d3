"""The fair policy's books: counters are tokens served per unit of weight; a tenant whose queues
were empty and that queues a request starts level with the least served tenant with requests
queued (else placed), never below (no banked credit, even while a request of its own runs) and
never above its own history; a tenant with nothing placed is forgotten."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_service.core.fair_share import FairShare
from scheduler_service.core.request import Request


def request(name: str, tenant: str) -> Request:
    return Request(name, [1, 2], tenant=tenant)


def test_charge_divides_by_weight() -> None:
    share = FairShare({"big": 4.0, "small": 0.5}.__getitem__)
    share.charge("big", 100)
    share.charge("small", 100)
    assert share.counter("big") == pytest.approx(25.0)
    assert share.counter("small") == pytest.approx(200.0)
    share.charge_all([request("a", "big"), request("b", "big"), request("c", "small")])
    assert share.counter("big") == pytest.approx(25.5)
    assert share.counter("small") == pytest.approx(202.0)


def test_a_tenant_that_queues_starts_at_the_least_served_queued_counter() -> None:
    share = FairShare()
    a1, b1 = request("a1", "a"), request("b1", "b")
    for placed in (a1, b1):
        share.join(placed)
        share.queued(placed)
    share.charge("a", 500)
    share.charge("b", 300)
    # Idle since start: it banked nothing, so it starts at the smaller queued counter.
    c1 = request("c1", "c")
    share.join(c1)
    share.queued(c1)
    assert share.counter("c") == 300
    # Its own history above the floor is kept while it has work placed: a request of its own
    # leaving the queue and another queueing does not wipe a debt.
    share.charge("c", 1000)
    share.unqueued(c1)
    c2 = request("c2", "c")
    share.join(c2)
    share.queued(c2)
    assert share.counter("c") == 1300


def test_a_running_request_banks_no_credit_while_others_are_served() -> None:
    share = FairShare()
    a_long, b1 = request("a-long", "a"), request("b1", "b")
    for placed in (a_long, b1):
        share.join(placed)
        share.queued(placed)
    # a's one request runs (out of the queue) while b's queue is served a million tokens.
    share.unqueued(a_long)
    share.charge("a", 1_000)
    share.charge("b", 1_000_000)
    flood = request("a-flood", "a")
    share.join(flood)
    share.queued(flood)
    assert share.counter("a") == 1_000_000


def test_with_nothing_queued_a_tenant_is_lifted_to_the_least_served_placed() -> None:
    share = FairShare()
    running = request("b1", "b")
    share.join(running)
    share.charge("b", 400)
    newcomer = request("a1", "a")
    share.join(newcomer)
    share.queued(newcomer)
    assert share.counter("a") == 400


def test_a_tenant_with_nothing_placed_is_forgotten() -> None:
    share = FairShare()
    only = request("a1", "a")
    share.join(only)
    share.charge("a", 70)
    share.leave(only)
    assert share.counter("a") == 0 and "a" not in share.served


def test_join_and_leave_are_idempotent() -> None:
    share = FairShare()
    one = request("a1", "a")
    share.join(one)
    share.join(one)
    assert share.placed("a") == 1
    share.leave(one)
    share.leave(one)
    assert share.placed("a") == 0
    share.leave(request("never", "a"))
    assert share.placed("a") == 0


def test_no_active_tenant_leaves_a_newcomer_where_it_was() -> None:
    share = FairShare()
    share.charge("a", 50)
    share.join(request("b1", "b"))
    assert share.counter("b") == 0


# (what, request index, tokens): join, queue, unqueue or leave request i, or charge tokens to
# request i's tenant.
_operations = st.lists(
    st.tuples(st.sampled_from(["join", "queue", "unqueue", "leave", "charge"]), st.integers(0, 11), st.integers(1, 100)),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(_operations)
def test_counters_follow_the_rules_under_any_sequence(operations: list[tuple[str, int, int]]) -> None:
    tenants = ("a", "b", "c")
    weights = {"a": 1.0, "b": 2.0, "c": 0.5}
    share = FairShare(weights.__getitem__)
    # Request i belongs to tenant i % 3.
    requests = [request(f"r{i}", tenants[i % 3]) for i in range(12)]
    placed: set[int] = set()
    queued: set[int] = set()

    def tenants_of(indices: set[int]) -> set[str]:
        return {tenants[i % 3] for i in indices}

    for what, index, tokens in operations:
        before = {t: share.counter(t) for t in tenants}
        tenant = requests[index].tenant
        if what == "join":
            share.join(requests[index])
            placed.add(index)
            assert {t: share.counter(t) for t in tenants} == before
        elif what == "queue":
            if index not in placed:
                continue
            others_queued = tenants_of(queued) - {tenant}
            others_placed = tenants_of(placed) - {tenant}
            floor_from = others_queued or others_placed
            was_queued = tenant in tenants_of(queued)
            share.queued(requests[index])
            queued.add(index)
            if was_queued or not floor_from:
                assert share.counter(tenant) == before[tenant]
            else:
                assert share.counter(tenant) == max(before[tenant], min(before[t] for t in floor_from))
        elif what == "unqueue":
            share.unqueued(requests[index])
            queued.discard(index)
            assert {t: share.counter(t) for t in tenants} == before
        elif what == "leave":
            share.leave(requests[index])
            placed.discard(index)
            queued.discard(index)
            if tenant not in tenants_of(placed):
                assert share.counter(tenant) == 0
                before[tenant] = 0
            assert {t: share.counter(t) for t in tenants} == before
        else:
            if tenant not in tenants_of(placed):
                # Only requests placed are planned, so only their tenants are charged.
                continue
            share.charge(tenant, tokens)
            assert share.counter(tenant) == pytest.approx(before[tenant] + tokens / weights[tenant])
        for t in tenants:
            if t in tenants_of(placed):
                assert share.counter(t) >= before[t], "a counter went down while its tenant had work"
            assert share.placed(t) == sum(1 for i in placed if tenants[i % 3] == t)
