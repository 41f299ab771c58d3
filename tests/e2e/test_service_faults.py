"""Faults a user would meet: bad requests get a status code that says what is wrong and never
disturb other requests; an executor killed mid-generation loses no request and no token."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from clients import AsyncClient, Client
from clients.errors import SplitserveError
from protos.splitserve.v1.generation_pb2 import EXECUTOR_STATE_UP
from tests.helpers.executor_kill import stream_through_executor_kill
from tests.helpers.executor_process import start_executor
from tests.helpers.greedy_client import workload
from tests.helpers.greedy_reference import Reference
from tests.helpers.model_factory import VOCAB_SIZE, build_model
from tests.helpers.scheduler_process import start_scheduler

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model("llama", tmp_path_factory.mktemp("faults") / "llama", seed=11)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Reference:
    return Reference(model_dir)


@pytest.fixture(scope="module")
def service(model_dir: Path) -> Iterator[str]:
    with start_executor(model_dir, num_kv_blocks=64, block_size=16, max_model_len=256) as (executor, _):
        with start_scheduler(executor) as address:
            yield address


@pytest.mark.parametrize(
    ("arguments", "code", "message"),
    [
        ({"prompt": "hello"}, grpc.StatusCode.FAILED_PRECONDITION, "no tokenizer"),
        ({"prompt_token_ids": [5, VOCAB_SIZE + 3]}, grpc.StatusCode.INVALID_ARGUMENT, "outside the vocabulary"),
        ({"prompt_token_ids": [5], "temperature": -1.0}, grpc.StatusCode.INVALID_ARGUMENT, "temperature must be >= 0"),
        ({"prompt_token_ids": [5], "top_p": 1.5}, grpc.StatusCode.INVALID_ARGUMENT, "top_p must be in (0, 1]"),
        ({"prompt_token_ids": [5], "logprobs": 1000}, grpc.StatusCode.INVALID_ARGUMENT, "logprobs must be at most"),
        ({"prompt_token_ids": [5], "stop": ["x"]}, grpc.StatusCode.INVALID_ARGUMENT, "stop strings need a tokenizer"),
        ({"prompt_token_ids": [7] * 300}, grpc.StatusCode.INVALID_ARGUMENT, "maximum model length of 256"),
    ],
)
def test_bad_requests_are_refused_with_a_status_that_says_why(
    service: str, arguments: dict[str, object], code: grpc.StatusCode, message: str
) -> None:
    with Client(service) as client, pytest.raises(SplitserveError) as error:
        client.generate(max_tokens=4, **arguments)
    assert error.value.code == code
    assert message in error.value.details


def test_a_duplicate_id_is_refused_while_the_first_request_runs_undisturbed(
    service: str, reference: Reference
) -> None:
    prompt = [9, 8, 7, 6, 5]

    async def scenario() -> tuple[list[int], SplitserveError | None]:
        tokens: list[int] = []
        refused = None
        async with AsyncClient(service) as client:
            deltas = client.stream(prompt_token_ids=prompt, max_tokens=200, temperature=0, ignore_eos=True, request_id="dup")
            async for delta in deltas:
                if not tokens:
                    try:
                        await client.generate(prompt_token_ids=[1], max_tokens=2, request_id="dup")
                    except SplitserveError as error:
                        refused = error
                tokens.extend(delta.token_ids)
        return tokens, refused

    tokens, refused = asyncio.run(scenario())
    assert refused is not None and refused.code == grpc.StatusCode.ALREADY_EXISTS
    assert tokens == reference(prompt, 200)


def test_an_executor_killed_mid_generation_loses_no_request_and_no_token(
    model_dir: Path, reference: Reference
) -> None:
    """SIGKILL the executor while 12 streams are running, start a fresh one on the same address:
    the scheduler recomputes from the tokens already streamed and every client gets exactly the
    tokens an undisturbed run would have given."""
    jobs = [(prompt, 48) for prompt, _ in workload(12, seed=5)]
    outputs, status = stream_through_executor_kill(model_dir, jobs, num_kv_blocks=256, block_size=16)
    for (prompt, max_tokens), output in zip(jobs, outputs, strict=True):
        assert output == reference(prompt, max_tokens)
    assert status.executors[0].state == EXECUTOR_STATE_UP
    assert status.num_preemptions >= 1
    assert status.kv_blocks_free == status.kv_blocks_total == 256
