"""The whole service over real processes: an executor on a random-weight Llama, the scheduler
in front of it, and many concurrent client streams. Outputs must equal transformers' generate."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from clients import AsyncClient, Client
from tests.helpers.block_audit import assert_books_agree, audit_now
from tests.helpers.executor_process import start_executor
from tests.helpers.greedy_client import stream_all, workload
from tests.helpers.greedy_reference import Reference
from tests.helpers.model_factory import build_model
from tests.helpers.scheduler_process import start_scheduler

BLOCK_SIZE = 16
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model("llama", tmp_path_factory.mktemp("e2e") / "llama", seed=7)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Reference:
    return Reference(model_dir)


@pytest.fixture(scope="module")
def executor(model_dir: Path) -> Iterator[str]:
    with start_executor(model_dir, num_kv_blocks=512, block_size=BLOCK_SIZE) as (address, _):
        yield address


def test_32_concurrent_streams_match_transformers_and_free_every_block(executor: str, reference: Reference) -> None:
    jobs = workload(32, seed=1)
    with start_scheduler(executor, max_num_seqs=16, max_num_batched_tokens=256) as address:
        outputs = asyncio.run(stream_all(address, jobs))
        with Client(address) as client:
            status = client.server_status()
        assert_books_agree(address)
    for (prompt, max_tokens), output in zip(jobs, outputs, strict=True):
        assert output == reference(prompt, max_tokens)
    assert status.kv_blocks_free == status.kv_blocks_total == 512
    assert status.num_running == status.num_waiting == 0


def test_outputs_survive_preemption_in_a_small_kv_pool_with_tokens_sent_in_groups(
    model_dir: Path, reference: Reference
) -> None:
    jobs = workload(32, seed=2)
    with start_executor(model_dir, num_kv_blocks=40, block_size=BLOCK_SIZE) as (executor_address, _):
        # Tokens held for a group when their request is preempted are sent all the same.
        flags = {"max_num_seqs": 32, "max_num_batched_tokens": 512, "stream_interval": 3}
        with start_scheduler(executor_address, **flags) as address:
            outputs = asyncio.run(stream_all(address, jobs))
            with Client(address) as client:
                status = client.server_status()
            assert_books_agree(address)
    assert status.num_preemptions > 0, "the pool was meant to be too small for the batch"
    for (prompt, max_tokens), output in zip(jobs, outputs, strict=True):
        assert output == reference(prompt, max_tokens)
    assert status.kv_blocks_free == status.kv_blocks_total == 40


def test_cancelled_streams_free_their_blocks_at_once(executor: str, reference: Reference) -> None:
    # The kept requests run long enough to be running still when every cancel has landed.
    keep = [(prompt, 200) for prompt, _ in workload(22, seed=3)]
    cancel = [(prompt, 500) for prompt, _ in workload(10, seed=4)]

    audits = []

    async def scenario(address: str) -> tuple[list[list[int]], int]:
        cancelled = asyncio.Event()
        cancelled_count = 0
        async with AsyncClient(address) as client:

            async def cancel_midway(prompt: list[int], max_tokens: int) -> None:
                nonlocal cancelled_count
                received = 0
                async with client.stream(prompt_token_ids=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True) as deltas:
                    async for delta in deltas:
                        received += len(delta.token_ids)
                        if received >= 4:
                            break
                cancelled_count += 1
                if cancelled_count == len(cancel):
                    cancelled.set()

            async def run_to_end(prompt: list[int], max_tokens: int) -> list[int]:
                result = await client.generate(prompt_token_ids=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True)
                return result.token_ids

            async def watch() -> int:
                await cancelled.wait()
                deadline = time.monotonic() + 5
                while True:
                    status = await client.server_status()
                    in_flight = status.num_running + status.num_waiting
                    if in_flight <= len(keep) or time.monotonic() > deadline:
                        # The kept streams still run: the executor holds them mid-generation.
                        audits.append(await audit_now(address))
                        return in_flight

            tasks = [run_to_end(p, m) for p, m in keep]
            results = await asyncio.gather(*tasks, *(cancel_midway(p, m) for p, m in cancel), watch())
            return results[: len(keep)], results[-1]

    with start_scheduler(executor, max_num_seqs=32, max_num_batched_tokens=512) as address:
        outputs, in_flight_after_cancel = asyncio.run(scenario(address))
        with Client(address) as client:
            status = client.server_status()
        assert_books_agree(address)
    assert in_flight_after_cancel == len(keep), "cancelled requests still hold their places"
    (during,) = audits
    assert during.num_mismatches == 0 and [e.audited for e in during.executors] == [True], during
    for (prompt, max_tokens), output in zip(keep, outputs, strict=True):
        assert output == reference(prompt, max_tokens)
    assert status.kv_blocks_free == status.kv_blocks_total


def test_logprobs_reach_the_client_as_the_model_computed_them(
    executor: str, reference: Reference
) -> None:
    """Greedy with 3 top logprobs: each token is its own top entry, and every logprob equals
    transformers' log-softmax at that position (one teacher-forced forward)."""
    prompt = list(range(40, 73))
    with start_scheduler(executor) as address, Client(address) as client:
        result = client.generate(
            prompt_token_ids=prompt, max_tokens=12, temperature=0, ignore_eos=True, logprobs=3
        )
    assert result.token_ids == reference(prompt, 12)
    with torch.inference_mode():
        logits = reference.model(torch.tensor([prompt + result.token_ids[:-1]])).logits[0]
    expected = torch.log_softmax(logits[len(prompt) - 1 :].float(), dim=-1)
    assert result.logprobs is not None and len(result.logprobs) == 12
    for position, (token, record) in enumerate(zip(result.token_ids, result.logprobs, strict=True)):
        assert record.token_id == token and record.top_token_ids[0] == token
        assert len(record.top_token_ids) == len(record.top_logprobs) == 3
        top = torch.topk(expected[position], 3)
        assert record.top_token_ids == top.indices.tolist()
        assert record.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-4)
        assert record.logprob == pytest.approx(float(expected[position, token]), abs=1e-4)


def test_unset_sampling_fields_follow_the_models_generation_config(
    executor: str, reference: Reference, tmp_path: Path
) -> None:
    """A model whose generation_config.json asks for greedy decoding and 6 new tokens: a request
    that sets neither gets exactly that; one that sets them gets its own."""
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.0, "max_new_tokens": 6}')
    prompt = [5, 9, 13, 17, 21, 25, 29]
    with start_scheduler(executor, generation_config=tmp_path) as address:
        with Client(address) as client:
            defaults = client.model_info().sampling_defaults
            unset = client.generate(prompt_token_ids=prompt, ignore_eos=True)
            own = client.generate(prompt_token_ids=prompt, ignore_eos=True, max_tokens=9, temperature=0)
    assert (defaults.temperature, defaults.max_tokens) == (0.0, 6)
    assert defaults.source == str(tmp_path / "generation_config.json")
    assert unset.token_ids == reference(prompt, 6) and unset.finish_reason == "length"
    assert own.token_ids == reference(prompt, 9)


def _prompt_expected(reference: Reference, prompt: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every prompt position but the last: row i scores token i+1."""
    with torch.inference_mode():
        logits = reference.model(torch.tensor([prompt])).logits[0]
    return torch.log_softmax(logits[:-1].float(), dim=-1)


def _assert_scores(records: list, prompt: list[int], expected: torch.Tensor, alternatives: int) -> None:  # type: ignore[type-arg]
    assert [record.token_id for record in records] == prompt[1:]
    for position, record in enumerate(records):
        assert record.logprob == pytest.approx(float(expected[position, prompt[position + 1]]), abs=1e-4)
        top = torch.topk(expected[position], alternatives)
        assert record.top_token_ids == top.indices.tolist()
        assert record.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-4)


def test_prompt_logprobs_score_the_prompt_as_transformers_does_chunked_cached_or_alone(
    executor: str, reference: Reference
) -> None:
    """Each prompt token after the first gets its logprob given the tokens before it, and the
    most likely alternatives: with max_tokens 0 (the prompt alone, finish reason length), beside
    generated tokens and their logprobs, in prefill chunks of 16 tokens, and for a prompt whose
    blocks another request left in the prefix cache."""
    prompt = list(range(100, 161))
    expected = _prompt_expected(reference, prompt)
    with start_scheduler(executor, max_num_batched_tokens=16) as address, Client(address) as client:
        cached = client.generate(prompt_token_ids=prompt, max_tokens=2, temperature=0, ignore_eos=True)
        alone = client.generate(prompt_token_ids=prompt, max_tokens=0, prompt_logprobs=2)
        beside = client.generate(
            prompt_token_ids=prompt, max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=0, logprobs=1
        )
    assert cached.prompt_logprobs is None and cached.usage is not None
    assert alone.token_ids == [] and alone.finish_reason == "length" and alone.logprobs is None
    assert alone.prompt_logprobs is not None
    _assert_scores(alone.prompt_logprobs, prompt, expected, 2)
    assert beside.token_ids == reference(prompt, 4)
    assert beside.prompt_logprobs is not None and beside.logprobs is not None and len(beside.logprobs) == 4
    _assert_scores(beside.prompt_logprobs, prompt, expected, 0)
    assert [record.token_id for record in beside.logprobs] == beside.token_ids
