"""Priority that preempts: under the priority and fair policies a request arriving at a full batch
(max_num_seqs) or a full cache takes the place of the lowest-ranked running request it outranks,
at once; the one preempted waits and later finishes with every token. FCFS never preempts for
priority, and under fair a priority never takes from a tenant that is owed. A Scheduler and the
SimulatedExecutor in lockstep, the block books audited after every step."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.fair_share import FairShare
from scheduler_service.core.policy import Policy
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.sampling_params import SamplingParams
from scheduler_service.core.sim_executor import default_next_token
from tests.helpers.lockstep import Lockstep

LOW, HIGH = 5, 0

# Sets up a run of four priority-5 requests with the batch or the cache full.
Full = Callable[[Policy], tuple[Lockstep, list[Request]]]


def make(name: str, index: int, prompt_len: int, max_tokens: int, priority: int, tenant: str = "default") -> Request:
    prompt = list(range(1000 * index + 1, 1000 * index + prompt_len + 1))
    return Request(name, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), priority=priority, tenant=tenant)


def expected_output(request: Request) -> list[int]:
    tokens = list(request.prompt_token_ids)
    for _ in range(request.sampling.max_tokens or 0):
        tokens.append(default_next_token("", tokens))
    return tokens[request.num_prompt_tokens :]


def config(policy: Policy, **overrides: object) -> SchedulerConfig:
    base: dict[str, object] = dict(num_kv_blocks=256, block_size=4, max_model_len=1024, max_num_seqs=4, policy=policy)
    base.update(overrides)
    return SchedulerConfig(**base)  # type: ignore[arg-type]


def admitted(plan_requests: list[str], request: Request) -> bool:
    return request.request_id in plan_requests


def seats_full(policy: Policy) -> tuple[Lockstep, list[Request]]:
    """Four priority-5 requests decoding in a batch of four seats."""
    run = Lockstep.of(config(policy))
    lows = [make(f"low{i}", i, 8, 30, LOW) for i in range(4)]
    run.step(lows)
    for _ in range(3):
        run.step()
    assert len(run.scheduler.running) == 4 and all(r.num_output_tokens >= 3 for r in lows)
    return run, lows


def blocks_full(policy: Policy) -> tuple[Lockstep, list[Request]]:
    """Four priority-5 requests holding every block of the cache, seats to spare: each has a
    16-token prompt and grows to 31 tokens, two blocks of 16, all eight taken from step 2."""
    run = Lockstep.of(config(policy, num_kv_blocks=8, block_size=16, max_num_seqs=64))
    lows = [make(f"low{i}", i, 16, 16, LOW) for i in range(4)]
    run.step(lows)
    run.step()
    assert run.scheduler.kv.num_free_blocks == 0 and len(run.scheduler.running) == 4
    return run, lows


@pytest.mark.parametrize("policy", [Policy.PRIORITY, Policy.FAIR])
@pytest.mark.parametrize("full", [seats_full, blocks_full], ids=["seats", "blocks"])
def test_a_high_priority_arrival_preempts_the_lowest_ranked_at_once(policy: Policy, full: Full) -> None:
    run, lows = full(policy)
    high = make("high", 9, 4, 6, HIGH)
    plan = run.step([high])
    assert admitted([n.request_id for n in plan.new_requests], high), "not admitted in the next plan"
    # The lowest ranked: equal priorities, so the last to arrive.
    victim = lows[-1]
    assert [r.num_preemptions for r in lows] == [0, 0, 0, 1]
    assert victim.status is RequestStatus.WAITING and victim in run.scheduler.queued
    assert victim.request_id in plan.dropped_request_ids
    run.run_until_done()
    assert high.num_preemptions == 0
    assert run.finished_at["high"] < run.finished_at[victim.request_id]
    for request in [*lows, high]:
        assert run.outputs[request.request_id] == expected_output(request), request.request_id


@pytest.mark.parametrize("full", [seats_full, blocks_full], ids=["seats", "blocks"])
def test_fcfs_never_preempts_for_priority(full: Full) -> None:
    run, lows = full(Policy.FCFS)
    high = make("high", 9, 4, 6, HIGH)
    run.step([high])
    assert high.first_scheduled_time is None
    run.run_until_done()
    assert [r.num_preemptions for r in [*lows, high]] == [0] * 5
    assert run.scheduler.num_preemptions == 0
    high_admitted = next(i for i, plan in enumerate(run.plans) if any(n.request_id == "high" for n in plan.new_requests))
    assert high_admitted + 1 >= min(run.finished_at[r.request_id] for r in lows)
    assert run.outputs["high"] == expected_output(high)


def test_the_victim_is_the_lowest_priority_not_the_last_arrival() -> None:
    run = Lockstep.of(config(Policy.PRIORITY))
    lows = [make("p3", 0, 8, 30, 3), make("p7", 1, 8, 30, 7), make("p5a", 2, 8, 30, 5), make("p5b", 3, 8, 30, 5)]
    run.step(lows)
    run.step()
    run.step([make("high", 9, 4, 6, HIGH)])
    assert [r.request_id for r in lows if r.num_preemptions] == ["p7"]
    run.run_until_done()


def test_equal_priority_never_preempts() -> None:
    run, lows = seats_full(Policy.PRIORITY)
    same = make("same", 9, 4, 6, LOW)
    run.step([same])
    assert same.first_scheduled_time is None and not any(r.num_preemptions for r in lows)
    run.run_until_done()


# ---- under fair: whose request may be taken -------------------------------------------------


def fair_run(weights: dict[str, float], max_num_seqs: int = 2) -> Lockstep:
    share = FairShare(lambda tenant: weights.get(tenant, 1.0))
    return Lockstep.of(config(Policy.FAIR, max_num_seqs=max_num_seqs), share)


def test_fair_a_tenant_served_more_does_not_preempt_another_tenants_request() -> None:
    """b's two priority-5 requests run; a arrives after them and is served a 100-token prompt, so
    it is over b's share. a's priority-0 request arrives at the full batch: a is not owed, so it
    waits for a seat to free (and a's own running request is of its priority, not a victim)."""
    run = fair_run({}, max_num_seqs=3)
    b_lows = [make(f"b{i}", 1 + i, 8, 30, LOW, "b") for i in range(2)]
    run.step(b_lows)
    history = make("a-history", 0, 100, 100, HIGH, "a")
    run.step([history])
    run.step()
    share = run.scheduler.share
    high = make("a-high", 9, 4, 6, HIGH, "a")
    run.step([high])
    assert share.counter("a") > share.counter("b")
    assert high.first_scheduled_time is None
    assert not any(r.num_preemptions for r in b_lows)
    run.run_until_done()
    assert not any(r.num_preemptions for r in b_lows)
    assert run.outputs["a-high"] == expected_output(high)


def test_fair_a_tenant_served_less_preempts_another_tenants_lower_priority() -> None:
    """b's two priority-5 requests fill the batch; a, new, starts level with b, and once b is
    charged for the step a's priority-0 request takes b's lower-ranked seat."""
    run = fair_run({})
    b_lows = [make(f"b{i}", 1 + i, 8, 30, LOW, "b") for i in range(2)]
    run.step(b_lows)
    run.step()
    high = make("a-high", 9, 4, 6, HIGH, "a")
    run.step([high])
    run.step()
    assert high.first_scheduled_time is not None, "a's request waited past the step after its arrival"
    assert [r.num_preemptions for r in b_lows] == [0, 1]
    run.run_until_done()
    for request in [*b_lows, high]:
        assert run.outputs[request.request_id] == expected_output(request)


def test_fair_a_tenant_served_more_preempts_its_own_lower_priority() -> None:
    """a (weight 1) and b (weight 2) each run a priority-5 request in a batch of two; a's counter
    runs ahead. a's priority-0 request takes a's own seat at once, and b's request is untouched."""
    run = fair_run({"a": 1.0, "b": 2.0})
    a_low = make("a-low", 0, 8, 40, LOW, "a")
    b_low = make("b-low", 1, 8, 40, LOW, "b")
    run.step([a_low, b_low])
    for _ in range(5):
        run.step()
    share = run.scheduler.share
    assert share.counter("a") > share.counter("b")
    high = make("a-high", 9, 4, 6, HIGH, "a")
    plan = run.step([high])
    assert admitted([n.request_id for n in plan.new_requests], high)
    assert (a_low.num_preemptions, b_low.num_preemptions) == (1, 0)
    run.run_until_done()
    for request in (a_low, b_low, high):
        assert run.outputs[request.request_id] == expected_output(request)


def test_fair_a_request_preempts_its_own_tenants_lower_priority_when_another_tenant_leads() -> None:
    """b is served more than a, but b's running request has priority 0 like a's arrival: a
    request a's priority-0 outranks, a's own priority-5 one, is still there to take."""
    run = fair_run({"a": 2.0, "b": 1.0})
    a_low = make("a-low", 0, 8, 40, LOW, "a")
    b_high = make("b-high", 1, 8, 40, HIGH, "b")
    run.step([a_low, b_high])
    for _ in range(5):
        run.step()
    share = run.scheduler.share
    assert share.counter("b") > share.counter("a")
    high = make("a-high", 9, 4, 6, HIGH, "a")
    plan = run.step([high])
    assert admitted([n.request_id for n in plan.new_requests], high)
    assert (a_low.num_preemptions, b_high.num_preemptions) == (1, 0)
    run.run_until_done()
    for request in (a_low, b_high, high):
        assert run.outputs[request.request_id] == expected_output(request)
