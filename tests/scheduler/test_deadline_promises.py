"""Admission by deadline keeps the promises it made: a request that would be served before queued
requests (an earlier deadline under priority, its tenant's turn under fair) is refused where it
would make one of them miss its deadline, and admitted where it would not, or where the one it
passes has a lower priority; and under fair a request is judged by when its turn comes as the
tenants are charged while it waits (core/queue_forecast.py), not by turns counted now."""

from __future__ import annotations

import pytest

from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.deadline_admission import Candidate, DeadlineAdmission
from scheduler_service.core.errors import AdmissionRefused
from scheduler_service.core.policy import Policy
from scheduler_service.core.queue_forecast import forecast_queue
from scheduler_service.core.request import Request
from scheduler_service.core.sampling_params import SamplingParams
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.ttft_forecast import forecast_ttft

STEP_S = 0.1
# The share of the time left a forecast must fit in, fixed here so the numbers below stay true.
MARGIN = 0.8
OUTPUT = 10
NOW = 1.0


def _request(request_id: str, index: int, deadline_s: float = 0.0, priority: int = 0, tenant: str = "t") -> Request:
    sampling = SamplingParams(max_tokens=OUTPUT, ignore_eos=True)
    request = Request(request_id, [1, 2, 3, 4], sampling, priority=priority, tenant=tenant, ttft_deadline_s=deadline_s)
    request.arrival_index = index
    # Everything arrives at 1.0 on the scheduler's clock, and is judged then.
    request.arrival_time = NOW
    return request


def _one_seat_taken(policy: Policy) -> Scheduler:
    """One seat, held OUTPUT steps more by a running request (of tenant "new")."""
    scheduler = Scheduler(SchedulerConfig(num_kv_blocks=64, block_size=4, max_model_len=256, max_num_seqs=1, policy=policy), clock=lambda: NOW)
    scheduler.add_request(_request("running", 0, tenant="new"))
    scheduler.schedule()
    assert len(scheduler.running) == 1
    return scheduler


def _choose(scheduler: Scheduler, request: Request) -> int:
    return DeadlineAdmission(margin=MARGIN).choose(request, [Candidate(scheduler, lambda tokens: STEP_S)], 0, now=NOW)


def test_a_request_that_would_make_a_queued_one_late_is_refused_saying_so() -> None:
    scheduler = _one_seat_taken(Policy.PRIORITY)
    # Alone it starts after the running one: ~1.2 s, inside 0.8 x 2.5 s.
    scheduler.add_request(_request("queued", 1, deadline_s=2.5))
    # An earlier deadline: served first, it would push the queued one to ~2.3 s.
    with pytest.raises(AdmissionRefused) as refused:
        _choose(scheduler, _request("new", 2, deadline_s=2.0))
    message = str(refused.value)
    assert "meets the deadline of 2000 ms" in message and "against 2500 ms" in message, message
    assert refused.value.retry_after_s is not None and refused.value.retry_after_s > 0


def test_a_request_that_leaves_the_queued_ones_on_time_is_admitted() -> None:
    scheduler = _one_seat_taken(Policy.PRIORITY)
    scheduler.add_request(_request("queued", 1, deadline_s=3.0))
    assert _choose(scheduler, _request("new", 2, deadline_s=2.0)) == 0


def test_a_queued_request_of_lower_priority_may_be_made_late() -> None:
    scheduler = _one_seat_taken(Policy.PRIORITY)
    scheduler.add_request(_request("queued", 1, deadline_s=2.5, priority=1))
    assert _choose(scheduler, _request("new", 2, deadline_s=2.0)) == 0


def test_under_fair_a_tenant_whose_turn_comes_first_cannot_make_another_tenants_request_late() -> None:
    scheduler = _one_seat_taken(Policy.FAIR)
    scheduler.add_request(_request("own-queued", 1, tenant="new"))
    # Alone it starts after own-queued: ~2.3 s, inside 0.8 x 3.5 s.
    scheduler.add_request(_request("queued", 2, deadline_s=3.5, tenant="served"))
    # "served" was served more, so "new"'s requests go first: a third would push it to ~3.4 s.
    scheduler.share.charge("served", 1000)
    with pytest.raises(AdmissionRefused) as refused:
        _choose(scheduler, _request("new", 3, deadline_s=2.5, tenant="new"))
    assert "against 3500 ms" in str(refused.value)


def test_under_fair_a_request_of_a_tenant_charged_more_while_it_waits_is_judged_by_when_it_starts() -> None:
    scheduler = Scheduler(SchedulerConfig(num_kv_blocks=64, block_size=4, max_model_len=256, max_num_seqs=3, policy=Policy.FAIR), clock=lambda: NOW)
    for index, max_tokens in enumerate((5, 40, 40)):
        running = _request(f"busy-{index}", index, tenant="busy")
        running.sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        scheduler.add_request(running)
    scheduler.schedule()
    for index in range(3):
        scheduler.add_request(_request(f"other-{index}", 3 + index, tenant="other"))
    new = _request("new", 6, deadline_s=4.0, tenant="busy")
    # By turns "busy" waits for one of "other"'s: its first token at ~2.8 s, inside 0.8 x 4 s.
    # But charged for three requests a step to "other"'s one, "busy" falls behind all of them.
    turns = forecast_ttft(scheduler, new, lambda tokens: STEP_S, float(OUTPUT)).ttft_s
    assert turns <= MARGIN * 4.0
    queue = forecast_queue(scheduler, new, lambda tokens: STEP_S, float(OUTPUT))
    assert [r.request_id for r in queue.order] == ["other-0", "other-1", "other-2", "new"]
    with pytest.raises(AdmissionRefused) as refused:
        _choose(scheduler, new)
    assert "would miss the deadline of 4000 ms" in str(refused.value)
