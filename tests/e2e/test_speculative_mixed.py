"""Speculative decoding among 32 concurrent requests of every kind, through real processes: greedy
and seeded sampled ones, some asking for logprobs, some ending on stop strings, and constrained
ones (a regex, a choice), whose ngram and suffix drafts are cut to what their grammar allows
(the draft method's draft model gives them none). With drafts proposed and accepted, every
request answers exactly what it does without speculation (tokens, text, finish, logprobs), the
constrained ones follow their constraint, and the scheduler's block books agree with the
executor's after.

The model and prompts are test_speculative_decoding.py's (a 16-token random Llama whose outputs
repeat, so drafts are accepted); the scheduler reads its tokens as the letters a..m
(letter_tokenizer.py), which is what structured outputs and stop strings need."""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from clients import AsyncClient
from clients.results import GenerationResult
from executor_service.truncated_draft import truncate
from tests.e2e.test_speculative_decoding import EXECUTOR_FLAGS, VOCAB, _prompts, model  # noqa: F401 (a fixture)
from tests.helpers.block_audit import assert_books_agree
from tests.helpers.executor_process import start_executor
from tests.helpers.letter_tokenizer import letter_tokenizer_dir
from tests.helpers.metrics_scrape import scrape
from tests.helpers.scheduler_process import start_scheduler
from tests.helpers.service_process import free_port

# 32 requests of about 40 prompt and 48 output tokens fit the executor's 256 blocks of 16 at
# once, so no request is preempted and the two runs schedule the same way.
MAX_TOKENS = 48
REGEX = "[a-f]{2,4}(g|h)[i-m]{3,6}"
CHOICES = ["cab", "bead", "fig", "lime", "deck"]
# Where the stop strings are taken from in outputs without them: two letters from here on.
STOP_AT = 12
NUM_REQUESTS = 32
# Drafts for every running request: by default a decode batch of 16 or more takes none.
SPECULATION = {"num_speculative_tokens": 4, "speculative_max_batch": 2 * NUM_REQUESTS}


@dataclass(slots=True)
class Ask:
    """One request (its options besides the prompt, and the prompt) and what is checked of its
    answer."""

    options: dict[str, Any]
    prompt: list[int] = field(default_factory=list)
    # The text it must match in full: a constrained request's constraint.
    pattern: str | None = None
    # What it stops on besides its length, set from its output without it: "text" (a stop
    # string) or "token" (a stop token id, which drafts may carry before their last token).
    stops: str | None = None


def _asks() -> list[Ask]:
    greedy: dict[str, Any] = {"temperature": 0.0, "ignore_eos": True}

    def seeded(seed: int, **more: Any) -> dict[str, Any]:
        return {"temperature": 0.8, "seed": seed, "ignore_eos": True, **more}

    choice = "|".join(map(re.escape, CHOICES))
    asks = (
        [Ask(dict(greedy)) for _ in range(6)]
        + [Ask({**greedy, "logprobs": 3}) for _ in range(3)]
        + [Ask({**greedy, "logprobs": 0})]
        + [Ask(seeded(10 + i)) for i in range(2)]
        # These may end on EOS, which drafts may carry before their last token.
        + [Ask(seeded(12 + i, ignore_eos=False)) for i in range(2)]
        + [Ask(seeded(20 + i, logprobs=2)) for i in range(3)]
        + [Ask(seeded(30, top_k=5)), Ask(seeded(31, top_p=0.8, logprobs=1))]
        + [Ask(dict(greedy), stops="text") for _ in range(2)]
        + [Ask(seeded(40), stops="text"), Ask({**greedy, "logprobs": 2}, stops="text")]
        + [Ask(seeded(41, logprobs=2), stops="text")]
        + [Ask({"temperature": 0.0, "structured_output": {"regex": REGEX}}, pattern=REGEX)]
        # On prompts 1 and 2, whose outputs vary (0's and 5's repeat one token).
        + [Ask(dict(greedy), stops="token"), Ask(seeded(42, logprobs=2), stops="token")]
        + [Ask(seeded(50 + i, structured_output={"regex": REGEX}), pattern=REGEX) for i in range(2)]
        + [Ask({"temperature": 0.0, "structured_output": {"choice": CHOICES}}, pattern=choice)]
        + [Ask(seeded(60 + i, structured_output={"choice": CHOICES}), pattern=choice) for i in range(2)]
    )
    prompts = _prompts()
    for i, ask in enumerate(asks):
        ask.prompt = prompts[i % len(prompts)]
        # A constrained request stops at its grammar's end (EOS), which ignore_eos would forbid.
        if ask.pattern is not None:
            ask.options.pop("ignore_eos", None)
    assert len(asks) == NUM_REQUESTS
    return asks


async def _generate(address: str, asks: list[Ask]) -> list[GenerationResult]:
    async with AsyncClient(address) as client:
        return await asyncio.gather(*(
            client.generate(prompt_token_ids=ask.prompt, max_tokens=MAX_TOKENS, **ask.options) for ask in asks
        ))


def _with_stops(address: str, asks: list[Ask]) -> list[Ask]:
    """The stops, from each stopping request's output without them: the two letters at STOP_AT
    of its text (it ends there or where they first appear), or the first token from STOP_AT on
    that it had not output before (it ends there)."""
    stopping = [ask for ask in asks if ask.stops]
    free = asyncio.run(_generate(address, stopping))
    for ask, result in zip(stopping, free):
        if ask.stops == "token":
            before = set(result.token_ids[:STOP_AT])
            ask.options["stop_token_ids"] = [next(t for t in result.token_ids[STOP_AT:] if t not in before)]
            continue
        stop = result.text[STOP_AT : STOP_AT + 2]
        assert len(stop) == 2, result.text
        ask.options["stop"] = [stop]
    return asks


@dataclass(slots=True)
class Served:
    asks: list[Ask]
    results: list[GenerationResult]
    spec_samples: dict[str, float]


def _serve(model_dir: Path, tokenizer: Path, asks: list[Ask] | None, draft: Path | None = None, **flags: object) -> Served:
    """The answers of one executor (with a draft model, if any) and scheduler started with flags
    (asks None: the stop strings are taken from this server's outputs first), and the
    scheduler's spec_* samples; the block books must agree after."""
    metrics_port = free_port()
    executor_flags = {**EXECUTOR_FLAGS, **({"draft_model": draft} if draft is not None else {})}
    with (
        start_executor(model_dir, **executor_flags) as (executor, _),
        start_scheduler(executor, metrics_port=metrics_port, tokenizer=tokenizer, **flags) as address,
    ):
        asks = asks if asks is not None else _with_stops(address, _asks())
        results = asyncio.run(_generate(address, asks))
        samples = {name: value for name, value in scrape(metrics_port)[0].items() if name.startswith("splitserve:spec_")}
        assert_books_agree(address)
    return Served(asks, results, samples)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return letter_tokenizer_dir(tmp_path_factory.mktemp("letters") / "tokenizer", VOCAB)


@pytest.fixture(scope="module")
def plain(model: Path, tokenizer: Path) -> Served:  # noqa: F811 (the imported fixture)
    served = _serve(model, tokenizer, None)
    assert not any(served.spec_samples.values())
    for ask, result in zip(served.asks, served.results):
        if ask.pattern is not None:
            assert re.fullmatch(ask.pattern, result.text), (ask.options, result.text)
            assert result.finish_reason == "stop", (ask.options, result)
        elif ask.stops:
            stop = ask.options["stop"][0] if ask.stops == "text" else str(ask.options["stop_token_ids"][0])
            assert result.finish_reason == "stop" and result.stop_reason == stop, result
        elif ask.options["ignore_eos"]:
            assert result.finish_reason == "length" and len(result.token_ids) == MAX_TOKENS, result
        assert (result.logprobs is not None) == ("logprobs" in ask.options)
    return served


def _answer(result: GenerationResult) -> tuple[object, ...]:
    return (result.token_ids, result.text, result.finish_reason, result.stop_reason, result.logprobs)


# The draft method's run is make test-slow's: test_speculative_decoding.py runs it in make test.
@pytest.mark.parametrize("method", ["ngram", "suffix", pytest.param("draft", marks=pytest.mark.slow)])
def test_mixed_concurrent_requests_answer_with_drafts_what_they_do_without(
    model: Path, tokenizer: Path, plain: Served, method: str, tmp_path: Path  # noqa: F811 (the imported fixture)
) -> None:
    draft = truncate(model, tmp_path / "draft", layers=1) if method == "draft" else None
    served = _serve(model, tokenizer, plain.asks, draft, speculative_method=method, **SPECULATION)
    label = f'{{method="{method}"}}'
    drafted = served.spec_samples.get(f"splitserve:spec_draft_tokens_total{label}", 0.0)
    accepted = served.spec_samples.get(f"splitserve:spec_accepted_tokens_total{label}", 0.0)
    assert drafted > 0 and accepted > 0, served.spec_samples
    for ask, result in zip(served.asks, served.results):
        if ask.pattern is not None:
            assert re.fullmatch(ask.pattern, result.text), (ask.options, result.text)
    mismatched = [
        (ask.options, _answer(got), _answer(want))
        for ask, got, want in zip(served.asks, served.results, plain.results)
        if _answer(got) != _answer(want)
    ]
    assert not mismatched, mismatched
