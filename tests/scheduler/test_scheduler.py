"""Scheduler behaviour beyond the seed scenarios: chunking, prefix hits, priorities, stops,
aborts, pipelining, and a fuzz of random workloads against the simulated executor."""

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from scheduler_service.core.audit import audit_executor
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.errors import ErrorKind, RequestError, RequestRejected
from scheduler_service.core.policy import Policy, StepMode
from scheduler_service.core.request import FinishReason, Request
from scheduler_service.core.sampling_params import SamplingParams
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.sim_executor import SimulatedExecutor, default_next_token
from tests.helpers.sched_harness import HandleBook, make_request, run, scheduled_ids


def config(**overrides: object) -> SchedulerConfig:
    base: dict[str, object] = dict(num_kv_blocks=64, block_size=4, max_model_len=512)
    base.update(overrides)
    return SchedulerConfig(**base)  # type: ignore[arg-type]


def expected_output(prompt: list[int], count: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(count):
        tokens.append(default_next_token("", tokens))
    return tokens[len(prompt) :]


def test_long_prompt_is_chunked_under_the_token_budget_beside_decodes() -> None:
    result = run(
        config(max_num_batched_tokens=16),
        {1: [make_request(0, 6, 4)], 2: [make_request(1, 40, 2)]},
    )
    assert result.lines[:5] == [
        "r0:6 | W: | R: r0",
        "r1:15 r0:1 | W: | R: r0 r1",                 # r0's decode, then r1's first chunk fills up
        "r0:1 r1:15 | W: | R: r0 r1",
        "r0:1 r1:10 | W: | R: r1",                    # r1's last chunk samples its first token
        "r1:1 | W: | R:",
    ]
    assert all(p.num_scheduled_tokens <= 16 for p in result.plans)
    assert result.outputs["r1"] == expected_output(list(range(101, 141)), 2)


def test_prefix_hits_count_as_computed_and_are_reported() -> None:
    shared = list(range(1, 13))
    first = Request("a", shared + [50], SamplingParams(max_tokens=2, ignore_eos=True))
    second = Request("b", shared + [60, 61], SamplingParams(max_tokens=2, ignore_eos=True))
    result = run(config(), {1: [first], 4: [second]})
    new_b = next(n for p in result.plans for n in p.new_requests if n.request_id == "b")
    assert new_b.num_computed_tokens == 12 and new_b.num_scheduled_tokens == 2
    assert second.num_cached_tokens == 12
    assert result.outputs["b"] == expected_output(shared + [60, 61], 2)


def test_priority_policy_admits_by_priority_and_preempts_only_lower_ranks() -> None:
    cfg = config(num_kv_blocks=6, block_size=4, max_num_seqs=2, policy=Policy.PRIORITY)
    low = make_request(0, 4, 12, priority=5)
    high = make_request(1, 4, 12, priority=0)
    mid = make_request(2, 4, 3, priority=1)
    result = run(cfg, {1: [low], 2: [mid, high]})
    # high and mid outrank low: they run first once admitted, and low is the one preempted.
    assert result.finished_at["r2"] < result.finished_at["r0"]
    assert result.finished_at["r1"] < result.finished_at["r0"]
    assert low.num_preemptions >= 1 and high.num_preemptions == 0
    assert {k: len(v) for k, v in result.outputs.items()} == {"r0": 12, "r1": 12, "r2": 3}


def test_stop_conditions() -> None:
    eos = default_next_token("", [1, 2, 3])
    scheduler = Scheduler(config(max_model_len=8), eos_token_ids=[eos])
    executor = SimulatedExecutor(64, 4)
    cases = {
        "eos": Request("eos", [1, 2, 3], SamplingParams()),
        "ignore": Request("ignore", [1, 2, 3], SamplingParams(ignore_eos=True, max_tokens=2)),
        "stop-id": Request("stop-id", [1, 2, 3], SamplingParams(stop_token_ids=(eos,), ignore_eos=True)),
        "min": Request("min", [1, 2, 3], SamplingParams(min_tokens=2, max_tokens=3)),
        "model-len": Request("model-len", [7, 7, 7], SamplingParams(ignore_eos=True)),
    }
    for request in cases.values():
        scheduler.add_request(request)
    while scheduler.has_unfinished():
        scheduler.update(executor.execute(scheduler.schedule()))
    assert (cases["eos"].finish_reason, cases["eos"].num_output_tokens) == (FinishReason.STOP, 1)
    assert (cases["ignore"].finish_reason, cases["ignore"].num_output_tokens) == (FinishReason.LENGTH, 2)
    assert (cases["stop-id"].finish_reason, cases["stop-id"].stop_reason) == (FinishReason.STOP, str(eos))
    assert cases["min"].num_output_tokens == 3
    assert (cases["model-len"].finish_reason, cases["model-len"].num_tokens) == (FinishReason.LENGTH, 8)
    assert scheduler.kv.num_free_blocks == 64


def test_rejections_name_the_problem() -> None:
    scheduler = Scheduler(config(num_kv_blocks=2, block_size=4, max_model_len=100))
    with pytest.raises(RequestRejected, match="KV cache of 2 blocks x 4 tokens") as too_big:
        scheduler.add_request(Request("big", list(range(9))))
    assert too_big.value.kind is ErrorKind.TOO_LARGE
    with pytest.raises(RequestRejected, match="empty"):
        scheduler.add_request(Request("empty", []))
    scheduler.add_request(Request("x", [1]))
    with pytest.raises(RequestRejected, match="already in flight"):
        scheduler.add_request(Request("x", [1]))


def test_abort_frees_blocks_at_once_and_tells_the_executor() -> None:
    scheduler = Scheduler(config())
    executor = SimulatedExecutor(64, 4)
    book = HandleBook()
    for i in range(3):
        scheduler.add_request(make_request(i, 9, 50))
    first = scheduler.schedule()
    book.scheduled(first)
    scheduler.update(executor.execute(first))
    assert scheduler.abort("r1") and not scheduler.abort("r1")
    assert scheduler.kv.num_free_blocks == 64 - 2 * 3
    plan = scheduler.schedule()
    assert plan.dropped_request_ids == ["r1"] and scheduled_ids(plan, book) == ["r0", "r2"]
    executor.execute(plan)
    assert "r1" not in executor.requests


def test_a_refused_entry_ends_its_request_and_leaves_nothing_in_the_prefix_cache() -> None:
    scheduler = Scheduler(config())
    executor = SimulatedExecutor(64, 4)
    prompt = list(range(1, 14))
    scheduler.add_request(Request("bad", prompt, SamplingParams(max_tokens=3)))
    plan = scheduler.schedule()
    output = executor.execute(plan)
    output.sampled.pop("bad")
    output.rejected["bad"] = RequestError(ErrorKind.INVALID, "temperature must be finite")
    [update] = scheduler.update(output)
    assert update.finished and update.error == RequestError(
        ErrorKind.INVALID, "the executor refused request bad: temperature must be finite"
    )
    assert scheduler.kv.num_free_blocks == 64
    # The refused step never wrote those blocks: a request with the same prompt computes it all.
    assert scheduler.kv.find_cached_prefix(prompt).num_tokens == 0


def test_a_late_result_never_reaches_a_new_request_that_reuses_the_id() -> None:
    scheduler = Scheduler(config())
    executor = SimulatedExecutor(64, 4)
    first = Request("same", [5, 6, 7], SamplingParams(max_tokens=20, ignore_eos=True))
    scheduler.add_request(first)
    in_flight = [executor.execute(scheduler.schedule()), executor.execute(scheduler.schedule())]
    scheduler.finish(first, FinishReason.STOP, "a stop string")
    second = Request("same", [9, 9, 9], SamplingParams(max_tokens=2, ignore_eos=True))
    scheduler.add_request(second)
    assert list(scheduler.update(in_flight.pop(0))) == [] and list(scheduler.update(in_flight.pop(0))) == []
    assert second.num_tokens == 3 and second.num_pending_outputs == 0
    while scheduler.has_unfinished():
        scheduler.update(executor.execute(scheduler.schedule()))
    assert second.output_token_ids == expected_output([9, 9, 9], 2)


def test_pipelined_planning_gives_the_same_tokens() -> None:
    """Plan N+1 goes out before result N returns, as the engine loop does."""
    requests = {i: make_request(i, 3 + 7 * i, 5 + i) for i in range(6)}
    scheduler = Scheduler(config(num_kv_blocks=12, max_num_batched_tokens=20))
    executor = SimulatedExecutor(12, 4)
    for request in requests.values():
        scheduler.add_request(request)
    in_flight = [executor.execute(scheduler.schedule())]
    while scheduler.has_unfinished():
        in_flight.append(executor.execute(scheduler.schedule()))
        scheduler.update(in_flight.pop(0))
    for i, request in requests.items():
        assert request.output_token_ids == expected_output(request.prompt_token_ids, 5 + i)
    assert scheduler.num_preemptions > 0 and scheduler.kv.num_free_blocks == 12


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    specs=st.lists(
        st.tuples(st.integers(1, 30), st.integers(1, 12), st.integers(0, 3), st.integers(1, 6)),
        min_size=1,
        max_size=12,
    ),
    num_blocks=st.integers(8, 24),
    block_size=st.sampled_from([2, 4, 8]),
    budget=st.integers(4, 64),
    max_num_seqs=st.integers(1, 6),
    policy=st.sampled_from(list(Policy)),
    mode=st.sampled_from(list(StepMode)),
    pipelined=st.booleans(),
    aborts=st.sets(st.integers(0, 11), max_size=3),
    stopped=st.sets(st.integers(0, 11), max_size=3),
    failing=st.sets(st.integers(1, 40), max_size=4),
    # A hybrid model's recurrent-state slots (0: none), which cap the requests running at once,
    # and its checkpoints every so many blocks (0: none, and no prefix caching), which share them.
    num_state_slots=st.integers(0, 3),
    state_checkpoint_blocks=st.integers(0, 2),
)
# A request retried alone after a failed step that had to preempt itself for blocks was admitted
# straight back each step, while the decode that would free those blocks never ran.
@example(
    specs=[(1, 1, 0, 1), (1, 1, 0, 1), (6, 3, 0, 2), (1, 1, 0, 1), (8, 2, 0, 1)],
    num_blocks=8, block_size=2, budget=7, max_num_seqs=2, policy=Policy.FCFS,
    mode=StepMode.PREFILL_FIRST, pipelined=True, aborts={0, 1, 3}, stopped=set(), failing={1, 4},
    num_state_slots=0, state_checkpoint_blocks=0,
)
# A retried request was admitted beside the step's bulk decodes, which the check for "others in
# this step" did not count.
@example(
    specs=[(1, 1, 0, 1), (3, 1, 0, 1), (1, 2, 0, 1)],
    num_blocks=8, block_size=2, budget=4, max_num_seqs=3, policy=Policy.FCFS,
    mode=StepMode.MIXED, pipelined=True, aborts=set(), stopped=set(), failing={1},
    num_state_slots=0, state_checkpoint_blocks=0,
)
def test_random_workloads_finish_with_the_right_tokens_and_free_every_block(
    specs, num_blocks, block_size, budget, max_num_seqs, policy, mode, pipelined, aborts, stopped, failing,
    num_state_slots, state_checkpoint_blocks,
) -> None:
    cfg = SchedulerConfig(
        num_kv_blocks=num_blocks, block_size=block_size, max_model_len=256,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, policy=policy, mode=mode,
        num_state_slots=num_state_slots, state_checkpoint_blocks=state_checkpoint_blocks,
    )
    scheduler = Scheduler(cfg)
    # The executor's forward raises at the steps in `failing`, whatever they hold.
    executor = SimulatedExecutor(
        num_blocks, block_size, fail_step=lambda plan, ids: "boom" if plan.step_id in failing else None,
        num_state_slots=num_state_slots,
    )
    requests: list[Request] = []
    errors: dict[str, RequestError] = {}
    for index, (prompt_len, max_tokens, priority, stem) in enumerate(specs):
        # Requests share stems so prefix hits, revivals and evictions all happen.
        prompt = [stem] * min(prompt_len, 8) + list(range(index * 50, index * 50 + prompt_len - 8))
        # Every third request wants logprobs, so it stays out of the bulk decodes beside them.
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=1 if index % 3 == 0 else None)
        request = Request(f"q{index}", prompt, sampling, priority)
        try:
            scheduler.add_request(request)
            requests.append(request)
        except RequestRejected:
            assert len(prompt) >= num_blocks * block_size
    in_flight = []
    book = HandleBook()
    for step in range(2000):
        if not scheduler.has_unfinished():
            break
        if step == 3:
            for index in aborts:
                scheduler.abort(f"q{index}")
        if step == 5:
            # A stop string ends a request from outside the planner, mid-pipeline; a new request
            # takes over its id at once.
            for index in stopped:
                old = scheduler.requests.get(f"q{index}")
                if old is not None:
                    scheduler.finish(old, FinishReason.STOP, "stop string")
                    fresh = Request(f"q{index}", [7, index, 7], SamplingParams(max_tokens=4, ignore_eos=True))
                    scheduler.add_request(fresh)
                    requests.append(fresh)
        plan = scheduler.schedule()
        assert plan.num_scheduled_tokens <= budget
        assert len(scheduler.running) <= max_num_seqs
        assert not num_state_slots or len(scheduler.running) <= num_state_slots
        ids = scheduled_ids(plan, book)
        retried = [i for i in ids if scheduler.requests[i].retry_alone]
        assert not retried or ids == retried, "a retry shares its step"
        plan.want_held_requests = True
        in_flight.append(executor.execute(plan))
        if not pipelined or len(in_flight) == 2 or not plan.has_work:
            output = in_flight.pop(0)
            for update in scheduler.update(output):
                if update.error is not None:
                    errors[update.request_id] = update.error
            # The books (blocks, slots, checkpoints) against the executor's, with no plan out.
            if not in_flight:
                assert output.held_requests is not None
                assert audit_executor(scheduler, output.held_requests) == [], f"step {step}"
    assert not scheduler.has_unfinished(), "a request starved"
    # Only a request whose retry failed too ends in error, and each failed step ends one at most.
    assert len(errors) <= len(failing)
    assert all(
        e.kind is ErrorKind.INTERNAL and "failed in the executor twice: boom" in e.message
        for e in errors.values()
    )
    for request in requests:
        expected = min(request.sampling.max_tokens, num_blocks * block_size - request.num_prompt_tokens)
        reference = expected_output(request.prompt_token_ids, expected)
        if request.finish_reason is FinishReason.LENGTH:
            assert request.output_token_ids == reference
        else:
            assert request.output_token_ids == reference[: request.num_output_tokens]
    assert scheduler.kv.num_free_blocks == num_blocks
    # Slots keeping checkpoints count as free, as cached blocks do.
    assert scheduler.kv.state_slots.holders() == {}
    assert scheduler.kv.stats().num_free_state_slots == num_state_slots


def test_a_failed_step_is_retried_alone_and_only_the_request_that_fails_again_ends() -> None:
    """r1 makes every forward it is part of raise from step 3 on. The three requests of step 3
    are recomputed one at a time; r1 fails alone and ends with the executor's error, while r0
    and r2 pass their retries, run together again and finish with the right tokens."""
    requests = [make_request(i, 5, 8) for i in range(3)]
    result = run(
        config(),
        {1: requests},
        fail_step=lambda plan, ids: "poisoned" if plan.step_id >= 3 and "r1" in ids else None,
    )
    assert result.errors == {
        "r1": RequestError(ErrorKind.INTERNAL, "request r1 failed in the executor twice: poisoned")
    }
    for request in (requests[0], requests[2]):
        assert result.outputs[request.request_id] == expected_output(request.prompt_token_ids, 8)
    # Recomputes start from each request's own cached first block.
    assert result.lines[2:7] == [
        "r0:1 r1:1 r2:1 | W: r0 r1 r2 | R:",
        "r0:3 | W: r1 r2 | R: r0",
        "r1:3 | W: r2 | R: r0",
        "r2:3 | W: | R: r0 r2",
        "r0:1 r2:1 | W: | R: r0 r2",
    ]


def test_a_stop_string_ends_a_request_through_the_scheduler_whatever_else_ended_it() -> None:
    scheduler = Scheduler(config())
    executor = SimulatedExecutor(64, 4)
    running = Request("running", [5, 6, 7], SamplingParams(max_tokens=10, ignore_eos=True))
    at_length = Request("at_length", [8, 9], SamplingParams(max_tokens=1, ignore_eos=True))
    scheduler.add_request(running)
    scheduler.add_request(at_length)
    updates = scheduler.update(executor.execute(scheduler.schedule()))
    assert [u.finished for u in updates] == [False, True]
    for request in (running, at_length):
        scheduler.stop_at_string(request, "END")
        assert (request.finish_reason, request.stop_reason) == (FinishReason.STOP, "END")
    assert not scheduler.has_unfinished() and scheduler.kv.num_free_blocks == 64
    assert sorted(scheduler.schedule().dropped_request_ids) == ["at_length", "running"]


def test_a_request_waits_for_a_shared_prefix_being_computed_instead_of_computing_it_twice() -> None:
    """Two prompts sharing 3 blocks arrive together: the second is held back one step, then
    starts from the cached blocks, and both produce the right tokens."""
    scheduler = Scheduler(config(max_num_batched_tokens=64))
    executor = SimulatedExecutor(64, 4)
    shared = list(range(50, 62))
    first = Request("first", shared + [1, 2], SamplingParams(max_tokens=3, ignore_eos=True))
    second = Request("second", shared + [3], SamplingParams(max_tokens=3, ignore_eos=True))
    scheduler.add_request(first)
    scheduler.add_request(second)
    plan = scheduler.schedule()
    assert scheduled_ids(plan, HandleBook()) == ["first"] and scheduler.num_waiting == 1
    scheduler.update(executor.execute(plan))
    plan = scheduler.schedule()
    [admitted] = plan.new_requests
    assert admitted.request_id == "second" and admitted.num_computed_tokens == len(shared)
    while scheduler.has_unfinished():
        scheduler.update(executor.execute(plan))
        plan = scheduler.schedule()
    for request in (first, second):
        assert request.output_token_ids == expected_output(request.prompt_token_ids, 3)
    assert second.num_cached_tokens == len(shared)


def test_without_a_prefix_cache_a_request_sharing_a_prefix_is_not_held_back() -> None:
    """Nothing it waited for would ever be cached: it is admitted beside the first, chunked
    into the step's remaining budget."""
    shared = list(range(50, 62))
    first = Request("first", shared + [1, 2], SamplingParams(max_tokens=3, ignore_eos=True))
    second = Request("second", shared + [3], SamplingParams(max_tokens=3, ignore_eos=True))
    result = run(config(max_num_batched_tokens=20, enable_prefix_caching=False), {1: [first, second]})
    assert result.lines[0] == "first:14 second:6 | W: | R: first second"
    for request in (first, second):
        assert result.outputs[request.request_id] == expected_output(request.prompt_token_ids, 3)


def test_steady_decodes_travel_as_handles_and_requests_needing_care_stay_listed() -> None:
    scheduler = Scheduler(config())
    executor = SimulatedExecutor(64, 4)
    plain = Request("plain", [1, 2, 3], SamplingParams(max_tokens=6, ignore_eos=True))
    with_logprobs = Request("logprobs", [4, 5, 6], SamplingParams(max_tokens=6, ignore_eos=True, logprobs=1))
    scheduler.add_request(plain)
    scheduler.add_request(with_logprobs)
    outputs: dict[str, list[int]] = {"plain": [], "logprobs": []}
    plans = []
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        plans.append(plan)
        for update in scheduler.update(executor.execute(plan)):
            outputs[update.request_id] += update.new_token_ids
    steady = plans[1:-1]
    assert steady and all(p.decode_handles == [plain.handle] for p in steady)
    assert all([c.request_id for c in p.continuing_requests] == ["logprobs"] for p in steady)
    assert len(outputs["plain"]) == len(outputs["logprobs"]) == 6
    assert scheduler.kv.num_free_blocks == 64


def test_an_executor_without_decode_handles_gets_every_decode_listed() -> None:
    scheduler = Scheduler(config(bulk_decodes=False))
    executor = SimulatedExecutor(64, 4)
    scheduler.add_request(Request("plain", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True)))
    tokens: list[int] = []
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        assert not plan.decode_handles
        for update in scheduler.update(executor.execute(plan)):
            tokens += update.new_token_ids
    assert tokens == expected_output([1, 2, 3], 4)


def test_a_result_missing_decode_tokens_ends_those_requests_in_error_not_the_scheduler() -> None:
    scheduler = Scheduler(config())
    executor = SimulatedExecutor(64, 4)
    scheduler.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True)))
    scheduler.update(executor.execute(scheduler.schedule()))
    plan = scheduler.schedule()
    assert plan.decode_handles
    output = executor.execute(plan)
    output.decode_token_ids = []
    [update] = scheduler.update(output)
    assert update.finished and update.error is not None and update.error.kind is ErrorKind.INTERNAL
    assert "0 decode tokens for 1 decode handles" in update.error.message
    assert not scheduler.has_unfinished() and scheduler.kv.num_free_blocks == 64


def test_steady_decodes_come_back_with_their_delivery_keys_and_one_gap_per_token_after_the_first() -> None:
    """An owner that forwards tokens in bulk (the planner) routes them by these keys, and every
    token but a request's first gives the inter-token histogram one figure, bulk or not."""
    now = [0.0]
    scheduler = Scheduler(config(), clock=lambda: now[0])
    executor = SimulatedExecutor(64, 4)
    for key in (7, 9):
        request = Request(f"r{key}", [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True))
        request.delivery_key = key
        scheduler.add_request(request)
    keys: list[list[int]] = []
    gaps: list[float] = []
    while scheduler.has_unfinished():
        now[0] += 0.5
        updates = scheduler.update(executor.execute(scheduler.schedule()))
        keys.append(updates.decoded_keys.tolist())
        assert len(updates.decoded_keys) == len(updates.decoded_requests)
        assert [r.delivery_key for r in updates.decoded_requests] == keys[-1]
        gaps += updates.inter_token_gaps
    assert [7, 9] in keys, "steady decodes came back in bulk"
    assert gaps == [0.5] * (2 * 4)


def test_a_bulk_decoding_request_reads_its_true_progress_mid_decode() -> None:
    """While a request decodes in bulk its progress lives in the decode set's arrays; read
    through the request it matches the same request decoding one plan entry at a time, at every
    step (planned two steps ahead, so outputs are pending too)."""
    now = [0.0]
    runs = []
    for bulk in (True, False):
        scheduler = Scheduler(config(bulk_decodes=bulk), clock=lambda: now[0])
        request = Request("r", [1, 2, 3], SamplingParams(max_tokens=9, ignore_eos=True))
        scheduler.add_request(request)
        runs.append((scheduler, SimulatedExecutor(64, 4), request, []))

    def progress(request: Request) -> tuple[object, ...]:
        return (
            request.num_tokens,
            request.num_computed_tokens,
            request.num_pending_outputs,
            request.num_uncomputed_tokens,
            request.last_token_at,
        )

    bulk_steps = 0
    while runs[0][0].has_unfinished():
        now[0] += 0.5
        for scheduler, executor, _, in_flight in runs:
            if scheduler.has_unfinished():
                in_flight.append(executor.execute(scheduler.schedule()))
            if len(in_flight) == 2 or not scheduler.has_unfinished():
                scheduler.update(in_flight.pop(0))
        assert progress(runs[0][2]) == progress(runs[1][2])
        bulk_steps += runs[0][2] in runs[0][0].decodes
    assert bulk_steps > 3, "the request decoded in bulk"
    assert runs[0][2].output_token_ids == runs[1][2].output_token_ids == expected_output([1, 2, 3], 9)


def test_bulk_decodes_fill_the_prefix_cache_as_per_request_decodes_do() -> None:
    """The blocks that steady decodes complete are entered into the prefix cache from their
    decode set's rows; at every step the cache holds the same blocks, under the same hashes, as
    when each decode is its own plan entry, across rows that fill and hand their tokens over."""
    runs = []
    for bulk in (True, False):
        scheduler = Scheduler(config(bulk_decodes=bulk, num_kv_blocks=256))
        for index, length in enumerate((3, 4, 5, 9)):
            prompt = [index * 100 + position for position in range(length)]
            scheduler.add_request(Request(f"r{index}", prompt, SamplingParams(max_tokens=90, ignore_eos=True)))
        runs.append((scheduler, SimulatedExecutor(256, 4), []))
    steps = 0
    while runs[0][0].has_unfinished():
        for scheduler, executor, in_flight in runs:
            if scheduler.has_unfinished():
                in_flight.append(executor.execute(scheduler.schedule()))
            if len(in_flight) == 2 or not scheduler.has_unfinished():
                scheduler.update(in_flight.pop(0))
        assert runs[0][0].kv.pool.cached_hashes() == runs[1][0].kv.pool.cached_hashes()
        steps += 1
    assert steps > 90 and len(runs[0][0].kv.pool.cached_hashes()) > 4 * 90 // 4
