"""The fair policy end to end in the planning core: a Scheduler and the SimulatedExecutor in
lockstep, the block books audited after every step. Tenants that keep a backlog get tokens by
weight whatever their requests' shapes, a tenant arriving behind a flood is served at once, and
running out of blocks costs the tenant furthest over its share."""

from __future__ import annotations

import pytest

from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.fair_share import FairShare
from scheduler_service.core.policy import Policy
from scheduler_service.core.request import Request
from scheduler_service.core.sampling_params import SamplingParams
from scheduler_service.core.sim_executor import default_next_token
from tests.helpers.lockstep import Lockstep


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
