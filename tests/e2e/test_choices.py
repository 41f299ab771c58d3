"""Several choices of one prompt (SamplingParams.n, best_of) through real processes: an executor
on a random-weight Llama behind the scheduler. The choices share one computation of the prompt
(the later ones report all but its last token as cached), each samples with its own seed exactly
as a request of its own with that seed would, best_of keeps the most likely, an abort by id ends
every choice, and choices whose executor is killed end as they would have undisturbed."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch

from clients import AsyncClient, Client
from clients.results import GenerationResult
from tests.helpers.block_audit import assert_books_agree
from tests.helpers.executor_process import ExecutorProcess, start_executor
from tests.helpers.model_factory import build_model
from tests.helpers.scheduler_process import start_scheduler

BLOCK_SIZE = 16
# 37 tokens: the 36 a later choice shares end inside a block, which it copies.
PROMPT = [(7 * i + 3) % 200 + 5 for i in range(37)]
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model("llama", tmp_path_factory.mktemp("choices") / "llama", seed=3)


@pytest.fixture(scope="module")
def service(model_dir: Path) -> Iterator[str]:
    with (
        start_executor(model_dir, num_kv_blocks=256, block_size=BLOCK_SIZE) as (executor, _),
        start_scheduler(executor) as scheduler,
    ):
        yield scheduler


def sample(client: Client, prompt: list[int] = PROMPT, **options: object) -> GenerationResult:
    return client.generate(prompt_token_ids=prompt, max_tokens=12, ignore_eos=True, temperature=1.0, **options)


def test_n_choices_share_one_prompt_computation_and_sample_as_their_own_seeds(service: str) -> None:
    with Client(service) as client:
        result = sample(client, n=4, seed=11)
        alone = [sample(client, seed=11 + i) for i in range(4)]
        status = client.server_status()
    assert [choice.index for choice in result.choices] == [0, 1, 2, 3]
    assert [choice.token_ids for choice in result.choices] == [single.token_ids for single in alone]
    assert len({tuple(choice.token_ids) for choice in result.choices}) == 4, "every choice samples its own"
    assert all(choice.finish_reason == "length" for choice in result.choices)
    cached = [choice.usage.cached_prompt_tokens for choice in result.choices if choice.usage]
    assert cached == [0] + [len(PROMPT) - 1] * 3, "the later choices forked from the first's prompt"
    assert status.kv_blocks_free == status.kv_blocks_total
    assert_books_agree(service)


def test_best_of_keeps_the_most_likely_choices_best_first(service: str) -> None:
    with Client(service) as client:
        every = sample(client, n=4, seed=5, logprobs=0)
        best = sample(client, n=2, best_of=4, seed=5)
    likelihood = {tuple(c.token_ids): sum(lp.logprob for lp in c.logprobs or []) for c in every.choices}
    ranked = sorted(likelihood, key=likelihood.__getitem__, reverse=True)
    assert [tuple(choice.token_ids) for choice in best.choices] == ranked[:2]
    assert all(choice.logprobs is None for choice in best.choices), "logprobs were not asked for"


def test_an_abort_by_request_id_ends_every_choice(service: str) -> None:
    async def run() -> tuple[dict[int, str | None], int]:
        async with AsyncClient(service) as client:
            stream = client.stream(prompt_token_ids=PROMPT, max_tokens=900, ignore_eos=True, n=3, request_id="many")
            ends: dict[int, str | None] = {}
            aborted = False
            async with stream:
                async for delta in stream:
                    if not aborted:
                        aborted = await client.abort("many")
                        assert aborted
                    if delta.finish_reason is not None:
                        ends[delta.index] = delta.finish_reason
            return ends, (await client.server_status()).num_running

    ends, running = asyncio.run(run())
    assert ends == {0: "abort", 1: "abort", 2: "abort"} and running == 0


async def _choices(address: str, fault: Callable[[], None] | None = None, after_steps: int = 0) -> list[list[list[int]]]:
    """The choices' tokens of four seeded n=4 requests in flight together; fault() once the
    scheduler has run after_steps more steps."""
    async with AsyncClient(address) as client:
        start = (await client.server_status()).num_steps

        async def one(index: int) -> list[list[int]]:
            prompt = [(token + index) % 250 + 3 for token in PROMPT]
            result = await client.generate(
                prompt_token_ids=prompt, max_tokens=40, ignore_eos=True, temperature=1.0, seed=index, n=4
            )
            return [choice.token_ids for choice in result.choices]

        streams = asyncio.gather(*(one(i) for i in range(4)))
        if fault is not None:
            while not streams.done() and (await client.server_status()).num_steps < start + after_steps:
                await asyncio.sleep(0.02)
            assert not streams.done(), "every request ended before the fault"
            fault()
        return await streams


def test_choices_survive_their_executor_killed_mid_generation(model_dir: Path) -> None:
    with ExitStack() as stack:
        executors = [ExecutorProcess(model_dir, num_kv_blocks=256, block_size=BLOCK_SIZE) for _ in range(2)]
        for executor in executors:
            stack.callback(executor.close)
        addresses = [executor.wait_ready() for executor in executors]
        address = stack.enter_context(start_scheduler(addresses, step_timeout_floor=5))
        undisturbed = asyncio.run(_choices(address))
        disturbed = asyncio.run(_choices(address, executors[0].process.kill, after_steps=10))
        with Client(address) as client:
            status = client.server_status()
    assert disturbed == undisturbed
    assert status.num_preemptions >= 1, "the kill came after every request had ended"
