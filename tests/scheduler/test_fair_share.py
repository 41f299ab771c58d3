"""The fair policy's books: counters are tokens served per unit of weight, and a tenant that
becomes active starts level with the least served active tenant, never below (no banked credit)
and never above its own history."""

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


def test_a_newly_active_tenant_starts_at_the_least_served_active_counter() -> None:
    share = FairShare()
    first, second = request("a1", "a"), request("b1", "b")
    share.join(first)
    share.join(second)
    share.charge("a", 500)
    share.charge("b", 300)
    # Idle since start: it banked nothing, so it starts at the smaller active counter.
    idle = request("c1", "c")
    share.join(idle)
    assert share.counter("c") == 300
    # Its own history above the floor is kept: going idle does not wipe a debt.
    share.charge("c", 1000)
    share.leave(idle)
    share.join(request("c2", "c"))
    assert share.counter("c") == 1300


def test_a_tenant_that_went_idle_is_lifted_when_it_returns() -> None:
    share = FairShare()
    early = request("a1", "a")
    share.join(early)
    share.join(request("b1", "b"))
    share.charge("a", 10)
    share.leave(early)
    share.charge("b", 400)
    share.join(request("a2", "a"))
    assert share.counter("a") == 400


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


# (what, request index, tokens): join or leave request i, or charge tokens to request i's tenant.
_operations = st.lists(
    st.tuples(st.sampled_from(["join", "leave", "charge"]), st.integers(0, 11), st.integers(1, 100)),
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
    for what, index, tokens in operations:
        before = {t: share.counter(t) for t in tenants}
        tenant = requests[index].tenant
        if what == "join":
            was_active = any(tenants[i % 3] == tenant for i in placed)
            floor = min((before[tenants[i % 3]] for i in placed), default=None)
            share.join(requests[index])
            placed.add(index)
            if was_active or floor is None:
                assert share.counter(tenant) == before[tenant]
            else:
                assert share.counter(tenant) == max(before[tenant], floor)
        elif what == "leave":
            share.leave(requests[index])
            placed.discard(index)
            assert {t: share.counter(t) for t in tenants} == before
        else:
            share.charge(tenant, tokens)
            assert share.counter(tenant) == pytest.approx(before[tenant] + tokens / weights[tenant])
        for t in tenants:
            assert share.counter(t) >= before[t], "a counter went down"
            assert share.placed(t) == sum(1 for i in placed if tenants[i % 3] == t)
