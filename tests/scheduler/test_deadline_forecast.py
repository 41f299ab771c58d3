"""Deadlines: the online step-time fit, the TTFT forecast behind admission by deadline, the
admission's choice among executors, and earliest-deadline-first order within a priority."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.deadline_admission import Candidate, DeadlineAdmission
from scheduler_service.core.errors import AdmissionRefused, ErrorKind
from scheduler_service.core.policy import Policy
from scheduler_service.core.prefill_share import MIN_PREFILL_TOKENS
from scheduler_service.core.request import Request
from scheduler_service.core.sampling_params import SamplingParams
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.step_timer import MIN_STEPS, StepTimer
from scheduler_service.core.ttft_forecast import forecast_ttft
from tests.helpers.lockstep import FakeClock, Lockstep
from tests.helpers.sched_harness import run


def make(index: int, prompt_len: int = 16, max_tokens: int = 16, **fields: object) -> Request:
    prompt = list(range(1000 * index + 1, 1000 * index + prompt_len + 1))
    return Request(f"r{index}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), **fields)  # type: ignore[arg-type]


def scheduler(policy: Policy = Policy.FCFS, **overrides: object) -> Scheduler:
    base: dict[str, object] = dict(
        num_kv_blocks=1024, block_size=16, max_model_len=4096, max_num_seqs=4, max_num_batched_tokens=64, policy=policy
    )
    base.update(overrides)
    return Scheduler(SchedulerConfig(**base), clock=FakeClock())  # type: ignore[arg-type]


def one_second(tokens: float) -> float:
    """Every step takes a second: a forecast reads in steps."""
    return 1.0


def linear(tokens: float) -> float:
    return 0.01 + 0.0001 * tokens


# ---- StepTimer -------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    overhead=st.floats(0.0005, 0.05),
    per_token=st.floats(1e-6, 1e-3),
    sizes=st.lists(st.integers(1, 4096), min_size=MIN_STEPS, max_size=300).filter(lambda s: len(set(s)) > 1),
)
def test_step_timer_recovers_overhead_and_per_token_cost(overhead: float, per_token: float, sizes: list[int]) -> None:
    timer = StepTimer()
    for tokens in sizes:
        timer.observe(tokens, overhead + per_token * tokens)
    assert timer.ready
    for tokens in (1, 64, 512, 8192):
        assert timer.seconds(tokens) == pytest.approx(overhead + per_token * tokens, rel=1e-6, abs=1e-9)


@settings(max_examples=200, deadline=None)
@given(
    overhead=st.floats(0.0005, 0.05),
    per_token=st.floats(1e-6, 1e-3),
    sizes=st.lists(st.integers(1, 4096), min_size=MIN_STEPS, max_size=300).filter(lambda s: len(set(s)) > 1),
    target=st.floats(0.0, 2.0),
)
def test_step_timer_tokens_within_are_the_most_that_fit_the_time(
    overhead: float, per_token: float, sizes: list[int], target: float
) -> None:
    timer = StepTimer()
    for tokens in sizes:
        timer.observe(tokens, overhead + per_token * tokens)
    tokens = timer.tokens_within(target)
    assert tokens is not None
    if target < overhead * (1 - 1e-6):
        assert tokens == 0
    else:
        # Within one token of the exact answer (float rounding of the fit).
        assert abs(tokens - (target - overhead) / per_token) <= 1 + 1e-6 * tokens


def test_step_timer_tells_no_tokens_within_a_time_until_it_has_a_cost_per_token() -> None:
    timer = StepTimer()
    for _ in range(MIN_STEPS - 1):
        timer.observe(32, 0.02)
        timer.observe(64, 0.03)
    assert timer.tokens_within(0.1) is not None
    flat = StepTimer()
    for _ in range(MIN_STEPS - 1):
        flat.observe(32, 0.02)
    assert flat.tokens_within(0.1) is None
    flat.observe(32, 0.02)
    # Ready, but every step had one size: no cost per token to go by.
    assert flat.ready and flat.tokens_within(0.1) is None


def test_step_timer_is_not_ready_before_enough_steps_and_guesses_the_mean_without_a_slope() -> None:
    timer = StepTimer()
    assert timer.seconds(100) == 0.0
    for _ in range(MIN_STEPS - 1):
        timer.observe(32, 0.02)
    assert not timer.ready
    timer.observe(32, 0.04)
    assert timer.ready
    # Steps all of one size: the mean time, whatever size is asked for.
    assert timer.seconds(4000) == pytest.approx(timer.seconds(1)) == pytest.approx((0.02 * 7 * 0.99 ** 4 + 0.04) / 8, rel=0.05)


def test_step_timer_follows_a_changing_machine() -> None:
    timer = StepTimer()
    for step in range(1000):
        timer.observe(step % 100 + 1, 0.010 + 0.0001 * (step % 100 + 1))
    for step in range(1000):
        timer.observe(step % 100 + 1, 0.020 + 0.0002 * (step % 100 + 1))
    assert timer.seconds(50) == pytest.approx(0.020 + 0.0002 * 50, rel=0.01)


# ---- forecast_ttft ----------------------------------------------------------------------------


@pytest.mark.parametrize("prompt_len", [1, 10, 63, 64, 65, 200, 1000])
def test_a_free_seat_and_an_empty_queue_take_the_prompts_chunks_and_one_step(prompt_len: int) -> None:
    """The plan in flight, then the prompt in chunks of the token budget (64)."""
    empty = scheduler()
    forecast = forecast_ttft(empty, make(0, prompt_len), one_second, mean_output=16)
    chunks = math.ceil(prompt_len / 64)
    assert chunks + 1 <= forecast.ttft_s <= chunks + 2
    assert forecast.step_s == 1.0


@settings(max_examples=300, deadline=None)
@given(
    prompts=st.lists(st.integers(1, 2000), min_size=1, max_size=12),
    outputs=st.lists(st.integers(1, 64), min_size=12, max_size=12),
    running=st.integers(0, 4),
    own_prompt=st.integers(1, 2000),
    overhead_s=st.sampled_from([0.0, 0.001, 0.005, 0.02]),
    per_token_s=st.sampled_from([1e-5, 1e-4, 1e-3, 1e-2]),
    max_num_seqs=st.integers(1, 8),
    budget=st.sampled_from([16, 64, 512, 2048]),
    policy=st.sampled_from([Policy.FCFS, Policy.PRIORITY, Policy.FAIR]),
)
def test_the_forecast_never_falls_as_requests_queue_ahead(
    prompts: list[int],
    outputs: list[int],
    running: int,
    own_prompt: int,
    overhead_s: float,
    per_token_s: float,
    max_num_seqs: int,
    budget: int,
    policy: Policy,
) -> None:
    """Whatever the step costs (per-token heavy, as on a CPU, included)."""
    sched = scheduler(policy, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    # Some requests running, then the queue fills one at a time.
    for index in range(running):
        sched.add_request(make(100 + index, 20, 40))
    if running:
        sched.schedule()
    probe = make(999, own_prompt, 16, priority=5)

    def step_seconds(tokens: float) -> float:
        return overhead_s + per_token_s * tokens

    last = forecast_ttft(sched, probe, step_seconds, mean_output=16)
    for index, (prompt_len, max_tokens) in enumerate(zip(prompts, outputs)):
        sched.add_request(make(index, prompt_len, max_tokens))
        forecast = forecast_ttft(sched, probe, step_seconds, mean_output=16)
        assert forecast.ttft_s >= last.ttft_s - 1e-12, f"fell from {last} to {forecast} at {index + 1} ahead"
        last = forecast


def test_a_prompt_alone_costs_its_prefill_step_after_the_step_in_flight() -> None:
    """500 tokens in one step of 501 (with its own decode slot), after a step of one decode:
    the in-flight step is not costed as a second prefill of this prompt."""
    forecast = forecast_ttft(scheduler(max_num_batched_tokens=512), make(0, 500), linear, mean_output=16)
    assert forecast.ttft_s == pytest.approx(linear(501) + linear(1))


def test_under_priority_only_better_ranked_requests_count_as_ahead() -> None:
    sched = scheduler(Policy.PRIORITY)
    urgent = make(999, 32, 16, priority=0)
    alone = forecast_ttft(sched, urgent, one_second, mean_output=16)
    for index in range(30):
        sched.add_request(make(index, 200, 64, priority=5))
    assert forecast_ttft(sched, urgent, one_second, mean_output=16).ttft_s == alone.ttft_s
    behind = make(998, 32, 16, priority=9)
    assert forecast_ttft(sched, behind, one_second, mean_output=16).ttft_s > 10 * alone.ttft_s


@pytest.mark.parametrize("limit", [None, 40])
def test_the_forecast_counts_the_prefill_steps_the_scheduler_takes_under_a_step_token_limit(limit: int | None) -> None:
    """A 300-token prompt beside eight decodes: in one step without a limit; under a limit of
    40 tokens (--target-itl-ms) in steps of 32 (the least a step gives prefill), ten of them.
    The forecast (one step a second) counts those steps, and one more for the step in flight."""
    probe = make(999, 300, 4)
    forecasts = []

    def arrive(step: int, sched: Scheduler) -> None:
        if step == 3:
            forecasts.append(forecast_ttft(sched, probe, one_second, mean_output=100, step_token_limit=limit))
            sched.add_request(probe)

    config = SchedulerConfig(num_kv_blocks=512, block_size=4, max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=512)
    result = run(config, {1: [make(i, 4, 100) for i in range(8)]}, before_step=arrive, step_token_limit=limit)
    prefill_steps = sum(any(r.request_id == probe.request_id for r in [*p.new_requests, *p.continuing_requests]) for p in result.plans)
    assert prefill_steps == (1 if limit is None else math.ceil(300 / MIN_PREFILL_TOKENS))
    assert forecasts[0].ttft_s == prefill_steps + 1


def test_a_deadline_only_a_limited_executor_would_miss_goes_to_the_other() -> None:
    """Both executors have eight requests decoding; the one whose lane holds steps to 40 tokens
    would compute the 300-token prompt in ten steps, the other in one."""
    request = make(999, 300, 4, ttft_deadline_s=5.0, arrival_time=100.0)
    executors = []
    for _ in range(2):
        sched = scheduler(max_num_seqs=16, max_num_batched_tokens=512)
        for i in range(8):
            sched.add_request(make(i, 4, 100))
        sched.schedule()
        executors.append(sched)
    candidates = [Candidate(executors[0], one_second, step_token_limit=40), Candidate(executors[1], one_second)]
    assert DeadlineAdmission(margin=1.0).choose(request, candidates, preferred=0, now=100.0) == 1
    with pytest.raises(AdmissionRefused):
        DeadlineAdmission(margin=1.0).choose(request, candidates[:1], preferred=0, now=100.0)


# ---- DeadlineAdmission.choose -----------------------------------------------------------------


def loaded() -> Scheduler:
    """Four seats taken by long requests, thirty more queued."""
    sched = scheduler()
    for index in range(34):
        sched.add_request(make(index, 200, 200))
    sched.schedule()
    return sched


def due(deadline_s: float = 0.0, tpot_s: float = 0.0) -> Request:
    return make(500, 32, 16, ttft_deadline_s=deadline_s, tpot_target_s=tpot_s, arrival_time=100.0)


def test_choose_keeps_the_preferred_executor_when_it_meets_the_deadline() -> None:
    admission = DeadlineAdmission()
    candidates = [Candidate(loaded(), linear), Candidate(scheduler(), linear), Candidate(scheduler(), linear)]
    assert admission.choose(due(0.5), candidates, preferred=2, now=100.0) == 2


def test_choose_moves_to_the_only_executor_that_meets_the_deadline() -> None:
    admission = DeadlineAdmission()
    candidates = [Candidate(loaded(), linear), Candidate(loaded(), linear), Candidate(scheduler(), linear)]
    assert admission.choose(due(0.5), candidates, preferred=0, now=100.0) == 2


def test_choose_refuses_with_the_reason_and_a_retry_after_when_no_executor_meets_it() -> None:
    admission = DeadlineAdmission()
    candidates = [Candidate(loaded(), linear), Candidate(loaded(), linear)]
    with pytest.raises(AdmissionRefused, match="ttft_deadline_ms") as refused:
        admission.choose(due(0.5), candidates, preferred=0, now=100.0)
    assert (refused.value.reason, refused.value.kind) == ("deadline", ErrorKind.OVERLOADED)
    assert refused.value.retry_after_s is not None and refused.value.retry_after_s > 0
    # Already waited past most of its deadline: refused even where the queue is empty.
    with pytest.raises(AdmissionRefused) as late:
        admission.choose(due(0.5), [Candidate(scheduler(), linear)], preferred=0, now=100.49)
    assert late.value.reason == "deadline" and late.value.retry_after_s is not None and late.value.retry_after_s > 0


def test_choose_refuses_a_per_token_target_no_executor_meets() -> None:
    admission = DeadlineAdmission()
    with pytest.raises(AdmissionRefused) as refused:
        admission.choose(due(tpot_s=0.001), [Candidate(scheduler(), linear)], preferred=0, now=100.0)
    assert (refused.value.reason, refused.value.kind) == ("tpot", ErrorKind.OVERLOADED)
    assert refused.value.retry_after_s is not None and refused.value.retry_after_s > 0
    assert admission.choose(due(tpot_s=0.05), [Candidate(scheduler(), linear)], preferred=0, now=100.0) == 0


def test_choose_does_not_judge_without_targets_or_without_a_ready_timer() -> None:
    admission = DeadlineAdmission()
    candidates = [Candidate(loaded(), linear), Candidate(scheduler(), linear)]
    assert admission.choose(due(), candidates, preferred=0, now=100.0) == 0
    unready = [Candidate(loaded(), None), Candidate(scheduler(), linear)]
    assert admission.choose(due(0.5), unready, preferred=0, now=100.0) == 0


def test_choose_learns_the_mean_output_from_finished_requests() -> None:
    """Requests that stop on EOS after about 2 tokens free their seats sooner than their
    max_tokens says: once the admission has seen them finish, it forecasts with that (before,
    with the max_tokens of the request it judges)."""
    sched = scheduler()
    for index in range(12):
        sched.add_request(Request(f"q{index}", [7] * 64, SamplingParams(max_tokens=500)))
    request = make(500, 32, 500, ttft_deadline_s=1.0, arrival_time=100.0)
    admission = DeadlineAdmission()
    with pytest.raises(AdmissionRefused):
        admission.choose(request, [Candidate(sched, linear)], preferred=0, now=100.0)
    finished = make(600, 8, 2)
    finished.token_ids += [5, 5]
    for _ in range(100):
        admission.finished(finished)
    assert admission.mean_output == pytest.approx(2.0)
    assert admission.choose(request, [Candidate(sched, linear)], preferred=0, now=100.0) == 0


# ---- earliest deadline first ------------------------------------------------------------------


@pytest.mark.parametrize("policy", [Policy.PRIORITY, Policy.FAIR])
def test_among_equal_priorities_the_earliest_ttft_deadline_is_admitted_first(policy: Policy) -> None:
    config = SchedulerConfig(num_kv_blocks=256, block_size=4, max_model_len=512, max_num_seqs=1, policy=policy)
    run = Lockstep.of(config)
    run.step([make(0, 8, 6)])
    queued = [
        make(1, 8, 4),
        make(2, 8, 4, ttft_deadline_s=5.0),
        make(3, 8, 4, ttft_deadline_s=1.0),
        make(4, 8, 4, priority=1, ttft_deadline_s=0.1),
        make(5, 8, 4, ttft_deadline_s=1.0),
    ]
    run.step(queued)
    run.run_until_done()
    order = sorted(queued, key=lambda r: r.first_scheduled_time or math.inf)
    assert [r.request_id for r in order] == ["r3", "r5", "r2", "r1", "r4"]


def test_fcfs_ignores_deadlines() -> None:
    config = SchedulerConfig(num_kv_blocks=256, block_size=4, max_model_len=512, max_num_seqs=1)
    run = Lockstep.of(config)
    run.step([make(0, 8, 6)])
    queued = [make(1, 8, 4), make(2, 8, 4, ttft_deadline_s=0.5)]
    run.step(queued)
    run.run_until_done()
    assert queued[0].first_scheduled_time < queued[1].first_scheduled_time  # type: ignore[operator]
