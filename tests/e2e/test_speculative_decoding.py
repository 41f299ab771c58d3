"""Speculative decoding through real processes: a scheduler that proposes drafts (ngram, suffix),
or asks the executor's draft model for them (draft: a copy of the model's first layer), and the
executor that verifies them give exactly the outputs of decoding one token at a time,
greedy and seeded, with and without penalties, while drafts are proposed and some accepted; and
the scheduler's block books agree with the executor's after.

The model is the tests' random Llama with a 16-token vocabulary: its greedy outputs fall into
short runs and cycles (13 15 13 15 ..., 8 8 8 ...), so the request's own tokens hold what
comes next often enough for drafts to be accepted; the prompts repeat a pattern, where prompt
lookup finds matches from the first step. A real model's acceptance is bench/speculation.py's.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from clients import AsyncClient
from executor_service.truncated_draft import truncate
from tests.helpers.block_audit import assert_books_agree
from tests.helpers.executor_process import start_executor
from tests.helpers.metrics_scrape import scrape
from tests.helpers.model_factory import build_model
from tests.helpers.scheduler_process import start_scheduler
from tests.helpers.service_process import free_port

VOCAB = 16
MAX_TOKENS = 96
EXECUTOR_FLAGS = {"num_kv_blocks": 256, "block_size": 16, "max_model_len": 512, "threads": 1}
# Token 2 is the model's EOS; the prompts avoid it and the requests ignore it.
FIRST_TOKEN = 3


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model("llama", tmp_path_factory.mktemp("speculation") / "llama", vocab_size=VOCAB)


def _prompts() -> list[list[int]]:
    """Patterns of 3 to 6 tokens repeated to about 40 tokens."""
    rng = random.Random(5)
    prompts = []
    for _ in range(6):
        pattern = [rng.randrange(FIRST_TOKEN, VOCAB) for _ in range(rng.randrange(3, 7))]
        prompts.append((pattern * 40)[: 40 + rng.randrange(4)])
    return prompts


# Greedy, and seeded sampling (its draws depend only on seed and position); then with
# penalties, which a verify step counts at each position with the drafts before it.
PENALTIES = {"repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.3}
SAMPLINGS = (
    [{"temperature": 0.0}] * 6
    + [{"temperature": 0.8, "seed": 100 + i} for i in range(2)]
    + [{"temperature": 0.0, "repetition_penalty": 1.1}, {"temperature": 0.0, **PENALTIES}]
    + [{"temperature": 0.8, "seed": 200, **PENALTIES}]
)


async def _outputs(address: str) -> list[list[int]]:
    prompts = _prompts()
    async with AsyncClient(address) as client:
        results = await asyncio.gather(*(
            client.generate(prompt_token_ids=prompts[i % len(prompts)], max_tokens=MAX_TOKENS, ignore_eos=True, **sampling)
            for i, sampling in enumerate(SAMPLINGS)
        ))
    return [list(result.token_ids) for result in results]


def _serve(model: Path, draft: Path | None = None, **flags: object) -> tuple[list[list[int]], dict[str, float]]:
    """The outputs of one executor (with a draft model, if any) and scheduler started with flags,
    and the scheduler's spec_* samples."""
    metrics_port = free_port()
    executor_flags = {**EXECUTOR_FLAGS, **({"draft_model": draft} if draft is not None else {})}
    with start_executor(model, **executor_flags) as (executor, _), start_scheduler(executor, metrics_port=metrics_port, **flags) as address:
        outputs = asyncio.run(_outputs(address))
        samples = {name: value for name, value in scrape(metrics_port)[0].items() if name.startswith("splitserve:spec_")}
        assert_books_agree(address)
    return outputs, samples


@pytest.fixture(scope="module")
def plain_outputs(model: Path) -> list[list[int]]:
    outputs, samples = _serve(model)
    assert not any(samples.values())
    assert all(len(output) == MAX_TOKENS for output in outputs)
    return outputs


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft"])
def test_speculation_gives_the_outputs_of_decoding_one_token_at_a_time(
    model: Path, plain_outputs: list[list[int]], method: str, tmp_path: Path
) -> None:
    draft = truncate(model, tmp_path / "draft", layers=1) if method == "draft" else None
    outputs, samples = _serve(model, draft, speculative_method=method, num_speculative_tokens=4)
    label = f'{{method="{method}"}}'
    drafted = samples.get(f"splitserve:spec_draft_tokens_total{label}", 0.0)
    accepted = samples.get(f"splitserve:spec_accepted_tokens_total{label}", 0.0)
    verifies = samples.get(f"splitserve:spec_accepted_tokens_per_verify_count{label}", 0.0)
    assert drafted > 0 and verifies > 0, samples
    assert 0 < accepted < drafted, samples
    assert outputs == plain_outputs
