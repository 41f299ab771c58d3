"""Speculative decoding planned by the scheduler, against the simulated executor (which verifies
drafts as the executor contract says): the same tokens as decoding one at a time in fewer steps,
the block books agreeing with the executor's after every step, requests with drafts in flight
preempted, swapped out and aborted, stops inside accepted drafts, K adapting to acceptance, and
the batch and budget rules."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import pytest

from scheduler_service.core.audit import audit_executor
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.policy import Policy
from scheduler_service.core.request import FinishReason, Request, RequestStatus
from scheduler_service.core.sampling_params import SamplingParams
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.sim_executor import SimulatedExecutor, TokenFn
from scheduler_service.core.speculation import PROBE_AFTER, Speculation
from scheduler_service.core.step_plan import StepOutput, StepPlan
from scheduler_service.core.suffix_proposer import SuffixTable
from tests.helpers.sched_harness import HandleBook
from tests.helpers.speculation_models import babble, decode_one_at_a_time, echo, recite

PERIOD = 20


def _config(**overrides: object) -> SchedulerConfig:
    settings: dict[str, object] = {
        "num_kv_blocks": 256, "block_size": 4, "max_model_len": 1024, "max_num_batched_tokens": 64,
        "num_speculative_tokens": 4,
    }
    settings.update(overrides)
    return SchedulerConfig(**settings)  # type: ignore[arg-type]


def _quoting(index: int, max_tokens: int, **sampling: object) -> Request:
    """A prompt of three periods of one phrase, which echo(PERIOD) goes on quoting."""
    phrase = list(range(100 + 40 * index, 100 + 40 * index + PERIOD))
    return Request(f"r{index}", phrase * 3, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling))  # type: ignore[arg-type]


@dataclass
class Drive:
    scheduler: Scheduler
    executor: SimulatedExecutor
    plans: list[StepPlan] = field(default_factory=list)
    outputs: dict[str, list[int]] = field(default_factory=dict)
    # When each plan was made: the decode batch (running requests past their prompt), and each
    # running request's outputs.
    batches: list[int] = field(default_factory=list)
    seen: list[dict[str, int]] = field(default_factory=list)


def drive(
    config: SchedulerConfig,
    requests: Iterable[Request],
    model: TokenFn,
    pipelined: bool = False,
    eos: Iterable[int] = (),
    on_output: Callable[[StepOutput], None] = lambda output: None,
    draft: TokenFn | None = None,
) -> Drive:
    """Runs the requests to their end, one plan on the wire (lockstep) or two (as the lane
    does), checking the block books against the executor's whenever none is, and that no plan
    continues a request whose drafts are still out. draft: the executor's draft model."""
    scheduler = Scheduler(config, eos_token_ids=eos)
    run = Drive(scheduler, SimulatedExecutor(config.num_kv_blocks, config.block_size, model, draft_token=draft))
    for request in requests:
        scheduler.add_request(request)
    in_flight: list[tuple[StepPlan, StepOutput]] = []
    book = HandleBook()
    while scheduler.has_unfinished():
        assert len(run.plans) < 5000, "the scheduler did not finish"
        run.batches.append(sum(not r.in_prefill for r in scheduler.running))
        run.seen.append({r.request_id: r.num_output_tokens for r in scheduler.running})
        plan = scheduler.schedule()
        plan.want_held_requests = True
        assert plan.num_scheduled_tokens <= config.max_num_batched_tokens
        drafting = {
            c.request_id for p, _ in in_flight for c in p.continuing_requests if c.draft_token_ids or c.num_model_drafts
        }
        assert not drafting & set(book.scheduled(plan)), "a request with drafts in flight was planned again"
        run.plans.append(plan)
        output = run.executor.execute(plan)
        on_output(output)
        in_flight.append((plan, output))
        if pipelined and len(in_flight) < 2 and plan.has_work:
            continue
        _, output = in_flight.pop(0)
        _apply(run, output)
        if not in_flight:
            assert output.held_requests is not None
            assert audit_executor(scheduler, output.held_requests) == [], f"step {len(run.plans)}"
    for _, output in in_flight:
        _apply(run, output)
    assert scheduler.kv.num_free_blocks == config.num_kv_blocks
    return run


def _apply(run: Drive, output: StepOutput) -> None:
    for update in run.scheduler.update(output):
        assert update.error is None, update.error
        run.outputs.setdefault(update.request_id, []).extend(update.new_token_ids)


def _drafts(plan: StepPlan) -> dict[str, list[int]]:
    return {c.request_id: c.draft_token_ids for c in plan.continuing_requests if c.draft_token_ids}


def _model_drafts(plan: StepPlan) -> dict[str, int]:
    return {c.request_id: c.num_model_drafts for c in plan.continuing_requests if c.num_model_drafts}


def _requests() -> list[Request]:
    return [_quoting(i, 30 + 7 * i, logprobs=1 if i == 2 else None) for i in range(5)]


@pytest.mark.parametrize("pipelined", [False, True])
def test_speculation_gives_the_tokens_of_decoding_one_at_a_time_in_fewer_steps(pipelined: bool) -> None:
    model = echo(PERIOD)
    plain = drive(_config(num_speculative_tokens=0), _requests(), model, pipelined)
    speculating = drive(_config(), _requests(), model, pipelined)
    for request in _requests():
        reference = decode_one_at_a_time(model, request.prompt_token_ids, request.sampling.max_tokens or 0)
        assert plain.outputs[request.request_id] == reference
        assert speculating.outputs[request.request_id] == reference
    assert not any(_drafts(plan) for plan in plain.plans)
    speculation = speculating.scheduler.speculation
    assert speculation.num_accepted_tokens > speculation.num_draft_tokens / 2
    # Fewer steps: in lockstep by half; pipelined, a request sits out the step planned while
    # its drafts are out, and still gains.
    assert len(speculating.plans) < len(plain.plans) * (0.5 if not pipelined else 0.85)


@pytest.mark.parametrize("pipelined", [False, True])
def test_the_executors_draft_model_proposes_with_the_draft_method_and_the_tokens_stay_those_of_decoding_one_at_a_time(
    pipelined: bool,
) -> None:
    """The plan asks for num_model_drafts (never tokens); the executor's draft model, right at
    most positions and wrong every 7th, proposes them; every request answers the tokens of
    decoding one at a time, in fewer steps, its K adapting."""
    model, draft = echo(PERIOD), echo(PERIOD, every=7)
    plain = drive(_config(num_speculative_tokens=0), _requests(), model, pipelined)
    run = drive(_config(speculative_method="draft"), _requests(), model, pipelined, draft=draft)
    for request in _requests():
        reference = decode_one_at_a_time(model, request.prompt_token_ids, request.sampling.max_tokens or 0)
        assert run.outputs[request.request_id] == reference
    assert not any(_drafts(plan) for plan in run.plans)
    asked = [count for plan in run.plans for count in _model_drafts(plan).values()]
    assert asked and max(asked) == 4 and min(asked) >= 1
    speculation = run.scheduler.speculation
    assert speculation.num_draft_tokens == sum(asked)
    assert speculation.num_draft_tokens / 2 < speculation.num_accepted_tokens < speculation.num_draft_tokens
    assert len(run.plans) < len(plain.plans) * (0.6 if not pipelined else 0.9)


def test_ngram_drafts_are_not_held_back_by_a_low_estimate() -> None:
    """A proposal from the scheduler costs only its verify rows when wrong: a request whose
    estimate sank still takes drafts wherever its tokens hold a match, at K 1."""
    speculation = Speculation(_config(num_speculative_tokens=4))
    request = _quoting(0, 500)
    speculation.begin_step([request])
    for _ in range(6):
        drafts = speculation.drafts_for(request, budget=100)
        assert drafts.token_ids
        speculation.sent(request)
        assert speculation.verified(request, drafts, [7]) is None
    assert speculation.k_of(request) == 1
    assert len(speculation.drafts_for(request, budget=100)) == 1


def test_a_new_request_starts_from_the_proposers_recent_acceptance() -> None:
    speculation = Speculation(_config(num_speculative_tokens=4, speculative_method="draft"))
    requests = [_quoting(i, 500) for i in range(13)]
    speculation.begin_step(requests)

    def verify_all(request: Request, accept: bool) -> int:
        """Verifies the request's drafts until it gets none; returns how many verifies."""
        count = 0
        while drafts := speculation.drafts_for(request, budget=100):
            speculation.sent(request)
            assert speculation.verified(request, drafts, [7] * len(drafts) + [7] if accept else [7]) is None
            count += 1
            if count == 20:
                break
        return count

    # Each request in turn, its drafts failing: the first starts at the flag's K and verifies
    # until its estimate sinks; later ones start lower, and soon with no verify at all (their
    # first drafts wait for a probe).
    assert speculation.k_of(requests[0]) == 4
    failed = [verify_all(request, accept=False) for request in requests[:12]]
    assert failed[0] == 3 and failed == sorted(failed, reverse=True) and failed[-2:] == [0, 0], failed
    assert [len(speculation.drafts_for(requests[11], budget=100)) for _ in range(PROBE_AFTER - 1)] == [0] * (PROBE_AFTER - 1)
    # Once drafts are accepted again, new requests start high.
    assert verify_all(requests[11], accept=True) == 20
    assert len(speculation.drafts_for(requests[12], budget=100)) >= 3


def test_a_draft_model_that_is_never_right_costs_only_probes() -> None:
    """The draft model always has a proposal; once its requests' estimates say drafts do not
    pay, they decode plain and pipelined, verifying only every PROBE_AFTER tokens."""
    model = echo(PERIOD)

    def wrong(request_id: str, tokens: Sequence[int]) -> int:
        return model(request_id, tokens) + 1

    run = drive(_config(speculative_method="draft"), _requests(), model, pipelined=True, draft=wrong)
    for request in _requests():
        assert run.outputs[request.request_id] == decode_one_at_a_time(model, request.prompt_token_ids, request.sampling.max_tokens or 0)
    verifies = [count for plan in run.plans for count in _model_drafts(plan).values()]
    outputs = sum(map(len, run.outputs.values()))
    assert run.scheduler.speculation.num_accepted_tokens == 0
    # A few verifies each while the estimate falls, then one per PROBE_AFTER tokens.
    assert len(verifies) <= len(run.outputs) * 3 + outputs / PROBE_AFTER


def test_penalised_requests_take_drafts_as_entries_like_the_rest_and_decode_in_bulk_without() -> None:
    # SmolLM2's generation_config asks repetition_penalty 1.1: such requests must speculate.
    def requests() -> list[Request]:
        return [
            _quoting(0, 20),
            _quoting(8, 20, repetition_penalty=1.1),
            _quoting(9, 20, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.3),
        ]

    model = echo(PERIOD)
    run = drive(_config(max_num_batched_tokens=256), requests(), model)
    for request in requests():
        assert any(request.request_id in _drafts(plan) for plan in run.plans)
        reference = decode_one_at_a_time(model, request.prompt_token_ids, request.sampling.max_tokens or 0)
        assert run.outputs[request.request_id] == reference
    # A request that may take drafts is an entry of its own, never a decode in bulk.
    assert not any(plan.decode_handles for plan in run.plans)
    # Without speculation all decode in bulk.
    off = drive(_config(num_speculative_tokens=0, max_num_batched_tokens=256), requests(), model)
    assert not {c.request_id for plan in off.plans for c in plan.continuing_requests}


def test_no_drafts_before_min_tokens_are_reached() -> None:
    run = drive(_config(), [_quoting(0, 40, min_tokens=12)], echo(PERIOD))
    drafted = [seen["r0"] for plan, seen in zip(run.plans, run.seen, strict=True) if _drafts(plan)]
    assert drafted and min(drafted) >= 12


def _until_drafted(scheduler: Scheduler, executor: SimulatedExecutor, request_id: str) -> tuple[StepPlan, StepOutput]:
    """Steps in lockstep until a plan carries drafts for the request; returns it run, its
    result not yet taken."""
    for _ in range(100):
        plan = scheduler.schedule()
        output = executor.execute(plan)
        if request_id in _drafts(plan):
            return plan, output
        scheduler.update(output)
    raise AssertionError(f"{request_id} never got drafts")


def _finish_in_lockstep(scheduler: Scheduler, executor: SimulatedExecutor, outputs: dict[str, list[int]]) -> None:
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        plan.want_held_requests = True
        output = executor.execute(plan)
        for update in scheduler.update(output):
            assert update.error is None, update.error
            outputs.setdefault(update.request_id, []).extend(update.new_token_ids)
        assert output.held_requests is not None
        assert audit_executor(scheduler, output.held_requests) == []


@pytest.mark.parametrize("num_host_blocks", [0, 64])
def test_a_request_preempted_with_drafts_in_flight_still_gets_the_right_tokens(num_host_blocks: int) -> None:
    """A higher priority takes the only seat while the running request's drafts are out: without
    a host tier it is recomputed and the drafts' answer is stale; with one its K/V is swapped
    out, and the answer still counts."""
    model = echo(PERIOD)
    config = _config(max_num_seqs=1, policy=Policy.PRIORITY, num_host_blocks=num_host_blocks)
    scheduler = Scheduler(config)
    executor = SimulatedExecutor(config.num_kv_blocks, config.block_size, model)
    low = _quoting(0, 40)
    low.priority = 5
    scheduler.add_request(low)
    _, drafted = _until_drafted(scheduler, executor, "r0")
    outputs = {"r0": list(low.output_token_ids)}
    verified = scheduler.speculation.num_verified
    high = _quoting(1, 10)
    scheduler.add_request(high)
    plan = scheduler.schedule()
    assert low.status is RequestStatus.WAITING and [n.request_id for n in plan.new_requests] == ["r1"]
    assert scheduler.kv.is_swapped("r0") == bool(num_host_blocks)
    for update in scheduler.update(drafted):
        outputs["r0"].extend(update.new_token_ids)
    assert scheduler.speculation.num_verified == verified + bool(num_host_blocks)
    for update in scheduler.update(executor.execute(plan)):
        outputs.setdefault(update.request_id, []).extend(update.new_token_ids)
    _finish_in_lockstep(scheduler, executor, outputs)
    for request in (low, high):
        reference = decode_one_at_a_time(model, request.prompt_token_ids, request.sampling.max_tokens or 0)
        assert outputs[request.request_id] == reference
    assert scheduler.kv.num_free_blocks == config.num_kv_blocks
    assert scheduler.num_swapped_out == bool(num_host_blocks)


def test_an_abort_with_drafts_in_flight_frees_the_blocks_at_once_and_the_answer_is_dropped() -> None:
    config = _config()
    scheduler = Scheduler(config)
    executor = SimulatedExecutor(config.num_kv_blocks, config.block_size, echo(PERIOD))
    scheduler.add_request(_quoting(0, 40))
    _, drafted = _until_drafted(scheduler, executor, "r0")
    assert scheduler.abort("r0")
    assert scheduler.kv.num_free_blocks == config.num_kv_blocks and "r0" in scheduler.pending_drops
    assert list(scheduler.update(drafted)) == [] and scheduler.speculation.num_verified == 0
    plan = scheduler.schedule()
    plan.want_held_requests = True
    assert plan.dropped_request_ids == ["r0"] and not plan.has_work
    output = executor.execute(plan)
    assert output.held_requests == {} and audit_executor(scheduler, output.held_requests) == []


def _with_logprobs(output: StepOutput) -> None:
    """A record per sampled token, as an executor gives a request that asked for logprobs."""
    for request_id, tokens in output.sampled.items():
        output.logprobs[request_id] = [("logprob of", token) for token in tokens]


@pytest.mark.parametrize("how", ["stop token", "eos"])
def test_a_stop_inside_accepted_drafts_ends_the_request_there(how: str) -> None:
    """The phrase quoted holds the stop; the executor accepts drafts past it, and the tokens
    (and logprobs) after it are dropped."""
    stop = 105
    phrase = list(range(100, 100 + PERIOD))
    sampling = SamplingParams(max_tokens=60, logprobs=0, stop_token_ids=(stop,) if how == "stop token" else ())
    request = Request("r", phrase * 2 + phrase[:3], sampling)
    answers: list[list[int]] = []

    def record(output: StepOutput) -> None:
        _with_logprobs(output)
        answers.extend(list(tokens) for tokens in output.sampled.values())

    run = drive(_config(), [request], echo(PERIOD, every=1000), eos=(stop,) if how == "eos" else (), on_output=record)
    assert run.outputs["r"] == [103, 104, 105]
    assert request.finish_reason is FinishReason.STOP
    assert request.stop_reason == (str(stop) if how == "stop token" else None)
    assert any(stop in tokens and tokens[-1] != stop for tokens in answers), "no drafts were accepted past the stop"


def test_logprobs_stay_one_per_token_delivered() -> None:
    scheduler = Scheduler(_config())
    executor = SimulatedExecutor(256, 4, echo(PERIOD))
    request = _quoting(0, 30, logprobs=1)
    scheduler.add_request(request)
    while scheduler.has_unfinished():
        output = executor.execute(scheduler.schedule())
        _with_logprobs(output)
        for update in scheduler.update(output):
            assert [token for _, token in update.new_logprobs] == update.new_token_ids  # type: ignore[misc]
    assert scheduler.speculation.num_accepted_tokens > 0


def test_k_shrinks_under_low_acceptance_and_never_passes_the_flag() -> None:
    rng_prompt = [10 + (i * 7919) % 5 for i in range(60)]
    request = Request("r", rng_prompt, SamplingParams(max_tokens=300, ignore_eos=True))
    run = drive(_config(num_speculative_tokens=6), [request], babble(5))
    drafted = [len(drafts) for plan in run.plans for drafts in _drafts(plan).values()]
    speculation = run.scheduler.speculation
    assert max(drafted) == 6 and drafted[0] == 6
    assert speculation.num_accepted_tokens < 0.4 * speculation.num_draft_tokens
    late = drafted[len(drafted) // 2 :]
    assert sum(late) / len(late) < 2.5
    assert run.outputs["r"] == decode_one_at_a_time(babble(5), rng_prompt, 300)


def test_draft_model_drafts_that_do_not_pay_wait_for_probes_that_back_off_and_k_climbs_back_to_the_flag_when_accepted() -> None:
    speculation = Speculation(_config(num_speculative_tokens=5, speculative_method="draft"))
    request = _quoting(0, 500)
    speculation.begin_step([request])
    ks = []

    def attempt(accept: bool) -> bool:
        """One step's drafts for the request, verified (all accepted or none); False when it
        got none (a plain decode)."""
        drafts = speculation.drafts_for(request, budget=100)
        if not drafts:
            return False
        assert len(drafts) <= 5
        speculation.sent(request)
        assert speculation.verified(request, drafts, [7] * len(drafts) + [7] if accept else [7]) is None
        ks.append(speculation.k_of(request))
        return True

    def plain(count: int) -> None:
        assert not any(attempt(False) for _ in range(count))

    assert all(attempt(False) for _ in range(3))
    # Its estimate now says a verify yields under two tokens: it decodes without drafts until
    # it has so decoded PROBE_AFTER tokens, then probes; each probe that accepts nothing doubles
    # the wait.
    assert ks[-1] <= 2
    plain(PROBE_AFTER)
    assert attempt(False)
    plain(2 * PROBE_AFTER)
    assert attempt(False)
    plain(4 * PROBE_AFTER)
    # Accepted drafts bring the wait back to PROBE_AFTER, and K climbs back to the flag.
    assert attempt(True)
    plain(PROBE_AFTER - 1)
    for _ in range(100):
        attempt(True)
    assert ks[-1] == 5 and max(ks) == 5


def test_no_drafts_while_the_decode_batch_reaches_the_max() -> None:
    requests = [_quoting(i, max_tokens) for i, max_tokens in enumerate((8, 16, 40, 80))]
    run = drive(_config(speculative_max_batch=3, max_num_batched_tokens=256), requests, echo(PERIOD))
    with_drafts = [batch for plan, batch in zip(run.plans, run.batches, strict=True) if _drafts(plan)]
    assert with_drafts and max(with_drafts) < 3
    assert any(batch >= 3 for batch in run.batches)


def test_drafts_come_out_of_the_budget_left_after_every_running_requests_token() -> None:
    requests = [_quoting(i, 100) for i in range(3)]
    # drive asserts that no plan passes the budget of 6.
    run = drive(_config(max_num_batched_tokens=6, max_num_seqs=3), requests, echo(PERIOD))
    decoding = [
        plan for plan in run.plans
        if len(plan.continuing_requests) == 3
        and all(c.num_scheduled_tokens == 1 or c.draft_token_ids for c in plan.continuing_requests)
    ]
    # Three decodes leave three tokens of drafts in a step, never more.
    assert any(_drafts(plan) for plan in decoding)
    assert all(sum(map(len, _drafts(plan).values())) <= 3 for plan in decoding)


ANSWER = list(range(300, 380))


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_suffix_learns_an_answer_across_requests(method: str) -> None:
    """Two requests with unrelated prompts give the same answer, one after the other: the
    second is drafted from the first's with suffix; prompt lookup finds nothing in its own
    tokens."""
    config = _config(speculative_method=method)
    scheduler = Scheduler(config)
    executor = SimulatedExecutor(config.num_kv_blocks, config.block_size, recite(ANSWER))
    outputs: dict[str, list[int]] = {}
    steps: dict[str, int] = {}
    for request_id, prompt in (("a", list(range(1, 13))), ("b", list(range(41, 53)))):
        scheduler.add_request(Request(request_id, prompt, SamplingParams(max_tokens=60, ignore_eos=True)))
        before = scheduler.num_steps
        _finish_in_lockstep(scheduler, executor, outputs)
        steps[request_id] = scheduler.num_steps - before
    assert outputs["a"] == outputs["b"] == ANSWER[:60]
    if method == "ngram":
        assert steps["b"] == steps["a"] == 60
    else:
        assert steps["b"] < steps["a"] / 3


def test_executors_share_one_suffix_table() -> None:
    """The engine's table serves every executor's scheduler: what one executor's request said
    drafts another's."""
    model = recite(ANSWER)
    config = _config(speculative_method="suffix")
    table = SuffixTable()
    first, second = Scheduler(config, suffixes=table), Scheduler(config, suffixes=table)
    outputs: dict[str, list[int]] = {}
    first.add_request(Request("a", list(range(1, 13)), SamplingParams(max_tokens=60, ignore_eos=True)))
    _finish_in_lockstep(first, SimulatedExecutor(256, 4, model), outputs)
    second.add_request(Request("b", list(range(41, 53)), SamplingParams(max_tokens=60, ignore_eos=True)))
    _finish_in_lockstep(second, SimulatedExecutor(256, 4, model), outputs)
    assert outputs["b"] == ANSWER[:60] and second.num_steps < first.num_steps / 3
    assert second.speculation.num_accepted_tokens > 40
