"""Stop strings completed inside a step's accepted drafts, through real processes: a step that
answers several tokens for a request (its accepted drafts and one more) may complete a stop
string before its last token. The request then answers what decoding one token at a time does:
the tokens up to the one that completed the stop string, their logprobs, the text before it, the
stop string as its reason, and those tokens alone counted in its usage.

The model and prompts are test_speculative_decoding.py's; prompts 0 and 5 make it repeat one
letter, whose drafts are accepted in full, and the stop strings are runs of that letter of every
length from 2 to 9, so many of them are completed inside a step's run of accepted drafts. The
step trace shows where each step's tokens ended, and the test holds that this happened."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from clients import AsyncClient
from clients.results import GenerationResult
from tests.e2e.test_speculative_decoding import EXECUTOR_FLAGS, VOCAB, _prompts, model  # noqa: F401 (a fixture)
from tests.helpers.executor_process import start_executor
from tests.helpers.letter_tokenizer import letter_tokenizer_dir
from tests.helpers.metrics_scrape import Samples, scrape
from tests.helpers.scheduler_process import start_scheduler
from tests.helpers.service_process import free_port

MAX_TOKENS = 32
# The prompts whose greedy outputs repeat one letter.
REPEATING = (0, 5)
STOP_LENGTHS = range(2, 10)
# Drafts for every running request, as many as a step may verify.
SPECULATION = {"num_speculative_tokens": 4, "speculative_max_batch": 64}


@dataclass(slots=True, frozen=True)
class Ask:
    prompt: list[int]
    options: dict[str, Any]


async def _generate(address: str, asks: list[Ask]) -> list[GenerationResult]:
    async with AsyncClient(address) as client:
        return await asyncio.gather(*(
            client.generate(prompt_token_ids=ask.prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, **ask.options)
            for ask in asks
        ))


def _answer(result: GenerationResult) -> tuple[object, ...]:
    assert result.usage is not None
    return (
        result.token_ids, result.text, result.finish_reason, result.stop_reason, result.logprobs,
        result.usage.prompt_tokens, result.usage.completion_tokens,
    )


def _step_tokens(trace_dir: Path) -> dict[str, list[int]]:
    """The tokens each step answered each request (1 and the drafts it accepted), in step order,
    from the step trace's plans and results."""
    events = [json.loads(line) for line in (trace_dir / "steps.jsonl").read_text().splitlines()]
    planned = {event["step"]: event for event in events if event["e"] == "plan"}
    tokens: dict[str, list[int]] = {}
    for result in (event for event in events if event["e"] == "result"):
        plan = planned[result["step"]]
        accepted = result.get("accepted", {})
        for request_id in [*plan["new"], *plan["cont"], *plan["dec"]]:
            tokens.setdefault(request_id, []).append(1 + accepted.get(request_id, 0))
    return tokens


def _ended_inside_a_step(steps: list[int], output_length: int) -> bool:
    """Whether the step that answered the output's last token answered more after it."""
    answered = 0
    for count in steps:
        answered += count
        if answered >= output_length:
            return answered > output_length
    return False


@dataclass(slots=True, frozen=True)
class Served:
    results: list[GenerationResult]
    # The scheduler's metrics after.
    samples: Samples
    # The tokens each step answered each request, by request id.
    steps: dict[str, list[int]]

    def ended_inside_a_step(self) -> list[GenerationResult]:
        return [result for result in self.results if _ended_inside_a_step(self.steps[result.request_id], len(result.token_ids))]


def _serve(model_dir: Path, tokenizer: Path, asks: list[Ask], trace_dir: Path, **flags: object) -> Served:
    metrics_port = free_port()
    with (
        start_executor(model_dir, **EXECUTOR_FLAGS) as (executor, _),
        start_scheduler(executor, tokenizer=tokenizer, trace_dir=trace_dir, metrics_port=metrics_port, **flags) as address,
    ):
        results = asyncio.run(_generate(address, asks))
        samples = scrape(metrics_port)[0]
    # The trace is complete once the scheduler has stopped.
    return Served(results, samples, _step_tokens(trace_dir))


def _steps_of(served: Served) -> dict[str, tuple[int, list[int]]]:
    """Each request's output length and step tokens, to show where its stop string fell."""
    return {result.request_id: (len(result.token_ids), served.steps[result.request_id]) for result in served.results}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return letter_tokenizer_dir(tmp_path_factory.mktemp("letters") / "tokenizer", VOCAB)


@pytest.fixture(scope="module")
def asks(model: Path, tokenizer: Path) -> list[Ask]:  # noqa: F811 (the imported fixture)
    """Runs of each repeating output's letter as stop strings (some with logprobs, some with the
    stop string in the text), after checking that the outputs do begin with a run that long."""
    prompts = [_prompts()[index] for index in REPEATING]
    with start_executor(model, **EXECUTOR_FLAGS) as (executor, _), start_scheduler(executor, tokenizer=tokenizer) as address:
        free = asyncio.run(_generate(address, [Ask(prompt, {}) for prompt in prompts]))
    asks = []
    longest = max(STOP_LENGTHS)
    for prompt, result in zip(prompts, free):
        letter = result.text[0]
        assert len(set(result.token_ids[:longest])) == 1 and result.text[:longest] == letter * longest, result
        for length in STOP_LENGTHS:
            options: dict[str, Any] = {"stop": [letter * length]}
            if length % 2:
                options["logprobs"] = 2
            if length % 3 == 0:
                options["include_stop_str_in_output"] = True
            asks.append(Ask(prompt, options))
    return asks


@pytest.fixture(scope="module")
def plain(model: Path, tokenizer: Path, asks: list[Ask], tmp_path_factory: pytest.TempPathFactory) -> list[GenerationResult]:  # noqa: F811 (the imported fixture)
    served = _serve(model, tokenizer, asks, tmp_path_factory.mktemp("plain"))
    for ask, result in zip(asks, served.results):
        # A run of n letters is n tokens.
        [stop] = ask.options["stop"]
        assert (result.finish_reason, result.stop_reason, len(result.token_ids)) == ("stop", stop, len(stop)), result
    return served.results


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_a_stop_string_inside_accepted_drafts_ends_the_output_where_one_token_at_a_time_does(
    model: Path, tokenizer: Path, asks: list[Ask], plain: list[GenerationResult], method: str, tmp_path: Path  # noqa: F811
) -> None:
    served = _serve(model, tokenizer, asks, tmp_path, speculative_method=method, **SPECULATION)

    mismatched = [
        (ask.options, _answer(got), _answer(want))
        for ask, got, want in zip(asks, served.results, plain)
        if _answer(got) != _answer(want)
    ]
    assert not mismatched, mismatched
    # Steps of up to 5 tokens on outputs of one letter: many stop strings end inside one (which
    # ones depends on when the drafts begin).
    assert served.ended_inside_a_step(), _steps_of(served)


def test_the_scheduler_counts_as_output_only_the_tokens_up_to_the_stop_string(
    model: Path, tokenizer: Path, asks: list[Ask], tmp_path: Path  # noqa: F811
) -> None:
    """Its generated tokens and finished requests' output lengths are its clients' usage. In one
    process: a front-end apart finds stop strings after its planner has sent more tokens."""
    served = _serve(model, tokenizer, asks, tmp_path, frontends=1, speculative_method="ngram", **SPECULATION)

    assert served.ended_inside_a_step(), _steps_of(served)
    completion_tokens = 0
    for result in served.results:
        assert result.usage is not None and result.finish_reason == "stop"
        completion_tokens += result.usage.completion_tokens
    assert served.samples["splitserve:request_generation_tokens_sum"] == completion_tokens
    assert served.samples["splitserve:generation_tokens_total"] == completion_tokens
