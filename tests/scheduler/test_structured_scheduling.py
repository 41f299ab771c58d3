"""Structured outputs in the planner: grammars compiled with xgrammar for a real tokenizer
(GPT-2's), a constrained request planned with its next-token bitmask on every step that samples
it, never pipelined past a token it has not seen, never decoded in bulk, and its grammar state
rebuilt from its tokens alone."""

from __future__ import annotations

import asyncio

import pytest

from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.errors import ErrorKind, RequestRejected
from scheduler_service.core.request import FinishReason, Request
from scheduler_service.core.sampling_params import SamplingParams
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.sim_executor import SimulatedExecutor
from scheduler_service.core.structured_output import GrammarKind, StructuredOutput
from scheduler_service.structured.grammars import Grammars
from scheduler_service.text.tokenizer import TextProcessor
from tests.helpers.gpt2_grammars import EOS, VOCAB_SIZE, allowed

ANSWERS = ("yes indeed", "no way", "maybe so")
CHOICE = StructuredOutput(GrammarKind.CHOICE, choices=ANSWERS)


def constrained(grammars: Grammars, request_id: str, prompt: list[int], spec: StructuredOutput = CHOICE) -> Request:
    request = Request(request_id, prompt, SamplingParams(max_tokens=20, structured_output=spec))
    request.grammar = grammars.state(spec, VOCAB_SIZE, [EOS], [])
    return request


def test_a_constrained_request_is_planned_with_its_mask_and_never_ahead_of_its_tokens(
    grammars: Grammars, text: TextProcessor
) -> None:
    scheduler = Scheduler(SchedulerConfig(num_kv_blocks=64, block_size=4, max_model_len=256), eos_token_ids=[EOS])
    executor = SimulatedExecutor(64, 4)
    requests = [constrained(grammars, f"c{i}", [10 + i, 20, 30, 40 + i]) for i in range(3)]
    plain = Request("plain", [1, 2, 3], SamplingParams(max_tokens=12, ignore_eos=True))
    for request in [*requests, plain]:
        scheduler.add_request(request)
    # Pipelined as the engine loop runs it: plan N+1 goes out before result N comes back.
    in_flight = [executor.execute(first := scheduler.schedule())]
    plans = [first]
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        plans.append(plan)
        for entry in (*plan.new_requests, *plan.continuing_requests):
            request = scheduler.requests[entry.request_id]
            if request.grammar is not None:
                # Sent only once the token before it is back, with a mask allowing something.
                assert request.num_pending_outputs == 1 and allowed(entry.allowed_token_bitmask)
        in_flight.append(executor.execute(plan))
        scheduler.update(in_flight.pop(0))
    while in_flight:
        scheduler.update(in_flight.pop(0))
    for request in requests:
        assert request.finish_reason is FinishReason.STOP
        assert request.output_token_ids[-1] == EOS
        assert text.tokenizer.decode(request.output_token_ids[:-1]) in ANSWERS
    # The plain request pipelined and decoded in bulk throughout; the constrained never did.
    assert len(plain.output_token_ids) == 12
    handles = {handle for plan in plans for handle in plan.decode_handles}
    assert plain.handle in handles and not handles & {r.handle for r in requests}
    listed = {entry.request_id for plan in plans for entry in plan.continuing_requests}
    assert {r.request_id for r in requests} <= listed
    assert scheduler.kv.num_free_blocks == 64


def test_a_token_the_grammar_does_not_allow_ends_the_request_in_error(grammars: Grammars) -> None:
    scheduler = Scheduler(SchedulerConfig(num_kv_blocks=16, block_size=4, max_model_len=64), eos_token_ids=[EOS])
    request = constrained(grammars, "c", [5, 6, 7])
    scheduler.add_request(request)
    plan = scheduler.schedule()
    output = SimulatedExecutor(16, 4).execute(plan)
    output.sampled["c"] = [EOS]  # an executor that ignored the mask: EOS before any answer
    (update,) = scheduler.update(output).updates
    assert update.error is not None and update.error.kind is ErrorKind.INTERNAL
    assert "grammar does not allow" in update.error.message and request.finish_reason is FinishReason.ABORT


def test_a_grammar_state_rebuilt_from_the_tokens_allows_what_the_stepped_one_does(
    grammars: Grammars, text: TextProcessor
) -> None:
    schema = '{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}'
    spec = StructuredOutput(GrammarKind.JSON_SCHEMA, schema)
    tokens = text.tokenizer.encode('{"ok": true}')
    stepped = grammars.state(spec, VOCAB_SIZE, [EOS], [])
    for count, token in enumerate(tokens):
        rebuilt = grammars.state(spec, VOCAB_SIZE, [EOS], tokens[:count])
        assert rebuilt.allowed_token_bitmask() == stepped.allowed_token_bitmask()
        assert token in allowed(stepped.allowed_token_bitmask())
        assert stepped.accept(token)
    assert allowed(stepped.allowed_token_bitmask()) == {EOS}
    assert stepped.accept(EOS) and stepped.is_terminated
    with pytest.raises(RequestRejected, match="does not follow") as refused:
        grammars.state(spec, VOCAB_SIZE, [EOS], text.tokenizer.encode("[1]"))
    assert refused.value.kind is ErrorKind.INVALID


def test_a_grammar_compiles_once_per_content_and_errors_name_the_problem(text: TextProcessor) -> None:
    grammars = Grammars(text)
    regex = StructuredOutput(GrammarKind.REGEX, r"[a-z]{3}")
    asyncio.run(grammars.compile(regex, VOCAB_SIZE))
    compiler = grammars._compiler(VOCAB_SIZE)
    cached = compiler.get_cache_size_bytes()
    asyncio.run(grammars.compile(StructuredOutput(GrammarKind.REGEX, r"[a-z]{3}"), VOCAB_SIZE))
    assert compiler.get_cache_size_bytes() == cached
    asyncio.run(grammars.compile(StructuredOutput(GrammarKind.REGEX, r"[0-9]{3}"), VOCAB_SIZE))
    assert compiler.get_cache_size_bytes() > cached
    with pytest.raises(RequestRejected) as refused:
        asyncio.run(grammars.compile(StructuredOutput(GrammarKind.JSON_SCHEMA, '{"type": 5}'), VOCAB_SIZE))
    assert refused.value.kind is ErrorKind.INVALID
    message = str(refused.value)
    assert message.startswith("structured_output json_schema cannot be compiled: ") and ".cc:" not in message


def test_without_a_tokenizer_a_grammar_is_unsupported_and_the_core_refuses_bad_combinations() -> None:
    with pytest.raises(RequestRejected, match="--tokenizer") as refused:
        asyncio.run(Grammars(None).compile(CHOICE, VOCAB_SIZE))
    assert refused.value.kind is ErrorKind.UNSUPPORTED
    problems = SamplingParams(
        structured_output=CHOICE, ignore_eos=True, min_tokens=2, allowed_token_ids=(5,)
    ).problems(VOCAB_SIZE, 0)
    assert problems == [
        "ignore_eos cannot be combined with structured_output",
        "min_tokens cannot be combined with structured_output",
        "allowed_token_ids cannot be combined with structured_output (the grammar decides)",
    ]
    empty = SamplingParams(structured_output=StructuredOutput(GrammarKind.REGEX, " ")).problems(VOCAB_SIZE, 0)
    assert empty == ["structured_output regex is empty"]


def test_with_late_bitmasks_a_constrained_request_pipelines_and_its_bitmask_follows_the_plan(
    grammars: Grammars, text: TextProcessor
) -> None:
    """As the executor runs it: plan N+1 is computed while result N is applied, and samples
    once the bitmasks that result released have come."""
    config = SchedulerConfig(num_kv_blocks=64, block_size=4, max_model_len=256, late_bitmasks=True)
    scheduler = Scheduler(config, eos_token_ids=[EOS])
    executor = SimulatedExecutor(64, 4)
    requests = [constrained(grammars, f"c{i}", [10 + i, 20, 30, 40 + i]) for i in range(3)]
    for request in requests:
        scheduler.add_request(request)
    results = [executor.execute(scheduler.schedule())]
    planned: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        updates = scheduler.update(results.pop(0))
        entries = {entry.request_id: entry for entry in plan.continuing_requests}
        for late in updates.late_bitmasks:
            assert late.step_id == plan.step_id
            for request_id, bitmask in late.bitmasks:
                assert entries[request_id].bitmask_follows and allowed(bitmask)
                entries[request_id].allowed_token_bitmask = bitmask
        for entry in plan.continuing_requests:
            # Each decode was planned with the token before it still in flight.
            assert entry.bitmask_follows
            planned[entry.request_id].append(plan.step_id)
        results.append(executor.execute(plan))
    for request in requests:
        assert request.finish_reason is FinishReason.STOP
        assert text.tokenizer.decode(request.output_token_ids[:-1]) in ANSWERS
        # One decode every step, not one every other.
        steps = planned[request.request_id]
        assert steps == list(range(steps[0], steps[0] + len(steps)))
        assert len(steps) >= len(request.output_token_ids) - 1
    assert scheduler.kv.num_free_blocks == 64
