"""The fair policy end to end in the planning core: a Scheduler and the SimulatedExecutor in
lockstep, the block books audited after every step. Tenants that keep a backlog get tokens by
weight whatever their requests' shapes, a tenant arriving behind a flood is served at once, and
running out of blocks costs the tenant furthest over its share."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from scheduler_service.core.audit import audit_executor
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.fair_share import FairShare
from scheduler_service.core.policy import Policy
from scheduler_service.core.request import Request
from scheduler_service.core.sampling_params import SamplingParams
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.sim_executor import SimulatedExecutor, default_next_token
from tests.helpers.lockstep import STEP_S, FakeClock, Lockstep


def tenant_request(tenant: str, index: int, prompt_len: int, max_tokens: int) -> Request:
    """Distinct prompts per tenant and index, so no two share cached blocks."""
    base = 100_000 * (ord(tenant[0]) - ord("a") + 1) + 100 * index
    prompt = list(range(base, base + prompt_len))
    return Request(f"{tenant}{index}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), tenant=tenant)


def expected_output(prompt: list[int], count: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(count):
        tokens.append(default_next_token("", tokens))
    return tokens[len(prompt) :]


def fair_config(**overrides: object) -> SchedulerConfig:
    base: dict[str, object] = dict(
        num_kv_blocks=512, block_size=4, max_model_len=512, max_num_seqs=8, max_num_batched_tokens=64, policy=Policy.FAIR
    )
    base.update(overrides)
    return SchedulerConfig(**base)  # type: ignore[arg-type]


def backlogged_window(run: Lockstep) -> tuple[int, int]:
    """Runs to the end; the steps (first, last) in which both tenants had requests waiting."""
    both = []
    while run.scheduler.has_unfinished():
        run.step()
        if {r.tenant for r in run.scheduler.queued} == {"a", "b"}:
            both.append(len(run.work))
        assert len(run.work) < 2000
    run.run_until_done()
    return both[0], both[-1]


@pytest.mark.parametrize(("weights", "low", "high"), [({"a": 1.0, "b": 1.0}, 0.9, 1.1), ({"a": 3.0, "b": 1.0}, 2.7, 3.3)])
def test_backlogged_tenants_get_tokens_by_weight_whatever_their_request_shapes(
    weights: dict[str, float], low: float, high: float
) -> None:
    """a sends long prompts and short answers (48 tokens a request), b the reverse (20): per
    request, a would get 2.4 times b's tokens; per token, the split follows the weights."""
    run = Lockstep.of(fair_config(), FairShare(weights.__getitem__))
    run.add([tenant_request("a", i, 40, 8) for i in range(60)])
    run.add([tenant_request("b", i, 4, 16) for i in range(60)])
    first, last = backlogged_window(run)
    assert last - first > 100, "the window is too short to judge"
    # From a few steps in (the first admissions are made before anyone was charged).
    served = run.tokens_by_tenant(first + 5, last)
    assert low <= served["a"] / served["b"] <= high, served
    for request in run.requests.values():
        assert run.outputs[request.request_id] == expected_output(request.prompt_token_ids, request.sampling.max_tokens)


@pytest.mark.parametrize("policy", [Policy.FAIR, Policy.FCFS])
def test_a_tenant_arriving_behind_a_flood_is_served_at_once(policy: Policy) -> None:
    """a queues 40 requests; b's one request, sent at step 20, takes the next seat under fair
    (at most one of a's, tied with it on the counters, goes first), where FCFS serves the whole
    flood first."""
    run = Lockstep.of(fair_config(max_num_seqs=4, policy=policy))
    run.add([tenant_request("a", i, 8, 12) for i in range(40)])
    for _ in range(19):
        run.step()
    late = tenant_request("b", 0, 8, 12)
    run.step([late])
    while late.first_scheduled_time is None:
        run.step()
    admitted_at = len(run.work)
    # a's requests admitted from b's arrival until b's admission, b's own step up to b.
    admissions = [new.request_id for plan in run.plans[19:admitted_at] for new in plan.new_requests]
    a_ahead = admissions[: admissions.index(late.request_id)]
    run.run_until_done()
    if policy is Policy.FAIR:
        assert len(a_ahead) <= 1, a_ahead
    else:
        assert len(a_ahead) > 20, a_ahead
    assert run.outputs[late.request_id] == expected_output(late.prompt_token_ids, 12)


def test_running_out_of_blocks_preempts_the_tenant_furthest_over_its_share() -> None:
    """a (weight 1) and b (weight 4) run one request each, a's first; their K/V outgrows the
    cache. Both are charged alike per token, so a's counter runs four times b's: a's request is
    the one preempted, though it arrived first (the priority policy would take b's, the
    later arrival)."""
    weights = {"a": 1.0, "b": 4.0}
    run = Lockstep.of(fair_config(num_kv_blocks=10, max_num_seqs=4), FairShare(weights.__getitem__))
    first = tenant_request("a", 0, 4, 28)
    second = tenant_request("b", 0, 4, 28)
    run.add([first, second])
    run.run_until_done()
    assert first.num_preemptions >= 1
    assert second.num_preemptions == 0
    for request in (first, second):
        assert run.outputs[request.request_id] == expected_output(request.prompt_token_ids, 28)


def test_priority_policy_preempts_the_later_arrival_in_the_same_case() -> None:
    """The contrast to the test above: without the fair books, rank alone picks the victim."""
    run = Lockstep.of(fair_config(num_kv_blocks=10, max_num_seqs=4, policy=Policy.PRIORITY))
    first = tenant_request("a", 0, 4, 28)
    second = tenant_request("b", 0, 4, 28)
    run.add([first, second])
    run.run_until_done()
    assert (first.num_preemptions, second.num_preemptions > 0) == (0, True)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    # (arrival step, tenant, prompt length, max_tokens, priority, TTFT deadline in steps or 0)
    specs=st.lists(
        st.tuples(
            st.integers(1, 12),
            st.sampled_from("abc"),
            st.integers(1, 24),
            st.integers(1, 12),
            st.integers(0, 3),
            st.sampled_from([0, 2, 10]),
        ),
        min_size=1,
        max_size=14,
    ),
    weights=st.tuples(st.sampled_from([0.5, 1.0, 3.0]), st.sampled_from([0.5, 1.0, 3.0]), st.sampled_from([0.5, 1.0, 3.0])),
    num_blocks=st.integers(8, 24),
    block_size=st.sampled_from([2, 4]),
    budget=st.integers(4, 48),
    max_num_seqs=st.integers(1, 5),
    policy=st.sampled_from([Policy.PRIORITY, Policy.FAIR]),
    pipelined=st.booleans(),
    num_host_blocks=st.sampled_from([0, 16]),
)
# A request admitted by preempting for blocks kept the prefix hit it found before: the victim's
# swap-out to the host tier had evicted the host blocks that hit named.
@example(
    specs=[(1, "a", 1, 1, 0, 0), (6, "c", 23, 5, 1, 0), (8, "a", 19, 4, 0, 0), (8, "b", 10, 2, 0, 0)],
    weights=(0.5, 0.5, 0.5), num_blocks=14, block_size=2, budget=4, max_num_seqs=2, policy=Policy.FAIR,
    pipelined=False, num_host_blocks=16,
)
def test_random_tenant_workloads_finish_with_the_right_tokens_and_clean_books(
    specs: list[tuple[int, str, int, int, int, int]],
    weights: tuple[float, float, float],
    num_blocks: int,
    block_size: int,
    budget: int,
    max_num_seqs: int,
    policy: Policy,
    pipelined: bool,
    num_host_blocks: int,
) -> None:
    """Priorities that preempt, preemption for blocks by share, a host tier to swap to, and
    steps planned before the last result is back (as the planner pipelines them): every request
    ends with its tokens, the books agree with the executor whenever no plan is out, and every
    block and every tenant's place in the fair books is given back."""
    config = SchedulerConfig(
        num_kv_blocks=num_blocks, block_size=block_size, max_model_len=256, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget, policy=policy, num_host_blocks=num_host_blocks,
    )
    share = FairShare(dict(zip("abc", weights)).__getitem__)
    clock = FakeClock()
    scheduler = Scheduler(config, clock=clock, share=share)
    executor = SimulatedExecutor(num_blocks, block_size)
    arrivals: dict[int, list[Request]] = {}
    for index, (step, tenant, prompt_len, max_tokens, priority, deadline_steps) in enumerate(specs):
        # Tenants share a first block now and then, so prefix hits happen across them.
        prompt = [7] * min(prompt_len, 4) + list(range(index * 50, index * 50 + prompt_len - 4))
        request = Request(
            f"q{index}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            priority=priority, tenant=tenant, ttft_deadline_s=deadline_steps * STEP_S,
        )
        arrivals.setdefault(step, []).append(request)
    requests: list[Request] = []
    in_flight = []
    for step in range(1, 3000):
        for request in arrivals.pop(step, []):
            if request.num_prompt_tokens >= config.max_seq_len:
                continue
            scheduler.add_request(request)
            requests.append(request)
        if not scheduler.has_unfinished() and not arrivals and not in_flight:
            break
        plan = scheduler.schedule()
        assert len(scheduler.running) <= max_num_seqs
        plan.want_held_requests = True
        in_flight.append(executor.execute(plan))
        clock.now += STEP_S
        if not pipelined or len(in_flight) == 2 or not plan.has_work:
            output = in_flight.pop(0)
            for update in scheduler.update(output):
                assert update.error is None, update.error
            if not in_flight:
                assert output.held_requests is not None
                assert audit_executor(scheduler, output.held_requests) == [], f"step {step}"
    assert not scheduler.has_unfinished() and not arrivals, "a request starved"
    for request in requests:
        # A request that outgrows the cache ends at its size (LENGTH).
        count = min(request.sampling.max_tokens or 0, config.max_seq_len - request.num_prompt_tokens)
        assert request.output_token_ids == expected_output(request.prompt_token_ids, count)
    assert scheduler.kv.num_free_blocks == num_blocks
    assert all(share.placed(tenant) == 0 for tenant in "abc")
