"""Tenants' quotas at arrival, on a fake clock: max_running holds requests in the tenant's own
queue and seats them as its requests end, max_waiting and tokens_per_minute refuse with a
retry-after, and no tenant's quota touches another's."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_service.core.errors import AdmissionRefused, ErrorKind
from scheduler_service.core.request import Request
from scheduler_service.core.sampling_params import SamplingParams
from scheduler_service.core.tenant_quotas import WINDOW_S, TenantQuotas
from scheduler_service.core.tenants import TenantLimits, TenantTable
from tests.helpers.lockstep import FakeClock

_index = iter(range(1_000_000))


def ask(tenant: str = "acme", prompt_len: int = 10, max_tokens: int = 30, priority: int = 0, deadline_s: float = 0.0, arrival_time: float = 0.0) -> Request:
    """A request of prompt_len + max_tokens tokens, numbered in arrival order."""
    index = next(_index)
    return Request(
        f"q{index}",
        [1] * prompt_len,
        SamplingParams(max_tokens=max_tokens),
        priority=priority,
        tenant=tenant,
        ttft_deadline_s=deadline_s,
        arrival_time=arrival_time,
        arrival_index=index,
    )


def quotas(**acme: int) -> tuple[TenantQuotas, FakeClock]:
    clock = FakeClock(0.0)
    return TenantQuotas(TenantTable({"acme": TenantLimits(**acme)}), clock), clock


def test_max_running_holds_the_rest_and_seats_them_as_requests_end() -> None:
    books, _ = quotas(max_running=2)
    first, second, third = ask(), ask(), ask()
    assert books.admit(first) and books.admit(second)
    assert books.admit(third) is False
    assert books.held() == [third] and books.num_held == 1
    assert books.ended(first) == [third]
    assert books.num_held == 0
    # third holds first's seat now: the next waits again.
    assert books.admit(ask()) is False


def test_held_requests_take_seats_by_priority_then_deadline_then_arrival() -> None:
    books, _ = quotas(max_running=1)
    running = ask()
    assert books.admit(running)
    plain = ask(priority=1)
    later_deadline = ask(priority=1, deadline_s=5.0)
    sooner_deadline = ask(priority=1, deadline_s=1.0)
    urgent = ask(priority=0)
    last_plain = ask(priority=1)
    for held in (plain, later_deadline, sooner_deadline, urgent, last_plain):
        assert books.admit(held) is False
    order = []
    ending = running
    while books.num_held:
        (seated,) = books.ended(ending)
        order.append(seated)
        ending = seated
    assert order == [urgent, sooner_deadline, later_deadline, plain, last_plain]


def test_a_held_request_that_ends_leaves_the_queue_without_freeing_a_seat() -> None:
    books, _ = quotas(max_running=1)
    running, held, other = ask(), ask(), ask()
    books.admit(running)
    books.admit(held)
    books.admit(other)
    assert books.ended(held) == []
    assert books.held() == [other]
    assert books.ended(running) == [other]


def test_max_waiting_refuses_with_a_retry_after() -> None:
    books, clock = quotas(max_running=1, max_waiting=2)
    running = ask()
    books.admit(running)
    assert books.admit(ask()) is False and books.admit(ask()) is False
    with pytest.raises(AdmissionRefused, match="max_waiting") as refused:
        books.admit(ask())
    assert (refused.value.reason, refused.value.kind) == ("max_waiting", ErrorKind.OVERLOADED)
    assert refused.value.retry_after_s is not None and refused.value.retry_after_s > 0
    assert books.num_held == 2
    # Another tenant is not held, let alone refused.
    assert books.admit(ask("globex"))
    # A seat frees: a held one takes it, and there is room to wait again.
    clock.now = 3.0
    books.ended(running)
    assert books.admit(ask()) is False


def test_max_waiting_zero_refuses_everything_past_max_running() -> None:
    books, _ = quotas(max_running=1, max_waiting=0)
    assert books.admit(ask())
    with pytest.raises(AdmissionRefused) as refused:
        books.admit(ask())
    assert refused.value.reason == "max_waiting"


def test_tokens_per_minute_refuses_until_enough_of_the_window_expires() -> None:
    books, clock = quotas(tokens_per_minute=100)
    for at in (0.0, 10.0):
        clock.now = at
        assert books.admit(ask())  # 40 tokens each
    clock.now = 20.0
    with pytest.raises(AdmissionRefused, match="tokens_per_minute") as refused:
        books.admit(ask())
    assert (refused.value.reason, refused.value.kind) == ("tokens_per_minute", ErrorKind.OVERLOADED)
    # 120 asked of 100: the 40 asked at 0 must leave the window, at 60.
    assert refused.value.retry_after_s == pytest.approx(WINDOW_S - 20.0)
    clock.now = 59.95
    with pytest.raises(AdmissionRefused) as almost:
        books.admit(ask())
    assert almost.value.retry_after_s == pytest.approx(0.1)
    clock.now = WINDOW_S
    assert books.admit(ask())
    # 40 (asked at 10) and 40 (at 60) are in the window: 55 more fit once the first leaves, 70
    # only once both have.
    with pytest.raises(AdmissionRefused) as bigger:
        books.admit(ask(prompt_len=15, max_tokens=40))
    assert bigger.value.retry_after_s == pytest.approx(10.0 + WINDOW_S - clock.now)
    with pytest.raises(AdmissionRefused) as biggest:
        books.admit(ask(prompt_len=30, max_tokens=40))
    assert biggest.value.retry_after_s == pytest.approx(WINDOW_S)


def test_a_refused_request_is_not_counted_against_the_window() -> None:
    books, clock = quotas(tokens_per_minute=100)
    assert books.admit(ask(max_tokens=70))  # 80
    for _ in range(5):
        with pytest.raises(AdmissionRefused):
            books.admit(ask())
    assert books.admit(ask(prompt_len=10, max_tokens=10))  # 20: exactly the quota


def test_a_single_request_over_the_quota_is_too_large() -> None:
    books, _ = quotas(tokens_per_minute=100)
    with pytest.raises(AdmissionRefused, match="lower max_tokens") as refused:
        books.admit(ask(prompt_len=50, max_tokens=51))
    assert (refused.value.reason, refused.value.kind) == ("tokens_per_minute", ErrorKind.TOO_LARGE)
    assert refused.value.retry_after_s is None


def test_other_tenants_are_unaffected_by_a_tenants_quotas() -> None:
    books, _ = quotas(tokens_per_minute=50, max_running=1, max_waiting=0)
    assert books.admit(ask())
    with pytest.raises(AdmissionRefused):
        books.admit(ask())
    # The defaults: no limit at all.
    for _ in range(100):
        assert books.admit(ask("globex", prompt_len=1000, max_tokens=1000))
    assert books.num_held == 0


def test_defaults_apply_to_every_tenant_the_table_does_not_name() -> None:
    clock = FakeClock(0.0)
    books = TenantQuotas(TenantTable({"vip": TenantLimits()}, defaults=TenantLimits(max_running=1)), clock)
    assert books.admit(ask("anyone")) and not books.admit(ask("anyone"))
    assert books.admit(ask("someone"))
    assert all(books.admit(ask("vip")) for _ in range(10))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 400), st.integers(2, 100)), min_size=1, max_size=40))
def test_tokens_per_minute_holds_in_every_window_and_its_retry_after_is_exact(
    arrivals: list[tuple[int, int]],
) -> None:
    """(tenths of a second since the last arrival, tokens asked). What was admitted never passes
    the quota in any 60 s; a refused request fits at once when retried after retry_after_s,
    and not 0.2 s sooner."""
    quota = 200
    books, clock = quotas(tokens_per_minute=quota)
    admitted: list[tuple[float, int]] = []
    tenths = 0
    for gap, tokens in arrivals:
        tenths += gap
        clock.now = tenths / 10
        request = ask(prompt_len=1, max_tokens=tokens - 1)
        try:
            books.admit(request)
        except AdmissionRefused as refused:
            assert refused.retry_after_s is not None and refused.retry_after_s >= 0.1
            later = copy.deepcopy(books)
            # (A hair later: on the boundary itself float rounding may fall either side.)
            later.clock.now = clock.now + refused.retry_after_s + 1e-6  # type: ignore[attr-defined]
            assert later.admit(copy.deepcopy(request))
            if refused.retry_after_s >= 0.3:
                sooner = copy.deepcopy(books)
                sooner.clock.now = clock.now + refused.retry_after_s - 0.2  # type: ignore[attr-defined]
                with pytest.raises(AdmissionRefused):
                    sooner.admit(copy.deepcopy(request))
            continue
        admitted.append((clock.now, tokens))
        in_window = sum(t for at, t in admitted if at > clock.now - WINDOW_S)
        assert in_window <= quota


def test_a_request_that_never_ran_gives_its_tokens_back() -> None:
    # A choice of n admitted, then cancelled when a sibling is refused: the retry must fit.
    books, _ = quotas(tokens_per_minute=100)
    siblings = [ask(prompt_len=10, max_tokens=20) for _ in range(3)]
    for sibling in siblings:
        assert books.admit(sibling)
    with pytest.raises(AdmissionRefused):
        books.admit(ask(prompt_len=10, max_tokens=20))
    for sibling in siblings:
        books.ended(sibling)
    assert books.books["acme"].asked_tokens == 0
    assert books.admit(ask(prompt_len=10, max_tokens=20))
    # One that ran keeps what it asked for counted.
    ran = ask(prompt_len=10, max_tokens=20)
    assert books.admit(ran)
    ran.first_scheduled_time = 0.0
    books.ended(ran)
    assert books.books["acme"].asked_tokens == 60


def test_a_resubmitted_request_is_never_refused_but_still_waits_for_a_seat() -> None:
    books, _ = quotas(max_running=1, max_waiting=0, tokens_per_minute=50)
    assert books.admit(ask(prompt_len=10, max_tokens=30))
    resumed = ask(prompt_len=10, max_tokens=30)
    assert books.admit(resumed, may_refuse=False) is False
    assert books.held() == [resumed]


def test_a_raised_max_running_seats_held_requests_at_once() -> None:
    books, _ = quotas(max_running=1)
    assert books.admit(ask())
    held = [ask(), ask()]
    assert [books.admit(r) for r in held] == [False, False]
    assert books.seat_wait_s("acme") > 0
    books.table = TenantTable({"acme": TenantLimits(max_running=3)})
    assert books.seat_held("acme") == held
    assert books.num_held == 0 and books.seat_wait_s("acme") == 0


def test_idle_tenants_books_are_swept() -> None:
    books, clock = quotas()
    for index in range(1_100):
        request = ask(tenant=f"t{index}")
        assert books.admit(request)
        books.ended(request)
    clock.now += WINDOW_S + 1
    books.admit(ask(tenant="late"))
    assert set(books.books) == {"late"}


def test_a_request_without_max_tokens_asks_for_the_rest_of_the_model_length() -> None:
    books, _ = quotas(tokens_per_minute=500)
    open_ended = Request("open", [1] * 10, SamplingParams(), tenant="acme")
    assert books.admit(open_ended, max_model_len=400)
    assert books.books["acme"].asked_tokens == 400
    with pytest.raises(AdmissionRefused):
        books.admit(Request("again", [1] * 10, SamplingParams(), tenant="acme"), max_model_len=400)
